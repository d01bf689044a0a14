"""A study: a folder, not a service. Runners anywhere claim its trials from a shared store.

A runner reads the whole study once as it starts. Its loop is then: read again only what may
have changed (the trials it last saw unfinished; see ``view``); if an attempt has stopped
being written, take it over as the next attempt; otherwise find the lowest trial number
nobody has claimed, reading on from the last one it saw claimed, ask the sampler (Optuna's,
kept in memory and updated with what was read: see ``mirror``) for a configuration, and
claim the number by creating its attempt 0 (if another runner created it first, read that
trial and go on to the next number); run the objective, writing the attempt as it goes;
write the result. What a claim costs does not grow with the study. It stops when every
trial has finished, after looking at the whole study once more to be sure.

"Stopped being written" is judged only by the store's stamps: the judge writes an entry of
its own (``<study>/judge/<runner>``) and compares that entry's stamp with the attempt's.
Two machines' clocks are never compared, so a runner whose clock is off judges as well as
any other. The attempt number is the fence: a runner that wakes up after its attempt was
taken over finds the next attempt and writes nothing that counts.

Any name may be held by something a writer of the folder put there (``names``): then the
runner takes the next name (the judge a fresh one, a take-over the next attempt's) or counts
the trial as blocked and goes on (``view``). No planted name stops, or keeps waiting, a runner.
"""

from __future__ import annotations

import os
import random
import re
import secrets
import socket
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ..errors import Missing, SomatizeError, StudyMismatch, Superseded
from ..record.studies import definition_name
from ..store import ClaimingStore, scanned_record
from . import names
from .attempt import Pulse, Running, Trial
from .definition import Definition, check_name, check_runner, load, optuna
from .history import History, TrialHistory, attempt_name
from .known import Known

if TYPE_CHECKING:
    from .mirror import Mirror

Progress = Callable[[str], Any]
_FIRST_WAIT = 0.002  # seconds: the first wait while others' attempts run, doubling up to a poll (a look is
# a read of the running trials' folders: a runner left idle by the last trials ends soon after them);
# back to it only when a trial moved on (``Known.refresh``), not each time a running one is rewritten


#: Seconds past the moment an attempt would turn `patience` unwritten that its judge looks:
#: a file system's stamps move by its timer's tick (4 ms on ext4 here), not continuously.
_OVERDUE_MARGIN = 0.01

