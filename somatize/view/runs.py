"""A run's page from what the view read before: each forward's record is read once.

A run of 100,000 forwards is 100,000 files, and reading them all is most of what opening its
page costs. The first look reads the run's chunks instead where a recorder wrote them (the
records of each thousand forwards in one entry: a hundred reads), and scans it otherwise. A
``FolderStore`` puts every entry by renaming a new file into its folder, so a forward whose
file still has the inode it had when the view read it is unchanged: after the first look,
the view lists the run's folder (names and inodes come with the listing, no entry is opened)
and reads only the forwards that are new or were put again. What a page draws from the rows
(the kinds, the curves) is kept with them until they change.

Everything here is read through the store's own verbs (`forwards`, ``record``); the listing
is `Changes.forward_files`: regular files named as forwards, never through a link.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from typing import Any

from ..errors import Missing, SomatizeError
from ..record import forwards, recorder
from ..record.readers import forward_row
from ..record.recorder import CHUNKS, check_run, chunk_name, chunk_records, entry_name
from ..record.shapes import left_out
from .answers import runs_by_last_write
from .changes import Changes

#: Runs kept at once (the least recently opened let go first): as many as a comparison shows.
KEPT = 8
#: The largest chunk file read (bytes): a recorder's thousand records are a few hundred KiB;
#: a bigger one in a shared folder was put there by someone else, and is not read whole.
MOST_CHUNK = 32 << 20
#: Points a curve sends at most, about (more are thinned: `thinned`).
POINTS = 2000


class Run:
    """What the view knows of one run."""

    def __init__(self) -> None:
        self.inodes: dict[int, int] = {}  # forward -> the inode of the file it was read from
        self.rows: dict[int, dict[str, Any]] = {}
        self.drawn: dict[str, Any] | None = None  # count, kinds, curves; None once the rows change
        self.ordered: list[dict[str, Any]] = []
        self.sorted: dict[tuple[str, bool], list[dict[str, Any]]] = {}  # by (column, descending)


class Runs:
    """The runs a view has opened, each read once and then kept up with."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.changes = Changes(store)  # its listings: the run's files, never through a link
        self._kept: OrderedDict[str, Run] = OrderedDict()
        self._lock = threading.Lock()

    def page(self, run: str, start: int, size: int, sort: str = "forward", desc: bool = False) -> dict[str, Any]:
        """``run``'s count, kinds, curves (loss and ``took_us``, thinned) and ``size`` rows
        from ``start``, in the order of column ``sort`` (a row's field: ``forward``,
        ``took_us``, a kind...; descending with ``desc``): what its page shows."""
        check_run(run, "the view")
        with self._lock:
            known = self._up_to_date(run)
            if known.drawn is None:
                known.ordered = [known.rows[n] for n in sorted(known.rows)]
                known.drawn = _drawn(known.ordered)
                known.sorted = {}
            rows = known.ordered
            if sort != "forward" or desc:
                if sort not in SORTABLE and sort not in known.drawn["kinds"]:
                    raise ValueError(f"a run's forwards are sorted by one of its columns, not by {sort[:40]!r}")
                if (sort, desc) not in known.sorted:
                    if len(known.sorted) >= 4:  # a few orders kept, until the rows change
                        known.sorted.clear()
                    known.sorted[(sort, desc)] = sorted(
                        known.ordered, key=lambda row: _order(row.get(sort), desc), reverse=desc
                    )
                rows = known.sorted[(sort, desc)]
            return {
                "run": run,
                "from": start,
                "sort": sort,
                "desc": desc,
                "forwards": rows[start : start + size],
                **known.drawn,
            }

    def warm(self, newest: int = 2) -> threading.Thread:
        """Read the ``newest`` runs (by their folders' stamps) on a thread of their own, so
        that the first look at a long run does not wait for its scan; returns the thread."""

        def read() -> None:
            for run in runs_by_last_write(self.changes)[:newest]:
                try:
                    with self._lock:
                        self._up_to_date(run)
                except (ValueError, OSError, SomatizeError):
                    continue

        thread = threading.Thread(target=read, daemon=True, name="somatize-view-warm")
        thread.start()
        return thread

    def _up_to_date(self, run: str) -> Run:
        known = self._kept.pop(run, None)
        if known is None:
            known, listed = self._first_look(run)
        else:
            listed = self.changes.forward_files(run)
        for number in [n for n in known.rows if n not in listed]:  # removed since
            del known.rows[number]
            known.inodes.pop(number, None)
            known.drawn = None
        for number, inode in listed.items():
            if known.inodes.get(number) == inode:
                continue
            try:
                record = self.store.record(entry_name(run, number))
            except (Missing, OSError, SomatizeError):
                continue  # gone or damaged since it was listed: the next look tells
            known.rows[number] = forward_row(number, record)
            known.inodes[number] = inode
            known.drawn = None
        self._kept[run] = known
        while len(self._kept) > KEPT:
            self._kept.popitem(last=False)
        return known

    def _first_look(self, run: str) -> tuple[Run, dict[int, int]]:
        """A run's rows, the first time: from its chunks (a recorder's records of each
        thousand forwards, in one entry) where they hold most of it, from a scan otherwise.
        A chunk stands for a forward only if that forward's file is no newer than the chunk's
        (one put again since is read on its own); the rest are read one by one. Also
        returns the listing's inodes."""
        known = Run()
        forwards_at = self.changes.forward_files(run, stats=True)
        chunks_at = self.changes.forward_files(run, CHUNKS, stats=True)
        from_chunks: dict[int, dict[str, Any]] = {}
        if chunks_at and len(chunks_at) * recorder.CHUNK >= len(forwards_at) // 2:
            for k, chunk in chunks_at.items():
                if chunk.st_size > MOST_CHUNK:  # not what a recorder writes: its forwards are read one by one
                    left_out(
                        self.store,
                        chunk_name(run, k),
                        f"its file is {chunk.st_size} bytes long (a sparse file counts by its length), "
                        f"more than the {MOST_CHUNK} a view reads of a chunk; its forwards are read one by one",
                    )
                    continue
                for number, record in (chunk_records(self.store, run, k) or {}).items():
                    at = forwards_at.get(number)
                    if at is not None and at.st_mtime_ns <= chunk.st_mtime_ns:
                        from_chunks[number] = forward_row(number, record)
        listed = {number: at.st_ino for number, at in forwards_at.items()}
        if from_chunks:
            for number, row in from_chunks.items():  # the others: read on their own next
                known.rows[number] = row
                known.inodes[number] = listed[number]
            return known, listed
        for row in forwards(self.store, run):  # one scan
            known.rows[row["forward"]] = row
        known.inodes = {n: inode for n, inode in listed.items() if n in known.rows}
        return known, listed


