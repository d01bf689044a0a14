"""The record of what happened: one entry per forward, and the readers that answer from it.

A :class:`Recorder` is a watcher. It collects the facts of the forward that is open and,
when ``finished`` or ``broke`` arrives, writes one entry ``run/<run>/<n>``: a small record
a scan can answer from (``run``, ``forward``, ``took_us``, ``state``, ``nodes``, ``facts``
and the summarised ``<kind>.<field>`` values), and a blob with every fact of that forward,
one JSON object per line, in the order they arrived. A fact outside the engine's
vocabulary (``loss``, ``updated``, ``said``) comes after the forward it is about, so it is
filed into the record that closed last, which is written again.

The readers are plain functions over a store, each with a known price: ``runs``,
``forwards`` and a summarised ``curve`` cost one scan; ``facts`` one fetch; ``nodes`` and
``fleet`` a fetch per forward. ``report`` and ``latest`` keep what each machine last said
about itself under ``machine/<name>``.

This module does not judge the numbers; it writes them down and adds them up.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import socket
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

from .errors import BadName
from .facts import CLOSING, ENGINE, Fact
from .store import Store, _check_name

__all__ = [
    "Recorder",
    "curve",
    "curve_costs",
    "facts",
    "fleet",
    "forwards",
    "latest",
    "machines",
    "nodes",
    "report",
    "runs",
    "self_report",
]

_RUNS = "run/"
_MACHINES = "machine/"
_NUMBER = re.compile(r"[0-9]+")
_KIND = re.compile(r"[A-Za-z0-9_-]+")


# -- writing ----------------------------------------------------------------------------


class Recorder:
    """A watcher that writes one record per forward into ``store``, under ``run/<run>/<n>``.

    ``run`` names the run; a run nobody named gets a sortable UTC name such as
    ``2026-11-29T10-01-02-ab12`` (see :attr:`run`). Giving the name of a run that already
    has records continues its numbering. ``summarising`` lists the kinds (``["loss"]``)
    whose fields are copied into the record itself as ``<kind>.<field>``, so a scan can
    draw their curve without reading a blob; when a kind is said several times in one
    forward, the last value of each field wins.

    Facts of the engine's vocabulary belong to the forward that is open; ``finished`` or
    ``broke`` close it and only then is anything written. Any other fact is filed into the
    forward that closed last, and that entry is written again. One said before any forward
    of this recorder closed waits, and is filed with the first one.

    Facts may arrive from several threads at once. Forwards run at the same time into one
    recorder each keep their own facts: the engine asks the recorder for a watcher of one
    forward (:meth:`for_forward`), and a forward is numbered when it closes.
    """

    def __init__(self, store: Store, run: str | None = None, summarising: Iterable[str] = ()) -> None:
        if not isinstance(store, Store):
            raise TypeError(
                f"Recorder(store) needs a store (something with put, scan and fetch, such as "
                f"`FolderStore(path)`); got a `{type(store).__name__}`."
            )
        self._store = store
        self._summarising = _kinds(summarising)
        self._lock = threading.Lock()
        if run is None:
            self._run, self._next = _fresh_run(store)
        else:
            self._run = _check_run(run, "Recorder(run=...)")
            self._next = _next_number(store, self._run)
        self._open: list[Fact] = []
        self._open_lines: list[bytes] = []
        # the forward that closed last: its number, facts and written lines
        self._last: tuple[int, list[Fact], list[bytes]] | None = None

    @property
    def run(self) -> str:
        """The run's name, given or made up; ``runs(store)`` lists it once a forward closed."""
        return self._run

    @property
    def summarising(self) -> tuple[str, ...]:
        return self._summarising

    def __repr__(self) -> str:
        extra = f", summarising={list(self._summarising)!r}" if self._summarising else ""
        return f"Recorder({self._store!r}, run={self._run!r}{extra})"

    def __call__(self, fact: Mapping[str, str]) -> None:
        """Take one fact: file it, and write when a forward closes or a closed one grows."""
        f = _checked(fact)
        line = _line(f)
        with self._lock:
            # the lock is held across the put, so two rewrites of one entry land in order
            kind = f["fact"]
            if kind in ENGINE or self._last is None:
                self._open.append(f)
                self._open_lines.append(line)
                if kind in CLOSING:
                    number, self._next = self._next, self._next + 1
                    self._last = (number, self._open, self._open_lines)
                    self._open, self._open_lines = [], []
                    self._write(number, self._last[1], self._last[2])
            else:
                number, filed, lines = self._last
                filed.append(f)
                lines.append(line)
                self._write(number, filed, lines)

    def for_forward(self) -> _OneForward:
        """A watcher for one forward: its engine facts are kept apart from any other
        forward's until it closes. The engine calls this once per forward."""
        return _OneForward(self)

    def _close(self, filed: list[Fact], lines: list[bytes]) -> None:
        with self._lock:
            if self._open:  # said before any forward closed: filed with the first
                filed, lines = self._open + filed, self._open_lines + lines
                self._open, self._open_lines = [], []
            number, self._next = self._next, self._next + 1
            self._last = (number, filed, lines)
            self._write(number, filed, lines)

    def _write(self, number: int, filed: list[Fact], lines: list[bytes]) -> None:
        record = _summary(self._run, number, filed, self._summarising)
        self._store.put(_name(self._run, number), record, list(lines))


