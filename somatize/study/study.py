"""A study: a folder, not a service. Runners anywhere claim its trials from a shared store.

A runner's loop is: scan the trials once; if an attempt has stopped being written, take it
over as the next attempt; otherwise ask the sampler (Optuna's, rebuilt in memory from that
scan) for a configuration and claim the next trial number by creating its attempt 0 (if
another runner created it first, scan again); run the objective, writing the attempt as it
goes; write the result. It stops when every trial has finished.

"Stopped being written" is judged only by the store's stamps: the judge writes an entry of
its own (``<study>/judge/<runner>``) and compares that entry's stamp with the attempt's.
Two machines' clocks are never compared, so a runner whose clock is off judges as well as
any other. The attempt number is the fence: a runner that wakes up after its attempt was
taken over finds the next attempt and writes nothing that counts.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import socket
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import Missing, SomatizeError, StudyMismatch, Superseded
from ..store import ClaimingStore
from .attempt import Running, Trial
from .definition import Definition, check_name, check_runner, load, optuna
from .history import History, TrialHistory, attempt_name, sampler_attrs

Progress = Callable[[str], Any]


class Study:
    """A search for the configuration that minimises (or maximises) an objective's score.

    ``Study(store, name, objective=..., space=...)`` writes the definition into ``store``
    under ``<name>/study`` if no study has that name yet, and otherwise opens the one there,
    refusing (``StudyMismatch``) a definition that differs from it. ``Study.open(store,
    name)`` opens an existing study as it is defined.

    ``objective`` is an import name, ``"package.module:function"`` (or a top-level function
    of an importable module); it is called with a :class:`Trial` and returns the score.
    ``space`` maps parameter names to Optuna distributions. ``trials`` is how many trials
    the study runs, ``sampler`` names Optuna's sampler (``"tpe"``, ``"random"``,
    ``"grid"``, ``"cmaes"``, ``"qmc"``, ``"gp"``, ``"nsga2"``, ``"bruteforce"``) seeded
    with ``seed``, ``direction`` is ``"minimize"`` or ``"maximize"``. An attempt that goes
    unwritten for ``patience`` seconds is taken over by another runner, up to ``attempts``
    attempts per trial. ``pruner`` names an Optuna pruner (``"median"``, ``"hyperband"``,
    ``"successive_halving"``, ``"wilcoxon"``) that may stop a trial on the values it says.

    The store must be shared by every runner (a folder on a disk they all mount) and be a
    claiming store (``create`` and ``stamp``), such as ``FolderStore``. Who can write that
    folder can add, change or take over trials: give it only to the people running them.
    """

    def __init__(
        self,
        store: ClaimingStore,
        name: str,
        *,
        objective: str | Callable[..., Any],
        space: Mapping[str, Any],
        trials: int = 40,
        sampler: str = "tpe",
        seed: int = 0,
        attempts: int = 3,
        direction: str = "minimize",
        patience: float = 60.0,
        pruner: str | None = None,
    ) -> None:
        self._store = _claiming(store)
        self._name = check_name(name)
        wanted = Definition.checked(
            objective=objective,
            space=space,
            trials=trials,
            sampler=sampler,
            seed=seed,
            attempts=attempts,
            direction=direction,
            patience=patience,
            pruner=pruner,
        )
        self._definition = _settle(self._store, self._name, wanted)

    @classmethod
    def open(cls, store: ClaimingStore, name: str) -> Study:
        """The study called ``name`` in ``store``, as its definition there says."""
        self = cls.__new__(cls)
        self._store = _claiming(store)
        self._name = check_name(name)
        record = _definition_record(self._store, self._name)
        if record is None:
            raise Missing(
                f"There is no study {name!r} in {store!r}. Define it first with "
                f"Study(store, {name!r}, objective='package.module:function', space={{...}}), "
                f"which writes its definition there; then any runner can open it."
            )
        self._definition = Definition.from_record(self._name, record)
        return self

    # -- what it is

    @property
    def name(self) -> str:
        return self._name

    @property
    def store(self) -> ClaimingStore:
        return self._store

    @property
    def objective(self) -> str:
        return self._definition.objective

    @property
    def space(self) -> dict[str, Any]:
        return dict(self._definition.space)

    @property
    def trials(self) -> int:
        return self._definition.trials

    @property
    def sampler(self) -> str:
        return self._definition.sampler

    @property
    def seed(self) -> int:
        return self._definition.seed

    @property
    def attempts(self) -> int:
        return self._definition.attempts

    @property
    def direction(self) -> str:
        return self._definition.direction

    @property
    def patience(self) -> float:
        return self._definition.patience

    @property
    def pruner(self) -> str | None:
        return self._definition.pruner or None

    def __repr__(self) -> str:
        return (
            f"Study({self._store!r}, {self._name!r}, objective={self.objective!r}, "
            f"trials={self.trials}, sampler={self.sampler!r}, direction={self.direction!r})"
        )

    # -- reading

    def optuna(self) -> Any:
        """An in-memory ``optuna.Study`` holding this study's trials as one scan finds
        them (no blob is read): for Optuna's plots and analyses. Trial ``n`` of the study
        is trial ``n`` there while the trials' numbers have no gaps."""
        history = History.scan(self._store, self._name)
        ostudy, _ = history.rebuild(self._definition, self._name, len(history))
        return ostudy

    # -- running

    def run(self, *, runner: str | None = None, progress: Progress | None = None) -> dict[str, int]:
        """Run trials on this machine until every trial of the study has finished.

        Returns how the attempts run here ended: ``done``, ``failed``, ``pruned``, and
        ``superseded`` (taken over by another runner while this one was not writing).
        ``runner`` names this runner in the records (default: host, process id and a few
        random characters); ``progress``, when given, is called with one line of text per
        event worth telling (``print`` will do).
        """
        objective = load(self.objective)
        me = check_runner(runner) if runner is not None else _runner_name()
        tell = progress or (lambda line: None)
        counts = {"done": 0, "failed": 0, "pruned": 0, "superseded": 0}
        poll = min(max(self.patience / 4, 0.05), 5.0)
        while True:
            history = History.scan(self._store, self._name)
            if history.finished(self.trials):
                tell(f"study {self._name!r}: all {self.trials} trials have finished")
                return counts
            self._in_hand = None
            try:
                running = self._take_over(history, me, tell)
                if running is None:
                    number = history.next_number(self.trials)
                    if number is not None:
                        running = self._claim(history, number, me)
                        if running is None:
                            continue  # another runner claimed it first: scan again
                    else:
                        time.sleep(poll)  # others' attempts are running: watch them
                        continue
            except BaseException:
                # told to stop while claiming: an attempt this runner got is handed over now
                if self._in_hand is not None:
                    self._in_hand.let_go()
                raise
            try:
                counts[_execute(running, objective, tell)] += 1
            except BaseException:
                running.let_go()  # stopped before its objective began: hand it over now
                raise

    def _claim(self, history: History, number: int, me: str) -> Running | None:
        ostudy, storage = history.rebuild(self._definition, self._name, number)
        otrial = ostudy.ask(self._definition.space)
        pruning = bool(self._definition.pruner)
        running = Running(
            self._store,
            self._name,
            number,
            0,
            otrial.params,
            runner=me,
            patience=self.patience,
            sampler_attrs=sampler_attrs(storage, ostudy, otrial.number),
            otrial=otrial if pruning else None,
            storage=storage if pruning else None,
        )
        self._in_hand = running
        return running if running.claim() else None

    def _take_over(self, history: History, me: str, tell: Progress) -> Running | None:
        """Claim the next attempt of a trial whose attempt stopped being written, if any."""
        for trial in self._abandoned(history, me):
            last = trial.last
            after = last.attempt + 1
            if after >= self.attempts:
                if self._store.create(attempt_name(self._name, trial.number, after), self._gave_up(last, me)):
                    tell(f"trial {trial.number}: failed, {_abandoned_times(after)}")
                continue
            otrial = storage = None
            if self._definition.pruner:  # the pruner judges the new attempt too
                ostudy, storage = history.rebuild(self._definition, self._name, trial.number)
                ostudy.enqueue_trial(last.config())
                otrial = ostudy.ask(self._definition.space)
            running = Running(
                self._store,
                self._name,
                trial.number,
                after,
                last.config(),
                runner=me,
                patience=self.patience,
                sampler_attrs=_json_field(last.record.get("sampler_attrs")),
                otrial=otrial,
                storage=storage,
            )
            self._in_hand = running
            if running.claim():
                tell(
                    f"trial {trial.number}: attempt {last.attempt} (runner "
                    f"{last.record.get('runner', '?')}) stopped writing; taking it over as attempt {after}"
                )
                return running
        return None

    def _abandoned(self, history: History, me: str) -> list[TrialHistory]:
        """Trials whose last attempt was given up, or has gone unwritten for longer than
        ``patience`` by the store's stamps (a fresh entry of this judge's against it)."""
        stopped = [t for t in history if t.state == "abandoned"]
        live = [t for t in history if t.state == "running"]
        if live:
            judge = f"{self._name}/judge/{me}"
            self._store.put(judge, {"runner": me})
            now = self._store.stamp(judge)
            patience_ns = int(self.patience * 1e9)
            for trial in live:
                try:
                    written = self._store.stamp(trial.last.name)
                except Missing:
                    continue
                if now - written > patience_ns:
                    stopped.append(trial)
        return sorted(stopped, key=lambda t: t.number)

    def _gave_up(self, last: Any, me: str) -> dict[str, str]:
        after = last.attempt + 1
        return {
            "trial": str(last.number),
            "attempt": str(after),
            "config": last.record.get("config", "{}"),
            "state": "failed",
            "score": "",
            "took_us": "0",
            "runner": me,
            "error": (
                f"{_abandoned_times(after)}: no runner kept writing it for {self.patience:g} s "
                f"(attempts={self.attempts}); this record only says so, nothing ran for it"
            ),
            "facts": "0",
        }


