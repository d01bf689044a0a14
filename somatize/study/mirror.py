"""Optuna's view of a study's trials, kept in one runner's memory and updated as they change.

A runner asks Optuna's sampler for every trial it claims, and the sampler wants every trial
the study has seen. Rebuilding an in-memory Optuna study from all the records before each
claim costs as much as the study is long. Instead a runner keeps one, a ``Mirror``: each
trial enters it once, when the runner first reads it, and changes in place when its record
does (running, then done: its score, its intermediate values, the sampler's notes).

Two kinds of Optuna trial must leave it: one asked for a number another runner claimed
first, and one whose record now says something the copy cannot become (another
configuration, a record that fails its checks). Optuna's in-memory storage cannot delete a
trial, so ours hides them from everything that reads the trials.

What a mirror holds is what the records say, checked (``history``): nothing in it came from
a pickle. Importing this module imports Optuna; ``study`` imports it only to run trials.
"""

from __future__ import annotations

import logging
from collections.abc import Container, Iterable
from typing import Any, Literal, cast

import optuna
from optuna.trial import FrozenTrial, TrialState

from .definition import Definition
from .history import Attempt, TrialHistory

_EMPTY: dict[str, dict[str, Any]] = {"trial": {}, "study": {}}


class _Storage(optuna.storages.InMemoryStorage):
    """Optuna's in-memory storage, with trials that can be hidden from every reader."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden: set[int] = set()
        self.made = -1  # the id of the trial made last

    def create_new_trial(self, study_id: int, template_trial: FrozenTrial | None = None) -> int:
        self.made = super().create_new_trial(study_id, template_trial)
        return self.made

    def get_all_trials(
        self, study_id: int, deepcopy: bool = True, states: Container[TrialState] | None = None
    ) -> list[FrozenTrial]:
        trials = super().get_all_trials(study_id, deepcopy, states)
        if self.hidden:
            trials = [t for t in trials if t._trial_id not in self.hidden]
        return trials

    def get_best_trial(self, study_id: int) -> FrozenTrial:
        best = super().get_best_trial(study_id)
        if best._trial_id not in self.hidden:
            return best
        done = self.get_all_trials(study_id, deepcopy=False, states=(TrialState.COMPLETE,))
        if not done:
            raise ValueError("No trials are completed yet.")
        maximize = self.get_study_directions(study_id)[0] == optuna.study.StudyDirection.MAXIMIZE
        pick = max if maximize else min
        return self.get_trial(pick(done, key=lambda t: cast(float, t.value))._trial_id)  # complete: a value each


class Mirror:
    """One in-memory Optuna study holding a study's trials as this runner last read them.

    ``take(trial)`` brings a trial in, or brings its copy up to date; ``ask(number)`` asks
    the sampler for trial ``number`` (seeded for it, as ``Definition.sampler_for`` says);
    ``keep(number, otrial)`` makes an asked trial the copy of ``number`` once this runner
    holds it, ``drop(otrial)`` hides one it did not get. The sampler's notes come back from
    the records unless ``notes`` is false.
    """

    def __init__(
        self, definition: Definition, study: str, trials: Iterable[TrialHistory], *, notes: bool = True
    ) -> None:
        _quiet_in_memory_studies()
        self.definition = definition
        self.notes = notes
        self.storage = _Storage()
        self.study = optuna.create_study(
            storage=self.storage,
            sampler=definition.sampler_for(0),
            pruner=definition.make_pruner(),
            direction=cast(Literal["minimize", "maximize"], definition.direction),  # one of DIRECTIONS, checked
            study_name=f"{_STUDY_NAMES}{study}",
        )
        self._study_id = self.storage.get_study_id_from_name(self.study.study_name)
        self._ids: dict[int, int] = {}  # trial number -> Optuna trial id of its copy
        self._noted: dict[str, int] = {}  # a study note -> the trial number whose record set it
        for trial in trials:
            self.take(trial)

    def __len__(self) -> int:
        return len(self._ids)

    # -- what the records say

    def take(self, trial: TrialHistory) -> None:
        """Bring ``trial`` in as its highest attempt says, or update the copy already here.

        ``done`` enters as complete with its score, ``failed`` as failed, ``pruned`` as
        pruned with its intermediate values, anything else as running (so a sampler that
        knows about running trials steers around them). A record that failed its checks, or
        that this space cannot hold, leaves nothing here."""
        last = trial.last
        known = self._ids.get(trial.number)
        made = None
        if last.checked is not None:
            attrs = last.sampler_attrs() if self.notes else _EMPTY
            self._note(trial.number, attrs["study"])
            made = _frozen(self.definition, last, attrs["trial"])
        if known is not None:
            if made is not None and self._updated(known, made):
                return
            self._hide(known)
            del self._ids[trial.number]
        if made is not None:  # checked by create_trial
            self._ids[trial.number] = self.storage.create_new_trial(self._study_id, template_trial=made)

    def _updated(self, known: int, made: FrozenTrial) -> bool:
        """Make the copy ``known`` say what ``made`` says, in place; ``False`` where it cannot."""
        have = self.storage.get_trial(known)
        if have.params != made.params or have.distributions != made.distributions:
            return False
        if have.state.is_finished():  # a finished copy never changes: the same, or replaced
            return (have.state, have.values, have.intermediate_values) == (
                made.state,
                made.values,
                made.intermediate_values,
            ) and all(have.system_attrs.get(k) == v for k, v in made.system_attrs.items())
        for key, value in made.system_attrs.items():
            if have.system_attrs.get(key) != value:
                self.storage.set_trial_system_attr(known, key, value)
        for step, value in made.intermediate_values.items():
            if have.intermediate_values.get(step) != value:
                self.storage.set_trial_intermediate_value(known, step, value)
        if made.state != TrialState.RUNNING:
            self.storage.set_trial_state_values(known, made.state, made.values)
        return True

    def _note(self, number: int, notes: dict[str, Any]) -> None:
        """The study's notes as the records say: each from the highest trial that wrote it."""
        for key, value in notes.items():
            if self._noted.get(key, -1) <= number:
                self._noted[key] = number
                self.storage.set_study_system_attr(self._study_id, key, value)

    def _hide(self, trial_id: int) -> None:
        self.storage.hidden.add(trial_id)

    # -- asking

    def ask(self, number: int) -> Any:
        """An Optuna trial proposing trial ``number``'s configuration (not kept yet)."""
        self.study.sampler = self.definition.sampler_for(number, reuse=self.study.sampler)
        return self._asking(lambda: self.study.ask(self.definition.space))

    def ask_again(self, number: int, config: dict[str, Any]) -> Any:
        """An Optuna trial for another attempt at trial ``number``, with its configuration
        (so that the pruner judges the new attempt too)."""
        self.study.sampler = self.definition.sampler_for(number, reuse=self.study.sampler)

        def again() -> Any:
            self.study.enqueue_trial(config)
            return self.study.ask(self.definition.space)

        return self._asking(again)

    def _asking(self, ask: Any) -> Any:
        before = self.storage.made
        try:
            return ask()
        except BaseException:
            if self.storage.made != before:
                self._hide(self.storage.made)  # half made, or waiting in the queue: never seen
            raise

    def keep(self, number: int, otrial: Any) -> None:
        """``otrial`` is now the copy of trial ``number`` (this runner claimed it)."""
        known = self._ids.get(number)
        if known is not None:
            self._hide(known)  # the attempt it takes over
        self._ids[number] = otrial._trial_id

    def drop(self, otrial: Any) -> None:
        """``otrial`` was asked for a trial this runner did not get: nobody sees it again."""
        self._hide(otrial._trial_id)

    def notes_of(self, otrial: Any) -> dict[str, Any]:
        """What the sampler (and pruner) noted about ``otrial`` and the study, as JSON."""
        return sampler_attrs(self.storage, self.study, otrial.number)