class _OneForward:
    """What a :class:`Recorder` hands the engine for one forward."""

    __slots__ = ("_recorder", "_facts", "_lines", "_lock")

    def __init__(self, recorder: Recorder) -> None:
        self._recorder = recorder
        self._facts: list[Fact] = []
        self._lines: list[bytes] = []
        self._lock = threading.Lock()  # this forward's branches report from several threads

    def __call__(self, fact: Mapping[str, str]) -> None:
        f = _checked(fact)
        if f["fact"] not in ENGINE:
            self._recorder(f)  # said by someone else: the recorder files it
            return
        with self._lock:
            self._facts.append(f)
            self._lines.append(_line(f))
            if f["fact"] not in CLOSING:
                return
            filed, lines = self._facts, self._lines
            self._facts, self._lines = [], []
        self._recorder._close(filed, lines)


def _summary(run: str, number: int, filed: list[Fact], summarising: tuple[str, ...]) -> dict[str, str]:
    """The record of one forward: everything in it follows from its facts alone."""
    closing: Fact = {}
    names: set[str] = set()
    summaries: dict[str, str] = {}
    for f in filed:
        kind = f["fact"]
        if kind in CLOSING:
            closing = f
        elif kind in ("ran", "recalled") and "node" in f:
            names.add(f["node"])
        if kind in summarising:
            for field, value in f.items():
                if field != "fact":
                    summaries[f"{kind}.{field}"] = value
    record = {
        "run": run,
        "forward": str(number),
        "state": "broke" if closing.get("fact") == "broke" else "ok",
        "nodes": str(len(names)),
        "facts": str(len(filed)),
    }
    if "took_us" in closing:
        record["took_us"] = closing["took_us"]
    if record["state"] == "broke" and "error" in closing:
        record["error"] = closing["error"]
    if summarising:
        record["summarising"] = " ".join(summarising)
    record.update(summaries)
    return record


def _checked(fact: object) -> Fact:
    if not isinstance(fact, Mapping):
        raise TypeError(
            f"a recorder is told facts, which are dicts of text; got a `{type(fact).__name__}`. "
            f"Build one with `somatize.fact('loss', value=0.25)`."
        )
    out: Fact = {}
    for key, value in fact.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(
                f"a fact is a dict of text, and this one holds {key!r}: {value!r} "
                f"(a `{type(value).__name__}`). Build it with `somatize.fact(...)`, which "
                f"writes numbers down as text."
            )
        out[key] = value
    if not out.get("fact"):
        raise TypeError(
            f"a fact names its kind under 'fact', and this one does not: {out!r}. "
            f"Build it with `somatize.fact('loss', value=0.25)`."
        )
    return out


def _line(f: Fact) -> bytes:
    try:
        return (json.dumps(f, ensure_ascii=False) + "\n").encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: escape everything, still exact
        return (json.dumps(f) + "\n").encode("ascii")


def _kinds(summarising: object) -> tuple[str, ...]:
    if isinstance(summarising, str) or not isinstance(summarising, Iterable):
        raise TypeError(
            f"`summarising=` takes a list of kinds, such as `['loss']`; got {summarising!r}."
        )
    kinds: list[str] = []
    for kind in summarising:
        if not isinstance(kind, str) or not _KIND.fullmatch(kind):
            raise ValueError(
                f"`summarising=` names kinds of facts, such as 'loss': letters, digits, '_' "
                f"and '-' (no dot: the record calls a field '<kind>.<field>'); got {kind!r}."
            )
        if kind not in kinds:
            kinds.append(kind)
    return tuple(kinds)


