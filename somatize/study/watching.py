"""``--watch``: a study's progress, live, from any machine that sees its folder.

One scan of the study's trials every few seconds (what ``--show`` reads, as a runner sees
it), said as one line: how many trials have finished of how many, how many are done,
failed, pruned and running, the best score so far, the pace since the watch began, and
about how long is left at that pace. On a terminal it is one line drawn again in place
(a tqdm bar, where tqdm is installed); elsewhere (a log, a pipe) a line each time it
changes. It ends when every trial has finished or is blocked (something a writer of the
folder put there holds the names it needs, as the runners find: ``names.blocked_trials``),
and only looks: it writes nothing.

A running trial whose record's stamp has not moved for half the study's patience (its runner
writes it every third) is said to have a silent runner, with about how long until another
runner takes it over. The silence is timed by this watch's own clock from when it first saw
that stamp (never a clock of another machine against the stamp), so it is at most what the
runners' judges will find.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from .history import FINISHED, History
from .names import blocked_trials, stamp


@dataclass(frozen=True)
class Seen:
    """What one look at a study found."""

    trials: int  # how many the study runs
    states: dict[str, int]
    best: tuple[float, int] | None  # (score, trial)
    running: tuple[tuple[int, int, int | None], ...] = ()  # (trial, attempt, its record's stamp)

    @property
    def finished(self) -> int:
        return sum(n for state, n in self.states.items() if state in FINISHED)

    @property
    def blocked(self) -> int:
        """Trials no runner can finish: their names are held by something else."""
        return self.states.get("blocked", 0)

    @property
    def over(self) -> bool:
        return self.finished + self.blocked >= self.trials


def look(study: Any) -> Seen:
    """One scan of ``study``'s trials, counted by state (``blocked`` among them), with the
    best done score."""
    states: dict[str, int] = {}
    best: tuple[float, int] | None = None
    sign = 1.0 if study.direction == "minimize" else -1.0
    history = History.scan(study.store, study.name)
    blocked = blocked_trials(study.store, study.name, study.trials, study.attempts, history)
    read = {trial.number for trial in history}
    running = tuple(
        (trial.number, trial.last.attempt, stamp(study.store, trial.last.name))
        for trial in history
        if trial.state == "running" and trial.number < study.trials and trial.number not in blocked
    )
    if any(number not in read for number in blocked):
        states["blocked"] = sum(1 for number in blocked if number not in read)
    for trial in history:
        if trial.number >= study.trials:
            continue  # a record past the study's end (a writer of the folder's): not counted
        state = "blocked" if trial.number in blocked else trial.state
        states[state] = states.get(state, 0) + 1
        score = trial.last.record.get("score", "")
        if state == "done" and score:
            try:
                value = float(score)
            except ValueError:
                continue
            if math.isfinite(value) and (best is None or sign * value < sign * best[0]):
                best = (value, trial.number)
    return Seen(study.trials, states, best, running)


def line(name: str, seen: Seen, pace: float | None, silent: Sequence[Silent] = ()) -> str:
    """What a look says: ``study 'tune': 12/40 finished (10 done, 2 failed), 3 running;
    best 0.0123 (trial 7); 2.1 trials/s, about 13 s left``, and of each trial whose runner
    went silent: ``; trial 4 attempt 0: its runner silent for 6 s, taken over in about 4 s``."""
    finished = ", ".join(f"{seen.states[s]} {s}" for s in ("done", "failed", "pruned") if seen.states.get(s))
    text = f"study {name!r}: {seen.finished}/{seen.trials} finished" + (f" ({finished})" if finished else "")
    running = seen.states.get("running", 0)
    if running:
        text += f", {running} running"
    if seen.blocked:
        text += f", {seen.blocked} blocked"
    if seen.best is not None:
        text += f"; best {seen.best[0]:.6g} (trial {seen.best[1]})"
    for quiet in silent[:SAID_SILENT]:
        when = (
            f"taken over in about {_duration(quiet.left)}" if quiet.left > 0 else "taken over at a runner's next look"
        )
        text += f"; trial {quiet.trial} attempt {quiet.attempt}: its runner silent for {_duration(quiet.quiet)}, {when}"
    if len(silent) > SAID_SILENT:
        text += f" (and {len(silent) - SAID_SILENT} more silent)"
    left = seen.trials - seen.finished - seen.blocked
    if left <= 0:
        return text
    if pace:
        rest = left / pace
        text += f"; {pace:.3g} trials/s, " + (f"about {_duration(rest)} left" if rest >= 1 else "under a second left")
    else:
        text += "; time left not known yet"
    return text


#: The most silent runners one line names.
SAID_SILENT = 3


@dataclass(frozen=True)
class Silent:
    """A running trial whose record has not moved for half the study's patience or more."""

    trial: int
    attempt: int
    quiet: float  # seconds its stamp has not moved, by this watch's clock (at least)
    left: float  # seconds until it is unwritten for the patience (then taken over at a look)


class Stamps:
    """When this watch first saw each running attempt's stamp as it is: how long it has not
    moved, by this watch's own clock."""

    def __init__(self) -> None:
        self._seen: dict[tuple[int, int], tuple[int | None, float]] = {}

    def silent(self, seen: Seen, patience: float, now: float) -> list[Silent]:
        kept: dict[tuple[int, int], tuple[int | None, float]] = {}
        out = []
        for number, attempt, stamped in seen.running:
            was = self._seen.get((number, attempt))
            since = was[1] if was is not None and was[0] == stamped else now
            kept[(number, attempt)] = (stamped, since)
            quiet = now - since
            if stamped is not None and quiet > patience / 2:
                out.append(Silent(number, attempt, quiet, patience - quiet))
        self._seen = kept
        return out


def watch(study: Any, *, every: float = 2.0, out: TextIO | None = None) -> Seen:
    """Say ``study``'s progress every ``every`` seconds until every trial has finished (or
    is blocked); return the last look. Ctrl-C stops it (``KeyboardInterrupt``)."""
    out = out or sys.stdout
    bar = _bar(study, out)
    started, first = time.monotonic(), None
    said = ""
    stamps = Stamps()
    try:
        while True:
            seen = look(study)
            first = seen.finished if first is None else first
            now = time.monotonic()
            elapsed = now - started
            pace = (seen.finished - first) / elapsed if elapsed > 0 and seen.finished > first else None
            text = line(study.name, seen, pace, stamps.silent(seen, study.patience, now))
            if bar is not None:
                bar.n = seen.finished
                bar.set_description_str(text, refresh=True)
            elif text != said:
                print(text, file=out, flush=True)
            said = text
            if seen.over:
                return seen
            time.sleep(every)
    finally:
        if bar is not None:
            bar.close()


def _bar(study: Any, out: TextIO) -> Any:
    """A tqdm bar on a terminal, where tqdm is installed; None elsewhere (lines instead)."""
    if not (hasattr(out, "isatty") and out.isatty()):
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=study.trials, file=out, bar_format="{desc} {bar}", dynamic_ncols=True, leave=True)


def _duration(seconds: float) -> str:
    if seconds < 1:
        return "less than a second"
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
