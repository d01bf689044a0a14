"""The client's express way: a repeated small call, its ``Work`` written in one frame, against a
worker played by hand on a real socket that answers what it likes.

A call nobody watches, with no deadline, whose recipe the worker holds for the connection and
whose input is one scalar goes out the short way (``Channel._express``); everything that
comes back other than its own ``Done`` is taken exactly as the general way takes it: a stale
answer dropped, a request for the recipe in full or to greet again met once, a refusal that
names no work never taken for its answer, junk refused with the channel dropped. A Done out of
turn is taken alike by the express call and the general ones (with a deadline, watched).

A channel given back and taken again within ``BACK_AT_ONCE`` is not asked whether its link
dropped: against real workers killed, restarted on the same port, or its sockets closed under
it while idle, a call ends with its answer or a typed error in bounded time, and the next one
is served.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np
import pytest
from by_hand import MARGIN, TYPED, WAIT, free_port
from conftest import WORKER, Process
from fabric_nodes import Add
from peers import RT, FakeWorker, within
from reliability_support import child_env

from somatize import Broker, KeysRefused, NodeFailed, ProtocolError, Refused, SomatizeError, Worker
from somatize.fabric.client import transport
from somatize.wire import Done, Failed, Ready, Refusal, Send, recipe_digest

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


# -- a channel taken back at once is not asked about its link: workers killed, restarted, closed --


@pytest.fixture
def procs(tmp_path):
    """Start processes with ``procs(argv)`` (this tree importable); each is stopped and reaped after."""
    started: list[Process] = []

    def start(argv: list[str]) -> Process:
        process = Process(argv, logs=tmp_path / "logs", env=child_env())
        started.append(process)
        return process

    yield start
    for process in reversed(started):
        process.stop()


def _listening(port: int) -> list[str]:
    return [*WORKER, "--listen", f"127.0.0.1:{port}", "--announce"]


def _idle_channel(broker: Broker, host: str = "w1"):
    (channel,) = broker._channels.idle[host]
    return channel


def test_a_worker_killed_and_restarted_between_two_calls_is_recovered_as_before(procs):
    """Attack: SIGKILL, then a new worker on the same port, between two calls. The second call
    comes long after the first's answer (the restart takes far more than ``BACK_AT_ONCE``), so
    the channel is asked whether its link dropped, and a fresh one serves it: the caller sees
    nothing, as before the change."""
    port = free_port()
    worker = procs(_listening(port))
    node = Add(1).named("inc").at("w1")
    with Broker.embedded({"w1": Worker.at(f"tcp://127.0.0.1:{port}", mode="project")}, patience=PATIENCE) as broker:
        for round_ in range(1):
            assert [node.forward(i, broker=broker) for i in range(3)] == [1, 2, 3]
            worker.signal(signal.SIGKILL)
            worker.popen.wait(WAIT)
            worker = procs(_listening(port))
            assert within(WAIT, lambda: [node.forward(i, broker=broker) for i in range(3)]) == [1, 2, 3], round_


def test_a_worker_killed_right_after_answering_fails_the_next_call_typed_or_serves_it(procs, monkeypatch):
    """Attack: the worker is SIGKILLed the instant it has answered, and the next call follows
    at once, on the same thread, within ``BACK_AT_ONCE`` of the answer as a rule: its channel
    is taken back unasked and its Work goes down a link that is dying or dead. The last round
    makes sure of the window (the channel marked given back just now, right after the kill,
    the worker still dying). Each such call has to end within a patience or so with a typed
    error (or its answer, if the kill lost the race), never a hang or a wrong value; once a
    worker is back on the port, calls are served again. How soon after its give-back each
    channel was taken again is recorded."""
    taken_after: list[float] = []
    real = transport.Transport.dropped_while_idle

    def timed(self):
        taken_after.append(time.monotonic() - self.idle_since)
        return real(self)

    monkeypatch.setattr(transport.Transport, "dropped_while_idle", timed)
    port = free_port()
    worker = procs(_listening(port))
    node = Add(1).named("inc").at("w1")
    outcomes, post_kill = [], []
    # a link that hangs up during its handshake is read as keys refused: the pre-existing
    # misreading pinned by `test_a_peer_that_hangs_up_during_the_handshake_...` below
    tolerated = (*TYPED, KeysRefused)
    with Broker.embedded({"w1": Worker.at(f"tcp://127.0.0.1:{port}", mode="project")}, patience=PATIENCE) as broker:
        for round_ in range(2):
            assert [node.forward(i, broker=broker) for i in range(3)] == [1, 2, 3]
            os.kill(worker.pid, signal.SIGKILL)
            if round_ == 1:  # the window, for certain: its give-back stamped ahead, so no
                # scheduling delay on a busy machine can carry the borrow past it
                _idle_channel(broker).transport.idle_since = time.monotonic() + 3600
            looked = len(taken_after)
            started = time.monotonic()
            try:  # on this thread: a thread of its own would start the call too late
                outcomes.append(node.forward(41, broker=broker))
            except tolerated as exc:
                outcomes.append(type(exc))
            assert time.monotonic() - started < PATIENCE * 4 + MARGIN
            post_kill.extend(taken_after[looked : looked + 1])
            worker.popen.wait(WAIT)
            worker = procs(_listening(port))
            served = None
            for _ in range(3):  # back: the first call or the next serves
                try:
                    served = within(WAIT, lambda: node.forward(9, broker=broker))
                    break
                except tolerated:
                    continue
            assert served == 10, round_
    assert all(o == 42 or o in tolerated for o in outcomes), outcomes
    assert post_kill[-1] < transport.BACK_AT_ONCE, post_kill


@pytest.mark.parametrize("restarted", [False, True], ids=["dead", "restarted on the port"])
def test_a_channel_taken_back_unasked_after_its_worker_died_ends_typed_and_recovers(procs, restarted):
    """Attack, made certain: the worker is killed and reaped (its link's drop already told),
    optionally replaced on the same port, and its idle channel is then taken back as if just
    given back (``idle_since`` stamped ahead: the check is skipped for certain). The call must end in
    bounded time with a typed error or its right answer; the calls after it are served once
    a worker is there."""
    port = free_port()
    worker = procs(_listening(port))
    node = Add(1).named("inc").at("w1")
    with Broker.embedded({"w1": Worker.at(f"tcp://127.0.0.1:{port}", mode="project")}, patience=PATIENCE) as broker:
        assert [node.forward(i, broker=broker) for i in range(3)] == [1, 2, 3]
        worker.signal(signal.SIGKILL)
        worker.popen.wait(WAIT)
        if restarted:
            worker = procs(_listening(port))
        _idle_channel(broker).transport.idle_since = time.monotonic() + 3600  # stamped ahead: never asked
        started = time.monotonic()
        try:
            outcome = within(PATIENCE * 4 + MARGIN, lambda: node.forward(41, broker=broker))
        except TYPED as exc:
            outcome = exc
        assert outcome == 42 or isinstance(outcome, TYPED), outcome
        assert time.monotonic() - started < PATIENCE * 3 + MARGIN
        if not restarted:
            with pytest.raises(TYPED):  # nobody there: said within a patience or so
                within(PATIENCE * 4 + MARGIN, lambda: node.forward(1, broker=broker))
            worker = procs(_listening(port))
        assert within(WAIT, lambda: [node.forward(i, broker=broker) for i in range(3)]) == [1, 2, 3]
        assert broker._turns._hosts == {}


@pytest.mark.parametrize("closed", ["the channel", "its socket alone"])
@pytest.mark.parametrize("when", ["at once", "after the window"])
def test_a_channel_closed_while_idle_then_taken_again_ends_typed_and_the_next_call_is_served(spawned, closed, when):
    """Attack: a channel sitting idle in the broker's pool has its sockets (or only its
    DEALER) closed under it, then is taken again, within ``BACK_AT_ONCE`` of its give-back
    (not asked about its link) or after it (asked: its monitor raises, so a fresh channel
    serves). Either way the call ends with its answer or a somatize error, never a bare
    ``zmq.ZMQError`` or a hang, and the call after it is served."""
    node = Add(1).named("inc").at("w1")
    with Broker.embedded({"w1": Worker.at(spawned.endpoint, mode="project")}, patience=PATIENCE) as broker:
        assert node.forward(1, broker=broker) == 2
        channel = _idle_channel(broker)
        if closed == "the channel":
            channel.close()
        else:
            channel.transport.sock.close(0)
        channel.transport.idle_since = time.monotonic() + (3600 if when == "at once" else -1.0)  # ahead: never asked
        try:
            outcome = within(WAIT, lambda: node.forward(2, broker=broker))
        except SomatizeError as exc:
            outcome = exc
        if when == "after the window" and closed == "the channel":
            assert outcome == 3  # its monitor was asked: a fresh channel, as before the change
        assert outcome == 3 or isinstance(outcome, SomatizeError), outcome
        assert within(WAIT, lambda: [node.forward(i, broker=broker) for i in range(3)]) == [1, 2, 3]


# -- a Done out of turn, taken alike however the call was made --------------------------------------


WAYS = {"express": {}, "deadline": {"deadline": 60.0}, "watched": {"watching": lambda fact: None}}


def _answer_to(scenario: str):
    def answer(work):
        right = Done(work.ref, work.input + 1, {}, 7)
        if work.input != ODD:
            return right
        wrong = Done(work.ref, -1, {}, 7)
        if scenario == "another ref first":
            return Done(work.ref + 1000, -1, {}, 7), right
        if scenario == "answered twice":
            return right, wrong
        if scenario == "busy, then a done":
            return Refusal("busy: someone else's", ref=work.ref), wrong
        if scenario == "a failure, then a done":
            return Failed(work.ref, "ValueError: no", "a", "ValueError", ""), wrong
        if scenario == "a send for nothing, then a done":
            return Send(work.ref + 1000, ("sha256:" + "b" * 64,)), right
        raise AssertionError(scenario)

    return answer


def _ended(fake: FakeWorker, call) -> tuple:
    """How ``call`` ended: ("value", it), or the class and first line of what it raised (the
    played worker's endpoint, which differs from one to the next, left out)."""
    try:
        return ("value", within(WAIT, call))
    except SomatizeError as exc:
        return (type(exc).__name__, str(exc).splitlines()[0].replace(fake.endpoint, "<endpoint>"))


SCENARIOS = [
    "another ref first",
    "answered twice",
    "busy, then a done",
    "a failure, then a done",
    "a send for nothing, then a done",
]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_a_done_out_of_turn_is_taken_alike_by_the_express_call_and_the_general_ones(played, scenario):
    """Attack over a real socket on the client's one-look Done: a Done for another ref before
    its own, a second Done for a work already answered, a Done after the work was refused as
    busy or failed. The call (express, with a deadline, watched) ends the same way each time,
    and the stray Done is dropped as stale by the next call: never taken for its answer."""
    outcomes = {}
    for way, options in WAYS.items():
        fake = played(_answer_to(scenario))
        node = Add(1).named("a").at("w1")
        with Broker.embedded({"w1": Worker.at(fake.endpoint, mode="project")}, patience=PATIENCE) as broker:
            assert [node.forward(i, broker=broker, **options) for i in (1, 2)] == [2, 3]
            outcomes[way] = _ended(fake, lambda o=options: node.forward(ODD, broker=broker, **o))
            assert [node.forward(i, broker=broker, **options) for i in (3, 4)] == [4, 5], way  # never -1
            outcomes[way] += (len(fake.hellos), len(fake.works))  # greeted again, sent again: alike
    assert outcomes["express"] == outcomes["deadline"] == outcomes["watched"], outcomes


def test_a_done_arriving_while_greeting_is_refused_alike_whichever_way_the_call_went(played, monkeypatch):
    """Attack: the played worker answers the Hello with a Done (for the very Work that went
    right behind the Hello) before its Ready. The exchange is greeting, not working: the Done
    may not be taken, however the call was made, and the next call is served on a fresh
    channel."""
    import itertools

    from somatize.fabric.client import channel as channel_module

    outcomes = {}
    for way, options in WAYS.items():
        monkeypatch.setattr(channel_module, "_refs", itertools.count(5000))
        fake = played(
            lambda work: Done(work.ref, work.input + 1, {}, 7),
            greet=lambda hello, n: (Done(5000, -1, {}, 7), Ready(RT)) if n == 1 else Ready(RT),
        )
        node = Add(1).named("a").at("w1")
        with Broker.embedded({"w1": Worker.at(fake.endpoint, mode="project")}, patience=PATIENCE) as broker:
            outcomes[way] = _ended(fake, lambda o=options: node.forward(1, broker=broker, **o))
            assert within(WAIT, lambda o=options: node.forward(3, broker=broker, **o)) == 4
    assert outcomes["express"] == outcomes["deadline"] == outcomes["watched"], outcomes
    assert outcomes["express"][0] == "ProtocolError", outcomes