#: Summarised kinds drawn besides the loss, at most (the table shows them all).
SERIES = 12
#: The fields of a summarised kind that count rather than measure (``loss.step``,
#: ``val.epoch``): never drawn as curves, they are the x a page may draw the others against.
COUNTERS = ("step", "epoch")
#: A forward that took more than this many times the median of the run's forwards is left
#: above the scale of the took chart, and named under it (a worker starting, a compilation).
OUTSIDE = 10
#: Forwards named above the took chart's scale, at most (the others are counted).
NAMED_OUTSIDE = 20
#: The columns of every run's forwards, besides its summarised kinds.
SORTABLE = ("forward", "state", "took_us", "nodes", "facts", "error")


def counter(key: str) -> str | None:
    """``step`` for ``loss.step``, ``epoch`` for ``val.epoch``; None for a measure."""
    field = key.rpartition(".")[2]
    return field if field in COUNTERS and "." in key else None


def _order(value: Any, desc: bool) -> tuple:
    """A sort key (for ``sorted(..., reverse=desc)``) that puts a row without the column last
    whichever way, numbers before text, and never compares a number with a text."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return (0 if desc else 2, 0)
    if isinstance(value, (int, float)):
        return (2 if desc else 0, value)
    return (1, str(value))


def _drawn(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The kinds, the loss curve, ``took_us`` per forward, and a curve for each other
    summarised field that holds numbers (`SERIES` at most), counters (`COUNTERS`) left out:
    they are given, for each forward drawn, as ``counters`` (``{"step": {forward: step}}``).
    The forwards whose took is over `OUTSIDE` times the median are ``took_outside``."""
    points: dict[str, list] = {}
    took = []
    at: dict[
        str, dict[int, tuple[str, float]]
    ] = {}  # a forward's step and epoch: the first kind's (by name) that says one
    counters: dict[str, str | None] = {}  # a field's counter, by its name
    for row in rows:
        number = row["forward"]
        for key, value in row.items():
            if "." in key:
                line = points.setdefault(key, [])
                if isinstance(value, float) and math.isfinite(value):
                    line.append((number, value))
                    named = counters.get(key) if key in counters else counters.setdefault(key, counter(key))
                    if named is not None:
                        said = at.setdefault(named, {})
                        if number not in said or key < said[number][0]:
                            said[number] = (key, value)
        if row["took_us"] is not None:
            took.append((number, row["took_us"]))
    if "epoch" in at and "step" in at:
        at["epoch"] = _within_epochs(at["epoch"], at["step"])
    loss = points.get("loss.value", [])
    others = [k for k in sorted(points) if k != "loss.value" and points[k] and counter(k) is None][:SERIES]
    stretches = {k: stretched(points[k]) for k in ["loss.value", *others] if k in points}
    series = {k: stretches[k][0] for k in others}
    curve, took_drawn = stretches["loss.value"][0] if loss else loss, thinned(took)
    drawn = {n for line in (curve, took_drawn, *series.values()) for n, _ in line}
    median = _median([t for _, t in took])
    outside = [(n, t) for n, t in took if median is not None and t > OUTSIDE * median]
    return {
        "count": len(rows),
        "first": rows[0]["forward"] if rows else None,
        "last": rows[-1]["forward"] if rows else None,
        "kinds": sorted(points),
        "curve": curve,
        "took": took_drawn,
        "took_median": median,
        "took_outside": outside[:NAMED_OUTSIDE],
        "took_outside_count": len(outside),
        "series": series,
        "x": ["forward", *(c for c in COUNTERS if c in at)],
        "counters": {c: {n: v for n, (_, v) in at[c].items() if n in drawn} for c in COUNTERS if c in at},
        # for each thinned curve (``stretched``), what each point kept stands for: a smoothing's
        # input (the compare page's), so that a long run is smoothed as it was recorded
        "stretches": {k: weights for k, (_, weights) in stretches.items() if weights is not None},
    }


