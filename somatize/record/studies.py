"""Reading a study back: what each trial did, and which one did best, from one scan.

A study is a folder in a store (the study itself is :mod:`somatize.study`'s): ``<study>/study``
holds its definition, and ``<study>/trial/<n>.<attempt>`` one record per attempt (a study
written before December 2026 has them as ``<study>/trial/<n>/<attempt>``, a folder per trial,
and is read alike), with
``config`` (JSON), ``state``, ``score``, ``took_us``, ``runner``, ``error``, the values the
trial said last as ``said.<key>``, and the summarised ``<kind>.<field>``. A trial's result
is its highest attempt's: an attempt with a later one was abandoned, whatever it says.

Nothing here fetches a blob, and nothing judges whether a running attempt is still alive:
that is judged by the store's stamps, by the runners, never by a reader's clock.

Whoever may write the study's folder may write any record there, so every record is checked
(:func:`checked_attempt`: its size, its kinds, how deep its JSON goes, and that its numbers are
numbers) before anything uses it. One that fails is left out, with one line on stderr naming
it, and never stops a reader, ``--show`` or a runner.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any

from ..errors import BadName, Missing
from ..folders import tell_once
from ..store import Store, check_name
from .shapes import maybe_float, number, plain_json, whole

#: The states an attempt's record may hold (none at all: just claimed, so ``running``).
STATES = frozenset({"running", "done", "failed", "pruned", "abandoned"})
_FIELD_MAX = 1 << 20  # config, intermediate values and sampler notes: each at most 1 MiB of text
_DEPTH_MAX = 32  # how deep the sampler's notes may nest


def definition_name(study: str) -> str:
    """The entry that holds ``study``'s definition."""
    return f"{study}/study"


def trial_prefix(study: str) -> str:
    """What the names of ``study``'s attempts start with."""
    return f"{study}/trial/"


def attempt_of(rest: str) -> tuple[int, int, bool] | None:
    """The trial and the attempt an attempt's name stands for, given the name after
    ``trial_prefix``, and whether it is in the folder-per-trial form (``<n>/<attempt>``,
    written before December 2026) rather than ``<n>.<attempt>``; ``None`` for any other
    name (somebody else's entry). Where one attempt is stored in both forms, the
    ``<n>.<attempt>`` one counts: it is what runners write now."""
    for mark, older in ((".", False), ("/", True)):
        number, found, attempt = rest.partition(mark)
        if found and number.isascii() and number.isdigit() and attempt.isascii() and attempt.isdigit():
            return int(number), int(attempt), older
    return None


def attempt_records(
    scanned: Iterable[tuple[str, dict[str, str]]], prefix: str
) -> list[tuple[str, int, int, dict[str, str]]]:
    """The attempts among ``scanned`` (names below ``prefix``, ``trial_prefix``'s), each as
    ``(name, trial, attempt, record)``: somebody else's entries left out, and of one attempt
    stored in both forms only the ``<n>.<attempt>`` one (``attempt_of``)."""
    chosen: dict[tuple[int, int], tuple[str, dict[str, str], bool]] = {}
    for name, record in scanned:
        parsed = attempt_of(name[len(prefix) :])
        if parsed is None:
            continue
        trial, attempt, folder_form = parsed
        there = chosen.get((trial, attempt))
        if folder_form and there is not None and not there[2]:
            continue
        chosen[(trial, attempt)] = (name, record, folder_form)
    return [(name, trial, attempt, record) for (trial, attempt), (name, record, _) in chosen.items()]


@dataclasses.dataclass(frozen=True)
class Checked:
    """The fields of an attempt's record that readers and runners use, checked."""

    state: str
    score: float | None
    config: dict[str, Any]
    intermediate: list[tuple[int, float]]
    sampler_attrs: dict[str, dict[str, Any]]  # "trial" and "study": name -> plain JSON


