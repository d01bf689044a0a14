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

#: Runs kept at once (the least recently opened let go first).
KEPT = 4
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


class Runs:
    """The runs a view has opened, each read once and then kept up with."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.changes = Changes(store)  # its listings: the run's files, never through a link
        self._kept: OrderedDict[str, Run] = OrderedDict()
        self._lock = threading.Lock()

    def page(self, run: str, start: int, size: int) -> dict[str, Any]:
        """``run``'s count, kinds, curves (loss and ``took_us``, thinned) and ``size`` rows
        from ``start``: what its page shows."""
        check_run(run, "the view")
        with self._lock:
            known = self._up_to_date(run)
            if known.drawn is None:
                known.ordered = [known.rows[n] for n in sorted(known.rows)]
                known.drawn = _drawn(known.ordered)
            return {"run": run, "from": start, "forwards": known.ordered[start : start + size], **known.drawn}

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


def _drawn(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The kinds, the loss curve, ``took_us`` per forward, and a curve for each other
    summarised field that holds numbers (`SERIES` at most)."""
    points: dict[str, list] = {}
    took = []
    for row in rows:
        number = row["forward"]
        for key, value in row.items():
            if "." in key:
                line = points.setdefault(key, [])
                if isinstance(value, float) and math.isfinite(value):
                    line.append((number, value))
        if row["took_us"] is not None:
            took.append((number, row["took_us"]))
    loss = points.get("loss.value", [])
    others = [k for k in sorted(points) if k != "loss.value" and points[k]][:SERIES]
    return {
        "count": len(rows),
        "kinds": sorted(points),
        "curve": thinned(loss),
        "took": thinned(took),
        "series": {k: thinned(points[k]) for k in others},
    }


def thinned(points: list) -> list:
    """At most about `POINTS` of ``points``: in each stretch, its lowest and highest (what a
    line at that width shows), and always the last point."""
    if len(points) <= POINTS:
        return points
    step = 2 * len(points) / POINTS
    out: list = []
    start = 0.0
    while int(start) < len(points):
        chunk = points[int(start) : int(start + step)] or points[int(start) : int(start) + 1]
        low, high = min(chunk, key=lambda p: p[1]), max(chunk, key=lambda p: p[1])
        out.extend(sorted({low, high}, key=lambda p: p[0]))
        start += step
    if out[-1] != points[-1]:
        out.append(points[-1])
    return out
