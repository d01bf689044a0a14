"""Ray and Dask, doing what cases (a), (b), (d), (t) and (p) ask of somatize, when they are installed.

Each system is started on its own, after somatize's cases, and shut down before the next:
their background processes would otherwise load the two cores under somatize's numbers.
The equivalents chosen are each system's idiomatic one:

- (a) Ray: a call on an actor holding the node. Dask: ``client.submit(...).result()`` on a
  one-process, one-thread ``LocalCluster``.
- (b) the same, with the array as the argument and the answer. Dask gets it ``scatter``-ed
  to the worker first (what Dask advises for big arguments), in the timed part.
- (t) Ray only: 16 threads calling 4 actors (4 threads an actor), and Ray's asynchronous
  way, every call submitted from one thread and then one ``ray.get`` of them all.
- (d) Dask only: a chain of 200 ``dask.delayed`` calls on the local threaded scheduler.
  Ray has no local graph engine to compare.
- (p) many inputs over 4 workers, the CPU-bound ones and the tiny ones of ``mapping.py``.
  Ray: tasks over 4 CPUs, every one submitted and then one ``ray.get``; for the tiny inputs
  also ``ActorPool.map`` over 4 actors, and the better of the two is compared. Dask:
  ``client.map`` then ``client.gather`` on a ``LocalCluster`` of 4 one-thread processes.

A system that is not installed, or fails to start, gives rows that say so.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable

import numpy as np
from cases import CHAIN, SMALL, Floors, Settings
from mapping import burn_by_value, counts
from table import Row, at_least, gbps, interleaved, median, p99, ratio, repeated, size, us
from threads import THREADS, WORKERS, rate


def _small_rows(system: str, samples: list[float], floors: Floors) -> list[Row]:
    mine = median(samples)
    against = ratio(mine / floors.small) if floors.small else ""
    return [
        Row(
            "a",
            f"{system}, 100 B round trip",
            f"{us(mine)} median, {us(p99(samples))} p99",
            f"raw {us(floors.small)}" if floors.small else "",
            against,
        )
    ]


def _array_rows(system: str, speeds: dict[int, float], floors: Floors, how: str) -> list[Row]:
    rows = []
    for nbytes, speed in speeds.items():
        raw = floors.arrays.get(nbytes)
        rows.append(
            Row(
                "b",
                f"{system} {how}, numpy {size(nbytes)}",
                f"{speed:.2f} GB/s",
                f"raw {raw:.2f} GB/s" if raw else "",
                ratio(speed / raw) if raw else "",
            )
        )
        if system == "Ray":  # the same-host target: somatize's Mount with views against Ray's object store
            for kind in ("numpy", "torch"):
                mine = floors.same_host.get((kind, nbytes))
                if mine is not None:
                    rows.append(
                        Row(
                            "b",
                            f"somatize Mount views, {kind} {size(nbytes)}, against Ray",
                            f"{mine:.2f} GB/s",
                            f"Ray {speed:.2f} GB/s",
                            ratio(mine / speed),
                            ">= 1x",
                            at_least(mine / speed, 1.0),
                        )
                    )
    return rows


def _missing(system: str, cases: str, why: str) -> list[Row]:
    return [Row(case, system, "-", verdict=why) for case in cases]


def ray(settings: Settings, floors: Floors, cases: str) -> list[Row]:
    wanted = "".join(c for c in "abtp" if c in cases)
    if not wanted:
        return []
    try:
        import ray as _ray
    except ImportError:
        return _missing("Ray", wanted, "not installed")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    try:
        _ray.init(
            num_cpus=WORKERS,
            include_dashboard=False,
            log_to_driver=False,
            logging_level=logging.ERROR,
            configure_logging=False,
        )
    except Exception as exc:
        return _missing("Ray", wanted, f"did not start: {type(exc).__name__}")
    rows: list[Row] = []
    try:

        class Echo:  # defined here, so it travels by value: Ray's workers cannot import this file
            def forward(self, x):
                return x

        actor = _ray.remote(num_cpus=1)(Echo).remote()

        def call(x):
            return _ray.get(actor.forward.remote(x))

        if "a" in wanted:
            for _ in range(max(20, settings.calls // 20)):
                call(SMALL)
            rows += _small_rows("Ray actor call", repeated(functools.partial(call, SMALL), settings.calls), floors)
        if "b" in wanted:
            rows += _array_rows("Ray", _speeds(call, settings), floors, "actor call")
        if "t" in wanted:  # 4 more actors, a quarter of a CPU each: they fit beside the first
            rows += _many_at_once(
                _ray, [_ray.remote(num_cpus=0.25)(Echo).remote() for _ in range(WORKERS)], settings, floors
            )
        if "p" in wanted:
            rows += _ray_map(_ray, Echo, settings, floors)
    finally:
        _ray.shutdown()
    return rows


def _ray_map(ray, Echo: type, settings: Settings, floors: Floors) -> list[Row]:
    """Case (p) on Ray: tasks over its 4 CPUs, all submitted then one ``ray.get``; the tiny
    inputs also through ``ActorPool.map`` over 4 actors."""
    from ray.util import ActorPool

    heavy, tiny = counts(settings)
    burn = ray.remote(num_cpus=1)(burn_by_value())
    echo = ray.remote(num_cpus=1)(lambda x: x)
    ray.get([burn.remote(x) for x in range(WORKERS * 4)] + [echo.remote(SMALL) for _ in range(WORKERS * 20)])
    began = time.perf_counter()
    if len(ray.get([burn.remote(x) for x in range(heavy)])) != heavy:
        raise AssertionError("answers went missing")
    heavy_rate = heavy / (time.perf_counter() - began)
    began = time.perf_counter()
    if ray.get([echo.remote(SMALL) for _ in range(tiny)])[-1] != SMALL:
        raise AssertionError("the value came back changed")
    tasks = tiny / (time.perf_counter() - began)
    actors = ActorPool([ray.remote(num_cpus=0.25)(Echo).remote() for _ in range(WORKERS)])
    list(actors.map(lambda actor, x: actor.forward.remote(x), [SMALL] * (WORKERS * 20)))
    began = time.perf_counter()
    if sum(1 for _ in actors.map(lambda actor, x: actor.forward.remote(x), [SMALL] * tiny)) != tiny:
        raise AssertionError("answers went missing")
    pooled = tiny / (time.perf_counter() - began)
    rows = [
        Row("p", f"Ray tasks over {WORKERS} CPUs, {heavy:,} CPU-bound inputs", f"{heavy_rate:,.0f} inputs/s"),
        Row("p", f"Ray tasks, {tiny:,} inputs of 100 B, one ray.get", f"{tasks:,.0f} inputs/s"),
        Row("p", f"Ray ActorPool.map over {WORKERS} actors, {tiny:,} inputs of 100 B", f"{pooled:,.0f} inputs/s"),
    ]
    return rows + _against("Ray", heavy_rate, max(tasks, pooled), floors)


def _against(system: str, heavy: float, tiny: float, floors: Floors) -> list[Row]:
    """somatize's (p) figures of this run against ``system``'s."""
    rows = []
    mine = floors.mapped.get("heavy")
    if mine:
        rows.append(
            Row(
                "p",
                f"somatize map, CPU-bound inputs, against {system}",
                f"{mine:,.0f}/s",
                f"{system} {heavy:,.0f}/s",
                ratio(mine / heavy),
                ">= 1x",
                at_least(mine / heavy, 1.0),
            )
        )
    mine = floors.mapped.get("tiny")
    if mine:
        rows.append(
            Row(
                "p",
                f"somatize map, inputs of 100 B, against {system}'s best",
                f"{mine:,.0f}/s",
                f"{system} {tiny:,.0f}/s",
                ratio(mine / tiny),
                ">= 1x",
                at_least(mine / tiny, 1.0),
            )
        )
    return rows


def _many_at_once(ray, actors: list, settings: Settings, floors: Floors) -> list[Row]:
    """Case (t) on Ray: 16 threads each calling its actor and waiting, then every call
    submitted at once and gathered with one ``ray.get``."""
    for actor in actors:
        ray.get(actor.forward.remote(SMALL))

    def call_for(i: int) -> Callable[[], object]:
        actor = actors[i % len(actors)]
        return lambda: ray.get(actor.forward.remote(SMALL))

    calls = settings.calls // 8
    waiting = rate(call_for, THREADS, calls)

    def submitted() -> None:
        refs = [actors[i % len(actors)].forward.remote(SMALL) for i in range(THREADS * calls)]
        if ray.get(refs)[-1] != SMALL:
            raise AssertionError("the value came back changed")

    in_flight = rate(lambda i: submitted, 1, 1) * THREADS * calls
    rows = [
        Row("t", f"Ray, {THREADS} threads to {len(actors)} actors, each waiting", f"{waiting:,.0f} calls/s"),
        Row("t", f"Ray, {THREADS * calls:,} calls in flight at once, one ray.get", f"{in_flight:,.0f} calls/s"),
    ]
    if floors.threads:
        best = max(waiting, in_flight)
        rows.append(
            Row(
                "t",
                f"somatize {THREADS} threads, against Ray's better",
                f"{floors.threads:,.0f}/s",
                f"Ray {best:,.0f}/s",
                ratio(floors.threads / best),
                ">= 1x",
                at_least(floors.threads / best, 1.0),
            )
        )
    return rows


def dask(settings: Settings, floors: Floors, cases: str) -> list[Row]:
    wanted = "".join(c for c in "abdp" if c in cases)
    if not wanted:
        return []
    try:
        import dask as _dask
        from distributed import Client, LocalCluster
    except ImportError:
        return _missing("Dask", wanted, "not installed")

    def echo(x):  # local functions travel by value: Dask's worker cannot import this file
        return x

    def inc(x):
        return x + 1

    rows: list[Row] = []
    if "a" in wanted or "b" in wanted:
        try:
            cluster = LocalCluster(
                n_workers=1, threads_per_worker=1, processes=True, dashboard_address=None, silence_logs=logging.ERROR
            )
        except Exception as exc:
            rows += _missing("Dask", wanted.replace("d", ""), f"did not start: {type(exc).__name__}")
        else:
            try:
                with Client(cluster) as client:
                    if "a" in wanted:

                        def call():
                            return client.submit(echo, SMALL, pure=False).result()

                        for _ in range(max(20, settings.calls // 20)):
                            call()
                        rows += _small_rows("Dask submit", repeated(call, settings.calls), floors)
                    if "b" in wanted:

                        def big(x):
                            return client.submit(echo, client.scatter(x, direct=True, hash=False), pure=False).result()

                        rows += _array_rows("Dask", _speeds(big, settings), floors, "scatter+submit")
            finally:
                cluster.close()
    if "p" in wanted:
        try:
            cluster = LocalCluster(
                n_workers=WORKERS,
                threads_per_worker=1,
                processes=True,
                dashboard_address=None,
                silence_logs=logging.ERROR,
            )
        except Exception as exc:
            rows += _missing("Dask", "p", f"did not start: {type(exc).__name__}")
        else:
            try:
                with Client(cluster) as client:
                    rows += _dask_map(client, echo, settings, floors)
            finally:
                cluster.close()
    if "d" in wanted:
        chain = functools.reduce(lambda x, _: _dask.delayed(inc)(x), range(CHAIN), 0)
        run: Callable[[], object] = functools.partial(chain.compute, scheduler="threads")
        assert run() == CHAIN
        samples = repeated(run, settings.chains)
        rows.append(Row("d", f"Dask delayed, {CHAIN}-node chain (threads)", f"{us(median(samples) / CHAIN)} per node"))
    return rows


def _dask_map(client, echo: Callable[[object], object], settings: Settings, floors: Floors) -> list[Row]:
    """Case (p) on Dask: ``client.map`` of every input, then one ``gather``."""
    heavy, tiny = counts(settings)
    burn = burn_by_value()
    client.gather(client.map(burn, range(WORKERS * 4), pure=False))
    client.gather(client.map(echo, [SMALL] * (WORKERS * 20), pure=False))
    began = time.perf_counter()
    if len(client.gather(client.map(burn, range(heavy), pure=False))) != heavy:
        raise AssertionError("answers went missing")
    heavy_rate = heavy / (time.perf_counter() - began)
    began = time.perf_counter()
    if client.gather(client.map(echo, [SMALL] * tiny, pure=False))[-1] != SMALL:
        raise AssertionError("the value came back changed")
    tiny_rate = tiny / (time.perf_counter() - began)
    rows = [
        Row("p", f"Dask client.map on {WORKERS} workers, {heavy:,} CPU-bound inputs", f"{heavy_rate:,.0f} inputs/s"),
        Row("p", f"Dask client.map on {WORKERS} workers, {tiny:,} inputs of 100 B", f"{tiny_rate:,.0f} inputs/s"),
    ]
    return rows + _against("Dask", heavy_rate, tiny_rate, floors)


def _speeds(call: Callable[[np.ndarray], object], settings: Settings) -> dict[int, float]:
    speeds = {}
    for nbytes in settings.sizes:
        x = np.ones(nbytes // 4, np.float32)
        out = call(x)  # warm
        if out.nbytes != nbytes:
            raise AssertionError("the array came back changed")
        del out
        samples = interleaved({"it": functools.partial(call, x)}, settings.reps, settings.reps)["it"]
        speeds[nbytes] = gbps(nbytes, median(samples))
        del x
    return speeds


#: Each system, and the cases it has an equivalent for.
SYSTEMS = {"Ray": (ray, "abtp"), "Dask": (dask, "abdp")}
