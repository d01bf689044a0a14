"""The view reads each forward of a run once: after the first scan, only what is new.

No browser here (tests/test_view.py drives one): `somatize.view.runs.Runs` over a real
FolderStore, with the store's reads counted.
"""

from __future__ import annotations

import math
import os

import pytest

pytest.importorskip("starlette")

import somatize.record.recorder as recorder_module  # noqa: E402
import somatize.view.runs as runs_module  # noqa: E402
from somatize import FolderStore, Recorder  # noqa: E402
from somatize.record.recorder import chunk_name, chunk_records, records_of  # noqa: E402
from somatize.view.runs import POINTS, Runs, stretched  # noqa: E402


class Counted(FolderStore):
    """A FolderStore that counts its scans, single records and fetches."""

    def __init__(self, path) -> None:  # noqa: ANN001
        super().__init__(path)
        self.scans = self.records = self.fetches = 0

    def scan(self, prefix: str):  # noqa: ANN201
        self.scans += 1
        return super().scan(prefix)

    def record(self, name: str) -> dict:
        self.records += 1
        return super().record(name)

    def fetch(self, name: str):  # noqa: ANN201
        self.fetches += 1
        return super().fetch(name)


def record(store, run: str, count: int, first: int = 0) -> None:  # noqa: ANN001
    recorder = Recorder(store, run=run, summarising=("loss",))
    for number in range(first, first + count):
        recorder({"fact": "ran", "node": "step", "took_us": "7"})
        recorder({"fact": "finished", "took_us": str(10 + number)})
        recorder({"fact": "loss", "value": repr(1.0 / (number + 1))})


@pytest.mark.pure
def test_a_run_is_read_once_and_then_only_what_is_new(tmp_path):
    store = Counted(tmp_path / "store")
    record(store, "r", 30)
    store.scans = 0  # (a Recorder looks at its run first)
    runs = Runs(store)
    page = runs.page("r", 0, 10)
    assert page["count"] == 30 and [row["forward"] for row in page["forwards"]] == list(range(10))
    assert page["kinds"] == ["loss.value"] and len(page["curve"]) == 30 and page["took"][0] == (0, 10)
    assert (store.scans, store.records) == (1, 0)
    assert runs.page("r", 25, 10)["forwards"][-1]["forward"] == 29
    assert (store.scans, store.records) == (1, 0)  # nothing new: nothing read
    record(store, "r", 5, first=30)
    store.scans = store.records = 0  # (a Recorder going on with a run looks at it first)
    page = runs.page("r", 28, 10)
    assert page["count"] == 35 and [row["forward"] for row in page["forwards"]] == list(range(28, 35))
    assert (store.scans, store.records) == (0, 5)  # the five new ones, and nothing else
    # a forward put again (a new file, a new inode) is read again; one removed goes
    store.put("run/r/3", {"state": "failed", "took_us": "1"})
    os.unlink(tmp_path / "store" / "run" / "r" / "4.rec")
    page = runs.page("r", 0, 10)
    assert page["count"] == 34 and page["forwards"][3]["state"] == "failed"
    assert [row["forward"] for row in page["forwards"]][3:5] == [3, 5]
    assert store.records == 6 and store.scans == 0


@pytest.mark.pure
def test_a_link_among_a_runs_forwards_is_never_read(tmp_path):
    """Records are written by other people's processes: a link planted as a forward's file
    is left out, by the listing as by the scan."""
    store = Counted(tmp_path / "store")
    record(store, "r", 3)
    runs = Runs(store)
    assert runs.page("r", 0, 10)["count"] == 3
    secret = tmp_path / "secret.rec"
    secret.write_text("not for the view")
    os.symlink(secret, tmp_path / "store" / "run" / "r" / "9.rec")
    assert runs.page("r", 0, 10)["count"] == 3 and store.records == 0


