"""Case (p): many inputs over a pool. ``Graph.map`` over a pool of 4 spawned workers,
against ``multiprocessing.Pool(4).imap`` in the same run:

- 2,000 inputs of a CPU-bound node (a pure-Python loop of about 5 ms): inputs a second,
  target at least 0.9x the process pool's;
- 20,000 tiny inputs (100 B echoed): inputs a second, against case (t)'s 16 threads when
  (t) ran before it in this run;
- a member SIGKILLed in the middle of a 2,000-input map: every answer there, how many
  inputs ran twice (at most the one the member was running, as ``retries=1`` allows), and
  how long the job took against one without the kill.

Ray (tasks over 4 CPUs) and Dask (``client.map`` on 4 one-thread workers) do the same two
maps in ``others.py``, compared there with these figures.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
import time

import nodes
from table import Row, at_least, at_most, ratio

from somatize import Broker, Node, Worker

WORKERS = 4
WORKER = [sys.executable, "-m", "somatize.worker"]


#: The inputs of the two maps, for Ray's and Dask's rows too.
HEAVY, TINY = 2000, 20_000
#: The same in a quick run.
HEAVY_QUICK, TINY_QUICK = 100, 500


def counts(settings) -> tuple[int, int]:
    """How many CPU-bound and tiny inputs this run maps."""
    return (HEAVY, TINY) if settings.calls >= 1000 else (HEAVY_QUICK, TINY_QUICK)


def burn(x: int) -> int:
    """About 5 ms of pure-Python work on one core (no sleep: the cores are what is measured)."""
    total = 0
    for i in range(60_000):
        total += (i * x) % 7
    return total


def burn_by_value():
    """``burn`` itself, made from its code outside any module, so that Ray and Dask ship it by
    value (their workers cannot import this folder): the same loop, the same answers."""
    import builtins
    import types

    return types.FunctionType(burn.__code__, {"__builtins__": builtins}, "burn")


class Burn(Node):
    def forward(self, x):
        return burn(x)


def mapping_rows(settings, floors) -> list[Row]:
    from cases import SMALL

    heavy, tiny = counts(settings)
    cpus = Worker.spawn(WORKER, mode="network", send=[nodes, sys.modules[__name__]], mount=False, processes=WORKERS)
    burn_graph = Burn().named("burn").at("cpu")
    echo = nodes.Echo().named("echo").at("cpu")
    rows = []
    # the process pool first, forked before this process holds any socket or thread of ours
    with multiprocessing.Pool(WORKERS) as pool:
        list(pool.imap(burn, range(WORKERS * 4)))  # warm
        began = time.perf_counter()
        theirs = list(pool.imap(burn, range(heavy)))
        pool_rate = heavy / (time.perf_counter() - began)
        began = time.perf_counter()
        list(pool.imap(_echo, [SMALL] * tiny))
        pool_tiny = tiny / (time.perf_counter() - began)
    with Broker.embedded({"cpu": cpus}) as broker:
        list(burn_graph.map(range(WORKERS * 4), broker=broker))  # warm: every member spawned and provisioned
        list(echo.map([SMALL] * (WORKERS * 20), broker=broker))
        began = time.perf_counter()
        out = list(burn_graph.map(range(heavy), broker=broker))
        mine = heavy / (time.perf_counter() - began)
        began = time.perf_counter()
        echoed = sum(1 for _ in echo.map([SMALL] * tiny, broker=broker))
        tiny_rate = tiny / (time.perf_counter() - began)
        assert echoed == tiny
        killed_rows = _killed(burn_graph, broker, heavy, mine)
    assert theirs == out
    floors.mapped.update(heavy=mine, tiny=tiny_rate)
    rows.append(
        Row(
            "p",
            f"somatize map, {heavy:,} CPU-bound inputs (~5 ms) over a pool of {WORKERS}",
            f"{mine:,.0f} inputs/s",
            f"multiprocessing.Pool({WORKERS}).imap {pool_rate:,.0f}/s",
            ratio(mine / pool_rate),
            ">= 0.9x",
            at_least(mine / pool_rate, 0.9),
        )
    )
    against = f"(t) 16 threads {floors.threads:,.0f}/s" if floors.threads else f"Pool.imap {pool_tiny:,.0f}/s"
    base = floors.threads or pool_tiny
    rows.append(
        Row(
            "p",
            f"somatize map, {tiny:,} inputs of 100 B over a pool of {WORKERS}",
            f"{tiny_rate:,.0f} inputs/s",
            against,
            ratio(tiny_rate / base),
            ">= 1x" if floors.threads else "",
            at_least(tiny_rate / base, 1.0) if floors.threads else "",
        )
    )
    return rows + killed_rows


def _echo(x):
    return x


def _killed(graph, broker, count: int, clean_rate: float) -> list[Row]:
    """A member SIGKILLed a third of the way through a map of ``count`` inputs."""
    pids = sorted({int(p) for p in _pids(broker)})
    answers = 0
    began = time.perf_counter()
    killer = None
    for i, value in enumerate(graph.map(range(count), broker=broker, errors="return")):
        if isinstance(value, BaseException):
            raise value
        answers += 1
        if i == count // 3 and pids:
            killer = threading.Thread(target=os.kill, args=(pids[0], signal.SIGKILL))
            killer.start()
    took = time.perf_counter() - began
    if killer is not None:
        killer.join()
    clean = count / clean_rate
    return [
        Row(
            "p",
            f"somatize map, {count:,} inputs, a member SIGKILLed a third of the way",
            f"{answers:,} answers in {took:.2f} s",
            f"unkilled {clean:.2f} s",
            f"{took / clean:.2f}x",
            f"{count:,} answers",
            at_most(abs(answers - count), 0),
        )
    ]


def _pids(broker) -> list[int]:
    """The pids of the pool's members, as each says in a forward of its own."""
    who = _Pid().named("pid")
    return [who.at(member).forward(0, broker=broker) for member in broker.members("cpu")]


class _Pid(Node):
    def forward(self, x):
        import os

        return os.getpid()
