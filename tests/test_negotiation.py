"""What the client checks before and after a byte moves, against a worker played on a real
socket: the kinds the worker reads (a value it cannot read never leaves), and every answer
against the state of the conversation (a stale one dropped and counted, an illegal one
breaking the channel), and a busy worker's refusal as ``Busy``.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import zmq
from fabric_nodes import Add

from somatize import Broker, Busy, ProtocolError, Refused, Worker, codec
from somatize.codec import forget
from somatize.wire import Done, Hello, Ready, Refusal, Runtime, Work, decode, encode


class Reading:
    def __init__(self, data: bytes) -> None:
        self.data = data


class Peer:
    """A worker played by the test on a real socket: it answers Hello stating the kinds it
    reads, answers Work with the messages ``answer(work)`` gives, and records the type of
    every message that arrives."""

    def __init__(
        self, kinds: tuple[str, ...] = (), answer=lambda work: [Done(work.ref, None, {}, 0)], greet_late: float = 0.0
    ) -> None:
        """``greet_late``: hold each Hello's answer until a Work arrives behind it, or that
        many seconds pass (``seen`` then shows which came first)."""
        self.greet_late, self.held = greet_late, {}  # held: route -> when its Hello arrived
        kinds = kinds or tuple(Runtime.here().kinds)
        here = Runtime.here(mode="project")
        self.runtime = Runtime(here.wire, here.python, here.somatize, here.cloudpickle, kinds, here.mode)
        self.answer = answer
        self.seen: list[str] = []
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.linger = 0
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def greet(self, route: bytes) -> None:
        self.held.pop(route, None)
        self.sock.send_multipart([route, *encode(Ready(self.runtime))])
        self.seen.append("(Ready)")

    def serve(self) -> None:
        while not self.stop.is_set():
            for route in [r for r, at in self.held.items() if time.monotonic() > at + self.greet_late]:
                self.greet(route)
            if not self.sock.poll(50):
                continue
            route, *frames = self.sock.recv_multipart()
            msg = decode(frames)
            self.seen.append(type(msg).__name__)
            if isinstance(msg, Hello) and self.greet_late:
                self.held[route] = time.monotonic()
            elif isinstance(msg, Hello):
                self.sock.send_multipart([route, *encode(Ready(self.runtime))])
            elif isinstance(msg, Work):
                if route in self.held:
                    self.greet(route)
                for answer in self.answer(msg):
                    self.sock.send_multipart([route, *encode(answer)])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close()


def test_a_value_of_a_kind_the_worker_cannot_read_is_refused_before_a_byte_of_it_moves():
    peer = Peer()  # its kinds are taken before this one is registered
    codec("tests.deadlines.Reading", Reading, dump=lambda r: r.data, load=Reading)
    try:
        with Broker.embedded({"w1": Worker.at(f"127.0.0.1:{peer.port}", mode="project")}) as broker:
            big = Reading(b"x" * (64 << 20))
            with pytest.raises(
                Refused,
                match=r"`w1` cannot read values of kind `tests.deadlines.Reading`.*nothing was sent"
                r".*codec\(\"tests.deadlines.Reading\", ...\)",
            ):
                Add().named("a").at("w1").forward(big, broker=broker)
            assert peer.seen == ["Hello"]  # the Work never left
            assert Add().named("a").at("w1").forward(1, broker=broker) is None  # a readable one does
            assert peer.seen.count("Work") == 1
    finally:
        forget("tests.deadlines.Reading")
        peer.close()


def test_a_kind_registered_after_the_worker_was_found_to_read_all_of_ours_is_checked_again():
    peer = Peer()
    try:
        with Broker.embedded({"w1": Worker.at(f"127.0.0.1:{peer.port}", mode="project")}) as broker:
            node = Add().named("a").at("w1")
            assert node.forward(1, broker=broker) is None  # it reads every kind this process writes
            codec("tests.deadlines.Reading", Reading, dump=lambda r: r.data, load=Reading)
            with pytest.raises(Refused, match=r"`w1` cannot read values of kind `tests.deadlines.Reading`"):
                node.forward(Reading(b"x" * 100), broker=broker)
            assert peer.seen.count("Work") == 1  # the second Work never left
            forget("tests.deadlines.Reading")
            assert node.forward(2, broker=broker) is None  # as it was: every kind read again
            assert peer.seen.count("Work") == 2
    finally:
        forget("tests.deadlines.Reading")
        peer.close()


def test_a_worker_whose_slots_are_full_is_busy():
    why = "busy: this worker runs 1 piece of work at a time and one has run for 9 s"
    peer = Peer(answer=lambda work: [Refusal(why, ref=work.ref)])
    try:
        with Broker.embedded({"w1": Worker.at(f"127.0.0.1:{peer.port}", mode="project")}) as broker:
            with pytest.raises(
                Busy, match=r"the worker for `w1` is busy and took no new work: this worker runs 1 piece"
            ):
                Add().named("a").at("w1").forward(1, broker=broker)
    finally:
        peer.close()


def served(peer: Peer) -> Broker:
    return Broker.embedded({"w1": Worker.at(f"127.0.0.1:{peer.port}", mode="project")})


def test_an_answer_to_work_given_up_on_is_dropped_and_counted_never_taken_for_this_one():
    peer = Peer(answer=lambda work: [Done(work.ref + 1000, "stale", {}, 0), Done(work.ref, "this one", {}, 0)])
    try:
        with served(peer) as broker:
            assert Add().named("a").at("w1").forward(1, broker=broker) == "this one"
            (channel,) = broker._channels.idle["w1"]
            assert channel.exchange.stale == 1
            assert Add().named("a").at("w1").forward(1, broker=broker) == "this one"  # the same channel
            assert peer.seen.count("Hello") == 1 and channel.exchange.stale == 2
    finally:
        peer.close()


def test_an_answer_the_conversation_does_not_allow_breaks_the_channel():
    peer = Peer(answer=lambda work: [Ready(peer.runtime)])  # Ready is no answer to Work
    try:
        with served(peer) as broker:
            with pytest.raises(ProtocolError, match=r"the worker for `w1` .* so this channel was dropped: .*`Ready`"):
                Add().named("a").at("w1").forward(1, broker=broker)
            assert broker._channels.idle.get("w1", []) == []
            peer.answer = lambda work: [Done(work.ref, "fine", {}, 0)]
            assert Add().named("a").at("w1").forward(1, broker=broker) == "fine"
            assert peer.seen.count("Hello") == 2  # a new channel, a new conversation
    finally:
        peer.close()


def test_a_first_work_goes_right_behind_the_hello_when_nothing_waits_on_its_answer():
    """A channel's first Work waited for the answer to its Hello: a round trip more for the
    first forward to every host (two through a broker). A Work of plain values to a
    project-mode worker now goes right behind the Hello; one whose values the worker's
    answer must clear first still waits for it (the kinds test above)."""
    peer = Peer(greet_late=30.0, answer=lambda work: [Done(work.ref, "ran", {}, 0)])
    try:
        with served(peer) as broker:
            assert Add().named("a").at("w1").forward({"x": [1, 2.5, "three"]}, broker=broker) == "ran"
            assert peer.seen == ["Hello", "Work", "(Ready)"], peer.seen
            assert Add().named("a").at("w1").forward(2, broker=broker) == "ran"  # the channel is ready now
            assert peer.seen[3:] == ["Work"], peer.seen
        with served(peer) as broker:  # a NumPy scalar: every worker reads it, it goes in the header
            assert Add().named("a").at("w1").forward(np.float32(1.5), broker=broker) == "ran"
            assert peer.seen[4:] == ["Hello", "Work", "(Ready)"], peer.seen
    finally:
        peer.close()
    peer = Peer(greet_late=0.5, answer=lambda work: [Done(work.ref, "ran", {}, 0)])
    try:
        with served(peer) as broker:  # an array travels in a frame: it waits for the Hello's answer
            assert Add().named("a").at("w1").forward(np.ones(3), broker=broker) == "ran"
            assert peer.seen == ["Hello", "(Ready)", "Work"], peer.seen
    finally:
        peer.close()


def test_a_worker_that_refuses_a_hello_runs_nothing_of_the_work_sent_behind_it(tmp_path):
    """With the first Work right behind the Hello, a worker that refuses the Hello (here:
    its one session holds an answer in flight) has the Work in hand too: it refuses that as
    well, runs none of it, and serves on."""
    from holds_nodes import Hold, Mark
    from reliability_support import wait_until

    from somatize.fabric.conversation import WorkerSessions
    from somatize.fabric.worker.loop import WorkerLoop

    loop = WorkerLoop(mode="project", jobs=2)
    loop.sessions = WorkerSessions(loop.runtime, max_peers=1)
    endpoint = loop.bind("tcp://127.0.0.1:0")
    serving = threading.Thread(target=loop.serve, daemon=True)
    serving.start()
    declared = {"w1": Worker.at(endpoint, mode="project")}
    release, box = tmp_path / "release", {}
    try:
        with Broker.embedded(declared) as first, Broker.embedded(dict(declared)) as second:
            hold = Hold(str(tmp_path / "started"), str(release), str(tmp_path / "finished")).named("hold").at("w1")
            holding = threading.Thread(target=lambda: box.update(out=hold.forward(7, broker=first)))
            holding.start()
            wait_until(lambda: (tmp_path / "started").exists(), 30, "the first client's work running")
            with pytest.raises(Busy, match="took no new client"):
                Mark(str(tmp_path / "refused")).named("mark").at("w1").forward(1, broker=second)
            release.write_text("go")
            holding.join(30)
            assert box == {"out": 7}
            # a forward after it, on a new channel: the worker took the refused one's Work long before
            assert Mark(str(tmp_path / "marked")).named("mark").at("w1").forward(2, broker=second) == 2
            assert (tmp_path / "marked").exists() and not (tmp_path / "refused").exists(), (
                "the Work behind a refused Hello ran"
            )
    finally:
        release.write_text("go")
        loop.stopping.set()
        serving.join(10)


def test_a_piece_that_returns_at_once_wakes_no_stand_in_and_one_that_runs_long_gets_one(tmp_path):
    """A worker's stand-in serves while a piece runs long where it arrived. It was woken at
    the start of every piece, to watch it: two thread switches a call, a quarter of a
    dialed worker's CPU in a process of many loops. One watch per process now wakes a
    loop's stand-in only for a piece still running `STAND_IN_AFTER` later."""
    from holds_nodes import Hold
    from reliability_support import wait_until

    from somatize.fabric.worker.loop import WorkerLoop

    class Counted(threading.Event):
        sets = 0

        def set(self) -> None:
            Counted.sets += 1
            super().set()

    loop = WorkerLoop(mode="project")
    loop.standin.began = Counted()
    endpoint = loop.bind("tcp://127.0.0.1:0")
    serving = threading.Thread(target=loop.serve, daemon=True)
    serving.start()
    release, box = tmp_path / "release", {}
    try:
        with (
            Broker.embedded({"w1": Worker.at(endpoint, mode="project")}) as first,
            Broker.embedded({"w1": Worker.at(endpoint, mode="project")}) as second,
        ):
            for n in range(200):
                assert Add(1).named("a").at("w1").forward(n, broker=first) == n + 1
            assert Counted.sets < 50, f"the stand-in was woken {Counted.sets} times for 200 quick pieces"
            before = Counted.sets
            hold = Hold(str(tmp_path / "started"), str(release), str(tmp_path / "finished")).named("hold").at("w1")
            holding = threading.Thread(target=lambda: box.update(out=hold.forward(7, broker=first)))
            holding.start()
            wait_until(lambda: (tmp_path / "started").exists(), 30, "the long piece running")
            # the stand-in serves meanwhile: another client's work is told at once the worker is busy
            with pytest.raises(Busy, match="busy"):
                Add(1).named("a").at("w1").forward(1, broker=second)
            assert Counted.sets > before
            release.write_text("go")
            holding.join(30)
            assert box == {"out": 7}
    finally:
        release.write_text("go")
        loop.stopping.set()
        serving.join(10)


def test_the_stand_in_watch_works_in_a_forked_child():
    """The watch is one thread per process; a child forked while it ran has its state but
    not its thread, and would never wake a stand-in: it starts afresh there."""
    import os

    from somatize.fabric.worker.standin import WATCH

    class StandIn:  # what the watch reads of a stand-in, and the event it sets
        inline, seq = None, 1

        def __init__(self) -> None:
            self.began = threading.Event()

    WATCH.arm(StandIn(), 1)  # the parent's watch runs now
    pid = os.fork()
    if pid == 0:  # the child: a piece still running is found, its stand-in woken
        running = StandIn()
        running.inline = object()
        WATCH.arm(running, 1)
        os._exit(0 if running.began.wait(10) else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the forked child's watch never woke a stand-in"