def checked_attempt(record: dict[str, str]) -> Checked:
    """The record of one attempt, checked; ``ValueError`` saying what is wrong otherwise.

    Nothing here trusts the record: each field is bounded in size before it is parsed,
    JSON too deep for the parser is refused, and kinds and numbers are checked (a step is a
    whole number, a configuration a map of plain values, the sampler's notes maps).
    """
    state = record.get("state", "running")
    if state not in STATES:
        raise ValueError(f"its state {state[:40]!r} is none of {', '.join(sorted(STATES))}")
    text = record.get("score", "")
    score = None if text == "" else number(text)
    if text != "" and score is None:
        raise ValueError(f"its score {text[:40]!r} is not a number")
    config = _json(record, "config", "{}", 1)
    if not isinstance(config, dict):
        raise ValueError("its config is not a JSON object")
    for key, value in config.items():
        if not (value is None or isinstance(value, (str, bool, int)) or _finite(value)):
            raise ValueError(f"its config gives {key[:40]!r} a value that is not a plain finite value")
    intermediate = []
    points = _json(record, "intermediate", "[]", 2, finite=False)  # a diverged value is NaN
    if not isinstance(points, list):
        raise ValueError("its intermediate values are not a JSON list")
    for point in points:
        if not (isinstance(point, list) and len(point) == 2 and _step(point[0]) and _number(point[1])):
            raise ValueError("its intermediate values are not [whole step, number] pairs")
        intermediate.append((point[0], float(point[1])))
    attrs = _json(record, "sampler_attrs", "{}", _DEPTH_MAX, finite=False)
    if not isinstance(attrs, dict) or not all(isinstance(attrs.get(side, {}), dict) for side in ("trial", "study")):
        raise ValueError("its sampler_attrs are not a JSON object of 'trial' and 'study' objects")
    sides = {side: dict(attrs.get(side, {})) for side in ("trial", "study")}
    return Checked(state, score, config, intermediate, sides)


def left_out(store: Store, name: str, why: object) -> None:
    """Say once that the record ``name`` is left out, and why."""
    where = getattr(store, "path", None)
    tell_once(
        f"{where}/{name}" if where is not None else f"{id(store)}:{name}",
        f"somatize study: the record {name} is left out: {why}; it was not written by a "
        f"runner of this version (someone who may write the study's folder wrote it).",
    )


def _json(record: dict[str, str], key: str, empty: str, most: int, *, finite: bool = True) -> Any:
    """A field of JSON text, bounded in size, then in depth before it is parsed (``plain_json``)."""
    text = record.get(key)
    if not text:  # most records have no intermediate values or notes: nothing to parse
        return [] if empty == "[]" else {}
    if len(text) > _FIELD_MAX:
        raise ValueError(f"its {key} is {len(text)} characters long, more than {_FIELD_MAX}")
    return plain_json(text, most, finite=finite, what=f"its {key}")


def _finite(value: object) -> bool:
    return isinstance(value, float) and math.isfinite(value)


def _number(value: object) -> bool:
    return isinstance(value, float) or (isinstance(value, int) and not isinstance(value, bool) and abs(value) < 2**63)


