"""Liveness with work open: a dialed worker stopped mid-work is noticed within its patience,
one resumed serves again, a long honest piece is never taken for a stopped one, and a flood
at a worker never holds back another tenant's answer. Real brokers and dialed workers, real
signals, real sockets (issue 38, "What to build" 5).

Beside them: a listening worker stopped while a client waits on a piece it runs where it
arrived tells the client in bounded time, and ends cleanly; a broker restarted while a dialed
worker runs a client's work hands that work's late answer to no new client; and streams that
announce a huge size and send nothing hold a worker's slots no longer than their grace, so
no client's big cargo is locked out for hours."""

from __future__ import annotations

import signal
import socket
import threading
import time

import numpy as np
import pytest
import zmq
from by_hand import MARGIN, PATIENCE, TYPED, WAIT, spec_of
from conftest import BROKER, WORKER, env_with_tests
from fabric_nodes import Add, Scale, Sleep
from holds_nodes import Hold
from liveness_nodes import Big, Marked
from peers import RT, Raw
from reliability_support import wait_until

from somatize import Broken, Broker, Busy, Refused, Worker
from somatize.fabric.broker.checks import PROBE
from somatize.packing import Packer
from somatize.wire import (
    Begin,
    Done,
    Hello,
    Located,
    Ready,
    Recipe,
    Refusal,
    Relay,
    Runtime,
    Where,
    Work,
    decode,
    encode,
)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def dialed(processes, patience: float | None = None, *extra: str):
    """A standalone broker and a project-mode worker dialed into it, offering `w1`."""
    url = f"tcp://127.0.0.1:{free_port()}"
    told = ["--patience", f"{patience:g}"] if patience is not None else []
    hub = processes([*BROKER, "--listen", url, "--announce", *told])
    worker = processes([*WORKER, "--broker", url, "--offer", "w1", *told, *extra], announce=None, env=env_with_tests())
    return url, hub, worker


