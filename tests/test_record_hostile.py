"""Records that crash or swell the readers (issue 39, item 6: "readers that read data").

A writer of a shared store folder (played by `nobody`, with `setpriv`, writing the store's file
format by hand) plants one malformed forward, ``run/r/3``, and one malformed attempt,
``tune/trial/000002.000``, beside good ones: a blob line that is a list, JSON nested 100,000
deep, ``took_us="²"`` (which ``str.isdigit`` takes for a digit), a 384 MiB sparse blob that
holds 4 KiB on disk, bytes that are not UTF-8, JSON of the wrong types or non-finite numbers,
a record of megabytes. Every reader, and ``--show``, then reads the store: none raises, each
still returns what the good entries say, names the bad one in one line where it read it, and
keeps a bounded amount of memory whatever the planted file's length.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import tracemalloc
from pathlib import Path

import pytest

optuna = pytest.importorskip("optuna", reason="studies need Optuna: pip install 'somatize[study]'")

from conftest import SETPRIV, env_with_tests  # noqa: E402
from optuna.distributions import FloatDistribution  # noqa: E402

from somatize import FolderStore, Recorder, fact, folders  # noqa: E402
from somatize.record import best, curve, facts, fleet, forwards, machines, nodes, report, runs, scores, trials  # noqa: E402  # noqa: E402
from somatize.study import Study  # noqa: E402

BAD_FORWARD = "run/r/3"
BAD_ATTEMPT = "tune/trial/000002.000"
SPARSE = 384 << 20

# The writer, as `nobody`: a store entry by hand (header, CRC, record, blob), written to a temp
# file and renamed into place; "sparse" makes the blob a hole of that many bytes.
PLANTER = r"""
import json, os, sys, zlib
for path, record, blob_hex, sparse in json.loads(sys.stdin.read()):
    data = (json.dumps(record, sort_keys=True) + "\n").encode()
    blob = b"" if blob_hex is None else bytes.fromhex(blob_hex)
    size = sparse if sparse else (None if blob_hex is None else len(blob))
    field = b"-" * 16 if size is None else b"%016x" % size
    head = b"SMZS1 %08x " % len(data) + field + b" "
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".planting", "wb") as file:
        file.write(head + b"%08x\n" % zlib.crc32(data, zlib.crc32(head)) + data + blob)
        if sparse:
            file.truncate(len(head) + 9 + len(data) + sparse)
    os.replace(path + ".planting", path)
