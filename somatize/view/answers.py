"""What the study and machines pages are sent beyond the readers' own rows.

- A study's score against each parameter, made from the rows of the one ``trials`` scan the
  study's page already reads: a chart per parameter whose values are numbers; a parameter
  whose values are not (a category, a flag, a text) is named as not drawn, with a few of
  its values.
- The trials running now, and for how long: each one's record says how long it had run at
  its last write (``took_us``, by its runner's own clock), and its stamp says when that
  write was; the time since is this view's clock against that stamp (on a local disk the
  same clock; on NFS the file server's, so a skew between the two shows here). A record
  and its stamp are read together (a stamp, the record, the stamp again): a write landing
  in between is never half-counted.
- The runs, the one written last first (a ``stat`` of each run's folder, no record read),
  and how long ago each machine last reported (its report's stamp); whether a run goes on,
  ended (and how) or went silent (its stamps).

Every name and value here comes from the store, so from whoever may write it: it is only
counted and passed on as data, and the page draws it as text.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from typing import Any

from ..errors import Missing, SomatizeError
from ..record.readers import run_end, whole
from ..record.recorder import end_name, entry_name
from ..study.history import attempt_name
from .study_page import axis, place

#: The most parameters a study's page draws (the others are counted, not drawn).
PARAMETERS = 50
#: The most running trials a study's page lists (the others are counted).
RUNNING = 100


def by_parameter(rows: list[dict[str, Any]], space: str | None, thin: Callable[[list], list]) -> dict[str, Any]:
    """The score of each done trial against each parameter's value: ``drawn``, a chart per
    parameter (``name``, ``kind``: ``float``, ``log``, ``int`` or ``categorical``, with its
    ``categories`` named; ``points`` as ``[value, score]`` in order of value, a category's
    value its index; thinned by ``thin``, ``count`` before thinning), and ``more``, how many
    parameters were left out past :data:`PARAMETERS`."""
    done = [
        row
        for row in rows
        if row["state"] == "done" and isinstance(row["score"], float) and math.isfinite(row["score"])
    ]
    kinds = space_of(space)
    values: dict[str, list[tuple[Any, float]]] = {name: [] for name in kinds}
    for row in done:
        for name, value in row["config"].items():
            if value is not None:
                values.setdefault(name, []).append((value, row["score"]))
    names = sorted(values)
    drawn = []
    for name in names[:PARAMETERS]:
        pairs = values[name]
        shape = axis(name, kinds.get(name, {}), [value for value, _ in pairs])
        placed = [(place(shape, value), score) for value, score in pairs]
        points = sorted(((x, score) for x, score in placed if x is not None), key=lambda p: p[0])
        chart = {"name": name, "kind": shape["kind"], "points": thin(points), "count": len(points)}
        chart["log"] = shape["kind"] == "log" and all(p[0] > 0 for p in points)
        if shape["kind"] == "categorical":
            chart["categories"] = shape["categories"]
        else:  # the axis spans the parameter's space (its distribution's low and high)
            chart["low"], chart["high"] = shape["low"], shape["high"]
        drawn.append(chart)
    return {"drawn": drawn, "more": max(0, len(names) - PARAMETERS)}


def running(store: Any, study: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The trials whose state is ``running``, at most :data:`RUNNING` of them (``count`` says
    how many there are): each one's ``trial``, ``runner``, ``attempts``, ``config``,
    ``running_s`` (how long it has run, from its record; ``None`` when unknown) and
    ``written_s_ago`` (how long since its runner last wrote it; ``None`` when unknown)."""
    live = [row for row in rows if row["state"] == "running"]
    out = []
    for row in live[:RUNNING]:
        item = {
            "trial": row["trial"],
            "runner": row["runner"],
            "attempts": row["attempts"],
            "attempt": row["attempts"] - 1,  # numbered from 0, as its runner's lines and `--show` say
            "config": row["config"],
            "running_s": None,
            "written_s_ago": None,
        }
        # attempts are numbered from 0, each created only once the one before it was there
        written, took_us = _written(store, attempt_name(study, row["trial"], row["attempts"] - 1), row["runner"])
        if written is not None:
            ago = max(0.0, (time.time_ns() - written) / 1e9)
            item["written_s_ago"] = ago
            item["running_s"] = (took_us or 0) / 1e6 + ago
        out.append(item)
    return {"running": out, "count": len(live)}


