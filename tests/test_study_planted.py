"""One planted name stops no study runner (issue 39, item 1, for the study folders).

The runbook makes a study's store writable by a group (and its members keep `umask 002`),
so anyone in it may put anything at any name a runner reads or writes: a file where the
`judge` folder belongs, a file where a trial's folder belongs, a folder, a link or a FIFO
where an attempt belongs. Each test plays that writer for real, as `nobody` (`setpriv`), in
a store opened to others (runners run with `umask 000` here, the group's `002` for a
writer who is not in the group), and then runs real runners (`python -m somatize study`),
`--watch` and `--show` as this user. Before, one such name made every runner exit 2 ("Not a
directory"), or go on for ever with the trial left `abandoned`, and `--watch` with it. Now
the name is blocked: a runner takes the next name, or counts the trial as blocked, finishes
the others and exits 0; `--watch` ends, and `--show` lists the blocked trial.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

optuna = pytest.importorskip("optuna", reason="studies need Optuna: pip install 'somatize[study]'")

from conftest import SETPRIV, env_with_tests  # noqa: E402
from optuna.distributions import FloatDistribution  # noqa: E402

from somatize import FolderStore  # noqa: E402
from somatize.record.studies import attempt_of  # noqa: E402
from somatize.study import Study  # noqa: E402

X = {"x": FloatDistribution(-5.0, 5.0)}
RUN_FOR = 60  # seconds a runner may take at most, under load; on main these ran for ever

# The writer, as `nobody`: the store's file format by hand (header, CRC, record), and the
# things no store writes: an empty file, a folder, links, a FIFO, a socket.
PLANTER = r"""
import json, os, socket, sys, zlib
for op, path, *rest in json.loads(sys.stdin.read()):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if op == "record":
        data = (json.dumps(rest[0], sort_keys=True) + "\n").encode()
        head = b"SMZS1 %08x ---------------- " % len(data)
        with open(path + ".planting", "wb") as file:
            file.write(head + b"%08x\n" % zlib.crc32(data, zlib.crc32(head)) + data)
        os.replace(path + ".planting", path)
        os.utime(path, ns=(0, 0))  # written long ago: stopped being written, by any stamp
    elif op == "file":
        open(path, "wb").close()
    elif op == "folder":
        os.mkdir(path)
    elif op == "rename":  # another's entry moved away (a folder open to the group allows it)
        os.rename(path, rest[0])
    elif op == "link":
        os.symlink(rest[0], path)
    elif op == "fifo":
        os.mkfifo(path)
    elif op == "socket":
        socket.socket(socket.AF_UNIX).bind(path)
print("planted")
"""

# What a writer may put at an attempt's name, as the planter makes it.
HOLDERS = {
    "link to nothing": ["link", "/nonexistent-somatize-target"],
    "link to a file": ["link", "/etc/hostname"],
    "link to a folder": ["link", "/tmp"],
    "FIFO": ["fifo"],
    "socket": ["socket"],
    "folder": ["folder"],
    "empty file": ["file"],
}


@pytest.fixture
def shared():
    """A store folder others may enter; `opened` opens a study's folders to writing."""
    base = Path(tempfile.mkdtemp(prefix="somatize-planted-"))
    base.chmod(0o755)
    yield base / "store"
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def plant(python_for_nobody):
    def run(*ops) -> None:
        done = subprocess.run(
            [*SETPRIV, python_for_nobody, "-c", PLANTER],
            input=json.dumps(ops),
            capture_output=True,
            text=True,
            cwd="/",
            timeout=30,
        )
        assert done.returncode == 0 and done.stdout == "planted\n", done.stderr

    return run


def opened(store: FolderStore, study: str) -> Path:
    """What a group-writable store gives everyone in the group: write in the study's folders."""
    trial = store.path / study / "trial"
    trial.mkdir(parents=True, exist_ok=True)
    for folder in (store.path, store.path / study, trial):
        folder.chmod(0o777)
    return store.path / study


def attempt_file(folder: Path, number: int, attempt: int) -> Path:
    """The file of attempt ``attempt`` of trial ``number`` in the study folder ``folder``."""
    return folder / "trial" / f"{number:06d}.{attempt:03d}.rec"


def command(store: FolderStore, study: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "somatize", "study", "--store", str(store.path), study, *extra]