@pytest.mark.pure
def test_a_run_folder_that_is_a_link_is_not_listed(tmp_path):
    """A writer of the shared folder replaces the store's `run` folder (or a run's) with a
    link to a folder of its choosing: the view lists nothing through it."""
    elsewhere = FolderStore(tmp_path / "elsewhere")
    record(elsewhere, "r", 3)
    store = Counted(tmp_path / "store")
    os.makedirs(tmp_path / "store" / "run")
    os.symlink(tmp_path / "elsewhere" / "run" / "r", tmp_path / "store" / "run" / "r")
    assert Runs(store).page("r", 0, 10)["count"] == 0
    os.unlink(tmp_path / "store" / "run" / "r")
    os.rmdir(tmp_path / "store" / "run")
    os.symlink(tmp_path / "elsewhere" / "run", tmp_path / "store" / "run")
    assert Runs(store).page("r", 0, 10)["count"] == 0 and store.records == 0


def test_a_long_curve_is_thinned_to_what_a_line_shows(tmp_path):
    store = FolderStore(tmp_path / "store")
    for n in range(3 * POINTS):
        store.put(f"run/long/{n}", {"state": "ok", "took_us": "5", "loss.value": repr(float(n % 97))})
    page = Runs(store).page("long", 0, 5)
    assert page["count"] == 3 * POINTS and len(page["curve"]) <= POINTS + 2
    assert page["curve"][-1] == (3 * POINTS - 1, float((3 * POINTS - 1) % 97))  # the last point kept
    assert max(v for _, v in page["curve"]) == 96.0 and min(v for _, v in page["curve"]) == 0.0
    # what each point kept stands for: its stretch's mean and count, counted once a stretch
    stretches = page["stretches"]["loss.value"]
    assert len(stretches) == len(page["curve"]) and "took_us" not in page["stretches"]
    assert sum(count for _, count in stretches) == 3 * POINTS
    assert math.isclose(sum(mean * count for mean, count in stretches), sum(float(n % 97) for n in range(3 * POINTS)))


@pytest.mark.pure
def test_a_stretch_is_a_partition_of_what_was_recorded():
    """`stretched`: each stretch's count on its first point kept (in order), 0 on the rest;
    the counts add up to the points, the means to their sum; short curves are not thinned."""
    points = [(n, float((n * 7919) % 1013)) for n in range(5 * POINTS + 3)]
    kept, stretches = stretched(points)
    assert stretched(points[:POINTS]) == (points[:POINTS], None)
    assert len(kept) == len(stretches) and kept[-1] == points[-1]
    assert [p[0] for p in kept] == sorted(p[0] for p in kept)
    assert sum(count for _, count in stretches) == len(points)
    assert math.isclose(sum(mean * count for mean, count in stretches), math.fsum(v for _, v in points))
    firsts = [k for k, (_, count) in enumerate(stretches) if count]
    assert firsts[0] == 0 and all(
        stretches[k][0] == stretches[k - 1][0] for k in range(1, len(kept)) if k not in firsts
    )


# -- chunks: a recorder's records of each thousand forwards, in one entry ------------------------


@pytest.fixture
def chunks_of_ten(monkeypatch):
    monkeypatch.setattr(recorder_module, "CHUNK", 10)


@pytest.mark.pure
def test_a_recorder_writes_each_chunk_once_it_is_whole(tmp_path, chunks_of_ten):
    """Chunk k is written when forward (k + 1) * CHUNK closes: by then no fact can be filed
    into its forwards any more (a loss said after `finished` is filed into the forward that
    closed last, which is written again), so it holds each forward's last record."""
    store = FolderStore(tmp_path / "store")
    record(store, "r", 25)
    scanned = {number: rec for number, rec in records_of(store, "r")}
    assert sorted(scanned) == list(range(25))
    assert chunk_records(store, "r", 0) == {n: scanned[n] for n in range(10)}
    assert chunk_records(store, "r", 1) == {n: scanned[n] for n in range(10, 20)}
    assert chunk_records(store, "r", 2) is None  # 20..24: not whole yet
    assert scanned[9]["loss.value"] == repr(1.0 / 10)  # the rewrite is what the chunk holds
    # a recorder that goes on with the run from its middle never writes the chunk it joined
    record(store, "r", 10, first=25)
    assert chunk_records(store, "r", 2) is None and chunk_records(store, "r", 3) is None


