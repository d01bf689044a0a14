"""A forward's deadline bounds every wait it causes, whatever it waits for: the handshake's
probe, the broker's word on a lost worker, a turn at the control socket another thread's
question holds. Past it the answer is ``Overdue``, never a ``Broken`` after the time.

Real sockets: an address that hangs up every handshake (a TCP port that is not ZeroMQ), a
broker played by hand on a ROUTER (it answers what the test says, and is silent where the
attack needs it), a worker played by hand. Each bound is a liveness fact of the design (the
deadline, plus room for a busy machine), not a speed figure.
"""

from __future__ import annotations

import threading
import time

import pytest
import zmq
from fabric_nodes import Add
from peers import FakeWorker, socket_peer, within

from somatize import Broken, Broker, Overdue, Worker
from somatize.wire import Done, Hosts, Listed, Located, Where, decode, encode

DEADLINE = 3.0
#: How late past its deadline a forward may end: a look (50 ms), a thread, a loaded machine.
LATE = 0.5


def holding(seconds: float):
    """A peer that takes each connection, reads the greeting, holds it ``seconds``, and
    hangs up: every ZeroMQ handshake fails, and so does every probe of it (held as long)."""

    def serve(conn, stop):
        conn.settimeout(5)
        try:
            conn.recv(64)
        except OSError:
            pass
        stop.wait(seconds)

    return serve


class PlayedBroker:
    """A broker played by a ROUTER on a thread: ``answer(message)`` gives what to send back
    (None: nothing, ever). Keeps every message it received."""

    def __init__(self, answer) -> None:
        self.answer = answer
        self.heard: list = []
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.linger = 0
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.url = f"tcp://127.0.0.1:{port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(50):
                continue
            route, *frames = self.sock.recv_multipart()
            message = decode(frames)
            self.heard.append(message)
            reply = self.answer(message)
            if reply is not None:
                self.sock.send_multipart([route, *encode(reply)])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close(0)


def timed(call) -> tuple[BaseException | None, float]:
    started = time.monotonic()
    try:
        within(DEADLINE + 30, call)
    except BaseException as exc:  # noqa: BLE001 - judged by the test
        return exc, time.monotonic() - started
    return None, time.monotonic() - started


@pytest.mark.parametrize("hold", [2.5, 2.9, 10.0])
def test_a_forward_to_an_address_that_hangs_up_every_handshake_is_overdue_by_its_deadline(hold):
    """Attack: ``deadline=3`` to an address that hangs up every handshake after holding it
    2.9 s ended after ~3.9 s, ``Broken``: the handshake probe's second (and the
    ``Where(lost)`` after it) were outside the deadline."""
    with socket_peer(holding(hold)) as (port, _):
        with Broker.embedded({"w1": Worker.at(f"tcp://127.0.0.1:{port}", mode="project")}) as broker:
            error, took = timed(lambda: Add(1).named("a").at("w1").forward(1, broker=broker, deadline=DEADLINE))
    assert took < DEADLINE + LATE, f"the forward ended {took:.2f} s after it began, {error!r}"
    assert isinstance(error, Overdue), repr(error)
    assert "the forward's deadline of 3 s" in str(error)


def test_a_hang_up_within_the_deadline_is_broken_within_it():
    """A peer that hangs up at once is no worker, and says so before the deadline: the answer
    is ``Broken``, at once (the deadline is not waited out)."""
    with socket_peer(holding(0.0)) as (port, _):
        with Broker.embedded({"w1": Worker.at(f"tcp://127.0.0.1:{port}", mode="project")}) as broker:
            error, took = timed(lambda: Add(1).named("a").at("w1").forward(1, broker=broker, deadline=DEADLINE))
    assert isinstance(error, Broken) and not isinstance(error, Overdue), repr(error)
    assert took < DEADLINE, took