def _execute(running: Running, objective: Callable[..., Any], tell: Progress) -> str:
    """Run the objective for a claimed attempt; return how it ended."""
    pruned = optuna().TrialPruned
    where = f"trial {running.number} attempt {running.attempt}"
    running.start()
    try:
        result = objective(Trial(running))
    except Superseded:
        outcome = "superseded"
    except pruned as exc:
        outcome = "pruned" if running.finish("pruned", error=str(exc)) else "superseded"
    except Exception as exc:
        text = "".join(traceback.format_exception(exc)).rstrip()
        outcome = "failed" if running.finish("failed", error=text) else "superseded"
    except BaseException:
        # told to stop (Ctrl-C, scancel): say so, and another runner takes it over at once
        try:
            running.finish("abandoned")
        finally:
            running.stop()
        raise
    else:
        score, why = _score(result)
        if why:
            outcome = "failed" if running.finish("failed", error=why) else "superseded"
        else:
            outcome = "done" if running.finish("done", score=score) else "superseded"
    finally:
        running.stop()
    if outcome == "superseded":
        tell(f"{where}: taken over by another runner; what it did here does not count")
    elif outcome == "done":
        tell(f"{where}: done, score {score} ({running.config})")
    else:
        tell(f"{where}: {outcome}")
    return outcome


