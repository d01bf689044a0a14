"""What one runner knows of its study's trials, kept current at a cost that does not grow
with the study.

A runner reads the whole study once, when it starts (one scan). After that it reads only
what may have changed since its last look, one trial's folder at a time:

- the trials it last saw unfinished (running, or abandoned), to learn how they ended or
  that another runner took them over: as many as other runners are running, not as many
  as the study has (what this runner wrote itself it knows without reading it back);
- the trial numbers from its frontier on, the lowest number it has not seen claimed: the
  first one that holds no attempt is the one it tries to claim, and each one another runner
  claimed meanwhile is read once, as it goes by.

A trial seen finished is not read again: its highest attempt's record is final (a runner
writes ``done``, ``failed`` or ``pruned`` once, and only into the attempt it holds). Before
it says the study is over, the runner looks at the whole study once more (``confirm``), so
that anything its looks could have missed (a trial taken over while its old attempt was
finishing) is found: from the study's listing alone where the store lists names (a
``FolderStore``), reading again only the trials whose highest attempt is not the one it
last read; otherwise by reading the whole study.

A trial is *blocked* when something other than an entry holds the names it needs (a writer
of the folder put a folder, a file, a link or a FIFO there; see ``names``): its first
attempt's name, when no attempt of it reads; every later attempt's name, when its last one
stopped; or its records no longer read at all. A blocked trial is over for this runner, as
a finished one is, and is not read again: it never keeps a runner waiting.

Nothing here writes or judges; ``study`` claims, writes and judges by the store's stamps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..record.studies import attempt_of, checked_attempt, trial_prefix
from ..store import FolderStore, Store
from .history import Attempt, History, TrialHistory, attempt_name, read_trial


class Known:
    """The trials of ``study`` numbered below ``trials`` as this runner last read them.

    ``trials`` maps number to :class:`TrialHistory` (every trial read so far, whatever its
    number); ``changed`` lists those read anew since ``taken()`` last emptied it, for the
    runner's Optuna mirror. ``tests/test_study_claims.py`` counts what this costs the store.
    """

    def __init__(
        self,
        store: Store,
        study: str,
        trials: int,
        *,
        attempts: int = 3,
        blocked: Callable[[int, str], Any] | None = None,
    ) -> None:
        self._store = store
        self._study = study
        self._count = trials
        self._attempts = attempts  # a trial's attempts are read by name up to this one
        self._older = False  # the study has attempts in the folder-per-trial form: read those too
        self._tell = blocked or (lambda number, why: None)
        self.trials: dict[int, TrialHistory] = {}
        self.blocked: set[int] = set()  # numbers over for this runner: see ``block``
        self.changed: list[TrialHistory] = []
        self._open: set[int] = set()  # numbers last read unfinished
        self._frontier = 0  # every number below it was read claimed, or is blocked
        self._lost: set[int] = set()  # numbers this runner failed to create

    def rescan(self) -> None:
        """Read the whole study again (one scan); what was read before is forgotten."""
        history = History.scan(self._store, self._study)
        prefix = trial_prefix(self._study)
        self._older = any(_folder_form(a.name[len(prefix) :]) for trial in history for a in trial.attempts)
        self.trials = dict(history.trials)
        self._open = {n for n, trial in self.trials.items() if not trial.finished and n not in self.blocked}
        self._frontier = 0
        self.changed = []

    def confirm(self) -> bool:
        """Look at the whole study once more before saying it is over: each trial whose
        highest attempt in the study's listing is not the one last read (or that was not
        read at all) is read again, and listed in ``changed``. One listing of the trial
        folder (and its folders, in a study written before December 2026), no record read but
        those, on a ``FolderStore`` (``names``); any other
        store is read whole (``rescan``: what was read before is forgotten, and this returns
        ``True``). A record's contents cannot change unseen: a finished attempt's is final,
        and one read unfinished is read again at every ``refresh``."""
        if not isinstance(self._store, FolderStore):
            self.rescan()
            return True
        prefix = trial_prefix(self._study)
        highest: dict[int, int] = {}
        for name in self._store.names(prefix):
            parsed = attempt_of(name[len(prefix) :])
            if parsed is not None:
                number, attempt, folder_form = parsed
                highest[number] = max(highest.get(number, attempt), attempt)
                self._older = self._older or folder_form
        for number, attempt in sorted(highest.items()):
            known = self.trials.get(number)
            if number in self.blocked or (known is not None and known.last.attempt == attempt):
                continue
            found = self._read(number)
            if found is not None and (known is None or not _same(found, known)):
                self._take(found)
        return False

    def refresh(self) -> bool:
        """Read again each trial last read unfinished; whether any moved on: ended, was
        stopped, was taken over or blocked (what may leave work to claim). A record that was
        only written again (a pulse, a value said) is taken, and is no such move."""
        moved = False
        for number in sorted(self._open):
            found = self._read(number)
            if found is None:  # its records were read before and no read shows them now
                self.block(number, "its records no longer read (something else holds their names)")
                moved = True
            elif not _same(found, self.trials[number]):
                moved = moved or _states(found) != _states(self.trials[number])
                self._take(found)
        return moved

    def next_free(self, after: int = -1) -> int | None:
        """The lowest number below ``trials`` (and above ``after``) that no read shows
        claimed, reading on from the frontier (each trial claimed meanwhile is read once);
        ``None`` when there is none. A number this runner failed to create that a read still
        shows empty is blocked (an entry is there, says the store, that no read can show)."""
        self._advance()
        number = max(self._frontier, after + 1)
        while number < self._count:
            if number not in self.trials and number not in self.blocked:
                found = self._read(number)
                if found is not None:
                    self._take(found)
                elif number in self._lost:
                    self.block(number, "its first attempt's name is held by something no read shows")
                else:
                    return number
            number += 1
        return None

    def lost(self, number: int) -> None:
        """This runner tried to create trial ``number`` and could not: someone holds it."""
        self._lost.add(number)

    def block(self, number: int, why: str) -> None:
        """Trial ``number`` is blocked (``why`` says how): over for this runner, never read
        again, never waited for."""
        if number in self.blocked:
            return
        self.blocked.add(number)
        self._open.discard(number)
        self._tell(number, why)

    def open(self) -> list[TrialHistory]:
        """The trials last read unfinished (and not blocked), by number."""
        return [self.trials[n] for n in sorted(self._open)]

    def finished(self) -> bool:
        """Whether every trial below ``trials`` was read finished (or is blocked)."""
        return not self._advance() and not any(n < self._count for n in self._open)

    def wrote(self, number: int, attempt: int, record: dict[str, str], *, mirrored: bool = False) -> None:
        """This runner wrote ``record`` as attempt ``attempt`` of trial ``number``: created
        it (a claim), or wrote its result (a result that counts: no later attempt was there
        when it was written). It is not read back. ``mirrored``: the mirror has it already
        (the trial the sampler was just asked for), so it is not listed in ``changed``."""
        name = attempt_name(self._study, number, attempt)
        mine = Attempt(name, number, attempt, record, checked_attempt(record))
        trial = self.trials.get(number)
        earlier = [a for a in trial.attempts if a.attempt < attempt] if trial else []
        self._take(TrialHistory(number, [*earlier, mine]), changed=not mirrored)

    def taken(self) -> list[TrialHistory]:
        """The trials read anew since the last call (for the mirror), emptied."""
        changed, self.changed = self.changed, []
        return changed

    def _advance(self) -> bool:
        """Move the frontier past numbers already read claimed; whether one is left below
        ``trials``."""
        while self._frontier < self._count and (self._frontier in self.trials or self._frontier in self.blocked):
            self._frontier += 1
        return self._frontier < self._count

    def _read(self, number: int) -> TrialHistory | None:
        return read_trial(self._store, self._study, number, self._attempts, older=self._older)

    def _take(self, trial: TrialHistory, *, changed: bool = True) -> None:
        self.trials[trial.number] = trial
        if changed:
            self.changed.append(trial)
        if trial.finished or trial.number in self.blocked:
            self._open.discard(trial.number)
        else:
            self._open.add(trial.number)


def _folder_form(rest: str) -> bool:
    parsed = attempt_of(rest)
    return parsed is not None and parsed[2]


def _states(trial: TrialHistory) -> list[tuple[int, str]]:
    return [(x.attempt, x.state) for x in trial.attempts]


def _same(a: TrialHistory, b: TrialHistory) -> bool:
    return [(x.attempt, x.record, x.problem) for x in a.attempts] == [
        (x.attempt, x.record, x.problem) for x in b.attempts
    ]
