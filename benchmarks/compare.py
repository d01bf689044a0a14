"""Case (a) on two or more checkouts of somatize, in turn, with the raw floor beside each:
how a change moved the small call, on one machine in the same minutes.

    git worktree add /tmp/before <commit>
    python benchmarks/compare.py /tmp/before . --rounds 2

Each round runs every tree once, in order, in a process of its own (``PYTHONPATH`` set to
the tree, so the client and the worker it spawns are that tree's; the loop, the nodes and
the floor are this checkout's). Within a run, blocks of 500 calls alternate between raw
pyzmq (over a Unix socket, as the spawned worker is reached) and somatize, twelve of each.
Printed per run: the median of the block medians and the least block median, of each, and
their ratios. Read the difference between trees within a round; a round later the machine
may be another one.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

ONE_RUN = """
import statistics, sys, time
sys.path[:0] = [{benchmarks!r}]
import paths
from cases import floor
from nodes import Echo
import somatize

SMALL = b"x" * 100
echo = Echo().named("echo").at("w1")
with paths.direct() as broker, floor() as raw:
    for _ in range(300):
        echo.forward(SMALL, broker=broker)
        raw.small(SMALL)
    ways = {{"raw": lambda: raw.small(SMALL), "somatize": lambda: echo.forward(SMALL, broker=broker)}}
    blocks = {{name: [] for name in ways}}
    for _ in range(12):
        for name, call in ways.items():
            took = []
            for _ in range(500):
                t = time.perf_counter_ns()
                call()
                took.append(time.perf_counter_ns() - t)
            blocks[name].append(statistics.median(took) / 1000)
med = {{name: statistics.median(b) for name, b in blocks.items()}}
least = {{name: min(b) for name, b in blocks.items()}}
print(f"raw {{med['raw']:.1f}} (least {{least['raw']:.1f}}) µs, somatize {{med['somatize']:.1f}} "
      f"(least {{least['somatize']:.1f}}) µs: {{med['somatize'] / med['raw']:.2f}}x at the median, "
      f"{{least['somatize'] / least['raw']:.2f}}x between the least")
"""


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/compare.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("trees", nargs="+", help="checkouts of somatize (folders holding `somatize/`)")
    parser.add_argument("--rounds", type=int, default=2, help="how many times each tree runs (default 2)")
    args = parser.parse_args(argv)
    trees = [Path(tree).resolve() for tree in args.trees]
    for tree in trees:
        if not (tree / "somatize" / "__init__.py").is_file():
            parser.error(f"{tree} holds no somatize/ folder")
    code = ONE_RUN.format(benchmarks=str(HERE))
    for round_ in range(1, args.rounds + 1):
        for tree in trees:
            env = dict(os.environ, PYTHONPATH=str(tree))
            done = subprocess.run(
                [sys.executable, "-c", code], env=env, cwd=tree, capture_output=True, text=True, timeout=600
            )
            said = done.stdout.strip() if done.returncode == 0 else f"failed: {done.stderr.strip()[-400:]}"
            print(f"round {round_}, {tree}: {said}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
