"""Computing once, against a writer of the store's folder (issue 39, items 1 and 4).

A colleague in the store's group (`nobody`, with ``setpriv``) plants names among the
computing claims. A file or a link at ``computing/judge`` made a waiting forward raise
``StoreError`` at its first judgement (3.6 s in); now a judge it cannot write means judging
the claim by its own stamp, and the forward recalls the entry the live claimer keeps, or
takes over a dead one's. A link (or anything else) as a claim made a waiter spin at a
quarter of a core for an hour; now that claim is nobody's and the forward computes at once.
Three claims kept fresh made a forward with ``deadline=6`` wait 3 s for each, then raise
``Overdue``; now all of a forward's waits end together at half its deadline, and it computes.
Claimers and waiters are real processes sharing a real ``FolderStore`` folder.
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
from pathlib import Path

import pytest
from computing_nodes import Counted
from conftest import env_with_tests
from reliability_support import wait_until
from shared_names_support import open_to_others, plant, plant_args, planting

from somatize import FolderStore

pytestmark = pytest.mark.timeout(120)

PATIENCE = 1.5  # the claimers' and the waiters' both: a pulse every 0.5 s, dead after 1.5 s

# A forward in its own process: claims, waits, computes or recalls as any runner would.
FORWARD = """if True:
    import json, sys, time
    from computing_nodes import Counted
    from somatize import FolderStore, computing
    folder, tally, gate, patience = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
    computing.PATIENCE = patience
    facts = []
    graph = Counted(tally, 60, gate).named("prefix").frozen().cached()
    wall, cpu = time.monotonic(), time.process_time()
    out = graph.forward(10, store=FolderStore(folder), watching=facts.append)
    wall, cpu = time.monotonic() - wall, time.process_time() - cpu
    print(json.dumps({"out": out, "wall": wall, "cpu": cpu,
                      "facts": [f["fact"] for f in facts if f["fact"] in ("recalled", "kept")]}), flush=True)
"""


@pytest.fixture
def shared():
    base = Path(tempfile.mkdtemp(prefix="somatize-claims-"))
    base.chmod(0o755)
    yield base / "store"
    shutil.rmtree(base, ignore_errors=True)


def forward(folder: Path, tally: Path, gate: Path, logs: Path, name: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", FORWARD, str(folder), str(tally), str(gate), str(PATIENCE)],
        stdout=subprocess.PIPE,
        stderr=(logs / f"{name}.err").open("w"),
        text=True,
        env=env_with_tests(),
    )


def said(process: subprocess.Popen) -> dict:
    out, _ = process.communicate(timeout=60)
    assert process.returncode == 0, f"the forward failed: {out}"
    return json.loads(out)


def key_of(tally: Path, gate: Path, probe: Path) -> str:
    """The key `FORWARD`'s node keeps its entry under (learnt in another store)."""
    facts: list = []
    gate.touch()
    Counted(str(tally), 60, str(gate)).named("prefix").frozen().cached().forward(
        10, store=FolderStore(probe), watching=facts.append
    )
    tally.unlink()
    return next(f["key"] for f in facts if f["fact"] == "kept")


def stamps_changed(store: FolderStore, name: str, times: int) -> None:
    """Wait until the claim ``name`` was written again ``times`` times (its claimer is alive)."""
    seen = [store.stamp(name)]

    def moved() -> bool:
        now = store.stamp(name)
        if now != seen[-1]:
            seen.append(now)
        return len(seen) > times

    wait_until(moved, 30, f"the claim written again {times} times")


@pytest.mark.parametrize("judge", ["file", "link-folder", "link-nowhere"])
def test_a_judge_planted_by_a_writer_makes_a_waiter_recall_not_raise(shared, tmp_path, python_for_nobody, judge):
    store = FolderStore(shared)
    open_to_others(store.path, store.path / "computing")
    where = store.path / "computing" / "judge"
    plant(
        python_for_nobody,
        ["file", str(where), b"mine".hex()] if judge == "file" else plant_args(judge, where, tmp_path / "theirs"),
    )
    tally, gate = tmp_path / "tally", tmp_path / "gate"
    claimer = forward(store.path, tally, gate, tmp_path, "claimer")
    waiter = None
    try:
        wait_until(lambda: tally.exists() and tally.read_text().strip(), 30, "the claimer computing")
        claim = next(name for name, _ in store.scan("computing/"))
        waiter = forward(store.path, tally, gate, tmp_path, "waiter")
        # the waiter tries its judge (every PATIENCE / 3), finds it blocked, and says so once
        wait_until(lambda: "computing/judge" in (tmp_path / "waiter.err").read_text(), 30, "the waiter judging")
        stamps_changed(store, claim, 4)  # > PATIENCE: a waiter that misjudged it would take it over
        gate.touch()
        first, second = said(claimer), said(waiter)
    finally:
        for each in (claimer, waiter):
            if each is not None:
                each.kill()
                each.wait()
    assert first["out"] == second["out"] == 20
    assert first["facts"] == ["kept"] and second["facts"] == ["recalled"]  # computed once, recalled
    assert len(tally.read_text().splitlines()) == 1
    assert (tmp_path / "waiter.err").read_text().count("computing/judge") == 1  # one line
    assert second["cpu"] < 0.2 * second["wall"], second  # it waited; it never spun


def test_a_dead_claimer_is_taken_over_when_the_judge_is_blocked(shared, tmp_path, python_for_nobody):
    store = FolderStore(shared)
    open_to_others(store.path, store.path / "computing")
    plant(python_for_nobody, ["file", str(store.path / "computing" / "judge"), b"mine".hex()])
    tally, gate = tmp_path / "tally", tmp_path / "gate"
    claimer = forward(store.path, tally, gate, tmp_path, "claimer")
    try:
        wait_until(lambda: tally.exists() and tally.read_text().strip(), 30, "the claimer computing")
    finally:
        claimer.send_signal(signal.SIGKILL)
        claimer.wait()
    gate.touch()  # ours returns at once once it computes
    waiter = forward(store.path, tally, gate, tmp_path, "waiter")
    try:
        got = said(waiter)
    finally:
        waiter.kill()
        waiter.wait()
    assert got["out"] == 20 and got["facts"] == ["kept"]
    assert len(tally.read_text().splitlines()) == 2  # the dead one's start, and ours
    assert list(store.scan("computing/")) == []


@pytest.mark.parametrize("kind", ["link-file", "link-folder", "link-nowhere", "folder", "socket"])
def test_a_claim_planted_as_anything_else_is_nobody_s_and_the_forward_computes(
    shared, tmp_path, python_for_nobody, kind
):
    """Attack: a link where a claim belongs. `create` said taken, every read said missing, and
    the waiter went round without a pause, 400-790 writes a second, for an hour. Now the
    claim's name is blocked: the forward computes at once, follows nothing, removes nothing."""
    theirs = FolderStore(tmp_path / "theirs")
    theirs.put("secret", {"v": "theirs"})
    store = FolderStore(shared)
    open_to_others(store.path, store.path / "computing")
    tally, gate = tmp_path / "tally", tmp_path / "gate"
    claim = store.path / "computing" / f"{key_of(tally, gate, tmp_path / 'probe')}.rec"
    plant(python_for_nobody, plant_args(kind, claim, theirs.path))
    process = forward(store.path, tally, gate, tmp_path, "forward")
    try:
        got = said(process)
    finally:
        process.kill()
        process.wait()
    assert got["out"] == 20 and got["facts"] == ["kept"]
    assert got["wall"] < PATIENCE * 10 and got["cpu"] < 5, got  # at once (on main: an hour, spinning)
    assert os.path.lexists(claim) and theirs.record("secret") == {"v": "theirs"}
    assert str(claim) in (tmp_path / "forward.err").read_text()  # one line names it


def test_claims_kept_fresh_by_a_writer_bound_a_forward_s_waits_together(shared, tmp_path, python_for_nobody):
    """Attack: three cached entries claimed by a writer who keeps writing the claims. A forward
    with ``deadline=6`` waited half its deadline for each in turn, 9.2 s, then raised
    ``Overdue``. Now its waits end together at half its deadline; then it computes all three."""
    tallies = [tmp_path / f"tally-{n}" for n in "abc"]
    graph = (
        Counted(str(tallies[0]), 0.0).named("a").frozen().cached()
        >> Counted(str(tallies[1]), 0.0).named("b").frozen().cached()
        >> Counted(str(tallies[2]), 0.0).named("c").frozen().cached()
    )
    facts: list = []
    assert graph.forward(10, store=FolderStore(tmp_path / "probe"), watching=facts.append) == 80
    keys = [f["key"] for f in facts if f["fact"] == "kept"]
    assert len(keys) == 3
    for tally in tallies:
        tally.unlink()
    store = FolderStore(shared)
    computing = store.path / "computing"
    open_to_others(store.path, computing)
    stop = shared.parent / "stop"  # where `nobody` can see it
    claims = [[str(computing / f"{key}.rec"), {"by": "a colleague", "node": "x"}] for key in keys]
    keeper = planting(python_for_nobody, [["record", *claim] for claim in claims], keep=claims, stop=stop)
    try:
        wall, cpu = time.monotonic(), time.process_time()
        assert graph.forward(10, store=store, deadline=6) == 80  # on main: Overdue after 9.2 s
        wall, cpu = time.monotonic() - wall, time.process_time() - cpu
        assert all(os.path.exists(claim) for claim, _ in claims)  # still the colleague's, kept
    finally:
        stop.touch()
        try:
            keeper.wait(timeout=30)
        finally:
            keeper.kill()
            keeper.wait()
    assert [len(t.read_text().splitlines()) for t in tallies] == [1, 1, 1]  # computed, unclaimed
    assert 2.5 < wall < 6, wall  # it waited (half its deadline, for all three together), and no more
    assert cpu < 0.2 * wall, (cpu, wall)  # and never spun while it waited