@pytest.mark.pure
def test_a_chunk_that_is_not_what_a_recorder_writes_is_not_taken(tmp_path, chunks_of_ten, monkeypatch):
    """Chunks are read from a shared folder: anything but forwards of that chunk with records
    of text spoils it, and its forwards are read one by one."""
    store = FolderStore(tmp_path / "store")
    record(store, "r", 12)
    name = chunk_name("r", 0)
    for junk in (
        b"not json",
        b'{"a": 1}',
        b'[[3, {"x": 1}]]',
        b'[[42, {"x": "y"}]]',
        b'[["3", {"x": "y"}]]',
        b"[" * 100_000,
    ):
        store.put(name, {"run": "r"}, junk)
        assert chunk_records(store, "r", 0) is None, junk[:40]
    with monkeypatch.context() as patched:  # a chunk bigger than any a recorder writes is never read whole
        patched.setattr(runs_module, "MOST_CHUNK", 1000)
        store.put(name, {"run": "r"}, b" " * 2000 + b'[[3, {"state": "planted"}]]')
        assert Runs(store).page("r", 0, 20)["forwards"][3]["state"] == "ok"
    store.put(name, {"run": "r"}, b'[[3, {"state": "planted"}]]')
    runs = Runs(store)
    page = runs.page("r", 0, 20)
    assert page["count"] == 12 and page["forwards"][3]["state"] == "planted"  # a chunk's word, checked


@pytest.mark.pure
def test_the_first_look_at_a_long_run_reads_its_chunks_not_every_forward(tmp_path, chunks_of_ten):
    store = Counted(tmp_path / "store")
    record(store, "r", 35)
    store.put("run/r/4", {"state": "failed", "took_us": "1"})  # put again after its chunk
    store.scans = store.records = store.fetches = 0
    page = Runs(store).page("r", 0, 40)
    assert [row["forward"] for row in page["forwards"]] == list(range(35))
    assert page["forwards"][4]["state"] == "failed" and page["forwards"][5]["state"] == "ok"
    assert page["curve"][-1] == (34, 1.0 / 35)
    # three chunks, and on their own: the five the last chunk lacks and the one put again
    assert (store.scans, store.fetches, store.records) == (0, 3, 6)


@pytest.mark.pure
def test_every_summarised_number_is_drawn_not_only_the_loss(tmp_path):
    store = FolderStore(tmp_path / "store")
    recorder = Recorder(store, run="r", summarising=("loss", "acc"))
    for number in range(5):
        recorder({"fact": "finished", "took_us": "3"})
        recorder({"fact": "loss", "value": repr(1.0 / (number + 1))})
        recorder({"fact": "acc", "value": repr(number / 10), "phase": "<b>train</b>"})
    page = Runs(store).page("r", 0, 10)
    assert page["kinds"] == ["acc.phase", "acc.value", "loss.value"]
    assert page["series"] == {"acc.value": [(n, n / 10) for n in range(5)]}  # a field of text: in the table only
    assert len(page["curve"]) == 5


