"""A writer of a shared folder (issue 19, item 6: "shared folders are data, never code, never links").

The runbook makes a study's store writable by a group, so everyone in it may write any record
there. Each test plays such a writer for real: `nobody` (with `setpriv`), in a store folder
opened to others, writes with nothing but the standard library (store files by hand, links,
a FIFO). Then a real runner (`python -m somatize study`, as this user) and the readers meet
what it left. What `nobody` may do is write records others read; what it must never do is
run code in a runner (nothing read from a record reaches pickle), make a runner or a reader
follow a link, or stop one with a malformed record.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from contextlib import nullcontext
from pathlib import Path

import pytest

optuna = pytest.importorskip("optuna", reason="studies need Optuna: pip install 'somatize[study]'")

from conftest import SETPRIV, env_with_tests  # noqa: E402
from optuna.distributions import FloatDistribution  # noqa: E402

from somatize import FolderStore, folders  # noqa: E402
from somatize.errors import Missing, StoreError  # noqa: E402
from somatize.record import best, trials  # noqa: E402
from somatize.record.studies import scored  # noqa: E402
from somatize.study import Study  # noqa: E402

X = {"x": FloatDistribution(-5.0, 5.0)}

# The writer: the store's file format by hand (header, CRC, record), written to a temp file
# and renamed into place as a runner would; links and FIFOs as `nobody` makes them.
WRITER = r"""
import json, os, sys, zlib
for op, path, *rest in json.loads(sys.stdin.read()):
    if op == "record":
        data = (json.dumps(rest[0], sort_keys=True) + "\n").encode()
        head = b"SMZS1 %08x ---------------- " % len(data)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".planting", "wb") as file:
            file.write(head + b"%08x\n" % zlib.crc32(data, zlib.crc32(head)) + data)
        os.replace(path + ".planting", path)
    elif op == "raw":
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as file:
            file.write(bytes.fromhex(rest[0]))
    elif op == "link":
        os.makedirs(os.path.dirname(path), exist_ok=True)
        os.symlink(rest[0], path)
    elif op == "fifo":
        os.makedirs(os.path.dirname(path), exist_ok=True)
        os.mkfifo(path)
print("planted")
"""


class Gadget:
    """A pickle that creates a file when it is loaded."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.fixture
def shared():
    """A store folder others may enter, whose study folders `open_to_others` opens to writing."""
    base = Path(tempfile.mkdtemp(prefix="somatize-shared-"))
    base.chmod(0o755)
    yield base / "store"
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def plant(python_for_nobody):
    """Run the writer as `nobody` with a list of operations."""

    def run(*ops) -> None:
        done = subprocess.run(
            [*SETPRIV, python_for_nobody, "-c", WRITER],
            input=json.dumps(ops),
            capture_output=True,
            text=True,
            cwd="/",
            timeout=30,
        )
        assert done.returncode == 0 and done.stdout == "planted\n", done.stderr

    return run


def open_to_others(store: FolderStore, study: str) -> None:
    """What a group-writable store gives everyone in the group: write in the study's folders."""
    (store.path / study / "trial").mkdir(parents=True, exist_ok=True)
    for folder in (store.path, store.path / study, store.path / study / "trial"):
        folder.chmod(0o777)


def runner(store: FolderStore, study: str, *extra: str) -> subprocess.CompletedProcess:
    """A real runner, to its end: every trial finished, or an error."""
    return subprocess.run(
        [sys.executable, "-m", "somatize", "study", "--store", str(store.path), study, *extra],
        capture_output=True,
        text=True,
        timeout=120,
        env=env_with_tests(),
    )


def attempt_record(x: float, **fields: str) -> dict[str, str]:
    record = {
        "trial": "0",
        "attempt": "0",
        "config": json.dumps({"x": x}),
        "state": "done",
        "score": repr((x - 2.0) ** 2),
        "took_us": "5",
        "runner": "nobody",
        "error": "",
        "facts": "0",
    }
    record.update(fields)
    return record


def written(store: FolderStore, study: str) -> list[dict[str, str]]:
    return [record for _, record in store.scan(f"{study}/trial/")]


# -- no record reaches pickle -------------------------------------------------------------------


