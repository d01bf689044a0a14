"""Studies over one real folder, with real runner processes killed, paused and misled for real.

Runners are `python -m somatize study` processes importing the objectives of
tests/support/study_objectives.py by name. Every wait is for a fact in the folder (an attempt's
record, a judge's entry, a process's exit), with a deadline; every process is reaped by the
`processes` fixture. Patience is a second or two, so a takeover takes about that long.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

optuna = pytest.importorskip("optuna", reason="studies need Optuna: pip install 'somatize[study]'")

import study_objectives  # noqa: E402
from conftest import TESTS, env_with_tests  # noqa: E402
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution  # noqa: E402

from somatize import FolderStore, SomatizeError  # noqa: E402
from somatize.errors import Missing  # noqa: E402
from somatize.record.studies import attempt_of  # noqa: E402
from somatize.store import scanned_record  # noqa: E402
from somatize.study import Study, StudyMismatch  # noqa: E402
from somatize.study.command import main as study_main  # noqa: E402
from somatize.study.command import table  # noqa: E402
from somatize.study.history import History, attempt_name, older_attempt_name, read_trial  # noqa: E402

SBATCH = TESTS.parent / "workers" / "somatize-study.sbatch"
X = {"x": FloatDistribution(-5.0, 5.0)}

# What `srun` does inside an array task: drop its options, run the command.
FAKE_SRUN = """#!/bin/bash
while [[ $# -gt 0 && $1 == -* ]]; do shift; done
exec "$@"
"""

# A runner whose wall clock is an hour ahead: patched here, never in the library.
CLOCK_AHEAD = """import sys, time
_time, _time_ns = time.time, time.time_ns
time.time = lambda: _time() + 3600.0
time.time_ns = lambda: _time_ns() + 3_600_000_000_000
from somatize.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


# -- helpers ----------------------------------------------------------------------------


def wait_for(check, what: str, deadline: float = 20.0):
    """Poll ``check`` until it returns something true; fail after ``deadline`` seconds."""
    until = time.monotonic() + deadline
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > until:
            raise AssertionError(f"waited {deadline} s for {what}")
        time.sleep(0.02)


def attempts(store: FolderStore, name: str) -> dict[int, list[dict[str, str]]]:
    """Every attempt's record, by trial number, in attempt order."""
    out: dict[int, list[dict[str, str]]] = {}
    for entry, record in store.scan(f"{name}/trial/"):
        number, attempt, _ = attempt_of(entry[len(f"{name}/trial/") :])
        assert int(record["attempt"]) == attempt
        out.setdefault(number, []).append(record)
    return {number: out[number] for number in sorted(out)}


def counted(store: FolderStore, name: str) -> dict[int, dict[str, str]]:
    """The record that counts for each trial: its highest attempt's."""
    return {n: records[-1] for n, records in attempts(store, name).items()}


def record_of(store: FolderStore, name: str, number: int, attempt: int) -> dict[str, str] | None:
    return scanned_record(store, attempt_name(name, number, attempt))


@pytest.fixture
def folder(tmp_path) -> Path:
    return tmp_path / "store"


@pytest.fixture
def env(tmp_path) -> dict:
    out = env_with_tests()
    out["STUDY_TEST_LOG"] = str(tmp_path / "log.txt")
    return out


@pytest.fixture
def start(processes, folder, env):
    """Start a runner of study ``name`` called ``runner`` (optionally through ``wrapper``)."""

    def runner(name: str, runner: str, wrapper: Path | None = None):
        python = [sys.executable, str(wrapper)] if wrapper else [sys.executable, "-m", "somatize"]
        argv = [*python, "study", "--store", str(folder), name, "--runner", runner]
        return processes(argv, env=env, announce=None)

    return runner


def finished(process, deadline: float = 30.0) -> int:
    try:
        return process.popen.wait(deadline)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{process.argv} still running after {deadline} s:\n{process.stderr()}") from None


def output(process) -> str:
    assert process.popen.stdout is not None
    return process.popen.stdout.read().decode(errors="replace")


# -- runners over one folder ------------------------------------------------------------


def test_two_runners_and_twenty_trials_give_twenty_results_none_duplicated(folder, start):
    store = FolderStore(folder)
    Study(store, "twenty", objective="study_objectives:quadratic_slowly", space=X, trials=20, patience=2)
    a, b = start("twenty", "a"), start("twenty", "b")
    assert finished(a) == 0, a.stderr()
    assert finished(b) == 0, b.stderr()

    trials = attempts(store, "twenty")
    assert sorted(trials) == list(range(20))
    assert all(len(records) == 1 for records in trials.values())  # nothing was taken over
    results = [records[-1] for records in trials.values()]
    assert all(r["state"] == "done" and r["score"] for r in results)
    assert {r["runner"] for r in results} == {"a", "b"}  # both took part
    configs = [r["config"] for r in results]
    assert len(set(configs)) == 20  # nobody ran a configuration twice
    for r in results:
        x = json.loads(r["config"])["x"]
        assert float(r["score"]) == pytest.approx((x - 2.0) ** 2)
        assert float(r["said.half"]) == pytest.approx(x / 2)
        assert int(r["took_us"]) >= 50_000


def test_a_runner_killed_mid_trial_is_finished_by_the_other_as_attempt_1(folder, start):
    store = FolderStore(folder)
    Study(store, "killed", objective="study_objectives:stalls_on_first_attempt", space=X, trials=4, patience=1)
    a = start("killed", "a")
    wait_for(lambda: (record_of(store, "killed", 0, 0) or {}).get("runner") == "a", "a to claim trial 0")
    b = start("killed", "b")
    # b runs the other trials while a's attempt is alive and saying: it does not take it over
    wait_for(
        lambda: all((record_of(store, "killed", n, 0) or {}).get("state") == "done" for n in (1, 2, 3)),
        "b to finish trials 1 to 3",
    )
    assert record_of(store, "killed", 0, 1) is None
    assert record_of(store, "killed", 0, 0)["state"] == "running"
    a.signal(signal.SIGKILL)
    assert finished(b) == 0, b.stderr()

    trial0 = attempts(store, "killed")[0]
    assert [r["runner"] for r in trial0] == ["a", "b"]
    assert trial0[0]["state"] == "running" and trial0[0]["score"] == ""  # a died writing
    assert trial0[1]["state"] == "done" and trial0[1]["score"] == "1.0"  # attempt 1's score
    assert trial0[1]["config"] == trial0[0]["config"]  # the same configuration, again
    assert all(r["state"] == "done" for r in counted(store, "killed").values())
    assert "taking it over as attempt 1" in output(b)
    # --show says who took it over
    shown = {row.split()[0]: row for row in table(Study.open(store, "killed")).splitlines()[2:]}
    assert shown["0"].split()[:3] == ["0", "done", "2"] and "b, took over" in shown["0"]
    assert "took over" not in shown["1"]


def test_a_paused_runner_that_wakes_after_a_takeover_changes_nothing_that_counts(folder, start):
    store = FolderStore(folder)
    Study(store, "paused", objective="study_objectives:stalls_on_first_attempt", space=X, trials=2, patience=1)
    a = start("paused", "a")
    wait_for(lambda: (record_of(store, "paused", 0, 0) or {}).get("runner") == "a", "a to claim trial 0")
    a.signal(signal.SIGSTOP)
    b = start("paused", "b")
    assert finished(b) == 0, b.stderr()  # took trial 0 over, and ran trial 1
    taken = record_of(store, "paused", 0, 1)
    assert taken["runner"] == "b" and taken["state"] == "done"

    a.signal(signal.SIGCONT)
    assert finished(a) == 0, a.stderr()  # it learns, stops that trial, sees all finished
    assert "taken over by another runner" in output(a)
    first = record_of(store, "paused", 0, 0)
    assert first["state"] == "abandoned" and first["score"] == ""
    assert record_of(store, "paused", 0, 1) == taken  # a wrote nothing over b's result
    results = counted(store, "paused")
    assert [r["state"] for r in results.values()] == ["done", "done"]
    assert results[0]["score"] == "1.0"  # the one result of trial 0 is attempt 1's


def test_a_runner_whose_clock_is_an_hour_off_judges_by_the_stores_stamps(folder, start, tmp_path):
    store = FolderStore(folder)
    ahead = tmp_path / "clock_ahead.py"
    ahead.write_text(CLOCK_AHEAD)

    # a live attempt, pulsing but saying nothing: the misled runner leaves it alone
    Study(store, "live", objective="study_objectives:quiet_until_judged", space=X, trials=1, patience=1)
    a = start("live", "a")
    wait_for(lambda: record_of(store, "live", 0, 0), "a to claim the trial")
    b = start("live", "b", wrapper=ahead)
    wait_for(lambda: dict(store.scan("live/judge/")), "b to judge a's attempt", deadline=10)
    assert record_of(store, "live", 0, 0)["state"] == "running"  # judged while it ran
    assert finished(a) == 0, a.stderr()  # 2.5 s more of b judging it, after the first time
    assert finished(b) == 0, b.stderr()
    assert [r["runner"] for r in attempts(store, "live")[0]] == ["a"]
    assert counted(store, "live")[0]["state"] == "done"

    # a dead attempt: the misled runner takes it over, about `patience` after it stopped
    Study(store, "dead", objective="study_objectives:sleeps_unless_taken_over", space=X, trials=1, patience=1)
    a = start("dead", "a")
    wait_for(lambda: record_of(store, "dead", 0, 0), "a to claim the trial")
    b = start("dead", "b", wrapper=ahead)
    wait_for(lambda: dict(store.scan("dead/judge/")), "b to judge a's attempt", deadline=10)
    a.signal(signal.SIGKILL)
    assert finished(b, deadline=15) == 0, b.stderr()
    trial = attempts(store, "dead")[0]
    assert [(r["runner"], r["state"]) for r in trial] == [("a", "running"), ("b", "done")]


def test_a_runner_told_to_stop_hands_its_trial_over_at_once(folder, start):
    store = FolderStore(folder)
    # patience is long: only the stopped runner's own word lets b take over quickly
    Study(store, "stopped", objective="study_objectives:sleeps_unless_taken_over", space=X, trials=1, patience=60)
    a = start("stopped", "a")
    wait_for(lambda: record_of(store, "stopped", 0, 0), "a to claim the trial")
    b = start("stopped", "b")
    a.signal(signal.SIGTERM)
    assert finished(a) == 128 + signal.SIGTERM
    assert record_of(store, "stopped", 0, 0)["state"] == "abandoned"
    assert finished(b, deadline=15) == 0, b.stderr()
    assert counted(store, "stopped")[0]["runner"] == "b"


def test_trials_share_a_cached_frozen_embed_across_runners(folder, start, tmp_path):
    store = FolderStore(folder)
    Study(
        store,
        "shared",
        objective="study_objectives:shares_embed",
        space={"scale": FloatDistribution(0.5, 2.0)},
        trials=8,
        patience=2,
    )
    a, b = start("shared", "a"), start("shared", "b")
    assert finished(a) == 0, a.stderr()
    assert finished(b) == 0, b.stderr()

    results = counted(store, "shared")
    assert len(results) == 8 and all(r["state"] == "done" for r in results.values())
    for r in results.values():  # 1 + 2 + 3 + 4 letters, scaled
        assert float(r["score"]) == pytest.approx(10 * json.loads(r["config"])["scale"])
    runs = (tmp_path / "log.txt").read_text().split()
    embeds = [pid for word, pid in zip(runs[::2], runs[1::2], strict=False) if word == "embed"]
    assert 1 <= len(embeds) <= 2 and len(set(embeds)) == len(embeds)  # at most once per runner
    # what each trial's graph did is in its attempt's blob
    facts = [
        json.loads(line) for n in results for line in store.fetch(f"shared/trial/{n:06d}.000").decode().splitlines()
    ]
    recalled = [f for f in facts if f["fact"] == "recalled" and f.get("node") == "embed"]
    ran = [f for f in facts if f["fact"] == "ran" and f.get("node") == "embed"]
    assert len(ran) == len(embeds) and len(recalled) == 8 - len(ran)


def test_the_sbatch_array_runs_one_runner_per_task(folder, processes, env, tmp_path):
    done = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    text = SBATCH.read_text()
    assert text.startswith("#!/bin/bash\n") and os.access(SBATCH, os.X_OK)
    assert re.search(r"^#SBATCH --array=\S+$", text, re.M)
    assert re.search(r"^#SBATCH --ntasks=1$", text, re.M)
    srun = re.sub(r"\\\n\s*", " ", text).split("exec srun ", 1)[1].split()
    options = srun[: srun.index('"$SOMATIZE_PYTHON"')]
    # each option carries its value after `=`, so srun's options and the command stay apart
    assert options and all(o.startswith("--") and "=" in o for o in options), options

    store = FolderStore(folder)
    Study(store, "slurm", objective="study_objectives:quadratic_slowly", space=X, trials=6, patience=2)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "srun").chmod(0o755)
    env = dict(env, PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", SOMATIZE_PYTHON=sys.executable)
    env.update(SOMATIZE_STORE=str(folder), SOMATIZE_STUDY="slurm")
    tasks = [
        processes(["bash", str(SBATCH)], env=dict(env, SLURM_ARRAY_TASK_ID=str(i)), announce=None) for i in range(2)
    ]
    for task in tasks:
        assert finished(task) == 0, task.stderr()
    results = counted(store, "slurm")
    assert len(results) == 6 and all(r["state"] == "done" for r in results.values())

    # without a study to run, a task says what to set
    env.pop("SOMATIZE_STUDY")
    done = subprocess.run(["bash", str(SBATCH)], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode != 0 and "SOMATIZE_STUDY" in done.stderr


# -- in one process ---------------------------------------------------------------------


class CountingStore:
    """A real FolderStore, with every call counted."""

    def __init__(self, inner: FolderStore) -> None:
        self.inner = inner
        self.calls: dict[str, int] = {}
        self.scanned: list[str] = []

    def _count(self, verb: str) -> None:
        self.calls[verb] = self.calls.get(verb, 0) + 1

    def put(self, name, record, blob=None):
        self._count("put")
        return self.inner.put(name, record, blob)

    def scan(self, prefix):
        self._count("scan")
        self.scanned.append(prefix)
        return self.inner.scan(prefix)

    def fetch(self, name):
        self._count("fetch")
        return self.inner.fetch(name)

    def create(self, name, record, blob=None, *, durable=True):
        self._count("create")
        return self.inner.create(name, record, blob, durable=durable)

    def stamp(self, name):
        self._count("stamp")
        return self.inner.stamp(name)


def test_an_attempt_nobody_writes_is_taken_over_then_the_trial_fails_past_attempts(folder):
    store = FolderStore(folder)
    # a ghost: an attempt claimed by a runner that never wrote again
    ghost = {
        "trial": "0",
        "attempt": "0",
        "config": json.dumps({"x": 1.5}),
        "state": "running",
        "score": "",
        "took_us": "0",
        "runner": "ghost",
        "error": "",
    }
    store.create("again/trial/000000.000", ghost)
    study = Study(store, "again", objective="study_objectives:quadratic", space=X, trials=1, attempts=2, patience=0.3)
    assert study.run(runner="here") == {"done": 1, "failed": 0, "pruned": 0, "superseded": 0}
    first, second = attempts(store, "again")[0]
    assert second["runner"] == "here" and second["state"] == "done" and second["config"] == first["config"]
    assert float(second["score"]) == pytest.approx(0.25)
    # the judge said so in its own entry, and compared stamps: its entry is newer by patience
    assert store.stamp("again/judge/here") - store.stamp("again/trial/000000.000") > 0.3e9

    store.create("once/trial/000000.000", dict(ghost, config=json.dumps({"x": 0.5})))
    study = Study(store, "once", objective="study_objectives:quadratic", space=X, trials=1, attempts=1, patience=0.3)
    assert study.run(runner="here") == {"done": 0, "failed": 0, "pruned": 0, "superseded": 0}
    gave_up = attempts(store, "once")[0]
    assert [r["state"] for r in gave_up] == ["running", "failed"]
    assert gave_up[1]["error"].startswith("abandoned 1 time:") and gave_up[1]["attempt"] == "1"


def test_a_study_written_with_a_folder_per_trial_is_read_and_run_on(folder):
    """Studies written before December 2026 keep each trial's attempts in a folder of their
    own (`trial/<n>/<attempt>`); this version writes one file per attempt in the trial folder
    (`trial/<n>.<attempt>`), and reads both: such a study's finished trials count, its dead
    runner's trial is taken over (the next attempt in the new form), the rest run, and every
    reader agrees."""
    from somatize import record

    store = FolderStore(folder)
    Study(store, "older", objective="study_objectives:quadratic", space=X, trials=3, attempts=2, patience=0.3)
    base = {"config": json.dumps({"x": 1.5}), "took_us": "5", "error": ""}
    store.put(
        older_attempt_name("older", 0, 0),
        {**base, "trial": "0", "attempt": "0", "state": "done", "score": "0.25", "runner": "before"},
    )
    store.put(
        older_attempt_name("older", 1, 0),
        {**base, "trial": "1", "attempt": "0", "state": "running", "score": "", "runner": "gone"},
    )
    study = Study.open(store, "older")
    assert study.run(runner="here") == {"done": 2, "failed": 0, "pruned": 0, "superseded": 0}
    made = sorted(name for name in store.names("older/trial/"))
    assert made == [
        "older/trial/000000/000",
        "older/trial/000001.001",
        "older/trial/000001/000",
        "older/trial/000002.000",
    ]
    rows = {row["trial"]: row for row in record.trials(store, study="older")}
    assert {n: (row["state"], row["attempts"], row["runner"]) for n, row in rows.items()} == {
        0: ("done", 1, "before"),
        1: ("done", 2, "here"),
        2: ("done", 1, "here"),
    }
    assert [t.number for t in History.scan(store, "older")] == [0, 1, 2]
    assert [a.attempt for a in read_trial(store, "older", 1, older=True).attempts] == [0, 1]
    # one attempt in both forms: the one a runner writes now counts
    store.put(older_attempt_name("older", 2, 0), {**base, "trial": "2", "attempt": "0", "state": "failed"})
    assert record.trials(store, study="older")[2]["state"] == "done"
    assert History.scan(store, "older").trials[2].last.state == "done"


def test_a_history_of_a_thousand_trials_is_rebuilt_with_one_scan_and_no_fetch(folder):
    store = FolderStore(folder)
    Study(store, "big", objective="study_objectives:quadratic", space=X, trials=1001, sampler="random")
    for n in range(1000):
        x = -5.0 + n / 100
        store.put(
            f"big/trial/{n:06d}.000",
            {
                "trial": str(n),
                "attempt": "0",
                "config": json.dumps({"x": x}),
                "state": "done",
                "score": repr((x - 2.0) ** 2),
                "took_us": "10",
                "runner": "elsewhere",
                "error": "",
            },
            b'{"fact": "said"}\n',
        )
    counting = CountingStore(store)
    study = Study.open(counting, "big")
    counting.calls.clear()
    rebuilt = study.optuna()
    assert counting.calls == {"scan": 1}
    assert len(rebuilt.trials) == 1000 and rebuilt.best_value == pytest.approx(0.0)
    assert rebuilt.best_params == {"x": pytest.approx(2.0)}

    # a runner reads the whole study once as it starts; then only trial 1000's names (to
    # see it free: what it writes there it knows); and the whole study once more to end
    counting.calls.clear()
    counting.scanned.clear()
    assert study.run(runner="here") == {"done": 1, "failed": 0, "pruned": 0, "superseded": 0}
    assert counting.scanned == ["big/trial/", "big/trial/001000.", "big/trial/"]
    assert "fetch" not in counting.calls and counting.calls["create"] == 1
    assert counted(store, "big")[1000]["runner"] == "here"


class ListingStore(FolderStore):
    """A FolderStore whose scans and listings are counted (it is one: a runner lists only a
    FolderStore's names)."""

    def __init__(self, path) -> None:
        super().__init__(path)
        self.calls: dict[str, int] = {}
        self.scanned: list[str] = []
        self.read: list[str] = []  # names read one by one (`scan_names`)

    def scan(self, prefix):
        self.calls["scan"] = self.calls.get("scan", 0) + 1
        self.scanned.append(prefix)
        return super().scan(prefix)

    def scan_names(self, names):
        names = list(names)
        self.read += names
        return super().scan_names(names)

    def names(self, prefix):
        self.calls["names"] = self.calls.get("names", 0) + 1
        return super().names(prefix)


def test_the_last_look_lists_the_study_and_reads_only_what_moved(folder):
    """Before a runner says a study is over it looks at the whole study once more: from the
    listing alone where the store lists names, reading again only a trial whose highest
    attempt is not the one it read. Here trial 0 was taken over (attempt 1, by a runner that
    then went silent) after this runner read it finished: the last look finds it, and the
    runner takes it over in turn."""
    store = FolderStore(folder)
    Study(
        store,
        "late",
        objective="study_objectives:overtakes_the_first_trial",
        space=X,
        trials=3,
        sampler="random",
        patience=0.3,
    )
    for n in range(2):
        store.put(
            f"late/trial/{n:06d}.000",
            {"trial": str(n), "attempt": "0", "config": json.dumps({"x": 1.0}), "state": "done", "score": "1.0"},
        )
    counting = ListingStore(folder)
    assert Study.open(counting, "late").run(runner="here") == {"done": 2, "failed": 0, "pruned": 0, "superseded": 0}
    assert [(r["state"], r.get("runner")) for r in attempts(store, "late")[0]] == [
        ("done", None),
        ("running", "elsewhere"),
        ("done", "here"),
    ]
    assert counting.scanned.count("late/trial/") == 1  # read whole once, as it started
    assert "late/trial/000000.001" in counting.read  # and again only the trial that moved
    assert counting.calls["names"] == 2  # a last look before each time it would have ended


def test_a_different_definition_under_the_same_name_is_refused(folder):
    store = FolderStore(folder)
    first = Study(store, "sweep", objective="study_objectives:quadratic", space=X, trials=5)
    again = Study(store, "sweep", objective=study_objectives.quadratic, space=dict(X), trials=5)
    assert again.objective == first.objective == "study_objectives:quadratic"
    assert Study.open(store, "sweep").trials == 5
    with pytest.raises(StudyMismatch) as refused:
        Study(
            store,
            "sweep",
            objective="study_objectives:quadratic",
            trials=6,
            sampler="random",
            space={"x": FloatDistribution(-1.0, 1.0), "y": IntDistribution(0, 3)},
        )
    text = str(refused.value)
    assert "'sweep'" in text and "Study.open(store, 'sweep')" in text
    assert "trials is 5 there and 6 here" in text and "sampler is 'tpe' there and 'random' here" in text
    assert "space['x']" in text and "space has 'y' here and not there" in text
    assert isinstance(refused.value, SomatizeError)
    with pytest.raises(Missing, match="no study 'nothing'"):
        Study.open(store, "nothing")


def test_an_objective_without_an_import_name_is_refused_with_the_fix(folder):
    store = FolderStore(folder)
    with pytest.raises(TypeError, match="has no import name.*myproject.train:objective"):
        Study(store, "l", objective=lambda trial: 0.0, space=X)

    def inner(trial):
        return 0.0

    with pytest.raises(TypeError, match="has no import name"):
        Study(store, "l", objective=inner, space=X)
    inner.__qualname__ = "inner"
    inner.__module__ = "__main__"
    with pytest.raises(TypeError, match="defined in __main__"):
        Study(store, "l", objective=inner, space=X)
    with pytest.raises(ValueError, match="not an import name"):
        Study(store, "l", objective="study_objectives.quadratic", space=X)
    assert not list(store.scan("l/"))  # nothing was written


def test_bad_arguments_are_refused_before_anything_is_written(folder):
    store = FolderStore(folder)
    good = dict(objective="study_objectives:quadratic", space=X)
    for bad, match in [
        (dict(trials=0), "trials="),
        (dict(sampler="annealing"), "sampler= is one of"),
        (dict(direction="up"), "direction="),
        (dict(patience=0), "patience="),
        (dict(pruner="sometimes"), "pruner= is one of"),
        (dict(space={"x": (0, 1)}), "Optuna distribution"),
        (dict(sampler="grid"), "has no finite set of values"),
    ]:
        with pytest.raises((TypeError, ValueError), match=match):
            Study(store, "bad", **{**good, **bad})
    for name in ("run", "a/b", ""):
        with pytest.raises(ValueError, match="study"):
            Study(store, name, **good)
    with pytest.raises(TypeError, match="create and stamp"):
        Study(object(), "bad", **good)
    assert not list(store.scan(""))


def test_a_failing_objective_is_failed_and_not_retried(folder):
    store = FolderStore(folder)
    study = Study(store, "boom", objective="study_objectives:boom", space=X, trials=3, attempts=3)
    assert study.run(runner="here") == {"done": 0, "failed": 3, "pruned": 0, "superseded": 0}
    trials = attempts(store, "boom")
    assert all(len(records) == 1 for records in trials.values())
    for records in trials.values():
        assert records[0]["state"] == "failed" and records[0]["score"] == ""
        assert "ValueError: no good at x=" in records[0]["error"]
        assert "Traceback" in records[0]["error"]

    odd = Study(store, "odd", objective="study_objectives:not_a_number", space=X, trials=1)
    odd.run()
    assert "returned a `str`, not a number" in counted(store, "odd")[0]["error"]


def test_a_pruner_stops_trials_on_what_they_say(folder):
    store = FolderStore(folder)
    study = Study(
        store,
        "pruned",
        objective="study_objectives:with_curve",
        space={"x": FloatDistribution(0.0, 1.0)},
        trials=12,
        sampler="random",
        pruner="median",
    )
    counts = study.run()
    assert counts["pruned"] > 0 and counts["done"] > 0 and counts["done"] + counts["pruned"] == 12
    for record in counted(store, "pruned").values():
        steps = json.loads(record["intermediate"])
        if record["state"] == "pruned":
            assert len(steps) < 5 and record["score"] == ""
        else:
            assert len(steps) == 5 and record["said.step"] == "4"
    rebuilt = study.optuna()
    assert sum(t.state == optuna.trial.TrialState.PRUNED for t in rebuilt.trials) == counts["pruned"]


@pytest.mark.parametrize("sampler", ["grid", "bruteforce", "qmc", "random", "tpe", "cmaes"])
def test_each_sampler_rebuilt_from_the_folder_proposes_new_points(folder, sampler):
    store = FolderStore(folder)
    if sampler in ("grid", "bruteforce"):  # ten trials cover the ten points, each once
        space = {"x": IntDistribution(-2, 2), "kind": CategoricalDistribution(["a", "b"])}
    else:  # a sampler rebuilt each time must not propose its first draw again
        space = {"x": FloatDistribution(-2, 2), "kind": CategoricalDistribution(["a", "b"])}
    study = Study(store, sampler, objective="study_objectives:with_curve_of_x", space=space, trials=10, sampler=sampler)
    study.run()
    configs = [r["config"] for r in counted(store, sampler).values()]
    assert len(configs) == 10 and len(set(configs)) == 10


@pytest.mark.pure
def test_a_random_sampler_seeded_anew_proposes_what_a_fresh_one_would():
    """A runner reseeds its random sampler for each trial instead of making one (numpy's
    entropy draw): trial n must get the very configuration a fresh sampler gives it, or two
    runners (one fresh, one not) would draw differently for the same study."""
    from somatize.study.definition import Definition
    from somatize.study.mirror import Mirror

    space = {
        "x": FloatDistribution(-2, 2),
        "n": IntDistribution(1, 9, log=True),
        "k": CategoricalDistribution(["a", "b"]),
    }
    definition = Definition.checked(
        objective="study_objectives:with_curve_of_x", space=space, trials=30, sampler="random",
        seed=3, attempts=3, direction="minimize", patience=10.0, pruner=None,
    )  # fmt: skip
    reused = Mirror(definition, "s", [])
    proposed = []
    for number in range(30):
        otrial = reused.ask(number)
        fresh = Mirror(definition, "s", [])
        fresh.study.sampler = definition.sampler_for(number)
        assert otrial.params == fresh.study.ask(definition.space).params, f"trial {number}"
        proposed.append(tuple(sorted(otrial.params.items())))
    assert len(set(proposed)) == 30  # and each trial its own draw
    sampler = reused.study.sampler
    assert definition.sampler_for(31, reuse=sampler) is sampler  # reseeded, not made
    tpe = dataclasses.replace(definition, sampler="tpe")
    first = tpe.sampler_for(0)
    assert tpe.sampler_for(1, reuse=first) is not first  # TPE keeps more than its seed: made afresh


def test_watch_says_how_far_a_study_is_until_it_ends(folder, start):
    """A runner said nothing about how far the study was, and nothing else could, live."""
    store = FolderStore(folder)
    Study(store, "watched", objective="study_objectives:quadratic_slowly", space=X, trials=10, sampler="random")
    runner = start("watched", "a")
    watching = subprocess.run(
        [sys.executable, "-m", "somatize", "study", "--store", str(folder), "watched", "--watch", "0.1"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env_with_tests(),
    )
    assert finished(runner) == 0, runner.stderr()
    assert watching.returncode == 0, watching.stderr
    said = watching.stdout.splitlines()
    assert all(line.startswith("study 'watched': ") for line in said)
    best = min((r for r in counted(store, "watched").values()), key=lambda r: float(r["score"]))
    assert (
        said[-1]
        == f"study 'watched': 10/10 finished (10 done); best {float(best['score']):.6g} (trial {best['trial']})"
    )
    counts = [int(re.match(r"study 'watched': (\d+)/10", line).group(1)) for line in said]
    assert counts == sorted(counts)  # never backwards
    assert study_main(["--store", str(folder), "watched", "--watch", "0"]) == 2


def test_watch_on_a_terminal_draws_one_line_in_place(tmp_path):
    import io

    from somatize.study.watching import Seen, line, watch

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    seen = Seen(40, {"done": 10, "failed": 2, "running": 3}, (0.0123, 7))
    assert line("tune", seen, 2.1) == (
        "study 'tune': 12/40 finished (10 done, 2 failed), 3 running; "
        "best 0.0123 (trial 7); 2.1 trials/s, about 13 s left"
    )
    assert line("tune", seen, None).endswith("; time left not known yet")
    store = FolderStore(tmp_path / "ended")
    study = Study(store, "ended", objective="study_objectives:quadratic", space=X, trials=3, sampler="random")
    study.run()
    screen = Terminal()
    assert watch(study, every=0.05, out=screen).finished == 3
    drawn = screen.getvalue()
    assert "study 'ended': 3/3 finished (3 done)" in drawn and "\r" in drawn  # drawn in place, by tqdm


@pytest.mark.pure
def test_watch_says_which_runner_went_silent_and_when_its_trial_is_taken_over():
    """A running trial whose record's stamp stops moving for half the patience has its
    runner said silent, timed by the watch's own clock from when it first saw that stamp
    (never another machine's clock against it), with the time left until its takeover."""
    from somatize.study.watching import Seen, Stamps, line

    stamps = Stamps()
    look = lambda stamp: Seen(4, {"done": 1, "running": 2}, None, ((0, 0, stamp), (3, 1, 500)))  # noqa: E731
    assert stamps.silent(look(100), patience=10, now=1000.0) == []  # first seen: nothing known yet
    assert stamps.silent(look(100), patience=10, now=1004.0) == []  # quiet 4 s: within its writes
    again = stamps.silent(look(200), patience=10, now=1006.0)  # trial 0 wrote: its silence starts again
    assert [(s.trial, s.quiet) for s in again] == [(3, 6.0)]  # trial 3's did not: silent past half
    silent = stamps.silent(look(200), patience=10, now=1007.0)
    assert [(s.trial, s.attempt, s.quiet, s.left) for s in silent] == [(3, 1, 7.0, 3.0)]
    said = line("tune", look(200), None, silent)
    assert "; trial 3 attempt 1: its runner silent for 7 s, taken over in about 3 s" in said
    late = stamps.silent(look(200), patience=10, now=1012.0)
    assert "trial 3 attempt 1: its runner silent for 12 s, taken over at a runner's next look" in line(
        "tune", look(200), None, late
    )
    assert [s.trial for s in late] == [0, 3]


def test_show_prints_the_trials(folder, capsys):
    store = FolderStore(folder)
    study = Study(store, "shown", objective="study_objectives:quadratic", space=X, trials=3, sampler="random")
    study.run()
    assert study_main(["--store", str(folder), "shown", "--show"]) == 0
    shown = capsys.readouterr().out
    assert shown.startswith("study 'shown': 3 trials (3 done); best ")
    assert shown == table(study) + "\n"
    rows = shown.splitlines()[2:]
    assert [row.split()[:3] for row in rows] == [[str(n), "done", "1"] for n in range(3)]

    assert study_main(["--store", str(folder), "missing"]) == 2
    assert "There is no study 'missing'" in capsys.readouterr().err
    assert study_main(["--store", str(folder / "nowhere"), "shown"]) == 2
    assert "there is no folder" in capsys.readouterr().err
    Study(store, "elsewhere", objective="not_installed_here.train:objective", space=X, trials=1)
    assert study_main(["--store", str(folder), "elsewhere"]) == 2
    assert "cannot be imported here" in capsys.readouterr().err
    assert not list(store.scan("elsewhere/trial/"))  # nothing claimed
    done = subprocess.run(
        [sys.executable, "-m", "somatize", "study", "--store", str(folder), "shown", "--show"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env_with_tests(),
    )
    assert done.returncode == 0 and done.stdout == shown


def test_a_runner_leaves_its_start_up_heap_to_the_collector_once_and_still_frees_what_trials_make(
    folder, start, tmp_path
):
    """The runner command freezes what it holds before its first trial (`gc.freeze`): the
    cyclic collector skips those objects in every collection after, its last one at exit
    included. What the trials make is not frozen: the count stays the same from trial to
    trial, and a cycle each trial leaves behind is still freed, its finalizer run, by the
    time the runner has exited."""
    store = FolderStore(folder)
    Study(store, "frozen", objective="study_objectives:counts_the_frozen_heap", space=X, trials=3)
    runner = start("frozen", "a")
    assert finished(runner) == 0, runner.stderr()

    lines = (tmp_path / "log.txt").read_text().splitlines()
    frozen = {int(line.split()[1]): int(line.split()[2]) for line in lines if line.startswith("frozen ")}
    assert sorted(frozen) == [0, 1, 2]
    assert len(set(frozen.values())) == 1, frozen  # nothing a trial made was frozen
    assert frozen[0] > 10_000  # Python's, NumPy's and Optuna's objects, the study's
    assert sorted(line for line in lines if line.startswith("finalized ")) == [f"finalized {n}" for n in range(3)]


def test_a_running_trial_written_again_is_read_but_is_no_reason_to_look_sooner(folder):
    """`Known.refresh` takes every record that changed, and says only whether a trial moved
    on (ended, was stopped, taken over): a runner with nothing to claim goes back to its
    shortest wait for that, not each time another's running trial says a value."""
    from somatize.study.known import Known

    store = FolderStore(folder)
    Study(store, "busy", objective="study_objectives:quadratic", space=X, trials=1)
    running = {"trial": "0", "attempt": "0", "config": json.dumps({"x": 1.0}), "state": "running", "runner": "r"}
    store.put("busy/trial/000000.000", running)
    known = Known(store, "busy", 1)
    known.rescan()
    assert known.open()[0].state == "running"
    store.put("busy/trial/000000.000", {**running, "intermediate": "[[1, 0.5]]"})  # a value said
    assert known.refresh() is False
    assert known.open()[0].last.checked.intermediate == [(1, 0.5)]  # read all the same
    store.put("busy/trial/000000.000", {**running, "state": "done", "score": "1.0"})
    assert known.refresh() is True and known.finished()


def test_a_trial_is_read_by_its_attempts_names_however_many_a_writer_lines_up(folder):
    """One trial is read by name, attempt 0 to the give-up record's (attempt `attempts`), and
    on past it only while the next is there, at most a hundred past it: a writer who lines
    up a thousand attempts' names costs a read a bounded number of opens."""
    store = ListingStore(folder)
    running = {"trial": "0", "config": json.dumps({"x": 1.0}), "state": "abandoned", "runner": "w"}
    for attempt in range(1000):
        store.put(attempt_name("lined", 0, attempt), {**running, "attempt": str(attempt)})
    read = read_trial(store, "lined", 0, attempts=3)
    assert [a.attempt for a in read.attempts] == list(range(104))
    assert len(store.read) == 104 and "scan" not in store.calls  # by name, nothing listed
    store.read.clear()
    assert read_trial(store, "lined", 1, attempts=3) is None and len(store.read) == 4
