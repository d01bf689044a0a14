"""A writer of a shared folder plants every kind of entry at every name the code uses (issue 39, item 2).

``hostile_folders`` knows every name any piece reads or writes (from the code's own name
functions) and how to plant each kind of entry there as `nobody`. The first tests hold that
table to the code: every path a piece touches under its store, traced inside the piece's own
process, is a name of the table, and every name of the table is touched. The others plant,
in turn, each kind at each name and run each piece that reads or writes it, a real one in a
real process: a cached forward, computing once, a study runner (``python -m somatize study``'s
``main``), ``--show``, ``--watch``, every reader of ``somatize.record`` and every page of the
view (a real ``python -m somatize view``, asked over HTTP with its token). Each case asserts
the piece did not crash, hang, spin or leak, answered right where there is a right answer,
and said one line naming the name.

The checks of one piece run in one warm process that forks a child per check (see
``hostile_folders.Prober``), so the file runs hundreds of checks in about a minute; the
results of a piece are computed once per session (shared by xdist's workers through a file
lock) and each case asserts its own. A case that fails on today's code is a finding, kept as
a strict xfail naming the fault (``FINDINGS``): it flips when the fault is mended.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

optuna = pytest.importorskip("optuna", reason="studies need Optuna: pip install 'somatize[study]'")

import hostile_folders as hf  # noqa: E402
from conftest import env_with_tests  # noqa: E402
from hostile_folders import RUN, RUNNER, STUDY, TRIAL, TRIALS, Site  # noqa: E402

pytestmark = pytest.mark.timeout(600)

# -- the table holds every name the code makes ------------------------------------------------

COVERING = r'''
import json, os, sys, time, urllib.request
from pathlib import Path
root = Path(os.environ["HOSTILE_ROOT"])
import hostile_folders as hf
from optuna.distributions import FloatDistribution
from somatize import FolderStore, computing
from somatize.facts import fact
from somatize.record import Recorder, recorder, report, self_report
import somatize.record as record
from somatize.study import Study
from somatize.__main__ import main

store = FolderStore(root)
# a cached forward: kept, then recalled
graph = hf.node()
assert graph.forward(3, store=store) == 31 and graph.forward(3, store=store) == 31
# computing once: a claim another forward holds, gone stale, judged and taken over
computing.PATIENCE = 0.6
aside = FolderStore(os.environ["HOSTILE_ASIDE"])
graph.forward(4, store=aside)
key = aside.names("cache/")[0][len("cache/"):]
store.create(computing._PREFIX + key, {"by": "elsewhere", "node": "tenfold"})
old = time.time_ns() - 3600 * 10**9
os.utime(root / (computing._PREFIX + key + ".rec"), ns=(old, old))
assert graph.forward(4, store=store) == 41
# a study: a stale attempt judged and taken over, the others claimed and done; then looked at
Study(store, hf.STUDY, objective="study_objectives:quadratic", space={"x": FloatDistribution(-5, 5)},
      trials=hf.TRIALS, sampler="random", patience=1.0)
from somatize.study.history import attempt_name
store.put(attempt_name(hf.STUDY, 0, 0), {"trial": "0", "attempt": "0", "config": '{"x": 1.0}', "state": "running",
          "score": "", "took_us": "1", "runner": "gone", "error": "", "facts": "0"})
os.utime(root / (attempt_name(hf.STUDY, 0, 0) + ".rec"), ns=(old, old))
assert main(["study", "--store", str(root), hf.STUDY, "--runner", hf.RUNNER]) == 0
assert main(["study", "--store", str(root), hf.STUDY, "--show"]) == 0
assert main(["study", "--store", str(root), hf.STUDY, "--watch", "0.1"]) == 0
# the record: forwards (a chunk of them too), a machine's report, and every reader
recorder.CHUNK = 3
rec = Recorder(store, run=hf.RUN, summarising=["loss"])
for n in range(5):
    graph.forward(n, store=store, watching=rec)
    rec(fact("loss", value=1.0 / (n + 1)))
report(store, hf.MACHINE, self_report(3, machine=hf.MACHINE))
recorder.CHUNK = 1000
print(json.dumps(hf._readers({"store": str(root), "readers": hf.READERS, "progress": os.environ["HOSTILE_ASIDE"] + "/p"}),
                 default=str))
'''


def _view(store: Path, env: dict[str, str], log: Path, prelude: str = "") -> tuple[subprocess.Popen, str, str]:
    """A real view of ``store``: its process, its address and its token."""
    script = prelude + "\nimport sys\nfrom somatize.__main__ import main\nsys.exit(main(sys.argv[1:]))\n"
    process = subprocess.Popen([sys.executable, "-c", script, "view", "--store", str(store), "--listen",
                                "127.0.0.1:0", "--announce"], stdout=subprocess.PIPE, stderr=log.open("w"),
                               text=True, env=env, start_new_session=True)
    import select

    ready, _, _ = select.select([process.stdout], [], [], 60)
    line = process.stdout.readline() if ready else ""
    assert line.startswith("somatize-view ready "), f"the view did not start: {log.read_text()[-2000:]}"
    address = line.split()[-1]
    return process, address.split("/?")[0], address.split("token=")[1]


def _get(base: str, token: str, path: str, timeout: float = 10.0) -> tuple[int, bytes]:
    asked = urllib.request.Request(base + path, headers={"Authorization": "token " + token, "Connection": "close"})
    try:
        with urllib.request.urlopen(asked, timeout=timeout) as answer:
            if path.startswith("/api/events"):
                return answer.status, b""  # a stream: that it opened is the answer
            return answer.status, answer.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (TimeoutError, OSError) as exc:
        return -1, str(exc).encode()


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def test_every_path_a_piece_touches_is_a_name_of_the_table(tmp_path):
    root, aside = tmp_path / "store", tmp_path / "aside"
    root.mkdir()
    trace = tmp_path / "trace"
    env = {**env_with_tests(), "HOSTILE_ROOT": str(root), "HOSTILE_TRACE": str(trace), "HOSTILE_ASIDE": str(aside)}
    done = subprocess.run([sys.executable, "-c", hf.TRACER + COVERING], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    readers = json.loads(done.stdout.strip().splitlines()[-1])
    assert not [name for name, said in readers.items() if "raised" in said], readers
    # and the view, every page of it, with the tracer in its own process
    process, base, token = _view(root, env, tmp_path / "view.log", prelude=hf.TRACER)
    try:
        pages = ["/", "/api/runs", f"/api/run/{RUN}", f"/api/run/{RUN}/nodes", f"/api/run/{RUN}/facts/1",
                 "/api/machines", f"/api/machines?run={RUN}", "/api/studies", f"/api/study/{STUDY}",
                 "/api/events?subject=runs", f"/api/events?subject=run:{RUN}", "/api/events?subject=machines",
                 "/api/events?subject=studies", f"/api/events?subject=study:{STUDY}"]
        for page in pages:
            status, _ = _get(base, token, page)
            assert status == 200, page
    finally:
        _stop(process)
    touched = hf.read_trace(trace)
    assert hf.unknown_paths(touched) == [], "names the code uses that the harness does not know"
    for name in hf.names():  # and the table holds no name the code no longer makes
        assert any(__import__("re").fullmatch(name.pattern + r"\.rec", path) for path in touched), name.what


def test_each_name_of_the_table_is_made_by_the_code_s_own_function():
    import re

    for name in hf.names():
        assert re.fullmatch(name.pattern, name.sample), name
    shown = {site.what: site.path for site in hf.sites().values()}
    assert shown["attempt"] == "tune/trial/000001/000.rec" and shown["folder <study>/trial/<n>"] == "tune/trial/000001"