def test_a_pickle_planted_in_a_trials_record_never_runs_in_a_runner(shared, plant, tmp_path):
    """Attack: a record whose sampler notes hold CMA-ES's pickled optimizer (a gadget), and the
    study's definition switched to `cmaes` by the same writer. Optuna's CMA-ES loads that pickle
    in every runner that rebuilds the history, as the runner's user. Now CMA-ES's state is rebuilt
    from the trials, the notes a record holds never carry a pickle, and a runner asked for
    another sampler refuses the switched definition."""
    store = FolderStore(shared)
    study = Study(store, "cma", objective="study_objectives:quadratic", space=X, trials=4, sampler="tpe")
    open_to_others(store, "cma")
    sentinel = tmp_path / "pwned-by-nobody"  # a folder only this user may write in
    gadget = pickle.dumps(Gadget(str(sentinel))).hex()
    switched = {**{k: v for k, v in study._definition.record().items()}, "sampler": "cmaes"}
    planted = attempt_record(
        1.0, sampler_attrs=json.dumps({"trial": {"cma:optimizer:0": gadget, "cma:generation": 0}, "study": {}})
    )
    plant(
        ["record", str(store.path / "cma" / "study.rec"), switched],
        ["record", str(store.path / "cma" / "trial" / "000000.000.rec"), planted],
    )

    ran = runner(store, "cma")  # a runner that takes the definition as it is: CMA-ES
    assert not sentinel.exists()
    assert ran.returncode == 0, ran.stderr
    records = written(store, "cma")
    assert len(records) == 4 and all(r["state"] == "done" for r in records)
    assert not any("optimizer" in r.get("sampler_attrs", "") for r in records[1:])
    assert all("cma:generation" in json.loads(r["sampler_attrs"])["trial"] for r in records[1:])

    # a runner asked for the sampler the study was made with refuses the switched definition
    more = {**switched, "trials": "5"}
    plant(["record", str(store.path / "cma" / "study.rec"), more])
    asked = runner(store, "cma", "--sampler", "tpe")
    assert asked.returncode == 2 and "sampler is 'cmaes' there and 'tpe' here" in asked.stderr
    assert len(written(store, "cma")) == 4  # nothing claimed


def test_cmaes_rebuilt_from_the_trials_moves_through_its_generations(tmp_path):
    """The CMA-ES a runner rebuilds from the records alone (no pickle kept anywhere) still
    learns: each generation is told again from the trials it tried, so later trials belong to
    later generations, as with Optuna's own CMA-ES in one process."""
    store = FolderStore(tmp_path / "store")
    study = Study(store, "gens", objective="study_objectives:quadratic", space=X, trials=14, sampler="cmaes")
    assert study.run()["done"] == 14
    records = written(store, "gens")
    assert not any("optimizer" in r.get("sampler_attrs", "") for r in records)
    generations = [json.loads(r["sampler_attrs"])["trial"].get("cma:generation") for r in records[1:]]
    assert generations == sorted(generations) and generations[-1] >= 2, generations


# -- no link is followed ------------------------------------------------------------------------


def test_a_link_planted_in_a_study_folder_is_never_followed(shared, plant, tmp_path):
    """Attack: a trial's first attempt (`trial/000000.000`) made a link to a file only the
    runner's user may write (when a trial was a folder, `trial/000000` a link to such a
    folder: the runner wrote its record there). Now every name is opened from the store's
    root without following a link: the runner says so in one line, leaves that trial alone and
    runs the others; the readers and `--show` leave the link out."""
    store = FolderStore(shared)
    Study(store, "linked", objective="study_objectives:quadratic", space=X, trials=3, sampler="random")
    open_to_others(store, "linked")
    secret = tmp_path / "root-only"
    secret.mkdir(mode=0o700)
    (secret / "000.rec").write_bytes((store.path / "linked" / "study.rec").read_bytes())  # looks like an entry
    trial = store.path / "linked" / "trial"
    before = (secret / "000.rec").read_bytes()
    plant(
        ["link", str(trial / "000000.000.rec"), str(secret / "000.rec")],
        ["link", str(trial / "000001.000.rec"), str(secret / "000.rec")],
    )

    ran = runner(store, "linked")
    assert ran.returncode == 0, ran.stderr
    assert sorted(p.name for p in secret.iterdir()) == ["000.rec"]  # nothing written through the link
    assert (secret / "000.rec").read_bytes() == before
    for name in ("trial/000000.000.rec", "trial/000001.000.rec"):
        told = [
            line
            for line in ran.stderr.splitlines()
            if line.endswith(
                f"/linked/{name} is a symbolic link, "
                "and a store never follows links; someone who may write this folder made it: remove it, "
                "and check who else may write there; it is left out."
            )
        ]
        assert len(told) == 1, ran.stderr  # once, however often the runner scanned
    assert [row["trial"] for row in trials(store, "linked")] == [2]
    shown = runner(store, "linked", "--show")
    assert shown.returncode == 0 and "study 'linked': 3 trials (1 done)" in shown.stdout


