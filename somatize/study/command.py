"""``python -m somatize study --store DIR NAME`` (and ``somatize-study``): a runner, or a look.

Run it on any machine that sees the folder, as many times as you like: each process runs
trials of the study until all have finished. The study must already be defined there by a
``Study(...)`` call. ``--show`` prints the trials as a table instead, and ``--watch`` says
how far the study is, live, until it ends.

SIGTERM (``scancel``, ``kill``) and Ctrl-C stop a runner between two writes: its attempt is
marked abandoned, so another runner takes the trial over at once rather than after the
study's patience.
"""

from __future__ import annotations

import argparse
import gc
import json
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from ..errors import SomatizeError
from ..record.drawings import printable
from ..record.shapes import whole
from .history import History
from .names import blocked_trials
from .study import Study
from .watching import watch


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--store", metavar="DIR", required=True, help="the study's folder, shared by every runner")
    parser.add_argument("name", metavar="NAME", help="the study's name, as given to Study(...)")
    parser.add_argument("--show", action="store_true", help="print the trials as a table and exit")
    parser.add_argument(
        "--watch",
        metavar="SECONDS",
        nargs="?",
        type=float,
        const=2.0,
        help="say the study's progress every SECONDS (default 2) until every trial has finished; runs nothing",
    )
    parser.add_argument("--runner", metavar="ID", help="this runner's name in the records (default: host-pid-random)")
    parser.add_argument(
        "--sampler",
        metavar="NAME",
        help="run only if the study's definition names this sampler (who may write the folder may change it)",
    )
    parser.add_argument(
        "--objective",
        metavar="MODULE:FUNCTION",
        help="run only if the study's definition names this objective",
    )


def command(args: argparse.Namespace) -> int:
    from ..store import FolderStore

    if not Path(args.store).is_dir():
        print(f"somatize study: there is no folder {args.store}; give the study's store.", file=sys.stderr)
        return 2
    try:
        study = Study.open(FolderStore(args.store), args.name, sampler=args.sampler, objective=args.objective)
        if args.show:
            print(table(study))
            return 0
        if args.watch is not None:
            if not args.watch > 0:
                print("somatize study: --watch takes a number of seconds above 0", file=sys.stderr)
                return 2
            watch(study, every=args.watch)
            return 0
        # What this process holds before its first trial (Python, NumPy, Optuna, the
        # objective's module, the study) stays until it exits: the cyclic collector need not
        # walk it again, in a trial's collections or in the last one at exit, which took 30
        # of a fresh runner's 220 ms. What a trial makes is still collected, and its
        # finalizers still run at exit. A process that runs the study and nothing else.
        gc.freeze()
        previous = signal.signal(signal.SIGTERM, _stop)
        try:
            study.run(runner=args.runner, progress=lambda line: print(line, flush=True))
        finally:
            signal.signal(signal.SIGTERM, previous)
    except (SomatizeError, ImportError, ValueError, TypeError) as exc:
        print(f"somatize study: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a folder this user cannot read or write, a full disk
        print(
            f"somatize study: cannot use the store {args.store}: {exc.strerror or exc}"
            f"{f' ({exc.filename})' if exc.filename else ''}; give a folder this user can read and write",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="somatize-study",
        description="Run a study's trials on this machine until all have finished.",
    )
    add_arguments(parser)
    return command(parser.parse_args(argv))


def table(study: Study) -> str:
    """The study's trials as text: one row per trial, from its highest attempt (one scan),
    as a runner sees them (a record it cannot read is a failed trial, with the reason), with
    who ran that attempt, and ``took over`` where an earlier one was given up; a trial whose
    names something else holds is ``blocked``, with why (``names.blocked_trials``)."""
    history = History.scan(study.store, study.name)
    blocked = blocked_trials(study.store, study.name, study.trials, study.attempts, history)
    rows = [("trial", "state", "attempts", "score", "took", "runner", "config", "error")]
    states: dict[str, int] = {}
    best: tuple[float, int] | None = None
    sign = 1.0 if study.direction == "minimize" else -1.0
    read = {trial.number for trial in history}
    unread = [(number, None) for number in blocked if number not in read]
    for number, trial in sorted([*unread, *((t.number, t) for t in history)], key=lambda pair: pair[0]):
        if trial is None:
            rows.append((str(number), "blocked", "0", "", "", "", "", blocked[number]))
            continue
        last = trial.last.record
        state = "blocked" if trial.number in blocked else trial.state
        if state != "blocked":
            states[state] = states.get(state, 0) + 1
        score = last.get("score", "")
        if state == "done" and score:
            value = float(score)
            if best is None or sign * value < sign * best[0]:
                best = (value, trial.number)
        took = last.get("took_us", "")
        error = (blocked.get(trial.number) or trial.last.problem or last.get("error") or "").strip().splitlines()
        runner = printable(str(last.get("runner", "")), 40)
        rows.append(
            (
                str(trial.number),
                state,
                str(len(trial.attempts)),
                score,
                _took(us) if (us := whole(took)) is not None else "",  # ASCII digits only: "²".isdigit()
                runner + (", took over" if len(trial.attempts) > 1 and runner else ""),
                json.dumps(trial.last.config(), sort_keys=True),
                printable(error[-1], 60) if error else "",
            )
        )
    counted = ", ".join(f"{n} {state}" for state, n in sorted(states.items())) or "none claimed yet"
    head = f"study {study.name!r}: {study.trials} trials ({counted})"
    if blocked:
        head += f", {len(blocked)} blocked"
    if best is not None:
        head += f"; best {best[0]!r} (trial {best[1]})"
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [head]
    for row in rows:
        cells = [
            cell.rjust(w) if i in (0, 2) else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=False))
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def _took(us: int) -> str:
    return f"{us / 1e3:.3g} ms" if us < 1_000_000 else f"{us / 1e6:.3g} s"


def _stop(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    sys.exit(main())