def sampler_attrs(storage: Any, ostudy: Any, number: int) -> dict[str, Any]:
    """What the sampler (and pruner) noted about trial ``number`` of an in-memory study,
    and about the study, kept as JSON so the next runner to read the record gets it back."""
    from .history import json_only, plain

    study_id = storage.get_study_id_from_name(ostudy.study_name)
    trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, number)
    return {
        "trial": plain(json_only(storage.get_trial_system_attrs(trial_id))),
        "study": plain(json_only(storage.get_study_system_attrs(study_id))),
    }


def _frozen(definition: Definition, attempt: Attempt, attrs: dict[str, Any]) -> FrozenTrial | None:
    states = TrialState
    checked = attempt.checked
    assert checked is not None
    state = checked.state
    params = checked.config
    value = checked.score
    if state == "done" and (value is None or value != value):
        state, value = "failed", None
    elif state != "done":
        value = None
    kind = {"done": states.COMPLETE, "failed": states.FAIL, "pruned": states.PRUNED}.get(state, states.RUNNING)
    try:
        return optuna.trial.create_trial(
            state=kind,
            value=value,
            params={k: params[k] for k in definition.space if k in params},
            distributions={k: d for k, d in definition.space.items() if k in params},
            system_attrs=attrs,
            intermediate_values=dict(checked.intermediate),
        )
    except (ValueError, TypeError, OverflowError):
        return None  # a record this space cannot hold (edited by hand): left out


# Optuna announces every study it creates at INFO. Only those announcements, of only our
# in-memory studies, are dropped.
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