def test_the_store_opens_no_name_through_a_link(tmp_path, capfd):
    store = FolderStore(tmp_path / "store")
    store.put("run/a/0", {"v": "0"}, b"blob")
    elsewhere = FolderStore(tmp_path / "elsewhere")
    elsewhere.put("b/0", {"v": "theirs"}, b"secret")
    os.symlink(elsewhere.path / "b", store.path / "run" / "b")  # a folder link below the root
    os.symlink(elsewhere.path / "b" / "0.rec", store.path / "run" / "a" / "1.rec")  # an entry link
    os.symlink(elsewhere.path, store.path / "other")  # a link straight under the root
    folders.forget_told()

    assert list(store.scan("")) == [("run/a/0", {"v": "0"})]
    assert list(store.scan("run/b/")) == [] and list(store.scan("other/")) == []
    for name in ("run/b/0", "run/a/1", "other/b/0"):
        for read in (store.record, store.fetch, store.stamp):
            with pytest.raises(Missing, match="is a symbolic link"):
                read(name)
        assert name not in store
        with pytest.raises(StoreError, match="is a symbolic link") if name != "run/a/1" else nullcontext():
            store.put(name, {"v": "mine"})
    store.delete("other/b/0")
    assert elsewhere.entry("b/0") == ({"v": "theirs"}, b"secret")  # never written, never removed
    assert store.record("run/a/1") == {"v": "mine"}  # a put replaces a link itself: a file now
    assert not os.path.islink(store.path / "run" / "a" / "1.rec")
    err = capfd.readouterr().err.splitlines()
    assert len(err) == len(set(err)) == 3, err  # one line per link met, each once


# -- a malformed record stops nobody -----------------------------------------------------------


def test_malformed_records_are_left_out_and_stop_no_runner_and_no_reader(shared, plant):
    """Attack: one record with `config` nested 100,000 deep, `Infinity` as a step, a number
    where a map belongs, a score that is no number, a FIFO and a damaged file where entries
    belong: every runner stopped (RecursionError, OverflowError, TypeError), and so did
    `--show` and `somatize.record.trials`. Now each is left out with one line naming it."""
    store = FolderStore(shared)
    Study(store, "junk", objective="study_objectives:quadratic", space=X, trials=9, sampler="tpe")
    open_to_others(store, "junk")
    trial = store.path / "junk" / "trial"
    bad = {
        0: {"config": "[" * 100_000 + "]" * 100_000},
        1: {"intermediate": "[[Infinity, 1.0]]"},
        2: {"sampler_attrs": json.dumps({"trial": 5})},
        3: {"config": "5"},
        4: {"score": "lots"},
        5: {"intermediate": "[[1, 2.0]]", "sampler_attrs": '{"trial": ' + '{"a": ' * 100 + "0" + "}" * 101},
    }
    plant(
        *[["record", str(trial / f"{n:06d}.000.rec"), attempt_record(0.5, **fields)] for n, fields in bad.items()],
        ["fifo", str(trial / "000006.000.rec")],
        ["raw", str(trial / "000007.000.rec"), b"SMZS1 not a header at all".hex()],
    )

    ran = runner(store, "junk")
    assert ran.returncode == 0, ran.stderr
    for n in bad:
        assert ran.stderr.count(f"the record junk/trial/{n:06d}.000 is left out: ") == 1, ran.stderr
    assert ran.stderr.count("a scan leaves out 'junk/trial/000007.000'") == 1
    assert ran.stderr.count("junk/trial/000006.000.rec is not a regular file") == 1
    assert [r["trial"] for r in trials(store, "junk")] == [8]  # the one trial left to run
    assert best(store, "junk")["trial"] == 8 and scored(store, "junk", "here")[1][0]["trial"] == 8
    shown = runner(store, "junk", "--show")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("study 'junk': 9 trials (1 done, 6 failed)")


def test_show_prints_no_escape_sequence_a_record_holds(shared):
    """A runner's name or an error from the folder reached the terminal as written: an
    escape sequence there could clear a reader's screen or retitle the terminal."""
    store = FolderStore(shared)
    Study(store, "ansi", objective="study_objectives:quadratic", space=X, trials=1)
    store.put(
        "ansi/trial/000000.000",
        attempt_record(1.0, runner="\x1b]0;owned\x07r1\x1b[2J", state="failed", score="", error="boom\x1b[31m red"),
    )
    shown = runner(store, "ansi", "--show")
    assert shown.returncode == 0, shown.stderr
    assert "\x1b" not in shown.stdout and "\x07" not in shown.stdout
    assert "?]0;owned?r1?[2J" in shown.stdout and "boom?[31m red" in shown.stdout


def test_a_malformed_record_is_named_once_per_process(tmp_path, capfd):
    store = FolderStore(tmp_path / "store")
    Study(store, "tune", objective="study_objectives:quadratic", space=X, trials=2)
    store.put("tune/trial/000000.000", attempt_record(1.0))
    store.put("tune/trial/000001.000", attempt_record(1.0, score="lots"))
    folders.forget_told()
    for _ in range(3):
        assert [r["trial"] for r in trials(store, "tune")] == [0]
    err = capfd.readouterr().err
    assert err.count("tune/trial/000001.000 is left out: its score 'lots' is not a number") == 1, err