def finish(store: FolderStore, study: str, *extra: str) -> subprocess.CompletedProcess:
    """A real runner (or `--watch`, `--show`), to its end; a failure if it runs for ever."""
    try:
        return subprocess.run(
            command(store, study, *extra),
            capture_output=True,
            text=True,
            timeout=RUN_FOR,
            env=env_with_tests(),
            preexec_fn=lambda: os.umask(0),
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(
            f"`{' '.join(command(store, study, *extra)[2:])}` was still running after {RUN_FOR} s "
            f"(stderr: {(exc.stderr or b'')[-600:]!r})"
        )


def attempt_record(number: int, attempt: int, state: str, x: float = 0.5) -> dict[str, str]:
    return {
        "trial": str(number),
        "attempt": str(attempt),
        "config": json.dumps({"x": x}),
        "state": state,
        "score": "",
        "took_us": "5",
        "runner": "gone",
        "error": "",
        "facts": "0",
    }


def counted(store: FolderStore, study: str) -> dict[int, tuple[int, dict[str, str]]]:
    """The attempt that counts for each trial (its highest readable one), and its record."""
    out: dict[int, tuple[int, dict[str, str]]] = {}
    for name, record in store.scan(f"{study}/trial/"):
        number, attempt, _ = attempt_of(name[len(f"{study}/trial/") :])
        if number not in out or attempt > out[number][0]:
            out[number] = (attempt, record)
    return out


def watched(store: FolderStore, study: str) -> str:
    """The last line `--watch` says; it must end by itself."""
    watch = finish(store, study, "--watch", "0.1")
    assert watch.returncode == 0, watch.stderr
    return watch.stdout.splitlines()[-1]


# -- the attacks -----------------------------------------------------------------------------


def test_a_file_at_the_judge_folder_stops_none_of_an_array_of_runners(shared, plant):
    """Attack: `touch <study>/judge`, with a trial whose runner died: every runner of a SLURM
    array exited 2 ("Cannot write 'judge-file/judge/...': Not a directory") the first time it
    judged. Now the judge takes another name, and the runners take the dead trial over and
    finish the study."""
    store = FolderStore(shared)
    Study(store, "judged", objective="study_objectives:quadratic", space=X, trials=6, sampler="random", patience=1.0)
    folder = opened(store, "judged")
    plant(
        ["record", str(attempt_file(folder, 0, 0)), attempt_record(0, 0, "running")],
        ["file", str(folder / "judge")],
    )

    runners = [
        subprocess.Popen(
            command(store, "judged"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env_with_tests(),
            preexec_fn=lambda: os.umask(0),
        )
        for _ in range(3)
    ]
    try:
        ended = [runner.communicate(timeout=RUN_FOR) for runner in runners]
    finally:
        for runner in runners:
            runner.kill()
            runner.wait()
    for runner, (_, err) in zip(runners, ended, strict=False):
        assert runner.returncode == 0, err
    results = counted(store, "judged")
    assert sorted(results) == list(range(6)) and all(record["state"] == "done" for _, record in results.values())
    assert results[0][0] == 1  # the dead runner's trial, taken over as attempt 1
    assert (folder / "judge").is_file()  # left as it was
    assert watched(store, "judged").startswith("study 'judged': 6/6 finished (6 done)")


def test_a_runner_waiting_for_a_dead_trial_with_its_judge_blocked_does_not_spin(shared, plant):
    """While it waits for a dead runner's trial to go unwritten for `patience`, a runner whose
    judge's name is blocked judges with another name at its usual pace, using next to no CPU."""
    store = FolderStore(shared)
    Study(store, "paced", objective="study_objectives:quadratic", space=X, trials=2, sampler="random", patience=6.0)
    folder = opened(store, "paced")
    plant(["file", str(folder / "judge")])
    # the dead runner's trial is written now (by the planter's clock and the store's: fresh)
    plant(["record", str(attempt_file(folder, 0, 0)), attempt_record(0, 0, "running")])
    os.utime(attempt_file(folder, 0, 0))

    runner = subprocess.Popen(
        command(store, "paced"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env_with_tests(),
        preexec_fn=lambda: os.umask(0),
    )
    try:
        lines, marks = [], []
        for line in runner.stdout:  # (a runner that stopped or hung ends the test by its timeout)
            lines.append(line)
            if line.startswith("trial 1 attempt 0: done") or "taking it over" in line:
                marks.append((time.monotonic(), cpu_seconds(runner.pid)))
            if len(marks) == 2:
                break
        _, err = runner.communicate(timeout=RUN_FOR)
    finally:
        runner.kill()
        runner.wait()
    assert runner.returncode == 0, err
    assert len(marks) == 2, "".join(lines)
    (began, cpu_began), (ended, cpu_ended) = marks
    assert ended - began > 1.0  # it did wait for the dead trial
    assert cpu_ended - cpu_began < 0.25 * (ended - began), (cpu_ended - cpu_began, ended - began)
    assert counted(store, "paced")[0][0] == 1


@pytest.mark.parametrize("held", ["file", "link", "folder"])
def test_something_at_a_trials_first_name_blocks_that_trial_alone(shared, plant, held):
    """Attack: a file no store wrote at `trial/000001.000` (or a link, or a folder): every
    runner exited 2 at the claim (when a trial was a folder, at `trial/000001`). Now that
    trial is blocked: the runner says so once, runs the others and exits 0; `--watch` ends and
    says it, `--show` lists it."""
    store = FolderStore(shared)
    Study(store, "held", objective="study_objectives:quadratic", space=X, trials=4, sampler="random")
    folder = opened(store, "held")
    plant(
        {
            "file": ["file", str(attempt_file(folder, 1, 0))],
            "link": ["link", str(attempt_file(folder, 1, 0)), "/tmp"],
            "folder": ["folder", str(attempt_file(folder, 1, 0))],
        }[held]
    )

    ran = finish(store, "held")
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.count("trial 1: blocked") == 1, ran.stdout
    assert "all 4 trials have finished or are blocked (1 blocked: trial 1)" in ran.stdout
    assert sorted(counted(store, "held")) == [0, 2, 3]
    assert watched(store, "held").startswith("study 'held': 3/4 finished (3 done), 1 blocked")
    shown = finish(store, "held", "--show")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("study 'held': 4 trials (3 done), 1 blocked")
    row = next(line for line in shown.stdout.splitlines() if line.split()[:2] == ["1", "blocked"])
    assert "something else holds its first attempt's name" in row


@pytest.mark.parametrize("holder", sorted(HOLDERS))
def test_an_abandoned_attempt_whose_next_name_is_held_is_taken_over_as_the_one_after(shared, plant, holder):
    """Attack: an `abandoned` attempt, and a link, a FIFO or a folder at its next attempt:
    runners and `--watch` went on for ever, the trial left `abandoned`. Now the name after
    stands in for the held one: the trial runs again as attempt 2, and everything ends."""
    store = FolderStore(shared)
    Study(store, "next", objective="study_objectives:quadratic", space=X, trials=3, sampler="random", attempts=3)
    folder = opened(store, "next")
    op, *rest = HOLDERS[holder]
    plant(
        ["record", str(attempt_file(folder, 1, 0)), attempt_record(1, 0, "abandoned", x=1.0)],
        [op, str(attempt_file(folder, 1, 1)), *rest],
    )

    ran = finish(store, "next")
    assert ran.returncode == 0, ran.stderr
    assert "trial 1: attempt 0 (runner gone) stopped writing; taking it over as attempt 2" in ran.stdout
    results = counted(store, "next")
    assert results[1][0] == 2 and results[1][1]["state"] == "done" and json.loads(results[1][1]["config"]) == {"x": 1.0}
    assert watched(store, "next").startswith("study 'next': 3/3 finished (3 done)")


def test_a_trial_whose_every_later_name_is_held_is_blocked_and_ends_everything(shared, plant):
    """Every name a runner could take a trial over with, up to the record that says it failed,
    held by something else: the trial is blocked, and runners, `--watch` and `--show` say so."""
    store = FolderStore(shared)
    Study(store, "stuck", objective="study_objectives:quadratic", space=X, trials=3, sampler="random", attempts=2)
    folder = opened(store, "stuck")
    plant(
        ["record", str(attempt_file(folder, 2, 0)), attempt_record(2, 0, "abandoned")],
        ["folder", str(attempt_file(folder, 2, 1))],
        ["fifo", str(attempt_file(folder, 2, 2))],
    )

    for _ in range(2):  # a second runner, started after, finds it as blocked as the first did
        ran = finish(store, "stuck")
        assert ran.returncode == 0, ran.stderr
        assert "trial 2: blocked (something else holds every attempt's name after attempt 0)" in ran.stdout
    assert counted(store, "stuck")[2][1]["state"] == "abandoned"
    assert watched(store, "stuck").startswith("study 'stuck': 2/3 finished (2 done), 1 blocked")
    shown = finish(store, "stuck", "--show")
    assert shown.returncode == 0 and shown.stdout.startswith("study 'stuck': 3 trials (2 done), 1 blocked"), shown
    assert any(line.split()[:3] == ["2", "blocked", "1"] for line in shown.stdout.splitlines()), shown.stdout


def test_a_folder_planted_at_a_running_attempts_fence_neither_stops_nor_traps_it(shared, plant, tmp_path):
    """Attack: a folder at the next attempt's name (`000000.001.rec`) of an attempt a live runner is
    running: the runner took it for a takeover, dropped its own result, and then could not
    take the trial over either (the name is held), and went on for ever. Now a held fence is
    no later attempt: the runner goes on, and its result counts."""
    store = FolderStore(shared)
    Study(store, "fenced", objective="test_study_planted:waits_for_go", space=X, trials=2, sampler="random")
    folder = opened(store, "fenced")
    ready, go = tmp_path / "ready", tmp_path / "go"
    env = {**env_with_tests(), "PLANTED_READY": str(ready), "PLANTED_GO": str(go)}
    runner = subprocess.Popen(
        command(store, "fenced"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=lambda: os.umask(0),
    )
    try:
        until = time.monotonic() + RUN_FOR
        while not ready.exists() and runner.poll() is None and time.monotonic() < until:
            time.sleep(0.02)
        assert ready.exists(), "the objective never started"
        plant(["folder", str(attempt_file(folder, 0, 1))])
        go.touch()
        out, err = runner.communicate(timeout=RUN_FOR)
    finally:
        runner.kill()
        runner.wait()
    assert runner.returncode == 0, err
    assert "trial 0 attempt 0: done" in out, out
    assert counted(store, "fenced")[0][1]["state"] == "done"
    assert watched(store, "fenced").startswith("study 'fenced': 2/2 finished (2 done)")


def test_a_folder_put_where_a_running_attempts_own_entry_was_stops_only_that_attempt(shared, plant, tmp_path):
    """Attack: a running attempt's own entry moved away and a folder put in its place: its
    next write raised out of the objective and out of the runner (exit 2). Now the attempt
    can no longer be written, so it stops as an overtaken one does; its trial reads as
    nothing, so it is blocked, and the runner finishes the others and exits 0."""
    store = FolderStore(shared)
    Study(store, "moved", objective="test_study_planted:waits_for_go", space=X, trials=2, sampler="random")
    folder = opened(store, "moved")
    ready, go = tmp_path / "ready", tmp_path / "go"
    env = {**env_with_tests(), "PLANTED_READY": str(ready), "PLANTED_GO": str(go)}
    runner = subprocess.Popen(
        command(store, "moved"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=lambda: os.umask(0),
    )
    try:
        until = time.monotonic() + RUN_FOR
        while not ready.exists() and runner.poll() is None and time.monotonic() < until:
            time.sleep(0.02)
        assert ready.exists(), "the objective never started"
        own = attempt_file(folder, 0, 0)
        plant(["rename", str(own), str(folder / "trial" / "elsewhere")], ["folder", str(own)])
        go.touch()
        out, err = runner.communicate(timeout=RUN_FOR)
    finally:
        runner.kill()
        runner.wait()
    assert runner.returncode == 0, err
    assert "trial 0 attempt 0: something else holds its name now, so it cannot be written" in out, out
    assert "trial 0: blocked" in out and "trial 1 attempt 0: done" in out, out
    assert own.is_dir() and not any(own.iterdir())  # nothing written into it
    assert watched(store, "moved").startswith("study 'moved': 1/2 finished (1 done), 1 blocked")


# -- helpers a runner imports ---------------------------------------------------------------


def waits_for_go(trial):
    """Trial 0 says it started, waits for the test's word, then says a value (a write, so it
    looks at its fence) and returns."""
    if trial.number == 0:
        Path(os.environ["PLANTED_READY"]).touch()
        until = time.monotonic() + RUN_FOR
        while not Path(os.environ["PLANTED_GO"]).exists() and time.monotonic() < until:
            time.sleep(0.02)
        trial.say(step=0, value=1.0)
    return float(trial.config["x"]) ** 2


def cpu_seconds(pid: int) -> float:
    """User and system CPU time the process ``pid`` has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_show_reads_a_took_that_is_a_digit_but_no_number(shared, plant):
    """A record whose `took_us` is "²" (a digit to `str.isdigit`, no number to `int`): `--show`
    exited 2. Now the time is left blank and the row shown."""
    store = FolderStore(shared)
    Study(store, "took", objective="study_objectives:quadratic", space=X, trials=1, sampler="random")
    record = {**attempt_record(0, 0, "done"), "score": "2.25", "took_us": "\u00b2"}
    plant(["record", str(attempt_file(opened(store, "took"), 0, 0)), record])
    shown = finish(store, "took", "--show")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("study 'took': 1 trials (1 done); best 2.25 (trial 0)"), shown.stdout
