"""The client's express way: a repeated small call, its ``Work`` written in one frame, against a
worker played by hand on a real socket that answers what it likes.

A call nobody watches, with no deadline, whose recipe the worker holds for the connection and
whose input is one scalar goes out the short way (``Channel._express``); everything that
comes back other than its own ``Done`` is taken exactly as the general way takes it: a stale
answer dropped, a request for the recipe in full or to greet again met once, a refusal that
names no work never taken for its answer, junk refused with the channel dropped.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
from fabric_nodes import Add
from peers import FakeWorker

from somatize import Broker, NodeFailed, ProtocolError, Refused, Worker
from somatize.wire import Done, Failed, Refusal, recipe_digest

PATIENCE = 2.0  # a worker played wrongly is a Busy in seconds, never a hang


def broker_for(fake: FakeWorker) -> Broker:
    return Broker.embedded({"w1": Worker.at(fake.endpoint, mode="project")}, patience=PATIENCE)


def done(work, output=None) -> Done:
    return Done(work.ref, work.input + 1 if output is None else output, {}, 7)


def by_digest(work) -> bool:
    """Whether ``work`` named its recipe by digest (the express way, for an unwatched call)."""
    return work.recipe is None and bool(work.recipe_digest)


#: The input the played worker answers wrongly. The calls before it warm the channel: the
#: first sends the recipe in full right behind the Hello, the second learns (from the
#: worker's Ready) that it reads every kind this client writes; from the third on, a call
#: goes the express way.
ODD = 10


def refusing_by_digest(why: str, **refusal):
    """A played worker's answers: ``Refusal(why, **refusal)`` to the ``ODD`` work named by
    digest (the express way; sent again in full, it is answered), ``done`` to the rest."""

    def answer(work):
        if work.input == ODD and by_digest(work):
            return Refusal(why, ref=work.ref, **refusal)
        return done(work)

    return answer


def warmed(node, broker) -> None:
    assert [node.forward(i, broker=broker) for i in (1, 2)] == [2, 3]


def test_a_repeated_call_names_its_recipe_in_one_frame_and_takes_its_done(played, ways):
    fake = played(done)
    node = Add(1).named("a").at("w1")
    with broker_for(fake) as broker:
        assert [node.forward(i, broker=broker) for i in range(5)] == [1, 2, 3, 4, 5]
    first, *rest = fake.works
    assert first.recipe is not None and not first.recipe_digest  # in full, the first time
    assert rest and all(by_digest(w) and not w.watched and not w.keys for w in rest)
    assert {w.recipe_digest for w in rest} == {recipe_digest(first.recipe).digest}
    assert len({w.ref for w in fake.works}) == len(fake.works)  # a ref of its own each
    assert ways == ["general"] + ["express"] * 3  # the first call goes behind the Hello, unasked


def test_a_stale_done_before_its_own_is_dropped(played, ways):
    fake = played(lambda work: (Done(work.ref + 1000, -1, {}, 1), done(work)) if work.input == ODD else done(work))
    node = Add(1).named("a").at("w1")
    with broker_for(fake) as broker:
        warmed(node, broker)
        assert node.forward(ODD, broker=broker) == ODD + 1  # a Done for another ref came first
        assert node.forward(3, broker=broker) == 4
    assert ways == ["general", "express", "express"]


def test_a_worker_without_the_recipe_gets_it_in_full_and_from_then_on(played, ways):
    fake = played(refusing_by_digest("no such recipe here", recipe=True))
    node = Add(1).named("a").at("w1")
    with broker_for(fake) as broker:
        warmed(node, broker)
        assert node.forward(ODD, broker=broker) == ODD + 1  # refused by digest, sent again in full
        assert node.forward(3, broker=broker) == 4
    # the last recipe sent in full was not kept (too big, as far as the client can tell):
    # it travels in full from then on, and is never named again on this connection
    kinds = ["digest" if by_digest(w) else "full" for w in fake.works]
    assert kinds == ["full", "digest", "digest", "full", "full"], kinds
    assert fake.works[2].ref == fake.works[3].ref  # the same work, sent again once
    assert ways == ["general", "express, then settled", "general"]


def test_a_worker_that_keeps_asking_for_the_recipe_is_refused_not_asked_forever(played, ways):
    fake = played(
        lambda work: Refusal("no such recipe here", ref=work.ref, recipe=True) if work.input == ODD else done(work)
    )
    node = Add(1).named("a").at("w1")
    with broker_for(fake) as broker:
        warmed(node, broker)
        with pytest.raises(Refused, match="no such recipe here"):
            node.forward(ODD, broker=broker)
    assert [by_digest(w) for w in fake.works] == [False, True, True, False]  # in full once, never a third time
    assert ways == ["general", "express, then settled"]


def test_a_worker_that_forgot_the_channel_is_greeted_again(played, ways):
    fake = played(refusing_by_digest("who are you?", hello=True))
    node = Add(1).named("a").at("w1")
    with broker_for(fake) as broker:
        warmed(node, broker)
        assert node.forward(ODD, broker=broker) == ODD + 1
    # greeted again: the worker holds no recipe of this channel's, so it goes in full
    assert [by_digest(w) for w in fake.works] == [False, True, True, False]
    assert ways == ["general", "express, then settled"]


def test_a_refusal_naming_no_work_is_not_taken_for_the_answer_and_nothing_is_resent(played, ways):
    fake = played(lambda work: Refusal("something went wrong") if work.input == ODD else done(work))
    node = Add(1).named("a").at("w1")
    with broker_for(fake) as broker:
        warmed(node, broker)
        with pytest.raises(Refused, match="whether it ran is not known"):
            node.forward(ODD, broker=broker)
        assert len(fake.works) == 3  # not sent again
        assert node.forward(3, broker=broker) == 4  # a fresh channel: its recipe in full again
    assert [by_digest(w) for w in fake.works] == [False, True, True, False]
    assert ways == ["general", "express, then settled"]


@pytest.mark.parametrize(
    "junk",
    [[b"\x93\x01\x02"], [b"\x8a" + b"\xa1v" * 10], [b""], [b"\x81", b"\x00" * 9]],
    ids=["a list", "keys twice", "empty", "a frame too many"],
)
def test_junk_in_answer_to_an_express_work_drops_the_channel_and_the_next_call_is_served(played, junk, ways):
    fake = played(lambda work: junk if work.input == ODD else done(work))
    node = Add(1).named("a").at("w1")
    with broker_for(fake) as broker:
        warmed(node, broker)
        with pytest.raises(ProtocolError, match="could not be taken"):
            node.forward(ODD, broker=broker)
        assert node.forward(5, broker=broker) == 6  # a fresh channel, its recipe in full
    assert [by_digest(w) for w in fake.works] == [False, True, True, False]
    assert ways == ["general", "express, then settled"]


def test_a_failure_or_an_answer_in_frames_is_taken_as_the_general_way_takes_it(played, ways):
    def answer(work):
        if work.input == 0:
            return Failed(work.ref, "ValueError: not zero", "a", "ValueError", "Traceback: ...")
        if work.input >= ODD:
            return done(work, output=np.arange(work.input))  # not a scalar: in a frame of its own
        return done(work)

    fake = played(answer)
    node = Add(1).named("a").at("w1")
    with broker_for(fake) as broker:
        warmed(node, broker)
        assert np.array_equal(node.forward(ODD, broker=broker), np.arange(ODD))
        assert node.forward(ODD + 1, broker=broker).tolist() == list(range(ODD + 1))
        with pytest.raises(NodeFailed, match="not zero") as failed:
            node.forward(0, broker=broker)
        assert failed.value.node == "a" and failed.value.host == "w1"
    assert [by_digest(w) for w in fake.works] == [False, True, True, True, True]
    assert ways == ["general", "express", "express", "express, then settled"]


def test_a_channel_taken_again_at_once_is_not_asked_about_its_link_and_one_idle_longer_is(played, monkeypatch):
    from somatize.fabric import sockets
    from somatize.fabric.client import transport

    fake = played(done)
    with broker_for(fake) as broker:
        node = Add(1).named("a").at("w1")
        assert node.forward(1, broker=broker) == 2
        looked = []  # the sockets looked at before a call (not the wait's looks at its link)
        real = sockets.readable

        def readable(sock):
            if sys._getframe(1).f_code.co_name == "dropped_while_idle":
                looked.append(sock)
            return real(sock)

        monkeypatch.setattr(sockets, "readable", readable)
        for i in range(5):  # a loop of calls: each takes the channel back within BACK_AT_ONCE
            assert node.forward(i, broker=broker) == i + 1
        channel = broker._channels.idle["w1"][0]
        assert channel.transport.monitor not in looked
        channel.transport.idle_since -= 2 * transport.BACK_AT_ONCE  # idle for longer: its link is looked at
        assert node.forward(7, broker=broker) == 8
        assert looked.count(channel.transport.monitor) >= 1
