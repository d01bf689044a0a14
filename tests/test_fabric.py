"""Across processes: one suite run over every path, then what is particular to each.

Everything here is real: spawned worker processes, a standalone broker process, ZeroMQ
sockets on 127.0.0.1 with ports the kernel picks, files in a shared directory.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import fabric_nodes
import numpy as np
import pytest
import zmq
from by_hand import project_worker, spec_of
from conftest import BROKER, WORKER, env_with_tests
from fabric_nodes import Add, Boom, Count, Pid, Scale, Sleep
from peers import RT, Raw

from somatize import (
    Broken,
    Broker,
    FolderStore,
    Node,
    NodeFailed,
    PlanError,
    Refused,
    Unreachable,
    Worker,
    codec,
)
from somatize.codec import forget
from somatize.fabric import sockets as fabric_sockets
from somatize.wire import Hello, Mounted, Ready, Recipe, Work, encode

PATHS = ["inprocess", "direct", "mount", "relayed"]


class Collect(list):
    def __call__(self, fact):
        self.append(fact)

    def kinds(self):
        return [f["fact"] for f in self]


def wait_for_host(broker: Broker, host: str, seconds: float = 15.0) -> None:
    until = time.monotonic() + seconds
    while not broker.knows(host):
        if time.monotonic() > until:
            raise AssertionError(f"{host} never dialed in")
        time.sleep(0.05)


@pytest.fixture(params=PATHS)
def path(request, tmp_path, processes):
    kind = request.param
    if kind == "inprocess":
        broker = Broker.embedded({"w1": Worker.inprocess()})
    elif kind == "direct":
        broker = Broker.embedded({"w1": Worker.spawn(WORKER, mode="network", send=[fabric_nodes], mount=False)})
    elif kind == "mount":
        shared = tmp_path / "shared"
        shared.mkdir()
        broker = Broker.embedded({"w1": Worker.spawn(WORKER, mode="network", send=[fabric_nodes], mount=str(shared))})
    else:
        hub = processes([*BROKER, "--listen", "tcp://127.0.0.1:0", "--announce"])
        processes([*WORKER, "--broker", hub.endpoint, "--offer", "w1", "--mode", "network"], announce=None)
        broker = Broker.at(hub.endpoint, send={"w1": [fabric_nodes]})
        wait_for_host(broker, "w1")
    broker.kind = kind
    broker.shared = tmp_path / "shared"
    with broker:
        yield broker


# -- the same suite over every path ------------------------------------------------------


def test_five_nodes_on_a_host_are_one_piece_of_work(path):
    seen = Collect()
    g = Add(1).named("local") >> (
        Add(1).named("a").at("w1")
        >> Add(1).named("b").at("w1")
        >> Add(1).named("c").at("w1")
        >> Add(1).named("d").at("w1")
        >> Add(1).named("e").at("w1")
    )
    assert g.forward(0, broker=path, watching=seen) == 6
    ran = [f for f in seen if f["fact"] == "ran"]
    assert [f["node"] for f in ran] == ["local", "a", "b", "c", "d", "e"]
    assert "host" not in ran[0]
    assert all(f["host"] == "w1" for f in ran[1:])  # the client names the host, never the worker
    left = [f for f in seen if f["fact"] == "left"]
    assert len(left) == 1 and left[0]["host"] == "w1" and left[0]["took_us"].isdigit()
    assert seen.kinds()[-1] == "finished"


def test_arrays_cross_exactly(path):
    x = np.arange(300_000, dtype=np.float32).reshape(600, 500)[:, ::2]  # not contiguous
    out = Scale(3.0).named("scale").at("w1").forward(x, broker=path)
    np.testing.assert_array_equal(out, x * 3.0)
    assert out.dtype == np.float32


def test_facts_arrive_while_the_work_is_still_going(path):
    arrived = {}

    def watch(fact):
        if fact["fact"] == "ran" and fact["node"] == "first":
            arrived["first"] = time.monotonic()

    g = Add().named("first").at("w1") >> Sleep(0.3).named("slow").at("w1")
    g.forward(1, broker=path, watching=watch)
    returned = time.monotonic()
    assert returned - arrived["first"] >= 0.2  # live, not batched with the answer


def test_a_remote_failure_names_node_and_host_and_the_worker_keeps_serving(path):
    seen = Collect()
    g = Add().named("a").at("w1") >> Boom().named("boom").at("w1")
    with pytest.raises(NodeFailed, match=r"node `boom` on `w1` raised ValueError: remote trouble") as info:
        g.forward(1, broker=path, watching=seen)
    assert info.value.node == "boom" and info.value.host == "w1"
    if path.kind != "inprocess":
        assert "remote trouble" in info.value.remote_traceback
        assert "in forward" in info.value.remote_traceback  # where it was raised, over there
        assert "Remote traceback" in str(info.value)
    assert seen.kinds() == ["ran", "failed", "broke"]
    assert seen[1]["host"] == "w1" and seen[1]["node"] == "boom"
    assert Add().named("a").at("w1").forward(1, broker=path) == 2


def test_a_cached_remote_node_is_kept_and_then_recalled_without_a_trip(path, tmp_path):
    calls = tmp_path / "calls"
    store = FolderStore(tmp_path / "store")
    g = Count(str(calls)).named("count").at("w1").cached().frozen()
    first, second = Collect(), Collect()
    np.testing.assert_array_equal(g.forward(5, broker=path, store=store, watching=first), [5, 6, 7])
    np.testing.assert_array_equal(g.forward(5, broker=path, store=store, watching=second), [5, 6, 7])
    assert first.kinds() == ["ran", "left", "kept", "finished"]
    assert second.kinds() == ["recalled", "finished"]  # no `left`: nothing was sent
    assert calls.read_text() == "x\n"


def test_mount_leaves_no_cargo_behind(path):
    if path.kind != "mount":
        pytest.skip("only the Mount path writes cargo to a directory")
    Scale(2.0).named("scale").at("w1").forward(np.ones(100_000), broker=path)
    with pytest.raises(NodeFailed):
        (Scale(2.0).named("scale").at("w1") >> Boom().named("boom").at("w1")).forward(np.ones(100_000), broker=path)
    assert [p.name for p in path.shared.iterdir() if not p.name.startswith(".")] == []


# -- spawned workers ------------------------------------------------------------------


def test_a_declaration_opens_nothing_and_a_spawn_waits_for_work():
    with Broker.embedded({"w1": Worker.spawn(WORKER, mode="network", send=[fabric_nodes])}) as broker:
        assert broker.knows("w1")
        assert Add().named("local").forward(1, broker=broker) == 2
        assert broker._server.children == {}  # no work was sent to w1: nothing started
        Add().named("a").at("w1").forward(1, broker=broker)
        assert broker._server.children["w1"].running
        child = broker._server.children["w1"].process
    assert child.poll() is not None  # closing the broker stopped and reaped it


def test_a_killed_worker_is_an_error_within_seconds_and_comes_back(tmp_path):
    with Broker.embedded({"w1": Worker.spawn(WORKER, mode="network", send=[fabric_nodes])}, patience=2.0) as broker:
        pid = Pid().named("pid").at("w1").forward(0, broker=broker)
        threading.Timer(0.5, os.kill, (pid, signal.SIGKILL)).start()
        started = time.monotonic()
        with pytest.raises(Broken, match=r"`w1` went away while running `sleepy`: killed by SIGKILL"):
            Sleep(30).named("sleepy").at("w1").forward(0, broker=broker)
        assert time.monotonic() - started < 10
        again = Pid().named("pid").at("w1").forward(0, broker=broker)
        assert again != pid  # started afresh on the next forward


def test_an_address_nobody_answers_on_is_named(tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with Broker.embedded({"w1": Worker.at(f"127.0.0.1:{port}", mode="network")}, patience=1.0) as broker:
        started = time.monotonic()
        with pytest.raises(Unreachable, match=rf"nobody answered at tcp://127.0.0.1:{port}"):
            Add().named("a").at("w1").forward(1, broker=broker)
        assert time.monotonic() - started < 10


def test_a_project_mode_worker_imports_nodes_by_name(processes):
    worker = processes([*WORKER, "--listen", "127.0.0.1:0", "--announce"], env=env_with_tests())
    with Broker.embedded({"w1": Worker.at(worker.endpoint, mode="project")}) as broker:
        assert (Add(2).named("a").at("w1") >> Add(3).named("b").at("w1")).forward(1, broker=broker) == 6


def test_project_mode_refuses_what_it_cannot_import_before_anything_runs(processes, tmp_path):
    class Local(Node):  # defined in a function: no worker can import it by name
        def forward(self, x):
            return x

    worker = processes([*WORKER, "--listen", "127.0.0.1:0", "--announce"], env=env_with_tests())
    calls = tmp_path / "calls"
    with Broker.embedded({"w1": Worker.at(worker.endpoint, mode="project")}) as broker:
        g = Count(str(calls)).named("count") >> Local().named("here").at("w1")
        with pytest.raises(PlanError, match="network"):
            g.forward(1, broker=broker)
    assert not calls.exists()


def test_a_project_mode_worker_refuses_code_by_value(processes):
    worker = processes([*WORKER, "--listen", "127.0.0.1:0", "--announce"], env=env_with_tests())
    with Broker.embedded({"w1": Worker.at(worker.endpoint, mode="network")}) as broker:
        with pytest.raises(Refused, match="project mode"):
            Add().named("a").at("w1").forward(1, broker=broker)


def test_a_value_of_a_kind_the_worker_cannot_read_is_refused_before_dispatch(processes):
    class Reading:
        def __init__(self, hz):
            self.hz = hz

    codec("tests.fabric.Reading", Reading, dump=lambda r: str(r.hz).encode(), load=lambda b: Reading(float(b)))
    try:
        worker = processes([*WORKER, "--listen", "127.0.0.1:0", "--announce"], env=env_with_tests())
        with Broker.embedded({"w1": Worker.at(worker.endpoint, mode="project")}) as broker:
            with pytest.raises(Refused, match="tests.fabric.Reading"):
                Add().named("a").at("w1").forward(Reading(5.0), broker=broker)
            assert Add().named("a").at("w1").forward(1, broker=broker) == 2  # still serving
    finally:
        forget("tests.fabric.Reading")


def test_the_worker_refuses_to_listen_where_others_can_reach_it():
    done = subprocess.run([*WORKER, "--listen", "0.0.0.0:7000"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2
    assert "refusing to listen on tcp://0.0.0.0:7000" in done.stderr
    assert "--insecure" in done.stderr


# -- a standalone broker ------------------------------------------------------------------


def test_direct_keeps_working_after_the_broker_is_stopped(processes, tmp_path):
    worker = processes([*WORKER, "--listen", "127.0.0.1:0", "--announce", "--mode", "network"])
    table = tmp_path / "hosts.toml"
    table.write_text(f'[hosts.w1]\naddress = "{worker.endpoint}"\nmode = "network"\n')
    hub = processes([*BROKER, "--listen", "tcp://127.0.0.1:0", "--hosts", str(table), "--announce"])
    with Broker.at(hub.endpoint, send={"w1": [fabric_nodes]}) as broker:
        g = Add(1).named("a").at("w1")
        assert g.forward(1, broker=broker) == 2
        assert hub.stop() == 0
        assert g.forward(2, broker=broker) == 3  # the broker is out of the path


# -- notebooks and scripts -------------------------------------------------------------

MAIN_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from dataclasses import dataclass
    from somatize import Broker, Node, Worker, codec

    @dataclass
    class Reading:
        hz: float

    codec("script.Reading", Reading, dump=lambda r: json.dumps(r.hz).encode(),
          load=lambda raw: Reading(json.loads(raw)))

    class Sense(Node):
        def forward(self, hz):
            return Reading(hz * 2)

    class Hz(Node):
        def forward(self, reading):
            return reading.hz

    broker = Broker.embedded({"w1": Worker.spawn([sys.executable, "-m", "somatize.worker"], mode="network")})
    with broker:
        g = Sense().named("sense").at("w1") >> Hz().named("hz")
        facts = []
        out = g.forward(21.0, broker=broker, watching=facts.append)
    print(json.dumps({"out": out, "hosts": [f.get("host") for f in facts if f["fact"] == "ran"]}))
    """
)