#: Seconds a running attempt may go unwritten before another runner takes it over, by
#: default. Its runner writes it every third of that (a thread of its own does), so a runner
#: that was killed has its trial taken over within about three of its writes and a judge's
#: look (a quarter of it): ten seconds or so, while the other runners wait. Raise it where a
#: healthy runner can be silent longer (a swapping node, a slow network file system).
PATIENCE = 10.0


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
    unwritten for ``patience`` seconds (`PATIENCE` by default; its runner writes it every
    third of that) is taken over by another runner, up to ``attempts`` attempts per trial. ``pruner`` names an Optuna pruner (``"median"``, ``"hyperband"``,
    ``"successive_halving"``, ``"wilcoxon"``) that may stop a trial on the values it says.

    The store must be shared by every runner (a folder on a disk they all mount) and be a
    claiming store (``create`` and ``stamp``), such as ``FolderStore``. Who can write that
    folder can add, change or take over trials: give it only to the people running them.
    They cannot run code in a runner: no record reaches ``pickle`` (CMA-ES's state is
    rebuilt from the trials), a record that fails its checks is left out, and a runner keeps
    the definition it started with (``Study.open(..., sampler=, objective=)`` refuses one
    that names another sampler or objective than the runner was asked to run).
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
        patience: float = PATIENCE,
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
    def open(
        cls, store: ClaimingStore, name: str, *, sampler: str | None = None, objective: str | None = None
    ) -> Study:
        """The study called ``name`` in ``store``, as its definition there says.

        ``sampler`` and ``objective``, when given, are what this runner was asked to run: a
        definition there that names others (written, or changed since, by someone else who
        may write the folder) is refused with ``StudyMismatch``."""
        self = cls.__new__(cls)
        self._store = _claiming(store)
        self._name = check_name(name)
        record = scanned_record(self._store, definition_name(self._name))
        if record is None:
            raise Missing(
                f"There is no study {name!r} in {store!r}. Define it first with "
                f"Study(store, {name!r}, objective='package.module:function', space={{...}}), "
                f"which writes its definition there; then any runner can open it."
            )
        self._definition = Definition.from_record(self._name, record)
        asked = {"sampler": sampler, "objective": objective}
        differences = [
            f"{field} is {getattr(self._definition, field)!r} there and {value!r} here"
            for field, value in asked.items()
            if value is not None and getattr(self._definition, field) != value
        ]
        if differences:
            raise StudyMismatch(
                f"The study {name!r} in {store!r} is not the one this runner was asked to run: "
                f"{'; '.join(differences)}. Someone who may write the folder defined it so, or "
                f"changed its definition: check {name}/study, and who may write that folder."
            )
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
        """Run trials on this machine until every trial of the study has finished (or is blocked).

        Returns how the attempts run here ended: ``done``, ``failed``, ``pruned``, and
        ``superseded`` (taken over by another runner while this one was not writing, or its
        entry's name taken by something else, so it could not be written). Trials something
        else blocks (see ``view``) are left alone, and do not keep it running. ``runner`` names this runner in the records (default: host, process id and a few
        random characters); ``progress``, when given, is called with one line of text per
        event worth telling (``print`` will do).
        """
        objective = load(self.objective)
        me = check_runner(runner) if runner is not None else _runner_name()
        tell = progress or (lambda line: None)
        # How often to judge others' attempts, and how long to wait at most between two
        # looks while they run: this runner's own timer says when to look, never what it sees.
        self._poll = min(max(self.patience / 4, 0.05), 5.0)
        self._judged: float | None = None  # when this runner last judged (its monotonic clock)
        # when the soonest running attempt it judged turns `patience` unwritten, if none is
        # written meanwhile (its monotonic clock: the store's stamps gave a duration, no time)
        self._overdue: float | None = None
        view = Known(
            self._store,
            self._name,
            self.trials,
            attempts=self.attempts,
            blocked=lambda number, why: tell(f"trial {number}: blocked ({why}); this runner leaves it alone"),
        )
        self._judge = names.Judge(self._store, self._name, me)
        view.rescan()  # the whole study, once; from here on only what may have changed
        self._mirror: Mirror | None = None
        self._notes = True
        self._pulse = Pulse()  # one thread keeps this runner's attempts written, whichever it holds
        self._skip, self._passed, self._random = False, -1, random.Random()
        try:
            return self._loop(view, objective, me, tell)
        finally:
            self._pulse.close()

    def _loop(self, view: Known, objective: Callable[..., Any], me: str, tell: Progress) -> dict[str, int]:
        counts = {"done": 0, "failed": 0, "pruned": 0, "superseded": 0}
        wait = _FIRST_WAIT
        while True:
            if view.refresh():
                wait = _FIRST_WAIT
            if view.finished():
                if view.confirm():  # before saying so, the whole study once more: see ``view``
                    self._mirror = None  # read whole: the mirror is made again from it
                if view.finished():
                    blocked = sorted(n for n in view.blocked if n < self.trials)
                    tell(
                        f"study {self._name!r}: all {self.trials} trials have finished"
                        if not blocked
                        else f"study {self._name!r}: all {self.trials} trials have finished or are blocked "
                        f"({len(blocked)} blocked: trial {', '.join(map(str, blocked[:10]))}"
                        f"{', ...' if len(blocked) > 10 else ''})"
                    )
                    return counts
            self._in_hand: Running | None = None
            try:
                running = self._take_over(view, me, tell)
                if running is None:
                    number = self._free(view, tell)
                    if number is None:  # others' attempts are running: watch them
                        left = None if self._overdue is None else self._overdue - time.monotonic()
                        time.sleep(min(wait, left) if left is not None and left > 0 else wait)
                        wait = min(2 * wait, self._poll)
                        continue
                    running = self._claim(view, number, me)
                    if running is None:  # another runner claimed it first (or it is blocked): go on
                        self._skip = self._random.random() < 0.5
                        continue
            except BaseException:
                # told to stop while claiming: an attempt this runner got is handed over now
                if self._in_hand is not None:
                    self._in_hand.let_go()
                raise
            wait = _FIRST_WAIT
            try:
                counts[_execute(running, objective, tell)] += 1
            except BaseException:
                running.let_go()  # stopped before its objective began: hand it over now
                raise
            if running.finished is not None:  # the result that counts, as written here
                view.wrote(running.number, running.attempt, running.finished)

    def _free(self, view: Known, tell: Progress) -> int | None:
        """The number to claim: the lowest free one; or, for a runner that lost a race for
        it, now and then the next (two runners that finish together would otherwise race
        for every number, and the loser's write is wasted), unless the one passed over last
        time is still free (nobody else took it: so this runner does)."""

        number = view.next_free()
        if number is None or not self._skip or number == self._passed:
            self._skip = False
            return number
        later = view.next_free(number)
        if later is None:
            return number
        self._passed = number
        return later

    def _mirrored(self, view: Known) -> Mirror:
        """This runner's Optuna study, brought up to date with the trials read since."""
        from .mirror import Mirror

        if self._mirror is None:
            view.taken()
            trials = sorted(view.trials.values(), key=lambda t: t.number)
            self._mirror = Mirror(self._definition, self._name, trials, notes=self._notes)
        else:
            for trial in view.taken():
                self._mirror.take(trial)
        return self._mirror

    def _claim(self, view: Known, number: int, me: str) -> Running | None:
        mirror = self._mirrored(view)
        try:
            otrial = mirror.ask(number)
        except Exception as exc:  # notes a writer altered so that the sampler trips on them
            if not self._notes:
                raise
            print(
                f"somatize study: the sampler of {self._name!r} could not use the notes the trials' "
                f"records hold ({type(exc).__name__}: {exc}); this runner asks it without them",
                file=sys.stderr,
            )
            self._notes, self._mirror = False, None
            mirror = self._mirrored(view)
            otrial = mirror.ask(number)
        pruning = bool(self._definition.pruner)
        running = Running(
            self._store,
            self._name,
            number,
            0,
            otrial.params,
            runner=me,
            patience=self.patience,
            sampler_attrs=mirror.notes_of(otrial),
            otrial=otrial if pruning else None,
            storage=mirror.storage if pruning else None,
            pulse=self._pulse,
            attempts=self.attempts,
        )
        got = self._claimed(view, mirror, otrial, running)
        if got == names.TAKEN:  # another runner claimed it first: the next read shows it
            view.lost(number)
        elif got == names.BLOCKED:
            view.block(number, "something else holds its first attempt's name")
        return running if got == names.MADE else None

    def _claimed(self, view: Known, mirror: Mirror | None, otrial: Any, running: Running) -> names.Made:
        """Create ``running``'s attempt; once made it is this runner's, in the view and the
        mirror, and otherwise ``otrial`` (asked for it) is dropped from the mirror."""
        self._in_hand = running
        try:
            got = running.claim()
        finally:
            if otrial is not None and mirror is not None and not running.claimed:
                mirror.drop(otrial)
        if got != names.MADE:
            return got
        kept = False
        if otrial is not None and mirror is not None:
            mirror.keep(running.number, otrial)
            kept = True
        view.wrote(running.number, running.attempt, running.claimed, mirrored=kept)  # type: ignore[arg-type]
        return got

    def _take_over(self, view: Known, me: str, tell: Progress) -> Running | None:
        """Claim the next attempt of a trial whose attempt stopped being written, if any."""
        for trial in self._abandoned(view, me):
            running = self._next_attempt(view, trial, me, tell)
            if running is not None:
                return running
        return None

    def _next_attempt(self, view: Known, trial: TrialHistory, me: str, tell: Progress) -> Running | None:
        """Claim the attempt after ``trial``'s last (or, past the study's ``attempts``,
        write that it failed); where something else holds that name, the next one; when
        every name up to the give-up record is held, the trial is blocked."""
        last = trial.last
        give_up = max(self.attempts, last.attempt + 1)
        for after in range(last.attempt + 1, give_up + 1):
            if after == give_up:
                got = names.create(
                    self._store, attempt_name(self._name, trial.number, after), self._gave_up(last, me, after)
                )
                if got == names.MADE:
                    tell(f"trial {trial.number}: failed, {_abandoned_times(after)}")
                if got != names.BLOCKED:
                    return None  # written here, or by another runner first: the next read shows it
                continue
            mirror = otrial = None
            if self._definition.pruner:  # the pruner judges the new attempt too
                mirror = self._mirrored(view)
                otrial = mirror.ask_again(trial.number, last.config())
            running = Running(
                self._store,
                self._name,
                trial.number,
                after,
                last.config(),
                runner=me,
                patience=self.patience,
                sampler_attrs=last.sampler_attrs(),
                otrial=otrial,
                storage=None if mirror is None else mirror.storage,
                pulse=self._pulse,
                attempts=self.attempts,
            )
            got = self._claimed(view, mirror, otrial, running)
            if got == names.MADE:
                tell(
                    f"trial {trial.number}: attempt {last.attempt} (runner "
                    f"{last.record.get('runner', '?')}) stopped writing; taking it over as attempt {after}"
                )
                return running
            if got == names.TAKEN:
                return None  # another runner took it over first: the next read shows it
            # blocked: the next attempt's name stands in for it
        view.block(trial.number, f"something else holds every attempt's name after attempt {last.attempt}")
        return None

    def _abandoned(self, view: Known, me: str) -> list[TrialHistory]:
        """Trials whose last attempt was given up, or has gone unwritten for longer than
        ``patience`` by the store's stamps (a fresh entry of this judge's against it). Only
        the trials last read unfinished are looked at, and running ones are judged once a
        poll, and again the moment the last judging said the soonest of them would turn
        ``patience`` unwritten (a judge writes, and the pace of claims is no reason to write
        more; a dead runner's trial is taken over ``patience`` after its last write, not up
        to a poll later)."""
        unfinished = view.open()
        stopped = [t for t in unfinished if t.state == "abandoned"]
        live = [t for t in unfinished if t.state == "running"]
        at = time.monotonic()
        due = (
            self._judged is None
            or at - self._judged >= self._poll
            or (self._overdue is not None and at >= self._overdue)
        )
        if live and due:
            self._judged, self._overdue = at, None
            now = self._judge.now()  # None: no judge's name could be written this time
            after = time.monotonic()  # the judge's stamp was taken before this: never early
            patience_ns = int(self.patience * 1e9)
            if now is not None:
                for trial in live:
                    written = names.stamp(self._store, trial.last.name)
                    if written is None:
                        continue  # gone, or held by something else: the next read says which
                    if now - written > patience_ns:
                        stopped.append(trial)
                    else:  # a duration by the store's clock, counted on this runner's own
                        overdue = after + (patience_ns - (now - written)) / 1e9 + _OVERDUE_MARGIN
                        self._overdue = overdue if self._overdue is None else min(self._overdue, overdue)
        return sorted(stopped, key=lambda t: t.number)

    def _gave_up(self, last: Any, me: str, after: int) -> dict[str, str]:
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
    if outcome == "superseded" and running.blocked:
        tell(f"{where}: something else holds its name now, so it cannot be written; what it did here does not count")
    elif outcome == "superseded":
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
            f"the objective returned a `{type(result).__name__}`, not a number; it must return the score (a float)"
        )
    score = float(result)
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


def _settle(store: ClaimingStore, name: str, wanted: Definition) -> Definition:
    """Write ``wanted`` if the study is new; otherwise check it against the one there."""
    if store.create(definition_name(name), wanted.record()):
        return wanted
    record = scanned_record(store, definition_name(name))
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


def _runner_name() -> str:
    host = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname().split(".")[0])[:60] or "host"
    return f"{host.lstrip('-') or 'host'}-{os.getpid()}-{secrets.token_hex(2)}"