def _check_run(run: object, where: str) -> str:
    if not isinstance(run, str):
        raise BadName(f"{where}: a run's name is a str, not a `{type(run).__name__}`.")
    if "/" in run:
        raise BadName(
            f"{where}: a run's name is one store name component, with no '/'; got {run!r}."
        )
    try:
        _check_name(_name(run, 0))
    except BadName as exc:
        raise BadName(f"{where}: {run!r} cannot name a run. {exc}") from None
    return run


def _fresh_run(store: Store) -> tuple[str, int]:
    """A name nobody used: UTC time to the second (so names sort), and a random suffix."""
    stamp = time.strftime("%Y-%m-%dT%H-%M-%S", time.gmtime())
    while True:
        run = f"{stamp}-{secrets.token_hex(2)}"
        if _next_number(store, run) == 0:
            return run, 0


def _next_number(store: Store, run: str) -> int:
    numbers = [number for number, _ in _records(store, run)]
    return max(numbers) + 1 if numbers else 0


def _name(run: str, number: int) -> str:
    return f"{_RUNS}{run}/{number}"


# -- reading ----------------------------------------------------------------------------


def _records(store: Store, run: str) -> list[tuple[int, dict[str, str]]]:
    """The records of one run, by forward number: one scan."""
    prefix = f"{_RUNS}{run}/"
    found = []
    for name, record in store.scan(prefix):
        rest = name[len(prefix) :]
        if _NUMBER.fullmatch(rest):
            found.append((int(rest), record))
    found.sort(key=lambda item: item[0])
    return found


def _read(store: Store, run: str, number: int) -> list[Fact]:
    blob = store.fetch(_name(run, number))
    if blob is None:
        return []
    text = bytes(blob).decode("utf-8")
    # split on '\n' only: JSON escapes it inside strings, but not U+2028 and its kin
    return [json.loads(line) for line in text.split("\n") if line]


def runs(store: Store) -> list[str]:
    """The runs this store holds a record of, sorted. One scan."""
    found = set()
    for name, _ in store.scan(_RUNS):
        parts = name.split("/")
        if len(parts) == 3 and _NUMBER.fullmatch(parts[2]):
            found.add(parts[1])
    return sorted(found)


def forwards(store: Store, run: str) -> list[dict[str, Any]]:
    """Step by step, from the records alone: one scan, no fetch.

    Each entry has ``forward``, ``state``, ``took_us``, ``nodes`` and ``facts`` (whole
    numbers; ``took_us`` is ``None`` when the closing fact had none), ``error`` for a
    forward that broke, and every summarised ``<kind>.<field>``, as a float when it reads as
    one and as text otherwise.
    """
    _check_run(run, "forwards(run=...)")
    out = []
    for number, record in _records(store, run):
        row: dict[str, Any] = {
            "forward": number,
            "state": record.get("state", ""),
            "took_us": _whole(record.get("took_us")),
            "nodes": _whole(record.get("nodes")),
            "facts": _whole(record.get("facts")),
        }
        if "error" in record:
            row["error"] = record["error"]
        for key, value in record.items():
            if "." in key:
                row[key] = _maybe_float(value)
        out.append(row)
    return out


def curve(store: Store, run: str, kind: str = "loss", field: str = "value") -> list[tuple[int, float]]:
    """The series somebody plots: ``(forward, value)`` for every forward that said ``kind``.

    From the records alone (one scan) for the forwards whose recorder summarised ``kind``;
    for any other forward, its blob is fetched and the last ``kind`` fact with ``field`` is
    used. :func:`curve_costs` tells which, before paying for it.
    """
    _check_run(run, "curve(run=...)")
    key = f"{kind}.{field}"
    out = []
    for number, record in _records(store, run):
        if _summarises(record, kind, key):
            value = record.get(key)
        else:
            value = None
            for f in _read(store, run, number):
                if f.get("fact") == kind and field in f:
                    value = f[field]
        if value is not None:
            out.append((number, _float(value, run, number, key)))
    return out


def curve_costs(store: Store, run: str, kind: str = "loss", field: str = "value") -> dict[str, Any]:
    """What :func:`curve` would cost, found with one scan and no fetch.

    ``{"scans": 1, "fetches": 0, "summarised": True, "forwards": N}`` when every record
    carries ``kind``; otherwise ``fetches`` counts the blobs it would read.
    """
    _check_run(run, "curve_costs(run=...)")
    key = f"{kind}.{field}"
    records = _records(store, run)
    fetches = sum(1 for _, record in records if not _summarises(record, kind, key))
    return {"scans": 1, "fetches": fetches, "summarised": fetches == 0, "forwards": len(records)}


