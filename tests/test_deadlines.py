"""Deadlines: real spawned workers, a real standalone broker, real sockets.

A forward given a deadline (or sent to a host with a default one) never waits past it for
a worker: it raises ``Overdue`` naming the nodes, the host and the time, and a spawned
worker stuck in a node is started afresh on the next forward; a standalone one answers
``Busy`` until its node returns. A broker closed under a waiting call (for an answer to
Hello, for a turn, or for a node that runs for an hour) ends it ``Closed`` within a bound, and
a new broker works after it.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import fabric_nodes
import numpy as np
import pytest
import zmq
from conftest import BROKER, WORKER
from fabric_nodes import Add, Pid, Sleep
from peers import within

from somatize import Broker, Busy, Closed, Node, Overdue, SomatizeError, Worker

#: How much later than its deadline an ``Overdue`` may arrive (a poll, a thread, a hop).
MARGIN = 1.5


def spawned(**declared) -> Broker:
    return Broker.embedded({"w1": Worker.spawn(WORKER, mode="network", send=[fabric_nodes], **declared)}, patience=2.0)


def test_a_node_that_never_returns_is_overdue_naming_node_host_and_time_and_the_worker_comes_back():
    with spawned() as broker:
        pid = Pid().named("pid").at("w1").forward(0, broker=broker)  # started: the clock is the work's
        started = time.monotonic()
        with pytest.raises(
            Overdue, match=r"`stuck` on `w1` did not finish within the forward's deadline of 1 s"
        ) as caught:
            Sleep(3600).named("stuck").at("w1").forward(0, broker=broker, deadline=1.0)
        took = time.monotonic() - started
        assert 1.0 <= took < 1.0 + MARGIN, took
        assert isinstance(caught.value, TimeoutError)
        again = Pid().named("pid").at("w1").forward(0, broker=broker, deadline=30)
        assert again != pid  # the stuck one was stopped; this forward started a new one
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # and it is gone, reaped


def test_a_hosts_own_deadline_bounds_every_forward_to_it():
    # A host's deadline counts from when the Work is sent: the 3 s bound the work, never how
    # fast this machine starts a worker and unpickles its code (once before, once after)
    with spawned(deadline=3.0) as broker:
        pid = Pid().named("pid").at("w1").forward(0, broker=broker)
        started = time.monotonic()
        with pytest.raises(Overdue, match=r"`stuck` on `w1` did not finish within host `w1`'s deadline of 3 s"):
            Sleep(3600).named("stuck").at("w1").forward(0, broker=broker)
        assert time.monotonic() - started < 3.0 + MARGIN
        assert Pid().named("pid").at("w1").forward(0, broker=broker) != pid  # started afresh


#: A worker that takes 2 s to start before it is the real one: longer than its host's deadline.
SLOW_START = [
    sys.executable,
    "-c",
    "import runpy, sys, time; time.sleep(2.0); sys.argv[0] = 'somatize.worker'; "
    "runpy.run_module('somatize.worker', run_name='__main__')",
]


def test_a_hosts_deadline_counts_from_when_its_worker_is_there_not_from_its_start():
    with Broker.embedded(
        {"w1": Worker.spawn(SLOW_START, mode="network", send=[fabric_nodes], deadline=1.0)}, patience=2.0
    ) as broker:
        assert Add(1).named("a").at("w1").forward(1, broker=broker) == 2  # started in >= 2 s, then 1 s of work
        with pytest.raises(Overdue, match=r"`stuck` on `w1` did not finish within host `w1`'s deadline of 1 s"):
            Sleep(3600).named("stuck").at("w1").forward(0, broker=broker)


def test_the_sooner_deadline_wins():
    with spawned(deadline=60.0) as broker:
        started = time.monotonic()
        with pytest.raises(Overdue, match=r"the forward's deadline of 0.5 s"):
            Sleep(3600).named("stuck").at("w1").forward(0, broker=broker, deadline=0.5)
        assert time.monotonic() - started < 0.5 + MARGIN


def test_the_deadline_covers_starting_the_worker():
    with spawned() as broker:
        with pytest.raises(Overdue, match=r"`stuck` on `w1`"):
            Sleep(3600).named("stuck").at("w1").forward(0, broker=broker, deadline=0.3)


def test_work_that_finishes_in_time_is_untouched_by_its_deadline():
    with spawned() as broker:
        x = np.arange(10.0)
        out = (Add(1).named("a").at("w1") >> Add(2).named("b").at("w1")).forward(x, broker=broker, deadline=30)
        np.testing.assert_array_equal(out, x + 3)


def test_a_relayed_worker_past_the_deadline_is_overdue_then_busy_until_its_node_returns(processes):
    hub = processes([*BROKER, "--listen", "tcp://127.0.0.1:0", "--announce"])
    processes([*WORKER, "--broker", hub.endpoint, "--offer", "w1", "--mode", "network"], announce=None)
    with Broker.at(hub.endpoint, send={"w1": [fabric_nodes]}, patience=2.0) as broker:
        until = time.monotonic() + 15
        while not broker.knows("w1"):
            assert time.monotonic() < until, "w1 never dialed in"
            time.sleep(0.05)
        assert Add(1).named("a").at("w1").forward(1, broker=broker) == 2  # connected, greeted
        started = time.monotonic()
        with pytest.raises(Overdue, match=r"`stuck` on `w1` did not finish within the forward's deadline of 2 s"):
            Sleep(3600).named("stuck").at("w1").forward(0, broker=broker, deadline=2.0)
        assert time.monotonic() - started < 2.0 + MARGIN
        with pytest.raises(Busy, match=r"`w1` is busy"):  # a standalone worker is never stopped by a client
            Add(1).named("a").at("w1").forward(1, broker=broker, deadline=10)


def test_a_local_node_is_checked_between_nodes_not_interrupted():
    class Slow(Node):
        def forward(self, x):
            time.sleep(0.4)
            return x

    g = Slow().named("slow") >> Add(1).named("after")
    with pytest.raises(Overdue, match=r"before `after` could start in this process"):
        g.forward(0, deadline=0.2)


@pytest.mark.parametrize("bad", [0, -1, float("inf"), float("nan")])
def test_a_deadline_is_a_positive_finite_number_of_seconds(bad):
    with pytest.raises(ValueError, match="positive, finite number of seconds"):
        Add(1).named("a").forward(1, deadline=bad)
    with pytest.raises(TypeError, match="seconds as a number"):
        Add(1).named("a").forward(1, deadline="5")


def test_closing_the_broker_ends_a_call_waiting_on_a_worker_that_is_not_its_own(processes):
    """A call waits, with no deadline, on a listening worker running a node for an hour; the
    broker is closed from another thread (a notebook's shutdown, a service stopping). The
    call ends at once with ``Closed``, saying what happened; it did not wait the hour for
    a worker that closing the broker does not stop."""
    import threading

    from somatize import Closed

    worker = processes([*WORKER, "--listen", "127.0.0.1:0", "--announce", "--mode", "network"])
    declared = {"w1": Worker.at(worker.endpoint, mode="network", send=[fabric_nodes])}
    broker, probe = Broker.embedded(declared, patience=2.0), Broker.embedded(declared, patience=2.0)
    ended: list = []

    def call() -> None:
        try:
            Sleep(3600).named("long").at("w1").forward(0, broker=broker)
            ended.append("returned")
        except BaseException as exc:  # noqa: BLE001 - told to the test's thread
            ended.append(exc)

    def busy() -> bool:  # the worker says so to another client while the hour's node runs
        try:
            Add(1).named("inc").at("w1").forward(1, broker=probe)
        except Busy:
            return True
        return False

    thread = threading.Thread(target=call, daemon=True)
    try:
        thread.start()
        until = time.monotonic() + 30
        while not busy():
            assert time.monotonic() < until and thread.is_alive(), f"the node never ran: {ended}"
        closed_at = time.monotonic()
        broker.close()
        thread.join(MARGIN + 5)
        assert not thread.is_alive(), "the call went on waiting after its broker closed"
        assert time.monotonic() - closed_at < MARGIN + 5
        assert busy(), "the node stopped: closing a broker stops no worker it did not start"
    finally:
        broker.close()
        probe.close()
    assert len(ended) == 1 and isinstance(ended[0], Closed), ended
    assert "this client was closed" in str(ended[0]) and "`long`" in str(ended[0])


# -- Broker.close() ends a waiting call: for an answer to Hello, a turn, or a node --------


CLOSE_BOUND = 3.0  # a look is 50 ms; generous for a loaded 2-core machine


def _calling(target) -> tuple[threading.Thread, list]:
    ended: list = []

    def run() -> None:
        try:
            target()
            ended.append("returned")
        except BaseException as exc:  # noqa: BLE001 - told to the test's thread
            ended.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, ended


def _wait_for(fact, seconds: float, what: str) -> None:
    until = time.monotonic() + seconds
    while not fact():
        assert time.monotonic() < until, f"never: {what}"
        time.sleep(0.02)


def test_closing_the_broker_ends_a_call_waiting_for_an_answer_to_hello():
    """A ZeroMQ peer that takes the connection and never answers Hello; the broker's patience
    is long. Closing the broker ends the call Closed at once, not after the patience."""
    context = zmq.Context.instance()
    silent = context.socket(zmq.ROUTER)
    silent.linger = 0
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    broker = Broker.embedded({"w1": Worker.at(f"tcp://127.0.0.1:{port}", mode="project")}, patience=60.0)
    try:
        thread, ended = _calling(lambda: Add(1).named("a").at("w1").forward(1, broker=broker))
        assert silent.poll(20_000), "the Hello never arrived"
        closed_at = time.monotonic()
        broker.close()
        thread.join(CLOSE_BOUND + 5)
        assert not thread.is_alive(), "the call still waits for Hello after its broker closed"
        assert time.monotonic() - closed_at < CLOSE_BOUND
    finally:
        broker.close()
        silent.close(0)
    assert len(ended) == 1 and isinstance(ended[0], Closed), ended


def test_closing_the_broker_ends_calls_running_and_waiting_for_a_turn_and_a_new_broker_works(processes):
    """One thread's hour-long node runs on a one-job worker, two more threads of the same
    broker wait for their turn behind it. Closing the broker ends all three Closed within a
    bound; a new broker then serves the same worker (once it is free), and no thread of the
    closed broker is left."""
    worker = processes([*WORKER, "--listen", "127.0.0.1:0", "--announce", "--mode", "network"])
    declared = {"w1": Worker.at(worker.endpoint, mode="network", send=[fabric_nodes])}
    before = set(threading.enumerate())
    broker = Broker.embedded(declared, patience=2.0)
    calls = []
    try:
        calls.append(_calling(lambda: Sleep(3600).named("long").at("w1").forward(0, broker=broker)))
        _wait_for(lambda: broker._turns.running("w1") >= 1, 20, "the long call running")
        # wait until the long node really runs (a second broker is told Busy)
        with Broker.embedded(declared, patience=2.0) as probe:

            def busy() -> bool:
                try:
                    Add(1).named("inc").at("w1").forward(1, broker=probe)
                except SomatizeError:
                    return True
                return False

            _wait_for(busy, 30, "the worker busy with the long node")
        for i in range(2):
            calls.append(_calling(lambda i=i: Add(i).named(f"add{i}").at("w1").forward(1, broker=broker)))
        _wait_for(lambda: broker._turns.waiting("w1") >= 2, 20, "two calls waiting for a turn")
        closed_at = time.monotonic()
        broker.close()
        for thread, _ in calls:
            thread.join(CLOSE_BOUND + 5)
        took = time.monotonic() - closed_at
        assert all(not t.is_alive() for t, _ in calls), "a call still waits after its broker closed"
        assert took < CLOSE_BOUND, took
    finally:
        broker.close()
    outcomes = [e for _, ended in calls for e in ended]
    assert len(outcomes) == 3 and all(isinstance(e, Closed) for e in outcomes), outcomes
    left = [t for t in threading.enumerate() if t not in before and t.is_alive()]
    _wait_for(lambda: not [t for t in left if t.is_alive()], 10, f"the closed broker's threads ending: {left}")
    worker.stop()


def test_a_new_broker_works_after_one_was_closed_under_a_waiting_call():
    context = zmq.Context.instance()
    silent = context.socket(zmq.ROUTER)
    silent.linger = 0
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        first = Broker.embedded({"w1": Worker.at(f"tcp://127.0.0.1:{port}", mode="project")}, patience=60.0)
        thread, ended = _calling(lambda: Add(1).named("a").at("w1").forward(1, broker=first))
        assert silent.poll(20_000)
        first.close()
        thread.join(CLOSE_BOUND + 5)
        assert ended and isinstance(ended[0], Closed), ended
    finally:
        silent.close(0)
    # the same process, a fresh in-process broker with an in-process host: still works
    with Broker.embedded({"w2": Worker.inprocess()}) as second:
        assert within(20, lambda: Add(2).named("b").at("w2").forward(1, broker=second)) == 3
