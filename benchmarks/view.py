"""Case (v): the live view on big records.

A run of 100,000 forwards recorded by a `Recorder` and a study of 10,000 finished trials, in
one store; `python -m somatize view` started on it, and the page's own requests timed over
HTTP, as the browser makes them (a run's page asks for the run, then its node costs; a
study's page for the study): opening the run as the view starts (it reads the newest runs
on a thread as it starts, so this is the first look at an unread run, or close to it), the
same run again, after 100 more forwards, and the study.

    python benchmarks/view.py 100000 10000     # the numbers as JSON
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

VIEW = [sys.executable, "-m", "somatize", "view", "--insecure", "--announce", "--listen", "127.0.0.1:0", "--store"]
VIEW_READY = "somatize-view ready "


class Parallel:
    """A store whose puts go out on eight threads (every put fsyncs: setup, not measured);
    what is written is what the Recorder wrote."""

    def __init__(self, store) -> None:  # noqa: ANN001 - a FolderStore
        self.store = store
        self.pool = ThreadPoolExecutor(8)
        self.pending: list = []

    def put(self, name: str, record, blob=None) -> None:  # noqa: ANN001
        self.pending.append(self.pool.submit(self.store.put, name, dict(record), blob))  # the Recorder makes each anew

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self.store, name)

    def wait(self) -> None:
        for done in self.pending:
            done.result()
        self.pending.clear()


def record(store, run: str, first: int, count: int) -> None:  # noqa: ANN001
    from somatize import Recorder

    recorder = Recorder(store, run=run, summarising=("loss",))
    for number in range(first, first + count):
        recorder({"fact": "ran", "node": "step", "took_us": "7", "host": "gpu1"})
        recorder({"fact": "finished", "took_us": "12"})
        recorder({"fact": "loss", "value": repr(1.0 / (number + 1))})


def get(url: str) -> tuple[float, int]:
    started = time.perf_counter()
    with urllib.request.urlopen(url, timeout=120) as answer:
        size = len(answer.read())
    return time.perf_counter() - started, size


def measure(forwards: int = 100_000, trials: int = 10_000) -> dict:
    from cases import _history  # a finished study, written as runners write them
    from children import Child

    from somatize import FolderStore

    folder = tempfile.mkdtemp(prefix="somatize-bench-view-")
    view = None
    try:
        started = time.perf_counter()
        parallel = Parallel(FolderStore(folder))
        record(parallel, "long", 0, forwards)
        parallel.wait()
        _history(folder, "sweep", trials)
        wrote = time.perf_counter() - started
        view = Child([*VIEW, folder], announce=VIEW_READY)
        base = view.endpoint.rstrip("/")
        run = [get(f"{base}/api/run/long"), get(f"{base}/api/run/long/nodes?last=100")]
        again = [get(f"{base}/api/run/long"), get(f"{base}/api/run/long/nodes?last=100")]
        record(FolderStore(folder), "long", forwards, 100)  # a run that goes on
        more = [get(f"{base}/api/run/long"), get(f"{base}/api/run/long/nodes?last=100")]
        study = get(f"{base}/api/study/sweep")
        study_again = get(f"{base}/api/study/sweep")
        runs = get(f"{base}/api/runs")
        return {
            "forwards": forwards,
            "trials": trials,
            "setup_s": wrote,
            "run_s": sum(t for t, _ in run),
            "run_bytes": sum(n for _, n in run),
            "run_again_s": sum(t for t, _ in again),
            "run_more_s": sum(t for t, _ in more),
            "study_s": study[0],
            "study_bytes": study[1],
            "study_again_s": study_again[0],
            "runs_s": runs[0],
        }
    finally:
        if view is not None:
            view.stop()
        shutil.rmtree(folder, ignore_errors=True)


def view_rows(settings, floors) -> list:  # noqa: ANN001  (cases.Settings, cases.Floors)
    from table import Row, at_most

    got = measure(settings.view_forwards, settings.view_trials)
    n, m = got["forwards"], got["trials"]
    return [
        Row(
            "v",
            f"opening a {n:,}-forward run as the view starts (the run, its node costs)",
            f"{got['run_s']:.2f} s, {got['run_bytes'] / 1024:.0f} KiB",
            target="<= 2 s",
            verdict=at_most(got["run_s"], 2.0),
        ),
        Row("v", "  the same run again", f"{got['run_again_s']:.2f} s"),
        Row("v", "  again after 100 more forwards", f"{got['run_more_s']:.2f} s"),
        Row(
            "v",
            f"opening a {m:,}-trial study",
            f"{got['study_s']:.2f} s, {got['study_bytes'] / 1024:.0f} KiB",
            target="<= 2 s",
            verdict=at_most(got["study_s"], 2.0),
        ),
        Row("v", "  the same study again", f"{got['study_again_s']:.2f} s"),
        Row("v", "the runs page", f"{got['runs_s']:.2f} s"),
        Row("v", "writing the run and the study (setup, not measured)", f"{got['setup_s']:.1f} s"),
    ]


if __name__ == "__main__":
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
    args = [int(a) for a in sys.argv[1:3]]
    print(json.dumps(measure(*args), indent=1))