def facts(store: Store, run: str, forward: int) -> list[Fact]:
    """Everything one forward did, in the order it arrived. One fetch."""
    _check_run(run, "facts(run=...)")
    number = _index(forward, "forward")
    return _read(store, run, number)


def nodes(store: Store, run: str, last: int | None = None) -> list[dict[str, Any]]:
    """Who spent the time, added up over the last ``last`` forwards (all when ``None``).

    One entry per node name: ``node``, ``ran`` (times), ``took_us`` (their sum),
    ``recalled`` and ``failed`` (times), and ``host`` when it ran elsewhere (several hosts
    are joined with ','). Sorted by ``took_us``, most first. One scan and a fetch per forward.
    """
    _check_run(run, "nodes(run=...)")
    totals: dict[str, dict[str, Any]] = {}
    hosts: dict[str, set[str]] = {}
    for number, _ in _chosen(store, run, last):
        for f in _read(store, run, number):
            kind = f.get("fact")
            if kind not in ("ran", "recalled", "failed") or "node" not in f:
                continue
            name = f["node"]
            row = totals.setdefault(name, {"node": name, "ran": 0, "took_us": 0, "recalled": 0, "failed": 0})
            row[kind] += 1
            if kind == "ran":
                row["took_us"] += _whole(f.get("took_us")) or 0
            if "host" in f and kind != "recalled":
                hosts.setdefault(name, set()).add(f["host"])
    for name, where in hosts.items():
        totals[name]["host"] = ",".join(sorted(where))
    return sorted(totals.values(), key=lambda row: (-row["took_us"], row["node"]))


def fleet(store: Store, run: str, last: int | None = None) -> dict[str, dict[str, Any]]:
    """Per host, what was sent there and what it cost: ``slices``, ``took_us``, ``waiting_us``.

    ``slices`` counts the ``left`` facts of a host (one per trip), ``took_us`` adds up what
    ran there, and ``waiting_us`` is each trip's round trip minus what ran there during it
    (the wire and the queue), never below zero for one trip. Hosts are keyed as facts name
    them, so a route is its own key (``w1/w2``). A host whose machine reported itself
    (:func:`report`) also has ``said``, its latest report. One scan and a fetch per forward,
    and one more scan for the reports.
    """
    _check_run(run, "fleet(run=...)")
    out: dict[str, dict[str, Any]] = {}
    for number, _ in _chosen(store, run, last):
        ran_since: dict[str, int] = {}  # what ran on each host since its last trip ended
        for f in _read(store, run, number):
            kind = f.get("fact")
            host = f.get("host")
            if not host or kind not in ("ran", "left"):
                continue
            row = out.setdefault(host, {"slices": 0, "took_us": 0, "waiting_us": 0})
            took = _whole(f.get("took_us")) or 0
            if kind == "ran":
                row["took_us"] += took
                ran_since[host] = ran_since.get(host, 0) + took
            else:
                row["slices"] += 1
                row["waiting_us"] += max(0, took - ran_since.pop(host, 0))
    if out:
        said = latest(store)
        for host, row in out.items():
            if host in said:
                row["said"] = said[host]
    return dict(sorted(out.items()))


class Chart(str):
    """A text chart: a ``str`` that shows itself as drawn rather than quoted."""

    def __repr__(self) -> str:
        return str(self)


def machines(store: Store, run: str, *, as_text: bool = False) -> Any:
    """The fleet, drawn: what ran on each host against what waited on the wire and queue.

    A matplotlib ``Figure`` when matplotlib can be imported (and ``as_text`` is false),
    otherwise a text chart (a ``str``), one line per host. Returns it; prints nothing.
    """
    hosts = fleet(store, run)
    if not as_text:
        try:
            from matplotlib.figure import Figure
        except ImportError:
            pass
        else:
            return _figure(Figure, run, hosts)
    return _text_chart(run, hosts)


_WIDTH = 40


