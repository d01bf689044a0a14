"""The five cases, measured on somatize and on the raw-pyzmq floor, each returning rows.

Every case warms up first (the first forward spawns the worker and sends the artifact),
then measures contenders in alternating blocks so a neighbour's load lands on all alike.
Nothing here asserts a timing: a row says PASS or MISS against its target and that is all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import admission
import fleet
import flooding
import mapping
import memory
import numpy as np
import paths
import threads
import view
from children import Child
from floor import ANNOUNCE, Floor
from nodes import Echo, Inc
from table import (
    Row,
    at_least,
    at_most,
    best_block,
    gbps,
    interleaved,
    median,
    ms,
    p99,
    ratio,
    repeated,
    size,
    us,
)

from somatize import Broker, FolderStore, Recorder, Study, Worker
from somatize.record import curve, forwards, trials
from somatize.study.history import attempt_name

FLOOR = [sys.executable, str(Path(__file__).with_name("floor.py"))]
SMALL = b"x" * 100


@dataclasses.dataclass(frozen=True)
class Settings:
    calls: int  # (a) round trips per contender
    sizes: tuple[int, ...]  # (b) bytes per array
    reps: int  # (b) round trips per contender and size
    graphs: int  # (c) forwards of the small graph per contender
    chains: int  # (d) forwards of the 200-node chain
    records: int  # (e) forwards recorded
    trials: int = 2000  # (f) trials run by two runners (and by two Optuna processes)
    small_study: int = 200  # (f) trials run by two fresh runners, start-up included
    history: int = 1000  # (f) trials in the history rebuilt
    blocks: int = 10
    fleet: int = 1000  # (h) dialed workers on one broker
    fleet_forwards: int = 2000  # (h) relayed forwards, each to the next host
    view_forwards: int = 100_000  # (v) forwards of the run the view opens
    view_trials: int = 10_000  # (v) trials of the study it opens

    @classmethod
    def full(cls) -> Settings:
        return cls(calls=4000, sizes=(64 << 20, 256 << 20), reps=7, graphs=4000, chains=200, records=10_000)

    @classmethod
    def quick(cls) -> Settings:
        return cls(
            calls=50,
            sizes=(1 << 20,),
            reps=3,
            graphs=200,
            chains=10,
            records=200,
            trials=40,
            small_study=20,
            history=50,
            blocks=2,
            fleet=50,
            fleet_forwards=100,
            view_forwards=2000,
            view_trials=300,
        )


@dataclasses.dataclass
class Floors:
    """What the raw-pyzmq floor measured, for the other systems' rows to compare with."""

    small: float | None = None  # (a) median seconds per round trip
    arrays: dict[int, float] = dataclasses.field(default_factory=dict)  # (b) GB/s by size
    same_host: dict[tuple[str, int], float] = dataclasses.field(default_factory=dict)  # (b) Mount views, GB/s
    threads: float | None = None  # (t) somatize's forwards a second from 16 threads
    mapped: dict[str, float] = dataclasses.field(default_factory=dict)  # (p) inputs a second: "heavy", "tiny"


@contextlib.contextmanager
def floor(transport: str = "ipc") -> Iterator[Floor]:
    """The raw echo server in a subprocess, and a client connected to it: over a Unix socket,
    as a spawned worker listens (``tcp``: over a loopback port)."""
    with Child([*FLOOR, transport], announce=ANNOUNCE) as server:
        client = Floor(server.endpoint)
        client.server_pid = server.pid
        try:
            yield client
        finally:
            client.close()


# -- (a) one small forward, Direct, sequential ----------------------------------------------


def small_forward(settings: Settings, floors: Floors) -> list[Row]:
    echo = Echo().named("echo").at("w1")
    with floor() as raw, floor("tcp") as tcp, paths.direct() as broker:
        for _ in range(max(20, settings.calls // 20)):  # warm: spawned, provisioned, connected
            echo.forward(SMALL, broker=broker)
            raw.small(SMALL)
            tcp.small(SMALL)
        assert echo.forward(SMALL, broker=broker) == SMALL
        ran: list[int] = [0]

        def told(fact: dict) -> None:  # a watcher: every fact of the forward is told to it
            ran[0] += fact["fact"] == "ran"

        samples = interleaved(
            {
                "raw": lambda: raw.small(SMALL),
                "tcp": lambda: tcp.small(SMALL),
                "somatize": lambda: echo.forward(SMALL, broker=broker),
                "watched": lambda: echo.forward(SMALL, broker=broker, watching=told),
            },
            settings.calls,
            settings.blocks,
        )
        made = paths.pickles(broker)
    assert ran[0] == len(samples["watched"]), "the watcher was not told each forward's `ran`"
    calls = len(samples["somatize"]) + len(samples["watched"]) + max(20, settings.calls // 20) + 1
    floor_median = median(samples["raw"])
    floors.small = floor_median
    mine = median(samples["somatize"])
    quiet_floor, quiet_mine = (best_block(samples[name], settings.blocks) for name in ("raw", "somatize"))
    return [
        Row(
            "a",
            "raw pyzmq DEALER->ROUTER, 100 B, over a Unix socket (ipc://, as the spawned worker)",
            f"{us(floor_median)} median, {us(p99(samples['raw']))} p99",
            verdict="floor",
        ),
        Row(
            "a",
            "the same over TCP loopback (not the floor: the worker is not reached so)",
            f"{us(median(samples['tcp']))} median, {us(p99(samples['tcp']))} p99",
            f"ipc {us(floor_median)}",
            ratio(median(samples["tcp"]) / floor_median),
        ),
        Row(
            "a",
            "somatize Direct, 1 node, 100 B",
            f"{us(mine)} median, {us(p99(samples['somatize']))} p99",
            f"raw {us(floor_median)}",
            ratio(mine / floor_median),
            "<= 2x",
            at_most(mine / floor_median, 2.0),
        ),
        Row(
            "a",
            "the same, least disturbed block of each",
            f"{us(quiet_mine)} median",
            f"raw {us(quiet_floor)}",
            ratio(quiet_mine / quiet_floor),
            "<= 2x",
            at_most(quiet_mine / quiet_floor, 2.0),
        ),
        Row(
            "a",
            "the same, watched (its facts told to a watcher)",
            f"{us(median(samples['watched']))} median",
            f"unwatched {us(mine)}",
            ratio(median(samples["watched"]) / mine),
        ),
        Row(
            "a",
            f"artifact pickles after {calls} calls",
            str(made),
            target="= 1",
            verdict="PASS" if made == 1 else "MISS",
        ),
    ]


# -- (b) big arrays and tensors, round trip ------------------------------------------------


def _values(nbytes: int) -> dict[str, Callable[[], object]]:
    """Makers of the values to send, by kind: NumPy always, torch when somatize.torch loads."""
    kinds: dict[str, Callable[[], object]] = {"numpy": lambda: np.ones(nbytes // 4, np.float32)}
    try:
        import torch

        import somatize.torch  # noqa: F401  (registers the tensor codec)
    except Exception:  # not installed, or in progress: the rows say so
        return kinds
    kinds["torch"] = lambda: torch.ones(nbytes // 4, dtype=torch.float32)
    return kinds


def torch_missing() -> str | None:
    try:
        import somatize.torch  # noqa: F401
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"[:60]
    return None


def big_arrays(settings: Settings, floors: Floors) -> list[Row]:
    echo = Echo().named("echo").at("w1")
    rows: list[Row] = []
    with floor() as raw, paths.direct() as d, paths.mount() as m, paths.mount_views() as v, paths.relayed() as r:
        brokers = {"Direct": d, "Mount": m, "Views": v, "Relayed": r}
        for nbytes in settings.sizes:
            made = {kind: make() for kind, make in _values(nbytes).items()}
            x = made["numpy"]
            contenders: dict[str, Callable[[], object]] = {"raw": functools.partial(raw.array, x)}
            for kind, value in made.items():
                for path, broker in brokers.items():
                    contenders[f"{path} {kind}"] = functools.partial(echo.forward, value, broker=broker)
            for name, call in contenders.items():  # warm, and check what came back
                out = call()
                if not (name == "raw" or type(out) is type(made[name.split()[1]])):
                    raise AssertionError(f"{name}: a {type(out).__name__} came back")
                if int(np.asarray(out[-1:])[0]) != 1 or out.nbytes != nbytes:
                    raise AssertionError(f"{name}: the value came back changed")
                del out
            samples = interleaved(contenders, settings.reps, settings.reps)
            speed = {name: gbps(nbytes, median(s)) for name, s in samples.items()}
            floors.arrays[nbytes] = speed["raw"]
            rows.append(
                Row("b", f"raw pyzmq zero-copy echo, {size(nbytes)}", f"{speed['raw']:.2f} GB/s", verdict="floor")
            )
            for kind in made:
                direct, mounted, views, relay = (speed[f"{p} {kind}"] for p in brokers)
                floors.same_host[kind, nbytes] = views
                raw_text = f"raw {speed['raw']:.2f} GB/s"
                rows += [
                    Row(
                        "b",
                        f"Direct, {kind} {size(nbytes)}",
                        f"{direct:.2f} GB/s",
                        raw_text,
                        ratio(direct / speed["raw"]),
                        ">= 0.8x",
                        at_least(direct / speed["raw"], 0.8),
                    ),
                    Row(
                        "b",
                        f"Mount (/dev/shm), {kind} {size(nbytes)}",
                        f"{mounted:.2f} GB/s",
                        raw_text,
                        ratio(mounted / speed["raw"]),
                        ">= 3x",
                        at_least(mounted / speed["raw"], 3.0),
                    ),
                    Row(
                        "b",
                        f"Mount (/dev/shm), views=True, {kind} {size(nbytes)}",
                        f"{views:.2f} GB/s",
                        raw_text,
                        ratio(views / speed["raw"]),
                        ">= 3x",
                        at_least(views / speed["raw"], 3.0),
                    ),
                    Row(
                        "b",
                        f"Relayed, {kind} {size(nbytes)}",
                        f"{relay:.2f} GB/s",
                        f"Direct {direct:.2f} GB/s",
                        ratio(relay / direct),
                        ">= 0.5x Direct",
                        at_least(relay / direct, 0.5),
                    ),
                ]
            if "torch" not in made:
                rows.append(Row("b", f"torch {size(nbytes)}", "skipped", verdict=f"somatize.torch: {torch_missing()}"))
            del made, x, contenders
        rows.append(
            Row(
                "b",
                "artifact pickles (Direct, Mount, Mount views, Relayed)",
                ", ".join(str(paths.pickles(b)) for b in brokers.values()),
                target="= 1 each",
                verdict="PASS" if all(paths.pickles(b) == 1 for b in brokers.values()) else "MISS",
            )
        )
    return rows


# -- (c) an InProcess host against no host ---------------------------------------------------


def inprocess(settings: Settings, floors: Floors) -> list[Row]:
    bare = Inc().named("i1") >> Inc().named("i2") >> Inc().named("i3")
    hosted = Inc().named("i1").at("here") >> Inc().named("i2").at("here") >> Inc().named("i3").at("here")
    with Broker.embedded({"here": Worker.inprocess()}) as broker:
        for _ in range(max(20, settings.graphs // 20)):
            bare.forward(0)
            hosted.forward(0, broker=broker)
        assert bare.forward(0) == hosted.forward(0, broker=broker) == 3
        samples = interleaved(
            {"bare": lambda: bare.forward(0), "hosted": lambda: hosted.forward(0, broker=broker)},
            settings.graphs,
            settings.blocks,
        )
    plain, there = median(samples["bare"]), median(samples["hosted"])
    return [
        Row("c", "no host, 3-node chain", f"{us(plain)} per forward", verdict=""),
        Row(
            "c",
            "InProcess host, same chain",
            f"{us(there)} per forward",
            f"no host {us(plain)}",
            ratio(there / plain),
            "<= 1.1x",
            at_most(there / plain, 1.1),
        ),
    ]


# -- (d) the engine's own cost per node ------------------------------------------------------

CHAIN = 200


def engine_overhead(settings: Settings, floors: Floors) -> list[Row]:
    steps = [Inc() for _ in range(CHAIN)]
    graph = functools.reduce(lambda a, b: a >> b, steps)

    def loop() -> int:
        x = 0
        for node in steps:
            x = node.forward(x)
        return x

    for _ in range(3):
        assert graph.forward(0) == loop() == CHAIN
    samples = interleaved({"engine": lambda: graph.forward(0), "loop": loop}, settings.chains, settings.blocks)
    engine, plain = median(samples["engine"]) / CHAIN, median(samples["loop"]) / CHAIN
    return [
        Row("d", f"Python loop over {CHAIN} forwards", f"{us(plain)} per node"),
        Row(
            "d",
            f"engine, {CHAIN}-node local chain",
            f"{us(engine)} per node",
            f"loop {us(plain)}",
            f"+{us(engine - plain)}/node",
        ),
    ]


# -- (e) reading the record ------------------------------------------------------------------


class Counting:
    """A store that counts what is asked of it, and hands every call to the real one."""

    def __init__(self, store: FolderStore) -> None:
        self.store = store
        self.scans = self.fetches = self.puts = 0

    def put(self, name, record, blob=None):
        self.puts += 1
        return self.store.put(name, record, blob)

    def scan(self, prefix):
        self.scans += 1
        return self.store.scan(prefix)

    def fetch(self, name):
        self.fetches += 1
        return self.store.fetch(name)

    def create(self, name, record, blob=None, *, durable=True):
        self.puts += 1
        return self.store.create(name, record, blob, durable=durable)

    def stamp(self, name):
        return self.store.stamp(name)

    def reset(self) -> None:
        self.scans = self.fetches = self.puts = 0


def _write(store: Counting, run: str, records: int, summarising: tuple[str, ...]) -> None:
    recorder = Recorder(store, run=run, summarising=summarising)
    for number in range(records):
        recorder({"fact": "ran", "node": "step", "took_us": "7"})
        recorder({"fact": "finished", "took_us": "12"})
        recorder({"fact": "loss", "value": repr(1.0 / (number + 1))})  # filed into that forward


def record_readers(settings: Settings, floors: Floors) -> list[Row]:
    folder = tempfile.mkdtemp(prefix="somatize-bench-store-")
    rows: list[Row] = []
    try:
        store = Counting(FolderStore(folder))
        started = time.perf_counter()
        # setup, not measured: every put fsyncs, so the two runs are written side by side
        writers = [
            threading.Thread(target=_write, args=(store, "summarised", settings.records, ("loss",))),
            threading.Thread(target=_write, args=(store, "plain", settings.records, ())),
        ]
        for writer in writers:
            writer.start()
        for writer in writers:
            writer.join()
        wrote, puts = time.perf_counter() - started, store.puts
        n = settings.records
        reads = [
            ("forwards(), summarised run", lambda: forwards(store, "summarised"), "1 scan, 0 fetches"),
            ("curve(), summarised run", lambda: curve(store, "summarised"), "1 scan, 0 fetches"),
            ("curve(), unsummarised run", lambda: curve(store, "plain"), ""),
        ]
        for what, read, target in reads:
            out = read()
            if len(out) != n:
                raise AssertionError(f"{what}: {len(out)} entries for {n} forwards")
            store.reset()
            read()
            scans, fetches = store.scans, store.fetches
            times = repeated(read, 3 if n > 1000 else 5)
            verdict = ""
            if target:
                verdict = "PASS" if (scans, fetches) == (1, 0) else "MISS"
            rows.append(
                Row(
                    "e",
                    f"{what}, {n:,} forwards",
                    f"{ms(median(times))}; {scans} scan, {fetches:,} fetches",
                    target=target,
                    verdict=verdict,
                )
            )
        rows.append(
            Row("e", "writing both runs (setup, not measured)", f"{wrote:.1f} s: {2 * n:,} forwards, {puts:,} puts")
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return rows


def _history(folder: str, name: str, trials: int) -> None:
    """A finished study of ``trials`` trials, written as runners write them (setup)."""
    from optuna.distributions import FloatDistribution

    store = FolderStore(folder)
    Study(
        store,
        name,
        objective="objectives:instant",
        space={"x": FloatDistribution(-5, 5)},
        trials=trials,
        sampler="random",
    )
    for n in range(trials):
        x = -5 + 10 * n / max(1, trials - 1)
        store.put(
            attempt_name(name, n, 0),
            {
                "trial": str(n),
                "attempt": "0",
                "config": json.dumps({"x": x}),
                "state": "done",
                "score": repr((x - 1.0) ** 2),
                "took_us": "10",
                "runner": "bench",
            },
        )


def _somatize_runners(folder: str, n: int, env: dict[str, str]) -> tuple[float, list[int]]:
    """Two ``python -m somatize study`` runners over a fresh study of ``n`` instant trials:
    seconds from their start to both ends, and when each trial finished, by the store's stamps."""
    from optuna.distributions import FloatDistribution

    store = FolderStore(folder)
    Study(
        store,
        "speed",
        objective="objectives:instant",
        space={"x": FloatDistribution(-5, 5)},
        trials=n,
        sampler="random",
        patience=30.0,
    )
    command = [sys.executable, "-m", "somatize", "study", "--store", folder, "speed"]
    took, codes = _both(command, env)
    done = [t for t in trials(store, study="speed") if t["state"] == "done"]
    if codes != [0, 0] or len(done) != n:
        raise AssertionError(f"runners ended with {codes}, {len(done)} of {n} trials done")
    return took, sorted(store.stamp(attempt_name("speed", t["trial"], t["attempts"] - 1)) for t in done)


def _optuna_journal(folder: str, n: int, env: dict[str, str]) -> tuple[float, list[float], int]:
    """Two Optuna processes sharing a ``JournalFileBackend`` file, running the same objective
    until the study holds ``n`` trials: seconds, when each finished, and how many did."""
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    path = os.path.join(folder, "journal.log")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = JournalStorage(JournalFileBackend(path))
    optuna.create_study(study_name="speed", storage=storage)
    took, codes = _both([sys.executable, str(Path(__file__).with_name("optuna_journal.py")), path, str(n)], env)
    done = [
        t
        for t in optuna.load_study(study_name="speed", storage=storage).trials
        if t.state == optuna.trial.TrialState.COMPLETE
    ]
    if codes != [0, 0] or len(done) < n:
        raise AssertionError(f"Optuna's processes ended with {codes}, {len(done)} of {n} trials complete")
    return took, sorted(t.datetime_complete.timestamp() for t in done), len(done)


def _small_study(folder: str, n: int, env: dict[str, str]) -> list[Row]:
    """(f) A small study as a researcher starts one: two fresh runner processes (Python's and
    the library's start-up, the definition read, the first claim) over ``n`` instant trials,
    beside two Optuna processes sharing a journal file in the same run: five runs of each,
    alternating (o s s o o s s o o s), each side's median. A run is under a second, and a
    side's best of two was decided by its luckiest run (Optuna's fastest are those where one
    process starts late and runs alone, without its lock's waits), so the verdict followed
    the noise of the machine rather than the two."""
    ours, theirs = [], []
    for turn, who in enumerate(["optuna", "somatize", "somatize", "optuna"] * 2 + ["optuna", "somatize"]):
        where = os.path.join(folder, f"small-{turn}")
        if who == "somatize":
            ours.append(_somatize_runners(where, n, env)[0])
        else:
            os.makedirs(where)
            took, _, done = _optuna_journal(where, n, env)
            theirs.append(took * n / done)
    mine, optuna_rate = n / median(ours), n / median(theirs)
    return [
        Row(
            "f",
            f"Optuna JournalFileBackend, 2 fresh processes, {n} instant trials (median of 5 runs)",
            f"{optuna_rate:,.1f} trials/s",
        ),
        Row(
            "f",
            f"2 fresh runners, {n} instant trials (start-up included; median of 5 runs)",
            f"{mine:,.1f} trials/s",
            f"Optuna journal {optuna_rate:,.1f}/s",
            ratio(mine / optuna_rate),
            ">= 1x Optuna",
            at_least(mine / optuna_rate, 1.0),
        ),
    ]


def _takeover(folder: str, env: dict[str, str]) -> Row:
    """(f) How long after a runner is SIGKILLed mid-trial its trial's next attempt begins, by
    another runner that had nothing left to claim (the study's default patience)."""
    from optuna.distributions import FloatDistribution

    from somatize.study.study import PATIENCE

    where = os.path.join(folder, "takeover")
    store = FolderStore(where)
    Study(store, "kill", objective="objectives:stalls_first", space={"x": FloatDistribution(-5, 5)}, trials=2)
    command = [sys.executable, "-m", "somatize", "study", "--store", where, "kill", "--runner"]
    first = os.path.join(where, attempt_name("kill", 0, 0) + ".rec")
    again = os.path.join(where, attempt_name("kill", 0, 1) + ".rec")
    stalling = subprocess.Popen([*command, "stalling"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    other = None
    try:
        _until(lambda: os.path.exists(first), 60, "the first runner's attempt")
        other = subprocess.Popen([*command, "other"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _until(lambda: any(t["state"] == "done" for t in trials(store, study="kill")), 60, "the other runner's trial")
        stalling.kill()
        killed = time.monotonic()
        _until(lambda: os.path.exists(again), 120, "the takeover")
        took = time.monotonic() - killed
        if other.wait(60) != 0:
            raise AssertionError("the runner that took over did not end well")
    finally:
        for process in (stalling, other):
            if process is not None and process.poll() is None:
                process.kill()
            if process is not None:
                process.wait()
    # the patience after the attempt's last write (which came before the kill: a judge looks
    # the moment its last look said the attempt would turn that old), and a second of slack
    most = PATIENCE + 1.0
    return Row(
        "f",
        f"a SIGKILLed runner's trial taken over (patience {PATIENCE:g} s, the other runner idle)",
        f"{took:.1f} s after the kill",
        "",
        "",
        f"<= {most:g} s",
        at_most(took / most, 1.0),
    )


def _until(fact: Callable[[], bool], seconds: float, what: str) -> None:
    """Wait for ``fact``, looking every 20 ms, at most ``seconds``."""
    until = time.monotonic() + seconds
    while not fact():
        if time.monotonic() > until:
            raise AssertionError(f"{what} did not come within {seconds:g} s")
        time.sleep(0.02)


def _both(command: list[str], env: dict[str, str]) -> tuple[float, list[int]]:
    """Start ``command`` twice at once; seconds until both ended, and their exit codes.

    Each end is waited for in ``waitpid`` itself, not with ``Popen.wait(timeout)``: that
    polls, sleeping up to 50 ms between looks, which rounded a 0.57 s run up to 0.62 s about
    one time in two and decided a comparison at parity by the round. A run past 900 s is
    killed by a timer, and its codes say so."""
    started = time.perf_counter()
    processes = [
        subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for _ in range(2)
    ]
    overdue = threading.Timer(900, lambda: [p.kill() for p in processes])
    overdue.start()
    try:
        codes = [p.wait() for p in processes]
    finally:
        overdue.cancel()
        for p in processes:
            if p.poll() is None:
                p.kill()
                p.wait()
    return time.perf_counter() - started, codes


def _first_and_last(finished: list[float], window: int) -> tuple[str, float]:
    """How long the first ``window`` trials took to finish against the last ``window``, per
    trial and in all, and the ratio of the two per-trial figures. Per trial is the median
    time for a tenth of the window to finish, over a tenth: a pause of the machine moves it
    little, and a tenth spans many ticks of a file system's coarse clock (ext4 stamps files
    with its timer tick, a few ms)."""
    first, last = finished[:window], finished[-window:]
    k = max(1, window // 10)
    per = [median([b - a for a, b in zip(part, part[k:], strict=False)]) / k for part in (first, last)]
    spans = [part[-1] - part[0] for part in (first, last)]
    text = f"{us(per[1])} against {us(per[0])} a trial ({ms(spans[1])} against {ms(spans[0])} in all)"
    return text, per[1] / per[0] if per[0] else float("inf")


def studies(settings: Settings, floors: Floors) -> list[Row]:
    """(f) Trials claimed and finished per second by two runner processes with an instant
    objective, beside two Optuna processes sharing a ``JournalFileBackend`` file in the
    same run (three runs of each, alternating: o s s o o s; each side's median run, as the
    small study's: a side's best run was its luckiest, Optuna's those where one process runs
    alone); whether the last claims of the study cost what the first ones did; and what
    reading a study's history costs."""
    folder = tempfile.mkdtemp(prefix="somatize-bench-study-")
    rows: list[Row] = []
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent), env.get("PYTHONPATH", "")]))
    n = settings.trials
    window = min(100, n // 4)
    try:
        ours: list[tuple[float, list[int]]] = []
        theirs: list[tuple[float, list[float], int]] = []
        for turn, who in enumerate(["optuna", "somatize", "somatize", "optuna", "optuna", "somatize"]):
            where = os.path.join(folder, f"speed-{turn}")
            if who == "somatize":
                ours.append(_somatize_runners(where, n, env))
            else:
                os.makedirs(where)
                theirs.append(_optuna_journal(where, n, env))
        took, stamps = sorted(ours, key=lambda run: run[0])[1]  # each side's median of three
        their_took, their_finished, their_n = sorted(theirs, key=lambda run: run[0] / run[2])[1]
        mine, optuna_rate = n / took, their_n / their_took
        rows.append(
            Row(
                "f",
                f"Optuna JournalFileBackend, 2 processes, {n:,} trials of an instant objective",
                f"{optuna_rate:,.1f} trials/s",
            )
        )
        rows.append(
            Row(
                "f",
                f"2 runners, {n:,} trials of an instant objective",
                f"{mine:,.1f} trials/s",
                f"Optuna journal {optuna_rate:,.1f}/s",
                ratio(mine / optuna_rate),
                ">= 1x Optuna",
                at_least(mine / optuna_rate, 1.0),
            )
        )
        rows.append(Row("f", "  the same, per trial (both processes' start included)", ms(took / n)))
        text, slower = _first_and_last([ns / 1e9 for ns in stamps], window)
        rows.append(
            Row(
                "f",
                f"  the last {window} trials against the first {window} (the store's stamps)",
                text,
                "",
                ratio(slower),
                "<= 1.5x",
                at_most(slower, 1.5),
            )
        )
        text, slower = _first_and_last(their_finished, window)
        rows.append(
            Row(
                "f", f"  Optuna's journal: the last {window} trials against the first {window}", text, "", ratio(slower)
            )
        )

        rows += _small_study(folder, settings.small_study, env)
        rows.append(_takeover(folder, env))

        _history(folder, "past", settings.history)
        counting = Counting(FolderStore(folder))
        counting.reset()
        past = Study.open(counting, "past")
        times = repeated(lambda: past.optuna(), 3)
        counting.reset()
        rebuilt = past.optuna()
        if len(rebuilt.trials) != settings.history:
            raise AssertionError(f"the rebuilt history holds {len(rebuilt.trials)} trials")
        scans, fetches = counting.scans, counting.fetches
        rows.append(
            Row(
                "f",
                f"rebuilding a {settings.history:,}-trial history for the sampler",
                f"{ms(median(times))}; {scans} scan, {fetches:,} fetches",
                target="1 scan, 0 fetches",
                verdict="PASS" if (scans, fetches) == (1, 0) else "MISS",
            )
        )
        counting.reset()
        times = repeated(lambda: trials(counting.store, study="past"), 3)
        counting.reset()
        trials(counting, study="past")
        rows.append(
            Row(
                "f",
                f"trials(), {settings.history:,} trials",
                f"{ms(median(times))}; {counting.scans} scan, {counting.fetches:,} fetches",
                target="1 scan, 0 fetches",
                verdict="PASS" if (counting.scans, counting.fetches) == (1, 0) else "MISS",
            )
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return rows


CASES: dict[str, Callable[[Settings, Floors], list[Row]]] = {
    "a": small_forward,
    "b": big_arrays,
    "c": inprocess,
    "d": engine_overhead,
    "e": record_readers,
    "f": studies,
    "g": flooding.flood_rows,
    "h": fleet.fleet_rows,
    "k": admission.admission_rows,
    "t": threads.threads_rows,
    "p": mapping.mapping_rows,
    "v": view.view_rows,
    "m": memory.memory_rows,
}
