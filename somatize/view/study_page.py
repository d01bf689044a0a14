"""What a study's page draws beyond its rows: how much each parameter matters, the trials as
parallel coordinates, and a timeline of every attempt by runner.

- ``importances``: Optuna's own ``optuna.importance.get_param_importances`` with its PED-ANOVA
  evaluator (it needs nothing beyond Optuna), over an in-memory copy of the study's done
  trials built as a runner builds one (``study.mirror.Mirror``), at most `IMPORTANCE_MOST`
  of them, the newest. Worked out again only when the done trials changed.
- ``parallel``: each done trial's values on one axis per parameter (`PARALLEL_MOST` trials,
  the newest; `AXES` parameters at most), and how each axis is scaled: ``float``, ``log``,
  ``int`` or ``categorical`` (its categories named).
- ``timeline``: each attempt of the newest `TIMELINE_MOST`, on its runner's row, from when it
  started (its last write's stamp less how long it had run then) to its last write, by this
  view's clock (the stamps are the store's): its trial, number, state, and whether it took
  over an earlier attempt.

Everything comes from records a writer of the folder may have shaped: a value that does not
fit its parameter's distribution leaves its trial out of the importances, names and labels
are passed on as data (the page draws them as text), and sizes are bounded here.
"""

from __future__ import annotations

import json
import math
import threading
import time
import warnings
from typing import Any

from ..errors import Missing, SomatizeError
from ..record.studies import definition_name
from ..study.history import Attempt, History

#: Done trials the importances are worked out from, at most (the newest).
IMPORTANCE_MOST = 2000
#: Done trials drawn as parallel coordinates, at most (the newest).
PARALLEL_MOST = 1000
#: Parameters drawn as axes of the parallel coordinates, at most.
AXES = 12
#: Attempts the timeline draws, at most (the newest).
TIMELINE_MOST = 500
#: Categories an axis names, at most (the others are counted together).
CATEGORIES = 50
_LABEL = 60  # characters of a category's label


class Importances:
    """Each study's importances, kept until its done trials change (one look per page read)."""

    def __init__(self) -> None:
        self._kept: dict[str, tuple[tuple[int, int], dict[str, Any]]] = {}
        self._lock = threading.Lock()

    def of(self, store: Any, study: str, rows: list[dict[str, Any]], history: History) -> dict[str, Any]:
        done = [row["trial"] for row in rows if row["state"] == "done"]
        key = (len(done), max(done, default=-1))
        with self._lock:
            kept = self._kept.get(study)
            if kept is not None and kept[0] == key:
                return kept[1]
        found = importances(store, study, history)
        with self._lock:
            if len(self._kept) >= 64:
                self._kept.clear()
            self._kept[study] = (key, found)
        return found


def importances(store: Any, study: str, history: History) -> dict[str, Any]:
    """``{"by": ..., "values": [[name, importance], ...]}`` (most important first, summing to
    1) from the done trials of ``history`` (the page's one scan of the study), or
    ``{"why": ...}``: why none can be given yet."""
    try:
        from optuna.importance import PedAnovaImportanceEvaluator, get_param_importances

        from ..study.definition import Definition
        from ..study.mirror import Mirror
    except ImportError:
        return {"why": "the importances need Optuna, where the view runs (the study extra)"}
    try:
        definition = Definition.from_record(study, store.record(definition_name(study)))
    except (Missing, OSError, SomatizeError, ValueError) as exc:
        return {"why": f"the study could not be read: {exc}"[:300]}
    done = [trial for trial in history if trial.state == "done"][-IMPORTANCE_MOST:]
    if len(done) < 4:
        return {"why": f"{len(done)} trials done: the importances need at least 4"}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # PED-ANOVA is marked experimental
            mirror = Mirror(definition, study, done, notes=False)
            found = get_param_importances(mirror.study, evaluator=PedAnovaImportanceEvaluator())
    except Exception as exc:  # noqa: BLE001 - Optuna's own refusal (too few distinct values, ...): said, not raised
        return {"why": f"Optuna could not weigh the parameters yet: {exc}"[:300]}
    values = [[name, float(value)] for name, value in found.items() if math.isfinite(value)]
    return {"by": "PED-ANOVA (optuna.importance)", "trials": len(done), "values": values}


