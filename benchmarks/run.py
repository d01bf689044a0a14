"""``python benchmarks/run.py``: somatize against raw pyzmq (the floor), Ray and Dask.

One command, one table, every row measured in this run:

    (a) a one-node remote forward of 100 B, Direct, sequential: median and p99 per call
    (b) 64 and 256 MiB NumPy arrays (and torch tensors) round trip, Direct / Mount / Relayed
    (c) an InProcess host against no host, same small graph
    (d) the engine's cost per node on a 200-node local chain, against a plain loop
    (e) forwards() and curve() over 10,000 recorded forwards: time, scans and fetches
    (f) a study's trials per second, and reading its history
    (g) another tenant's answers, and the broker's memory, while one floods it
    (h) a fleet of dialed workers on one broker: registering, idle, relayed forwards
    (k) another key's relayed forwards and Hosts, and the broker's memory, while one key
        floods it every way its admission step bounds
    (t) 16 threads of one client forwarding 100 B to 4 spawned workers: forwards/s (and Ray's)
    (p) Graph.map over a pool of 4 spawned workers: CPU-bound and tiny inputs against
        multiprocessing.Pool(4).imap, and a member SIGKILLed mid-map
    (v) the live view opening a 100,000-forward run and a 10,000-trial study
    (m) the peak memory of client, worker and broker during (b)'s round trips, per path

    python benchmarks/run.py --quick          # tiny sizes: a smoke run of well under a minute
    python benchmarks/run.py --markdown       # the table as Markdown (docs/performance.md)
    python benchmarks/run.py --only a,c       # some cases only

Targets are printed as ratios with PASS or MISS; nothing fails on a timing. Everything
started is stopped and reaped, temporary folders (in /tmp and /dev/shm) are removed.
"""

from __future__ import annotations

import argparse
import compileall
import os
import platform
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# this file runs as a script: its helpers sit next to it, somatize one folder up (also for
# the workers it spawns, should somatize not be installed)
sys.path[:0] = [str(HERE), str(ROOT)]
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))

import cases  # noqa: E402
import others  # noqa: E402
from table import Row, as_markdown, as_text  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/run.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes and few calls: a smoke run")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    parser.add_argument(
        "--only",
        metavar="a,b,...",
        default=",".join(cases.CASES),
        help=f"the cases to run (default: all of {','.join(cases.CASES)})",
    )
    parser.add_argument(
        "--without-others",
        action="store_true",
        help="leave Ray and Dask out even where installed (their rows say so): the suite's quick run does",
    )
    args = parser.parse_args(argv)
    chosen = [c.strip() for c in args.only.split(",") if c.strip()]
    unknown = [c for c in chosen if c not in cases.CASES]
    if unknown or not chosen:
        parser.error(f"--only takes some of {','.join(cases.CASES)}; got {args.only!r}")
    settings = cases.Settings.quick() if args.quick else cases.Settings.full()

    # Fresh processes are timed beside Optuna's (case f), whose bytecode pip compiled at its
    # install: somatize's is compiled here too (a tree run with PYTHONDONTWRITEBYTECODE set
    # would otherwise compile every module in every runner it starts, about 0.15 s each). A
    # quick run times nothing worth it, and writes nothing into the tree.
    if not args.quick:
        compileall.compile_dir(ROOT / "somatize", quiet=2)
    started = time.monotonic()
    floors = cases.Floors()
    rows: list[Row] = []
    failed = False
    for case in chosen:
        print(f"benchmarks: case {case} ...", file=sys.stderr, flush=True)
        try:
            rows += cases.CASES[case](settings, floors)
        except Exception as exc:  # the other cases still run; the run fails at the end
            traceback.print_exc()
            rows.append(Row(case, "somatize", "-", verdict=f"FAILED: {type(exc).__name__}"))
            failed = True
    for name, (system, covers) in others.SYSTEMS.items():
        wanted = "".join(c for c in chosen if c in covers)
        if not wanted:
            continue
        if args.without_others:
            rows += [Row(c, name, "-", verdict="left out (--without-others)") for c in wanted]
            continue
        print(f"benchmarks: {name} ...", file=sys.stderr, flush=True)
        try:
            rows += system(settings, floors, wanted)
        except Exception as exc:  # theirs, not ours: said in its rows, and the run goes on
            traceback.print_exc()
            rows += [Row(c, name, "-", verdict=f"failed: {type(exc).__name__}") for c in wanted]
    order = {case: number for number, case in enumerate(cases.CASES)}
    rows.sort(key=lambda row: order[row.case])  # stable: each case's rows keep their order

    took = time.monotonic() - started
    print(
        f"somatize benchmarks, {'quick' if args.quick else 'full'} run of {_version()}, finished "
        f"{time.strftime('%Y-%m-%d %H:%M %Z')} after {took:.0f} s; {os.cpu_count()} cores, "
        f"Python {platform.python_version()}"
    )
    print()
    print(as_markdown(rows) if args.markdown else as_text(rows))
    return 1 if failed else 0


def _version() -> str:
    """The commit measured, and whether somatize/ had changes not committed yet."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "somatize"], cwd=ROOT, capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "somatize (no git)"
    if not commit:
        return "somatize (no git)"
    return f"{commit}{' + uncommitted changes in somatize/' if dirty else ''}"


def _stopped(signum: int, _frame: object) -> None:
    """Stopped (SIGTERM, as the suite stops a run it started when it ends first): leave
    through every `finally`, so each case's processes are reaped and its folders in
    /dev/shm removed, as on a normal end."""
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _stopped)
    sys.exit(main())