def _text_chart(run: str, hosts: dict[str, dict[str, Any]]) -> Chart:
    if not hosts:
        return Chart(f"nothing ran on another machine in run {run!r}")
    widest = max(len(host) for host in hosts)
    most = max(row["took_us"] + row["waiting_us"] for row in hosts.values()) or 1
    lines = [f"run {run!r}, per host: # ran there, . waited (the wire and the queue)"]
    for host, row in hosts.items():
        ran = _bar(row["took_us"], most)
        waited = _bar(row["waiting_us"], most)
        lines.append(
            f"{host:<{widest}}  {'#' * ran}{'.' * waited}{' ' * (_WIDTH - ran - waited)}"
            f"  slices {row['slices']}  ran {row['took_us']} us  waited {row['waiting_us']} us"
        )
    return Chart("\n".join(lines))


def _bar(amount: int, most: int) -> int:
    if amount <= 0:
        return 0
    return max(1, round(amount * (_WIDTH - 1) / most))


def _figure(Figure: Any, run: str, hosts: dict[str, dict[str, Any]]) -> Any:
    names = list(hosts)
    figure = Figure(figsize=(7, 1.2 + 0.45 * max(1, len(names))), layout="constrained")
    axes = figure.subplots()
    ran = [hosts[h]["took_us"] for h in names]
    waited = [hosts[h]["waiting_us"] for h in names]
    axes.barh(names, ran, label="ran there")
    axes.barh(names, waited, left=ran, label="waited (the wire and the queue)")
    axes.invert_yaxis()
    axes.set_xlabel("microseconds")
    axes.set_title(f"run {run!r}, per host" if names else f"nothing ran elsewhere in run {run!r}")
    if names:
        figure.legend(loc="outside lower center", ncols=2, frameon=False)
    return figure


def _chosen(store: Store, run: str, last: int | None) -> list[tuple[int, dict[str, str]]]:
    records = _records(store, run)
    if last is None:
        return records
    count = _index(last, "last")
    return records[len(records) - count :] if count else []


def _summarises(record: Mapping[str, str], kind: str, key: str) -> bool:
    return key in record or kind in record.get("summarising", "").split()


def _whole(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        return None


def _maybe_float(value: str) -> float | str:
    try:
        return float(value)
    except ValueError:
        return value


def _float(value: str, run: str, number: int, key: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise ValueError(
            f"forward {number} of run {run!r} says {key} = {value!r}, which is not a number; "
            f"a curve is drawn from numbers. Read it with `facts(store, run={run!r}, "
            f"forward={number})`."
        ) from None


def _index(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"`{what}=` takes a whole number from 0; got {value!r}.")
    return value


# -- machines speaking for themselves ---------------------------------------------------


def report(store: Store, machine: str, said: Mapping[str, str]) -> None:
    """Write what ``machine`` says about itself under ``machine/<machine>``, replacing the last.

    The record is ``said`` plus ``machine``; there is no blob.
    """
    if not isinstance(machine, str) or "/" in machine:
        raise BadName(f"report(machine=...): a machine's name is one store name component; got {machine!r}.")
    name = f"{_MACHINES}{machine}"
    try:
        _check_name(name)
    except BadName as exc:
        raise BadName(f"report(machine=...): {machine!r} cannot name a machine. {exc}") from None
    store.put(name, {**said, "machine": machine})


def latest(store: Store) -> dict[str, dict[str, str]]:
    """What each machine said about itself last, by machine. One scan."""
    out = {}
    for name, record in store.scan(_MACHINES):
        rest = name[len(_MACHINES) :]
        if "/" not in rest:
            out[rest] = record
    return out


def self_report(served: int) -> dict[str, str]:
    """What a worker says about itself: load, memory, slices served, pid and host, as text.

    ``kind`` is ``load``; ``load1``, ``load5`` and ``load15`` are the load averages (left
    out where the system has none); ``rss_bytes`` is the resident memory now (VmRSS), or
    the peak where /proc is missing; ``slices`` is ``served``.
    """
    count = _index(served, "served")
    said = {"kind": "load"}
    try:
        load1, load5, load15 = os.getloadavg()
    except (OSError, AttributeError):
        pass
    else:
        said.update(load1=f"{load1:.2f}", load5=f"{load5:.2f}", load15=f"{load15:.2f}")
    rss = _rss_bytes()
    if rss is not None:
        said["rss_bytes"] = str(rss)
    # `machine`, not `host`: on a connection the client adds `host`, the graph's name for it
    said.update(slices=str(count), pid=str(os.getpid()), machine=socket.gethostname())
    return said


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    amount, unit = line.split()[1:3]
                    return int(amount) * (1024 if unit.lower() == "kb" else 1)
    except (OSError, ValueError):
        pass
    try:
        import resource
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere
