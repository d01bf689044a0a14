"""A cached entry several forwards miss at once is computed once (issue 21).

Four runners started together used to compute a shared cached prefix four times. Now the
first to miss it claims it in the store (``computing/<key>``, by ``create``), and the others
wait for the entry and read it back; a claim whose writer died is judged by the store's
stamps and taken over, and one given back without the entry (its forward failed) is taken
again. Real processes share a real ``FolderStore`` folder; the in-process forwards are real
threads; the dead claimer is a real process killed with SIGKILL.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading

import pytest
from computing_nodes import Counted, FailsFirst
from conftest import env_with_tests
from reliability_support import wait_until

from somatize import FolderStore, computing

pytestmark = pytest.mark.timeout(120)

RUNNER = """if True:
    import json, os, sys, time
    from computing_nodes import Counted, Plus
    from somatize import FolderStore
    folder, tally, go, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    while not os.path.exists(go):  # every runner starts its forward at the same moment
        time.sleep(0.005)
    facts = []
    graph = Counted(tally, 1.0).named("prefix").frozen().cached() >> Plus(n).named("tail")
    out = graph.forward(10, store=FolderStore(folder), watching=facts.append)
    print(json.dumps({"out": out, "facts": [dict(f) for f in facts if f["fact"] in ("recalled", "kept")]}), flush=True)
"""


def prefix(tally, seconds=1.0):
    return Counted(str(tally), seconds).named("prefix").frozen().cached()


def test_four_runners_started_at_once_compute_a_shared_prefix_once(tmp_path):
    folder, tally, go = tmp_path / "store", tmp_path / "tally", tmp_path / "go"
    folder.mkdir()
    runners = [
        subprocess.Popen(
            [sys.executable, "-c", RUNNER, str(folder), str(tally), str(go), str(n)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env_with_tests(),
        )
        for n in range(4)
    ]
    try:
        go.touch()
        said = [json.loads(r.communicate(timeout=60)[0]) for r in runners]
    finally:
        for r in runners:
            r.kill()
            r.wait()
    assert len(tally.read_text().splitlines()) == 1, "the prefix was computed more than once"
    assert [s["out"] for s in said] == [20, 21, 22, 23]
    kinds = sorted(f["fact"] for s in said for f in s["facts"])
    assert kinds == ["kept", "recalled", "recalled", "recalled"]
    waited = [f for s in said for f in s["facts"] if f["fact"] == "recalled"]
    assert all(int(f["waited_us"]) > 0 for f in waited)  # recalled after a wait, and it says so
    assert list(FolderStore(folder).scan("computing/")) == []  # every claim given back


def test_a_dead_claimer_s_claim_is_taken_over(tmp_path, monkeypatch):
    folder, tally, gate = tmp_path / "store", tmp_path / "tally", tmp_path / "gate"
    store = FolderStore(folder)
    script = (
        "import sys; from computing_nodes import Counted; from somatize import FolderStore; "
        "Counted(sys.argv[2], 60, sys.argv[3]).named('prefix').frozen().cached()"
        ".forward(10, store=FolderStore(sys.argv[1]))"
    )
    claimer = subprocess.Popen([sys.executable, "-c", script, str(folder), str(tally), str(gate)], env=env_with_tests())
    try:
        wait_until(lambda: list(store.scan("computing/")), 30, "the claimer claiming the prefix")
        # its line written, not only the file made (killed between the two, it leaves none)
        wait_until(lambda: tally.exists() and tally.read_text().strip(), 30, "the claimer computing")
    finally:
        claimer.send_signal(signal.SIGKILL)
        claimer.wait()
    monkeypatch.setattr(computing, "PATIENCE", 0.6)  # this forward's judgement: 0.6 s unwritten is dead
    gate.touch()  # the same node (the same key): ours returns at once
    facts: list = []
    graph = Counted(str(tally), 60, str(gate)).named("prefix").frozen().cached()
    assert graph.forward(10, store=store, watching=facts.append) == 20
    assert len(tally.read_text().splitlines()) == 2  # the dead one's start, and ours
    assert [f["fact"] for f in facts if f["fact"] in ("recalled", "kept")] == ["kept"]
    assert list(store.scan("computing/")) == []


def test_a_claim_given_back_without_the_entry_is_taken_again(tmp_path):
    store = FolderStore(tmp_path / "store")
    flag = tmp_path / "flag"
    graph = FailsFirst(str(flag), 0.5).named("prefix").frozen().cached()
    failed: list = []
    first = threading.Thread(target=lambda: failed.append(_raised(lambda: graph.forward(10, store=store))))
    first.start()
    wait_until(lambda: list(store.scan("computing/")), 30, "the first forward claiming the entry")
    facts: list = []
    assert graph.forward(10, store=store, watching=facts.append) == 20  # waited, then computed it
    first.join(30)
    assert failed and "the first computation fails" in failed[0]
    assert [f["fact"] for f in facts if f["fact"] in ("recalled", "kept")] == ["kept"]


@pytest.mark.pure
def test_a_claim_planted_as_junk_makes_nobody_wait(tmp_path):
    """A writer of the folder puts a FIFO where a claim belongs: a forward computes at once,
    as it would with no claims, and never blocks on opening it."""
    import os

    store = FolderStore(tmp_path / "store")
    tally = tmp_path / "tally"
    facts: list = []
    graph = prefix(tally, 0.0)
    FolderStore(tmp_path / "probe").put("x", {})  # the folder layout: where a claim's file goes
    key = _key_of(graph, tmp_path)
    (tmp_path / "store" / "computing").mkdir(parents=True)
    planted = tmp_path / "store" / "computing" / f"{key}.rec"
    os.mkfifo(planted)
    assert graph.forward(10, store=store, watching=facts.append) == 20
    assert len(tally.read_text().splitlines()) == 1
    assert planted.exists()  # computed at once: not judged dead after a patience and taken over


def _key_of(graph, tmp_path) -> str:
    facts: list = []
    graph.forward(10, store=FolderStore(tmp_path / "elsewhere"), watching=facts.append)
    (tmp_path / "tally").unlink()
    return next(f["key"] for f in facts if f["fact"] == "kept")


def _raised(call) -> str:
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the test reads it
        return str(exc)
    return ""