def trained(store, run: str = "t", steps: int = 12, per_epoch: int = 4) -> None:  # noqa: ANN001
    """What a `Trainer` with `Recorder(summarising=["loss", "val"])` writes: a loss with its step
    and epoch each forward, a validation loss with its epoch at each epoch's end; the first
    forward slow (a worker starting)."""
    recorder = Recorder(store, run=run, summarising=("loss", "val"))
    for n in range(steps):
        recorder({"fact": "finished", "took_us": str(2_100_000 if n == 0 else 5000 + n)})
        recorder({"fact": "loss", "value": repr(1 / (n + 1)), "step": str(n), "epoch": str(n // per_epoch)})
        if n % per_epoch == per_epoch - 1:
            recorder({"fact": "val", "value": repr(0.5 / (n + 1)), "epoch": str(n // per_epoch)})


@pytest.mark.pure
def test_counters_are_the_x_a_page_may_choose_not_curves(tmp_path):
    store = FolderStore(tmp_path / "store")
    trained(store)
    page = Runs(store).page("t", 0, 20)
    assert page["kinds"] == ["loss.epoch", "loss.step", "loss.value", "val.epoch", "val.value"]  # the table's columns
    assert list(page["series"]) == ["val.value"]  # no curve of a counter
    assert page["x"] == ["forward", "step", "epoch"]
    assert page["counters"]["step"] == {n: float(n) for n in range(12)}
    # against the epoch, each forward at its place in its epoch (steps 0..3 are epoch 0): a
    # per-step loss draws as a line, and the validation said at an epoch's last step sits there
    assert page["counters"]["epoch"] == {n: n / 4 for n in range(12)}


@pytest.mark.pure
def test_a_place_in_an_epoch_follows_the_steps_however_they_are_counted(tmp_path):
    store = FolderStore(tmp_path / "store")
    recorder = Recorder(store, run="r", summarising=("loss", "val"))
    said = [  # steps that start again each epoch, said every 10th step; a forward saying no step
        *[{"value": "1.0", "step": str(s), "epoch": "0"} for s in (0, 10, 20, 30, 40)],
        *[{"value": "0.5", "step": str(s), "epoch": "1"} for s in (0, 10, 20, 30, 40)],
        {"value": "0.4", "epoch": "2"},
        {"value": "0.3", "step": "7", "epoch": "3"},  # an epoch of one step: its start
    ]
    for fields in said:
        recorder({"fact": "finished", "took_us": "10"})
        recorder({"fact": "loss", **fields})
    epoch = Runs(store).page("r", 0, 20)["counters"]["epoch"]
    assert [epoch[n] for n in range(5)] == [0.0, 0.2, 0.4, 0.6, 0.8]  # 5 steps, 10 apart: 50 in all
    assert [epoch[n] for n in range(5, 10)] == [1.0, 1.2, 1.4, 1.6, 1.8]
    assert epoch[10] == 2.0 and epoch[11] == 3.0

    # a validation counting its own steps on forwards of its own: measured against its own
    store = FolderStore(tmp_path / "other")
    recorder = Recorder(store, run="r", summarising=("loss", "val"))
    for n in range(200):
        recorder({"fact": "finished", "took_us": "10"})
        recorder({"fact": "loss", "value": "1.0", "step": str(n), "epoch": str(n // 100)})
        if n % 100 == 99:
            for k in range(10):
                recorder({"fact": "finished", "took_us": "10"})
                recorder({"fact": "val", "value": "0.5", "step": str(k), "epoch": str(n // 100)})
    epoch = Runs(store).page("r", 0, 300)["counters"]["epoch"]
    assert epoch[110] == 1.0 and epoch[209] == 1.99  # the training's epoch 1: steps 100 to 199
    assert epoch[100] == 0.0 and epoch[109] == 0.9  # the validation's ten steps of epoch 0

    # epochs said as halves: a place covers the way to the next epoch said, never past it
    recorder = Recorder(store, run="halves", summarising=("loss",))
    for step, at in ((0, "0.5"), (99, "0.5"), (100, "1")):
        recorder({"fact": "finished", "took_us": "10"})
        recorder({"fact": "loss", "value": "1.0", "step": str(step), "epoch": at})
    assert Runs(store).page("halves", 0, 5)["counters"]["epoch"] == {0: 0.5, 1: 0.5 + 0.99 * 0.5, 2: 1.0}

    # steps written as far apart as a float goes: no place is made of them, nothing breaks
    store = FolderStore(tmp_path / "store")
    recorder = Recorder(store, run="r", summarising=("loss", "val"))
    for step in ("-1e308", "1e308"):
        recorder({"fact": "finished", "took_us": "10"})
        recorder({"fact": "loss", "value": "0.1", "step": step, "epoch": "9"})
    epoch = Runs(store).page("r", 0, 20)["counters"]["epoch"]
    assert epoch[12] == 9.0 and math.isfinite(epoch[13]) and 9.0 <= epoch[13] < 10.0


@pytest.mark.pure
def test_a_forward_far_slower_than_the_others_is_named_above_the_scale(tmp_path):
    store = FolderStore(tmp_path / "store")
    trained(store)
    page = Runs(store).page("t", 0, 20)
    assert page["took_outside"] == [(0, 2_100_000)] and page["took_outside_count"] == 1 and page["first"] == 0
    assert page["took_median"] == 5006.5


@pytest.mark.pure
def test_forwards_are_sorted_by_any_column_missing_values_last(tmp_path):
    store = FolderStore(tmp_path / "store")
    trained(store)
    runs = Runs(store)
    assert [r["forward"] for r in runs.page("t", 0, 3, "forward", desc=True)["forwards"]] == [11, 10, 9]
    assert [r["forward"] for r in runs.page("t", 0, 2, "took_us", desc=True)["forwards"]] == [0, 11]
    assert [r["forward"] for r in runs.page("t", 0, 4, "val.value")["forwards"]] == [11, 7, 3, 0]  # none: last
    assert [r["forward"] for r in runs.page("t", 0, 4, "val.value", desc=True)["forwards"]] == [3, 7, 11, 0]
    assert runs.page("t", 10, 5, "state")["forwards"][-1]["forward"] == 11
    with pytest.raises(ValueError, match="sorted by one of its columns"):
        runs.page("t", 0, 5, "<script>")


class Stamped(FolderStore):
    """A FolderStore that counts the stamps asked of it."""

    def __init__(self, path) -> None:  # noqa: ANN001
        super().__init__(path)
        self.stamps = 0

    def stamp(self, name: str) -> int:
        self.stamps += 1
        return super().stamp(name)


@pytest.mark.pure
def test_a_study_s_timeline_stamps_each_final_attempt_once_and_a_running_one_at_every_read(tmp_path):
    from somatize.study.history import History
    from somatize.view.study_page import Timeline

    store = Stamped(tmp_path / "store")
    for number, attempts in enumerate([["done"], ["running", "done"], ["running"]]):
        for attempt, state in enumerate(attempts):
            store.put(f"s/trial/{number:06d}.{attempt:03d}", {"state": state, "runner": "r", "took_us": "5"})
    timelines = Timeline()
    first = timelines.of(store, History.scan(store, "s"))
    assert [(a["trial"], a["attempt"], a["state"]) for a in first["attempts"]] == [
        (0, 0, "done"),
        (1, 0, "overtaken"),
        (1, 1, "done"),
        (2, 0, "running"),
    ]
    assert store.stamps == 4
    store.stamps = 0
    again = timelines.of(store, History.scan(store, "s"))
    assert store.stamps == 1  # only the attempt a runner still writes
    assert [a["trial"] for a in again["attempts"]] == [0, 1, 1, 2]
    assert again["attempts"][0]["end_s"] >= first["attempts"][0]["end_s"]  # the same stamp, read later

    # an overtaken attempt its runner then marks abandoned is a record written again: stamped again
    store.put("s/trial/000001.000", {"state": "abandoned", "runner": "r", "took_us": "9"})
    store.stamps = 0
    after = timelines.of(store, History.scan(store, "s"))
    assert store.stamps == 2  # that one, and the running one
    assert after["attempts"][1]["state"] == "abandoned"
