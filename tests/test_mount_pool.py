"""The Mount path on one machine: pooled, pre-faulted shared-memory segments with leases.

Real spawned workers, real segments in ``/dev/shm``; every test counts the files left in
its folder. See :mod:`somatize.fabric.leases` for who creates, attaches, acknowledges and
unlinks.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import fabric_nodes
import msgpack
import numpy as np
import pytest
from cargo_support import proved, sealed
from conftest import BROKER, WORKER, env_with_tests
from fabric_nodes import Scale
from reliability_support import wait_until

from somatize import Broker, Node, NodeFailed, SomatizeError, Worker
from somatize.fabric import leases, mount
from somatize.fabric.client import lending as client_pool
from somatize.packing import Packer
from somatize.wire import WIRE_VERSION, Done, Mounted, Recipe, Refusal, Work, decode, encode

SHM = Path("/dev/shm")
pytestmark = pytest.mark.skipif(not SHM.is_dir() or not leases.in_memory(SHM), reason="needs /dev/shm on tmpfs")


@pytest.fixture
def folder(tmp_path):
    """A fresh mount folder in /dev/shm, removed after (with whatever is left in it)."""
    made = SHM / f"somatize-test-{os.getpid()}-{tmp_path.name}"
    yield made
    if made.exists():
        for p in made.iterdir():
            p.unlink()
        made.rmdir()


def files(folder: Path) -> list[str]:
    return sorted(os.listdir(folder)) if folder.exists() else []


def spawned(folder: Path, **options) -> Broker:
    return Broker.embedded(
        {
            "w1": Worker.spawn(
                WORKER, mode="network", send=[fabric_nodes, sys.modules[__name__]], mount=str(folder), **options
            )
        }
    )


class Echo(Node):
    def forward(self, x):
        return x


class Keep(Node):
    """Keeps a view of its input past the call (as a cache might)."""

    held: list = []

    def forward(self, x):
        Keep.held.append(x[1:])
        return float(x[:4].sum())


class Hold(Node):
    """Says it started (with its pid), then waits for a file that never comes."""

    def __init__(self, started: str) -> None:
        self.started = started

    def forward(self, x):
        Path(self.started).write_text(str(os.getpid()))
        time.sleep(60)
        return x


# -- the round trip ----------------------------------------------------------------------------


def test_arrays_cross_through_pooled_segments_and_the_pool_is_reused(folder):
    x = np.arange(600_000, dtype=np.float32).reshape(600, 1000)[:, ::2]  # not contiguous
    with spawned(folder) as broker:
        g = Scale(3.0).named("scale").at("w1")
        out = g.forward(x, broker=broker)
        np.testing.assert_array_equal(out, x * 3.0)
        assert out.flags.writeable  # a copy: the segment went back to the pool
        pool = client_pool.pool(folder)
        after_first = files(folder)
        made = pool.made
        for _ in range(5):
            np.testing.assert_array_equal(g.forward(x, broker=broker), x * 3.0)
        assert files(folder) == after_first, "a repeated call made new segments"
        assert pool.made == made
        several = (np.ones(3, np.int8), np.zeros((0, 4)), np.arange(10.0), b"bytes")
        back = Echo().named("echo").at("w1").forward(several, broker=broker)
        assert [np.asarray(a).tolist() for a in back[:3]] == [np.asarray(a).tolist() for a in several[:3]]
        assert back[3] == b"bytes"
    assert files(folder) == [], "a closed broker left idle segments behind"


def test_a_big_array_crosses_and_a_repeated_call_makes_nothing_new(folder):
    big = np.random.default_rng(0).integers(0, 255, 48 << 20, dtype=np.uint8)
    with spawned(folder) as broker:
        g = Scale(1).named("same").at("w1")
        np.testing.assert_array_equal(g.forward(big, broker=broker), big)
        pool = client_pool.pool(folder)
        made, adopted, there = pool.made, pool.adopted, files(folder)
        np.testing.assert_array_equal(g.forward(big, broker=broker), big)
        assert (pool.made, pool.adopted, files(folder)) == (made, adopted, there)
    assert files(folder) == []


def test_a_node_returning_its_input_sends_it_back_without_a_copy(folder):
    x = np.arange(1 << 18, dtype=np.float64)
    with spawned(folder, views=True) as broker:
        out = Echo().named("echo").at("w1").forward(x, broker=broker)
        np.testing.assert_array_equal(out, x)
        pool = client_pool.pool(folder)
        # one segment made (the request's), none adopted from the worker, no spare offered:
        # the answer is a span of the request's own segment
        assert (pool.made, pool.adopted) == (1, 0)
        (seg,) = pool.known.values()
        start, length = leases.address_of(out)
        base = leases.address_of(seg.view)[0]
        assert base <= start and start + length <= base + seg.size
        assert not out.flags.writeable
        del out
        gc.collect()
    assert files(folder) == []


def test_a_node_keeping_its_input_has_that_segment_retired_never_reused(folder):
    x = np.arange(1 << 16, dtype=np.float32)
    with spawned(folder) as broker:
        g = Keep().named("keep").at("w1")
        assert g.forward(x, broker=broker) == 6.0
        pool = client_pool.pool(folder)
        assert files(folder) == [] and not pool.known, "a kept segment is still in the pool"
        assert g.forward(x, broker=broker) == 6.0
        assert pool.made == 2, "the kept segment was used again"
        e = Echo().named("echo").at("w1")
        np.testing.assert_array_equal(e.forward(x, broker=broker), x)
    assert files(folder) == []


def test_a_node_that_raises_lets_go_of_its_input_and_the_segment_is_reused(folder):
    with spawned(folder) as broker:
        g = fabric_nodes.Boom().named("boom").at("w1")
        for _ in range(3):
            with pytest.raises(NodeFailed):
                g.forward(np.ones(10_000), broker=broker)
        pool = client_pool.pool(folder)
        assert pool.made == 1, "a failed call's segment was retired as if a node kept it"
    assert files(folder) == []


def test_views_hold_their_segment_until_the_last_is_freed(folder):
    x = np.arange(100_000, dtype=np.int64)
    with spawned(folder, views=True) as broker:
        g = Scale(2).named("scale").at("w1")
        out = g.forward(x, broker=broker)
        np.testing.assert_array_equal(out, x * 2)
        assert not out.flags.writeable
        pool = client_pool.pool(folder)
        held = [s for s in pool.known.values() if s.holds]
        assert len(held) == 1 and held[0].name not in pool.free
        part = out[10:20]
        del out
        gc.collect()
        pool.collect()
        assert held[0].holds == 1 and held[0].name not in pool.free  # a view of the view holds it too
        del part
        gc.collect()
        pool.collect()
        assert held[0].holds == 0 and held[0].name in pool.free
        np.testing.assert_array_equal(g.forward(x, broker=broker), x * 2)
    assert files(folder) == []


def test_two_workers_and_two_threads_share_one_pool_without_crossing_answers(folder):
    send = [fabric_nodes, sys.modules[__name__]]
    hosts = {h: Worker.spawn(WORKER, mode="network", send=send, mount=str(folder)) for h in ("w1", "w2")}
    wrong: list = []
    with Broker.embedded(hosts) as broker:

        def calls(host: str, base: int) -> None:
            g = Scale(2).named(f"scale-{host}").at(host)
            for i in range(8):
                x = np.full(50_000 + 1000 * i, base + i, dtype=np.int64)
                out = g.forward(x, broker=broker)
                if out.shape != x.shape or not (out == 2 * (base + i)).all():
                    wrong.append((host, i))

        threads = [threading.Thread(target=calls, args=(h, 100 * n)) for n, h in enumerate(hosts)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not wrong
        assert len(files(folder)) <= client_pool.IDLE_COUNT
    assert files(folder) == []


def test_a_client_of_a_standalone_broker_asks_for_views_by_host_name(processes, folder, tmp_path):
    worker = processes([*WORKER, "--listen", "127.0.0.1:0", "--announce", "--mount", str(folder)], env=env_with_tests())
    table = tmp_path / "hosts.toml"
    table.write_text(f'[hosts.w1]\naddress = "{worker.endpoint}"\nmount = "{folder}"\n')
    hub = processes([*BROKER, "--listen", "tcp://127.0.0.1:0", "--hosts", str(table), "--announce"])
    x = np.arange(10_000.0)
    with Broker.at(hub.endpoint, views=["w1"]) as broker:
        out = Scale(2.0).named("scale").at("w1").forward(x, broker=broker)
        np.testing.assert_array_equal(out, x * 2.0)
        assert not out.flags.writeable  # a view of the segment the answer came in
        del out
        gc.collect()
    assert files(folder) == []


# -- either side killed ------------------------------------------------------------------------


def cargo(kind: str):
    """1 MiB of NumPy array or torch tensor (skipped where torch is not installed)."""
    if kind == "torch":
        torch = pytest.importorskip("torch")
        return torch.ones(1 << 18, dtype=torch.float32)
    return np.ones(1 << 20, np.uint8)


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_a_worker_killed_mid_exchange_leaves_no_segment(folder, tmp_path, kind):
    started = tmp_path / "started"
    x = cargo(kind)
    with spawned(folder) as broker:
        killer = threading.Thread(
            target=lambda: os.kill(
                int(wait_until(lambda: started.exists() and started.read_text(), 30, "the node starting")),
                signal.SIGKILL,
            ),
            daemon=True,
        )
        killer.start()
        with pytest.raises(SomatizeError):  # the worker was killed under it: Broken
            Hold(str(started)).named("hold").at("w1").forward(x, broker=broker)
        killer.join(10)
        assert files(folder) == [], "the client did not retire what it lent a dead worker"
    assert files(folder) == []


CLIENT = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import numpy as np
    from somatize import Broker, Node, NodeFailed, Worker

    class Hold(Node):
        def __init__(self, started):
            self.started = started
        def forward(self, x):
            import os
            Path(self.started).write_text(str(os.getpid()))
            time.sleep(60)
            return x

    folder, started, kind = sys.argv[1], sys.argv[2], sys.argv[3]
    if kind == "torch":
        import torch
        x = torch.ones(1 << 18, dtype=torch.float32)
    else:
        x = np.ones(1 << 20, np.uint8)
    if len(sys.argv) > 4:  # a worker listening there, not this process's child
        declared = Worker.at(sys.argv[4], mode="network", mount=folder)
    else:
        declared = Worker.spawn([sys.executable, "-m", "somatize.worker"], mount=folder)
    broker = Broker.embedded({"w1": declared})
    Hold(started).named("hold").at("w1").forward(x, broker=broker)
    """
)


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_a_client_killed_mid_exchange_leaves_no_segment(folder, tmp_path, kind):
    """Its spawned worker, stuck in a node, ends with it and removes what it lent: nothing
    of a SIGKILLed notebook stays in memory, with no later client to sweep the folder."""
    cargo(kind)  # skips where torch is not installed
    started = tmp_path / "started"
    client = subprocess.Popen([sys.executable, "-c", CLIENT, str(folder), str(started), kind], env=env_with_tests())
    worker_pid = None
    try:
        worker_pid = int(wait_until(lambda: started.exists() and started.read_text(), 60, "the node starting"))
        assert files(folder), "the request's segment is not in the folder"
        client.send_signal(signal.SIGKILL)
        client.wait(10)
        wait_until(lambda: files(folder) == [], 30, "the worker removing its dead client's segments")
    finally:
        if client.poll() is None:
            client.kill()
            client.wait(10)
        if worker_pid is not None:
            try:
                os.kill(worker_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            wait_until(
                lambda: (
                    not Path(f"/proc/{worker_pid}").exists()
                    or "zombie" in Path(f"/proc/{worker_pid}/status").read_text().lower()
                ),
                10,
                "the worker ending",
            )
    assert files(folder) == []


def test_a_listening_worker_removes_the_segments_of_a_client_killed_mid_exchange(processes, folder, tmp_path):
    folder.mkdir(mode=0o700)
    worker = processes([*WORKER, "--listen", "127.0.0.1:0", "--announce", "--mode", "network", "--mount", str(folder)])
    started = tmp_path / "started"
    client = subprocess.Popen(
        [sys.executable, "-c", CLIENT, str(folder), str(started), "numpy", worker.endpoint], env=env_with_tests()
    )
    try:
        wait_until(lambda: started.exists() and started.read_text(), 60, "the node starting")
        assert files(folder), "the request's segment is not in the folder"
        client.send_signal(signal.SIGKILL)
        client.wait(10)
        # the worker is still in the node, serving through its stand-in, and no client comes
        wait_until(lambda: files(folder) == [], 30, "the worker removing its dead client's segments")
        assert worker.alive
    finally:
        if client.poll() is None:
            client.kill()
            client.wait(10)


# -- hostile requests ----------------------------------------------------------------------------


class Raw:
    """A client speaking the wire by hand on one DEALER."""

    def __init__(self, endpoint: str) -> None:
        import zmq

        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.connect(endpoint)

    def ask(self, frames, timeout: float = 20.0):
        self.sock.send_multipart(list(frames))
        assert self.sock.poll(int(timeout * 1000)), "no answer"
        return decode(self.sock.recv_multipart())

    def close(self) -> None:
        self.sock.close(0)


def test_hostile_spans_and_names_are_refused_and_the_worker_keeps_serving(processes, folder):
    worker = processes([*WORKER, "--listen", "127.0.0.1:0", "--announce", "--mount", str(folder)], env=env_with_tests())
    raw = Raw(worker.endpoint)
    pool = client_pool.pool(folder)
    scale = Packer("project").spec(Scale(2.0).named("scale").steps[0])
    x = np.arange(1000, dtype=np.float64)
    work = encode(Work(1, Recipe((scale,), ("step", 0)), x, watched=False))
    me = f"{os.getpid()}-{mount._tag()}"
    try:
        key = proved(raw.ask, folder)  # cargo goes only to a worker that proved it sees the folder
        lending = client_pool.Lending(pool)
        good = decode(lending.send(work, key))
        seg = good.files[0]

        def refused(msg, why: str) -> None:
            answer = raw.ask(encode(msg) if isinstance(msg, Mounted) else msg)
            assert isinstance(answer, Refusal), answer
            assert why in answer.why, answer.why

        def variant(**changes) -> Mounted:
            fields = dict(files=good.files, header=good.header, spans=good.spans, spare=good.spare, kept=())
            fields.update(changes)
            return sealed(Mounted(**fields), key)  # sealed: the check each one is about is reached

        size = pool.known[seg].size
        refused(variant(spans=((0, size - 8, 64),)), "reads up to byte")
        refused(variant(spans=((0, 32 << 30, 16 << 30),)), "reads up to byte")
        overflow = {
            "v": WIRE_VERSION,
            "t": "Mounted",
            "files": [seg],
            "spans": [[0, 0, 2**40]],
            "spare": [],
            "kept": [],
            "seal": "",
        }
        refused([msgpack.packb(overflow), bytes(good.header)], "Mounted.spans[0][2]")
        refused(variant(spare=("4242-" + "0" * 32 + "-0",)), "two different owners")
        link = f"{me}{'1' * 24}-0"
        os.symlink(folder / seg, folder / link)
        refused(variant(files=(link,)), "symbolic link")
        fifo = f"{me}{'2' * 24}-0"
        os.mkfifo(folder / fifo, 0o600)
        refused(variant(files=(fifo,)), "not a regular file")
        if os.geteuid() == 0:
            theirs = f"{me}{'3' * 24}-0"
            (folder / theirs).write_bytes(bytes(size))
            os.chmod(folder / theirs, 0o600)
            os.chown(folder / theirs, 65534, 65534)  # nobody's
            refused(variant(files=(theirs,)), "belongs to user 65534")
        # and the worker still serves, from the very same segment
        answer = raw.ask(lending.send(work, key))
        assert isinstance(answer, Mounted) and not answer.kept
        done = decode(lending.receive(answer))
        assert isinstance(done, Done)
        np.testing.assert_array_equal(done.output, x * 2.0)
        del done
        lending.end(answered=True)
    finally:
        raw.close()
        for name in files(folder):
            if not name.startswith(me) or name not in pool.known:
                (folder / name).unlink()
        pool.drain()


def test_tensors_cross_through_pooled_segments(folder):
    torch = pytest.importorskip("torch")
    t = torch.arange(1 << 16, dtype=torch.bfloat16).reshape(256, 256)
    with spawned(folder) as broker:
        back = Echo().named("echo").at("w1").forward(t, broker=broker)
        assert back.dtype == torch.bfloat16 and torch.equal(back, t)
    with spawned(folder, views=True) as broker:
        back = Echo().named("echo").at("w1").forward(t, broker=broker)
        assert torch.equal(back, t)
        del back
        gc.collect()
    assert files(folder) == []


# -- the pool and the wire, without a worker -------------------------------------------------


def test_the_pool_keeps_a_bounded_number_of_idle_segments(folder):
    pool = client_pool.pool(folder)
    lent = [pool.lease(1000) for _ in range(client_pool.IDLE_COUNT + 4)]
    assert len(files(folder)) == client_pool.IDLE_COUNT + 4
    for seg in lent:
        seg.lent = False
        pool.settle(seg)
    assert len(pool.free) == client_pool.IDLE_COUNT == len(files(folder))
    again = pool.lease(1000)
    assert again.name in {s.name for s in lent}  # reused, not made
    again.lent = False
    pool.settle(again)
    pool.drain()
    assert files(folder) == []


def test_segment_sizes_waste_at_most_an_eighth():
    assert leases.size_for(1) == leases.SMALLEST
    for need in (1 << 20, (1 << 20) + 1, 3 << 20, 256 << 20, (256 << 20) + 64, 1_000_000_007):
        size = leases.size_for(need)
        assert need <= size <= max(leases.SMALLEST, need + need // 8 + 1)


def test_mounted_spans_are_checked_before_anything_is_opened():
    name = f"{os.getpid()}-{'a' * 32}-0"
    msg = Mounted((name,), header=b"h", spans=((0, 16, 100), (0, 0, 0)), spare=(name,), kept=(name,))
    back = decode(encode(msg))
    assert (back.files, back.spans, back.spare, back.kept) == (msg.files, msg.spans, msg.spare, msg.kept)
    for bad in (
        dict(spans=((1, 0, 1),)),  # a file it does not name
        dict(spans=((0, -1, 1),)),
        dict(spans=((0, 0, (16 << 30) + 1),)),
        dict(spans=((0, 0),)),
        dict(spare=("../etc/passwd",)),
        dict(kept=(name,) * 65),
        dict(files=(), spans=((0, 0, 1),)),
    ):
        fields = dict(files=(name,), header=b"h", spans=((0, 0, 1),))
        fields.update(bad)
        with pytest.raises((ValueError, TypeError)):
            encode(Mounted(**fields))


# -- a spawned worker's default ------------------------------------------------------------------


def test_a_spawned_worker_uses_this_users_folder_in_memory_unless_told_otherwise():
    declared = Worker.spawn(WORKER, mode="network", send=[sys.modules[__name__]])
    own = mount.own_folder()
    assert declared.own_mount and own == f"/dev/shm/somatize-{os.geteuid()}"  # looked at when it starts
    assert not Worker.spawn(WORKER, mount=False).own_mount and Worker.spawn(WORKER, mount=False).mount is None
    x = np.arange(1 << 18, dtype=np.float64)  # 2 MiB: through a pooled segment
    with Broker.embedded({"w1": declared}) as broker:
        np.testing.assert_array_equal(Echo().named("echo").at("w1").forward(x, broker=broker), x)
        assert broker._rendezvous.located["w1"].path == "mount"
        mine = [n for n in os.listdir(own) if n.startswith(f"{os.getpid()}-")]
        assert mine, "the request went through a segment of this process's in that folder"
    # the last to leave the default folder removes it, when nobody else has anything there
    assert not os.path.exists(own) or [n for n in os.listdir(own) if n.startswith(f"{os.getpid()}-")] == []
    assert not os.path.exists(own) or os.listdir(own), "an empty default folder is left behind"


def test_a_default_folder_another_user_took_is_not_used(tmp_path, monkeypatch):
    if os.geteuid() != 0:
        pytest.skip("needs root to make a folder that another user owns")
    fake_shm = SHM / f"somatize-test-squat-{os.getpid()}"
    fake_shm.mkdir(mode=0o755)
    try:
        squatted = fake_shm / f"somatize-{os.geteuid()}"
        squatted.mkdir(mode=0o777)
        os.chown(squatted, 65534, 65534)  # nobody took the name first
        monkeypatch.setattr(mount, "SHM", str(fake_shm))
        assert mount.own_folder() is None
    finally:
        for p in fake_shm.iterdir():
            p.rmdir()
        fake_shm.rmdir()


def test_a_default_folder_taken_after_the_declaration_means_the_socket_never_a_failed_forward(monkeypatch, capfd):
    """The default folder is looked at when the worker starts, not when it was declared:
    another user who takes the name in between gets nothing, and the forward goes through
    the socket, with one warning."""
    if os.geteuid() != 0:
        pytest.skip("needs root to act as another user")
    fake_shm = SHM / f"somatize-test-squat-late-{os.getpid()}"
    fake_shm.mkdir()
    fake_shm.chmod(0o1777)  # like /dev/shm: anyone may make a name there
    try:
        monkeypatch.setattr(mount, "SHM", str(fake_shm))
        declared = Worker.spawn(WORKER, mode="network", send=[sys.modules[__name__]])
        assert declared.own_mount
        squatted = fake_shm / f"somatize-{os.geteuid()}"
        subprocess.run(
            [
                "setpriv",
                "--reuid",
                "nobody",
                "--regid",
                "nogroup",
                "--clear-groups",
                "mkdir",
                "-m",
                "777",
                str(squatted),
            ],
            check=True,
            timeout=30,
        )
        assert squatted.stat().st_uid != os.geteuid()
        x = np.arange(1 << 18, dtype=np.float64)  # 2 MiB: a pooled segment, had the folder been ours
        with Broker.embedded({"w1": declared}) as broker:
            for _ in range(2):
                np.testing.assert_array_equal(Echo().named("echo").at("w1").forward(x, broker=broker), x)
            assert broker._rendezvous.located["w1"].path == "direct"
        assert os.listdir(squatted) == [], "nothing of ours went into their folder"
        assert capfd.readouterr().err.count("is not this user's safe folder") == 1
    finally:
        for p in fake_shm.iterdir():
            p.rmdir()
        fake_shm.rmdir()
