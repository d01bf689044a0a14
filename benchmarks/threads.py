"""Case (t): many calls at once. 16 threads of one client forward a small value, each to one
of 4 spawned workers (Direct, 4 threads a worker), and the forwards a second they make
together are the result. Ray does the same in ``others.py``: 16 threads calling 4 actors,
and its asynchronous way (every call submitted, then one ``ray.get``); somatize's figure is
compared there with the better of Ray's two.

A round starts every thread at once (a barrier) and ends when the last one is done; the
median of a few rounds is taken, so one disturbed round does not decide.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator

import nodes
from nodes import Echo
from table import Row, median

from somatize import Broker, Worker

THREADS = 16
WORKERS = 4
ROUNDS = 5
WORKER = [sys.executable, "-m", "somatize.worker"]


def rate(call_for: Callable[[int], Callable[[], object]], threads: int, calls: int, rounds: int = ROUNDS) -> float:
    """Calls a second of ``threads`` threads making ``calls`` calls each, ``call_for(i)``
    being thread i's call: the median over ``rounds`` rounds."""
    rates = []
    for _ in range(rounds):
        start = threading.Barrier(threads + 1)
        failed: list[BaseException] = []

        def run(call: Callable[[], object]) -> None:
            start.wait()
            try:
                for _ in range(calls):
                    call()
            except BaseException as exc:  # said after the round, in the calling thread
                failed.append(exc)

        workers = [threading.Thread(target=run, args=(call_for(i),), daemon=True) for i in range(threads)]
        for thread in workers:
            thread.start()
        start.wait()
        began = time.perf_counter()
        for thread in workers:
            thread.join()
        took = time.perf_counter() - began
        if failed:
            raise failed[0]
        rates.append(threads * calls / took)
    return median(rates)


@contextlib.contextmanager
def four_workers() -> Iterator[Broker]:
    """4 spawned network-mode workers, each reached Direct."""
    hosts = {f"w{i + 1}": Worker.spawn(WORKER, mode="network", send=[nodes], mount=False) for i in range(WORKERS)}
    with Broker.embedded(hosts) as broker:
        yield broker


def threads_rows(settings, floors) -> list[Row]:
    from cases import SMALL  # cases imports this module

    echoes = [Echo().named(f"echo{i}").at(f"w{i % WORKERS + 1}") for i in range(THREADS)]
    with four_workers() as broker:
        for echo in echoes:  # warm: every worker spawned, provisioned, connected from each thread's first call
            assert echo.forward(SMALL, broker=broker) == SMALL

        def call_for(i: int) -> Callable[[], object]:
            echo = echoes[i]

            def call() -> None:
                if echo.forward(SMALL, broker=broker) != SMALL:
                    raise AssertionError("the value came back changed")

            return call

        rate(call_for, THREADS, max(2, settings.calls // 200), rounds=1)  # warm: each thread's own channel
        mine = rate(call_for, THREADS, settings.calls // 8)
        one = rate(call_for, 1, settings.calls // 2)
    floors.threads = mine
    return [
        Row(
            "t",
            f"somatize, {THREADS} threads to {WORKERS} workers, 100 B",
            f"{mine:,.0f} forwards/s",
            f"1 thread {one:,.0f}/s",
            f"{mine / one:.2f}x",
        ),
    ]