def test_a_class_from_main_and_a_notebook_codec_run_on_a_spawned_network_worker(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(MAIN_SCRIPT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"out": 42.0, "hosts": ["w1", None]}


# -- mount: a request naming no files leaves no cargo behind ----------------------------


def test_a_mounted_message_naming_no_files_leaves_no_cargo_behind(processes, tmp_path):
    """Attacker: an allowed client of a worker started with `--mount DIR` (here a keyless
    loopback worker; over TCP with a key in `--allow` it may be on another machine and need
    not see the folder at all).

    What it achieves: the worker writes answers into its private mount folder (tmpfs, in
    the usual `/dev/shm` setup: memory) that nobody ever removes, eight times the bytes the
    attacker sent, for as long as the worker runs. A `Mounted` naming no files is accepted
    (its Work's input rides in the header); the worker names its answer's files after the
    request's first file, and with none, after its own pid, which is alive, so no sweep
    ever takes them; only a client removes cargo, and this one never does.
    """
    folder = tmp_path / "cargo"
    worker = project_worker(processes, "--mount", str(folder))
    scale = spec_of(Scale(2.0).named("scale"))
    attacker = Raw(worker.endpoint)
    sent = 0
    try:
        assert isinstance(attacker.ask(Hello(RT)), Ready)
        for ref in range(1, 9):
            header = encode(Work(ref, Recipe((scale,), ("step", 0)), [1] * 500_000, watched=False))
            assert len(header) == 1
            sent += len(header[0])
            attacker.send(Mounted((), header=header[0]))
            answer = attacker.answer(30)
            assert answer is not None
    finally:
        attacker.close()
    left = sum(p.stat().st_size for p in folder.iterdir()) if folder.exists() else 0
    assert left == 0, f"{left:,} bytes of cargo left in {folder} by {sent:,} bytes sent, never to be removed"


# -- relayed: through the broker, a window at a time ------------------------------------


def rss_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {field} for {pid}")


@pytest.fixture
def relayed(processes):
    hub = processes([*BROKER, "--listen", "tcp://127.0.0.1:0", "--announce"])
    processes([*WORKER, "--broker", hub.endpoint, "--offer", "w1", "--mode", "network"], announce=None)
    with Broker.at(hub.endpoint, send={"w1": [fabric_nodes]}) as broker:
        wait_for_host(broker, "w1")
        broker.hub = hub
        yield broker


def test_relayed_cargo_bigger_than_a_chunk_crosses_both_ways(relayed):
    x = np.random.default_rng(7).standard_normal(5_000_000)  # 40 MB: streamed in chunks
    np.testing.assert_array_equal(Scale(2.0).named("scale").at("w1").forward(x, broker=relayed), x * 2.0)


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the broker's memory from /proc")
def test_relaying_a_gibibyte_keeps_the_broker_within_its_window(relayed):
    from somatize.fabric.streams import WINDOW

    g = Sleep(0).named("echo").at("w1")
    g.forward(np.zeros(1 << 20, np.uint8), broker=relayed)  # warm: everything imported, connected
    pid = relayed.hub.pid
    before = rss_kib(pid, "VmRSS")
    x = np.ones(1 << 30, np.uint8)
    out = g.forward(x, broker=relayed)
    assert out.nbytes == 1 << 30 and int(out[::4096].sum()) == (1 << 30) // 4096
    del x, out
    growth = (rss_kib(pid, "VmHWM") - before) * 1024
    assert growth < 4 * WINDOW, f"the broker grew by {growth >> 20} MiB relaying 2 GiB"


def test_work_nobody_watches_sends_no_facts_back(processes):
    from somatize.fabric import sockets
    from somatize.packing import Packer
    from somatize.wire import Done, Hello, Recipe, Runtime, Work, decode, encode

    worker = processes([*WORKER, "--listen", "127.0.0.1:0", "--announce"], env=env_with_tests())
    spec = Packer("project").spec(Add(1).named("a").steps[0])
    sock = sockets.dealer(2.0)
    try:
        sock.connect(worker.endpoint)
        sock.send_multipart(encode(Hello(Runtime.here(mode="project"))))
        assert sockets.poll(sock, 10)
        sock.recv_multipart()
        answers = {}
        for watched in (True, False):
            sock.send_multipart(encode(Work(1, Recipe((spec,), ("step", 0)), 1, watched=watched)))
            said = []
            while not said or type(said[-1]) is not Done:
                assert sockets.poll(sock, 10)
                said.append(decode(sock.recv_multipart()))
            answers[watched] = said
    finally:
        sockets.close(sock)
    # watched: the piece finished at once, so its `ran` travels inside its Done, no Saw of its own
    assert [type(m) for m in answers[True]] == [Done]
    assert [(f["fact"], f["node"]) for f in answers[True][0].saw] == [("ran", "a")]
    assert [type(m) for m in answers[False]] == [Done] and answers[False][0].saw == ()


def test_asking_a_socket_whether_it_has_a_message_or_room_is_an_error_once_it_is_closed():
    import zmq

    from somatize.fabric import sockets

    a, b = sockets.pair(zmq.PAIR), sockets.pair(zmq.PAIR)
    url = sockets.unique_inproc("asked")
    a.bind(url)
    b.connect(url)
    try:
        assert not sockets.readable(a) and sockets.writable(b)
        b.send(b"x")
        assert sockets.poll(a, 10) and sockets.readable(a)  # an inproc message is there at once
        a.recv()
        assert not sockets.readable(a)
    finally:
        sockets.close(a, b)
    for closed in (a, b):  # never an answer about some other descriptor
        with pytest.raises(zmq.ZMQError):
            sockets.readable(closed)
        with pytest.raises(zmq.ZMQError):
            sockets.writable(closed)


def test_readable_and_writable_refuse_a_closed_socket_even_when_descriptor_0_is_readable(monkeypatch):
    """Attack: pyzmq's poll of a closed socket polls descriptor 0 in its place. With
    descriptor 0 made readable (a pipe holding a byte), a closed socket must still raise
    ``ZMQError`` (ENOTSOCK), never read as 'a message waits' or 'room to send'; an open one
    with nothing waiting reads as nothing waiting."""
    ctx = zmq.Context.instance()
    saved = os.dup(0)
    r, w = os.pipe()
    try:
        os.dup2(r, 0)
        os.write(w, b"x")
        for kind in (zmq.DEALER, zmq.PULL, zmq.PUSH, zmq.PAIR):
            sock = ctx.socket(kind)
            sock.linger = 0
            if kind != zmq.PUSH:
                assert fabric_sockets.readable(sock) is False  # fd 0 is readable; the socket is not
            sock.close()
            for look in (fabric_sockets.readable, fabric_sockets.writable):
                with pytest.raises(zmq.ZMQError) as refused:
                    look(sock)
                assert refused.value.errno == zmq.ENOTSOCK
    finally:
        os.dup2(saved, 0)
        for fd in (saved, r, w):
            os.close(fd)