def runs_by_last_write(changes: Any) -> list[str]:
    """The runs of the store, the one whose folder was written last first (by name among
    equals): a listing and a ``stat`` per run."""
    try:
        folder = changes.run_folder()
    except OSError:
        return []
    stamped = []
    for run in changes.runs() if folder is not None else ():
        try:
            stamped.append((os.lstat(folder / run).st_mtime_ns, run))
        except OSError:
            continue
    return [run for _, run in sorted(stamped, reverse=True)]


#: A run whose newest forward was written at most this long ago (or three times its own pace
#: between forwards, for a slow one) is running; past it, silent (seconds).
RUNNING_FOR = 30.0


def run_status(store: Any, run: str, first: int | None, last: int | None, count: int) -> dict[str, Any]:
    """Whether ``run`` (``count`` forwards, numbered ``first`` to ``last``) goes on: ``state``
    is ``ended`` (its recorder said so after its last forward; ``how`` says ok or broke),
    ``running`` (its newest forward is younger than `RUNNING_FOR`, or three times the run's own
    pace) or ``silent``; ``quiet_s`` is how long ago its last write was, and ``silent_after_s``
    when a running one is to be called silent if nothing comes meanwhile. By the entries'
    stamps against this view's clock: two stamps and the end's record, whatever its length."""
    out: dict[str, Any] = {"state": "silent", "how": "", "quiet_s": None}
    try:
        how = run_end(store, run)
        ended_ns = store.stamp(end_name(run)) if how is not None else 0
    except (Missing, OSError, SomatizeError, ValueError):
        how, ended_ns = None, 0
    last_ns = first_ns = 0
    if first is not None and last is not None:
        try:
            last_ns = store.stamp(entry_name(run, last))
            first_ns = store.stamp(entry_name(run, first)) if count > 1 else last_ns
        except (Missing, OSError, SomatizeError, ValueError):
            pass
    newest = max(last_ns, ended_ns)
    if not newest:
        return out
    out["quiet_s"] = quiet = max(0.0, (time.time_ns() - newest) / 1e9)
    if how is not None and ended_ns >= last_ns:
        out["state"], out["how"] = "ended", how
        return out
    pace = (last_ns - first_ns) / 1e9 / (count - 1) if count > 1 else 0.0
    out["silent_after_s"] = limit = max(RUNNING_FOR, 3 * pace)  # the page says silent then, if nothing came
    out["state"] = "running" if quiet <= limit else "silent"
    return out


def report_ages(store: Any, machines: list[str]) -> dict[str, float | None]:
    """How many seconds ago each machine's report was written, by its stamp (``None`` if it
    went meanwhile)."""
    out: dict[str, float | None] = {}
    for machine in machines:
        try:
            stamp = store.stamp(f"machine/{machine}")
        except (Missing, OSError, SomatizeError, ValueError):
            out[machine] = None
            continue
        out[machine] = max(0.0, (time.time_ns() - stamp) / 1e9)
    return out


def _written(store: Any, name: str, runner: str) -> tuple[int | None, int | None]:
    """When the attempt ``name`` was last written and how long it had run then, if it is
    the running attempt of ``runner``; ``(None, None)`` otherwise."""
    for _ in range(3):
        try:
            before = store.stamp(name)
            record = store.record(name)
            after = store.stamp(name)
        except (Missing, OSError, SomatizeError, ValueError):
            return None, None
        if before == after:
            if record.get("state", "running") != "running" or record.get("runner", "") != runner:
                return None, None
            return after, whole(record.get("took_us"))
    return None, None  # written again and again while we looked: the next look will tell


def space_of(text: str | None) -> dict[str, dict[str, Any]]:
    """The study's space as its definition wrote it (distributions as Optuna writes them to
    JSON), or ``{}`` where it is not that."""
    if not text:
        return {}
    try:
        space = json.loads(text)
    except (ValueError, RecursionError):
        return {}
    if not isinstance(space, dict):
        return {}
    out = {}
    for name, kind in space.items():
        if isinstance(kind, dict) and isinstance(kind.get("attributes", {}), dict):
            out[name] = kind
        else:
            out[name] = {}
    return out
