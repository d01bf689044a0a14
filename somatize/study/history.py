"""A study's history: its trials' records, read with one scan, or one trial at a time.

Every attempt of every trial is one entry, ``<study>/trial/<n:06d>.<attempt:03d>``, whose
record holds the configuration, the state and the score beside each other. So one scan
says everything a sampler needs, without reading a single blob. The attempt that counts
for a trial is its highest; an attempt that is still ``running`` while a higher one exists
was abandoned.

Nothing here writes: the runner claims, writes and judges. A runner reads the whole study
once, then only the trials that may have changed (``read_trial``, see ``view``); Optuna's
view of the trials is kept by ``mirror``.

Records come from a folder others may write. Each is checked before it is used
(``somatize.record.studies.checked_attempt``); one that fails still holds its trial's number
(so nobody claims it again) but counts as failed and tells the sampler nothing, with one line
naming it. And nothing read from a record ever reaches ``pickle``: the sampler's notes come
back only as plain JSON, without the keys where Optuna keeps a pickle (CMA-ES's optimizer,
which is rebuilt from the trials instead: see ``cmaes``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Iterator
from typing import Any

from ..record.studies import Checked, attempt_records, checked_attempt, left_out, trial_prefix
from ..store import FolderStore, Store
from .definition import Definition

#: The states an attempt's record may hold. ``abandoned`` is written by a runner that was
#: stopped (or learned it was overtaken); a reader infers it for any superseded ``running``.
FINISHED = frozenset({"done", "failed", "pruned"})


#: How many attempts past the give-up record's a read of one trial follows, at most: runners
#: go past it only to take over attempts someone else wrote there, and no further than this
#: is read at all, however many such names a writer of the folder puts in a row.
_BEYOND = 100


def attempt_name(study: str, number: int, attempt: int) -> str:
    """The entry of one attempt: one file per attempt, all in the study's ``trial`` folder (a
    runner makes no folder per trial: on a cluster's file system each is a round trip)."""
    return f"{trial_prefix(study)}{number:06d}.{attempt:03d}"


def older_attempt_name(study: str, number: int, attempt: int) -> str:
    """Where a study written before December 2026 keeps an attempt: a folder per trial.
    Read, never written."""
    return f"{trial_prefix(study)}{number:06d}/{attempt:03d}"


@dataclasses.dataclass
class Attempt:
    name: str
    number: int
    attempt: int
    record: dict[str, str]
    checked: Checked | None = None  # None: the record failed its checks, and says nothing
    problem: str = ""

    @property
    def state(self) -> str:
        return "failed" if self.checked is None else self.checked.state

    def config(self) -> dict[str, Any]:
        return {} if self.checked is None else dict(self.checked.config)

    def sampler_attrs(self) -> dict[str, dict[str, Any]]:
        """What the sampler noted, as plain JSON, never a key where Optuna keeps a pickle."""
        if self.checked is None:
            return {"trial": {}, "study": {}}
        return {side: plain(attrs) for side, attrs in self.checked.sampler_attrs.items()}


@dataclasses.dataclass
class TrialHistory:
    number: int
    attempts: list[Attempt]  # in attempt order

    @property
    def last(self) -> Attempt:
        return self.attempts[-1]

    @property
    def state(self) -> str:
        return self.last.state

    @property
    def finished(self) -> bool:
        return self.state in FINISHED


class History:
    """Every trial of one study as one scan found them, by number."""

    def __init__(self, trials: dict[int, TrialHistory]) -> None:
        self.trials = dict(sorted(trials.items()))

    @classmethod
    def scan(cls, store: Store, study: str) -> History:
        """The whole study, from one scan of its trials' records (no blob is read)."""
        return cls.of(store, study, store.scan(trial_prefix(study)))

    @classmethod
    def of(cls, store: Store, study: str, scanned: Iterable[tuple[str, dict[str, str]]]) -> History:
        """The whole study, from a scan of its trials' records already made."""
        return cls(_trials(store, trial_prefix(study), scanned))

    def __iter__(self) -> Iterator[TrialHistory]:
        return iter(self.trials.values())

    def __len__(self) -> int:
        return len(self.trials)

    def rebuild(self, definition: Definition, study: str, number: int) -> tuple[Any, Any]:
        """An in-memory Optuna study holding this history, with its sampler seeded to
        propose trial ``number``; returns it and its storage.

        Each trial enters as its highest attempt says (see ``mirror.Mirror.take``), with
        the sampler's notes its record keeps; a trial whose record failed its checks is
        left out."""
        from .mirror import Mirror

        mirror = Mirror(definition, study, self)
        mirror.study.sampler = definition.sampler_for(number)
        return mirror.study, mirror.storage


def read_trial(store: Store, study: str, number: int, attempts: int = 3, *, older: bool = False) -> TrialHistory | None:
    """Trial ``number`` of ``study`` as its attempts' records say now, or ``None`` when no
    attempt of it is stored. On a folder, its attempts' names are read, not listed: attempts 0
    to ``attempts`` (the give-up record's), and on while the last of them is there, one open
    each whatever the study's size. ``older``: the study has trials in the folder-per-trial
    form too, and trial ``number``'s folder is read as well."""
    prefix = trial_prefix(study)
    if isinstance(store, FolderStore):
        scanned = list(store.scan_names(attempt_name(study, number, k) for k in range(attempts + 1)))
        after = attempts + 1
        while scanned and scanned[-1][0] == attempt_name(study, number, after - 1) and after <= attempts + _BEYOND:
            more = list(store.scan_names([attempt_name(study, number, after)]))
            if not more:
                break
            scanned += more
            after += 1
    else:
        scanned = list(store.scan(f"{prefix}{number:06d}."))
    if older:
        scanned += list(store.scan(f"{prefix}{number:06d}/"))
    return _trials(store, prefix, scanned).get(number)


def _trials(store: Store, prefix: str, scanned: Iterable[tuple[str, dict[str, str]]]) -> dict[int, TrialHistory]:
    by_number: dict[int, dict[int, Attempt]] = {}
    for name, number, attempt, record in attempt_records(scanned, prefix):
        try:
            found = Attempt(name, number, attempt, record, checked_attempt(record))
        except ValueError as exc:
            left_out(store, name, exc)
            found = Attempt(name, number, attempt, {}, None, str(exc))
        by_number.setdefault(number, {})[attempt] = found
    return {n: TrialHistory(n, [tried[k] for k in sorted(tried)]) for n, tried in by_number.items()}


def plain(attrs: dict[str, Any]) -> dict[str, Any]:
    """The sampler's notes without those Optuna keeps as a pickle (CMA-ES's optimizer, as
    ``cma:optimizer:0``...; rebuilt from the trials, never read back)."""
    return {key: value for key, value in attrs.items() if "optimizer" not in key}


def json_only(attrs: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in attrs.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            continue
        out[key] = value
    return out