def parallel(rows: list[dict[str, Any]], space: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The newest done trials (with a finite score) as parallel coordinates: ``axes`` (each a
    ``name``, a ``kind``, and its ``low`` and ``high`` or ``categories``) and ``lines`` (each a
    ``trial``, its ``score`` and its ``values``, one per axis: a number, a category's index,
    or None where it has none)."""
    done = [
        row
        for row in rows
        if row["state"] == "done" and isinstance(row["score"], float) and math.isfinite(row["score"])
    ][-PARALLEL_MOST:]
    names = sorted({name for row in done for name in row["config"]} | set(space))[:AXES]
    axes = [axis(name, space.get(name, {}), [row["config"].get(name) for row in done]) for name in names]
    lines = []
    for row in done:
        values = [place(a, row["config"].get(a["name"])) for a in axes]
        lines.append({"trial": row["trial"], "score": row["score"], "values": values})
    return {"axes": axes, "lines": lines, "more": max(0, len(set(space)) - AXES)}


def axis(name: str, kind: dict[str, Any], values: list[Any]) -> dict[str, Any]:
    """How a parameter's values are placed: ``categorical`` (its categories, as their JSON),
    ``log``, ``int`` or ``float`` (with ``low`` and ``high``)."""
    attributes = kind.get("attributes", {}) if isinstance(kind.get("attributes", {}), dict) else {}
    given = [v for v in values if v is not None]
    numbers = [float(v) for v in given if _number(v)]
    categorical = kind.get("name") == "CategoricalDistribution" or len(numbers) < len(given)
    if categorical:
        choices = attributes.get("choices")
        known = choices if isinstance(choices, list) else []
        labels = list(dict.fromkeys(_label(v) for v in [*known, *given]))
        return {
            "name": name,
            "kind": "categorical",
            "categories": labels[:CATEGORIES],
            "more": len(labels) > CATEGORIES,
        }
    given_low, given_high = attributes.get("low"), attributes.get("high")
    if (
        isinstance(given_low, (int, float))
        and isinstance(given_high, (int, float))
        and _number(given_low)
        and _number(given_high)
        and given_low < given_high
    ):
        low, high = float(given_low), float(given_high)
    else:
        low, high = (min(numbers), max(numbers)) if numbers else (0.0, 1.0)
    log = attributes.get("log") is True and low > 0
    kind_name = "log" if log else "int" if kind.get("name") == "IntDistribution" else "float"
    return {"name": name, "kind": kind_name, "low": float(low), "high": float(high)}


def place(a: dict[str, Any], value: Any) -> float | None:
    """``value`` on axis ``a``: a number, or its category's index; None where it has none."""
    if value is None:
        return None
    if a["kind"] == "categorical":
        label = _label(value)
        return a["categories"].index(label) if label in a["categories"] else None
    return float(value) if _number(value) else None


class Timeline:
    """`timeline`, keeping the stamps of attempts no runner writes any more (finished, or
    taken over): their records are final, so each is stamped once, not at every read of the
    page (up to `TIMELINE_MOST` stats a read of a study that has ended). A stamp is kept
    under the record it belongs to (its name, state, runner and time taken), so a record
    written again (an overtaken attempt its runner marks abandoned, a study removed and run
    again under its name) is stamped again."""

    def __init__(self) -> None:
        self._stamps: dict[tuple[str, ...], int] = {}
        self._lock = threading.Lock()

    def of(self, store: Any, history: History) -> dict[str, Any]:
        return timeline(store, history, self._stamp)

    def _stamp(self, store: Any, attempt: Attempt, final: bool) -> int:
        key = (attempt.name, attempt.state, *(attempt.record.get(k, "") for k in ("runner", "took_us")))
        with self._lock:
            kept = self._stamps.get(key)
        if kept is not None:
            return kept
        written = store.stamp(attempt.name)
        if final:
            with self._lock:
                if len(self._stamps) >= _STAMPS_KEPT:
                    self._stamps.clear()
                self._stamps[key] = written
        return written


_STAMPS_KEPT = 100_000  # attempts, over every study the view has drawn: a few tens of MiB at most


def _stamped(store: Any, attempt: Attempt, final: bool) -> int:
    return int(store.stamp(attempt.name))


def timeline(store: Any, history: History, stamp: Any = _stamped) -> dict[str, Any]:
    """The newest attempts, each with its ``runner``, ``trial``, ``attempt``, ``state``,
    ``start_s`` and ``end_s`` (seconds before now, by the stamps of its record: when it last
    wrote, less how long it had run then), and ``again`` where it took over an earlier one.
    ``stamp(store, attempt, final)`` reads a record's stamp (`Timeline` keeps the final ones)."""
    attempts = [(a, a is trial.last) for trial in history for a in trial.attempts]
    attempts.sort(key=lambda pair: (pair[0].number, pair[0].attempt))
    now = time.time_ns()
    out = []
    for a, last in attempts[-TIMELINE_MOST:]:
        try:
            written = stamp(store, a, a.state != "running" or not last)
        except (Missing, OSError, SomatizeError, ValueError):
            continue
        took = a.record.get("took_us", "")
        took_s = int(took) / 1e6 if took.isdigit() and len(took) < 16 else 0.0
        quiet = max(0.0, (now - written) / 1e9)
        state = a.state
        if state == "running" and not last:
            state = "overtaken"  # a later attempt took its trial over
        out.append(
            {
                "runner": a.record.get("runner", "")[:_LABEL],
                "trial": a.number,
                "attempt": a.attempt,
                "state": state,
                "end_s": 0.0 if state == "running" else quiet,  # a running one goes on to now
                "start_s": quiet + took_s,
                "again": a.attempt > 0,
            }
        )
    return {"attempts": out, "count": len(attempts)}


def _number(value: object) -> bool:
    """Whether an axis can place ``value``: a finite number (a flag is not one)."""
    if isinstance(value, bool):
        return False
    return isinstance(value, (int, float)) and math.isfinite(float(value)) and abs(float(value)) < 1e300


def _label(value: object) -> str:
    try:
        return json.dumps(value)[:_LABEL]
    except (TypeError, ValueError, RecursionError):
        return "?"