def test_the_brokers_word_on_a_lost_worker_is_waited_for_only_within_the_deadline():
    """The worker's address hangs up each handshake after 1 s (the probe then takes its
    second), and the broker never answers ``Where(lost)``: the client waited two patiences
    for it after the deadline had nearly passed. Now ``Overdue`` at the deadline."""
    with socket_peer(holding(1.2)) as (port, _):
        address = f"tcp://127.0.0.1:{port}"

        def answer(message):
            if isinstance(message, Hosts):
                return Listed({"w1": "project"})
            if isinstance(message, Where) and not message.lost:
                return Located("w1", "direct", address=address, mode="project")
            return None  # Where(lost): never a word

        played = PlayedBroker(answer)
        try:
            with Broker.at(played.url, patience=5.0) as broker:
                error, took = timed(lambda: Add(1).named("a").at("w1").forward(1, broker=broker, deadline=DEADLINE))
        finally:
            played.close()
    assert took < DEADLINE + LATE, f"the forward ended {took:.2f} s after it began, {error!r}"
    assert isinstance(error, Overdue), repr(error)
    assert any(isinstance(m, Where) and m.lost for m in played.heard), "the broker was never told"


def test_a_question_another_thread_holds_the_broker_with_does_not_hold_a_deadline():
    """One thread asks where a host is whose worker takes long to start (the broker says
    nothing for a while); another forward, to another host, with a deadline, waited behind
    that question on the client's one control socket, past its deadline. Now it asks on a
    socket of its own and is answered."""
    fake = FakeWorker(lambda work: Done(work.ref, work.input + 1, {}, 7))
    release = threading.Event()

    def answer(message):
        if isinstance(message, Hosts):
            return Listed({"slow": "project", "w2": "project"})
        if isinstance(message, Where) and message.host == "w2":
            return Located("w2", "direct", address=fake.endpoint, mode="project")
        if isinstance(message, Where) and message.host == "slow":
            release.wait(30)  # a start that takes long: this played broker answers nobody meanwhile
            return None
        return None

    played = PlayedBroker(answer)
    try:
        with Broker.at(played.url, patience=5.0) as broker:
            broker.hosts()
            slow = threading.Thread(target=lambda: _quietly(lambda: broker._rendezvous.locate("slow")), daemon=True)
            slow.start()
            until = time.monotonic() + 10
            while not any(isinstance(m, Where) and m.host == "slow" for m in played.heard):
                assert time.monotonic() < until, "the slow question never reached the broker"
                time.sleep(0.01)
            release.set()  # the played broker serves again; the slow question stays unanswered
            error, took = timed(lambda: Add(1).named("a").at("w2").forward(1, broker=broker, deadline=2.0))
            assert error is None, repr(error)
            assert took < 2.0 + LATE, took
    finally:
        release.set()
        played.close()
        fake.close()


def _quietly(call) -> None:
    try:
        call()
    except Exception:  # noqa: BLE001 - the slow question ends as it may; not this test's fact
        pass


@pytest.mark.parametrize("hold", [2.9, 10.0])
def test_asking_a_broker_that_hangs_up_every_handshake_for_its_hosts_is_overdue_by_the_deadline(hold):
    """The checks before a forward ask the broker for its hosts: that question waited two
    patiences (10 s), whatever the forward's deadline, and ended ``Unreachable``."""
    with socket_peer(holding(hold)) as (port, _):
        with Broker.at(f"tcp://127.0.0.1:{port}", patience=5.0) as broker:
            error, took = timed(lambda: Add(1).named("a").at("w1").forward(1, broker=broker, deadline=DEADLINE))
    assert took < DEADLINE + LATE, f"the forward ended {took:.2f} s after it began, {error!r}"
    assert isinstance(error, Overdue), repr(error)
    assert "did not start within the forward's deadline of 3 s" in str(error)


def test_a_relayed_forward_whose_answer_never_comes_is_overdue_by_its_deadline():
    """A dialed host (the listing says so) whose answers never come through the broker: the
    lane's waits, and its looks whether the worker is still there, end at the deadline."""

    def answer(message):
        if isinstance(message, Hosts):
            return Listed({"w1": "project"}, {"w1": []})
        if isinstance(message, Where):
            return Located("w1", "relayed", address="", mode="project")
        return None  # a Relay: the worker behind it never answers

    played = PlayedBroker(answer)
    try:
        with Broker.at(played.url, patience=1.0) as broker:
            error, took = timed(lambda: Add(1).named("a").at("w1").forward(1, broker=broker, deadline=DEADLINE))
    finally:
        played.close()
    assert took < DEADLINE + LATE, f"the forward ended {took:.2f} s after it began, {error!r}"
    assert isinstance(error, Overdue), repr(error)
