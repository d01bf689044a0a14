"""A worker survives its nodes and its peers: real worker processes, real sockets.

Each test is one attack from issue 11 (a target that exits at import, ``sys.exit`` in a
node, a ``__main__`` target, a module planted in the worker's working directory, a broker
restarted under a dialed worker with a late answer in flight, an orphaned spawned worker
whose node never returns, new work for a worker whose node hangs) and checks that the
worker answers, names the node, and goes on serving.

The nodes below are sent by name: project-mode workers import them from this module
(``env_with_tests`` puts this folder on their path).
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from conftest import BROKER, WORKER, env_with_tests
from fabric_nodes import Add
from reliability_support import wait_until

from somatize import Broker, Busy, Node, NodeFailed, Overdue, Worker
from somatize.fabric import sockets
from somatize.packing import Packer
from somatize.wire import Failed, Hello, NodeSpec, Ready, Recipe, Refusal, Runtime, Saw, Work, decode, encode


class Exits(Node):
    """Raises what is not an ``Exception``: ``sys.exit(3)`` or a ``KeyboardInterrupt``."""

    def __init__(self, how: str = "exit") -> None:
        self.how = how

    def forward(self, x):
        if self.how == "interrupt":
            raise KeyboardInterrupt("raised by a node")
        sys.exit(3)


class Stall(Node):
    """Writes its pid to ``started``, then runs until ``release`` exists (a minute at most)."""

    def __init__(self, started: str, release: str) -> None:
        self.started = started
        self.release = release

    def forward(self, x):
        Path(self.started).write_text(str(os.getpid()))
        until = time.monotonic() + 60
        while not os.path.exists(self.release) and time.monotonic() < until:
            time.sleep(0.01)
        return x


class Raw:
    """A client that speaks the wire itself, to send what no graph would."""

    def __init__(self, endpoint: str) -> None:
        self.sock = sockets.dealer(2.0)
        self.sock.connect(endpoint)
        self.refs = iter(range(1, 1 << 30))

    def close(self) -> None:
        sockets.close(self.sock)

    def next(self, seconds: float = 10.0):
        assert sockets.poll(self.sock, seconds), f"the worker did not answer within {seconds:g} s"
        return decode(self.sock.recv_multipart())

    def hello(self, seconds: float = 10.0):
        self.sock.send_multipart(encode(Hello(Runtime.here(mode="project"))))
        return self.next(seconds)

    def work(self, spec: NodeSpec, x=1, *, watched: bool = False, seconds: float = 10.0) -> list:
        """Send one Work; every answer to it, up to the terminal one."""
        ref = next(self.refs)
        self.sock.send_multipart(encode(Work(ref, Recipe((spec,), ("step", 0)), x, watched=watched)))
        answers = [self.next(seconds)]
        while isinstance(answers[-1], Saw):
            answers.append(self.next(seconds))
        assert all(getattr(a, "ref", ref) == ref for a in answers), answers
        return answers


def named(target: str, label: str = "planted") -> NodeSpec:
    return NodeSpec(label=label, cache=False, source="project", target=target, args=(), kwargs={})


def add_spec() -> NodeSpec:
    return Packer("project").spec(Add(1).named("a").steps[0])


def project_worker(processes, *extra: str, **options):
    options.setdefault("env", env_with_tests())
    return processes([*WORKER, "--listen", "127.0.0.1:0", "--announce", *extra], **options)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# -- what a node or a target raises ------------------------------------------------------


def test_a_target_that_exits_at_import_fails_the_work_and_the_worker_serves_on(processes, tmp_path):
    (tmp_path / "exits_at_import.py").write_text("raise SystemExit(2)\n")
    env = env_with_tests()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    worker = project_worker(processes, env=env)
    raw = Raw(worker.endpoint)
    try:
        assert isinstance(raw.hello(), Ready)
        [answer] = raw.work(named("exits_at_import:Anything", "boom"))
        assert isinstance(answer, Failed), answer
        assert answer.node == "boom" and answer.error == "SystemExit"
        assert "importing `exits_at_import`" in answer.why
        assert raw.work(add_spec(), 1)[-1].output == 2  # still serving
    finally:
        raw.close()
    assert worker.alive


def test_a_main_module_is_refused_as_a_target(processes):
    worker = project_worker(processes)
    raw = Raw(worker.endpoint)
    try:
        assert isinstance(raw.hello(), Ready)
        for target in ("unittest.__main__:X", "__main__:X"):
            [answer] = raw.work(named(target, "main"))
            assert isinstance(answer, Refusal), answer
            assert "`__main__` module" in answer.why and "does not import" in answer.why
        assert raw.work(add_spec(), 1)[-1].output == 2
    finally:
        raw.close()
    assert worker.alive


@pytest.mark.parametrize(("how", "jobs"), [("exit", "1"), ("exit", "2"), ("interrupt", "1")])
def test_sys_exit_in_a_node_fails_the_work_and_the_worker_serves_on(processes, how, jobs):
    worker = project_worker(processes, "--jobs", jobs)
    with Broker.embedded({"w1": Worker.at(worker.endpoint, mode="project")}) as broker:
        with pytest.raises(NodeFailed, match=r"node `quits` on `w1` raised") as info:
            Exits(how).named("quits").at("w1").forward(1, broker=broker)
        assert info.value.node == "quits"
        assert info.value.error == ("SystemExit" if how == "exit" else "KeyboardInterrupt")
        assert Add(2).named("a").at("w1").forward(1, broker=broker) == 3
    assert worker.alive


# -- what the worker imports ---------------------------------------------------------------


def test_a_module_planted_in_the_working_directory_is_not_imported(processes, tmp_path):
    marker = tmp_path / "imported"
    (tmp_path / "planted_nodes.py").write_text(
        textwrap.dedent(f"""
        from pathlib import Path
        Path({str(marker)!r}).write_text("ran as the worker")
        from somatize import Node
        class Planted(Node):
            def forward(self, x):
                return x
    """)
    )
    in_there = ["sh", "-c", 'cd "$0" && exec "$@"', str(tmp_path)]
    worker = processes([*in_there, *WORKER, "--listen", "127.0.0.1:0", "--announce"], env=env_with_tests())
    raw = Raw(worker.endpoint)
    try:
        assert isinstance(raw.hello(), Ready)
        [answer] = raw.work(named("planted_nodes:Planted"))
        assert isinstance(answer, Refusal) and "cannot import `planted_nodes`" in answer.why, answer
    finally:
        raw.close()
    assert not marker.exists()
    # the folder is importable when the worker is told so
    told = processes(
        [*in_there, *WORKER, "--listen", "127.0.0.1:0", "--announce", "--project", "."], env=env_with_tests()
    )
    raw = Raw(told.endpoint)
    try:
        assert isinstance(raw.hello(), Ready)
        assert raw.work(named("planted_nodes:Planted"), 5)[-1].output == 5
    finally:
        raw.close()
    assert marker.exists()


# -- a node that hangs ------------------------------------------------------------------------


def test_new_work_for_a_worker_whose_node_hangs_is_busy_and_a_probe_hears_how_long(processes, tmp_path):
    started, release = tmp_path / "started", tmp_path / "release"
    worker = project_worker(processes)
    declared = {"w1": Worker.at(worker.endpoint, mode="project")}
    outcome: dict = {}

    def stalled() -> None:
        with Broker.embedded(declared) as first:
            outcome["value"] = Stall(str(started), str(release)).named("stall").at("w1").forward(7, broker=first)

    thread = threading.Thread(target=stalled, daemon=True)
    thread.start()
    raw = Raw(worker.endpoint)
    try:
        wait_until(started.exists, 30, "the node starting")
        ready = raw.hello()
        assert isinstance(ready, Ready) and ready.busy_us > 0, ready
        answers = raw.work(add_spec(), 1, watched=True)
        said, refused = answers[-2:]
        assert isinstance(refused, Refusal) and refused.why.startswith("busy: running `stall` for "), refused
        assert isinstance(said, Saw) and said.fact["fact"] == "said" and said.fact["kind"] == "busy"
        with Broker.embedded(declared) as second:
            with pytest.raises(Busy, match="stall"):
                Add(1).named("a").at("w1").forward(1, broker=second)
            release.write_text("go")
            thread.join(30)
            assert outcome == {"value": 7}
            assert Add(1).named("a").at("w1").forward(1, broker=second) == 2
        assert raw.hello().busy_us == 0
    finally:
        release.write_text("go")
        raw.close()
        thread.join(30)


def test_a_clients_own_forwards_to_a_busy_worker_take_turns_and_another_clients_hear_busy(processes, tmp_path):
    """A worker never queues work: it refuses it as busy. But a client's own threads
    forwarding to one host at once take turns there, as calls to an actor would: a forward
    turned away while another of the same client runs on that host waits for it and is sent
    again, within its deadline. Another client is told `Busy` at once, as before."""
    started, release = tmp_path / "started", tmp_path / "release"
    worker = project_worker(processes)
    declared = {"w1": Worker.at(worker.endpoint, mode="project")}
    answers: dict = {}

    def forward(broker, key, node, x, **options) -> None:
        try:
            answers[key] = node.forward(x, broker=broker, **options)
        except Exception as exc:
            answers[key] = exc

    with Broker.embedded(declared) as first, Broker.embedded(declared) as second:
        holding = threading.Thread(
            target=forward, args=(first, "stall", Stall(str(started), str(release)).named("stall").at("w1"), 7)
        )
        holding.start()
        wait_until(started.exists, 30, "the node starting")
        behind = [
            threading.Thread(target=forward, args=(first, i, Add(i).named(f"a{i}").at("w1"), 100)) for i in range(4)
        ]
        late = threading.Thread(
            target=forward, args=(first, "late", Add(9).named("late").at("w1"), 0), kwargs={"deadline": 1.5}
        )
        for thread in [*behind, late]:
            thread.start()
        wait_until(
            lambda: first._turns.waiting("w1") == 5, 30, "every forward behind the first turned away and waiting"
        )
        with pytest.raises(Busy, match="busy and took no new work: running `stall` for"):
            Add(1).named("a").at("w1").forward(1, broker=second)  # someone else's work: Busy at once
        late.join(30)
        assert isinstance(answers["late"], Overdue), answers
        assert "`late` on `w1` did not finish within the forward's deadline of 1.5 s" in str(answers["late"])
        assert "for a turn on `w1` behind this client's other forwards there" in str(answers["late"])
        assert "Nothing of it ran on `w1`" in str(answers["late"])
        assert "stall" not in answers and all(thread.is_alive() for thread in behind)  # still waiting their turn
        release.write_text("go")
        for thread in [holding, *behind]:
            thread.join(30)
        assert answers == {"stall": 7, "late": answers["late"], **{i: 100 + i for i in range(4)}}
        assert first._turns.waiting("w1") == first._turns.running("w1") == 0
        assert Add(1).named("a").at("w1").forward(1, broker=second) == 2


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_a_worker_told_to_stop_while_its_node_hangs_stops(processes, tmp_path, jobs):
    started, release = tmp_path / "started", tmp_path / "release"
    worker = project_worker(processes, "--jobs", jobs)

    def stalled() -> None:
        with Broker.embedded({"w1": Worker.at(worker.endpoint, mode="project")}) as broker:
            try:
                Stall(str(started), str(release)).named("stall").at("w1").forward(0, broker=broker)
            except Exception:
                pass  # the worker stopped under it: expected

    thread = threading.Thread(target=stalled, daemon=True)
    thread.start()
    try:
        wait_until(started.exists, 30, "the node starting")
        worker.signal(signal.SIGTERM)
        wait_until(lambda: not worker.alive, 10, "the worker stopping")
        assert worker.popen.returncode == 0, worker.stderr()
    finally:
        release.write_text("go")
        thread.join(30)


def _python_threads(pid: int) -> list[int]:
    """The ids of ``pid``'s threads other than its main one that take signals: libzmq's own
    (``ZMQbg/...``) block every signal, so a signal sent to one of them is never delivered."""
    found = []
    for tid in map(int, os.listdir(f"/proc/{pid}/task")):
        if tid != pid and not Path(f"/proc/{pid}/task/{tid}/comm").read_text().startswith("ZMQbg"):
            found.append(tid)
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sends to one thread with tgkill, which is Linux's")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_worker_stops_at_once_whichever_of_its_threads_the_signal_lands_on(processes, signum):
    """CPython runs a handler on the main thread; a signal the kernel hands to another thread
    reached a worker asleep in its poll only when the poll timed out (a patience: 60 s here)."""
    worker = project_worker(processes, "--patience", "60")
    with Broker.embedded({"w1": Worker.at(worker.endpoint, mode="project")}) as broker:
        assert Add(1).named("a").at("w1").forward(1, broker=broker) == 2  # the stand-in and its watch run now
    threads = _python_threads(worker.pid)
    assert threads, "the worker runs no thread of its own besides the main one"
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.tgkill(worker.pid, threads[-1], int(signum)) == 0, os.strerror(ctypes.get_errno())
    wait_until(lambda: not worker.alive, 15, "the worker stopping")
    assert worker.popen.returncode == 0, worker.stderr()


ORPHAN = textwrap.dedent(
    """
    import sys
    from somatize import Broker, Worker
    from test_survival import Stall

    worker = Worker.spawn([sys.executable, "-m", "somatize.worker"], mode="project")
    with Broker.embedded({"w1": worker}) as broker:
        Stall(sys.argv[1], sys.argv[2]).named("stall").at("w1").forward(0, broker=broker)
    """
)
PR_SET_CHILD_SUBREAPER = 36


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="adopts the orphan with prctl, which is Linux's")
def test_an_orphaned_spawned_worker_exits_while_its_node_is_stuck(tmp_path):
    started, release = tmp_path / "started", tmp_path / "release"
    script = tmp_path / "client.py"
    script.write_text(ORPHAN)
    libc = ctypes.CDLL(None, use_errno=True)
    # orphans come to this process, so the worker can be waited for (and reaped) here
    assert libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    client = subprocess.Popen(
        [sys.executable, str(script), str(started), str(release)],
        env=env_with_tests(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
    )
    pid = None
    try:
        pid = int(wait_until(lambda: started.exists() and started.read_text(), 30, "the node starting"))
        client.kill()
        client.wait(10)
        ended = wait_until(lambda: os.waitpid(pid, os.WNOHANG)[0] == pid, 15, "the orphaned worker exiting")
        assert ended
        pid = None
    finally:
        release.write_text("go")
        if client.poll() is None:
            client.kill()
            client.wait(10)
        if pid is not None:  # it outlived its client: end it and reap it here
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


# -- a dialed worker and its broker ---------------------------------------------------------


def test_a_dialed_worker_comes_back_after_its_broker_restarts_with_a_late_answer(processes, tmp_path):
    started, release = tmp_path / "started", tmp_path / "release"
    url = f"tcp://127.0.0.1:{free_port()}"
    hub = processes([*BROKER, "--listen", url, "--announce"])
    worker = processes(
        [*WORKER, "--broker", url, "--offer", "w1", "--patience", "2"], announce=None, env=env_with_tests()
    )

    def served(broker: Broker) -> bool:
        return broker.knows("w1")

    with Broker.at(url) as broker:
        wait_until(lambda: served(broker), 15, "the worker dialing in")

    def late() -> None:  # its answer comes after the broker that relayed it is gone
        with Broker.at(url) as first:
            try:
                Stall(str(started), str(release)).named("stall").at("w1").forward(0, broker=first)
            except Exception:
                pass  # the broker went away under it: this client's trouble, not the test's

    thread = threading.Thread(target=late, daemon=True)
    thread.start()
    try:
        wait_until(started.exists, 30, "the node starting")
        assert hub.stop() == 0
        release.write_text("go")  # the answer leaves for a broker that is not there
        processes([*BROKER, "--listen", url, "--announce"])
        wait_until(lambda: "refused this worker" in worker.stderr(), 20, "the new broker refusing the late answer")
        with Broker.at(url) as broker:  # a new client: the listing is the new broker's
            wait_until(lambda: served(broker), 20, "the worker dialing in again")
            assert Add(1).named("a").at("w1").forward(1, broker=broker) == 2
        assert worker.alive
    finally:
        release.write_text("go")
        thread.join(30)


def test_a_broker_that_refuses_the_offer_is_asked_again_not_left(processes, tmp_path):
    url = f"tcp://127.0.0.1:{free_port()}"
    hosts = tmp_path / "hosts.toml"  # `w1` is declared there: no worker may dial in under its name
    hosts.write_text('[hosts.w1]\naddress = "127.0.0.1:1"\n')
    processes([*BROKER, "--listen", url, "--hosts", str(hosts), "--announce"])
    worker = processes(
        [*WORKER, "--broker", url, "--offer", "w1", "--patience", "1"], announce=None, env=env_with_tests()
    )
    wait_until(lambda: worker.stderr().count("refused this worker") >= 2, 20, "a second Hello after a refusal")
    assert worker.alive
    assert "saying Hello again in" in worker.stderr()


def test_dialing_a_broker_on_another_machine_without_keys_needs_insecure():
    done = subprocess.run(
        [*WORKER, "--broker", "tcp://192.0.2.1:5555", "--offer", "w1"], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 2
    assert "refusing to dial tcp://192.0.2.1:5555 with no keys" in done.stderr
    assert "--insecure" in done.stderr and "--broker-key" in done.stderr
