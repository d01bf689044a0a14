"""A dialed worker's folder for cargo (issue 20): a worker that dials in to a broker with
``--mount DIR`` names its folder, and a file it made there, in its Hello; a client that
finds that file sends cargo through the folder and only control through the broker. A client
that does not see the folder (another machine; here, another mount namespace) sends
everything through the broker, as before.

Real processes: a standalone broker, a dialed worker (``python -m somatize.worker``), the
client in this process; the second worker runs in a mount namespace of its own, where its
folder is a fresh tmpfs with the same name. What a peer names is only looked at: a token
with no file, a link, another user's file, a folder others may write are not the folder.
"""

from __future__ import annotations

import os
import subprocess

import numpy as np
import pytest
from conftest import BROKER, WORKER, env_with_tests
from fabric_nodes import FolderSeen
from reliability_support import wait_until

from somatize import Broker
from somatize.fabric import mount
from somatize.wire import Hello, Located, Runtime, decode, encode

BIG = np.ones(1 << 20)  # 8 MiB: a frame of its own, so it is cargo


def _hub(processes):
    return processes([*BROKER, "--listen", "tcp://127.0.0.1:0", "--announce"], env=env_with_tests())


def _worker(processes, hub, folder, *, namespace: bool = False):
    argv = [*WORKER, "--broker", hub.endpoint, "--offer", "w1", "--mode", "project", "--mount", str(folder)]
    if namespace:  # the same path, another folder: a tmpfs only this worker sees
        argv = [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            f'mount -t tmpfs -o mode=0700 none "{folder}" && exec "$@"',
            "sh",
            *argv,
        ]
    return processes(argv, env=env_with_tests(), announce=None)


def _seen_files(folder) -> list[str]:
    return [n for n in os.listdir(folder) if n.startswith("seen-")]


def test_a_dialed_worker_with_a_folder_gets_its_cargo_through_it(processes, tmp_path):
    """A dialed worker's --mount was used for nothing: every byte went through the broker."""
    folder = tmp_path / "cargo"
    hub = _hub(processes)
    worker = _worker(processes, hub, folder)
    client = Broker.at(hub.endpoint)
    try:
        wait_until(lambda: client.knows("w1"), 30, "the worker dialing in")
        assert len(_seen_files(folder)) == 1  # the worker's mark
        size, files = FolderSeen(str(folder)).at("w1").forward(BIG, broker=client)
        assert size == BIG.nbytes
        assert files >= 1, "the cargo did not go through the folder"
    finally:
        client.close()
    worker.stop()
    assert _seen_files(folder) == [], "a worker that stopped left its mark"


def test_a_client_that_does_not_see_the_folder_sends_everything_through_the_broker(processes, tmp_path):
    folder = tmp_path / "cargo"
    folder.mkdir(mode=0o700)
    hub = _hub(processes)
    _worker(processes, hub, folder, namespace=True)
    client = Broker.at(hub.endpoint)
    try:
        wait_until(lambda: client.knows("w1"), 30, "the worker dialing in")
        size, files = FolderSeen(str(folder)).at("w1").forward(BIG, broker=client)
        assert (size, files) == (BIG.nbytes, 0)  # nothing in the worker's folder: all relayed
        assert os.listdir(folder) == [], "the client wrote into a folder the worker does not see"
    finally:
        client.close()


def test_what_a_peer_names_is_the_folder_only_when_this_process_finds_the_file(tmp_path):
    folder = tmp_path / "cargo"
    token = mount.mark(folder)
    assert mount.sees(str(folder), token)
    assert not mount.sees(str(folder), f"{os.getpid()}-{'0' * 32}")  # a token with no file
    assert not mount.sees("cargo", token)  # a relative path
    assert not mount.sees(str(folder), "../../etc/passwd")
    mount.unmark(folder, token)
    # a link where the file should be, even to a file of ours: not followed
    target = tmp_path / "ours"
    target.write_bytes(b"")
    (folder / f"seen-{token}").symlink_to(target)
    assert not mount.sees(str(folder), token)
    (folder / f"seen-{token}").unlink()
    # another user's file
    (folder / f"seen-{token}").write_bytes(b"")
    os.chown(folder / f"seen-{token}", 65534, 65534)
    assert not mount.sees(str(folder), token)
    os.chown(folder / f"seen-{token}", os.geteuid(), os.getegid())
    assert mount.sees(str(folder), token)
    # a folder others may write in
    os.chmod(folder, 0o777)
    assert not mount.sees(str(folder), token)
    os.chmod(folder, 0o700)
    # a folder of another user's
    subprocess.run(["chown", "nobody", str(folder)], check=True)
    assert not mount.sees(str(folder), token)


def test_the_wire_says_what_a_folder_and_its_token_must_be():
    rt = Runtime.here(mode="project")
    token = f"{os.getpid()}-{'a' * 32}"
    hello = Hello(rt, offering="w1", mount="/shared/cargo", seen=token)
    assert decode(encode(hello)) == hello
    for bad, says in (
        (Hello(rt, mount="/x", seen=token), "offers no host"),
        (Hello(rt, offering="w1", seen=token), "names none"),
        (Hello(rt, offering="w1", mount="/x", seen="x" * 32), "a file's token"),
    ):
        with pytest.raises(ValueError, match=says):
            encode(bad)
    relayed = Located("w1", "relayed", address="tcp://127.0.0.1:1", mode="project", mount="/shared/cargo", seen=token)
    assert decode(encode(relayed)) == relayed
    with pytest.raises(ValueError, match="names none"):
        encode(Located("w1", "direct", address="tcp://127.0.0.1:1", mode="project", seen=token))
    with pytest.raises(ValueError, match="only for"):
        encode(Located("w1", "inprocess", mount="/shared/cargo", seen=token))


def test_the_mark_of_a_killed_worker_is_swept_like_its_cargo(tmp_path):
    folder = tmp_path / "cargo"
    token = mount.mark(folder)
    stale = f"seen-{_dead_pid()}-{token.split('-', 1)[1]}"  # a worker of this machine that ended
    (folder / stale).write_bytes(b"")
    assert stale in mount.sweep(folder)
    assert _seen_files(folder) == [f"seen-{token}"]  # ours, alive, stays


def test_the_cargo_of_a_killed_client_not_yet_reaped_is_swept(tmp_path):
    """A spawned worker sweeps the moment its client dies (it is reparented then), before the
    client's parent has reaped it: a zombie's cargo is a dead client's, or it stays in memory."""
    folder = tmp_path / "cargo"
    token = mount.mark(folder)
    child = subprocess.Popen(["sleep", "60"])
    try:
        child.kill()
        wait_until(lambda: _state(child.pid) == "Z", 10, "the killed child becoming a zombie")
        cargo = f"{child.pid}-{token.split('-', 1)[1]}-0"  # a file of the zombie's, as `write` names them
        assert mount.NAME.fullmatch(cargo)
        (folder / cargo).write_bytes(b"x")
        assert cargo in mount.sweep(folder)
        assert _seen_files(folder) == [f"seen-{token}"]  # ours, alive, stays
    finally:
        child.wait(10)


def _state(pid: int) -> str:
    line = open(f"/proc/{pid}/stat", "rb").read()
    return line[line.rfind(b")") + 2 : line.rfind(b")") + 3].decode()


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid
