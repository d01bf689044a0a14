"""The broker's view of exchanges lost with their worker, sans IO (issue 38, liveness)."""

from __future__ import annotations

import pytest

from somatize.fabric.broker.peers import LOST_FOR, BrokerView
from somatize.fabric.conversation import CLIENT, WORKER
from somatize.packing import Packer
from somatize.wire import Done, Hello, Recipe, Relay, Runtime, Work, decode, encode

EVERYONE = frozenset((CLIENT, WORKER))


def offering(host: str) -> Hello:
    return Hello(Runtime.here(), offering=host)


def work(ref: int) -> Work:
    from fabric_nodes import Add

    return Work(ref, Recipe((Packer("project").spec(Add(1).named("a").steps[0]),), ("step", 0)), 1)


def sent(b: BrokerView, client: bytes, message, now: float) -> int:
    return decode(b.relay(client, "A", Relay(host="w1", inner=tuple(encode(message))), now).frames).exchange


@pytest.mark.pure
def test_work_open_when_its_worker_expired_is_told_once_the_host_is_offered_again():
    b = BrokerView(patience=1.0)
    b.hello(b"worker", "W", EVERYONE, offering("w1"), 0.0)
    waiting = sent(b, b"alice", work(1), 10.0)
    answered = sent(b, b"bob", work(2), 10.0)
    b.relay(b"worker", "W", Relay(exchange=answered, inner=tuple(encode(Done(2, 1, {}, 5)))), 10.1)
    assert b.expire(11.7) == ["w1"] and b.stalled == {"w1"}
    assert b.orphaned == []  # its client, looking, finds the host gone: `Broken`, not this
    assert b.hello(b"worker", "W", EVERYONE, offering("w1"), 12.0) == "offered"  # it went on
    assert [e.number for e in b.orphaned] == [waiting]  # bob's work had ended: nothing to tell


@pytest.mark.pure
def test_work_open_when_its_workers_connection_dropped_is_told_when_it_dials_again():
    b = BrokerView(patience=1.0)
    b.hello(b"old", "W", EVERYONE, offering("w1"), 0.0)
    waiting = sent(b, b"alice", work(1), 1.0)
    b.leave(b"old")
    assert b.orphaned == []
    b.hello(b"new", "W", EVERYONE, offering("w1"), 2.0)
    assert [e.number for e in b.orphaned] == [waiting]


@pytest.mark.pure
def test_work_open_on_a_connection_its_worker_left_for_a_new_one_is_told_at_once():
    b = BrokerView(patience=1.0)
    b.hello(b"old", "W", EVERYONE, offering("w1"), 0.0)
    waiting = sent(b, b"alice", work(1), 1.0)
    assert b.hello(b"new", "W", EVERYONE, offering("w1"), 2.0) == "offered"  # the same key, moved
    assert [e.number for e in b.orphaned] == [waiting] and not b.exchanges


@pytest.mark.pure
def test_losses_are_forgotten_once_every_client_has_looked():
    b = BrokerView(patience=1.0)
    b.hello(b"worker", "W", EVERYONE, offering("w1"), 0.0)
    sent(b, b"alice", work(1), 10.0)
    assert b.expire(11.7) == ["w1"]
    b.expire(12.0)
    b.expire(12.0 + LOST_FOR + 1.0)
    b.hello(b"worker", "W", EVERYONE, offering("w1"), 12.0 + LOST_FOR + 1.5)
    assert b.orphaned == []
