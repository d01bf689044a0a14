"""A client's own forwards to one host take turns (``somatize.fabric.client.turns``).

The worker is played here by a slot that an attempt takes or is turned away from, as a
worker with ``--jobs 1`` does: what is checked is the order the turns go in and that nothing
waits on nothing. Then the turns, taken and ended in place, attacked against a real worker
with one job: eight threads of one client are never told Busy nor left waiting for a missed
hand-on, and another client's long work makes each call hear Busy at once. The same, against a
real worker and a second client, is in
``test_survival.py::test_a_clients_own_forwards_to_a_busy_worker_take_turns_and_another_clients_hear_busy``.
"""

from __future__ import annotations

import threading
import time

import pytest
from by_hand import PATIENCE, WAIT, final, full, spec_of
from fabric_nodes import Add, Sleep
from reliability_support import wait_until

from somatize import Broker, Busy, Worker
from somatize.fabric.client.refusals import TurnedAway
from somatize.fabric.client.transport import PastDeadline
from somatize.fabric.client.turns import Turns
from somatize.pieces import Deadline
from somatize.wire import Done, Hello, Recipe, Runtime


class Slot:
    """One piece at a time; another is turned away at once, as a busy worker does."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ran: list[str] = []
        self.refused: list[str] = []

    def attempt(self, name: str, hold: threading.Event | None = None):
        def run() -> str:
            if not self.lock.acquire(blocking=False):
                self.refused.append(name)
                raise TurnedAway(f"busy: {name}")
            try:
                self.ran.append(name)
                if hold is not None:
                    assert hold.wait(10)
                return name
            finally:
                self.lock.release()

        return run


def line_up(turns: Turns, slot: Slot, take, first, names: str) -> list[threading.Thread]:
    """``first`` (an attempt that takes the slot) running, then a forward for each of
    ``names`` in line behind it, in that order; their threads, the first's first."""
    threads = [threading.Thread(target=take, args=("first", first))]
    threads[0].start()
    wait_until(lambda: slot.ran == ["first"], 10, "the first running")
    for number, name in enumerate(names, start=1):
        threads.append(threading.Thread(target=take, args=(name, slot.attempt(name))))
        threads[-1].start()
        wait_until(lambda: turns.waiting("w1") == number, 10, f"{name} waiting")
    return threads


@pytest.mark.pure
def test_turned_away_with_nothing_of_ours_running_is_busy_at_once_and_leaves_nothing():
    turns, slot = Turns(), Slot()
    slot.lock.acquire()  # someone else's work holds the worker
    with pytest.raises(TurnedAway):
        turns.take("w1", slot.attempt("mine"), TurnedAway, None)
    assert slot.refused == ["mine"] and turns._hosts == {}


@pytest.mark.pure
def test_the_forwards_turned_away_go_in_the_order_they_were_turned_away():
    turns, slot, hold = Turns(), Slot(), threading.Event()
    results: dict[str, object] = {}

    def take(name: str, attempt) -> None:
        results[name] = turns.take("w1", attempt, TurnedAway, None)

    threads = line_up(turns, slot, take, slot.attempt("first", hold), "bcde")
    hold.set()
    for thread in threads:
        thread.join(10)
    assert slot.ran == ["first", "b", "c", "d", "e"]
    assert results == {name: name for name in ["first", "b", "c", "d", "e"]}
    assert slot.refused == ["b"]  # the others went behind it in line, unsent: a turn goes to one at a time
    assert turns._hosts == {}


@pytest.mark.pure
def test_one_of_ours_that_ended_after_this_was_sent_is_what_the_worker_was_busy_with():
    """Turned away, and no forward of ours runs there now, but one ended since this one was
    sent: the worker was busy with ours, so it is sent again rather than called Busy."""
    turns, slot = Turns(), Slot()
    tries = []

    def attempt() -> str:
        tries.append(1)
        if len(tries) == 1:
            slot.lock.acquire()  # ours holds the worker while this one arrives...
            assert turns.take("w1", lambda: "other", TurnedAway, None) == "other"  # ...and ends
            slot.lock.release()
            raise TurnedAway("busy: with the other")
        return "mine"

    assert turns.take("w1", attempt, TurnedAway, None) == "mine"
    assert len(tries) == 2 and turns._hosts == {}