def running_there(url: str, seconds: float = 20.0) -> None:
    """Until the worker serving `w1` says, through the broker, that work runs there (its
    Ready's ``busy_us``): what it said before that, on its one connection, has reached the
    broker too (a Ready to the client's Hello, say)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(url)
    until = time.monotonic() + seconds
    try:
        while True:
            sock.send_multipart(encode(Relay(host="w1", inner=tuple(encode(Hello(Runtime.here(mode="project")))))))
            while sock.poll(200):
                message = decode(sock.recv_multipart())
                if isinstance(message, Ready) and message.busy_us > 0:
                    return
            assert time.monotonic() < until, f"the worker said nothing ran for {seconds:g} s"
    finally:
        sock.close()


def in_thread(call):
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            box["error"] = exc
        box["ended"] = time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def served(call, seconds: float):
    """``call()``'s value, called again while the worker has not offered its host again yet,
    or is still busy with the piece that ran when it stopped (it runs one at a time, and says
    so); each answer is the fact."""
    until = time.monotonic() + seconds
    while True:
        try:
            return call()
        except (Busy, Broken, Refused) as exc:
            if isinstance(exc, Refused) and "knows no host" not in str(exc):
                raise  # not yet dialed in again: that one is waited for, nothing else
            assert time.monotonic() < until, f"not served within {seconds:g} s"
            time.sleep(0.2)


def test_a_dialed_worker_stopped_mid_work_is_broken_within_two_patiences_and_serves_once_resumed(processes, tmp_path):
    """The attack: SIGSTOP a dialed worker running a 6 s piece, every patience 2 s. The
    client's Hello went right behind its Work, and the worker's Ready to it came after: the
    broker took that for the answer the client waited on and held the host to the idle
    limit, thirty patiences: `Broken` after 60 s. Now any work open holds it to the working
    limit, whoever spoke last."""
    patience = 2.0
    url, hub, worker = dialed(processes, patience)
    started = tmp_path / "started"
    with Broker.at(url, patience=patience) as client:
        wait_until(lambda: client.knows("w1"), 20, "the worker dialing in")
        thread, box = in_thread(lambda: Marked(str(started), 6.0).named("long").at("w1").forward(0, broker=client))
        wait_until(started.exists, 20, "the piece running")
        running_there(url)  # and the worker's Ready to the client's Hello has reached the broker
        worker.signal(signal.SIGSTOP)
        stopped = time.monotonic()
        thread.join(20)
        try:
            assert not thread.is_alive(), "the client still waits 20 s after its worker stopped"
            assert isinstance(box.get("error"), Broken), box
            took = box["ended"] - stopped
            assert took < 2 * patience + PROBE, f"the client was told after {took:.1f} s"
            assert "with work open" in hub.stderr(), hub.stderr()
        finally:
            worker.signal(signal.SIGCONT)
        resumed = time.monotonic()
        assert served(lambda: Add(1).named("a").at("w1").forward(1, broker=client), 15) == 2
        assert time.monotonic() - resumed < 15
        assert worker.alive


def test_a_dialed_worker_stopped_for_a_second_answers_its_work_and_the_next(processes, tmp_path):
    patience = 2.0
    url, hub, worker = dialed(processes, patience)
    started = tmp_path / "started"
    with Broker.at(url, patience=patience) as client:
        wait_until(lambda: client.knows("w1"), 20, "the worker dialing in")
        thread, box = in_thread(lambda: Marked(str(started), 3.0).named("long").at("w1").forward(7, broker=client))
        wait_until(started.exists, 20, "the piece running")
        worker.signal(signal.SIGSTOP)
        time.sleep(1.0)  # a GC pause, a frozen VM: a second, then it goes on
        worker.signal(signal.SIGCONT)
        thread.join(20)
        assert not thread.is_alive() and box.get("value") == 7, box
        assert served(lambda: Add(1).named("a").at("w1").forward(1, broker=client), 15) == 2


@pytest.mark.parametrize("spin", [False, True], ids=["sleeping", "spinning"])
def test_a_long_honest_piece_is_never_taken_for_a_stopped_worker(processes, tmp_path, spin):
    """Four patiences of work, sleeping or keeping the interpreter busy: the worker's serving
    thread says Hello every half patience meanwhile, so the broker holding the host to one
    and a half never finds it silent."""
    patience = 1.0
    url, hub, worker = dialed(processes, patience)
    with Broker.at(url, patience=patience) as client:
        wait_until(lambda: client.knows("w1"), 20, "the worker dialing in")
        node = Marked(str(tmp_path / "started"), 4 * patience, spin=spin).named("honest").at("w1")
        assert node.forward("done", broker=client) == "done"
        assert "left" not in hub.stderr(), hub.stderr()


def _flood(url: str, connections: int, message: list, stop: threading.Event, sent: list) -> None:
    """Send ``message`` from ``connections`` connections as fast as they take it, reading
    (and dropping) whatever comes back, until ``stop``."""
    context = zmq.Context.instance()
    socks = []
    try:
        for _ in range(connections):
            sock = context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 10_000)
            sock.connect(url)
            socks.append(sock)
        while not stop.is_set():
            for sock in socks:
                for _ in range(100):
                    try:
                        sock.send_multipart(message, zmq.NOBLOCK)
                        sent[0] += 1
                    except zmq.Again:
                        break
                while True:
                    try:
                        sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
    finally:
        for sock in socks:
            sock.close()


@pytest.mark.parametrize(
    ("what", "big"),
    [("Hello", False), ("Work", False), ("Hello", True)],
    ids=["Hellos", "Works", "Hellos, a streamed answer"],
)
def test_a_flood_at_a_dialed_worker_never_holds_back_another_tenants_answer(processes, what, big):
    """The attack, scaled down: while connections of their own flood a dialed worker with
    relayed Hellos (or Works, refused as busy), a victim's 2 s piece there runs. The worker
    answered each of the flood at once, the socket always took it (the kernel's buffers and
    the broker's queue hold tens of thousands), and the victim's Done left behind all of
    them: the broker read it long after the victim's deadline. Now the worker keeps a window
    in flight and sends what waits one tenant at a time, a stream beside them."""
    url, hub, worker = dialed(processes)
    if what == "Hello":
        inner = Hello(Runtime.here(mode="project"))
    else:  # never greeted: each is refused, naming its ref
        inner = Work(1, Recipe((Packer("project").spec(Add(1).named("a").steps[0]),), ("step", 0)), 1)
    flood = encode(Relay(host="w1", inner=tuple(encode(inner))))
    stop, sent = threading.Event(), [0]
    with Broker.at(url) as client:
        wait_until(lambda: client.knows("w1"), 20, "the worker dialing in")
        assert Add(1).named("a").at("w1").forward(1, broker=client) == 2
        victim = Big(2.0, 12 << 20) if big else Sleep(2.0)  # 12 MiB: three chunks of a stream
        expected = bytes([7]) * (12 << 20) if big else 7
        thread, box = in_thread(lambda: victim.named("victim").at("w1").forward(7, broker=client, deadline=10))
        flooding = threading.Thread(target=_flood, args=(url, 16, flood, stop, sent), daemon=True)
        flooding.start()
        try:
            thread.join(15)
            assert not thread.is_alive(), "the victim still waits"
            assert box.get("value") == expected, str(box)[:300]
            assert sent[0] > 10_000, f"the flood sent only {sent[0]} messages"
        finally:
            stop.set()
            flooding.join(10)


def test_a_worker_back_before_its_client_looked_has_that_client_told(processes, tmp_path):
    """The broker found a stopped worker gone with work open and ended its exchange; the
    worker went on and offered its host again before the client looked (once a patience of
    its own, 20 s here). The client found the host there and waited for ever: the answer to
    its work could never come through (its exchange was over). Now the broker tells it as
    the host is offered again."""
    url, hub, worker = dialed(processes, 1.0)
    started = tmp_path / "started"
    with Broker.at(url, patience=20.0) as client:
        wait_until(lambda: client.knows("w1"), 20, "the worker dialing in")
        thread, box = in_thread(lambda: Marked(str(started), 4.0).named("long").at("w1").forward(0, broker=client))
        wait_until(started.exists, 20, "the piece running")
        running_there(url)
        worker.signal(signal.SIGSTOP)
        try:
            wait_until(lambda: "with work open" in hub.stderr(), 20, "the broker finding the worker gone")
        finally:
            worker.signal(signal.SIGCONT)
        thread.join(15)
        assert not thread.is_alive(), "the client still waits 15 s after its worker came back"
        error = box.get("error")
        assert isinstance(error, Refused), box
        assert "was lost while the work sent there was open" in str(error) and "whether it ran is not known" in str(
            error
        )
        assert served(lambda: Add(1).named("a").at("w1").forward(1, broker=client), 15) == 2


# -- a worker stopped while a client waits on a piece it runs where it arrived ---------------------


def test_a_worker_stopped_while_a_client_waits_tells_it_in_bounded_time_and_ends_cleanly(serving, monkeypatch):
    """Attack: a loop running a piece where it arrived is stopped while the client waits; the
    piece outlives the loop's patience, so the stand-in closes the sockets under it, and the
    serving thread comes back to closed sockets (its polls of no time, its answers). The
    client hears a typed error within a bound; the serving thread ends with nothing raised
    on any thread."""
    raised: list = []
    monkeypatch.setattr(threading, "excepthook", lambda args: raised.append(args))
    loop, endpoint, thread = serving(patience=0.5)
    node = Sleep(1.5).named("long").at("w1")
    probe = Raw(endpoint)
    try:
        with Broker.embedded({"w1": Worker.at(endpoint, mode="project")}, patience=PATIENCE) as broker:
            assert Add(1).named("warm").at("w1").forward(1, broker=broker) == 2
            box: dict = {}

            def call() -> None:
                try:
                    box["value"] = node.forward(1, broker=broker)
                except BaseException as exc:  # noqa: BLE001
                    box["error"] = exc

            caller = threading.Thread(target=call, daemon=True)
            caller.start()
            ready = probe.ask(Hello(Runtime.here(mode="project")))
            while ready is not None and ready.busy_us == 0:  # a fact: the long piece runs
                ready = probe.ask(Hello(Runtime.here(mode="project")))
            stopped = time.monotonic()
            loop.close()
            caller.join(WAIT)
            assert not caller.is_alive(), "the client still waits on a stopped worker"
            assert "value" in box or isinstance(box.get("error"), TYPED), box
            assert time.monotonic() - stopped < PATIENCE * 4 + MARGIN
        thread.join(WAIT)
        assert not thread.is_alive()
    finally:
        probe.close()
    assert not raised, [(a.exc_type, a.exc_value) for a in raised]


# -- a broker restarted under open work hands no new client another's answer ------------------


def test_after_a_broker_restarts_a_new_client_does_not_receive_the_answer_to_another_clients_work(processes, tmp_path):
    """Attacker: an allowed client of a broker (a keyless loopback broker here, which every
    local user reaches; the numbering is the same with keys, where it takes a client key).

    What it achieves: it receives another client's answer (the victim's output, here the
    secret it sent in). A broker numbers its relayed exchanges from 1 and a dialed worker
    names each relayed peer by that number alone (`relay:N`). When the broker restarts
    while the victim's work runs (an operator's restart, a crash, a deploy), the worker
    keeps its session `relay:1` with the victim's open ref; the first client of the new
    broker to talk to that host gets exchange 1, and the worker's late answer to the victim
    is relayed to it. (A Hello on it even keeps the victim's open refs: `_greet` carries
    them over.)
    """
    started, release, finished = tmp_path / "started", tmp_path / "release", tmp_path / "finished"
    url = f"tcp://127.0.0.1:{free_port()}"
    hub = processes([*BROKER, "--listen", url, "--announce"])
    processes([*WORKER, "--broker", url, "--offer", "w1", "--patience", "2"], announce=None, env=env_with_tests())
    probe = Raw(url)
    victim = Raw(url)
    attacker = None
    try:
        wait_until(lambda: isinstance(probe.ask(Where("w1"), 2.0), Located), 20, "w1 dialing in")
        victim.send(Relay(host="w1", inner=tuple(encode(Hello(RT)))))
        assert isinstance(victim.answer(), Ready)
        secret = "victim's secret output 4242"
        hold = spec_of(Hold(str(started), str(release), str(finished)).named("hold"))
        victim.send(Relay(host="w1", inner=tuple(encode(Work(7, Recipe((hold,), ("step", 0)), secret, watched=False)))))
        wait_until(started.exists, 30, "the victim's work starting")

        assert hub.stop() == 0  # the broker restarts while the victim's work runs
        probe.close()
        processes([*BROKER, "--listen", url, "--announce"])
        probe = Raw(url)
        wait_until(lambda: isinstance(probe.ask(Where("w1"), 2.0), Located), 30, "w1 dialing in again")

        attacker = Raw(url)  # the first client of the new broker to talk to w1: exchange 1
        assert isinstance(attacker.ask(Relay(host="w1", inner=tuple(encode(Hello(RT))))), Ready)
        release.write_text("go")
        wait_until(finished.exists, 30, "the victim's work returning")

        # the attacker's own work: everything relayed to it before its answer is looked at
        add = spec_of(Add(1).named("a"))
        attacker.send(Relay(host="w1", inner=tuple(encode(Work(99, Recipe((add,), ("step", 0)), 1, watched=False)))))
        got = []
        while not got or getattr(got[-1], "ref", None) != 99:
            answer = attacker.answer(20)
            assert answer is not None, got
            got.append(answer)
        leaked = [a for a in got if isinstance(a, Done) and a.ref == 7]
        assert not leaked, f"the attacker received the victim's answer: {leaked}"
        assert isinstance(got[-1], Done) and got[-1].output == 2
    finally:
        release.write_text("go")
        for raw in (probe, victim, attacker):
            if raw is not None:
                raw.close()


# -- a stream that announces a huge size and sends nothing holds its slot no longer than its grace -


#: A dialed worker whose streams get 2 s of grace instead of 30, so the test need not wait
#: half a minute; everything else is `python -m somatize.worker` as shipped.
QUICK_GRACE_WORKER = (
    "import sys; import somatize.fabric.streams as s; s.GRACE = 2.0; "
    "from somatize.worker import main; sys.exit(main(sys.argv[1:]))"
)


def test_a_stream_that_announces_a_huge_size_and_sends_nothing_does_not_hold_its_slot_for_hours(processes):
    """Attacker: clients of a keyless loopback broker (every local user is one; each
    connection is a tenant of its own there).

    What it achieves: every client's big cargo (over 4 MiB) to a dialed worker is refused
    for nine hours, for 96 small messages. A stream's lifetime is `GRACE + sizes / MIN_RATE`
    of the sizes its `Begin` *announces*: a Begin announcing 32 GiB buys 30 s + 32,768 s
    whatever arrives, so a slot held with no chunk at all (or one byte now and then) is
    never dropped, though docs/conversation.md says "a slot kept alive by one-byte chunks
    is dropped, and nobody can lock the others out". 32 connections fill the worker's 64
    slots. (The worker here runs with a grace of 2 s, so the test need not wait 30.)
    """
    hub = processes([*BROKER, "--listen", "tcp://127.0.0.1:0", "--announce"])
    worker_cmd = [WORKER[0], "-c", QUICK_GRACE_WORKER, "--broker", hub.endpoint, "--offer", "w1", "--patience", "2"]
    processes(worker_cmd, announce=None, env=env_with_tests())
    crowd: list[Raw] = []
    with Broker.at(hub.endpoint, patience=2.0) as broker:
        wait_until(lambda: broker.knows("w1"), 20, "w1 dialing in")
        assert Add(1).named("a").at("w1").forward(1, broker=broker) == 2
        try:
            huge = (1, 16 << 30, (16 << 30) - 1)
            for _ in range(32):
                raw = Raw(hub.endpoint)
                crowd.append(raw)
                assert isinstance(raw.ask(Relay(host="w1", inner=tuple(encode(Hello(RT))))), Ready)
                for sid in (1, 2):
                    raw.send(Relay(host="w1", inner=tuple(encode(Begin(sid, huge)))))
                # a Hello after them is answered once the worker has taken both Begins
                assert isinstance(raw.ask(Relay(host="w1", inner=tuple(encode(Hello(RT))))), Ready)
            late = Raw(hub.endpoint)
            crowd.append(late)
            late.ask(Relay(host="w1", inner=tuple(encode(Hello(RT)))))
            late.send(Relay(host="w1", inner=tuple(encode(Begin(1, (1, 1 << 20))))))
            refused = late.answer(10)
            assert isinstance(refused, Refusal) and "as many big messages" in refused.why  # locked out

            errors: list[str] = []

            def big_forward_goes_through() -> bool:
                try:
                    out = Scale(1.0).named("s").at("w1").forward(np.ones(1 << 20), broker=broker, deadline=15)
                except Exception as exc:
                    errors[:] = [f"{type(exc).__name__}: {exc}"]
                    return False
                return float(out.sum()) == float(1 << 20)

            # nothing more arrives on the 64 streams: past their grace they are gone
            try:
                wait_until(big_forward_goes_through, 25, "a client's big cargo getting through")
            except AssertionError as exc:
                raise AssertionError(f"{exc}; the last try: {errors[-1] if errors else '?'}") from None
        finally:
            for raw in crowd:
                raw.close()