def _abandoned_times(times: int) -> str:
    return f"abandoned {times} time{'' if times == 1 else 's'}"


def _score(result: object) -> tuple[str, str]:
    """The score as text, or why the result is not one."""
    if isinstance(result, (bool, str, bytes)) or not hasattr(result, "__float__"):
        return "", (
            f"the objective returned a `{type(result).__name__}`, not a number; it must "
            f"return the score (a float)"
        )
    score = float(result)  # type: ignore[arg-type]
    if score != score:
        return "", "the objective returned nan, which is not a score"
    return repr(score), ""


def _claiming(store: object) -> ClaimingStore:
    if not isinstance(store, ClaimingStore):
        raise TypeError(
            f"A study needs a store its runners can claim trials in: one with create and "
            f"stamp besides put, scan and fetch, such as FolderStore(path) on a folder every "
            f"runner sees; got a `{type(store).__name__}`."
        )
    return store


def _definition_record(store: ClaimingStore, name: str) -> dict[str, str] | None:
    wanted = f"{name}/study"
    for found, record in store.scan(wanted):
        if found == wanted:
            return record
    return None


def _settle(store: ClaimingStore, name: str, wanted: Definition) -> Definition:
    """Write ``wanted`` if the study is new; otherwise check it against the one there."""
    if store.create(f"{name}/study", wanted.record()):
        return wanted
    record = _definition_record(store, name)
    if record is None:
        raise SomatizeError(
            f"The study {name!r} in {store!r} could not be created nor read back; check "
            f"that nothing else writes {name}/study."
        )
    there = Definition.from_record(name, record)
    differences = there.differences(wanted)
    if differences:
        raise StudyMismatch(
            f"The study {name!r} in {store!r} is already defined, differently: "
            f"{'; '.join(differences)}. Give this definition another name for a new study, "
            f"or open the one there as it is with Study.open(store, {name!r})."
        )
    return there


def _json_field(text: str | None) -> dict[str, Any]:
    try:
        value = json.loads(text or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _runner_name() -> str:
    host = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname().split(".")[0])[:60] or "host"
    return f"{host.lstrip('-') or 'host'}-{os.getpid()}-{secrets.token_hex(2)}"
