"""Reading a study back: what each trial did, and which one did best, from one scan.

A study is a folder in a store (the study itself is :mod:`somatize.study`'s): ``<study>/study``
holds its definition, and ``<study>/trial/<n>/<attempt>`` one record per attempt, with
``config`` (JSON), ``state``, ``score``, ``took_us``, ``runner``, ``error``, the values the
trial said last as ``said.<key>``, and the summarised ``<kind>.<field>``. A trial's result
is its highest attempt's: an attempt with a later one was abandoned, whatever it says.

Nothing here fetches a blob, and nothing judges whether a running attempt is still alive:
that is judged by the store's stamps, by the runners, never by a reader's clock.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from typing import Any

from ..errors import BadName, Missing
from ..store import Store, check_name
from .readers import maybe_float, whole

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
    return _rows(name, store.scan(f"{name}/trial/"), f"{name}/trial/")


def best(store: Store, study: str) -> dict[str, Any] | None:
    """The trial that did best, as :func:`trials` tells it, or ``None`` while none is done.

    Best is the lowest score, or the highest when the study's ``direction`` is
    ``maximize``; among equals, the first. Only ``done`` trials with a score that is a
    number count. One scan of ``<study>/`` (the definition and the trials together), no fetch.
    """
    direction, rows = _study(store, study, "best(study=...)")
    ranked = sorted(_scored(rows), key=lambda row: (_sign(direction) * row["score"], row["trial"]))
    return ranked[0] if ranked else None


def scored(store: Store, study: str, where: str) -> tuple[str, list[dict[str, Any]]]:
    """The study's direction, and its trials each with ``best``: the best score of the done
    trials up to it (``None`` before the first), and ``improved`` when it set that best.
    One scan of ``<study>/``, no fetch; what the drawing of a study is made from."""
    direction, rows = _study(store, study, where)
    sign = _sign(direction)
    so_far: float | None = None
    for row in rows:
        score = row["score"] if _counts(row) else None
        improved = score is not None and (so_far is None or sign * score < sign * so_far)
        if improved:
            so_far = score
        row["best"] = so_far
        row["improved"] = improved
    return direction, rows


# -- the scan -------------------------------------------------------------------------------


def _study(store: Store, study: str, where: str) -> tuple[str, list[dict[str, Any]]]:
    """The direction and the trials of ``study``, from one scan of ``<study>/``."""
    name = _check_study(study, where)
    definition: dict[str, str] | None = None
    found: list[tuple[str, dict[str, str]]] = []
    trial_prefix = f"{name}/trial/"
    for key, record in store.scan(f"{name}/"):
        if key == f"{name}/study":
            definition = record
        elif key.startswith(trial_prefix):
            found.append((key, record))
    if definition is None:
        raise Missing(
            f"{where}: this store holds no study {name!r} ({name}/study is not there, so its "
            f"direction is unknown). Check the name, and the store: the one `Study(store, "
            f"{name!r}, ...)` was given."
        )
    direction = definition.get("direction", "minimize")
    if direction not in _DIRECTIONS:
        raise ValueError(
            f"{where}: study {name!r} says its direction is {direction!r}; a study minimizes "
            f"or maximizes its score ('minimize' or 'maximize')."
        )
    return direction, _rows(name, found, trial_prefix)


def _rows(name: str, scanned: Iterable[tuple[str, dict[str, str]]], prefix: str) -> list[dict[str, Any]]:
    attempts: dict[int, dict[int, dict[str, str]]] = {}
    for key, record in scanned:
        parts = key[len(prefix) :].split("/")
        if len(parts) == 2 and all(part.isascii() and part.isdigit() for part in parts):
            attempts.setdefault(int(parts[0]), {})[int(parts[1])] = record
    return [_row(name, number, attempts[number]) for number in sorted(attempts)]


def _row(name: str, number: int, tried: dict[int, dict[str, str]]) -> dict[str, Any]:
    attempt = max(tried)
    record = tried[attempt]  # the highest attempt's is the one that counts
    where = f"trial {number} (attempt {attempt}) of study {name!r}"
    row: dict[str, Any] = {
        "trial": number,
        "state": record.get("state", ""),
        "score": _score(record.get("score", ""), where),
        "attempts": len(tried),
        "took_us": whole(record.get("took_us")),
        "config": _config(record.get("config"), where),
        "said": {key[5:]: maybe_float(value) for key, value in record.items() if key.startswith("said.")},
        "runner": record.get("runner", ""),
    }
    if row["state"] == "failed":
        row["error"] = record.get("error", "")
    return row


def _score(text: str, where: str) -> float | None:
    if text == "":
        return None
    try:
        return float(text)
    except ValueError:
        raise ValueError(
            f"{where} has the score {text!r}, which is not a number; a score is what the "
            f"objective returned, written as a float."
        ) from None


def _config(text: str | None, where: str) -> dict[str, Any]:
    if text is None:
        return {}
    try:
        config = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{where} has a config that is not JSON ({exc}): {text[:200]!r}.") from None
    if not isinstance(config, dict):
        raise ValueError(f"{where} has a config that is not a JSON object: {text[:200]!r}.")
    return config


def _scored(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [row for row in rows if _counts(row)]


def _counts(row: dict[str, Any]) -> bool:
    """Whether a trial's score counts towards the best: done, and a number."""
    return row["state"] == "done" and row["score"] is not None and not math.isnan(row["score"])


def _sign(direction: str) -> int:
    return -1 if direction == "maximize" else 1


def _check_study(study: object, where: str) -> str:
    if not isinstance(study, str):
        raise BadName(f"{where}: a study's name is a str, not a `{type(study).__name__}`.")
    try:
        check_name(f"{study}/study")
    except BadName as exc:
        raise BadName(f"{where}: {study!r} cannot name a study. {exc}") from None
    return study