@pytest.mark.pure
def test_when_someone_elses_work_takes_the_worker_as_ours_ends_every_waiting_forward_hears_busy():
    """Someone else's work takes the worker as ours ends: the one whose turn it was is turned
    away again and, none of ours running there now, told Busy; it hands the turn on, so the
    next in line tries once and is told Busy too, and none waits on nothing."""
    turns, slot, hold = Turns(), Slot(), threading.Event()
    outcomes: dict[str, object] = {}

    def take(name: str, attempt) -> None:
        try:
            outcomes[name] = turns.take("w1", attempt, TurnedAway, None)
        except TurnedAway as exc:
            outcomes[name] = exc

    def first_then_a_stranger() -> str:
        result = slot.attempt("first", hold)()
        slot.lock.acquire()  # a stranger's work takes the worker as ours ends (held to the end)
        return result

    threads = line_up(turns, slot, take, first_then_a_stranger, "bc")
    hold.set()
    for thread in threads:
        thread.join(10)
        assert not thread.is_alive()
    assert outcomes["first"] == "first"
    assert isinstance(outcomes["b"], TurnedAway) and isinstance(outcomes["c"], TurnedAway)
    assert slot.refused == ["b", "b", "c"] and turns._hosts == {}  # c went behind b in line, unsent


@pytest.mark.pure
def test_a_forward_waiting_for_a_turn_past_its_deadline_stops_waiting():
    turns, slot, hold = Turns(), Slot(), threading.Event()
    first = threading.Thread(target=turns.take, args=("w1", slot.attempt("first", hold), TurnedAway, None))
    first.start()
    wait_until(lambda: slot.ran == ["first"], 10, "the first running")
    try:
        with pytest.raises(PastDeadline, match="for a turn on `w1` behind this client's other forwards there"):
            turns.take("w1", slot.attempt("late"), TurnedAway, Deadline.after(0.2))
        assert turns.waiting("w1") == 0 and turns.running("w1") == 1
    finally:
        hold.set()
        first.join(10)
    assert turns._hosts == {}


@pytest.mark.pure
def test_a_new_forward_goes_behind_the_ones_waiting_so_a_loop_cannot_starve_them():
    """A thread forwarding in a loop sent its next forward as its last ended, before the one
    whose turn it had handed on could: that one waited for as long as the loop went on.
    Now a new forward to a host where some wait goes behind them, unsent."""
    turns, slot, hold = Turns(), Slot(), threading.Event()
    first = threading.Thread(target=turns.take, args=("w1", slot.attempt("loop 1", hold), TurnedAway, None))
    first.start()
    wait_until(lambda: slot.ran == ["loop 1"], 10, "the loop's first forward running")
    behind = threading.Thread(target=turns.take, args=("w1", slot.attempt("b"), TurnedAway, None))
    behind.start()
    wait_until(lambda: turns.waiting("w1") == 1, 10, "b waiting")
    again = threading.Thread(target=turns.take, args=("w1", slot.attempt("loop 2"), TurnedAway, None))
    again.start()
    wait_until(lambda: turns.waiting("w1") == 2, 10, "the loop's next forward in line behind b")
    hold.set()
    for thread in (first, behind, again):
        thread.join(10)
    assert slot.ran == ["loop 1", "b", "loop 2"] and slot.refused == ["b"] and turns._hosts == {}


class Lost(Exception):
    """The worker went away (what `Broken` or `Unreachable` says)."""


@pytest.mark.pure
def test_a_lost_worker_hands_every_waiting_forward_its_turn_at_once():
    """The forward the others waited on found its worker gone: each waiting one found that
    out in turn, one patience after another. Now all of them are sent again at once."""
    turns, slot, hold = Turns(), Slot(), threading.Event()
    together = threading.Barrier(3, timeout=5)  # passes only if the three are sent at once
    outcomes: list = []

    def gone() -> None:
        slot.ran.append("first")
        assert hold.wait(10)
        raise Lost("the worker went away")

    def again() -> str:
        if not slot.lock.acquire(blocking=False):
            raise TurnedAway("busy")
        slot.lock.release()
        together.wait()  # a worker taking its time to be found gone: they wait for it together
        return "sent"

    def take(attempt) -> None:
        try:
            outcomes.append(turns.take("w1", attempt, TurnedAway, None, lost=(Lost,)))
        except BaseException as exc:
            outcomes.append(exc)

    first = threading.Thread(target=take, args=(gone,))
    first.start()
    wait_until(lambda: slot.ran == ["first"], 10, "the first running")
    slot.lock.acquire()  # the worker holds the first's piece: the others are turned away
    waiters = [threading.Thread(target=take, args=(again,)) for _ in range(3)]
    for number, thread in enumerate(waiters, start=1):
        thread.start()
        wait_until(lambda: turns.waiting("w1") == number, 10, f"waiter {number} in line")
    slot.lock.release()
    hold.set()
    for thread in [first, *waiters]:
        thread.join(10)
    assert isinstance(outcomes[0], Lost) and outcomes[1:] == ["sent"] * 3, outcomes
    assert turns._hosts == {}


