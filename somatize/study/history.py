"""A study's history: one scan of its trials' records, and the Optuna study rebuilt from it.

Every attempt of every trial is one entry, ``<study>/trial/<n:06d>/<attempt:03d>``, whose
record holds the configuration, the state and the score beside each other. So one scan
says everything a sampler needs, without reading a single blob. The attempt that counts
for a trial is its highest; an attempt that is still ``running`` while a higher one exists
was abandoned.

Nothing here writes: the runner claims, writes and judges.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterator
from typing import Any

from ..store import Store
from .definition import Definition, optuna

#: The states an attempt's record may hold. ``abandoned`` is written by a runner that was
#: stopped (or learned it was overtaken); a reader infers it for any superseded ``running``.
FINISHED = frozenset({"done", "failed", "pruned"})


def trial_prefix(study: str) -> str:
    return f"{study}/trial/"


def attempt_name(study: str, number: int, attempt: int) -> str:
    return f"{study}/trial/{number:06d}/{attempt:03d}"


@dataclasses.dataclass
class Attempt:
    name: str
    number: int
    attempt: int
    record: dict[str, str]

    @property
    def state(self) -> str:
        return self.record.get("state", "running")

    def config(self) -> dict[str, Any]:
        try:
            config = json.loads(self.record.get("config", "{}"))
        except ValueError:
            return {}
        return config if isinstance(config, dict) else {}


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
        prefix = trial_prefix(study)
        by_number: dict[int, list[Attempt]] = {}
        for name, record in store.scan(prefix):
            parts = name[len(prefix) :].split("/")
            if len(parts) != 2 or not all(p.isdigit() for p in parts):
                continue  # not an attempt's record: somebody else's entry
            number, attempt = int(parts[0]), int(parts[1])
            by_number.setdefault(number, []).append(Attempt(name, number, attempt, record))
        return cls(
            {
                n: TrialHistory(n, sorted(attempts, key=lambda a: a.attempt))
                for n, attempts in by_number.items()
            }
        )

    def __iter__(self) -> Iterator[TrialHistory]:
        return iter(self.trials.values())

    def __len__(self) -> int:
        return len(self.trials)

    def next_number(self, trials: int) -> int | None:
        """The lowest trial number nobody has claimed, or ``None`` when all ``trials`` are."""
        for number in range(trials):
            if number not in self.trials:
                return number
        return None

    def finished(self, trials: int) -> bool:
        return all(n in self.trials and self.trials[n].finished for n in range(trials))

    def rebuild(self, definition: Definition, study: str, number: int) -> tuple[Any, Any]:
        """An in-memory Optuna study holding this history, with its sampler seeded to
        propose trial ``number``; returns it and its storage.

        Each trial enters as its highest attempt says: ``done`` as complete with its
        score, ``failed`` as failed, ``pruned`` as pruned with its intermediate values,
        anything else as running (so a sampler that knows about running trials steers
        around them). The sampler's own attributes, kept in each record, come back too.
        """
        opt = optuna()
        _quiet_in_memory_studies()
        storage = opt.storages.InMemoryStorage()
        ostudy = opt.create_study(
            storage=storage,
            sampler=definition.sampler_for(number),
            pruner=definition.make_pruner(),
            direction=definition.direction,
            study_name=f"{_STUDY_NAMES}{study}",
        )
        frozen = []
        study_attrs: dict[str, Any] = {}
        for trial in self:
            made = _frozen(opt, definition, trial.last)
            if made is not None:
                frozen.append(made)
            attrs = _sampler_attrs(trial.last.record)
            study_attrs.update(attrs.get("study", {}))  # the latest trial's values win
        ostudy.add_trials(frozen)
        study_id = storage.get_study_id_from_name(ostudy.study_name)
        for key, value in study_attrs.items():
            storage.set_study_system_attr(study_id, key, value)
        return ostudy, storage


def sampler_attrs(storage: Any, ostudy: Any, number: int) -> dict[str, Any]:
    """What the sampler (and pruner) noted about trial ``number`` of an in-memory study,
    and about the study, kept as JSON so the next rebuild gives it back."""
    study_id = storage.get_study_id_from_name(ostudy.study_name)
    trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, number)
    return {
        "trial": _json_only(storage.get_trial_system_attrs(trial_id)),
        "study": _json_only(storage.get_study_system_attrs(study_id)),
    }


def _frozen(opt: Any, definition: Definition, attempt: Attempt) -> Any:
    states = opt.trial.TrialState
    record = attempt.record
    state = attempt.state
    params = attempt.config()
    intermediate = {}
    try:
        for step, value in json.loads(record.get("intermediate") or "[]"):
            intermediate[int(step)] = float(value)
    except (ValueError, TypeError):
        intermediate = {}
    value = None
    if state == "done":
        try:
            value = float(record.get("score", ""))
        except ValueError:
            state = "failed"
    kind = {"done": states.COMPLETE, "failed": states.FAIL, "pruned": states.PRUNED}.get(
        state, states.RUNNING
    )
    try:
        return opt.trial.create_trial(
            state=kind,
            value=value,
            params={k: params[k] for k in definition.space if k in params},
            distributions={k: d for k, d in definition.space.items() if k in params},
            system_attrs=_sampler_attrs(record).get("trial", {}),
            intermediate_values=intermediate,
        )
    except ValueError:
        return None  # a record this space cannot hold (edited by hand): left out


def _sampler_attrs(record: dict[str, str]) -> dict[str, Any]:
    try:
        attrs = json.loads(record.get("sampler_attrs") or "{}")
    except ValueError:
        return {}
    return attrs if isinstance(attrs, dict) else {}


def _json_only(attrs: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in attrs.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            continue
        out[key] = value
    return out


# Optuna announces every study it creates at INFO; a runner creates one per claim. Only
# those announcements, of only our in-memory studies, are dropped.
_STUDY_NAMES = "somatize-study:"
_quieted = False


class _OursOnly(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return _STUDY_NAMES not in record.getMessage()


def _quiet_in_memory_studies() -> None:
    global _quieted
    if not _quieted:
        logging.getLogger("optuna.storages._in_memory").addFilter(_OursOnly())
        _quieted = True
