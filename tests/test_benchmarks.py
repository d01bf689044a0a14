"""The benchmark runs end to end (quick sizes) and prints a row for every case.

No timing is asserted anywhere: the machine is shared and small. What is checked is that
one command measures everything it promises, says PASS or MISS wherever there is a target,
and exits cleanly.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # `-m "not slow"` leaves this file out

ROOT = Path(__file__).resolve().parent.parent
RUN = ROOT / "benchmarks" / "run.py"

# the start of a row's `what`, for every row each case must print
ROWS = {
    "a": [
        "raw pyzmq DEALER->ROUTER, 100 B",
        "somatize Direct, 1 node, 100 B",
        "the same, least disturbed block",
        "the same, watched",
        "artifact pickles after",
        "Ray",
        "Dask",
    ],
    "b": [
        "raw pyzmq zero-copy echo, 1 MiB",
        "Direct, numpy 1 MiB",
        "Mount (/dev/shm), numpy 1 MiB",
        "Mount (/dev/shm), views=True, numpy 1 MiB",
        "Relayed, numpy 1 MiB",
        "artifact pickles (Direct, Mount, Mount views, Relayed)",
        "Ray",
        "Dask",
    ],
    "c": ["no host, 3-node chain", "InProcess host, same chain"],
    "d": ["Python loop over 200 forwards", "engine, 200-node local chain", "Dask"],
    "e": ["forwards(), summarised run", "curve(), summarised run", "curve(), unsummarised run"],
    "f": ["Optuna JournalFileBackend, 2 processes", "2 runners,", "the last", "rebuilding a", "trials(),"],
    "h": [
        "50 dialed workers registered",
        "broker memory and descriptors a worker",
        "idle broker CPU",
        "relayed forwards a second, 1 client",
        "relayed forwards a second, 4 clients",
        "broker memory after the clients left",
    ],
    "t": ["somatize, 16 threads to 4 workers, 100 B", "Ray"],
    "v": [
        "opening a 2,000-forward run as the view starts",
        "the same run again",
        "again after 100 more forwards",
        "opening a 300-trial study",
        "the same study again",
        "the runs page",
    ],
    "m": [
        "raw pyzmq echo, numpy 1 MiB: peak RSS",
        "Direct, numpy 1 MiB: peak RSS",
        "Mount, numpy 1 MiB: peak RSS",
        "Mount views, numpy 1 MiB: peak RSS",
        "Relayed, numpy 1 MiB: peak RSS",
    ],
}


def quick(*options: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(RUN), "--quick", *options], cwd=ROOT, capture_output=True, text=True, timeout=600
    )


def markdown_rows(output: str) -> list[dict[str, str]]:
    lines = [line for line in output.splitlines() if line.startswith("| ")]
    names = [cell.strip() for cell in lines[0].strip("|").split("|")]
    cells = [[cell.strip() for cell in line.strip("|").split(" | ")] for line in lines[1:]]
    return [dict(zip(names, row, strict=True)) for row in cells]


@pytest.mark.timeout(660)
def test_the_quick_run_measures_every_case(request):
    """The run itself started as the suite did, beside the other tests (conftest's
    ``QUICK_RUN``): here its output is read once it has ended."""
    from conftest import quick_run_result

    if hasattr(request.config, "_quick_run"):
        done = quick_run_result(request.config, 600)
    else:  # under pytest-xdist: run here
        done = quick("--markdown", "--without-others")
    assert done.returncode == 0, done.stderr[-4000:]
    rows = markdown_rows(done.stdout)
    for case, expected in ROWS.items():
        whats = [row["what"] for row in rows if row["case"] == case]
        for start in expected:
            assert any(what.startswith(start) for what in whats), f"({case}) has no row {start!r}:\n{done.stdout}"
    torch_rows = [row for row in rows if row["case"] == "b" and "torch" in row["what"]]
    assert torch_rows, "a torch row, measured or saying why not"
    for row in rows:
        if row["target"]:
            assert row["verdict"] in ("PASS", "MISS"), row
        if row["what"].startswith("artifact pickles"):
            assert row["verdict"] == "PASS", f"the node was pickled more than once: {row}"


@pytest.mark.timeout(240)
def test_only_picks_cases_and_the_text_table_lines_up():
    done = quick("--only", "c,d", "--without-others")
    assert done.returncode == 0, done.stderr[-4000:]
    lines = done.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("case  what"))
    body = [line for line in lines[header + 2 :] if line.strip()]
    assert {line.split()[0] for line in body} == {"c", "d"}
    column = lines[header].index("result")
    assert all(line[column - 2 : column] == "  " for line in body)  # aligned under the header


def test_an_unknown_case_is_refused():
    done = subprocess.run(
        [sys.executable, str(RUN), "--only", "z"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and "--only takes some of a,b,c,d,e,f" in done.stderr


@pytest.mark.timeout(240)
def test_compare_runs_case_a_on_each_tree_in_turn(tmp_path):
    """`benchmarks/compare.py` runs case (a) against each checkout given, each in a process of
    its own with that checkout's somatize; a folder that is not one is refused."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "compare.py"), str(ROOT), "--rounds", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    (line,) = done.stdout.splitlines()
    assert line.startswith(f"round 1, {ROOT}: raw ") and "x at the median" in line and "failed" not in line, line
    refused = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "compare.py"), str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2 and "holds no somatize/ folder" in refused.stderr