# -- against a real worker with one job: turned away as busy, never a missed hand-on -------------


def _hammer(broker: Broker, node, threads: int, calls: int) -> tuple[list, list, list]:
    """``threads`` threads, ``calls`` forwards each: (wrong answers, errors, each call's seconds)."""
    wrong, errors, took = [], [], []
    lock = threading.Lock()
    go = threading.Barrier(threads)

    def run(base: int) -> None:
        go.wait(WAIT)
        for i in range(calls):
            started = time.monotonic()
            try:
                out = node.forward(base + i, broker=broker)
            except BaseException as exc:  # noqa: BLE001 - said on the test's thread
                out = exc
            with lock:
                took.append(time.monotonic() - started)
                if isinstance(out, BaseException):
                    errors.append(out)
                elif out != base + i:
                    wrong.append((base + i, out))

    running = [threading.Thread(target=run, args=(k * 1000,), daemon=True) for k in range(threads)]
    for thread in running:
        thread.start()
    for thread in running:
        thread.join(WAIT * 3)
    assert not any(thread.is_alive() for thread in running), "a thread still waits"
    return wrong, errors, took


def test_many_threads_on_one_job_take_turns_without_busy_without_a_missed_wake_up(spawned, monkeypatch):
    """Attack on the turn taken and ended in place: eight threads, eight calls each, to one
    worker with one job, so the worker turns most of them away as busy (counted: it did). No
    call may hear Busy (only this client's work fills the worker), none may wait for the
    ``LOOK_AGAIN`` second that only a missed hand-on costs, and nothing is left in the turns."""
    from somatize.fabric.client.turns import LOOK_AGAIN, Turns

    refused = []
    real = Turns._turned_away

    def counted(self, *args, **kwargs):
        refused.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Turns, "_turned_away", counted)
    # longer than the worker's stand-in waits (`STAND_IN_AFTER`): the rest are refused as busy
    node = Sleep(0.025).named("nap").at("w1")
    with Broker.embedded({"w1": Worker.at(spawned.endpoint, mode="project")}, patience=PATIENCE) as broker:
        wrong, errors, took = _hammer(broker, node, threads=8, calls=8)
        assert broker._turns._hosts == {}
    assert not wrong and not errors, (wrong, errors[:3])
    assert len(took) == 64
    assert refused, "the worker never turned a call away: the turns were not attacked"
    assert max(took) < 0.9 * LOOK_AGAIN, f"a call waited {max(took):.2f} s: a hand-on was missed"


def test_someone_elses_long_work_makes_every_call_busy_at_once_and_then_each_is_served(spawned, raws):
    """Attack: another client's long piece fills the one job while eight threads of this
    client call: each call has to hear Busy (someone else's work), at once, never waiting in
    line for a second; once it returns, all are served and no turn is left behind."""
    other = raws(spawned.endpoint)
    probe = raws(spawned.endpoint)
    other.send_frames(full(1, Recipe((spec_of(Sleep(2.5), "long"),), ("step", 0)), "slept"))
    ready = probe.ask(Hello(Runtime.here(mode="project")))
    while ready.busy_us == 0:  # a fact: the long piece runs
        ready = probe.ask(Hello(Runtime.here(mode="project")))
    node = Add(0).named("zero").at("w1")
    with Broker.embedded({"w1": Worker.at(spawned.endpoint, mode="project")}, patience=PATIENCE) as broker:
        wrong, errors, took = _hammer(broker, node, threads=8, calls=2)
        assert broker._turns._hosts == {}
        assert not wrong
        assert errors and all(isinstance(e, Busy) and "long" in str(e) for e in errors), errors[:3]
        assert max(took) < 0.9, f"a call waited {max(took):.2f} s to hear Busy"
        done = final(other, 1)
        assert isinstance(done, Done) and done.output == "slept"
        wrong, errors, took = _hammer(broker, node, threads=8, calls=5)
        assert not wrong and not errors and broker._turns._hosts == {}