print("planted")
"""


def lines(*items) -> bytes:
    return b"".join((item if isinstance(item, bytes) else json.dumps(item).encode()) + b"\n" for item in items)


GOOD_RAN = {"fact": "ran", "node": "embed", "took_us": "10", "host": "w1"}
FINISHED = {"fact": "finished", "took_us": "50"}
FORWARD_RECORD = {"run": "r", "forward": "3", "state": "ok", "nodes": "1", "facts": "3", "took_us": "50"}


def attempt(**fields: str) -> dict[str, str]:
    record = {
        "trial": "2",
        "attempt": "0",
        "config": json.dumps({"x": 0.5}),
        "state": "done",
        "score": "2.25",
        "took_us": "5",
        "runner": "nobody",
        "error": "",
        "facts": "0",
    }
    record.update(fields)
    return record


# each plant: (the forward's record, its blob, its sparse length), the attempt's record (or None),
# and whether a reader that reads them must name them
PLANTS = {
    "a blob line that is a list": (
        (FORWARD_RECORD, lines(GOOD_RAN, b"[1]", b'"text"', b"null", FINISHED), 0),
        attempt(config="[1]"),
        True,
    ),
    "JSON nested 100,000 deep": (
        (
            FORWARD_RECORD,
            lines(GOOD_RAN, b"[" * 100_000 + b"]" * 100_000, b'{"a": ' * 100_000 + b"1" + b"}" * 100_000, FINISHED),
            0,
        ),
        attempt(sampler_attrs='{"trial": ' + '{"a": ' * 100_000 + "0" + "}" * 100_001),
        True,
    ),
    "took_us that is a superscript two": (
        (
            {**FORWARD_RECORD, "took_us": "²", "nodes": "²", "facts": "١٢"},
            lines(
                {**GOOD_RAN, "took_us": "²", "items": "²"},
                {"fact": "left", "host": "w1", "took_us": "²", "worked_us": "²"},
                {**FINISHED, "took_us": "²"},
            ),
            0,
        ),
        attempt(took_us="²"),
        False,
    ),
    "a 384 MiB sparse blob": ((FORWARD_RECORD, b"", SPARSE), attempt(), True),
    "bytes that are not UTF-8": (
        (FORWARD_RECORD, lines(GOOD_RAN, b'{"fact": "ran", "node": "\xff\xfe", "took_us": "1"}', FINISHED), 0),
        None,
        True,
    ),
    "JSON of the wrong types or non-finite numbers": (
        (
            FORWARD_RECORD,
            lines(
                GOOD_RAN,
                {"fact": "ran", "node": 5, "took_us": 1.5},
                {"fact": "left", "host": ["w1"]},
                {"fact": "said", "host": "w1", "machine": {"a": 1}},
                b'{"fact": "loss", "value": NaN}',
                {"fact": None},
                {"fact": "ran", "node": "x", "took_us": "1", "deep": {"a": "b"}},
                FINISHED,
            ),
            0,
        ),
        attempt(config='{"x": NaN}'),
        True,
    ),
    "a record of megabytes": (({**FORWARD_RECORD, "error": "x" * (2 << 20)}, lines(GOOD_RAN, FINISHED), 0), None, True),
}


@pytest.fixture
def shared():
    base = Path(tempfile.mkdtemp(prefix="somatize-hostile-readers-"))
    base.chmod(0o755)
    yield base / "store"
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def planted(shared, python_for_nobody, request):
    """A store with three good forwards, a machine's report and a study of two done trials,
    each folder open to others; then `nobody` plants the attack named by the test."""
    store = FolderStore(shared)
    rec = Recorder(store, run="r")
    for step in range(3):
        rec(fact("ran", node="embed", took_us=10, host="w1"))
        rec(fact("ran", node="head", took_us=1))
        rec(fact("left", host="w1", took_us=30, worked_us=11))
        rec(fact("finished", took_us=50))
        rec(fact("loss", value=1 / (step + 1)))
    report(store, "w1", {"kind": "load"})
    Study(store, "tune", objective="study_objectives:quadratic", space={"x": FloatDistribution(-5.0, 5.0)}, trials=4)
    for n, x in enumerate([1.0, 3.5]):
        store.put(
            f"tune/trial/{n:06d}.000", attempt(trial=str(n), config=json.dumps({"x": x}), score=repr((x - 2.0) ** 2))
        )
    for folder in ("", "run", "run/r", "tune", "tune/trial"):
        (store.path / folder).mkdir(exist_ok=True)
        (store.path / folder).chmod(0o777)
    (record, blob, sparse), study_record, named = PLANTS[request.param]
    ops = [[str(store.path / f"{BAD_FORWARD}.rec"), record, blob.hex(), sparse]]
    if study_record is not None:
        ops.append([str(store.path / f"{BAD_ATTEMPT}.rec"), study_record, None, sparse])
    done = subprocess.run(
        [*SETPRIV, python_for_nobody, "-c", PLANTER],
        input=json.dumps(ops),
        capture_output=True,
        text=True,
        cwd="/",
        timeout=30,
    )
    assert done.returncode == 0 and done.stdout == "planted\n", done.stderr
    assert (store.path / f"{BAD_FORWARD}.rec").stat().st_uid != 0  # `nobody` wrote it
    return store, request.param, study_record is not None, named


# -- each reader: what the good entries say must still come back -----------------------------------


def _runs(store):
    assert runs(store) == ["r"]


def _forwards(store):
    rows = {row["forward"]: row for row in forwards(store, run="r")}
    assert [rows[n]["took_us"] for n in range(3)] == [50, 50, 50]
    assert all(row["took_us"] is None or type(row["took_us"]) is int for row in rows.values())


def _curve(store):
    assert curve(store, run="r")[:3] == [(0, 1.0), (1, 0.5), (2, 1 / 3)]


def _facts(store):
    assert [f["fact"] for f in facts(store, run="r", forward=0)] == ["ran", "ran", "left", "finished", "loss"]
    found = facts(store, run="r", forward=3)
    assert all(isinstance(f, dict) and all(type(v) is str for v in f.values()) for f in found)


def _nodes(store):
    embed = next(row for row in nodes(store, run="r") if row["node"] == "embed")
    assert embed["ran"] >= 3 and embed["took_us"] >= 30 and embed["host"] == "w1"


def _fleet(store):
    w1 = fleet(store, run="r")["w1"]
    assert w1["slices"] >= 3 and w1["took_us"] >= 33 and w1["said"]["kind"] == "load"


def _machines(store):
    assert "w1" in machines(store, run="r", as_text=True)


def _trials(store):
    rows = {row["trial"]: row for row in trials(store, study="tune")}
    assert [rows[n]["state"] for n in (0, 1)] == ["done", "done"]
    assert rows.get(2, {}).get("took_us") is None or type(rows[2]["took_us"]) is int


def _best(store):
    assert best(store, study="tune")["trial"] == 0


def _scores(store):
    assert "study 'tune'" in scores(store, study="tune", as_text=True)


READERS = {
    "runs": _runs,
    "forwards": _forwards,
    "curve": _curve,
    "facts": _facts,
    "nodes": _nodes,
    "fleet": _fleet,
    "machines": _machines,
    "trials": _trials,
    "best": _best,
    "scores": _scores,
}
# which readers read the planted forward's blob, its record, or the planted attempt
READS_BLOB = {"curve", "facts", "nodes", "fleet", "machines"}
READS_RECORD = {"forwards", "curve", "nodes", "fleet", "machines"}
READS_STUDY = {"trials", "best", "scores"}


@pytest.mark.parametrize("planted", list(PLANTS), indirect=True)
@pytest.mark.parametrize("reader", list(READERS))
def test_a_planted_record_stops_no_reader_and_swells_none(planted, reader, capfd):
    """Attack: on main `nodes`, `fleet`, `machines` and `curve` raise AttributeError on a line
    `[1]`, `facts` RecursionError on a deep one, and every blob reader allocates the 384 MiB
    a sparse file claims (the view grew by 1.9 GiB). Now each answers from the good entries,
    names the bad one in one line, and allocates a bounded amount whatever the file's length."""
    store, plant, in_study, named = planted
    folders.forget_told()
    capfd.readouterr()
    tracemalloc.start()
    try:
        READERS[reader](store)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 24 << 20, f"{reader} allocated {peak} bytes at its peak"
    err = capfd.readouterr().err
    said = [line for line in err.splitlines() if BAD_FORWARD in line or BAD_ATTEMPT in line]
    assert len(said) <= 2 and "Traceback" not in err, err
    megabytes = plant == "a record of megabytes"
    if named and (reader in READS_BLOB and not megabytes or reader in READS_RECORD and megabytes):
        assert sum(BAD_FORWARD in line for line in said) == 1, err
    if named and in_study and reader in READS_STUDY and plant != "a 384 MiB sparse blob":
        assert sum(BAD_ATTEMPT in line for line in said) == 1, err


@pytest.mark.parametrize("planted", list(PLANTS), indirect=True)
def test_show_prints_the_good_trials_whatever_was_planted(planted):
    """Attack: `took_us="²"` made `--show` exit 2 (`"²".isdigit()` is true, `int("²")` fails)."""
    store, plant, in_study, named = planted
    shown = subprocess.run(
        [sys.executable, "-m", "somatize", "study", "--store", str(store.path), "tune", "--show"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env_with_tests(),
    )
    assert shown.returncode == 0, shown.stderr
    rows = {line.split()[0]: line.split() for line in shown.stdout.splitlines()[2:]}
    assert rows["0"][1] == "done" and rows["1"][1] == "done", shown.stdout
    assert "Traceback" not in shown.stderr
    if named and in_study and plant != "a 384 MiB sparse blob":
        assert shown.stderr.count(f"the record {BAD_ATTEMPT} is left out") == 1, shown.stderr
