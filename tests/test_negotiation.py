"""What the client checks before and after a byte moves, against a worker played on a real
socket: the kinds the worker reads (a value it cannot read never leaves), and every answer
against the state of the conversation (a stale one dropped and counted, an illegal one
breaking the channel), and a busy worker's refusal as ``Busy``.
"""

from __future__ import annotations

import threading

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

    def __init__(self, kinds: tuple[str, ...] = (), answer=lambda work: [Done(work.ref, None, {}, 0)]) -> None:
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

    def serve(self) -> None:
        while not self.stop.is_set():
            if not self.sock.poll(50):
                continue
            route, *frames = self.sock.recv_multipart()
            msg = decode(frames)
            self.seen.append(type(msg).__name__)
            if isinstance(msg, Hello):
                self.sock.send_multipart([route, *encode(Ready(self.runtime))])
            elif isinstance(msg, Work):
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


def test_a_worker_whose_slots_are_full_is_busy():
    why = "busy: this worker runs 1 piece of work at a time and one has run for 9 s"
    peer = Peer(answer=lambda work: [Refusal(why, ref=work.ref)])
    try:
        with Broker.embedded({"w1": Worker.at(f"127.0.0.1:{peer.port}", mode="project")}) as broker:
            with pytest.raises(Busy, match=r"the worker for `w1` is busy and took no new work: this worker runs 1 piece"):
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
            (channel,) = broker._idle["w1"]
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
            assert broker._idle.get("w1", []) == []
            peer.answer = lambda work: [Done(work.ref, "fine", {}, 0)]
            assert Add().named("a").at("w1").forward(1, broker=broker) == "fine"
            assert peer.seen.count("Hello") == 2  # a new channel, a new conversation
    finally:
        peer.close()