def _step(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63


_DIRECTIONS = ("minimize", "maximize")


def trials(store: Store, study: str) -> list[dict[str, Any]]:
    """Every trial of ``study``, by number. One scan of ``<study>/trial/``, no fetch.

    Each entry has ``trial`` (its number), ``state`` (``running``, ``done``, ``failed``,
    ``abandoned`` or ``pruned``), ``score`` (a float, or ``None`` until there is one),
    ``attempts`` (how many times it was started), ``took_us`` (as its attempt last wrote
    it: so far, while it runs; ``None`` if it wrote none),
    ``config`` (a dict), ``said`` (the values it said last, by key: floats where they read
    as one), ``runner`` (who ran its last attempt), and ``error`` for one that failed.
    """
    name = _check_study(study, "trials(study=...)")
    prefix = trial_prefix(name)
    return _rows(store, name, store.scan(prefix), prefix)


def trial_records(store: Store, study: str) -> list[tuple[str, dict[str, str]]]:
    """The records of ``study``'s attempts, as one scan of ``<study>/trial/`` reads them:
    for `trials_of` and ``History.of`` both (the view's study page reads its rows and its
    attempts from one scan)."""
    return list(store.scan(trial_prefix(_check_study(study, "trials(study=...)"))))


def trials_of(store: Store, study: str, scanned: Iterable[tuple[str, dict[str, str]]]) -> list[dict[str, Any]]:
    """`trials`, from the records `trial_records` read."""
    name = _check_study(study, "trials(study=...)")
    return _rows(store, name, scanned, trial_prefix(name))


def best(store: Store, study: str) -> dict[str, Any] | None:
    """The trial that did best, as :func:`trials` tells it, or ``None`` while none is done.

    Best is the lowest score, or the highest when the study's ``direction`` is
    ``maximize``; among equals, the first. Only ``done`` trials with a score that is a
    number count. One scan of ``<study>/`` (the definition and the trials together), no fetch.
    """
    direction, rows = _study(store, study, "best(study=...)")
    return best_of(rows, direction)


def best_of(rows: list[dict[str, Any]], direction: str | None) -> dict[str, Any] | None:
    """`best`, from rows :func:`trials` already read (the view's study page has them);
    ``None`` too when the direction is unknown."""
    if direction is None:
        return None
    return min(_scored(rows), key=lambda row: (_sign(direction) * row["score"], row["trial"]), default=None)


def scored(store: Store, study: str, where: str) -> tuple[str | None, list[dict[str, Any]]]:
    """The study's direction, and its trials each with ``best``: the best score of the done
    trials up to it (``None`` before the first), and ``improved`` when it set that best.
    One scan of ``<study>/``, no fetch; what the drawing of a study is made from."""
    direction, rows = _study(store, study, where)
    sign = _sign(direction)
    so_far: float | None = None
    for row in rows:
        score = row["score"] if _counts(row) else None
        improved = score is not None and direction is not None and (so_far is None or sign * score < sign * so_far)
        if improved:
            so_far = score
        row["best"] = so_far
        row["improved"] = improved
    return direction, rows


# -- the scan -------------------------------------------------------------------------------


def _study(store: Store, study: str, where: str) -> tuple[str | None, list[dict[str, Any]]]:
    """The direction and the trials of ``study``, from one scan of ``<study>/``."""
    name = _check_study(study, where)
    definition: dict[str, str] | None = None
    found: list[tuple[str, dict[str, str]]] = []
    prefix = trial_prefix(name)
    for key, record in store.scan(f"{name}/"):
        if key == definition_name(name):
            definition = record
        elif key.startswith(prefix):
            found.append((key, record))
    if definition is None:
        raise Missing(
            f"{where}: this store holds no study {name!r} ({name}/study is not there, so its "
            f"direction is unknown). Check the name, and the store: the one `Study(store, "
            f"{name!r}, ...)` was given."
        )
    return direction_of(store, name, definition), _rows(store, name, found, prefix)


def direction_of(store: Store, study: str, definition: Mapping[str, str]) -> str | None:
    """The direction ``study``'s definition says, or ``None`` (said once, naming the
    definition) when it says neither ``minimize`` nor ``maximize``: then no trial is ranked,
    rather than the worst called best by a guess."""
    direction = definition.get("direction", "minimize")
    if direction in _DIRECTIONS:
        return direction
    left_out(
        store,
        definition_name(study),
        f"its direction {direction[:40]!r} is neither 'minimize' nor 'maximize', so no trial is "
        f"called best until it says one",
    )
    return None


def _rows(store: Store, name: str, scanned: Iterable[tuple[str, dict[str, str]]], prefix: str) -> list[dict[str, Any]]:
    attempts: dict[int, dict[int, tuple[dict[str, str], Checked]]] = {}
    for key, trial, attempt, record in attempt_records(scanned, prefix):
        try:
            checked = checked_attempt(record)
        except ValueError as exc:
            left_out(store, key, exc)
            continue
        attempts.setdefault(trial, {})[attempt] = (record, checked)
    return [_row(number, attempts[number]) for number in sorted(attempts)]


def _row(number: int, tried: dict[int, tuple[dict[str, str], Checked]]) -> dict[str, Any]:
    record, checked = tried[max(tried)]  # the highest attempt's is the one that counts
    row: dict[str, Any] = {
        "trial": number,
        "state": record.get("state", ""),
        "score": checked.score,
        "attempts": len(tried),
        "took_us": whole(record.get("took_us")),
        "config": checked.config,
        "said": {key[5:]: maybe_float(value) for key, value in record.items() if key.startswith("said.")},
        "runner": record.get("runner", ""),
    }
    if row["state"] == "failed":
        row["error"] = record.get("error", "")
    return row


def _scored(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [row for row in rows if _counts(row)]


def _counts(row: dict[str, Any]) -> bool:
    """Whether a trial's score counts towards the best: done, and a number."""
    return row["state"] == "done" and row["score"] is not None and not math.isnan(row["score"])


def _sign(direction: str | None) -> int:
    return -1 if direction == "maximize" else 1


def _check_study(study: object, where: str) -> str:
    if not isinstance(study, str):
        raise BadName(f"{where}: a study's name is a str, not a `{type(study).__name__}`.")
    try:
        check_name(definition_name(study))
    except BadName as exc:
        raise BadName(f"{where}: {study!r} cannot name a study. {exc}") from None
    return study