def _within_epochs(
    epochs: dict[int, tuple[str, float]], steps: dict[int, tuple[str, float]]
) -> dict[int, tuple[str, float]]:
    """Each forward's epoch with its place in that epoch added, from the step it also says
    (``2.5``: half way through epoch 2), as TensorBoard draws against fractional epochs: a
    per-step curve drawn against the epoch is a line, not a column of points per epoch, and
    a value said once an epoch sits where the per-step curve was when it was said.

    The place is the step's distance from the epoch's first step over the steps the epoch
    spans: up to the next epoch's first step, or (steps that start again each epoch, or the
    last epoch) its own steps' span, from their spacing; it covers the way to the next epoch
    said (a whole epoch at most). Steps of one kind are measured against that kind's only
    (a validation counting its own steps does not squeeze the training's). A forward that
    says no step stays at its whole epoch; a place never reaches the next epoch."""
    low: dict[tuple[str, float], float] = {}
    high: dict[tuple[str, float], float] = {}
    said: dict[tuple[str, float], set[float]] = {}
    for number, (_, epoch) in epochs.items():
        if number in steps:
            kind, step = steps[number]
            at = (kind, epoch)
            low[at] = min(low.get(at, step), step)
            high[at] = max(high.get(at, step), step)
            said.setdefault(at, set()).add(step)
    span: dict[tuple[str, float], float] = {}
    width: dict[tuple[str, float], float] = {}
    ordered = sorted(low)
    for i, at in enumerate(ordered):
        count = len(said[at])
        own = (high[at] - low[at]) * count / (count - 1) if count > 1 else 1.0
        span[at], width[at] = own, 1.0
        if i + 1 < len(ordered) and ordered[i + 1][0] == at[0]:  # the next epoch this kind said
            after = ordered[i + 1]
            if low[after] - low[at] > high[at] - low[at]:
                span[at] = low[after] - low[at]
            width[at] = min(1.0, after[1] - at[1])
    out = dict(epochs)
    for number, (key, epoch) in epochs.items():
        if number in steps:
            at = (steps[number][0], epoch)
            place = (steps[number][1] - low[at]) / span[at]
            if math.isfinite(place):  # steps of a written record may be 1e308 apart: that one stays whole
                out[number] = (key, epoch + min(place, _LAST_PLACE) * width[at])
    return out


#: The furthest into an epoch a place goes (``_within_epochs``): short of the next epoch.
_LAST_PLACE = 0.999


def _median(values: list) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    middle = len(ordered) // 2
    return float(ordered[middle]) if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def thinned(points: list) -> list:
    """At most about `POINTS` of ``points``: in each stretch, its lowest and highest (what a
    line at that width shows), and always the last point."""
    return stretched(points)[0]


def stretched(points: list) -> tuple[list, list | None]:
    """``thinned(points)``, and for each point kept the stretch of ``points`` it stands for,
    as ``[mean, count]``: the count on the stretch's first point kept, 0 on its others (the
    same stretch). ``None`` where nothing was thinned. What a smoothing needs to weigh a
    stretch as the points it stands for: an average over the kept lowest and highest would
    follow the envelope, each pair weighing as two points however many it stands for."""
    if len(points) <= POINTS:
        return points, None
    step = 2 * len(points) / POINTS
    out: list = []
    weights: list = []
    start = 0.0
    while int(start) < len(points):
        chunk = points[int(start) : int(start + step)] or points[int(start) : int(start) + 1]
        low, high = min(chunk, key=lambda p: p[1]), max(chunk, key=lambda p: p[1])
        kept = sorted({low, high}, key=lambda p: p[0])
        mean = math.fsum(p[1] for p in chunk) / len(chunk)
        out.extend(kept)
        weights.extend([[mean, len(chunk)], *([[mean, 0]] * (len(kept) - 1))])
        start += step
    if out[-1] != points[-1]:  # in the last stretch, counted with it
        out.append(points[-1])
        weights.append([weights[-1][0], 0])
    return out, weights
