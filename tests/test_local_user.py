"""Another user on the same machine (issue 11, item 4: "local workers nobody else reaches").

Each test plays that user for real: a process run as `nobody` (with `setpriv`), speaking to
what this user's processes made (a spawned worker, a mount folder) with nothing but the
standard library, as an attacker on a shared login node would. They need root to become
`nobody`, and skip where the suite is not root.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import fabric_nodes
import pytest
from conftest import SETPRIV, WORKER
from fabric_nodes import Add

from somatize import Broker, ProtocolError, Refused, Worker
from somatize.fabric import mount
from somatize.fabric.broker.spawn import Child
from somatize.wire import Hello, Mounted, Provision, Ready, Runtime, decode, encode

# The attacker's client: ZMTP 3.0 (NULL) by hand, standard library only, so that it runs on
# any Python `nobody` may execute. It connects, sends the messages given on stdin, and
# prints what it got back as JSON.
ZMTP_ATTACKER = r"""
import json, socket, sys
spec = json.loads(sys.stdin.read())
def out(**said):
    print(json.dumps(said)); sys.exit(0)
address = spec["address"]
try:
    if address.startswith("ipc://"):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); s.settimeout(3); s.connect(address[6:])
    else:
        host, port = address.split("://")[1].rsplit(":", 1)
        s = socket.create_connection((host, int(port)), timeout=3)
except OSError as exc:
    out(connected=False, why=f"{type(exc).__name__}: {exc}")
def exact(n):
    got = b""
    while len(got) < n:
        part = s.recv(n - len(got))
        if not part:
            raise EOFError("the worker closed the connection")
        got += part
    return got
def frame(flags, body):
    if len(body) > 255:
        return bytes([flags | 2]) + len(body).to_bytes(8, "big") + body
    return bytes([flags, len(body)]) + body
def next_frame():
    flags = exact(1)[0]
    return flags, exact(int.from_bytes(exact(8 if flags & 2 else 1), "big"))
def next_message():
    parts = []
    while True:
        flags, body = next_frame()
        if flags & 4:
            continue  # a command (a heartbeat), not a message
        parts.append(body)
        if not flags & 1:
            return parts
answers = []
try:
    s.sendall(b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + b"\0" * 32)
    exact(64)
    s.sendall(frame(4, b"\x05READY\x0bSocket-Type" + (6).to_bytes(4, "big") + b"DEALER"))
    next_frame()
    for message in spec["messages"]:
        parts = [bytes.fromhex(p) for p in message]
        for i, part in enumerate(parts):
            s.sendall(frame(1 if i < len(parts) - 1 else 0, part))
        answers.append([p.hex() for p in next_message()])
except (OSError, EOFError) as exc:
    out(connected=True, answers=answers, why=f"{type(exc).__name__}: {exc}")
out(connected=True, answers=answers)
"""

# The attacker at a mount folder: each attempt, and what came of it.
FOLDER_ATTACKER = r"""
import json, os, sys
spec = json.loads(sys.stdin.read())
folder, tried = spec["folder"], {}
def attempt(what, action):
    try:
        action(); tried[what] = "done"
    except OSError as exc:
        tried[what] = type(exc).__name__
attempt("list", lambda: os.listdir(folder))
for path in spec["cargo"]:
    attempt("read " + os.path.basename(path), lambda: open(path, "rb").read())
attempt("plant a link", lambda: os.symlink(spec["target"], os.path.join(folder, spec["name"])))
attempt("plant a file", lambda: open(os.path.join(folder, "planted"), "w").close())
print(json.dumps(tried))
"""


@pytest.fixture
def as_nobody(python_for_nobody):
    """Run a script as `nobody`, with ``spec`` as JSON on stdin; return what it printed."""

    def run(script: str, spec: dict, *, as_me: bool = False) -> dict:
        argv = [python_for_nobody, "-c", script] if as_me else [*SETPRIV, python_for_nobody, "-c", script]
        done = subprocess.run(argv, input=json.dumps(spec), capture_output=True, text=True, cwd="/", timeout=30)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    return run


@pytest.fixture
def open_base():
    """A folder others may enter (0755) but not write, like a home directory or /dev/shm/you."""
    base = Path(tempfile.mkdtemp(prefix="somatize-local-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    base.chmod(0o755)
    yield base
    shutil.rmtree(base, ignore_errors=True)


class Gadget:
    """A pickle that creates a file when it is loaded."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _tcp_listeners(pid: int) -> list[str]:
    """The TCP sockets process ``pid`` listens on, as /proc/net/tcp shows them to anyone."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if os.path.exists(table):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    found.append(fields[1])
    return found


def test_another_user_cannot_reach_a_spawned_worker_to_run_a_pickle(as_nobody, tmp_path):
    """Attack: "Any local user runs code as you". A notebook's spawned network-mode worker
    used to listen on 127.0.0.1 with no keys: `nobody` read its port from /proc/net/tcp and
    sent Hello + Provision of a gadget pickle, which ran as the notebook's user. Now the
    worker listens on an ipc socket in a 0700 folder: no port to find, and `nobody`'s
    connect is refused by the kernel, even knowing the exact address."""
    sentinel = tmp_path / "pwned-by-nobody"
    artifact = pickle.dumps(Gadget(str(sentinel)))
    hello = encode(Hello(Runtime.here(mode="network")))
    provision = encode(Provision("sha256:" + hashlib.sha256(artifact).hexdigest(), artifact))
    with Broker.embedded({"w1": Worker.spawn(WORKER, send=[fabric_nodes])}) as broker:
        assert Add().named("a").at("w1").forward(1, broker=broker) == 2
        child = broker._server.children["w1"]
        assert _tcp_listeners(child.process.pid) == []  # nothing for anyone to find in /proc/net/tcp

        attack = as_nobody(
            ZMTP_ATTACKER,
            {"address": child.address, "messages": [[bytes(f).hex() for f in m] for m in (hello, provision)]},
        )
        assert attack["connected"] is False, attack
        assert "PermissionError" in attack["why"]

        # the same client run as this user is answered: the kernel stopped `nobody`, not a bug
        # in the attacker's ZMTP (a Hello only: the gadget is never sent to the real worker)
        control = as_nobody(
            ZMTP_ATTACKER, {"address": child.address, "messages": [[bytes(f).hex() for f in hello]]}, as_me=True
        )
        assert control["connected"] is True and len(control["answers"]) == 1, control
        assert isinstance(decode([bytes.fromhex(p) for p in control["answers"][0]]), Ready)
        assert Add().named("a").at("w1").forward(2, broker=broker) == 3  # still serving its client
    assert not sentinel.exists()


def test_a_spawned_worker_leaves_no_socket_folder_behind_even_when_killed():
    """Attack surface left behind: the private socket folder of a spawned worker is removed
    when it stops, and when it was SIGKILLed (the worker itself then removes nothing)."""
    for ending in ("stop", "kill -9"):
        child = Child("w1", tuple(WORKER), mode="network", mount=None)
        address = child.start()
        folder = Path(address[len("ipc://") :]).parent
        info = folder.stat()
        assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.geteuid()
        if ending == "stop":
            child.stop()
        else:
            os.kill(child.process.pid, signal.SIGKILL)
            child.process.wait(10)
            assert folder.exists()  # nobody tidied up: the parent does, on the next stop or start
            child.kill()
        assert not folder.exists(), ending


def test_another_user_can_neither_read_cargo_nor_plant_a_link_in_a_mount_folder(as_nobody, open_base):
    """Attack: "mount cargo is 0644" and "a symlink planted in a mount folder makes the
    worker read any file its user can". A mount folder that did not exist is made 0700 and
    cargo files 0600; in a folder this user made 0755 (`mkdir` with the usual umask) the
    cargo still cannot be read, and `nobody` can plant nothing in either."""
    secret = b"the notebook's data " * 100
    for folder in (open_base / "made-by-mount", open_base / "made-by-you"):
        if folder.name == "made-by-you":
            folder.mkdir(mode=0o755)
        _, made = mount.write([b"header", secret, secret], folder)
        assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in made)
        if folder.name == "made-by-mount":
            assert stat.S_IMODE(folder.stat().st_mode) == 0o700
        tried = as_nobody(
            FOLDER_ATTACKER,
            {
                "folder": str(folder),
                "cargo": [str(p) for p in made],
                "target": "/etc/shadow",
                "name": made[0].name + "0",
            },
        )
        assert all(tried[f"read {p.name}"] == "PermissionError" for p in made), tried
        assert tried["plant a link"] == tried["plant a file"] == "PermissionError", tried
        assert not (folder / "planted").exists() and not (folder / (made[0].name + "0")).exists()
        mount.remove(made)


def test_a_mount_folder_others_may_write_in_or_owned_by_another_user_is_refused(as_nobody, open_base):
    """Attack: a symlink planted in a shared mount folder (`mount="/dev/shm/cargo"` made
    world-writable, as `/dev/shm` itself is). `nobody` plants a link under a name the mount
    makes, pointing at a file only this user may read; such a folder is now refused before
    anything is read or written, at the declaration and at use, and so is a folder
    `nobody` owns."""
    secret = open_base / "secret"
    secret.write_text("root's eyes only")
    secret.chmod(0o600)
    loose = open_base / "loose"
    loose.mkdir()
    loose.chmod(0o777)
    name = f"{os.getpid()}-{'ab' * 16}-0"
    tried = as_nobody(FOLDER_ATTACKER, {"folder": str(loose), "cargo": [], "target": str(secret), "name": name})
    assert tried["plant a link"] == "done"  # the folder let it in
    with pytest.raises(ProtocolError, match=r"writable by group and others \(mode 0777\).*chmod 700"):
        mount.read(Mounted((name,), header=b"header"), loose)
    with pytest.raises(Refused, match="writable by group and others"):
        mount.write([b"header", b"cargo"], loose)
    with pytest.raises(ValueError, match="writable by group and others"):
        Worker.spawn(WORKER, mount=str(loose))

    theirs = open_base / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 65534, 65534)
    with pytest.raises(Refused, match=r"belongs to user 65534, not to you"):
        mount.write([b"header", b"cargo"], theirs)
    with pytest.raises(ValueError, match=r"belongs to user 65534"):
        Worker.spawn(WORKER, mount=str(theirs))


def test_a_link_or_a_strange_file_named_in_a_mounted_message_is_never_followed(tmp_path):
    """Attack: a symlink planted in a mount folder, by someone who could write there (played
    here by this user, as the folder admits nobody else). `mount.read` opens with
    O_NOFOLLOW and checks what it opened: a link, a FIFO, a file with a second name and
    another user's file are each a ProtocolError naming the file, and nothing is read."""
    folder = tmp_path / "cargo"
    _, made = mount.write([b"header", b"real cargo"], folder)
    secret = tmp_path / "secret"
    secret.write_bytes(b"a CURVE secret key")
    stem = made[0].name[:-2]

    def refused(suffix: str, plant, match: str) -> None:
        name = f"{stem}-{suffix}"
        plant(folder / name)
        with pytest.raises(ProtocolError, match=match) as info:
            mount.read(Mounted((made[0].name, name), header=b"header"), folder)
        assert "a CURVE secret" not in str(info.value)

    refused("1", lambda p: p.symlink_to(secret), r"`.*-1` in .* is a symbolic link: cargo is never read through a link")
    refused("2", lambda p: p.symlink_to(tmp_path / "nothing-there"), r"is a symbolic link")
    refused("3", os.mkfifo, r"is not a regular file")  # and the read did not hang on it
    refused("4", lambda p: os.link(secret, p), r"has 2 links")

    def theirs(path: Path) -> None:
        path.write_bytes(b"from another user")
        os.chown(path, 65534, 65534)

    if os.geteuid() == 0:
        refused("5", theirs, r"belongs to user 65534")
    with pytest.raises(ProtocolError, match="not a file the mount makes"):
        mount.read(Mounted(("../secret",), header=b"header"), folder)
    frames, paths = mount.read(Mounted((made[0].name,), header=b"header"), folder)
    assert [bytes(f) for f in frames] == [b"header", b"real cargo"] and paths == made


KILLED_CLIENT = textwrap.dedent(r"""
    import sys
    from somatize.fabric import mount
    _, made = mount.write([b"header", b"x" * 1000, b"y" * 1000], sys.argv[1])
    print(" ".join(p.name for p in made), flush=True)
    sys.stdin.read()  # held until killed
""")


def test_the_cargo_of_a_killed_client_is_swept(tmp_path):
    """Attack: "mount cargo is ... left behind by a killed client". A client SIGKILLed
    mid-exchange leaves its files; the next process to use the folder, or the next spawned
    worker started on it, removes them. The cargo of a client still alive stays."""
    folder = tmp_path / "cargo"

    started: list[subprocess.Popen] = []

    def client() -> tuple[subprocess.Popen, list[str]]:
        process = subprocess.Popen(
            [sys.executable, "-c", KILLED_CLIENT, str(folder)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        started.append(process)
        return process, process.stdout.readline().split()

    killed, left = client()
    alive, kept = client()
    try:
        killed.kill()
        killed.wait(10)
        assert len(left) == 2 and all((folder / n).exists() for n in left)
        _, made = mount.write([b"header", b"mine"], folder)  # this process's first use of the folder
        assert not any((folder / n).exists() for n in left)
        assert all((folder / n).exists() for n in kept) and made[0].exists()

        again, left = client()
        again.kill()
        again.wait(10)
        child = Child("w1", tuple(WORKER), mode="network", mount=str(folder))
        try:
            child.start()  # a spawned worker started on the folder sweeps it too
        finally:
            child.stop()
        assert not any((folder / n).exists() for n in left)
        assert all((folder / n).exists() for n in kept)
    finally:
        for process in started:
            process.kill()
            process.wait(10)
            process.stdout.close()
            process.stdin.close()
