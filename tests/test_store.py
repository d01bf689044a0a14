"""FolderStore on real files: round trips, names, prefixes, damage, and real concurrent
writers, including ones killed with SIGKILL mid-put."""

from __future__ import annotations

import hashlib
import os
import random
import select
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import somatize.store
from somatize import folders
from somatize.errors import BadName, Missing, StoreError
from somatize.store import ClaimingStore, FolderStore, Store

# Child processes import somatize from wherever this process did.
_ENV = {**os.environ, "PYTHONPATH": str(Path(somatize.store.__file__).resolve().parents[1])}


def _temps(root: Path) -> list[Path]:
    return [p for p in root.rglob(".*") if p.is_file() and ".tmp" in p.name]


def _verify(record: dict[str, str], blob: bytes | bytearray | None) -> None:
    """An entry whose blob is a function of its record: anything torn fails here."""
    if record["sha"] == "none":
        assert blob is None
    else:
        assert blob is not None
        assert len(blob) == int(record["size"])
        assert hashlib.sha256(blob).hexdigest() == record["sha"]


def _spawn(script: str, *args: object) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", script, *map(str, args)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=_ENV,
    )


def _line(proc: subprocess.Popen[str], timeout: float = 20.0) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, "the child said nothing in time"
    return proc.stdout.readline().strip()


def _reap(procs: list[subprocess.Popen[str]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()


# -- round trips ------------------------------------------------------------------------


@pytest.mark.pure
def test_put_scan_fetch_round_trip(tmp_path: Path) -> None:
    store = FolderStore(tmp_path / "s")
    store.put("cache/sha256:ab12", {"kind": "numpy", "frames": "2"}, b"\x00\x01payload")
    store.put("run/tuesday/0", {"state": "ok", "note": "héllo ✓"})

    assert list(store.scan("")) == [
        ("cache/sha256:ab12", {"frames": "2", "kind": "numpy"}),
        ("run/tuesday/0", {"note": "héllo ✓", "state": "ok"}),
    ]
    blob = store.fetch("cache/sha256:ab12")
    assert blob == b"\x00\x01payload" and isinstance(blob, bytearray)
    assert store.fetch("run/tuesday/0") is None  # put without a blob
    assert store.record("run/tuesday/0") == {"state": "ok", "note": "héllo ✓"}
    assert store.entry("cache/sha256:ab12") == ({"kind": "numpy", "frames": "2"}, blob)
    assert "run/tuesday/0" in store and "run/tuesday/1" not in store


class _Disk:
    """What a store asks of the disk, in order: each fsync (of what), link, rename, mkdir.
    The calls go through to the real ones; they are only written down."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
        self.root, self.done = root.resolve(), []
        for call in ("fsync", "link", "replace", "mkdir"):
            monkeypatch.setattr(os, call, self._spy(call, getattr(os, call)))

    def _spy(self, call, real):  # type: ignore[no-untyped-def]
        def spied(*args, **kwargs):  # type: ignore[no-untyped-def]
            result = real(*args, **kwargs)
            if call == "fsync":
                path = Path(os.readlink(f"/proc/self/fd/{args[0]}"))
                self.done.append(("fsync", ".tmp" if path.name.endswith(".tmp") else self._short(path)))
            else:
                folder = Path(os.readlink(f"/proc/self/fd/{kwargs.get('dst_dir_fd', kwargs.get('dir_fd'))}"))
                made = args[0] if call == "mkdir" else args[1]  # mkdir(name, mode), link/replace(temp, name)
                self.done.append((call, self._short(folder / made)))
            return result

        return spied

    def _short(self, path: Path) -> str:
        return "/" + str(path.relative_to(self.root)) if path != self.root else "/"


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="reads /proc/self/fd")
def test_an_entry_is_on_the_disk_before_it_has_its_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No crash shows a torn entry: its bytes are synced before the link or rename gives it
    its name; the name is synced after (unless ``durable=False``); every folder made on the
    way is synced before the call returns, after the entry's own sync (so that one disk
    commit carries both)."""
    store = FolderStore(tmp_path)
    disk = _Disk(monkeypatch, tmp_path)
    assert store.create("a/b/c", {"k": "v"})
    assert disk.done == [
        ("mkdir", "/a"),
        ("mkdir", "/a/b"),
        ("fsync", ".tmp"),
        ("link", "/a/b/c.rec"),
        ("fsync", "/a/b"),  # the name
        ("fsync", "/a"),  # b, made in a
        ("fsync", "/"),  # a, made in the root
    ], disk.done
    disk.done.clear()
    assert store.create("a/d/e", {"k": "v"}, durable=False)
    assert disk.done == [("mkdir", "/a/d"), ("fsync", ".tmp"), ("link", "/a/d/e.rec"), ("fsync", "/a")], disk.done
    disk.done.clear()
    store.put("a/d/e", {"k": "w"})
    assert disk.done == [("fsync", ".tmp"), ("replace", "/a/d/e.rec"), ("fsync", "/a/d")], disk.done
    assert store.record("a/d/e") == {"k": "w"}


@pytest.mark.pure
def test_empty_blob_is_not_no_blob(tmp_path: Path) -> None:
    store = FolderStore(tmp_path)
    store.put("a", {}, b"")
    store.put("b", {})
    assert store.fetch("a") == bytearray() and store.fetch("b") is None


@pytest.mark.pure
def test_put_replaces(tmp_path: Path) -> None:
    store = FolderStore(tmp_path)
    store.put("m/gpu-box-1", {"v": "1"}, b"one")
    store.put("m/gpu-box-1", {"v": "2"})
    assert store.entry("m/gpu-box-1") == ({"v": "2"}, None)
    assert list(store.scan("m/")) == [("m/gpu-box-1", {"v": "2"})]


@pytest.mark.pure
def test_blob_kinds_are_written_in_order(tmp_path: Path) -> None:
    import array

    store = FolderStore(tmp_path)
    doubles = array.array("d", [1.5, -2.0])
    store.put("v", {}, memoryview(doubles))
    assert store.fetch("v") == doubles.tobytes()
    store.put("b", {}, bytearray(b"xyz"))
    assert store.fetch("b") == b"xyz"
    store.put("parts", {}, [b"head", memoryview(b"--frame1--"), bytearray(b"frame2"), doubles])
    assert store.fetch("parts") == b"head--frame1--frame2" + doubles.tobytes()
    store.put("tuple", {}, (b"a", b"", b"b"))
    assert store.fetch("tuple") == b"ab"
    store.put("none", {}, [])
    assert store.fetch("none") == b""


@pytest.mark.pure
def test_big_blob_round_trips(tmp_path: Path) -> None:
    store = FolderStore(tmp_path)
    big = bytearray(random.Random(1).randbytes(1 << 20)) * 24  # 24 MiB
    store.put("big", {"n": "1"}, memoryview(big))
    back = store.fetch("big")
    assert isinstance(back, bytearray) and len(back) == len(big) and back == big
    back[0] ^= 1  # writable, callers may use it in place
    assert store.fetch("big") == big


@pytest.mark.pure
def test_entry_lets_admit_refuse_a_blob_before_room_is_made_for_it(tmp_path: Path) -> None:
    """``admit`` sees the blob's first 64 KiB and its declared length; what it raises comes
    out of ``entry`` before a buffer of the blob's size exists, and what it passes reads whole."""
    import tracemalloc

    from somatize.store_file import BLOB_START

    store = FolderStore(tmp_path)
    blob = random.Random(2).randbytes(8 << 20)  # 8 MiB
    store.put("big", {"n": "1"}, blob)
    seen: list[tuple[int, int]] = []

    def refuse(start: bytearray, length: int) -> None:
        seen.append((len(start), length))
        raise StoreError("refused by its start")

    tracemalloc.start()
    try:
        with pytest.raises(StoreError, match="refused by its start"):
            store.entry("big", admit=refuse)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert seen == [(BLOB_START, len(blob))]
    assert peak < 1 << 20, f"{peak} bytes allocated to refuse an 8 MiB blob"
    record, back = store.entry("big", admit=lambda start, length: seen.append((len(start), length)))
    assert record == {"n": "1"} and back == blob and seen[-1] == (BLOB_START, len(blob))
    store.put("small", {}, b"abc")
    assert store.entry("small", admit=lambda start, length: seen.append((len(start), length)))[1] == b"abc"
    assert seen[-1] == (3, 3)


@pytest.mark.pure
def test_missing(tmp_path: Path) -> None:
    store = FolderStore(tmp_path)
    store.put("run/a", {})
    for read in (store.fetch, store.record, store.entry):
        with pytest.raises(Missing) as caught:
            read("run/ghost")
        assert isinstance(caught.value, KeyError)
        assert "'run/ghost'" in str(caught.value)
    with pytest.raises(KeyError):
        store.fetch("run/a/0")  # under a name that is a file, not a folder
    store.delete("run/ghost")  # absent: nothing happens
    store.delete("run/a")
    assert "run/a" not in store and list(store.scan("")) == []


@pytest.mark.pure
def test_folder_store_basics(tmp_path: Path) -> None:
    store = FolderStore(tmp_path / "deep" / "er")  # PathLike, parents created
    assert store.path == (tmp_path / "deep" / "er").resolve() and store.path.is_dir()
    assert isinstance(store.path, Path)
    assert repr(store) == f"FolderStore({str(store.path)!r})"
    assert isinstance(store, Store)
    assert FolderStore(str(tmp_path / "deep" / "er")).path == store.path
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(StoreError, match="file"):
        FolderStore(tmp_path / "file")


@pytest.mark.pure
def test_file_is_readable_by_hand(tmp_path: Path) -> None:
    store = FolderStore(tmp_path)
    store.put("run/t/0", {"z": "1", "a": "ü"}, b"BLOB")
    raw = (tmp_path / "run" / "t" / "0.rec").read_bytes()
    header, record, blob = raw.split(b"\n", 2)
    assert header.startswith(b"SMZS1 ")
    assert record.decode() == '{"a": "ü", "z": "1"}'  # sorted keys, plain UTF-8
    assert blob == b"BLOB"
    assert _temps(tmp_path) == []


@settings(max_examples=60, deadline=None)
@given(
    record=st.dictionaries(st.text(max_size=20), st.text(max_size=40), max_size=6),
    blob=st.none() | st.binary(max_size=300),
)
@pytest.mark.pure
def test_any_record_round_trips(tmp_path_factory, record, blob) -> None:  # type: ignore[no-untyped-def]
    store = FolderStore(tmp_path_factory.mktemp("rt"))
    store.put("x", record, blob)
    assert store.entry("x") == (record, blob)
    assert list(store.scan("")) == [("x", record)]


@pytest.mark.pure
def test_lone_surrogates_round_trip(tmp_path: Path) -> None:
    store = FolderStore(tmp_path)
    store.put("s", {"k\ud800": "v\udfff"})
    assert store.record("s") == {"k\ud800": "v\udfff"}


# -- names ------------------------------------------------------------------------------

BAD_NAMES = [
    "",
    "/abs",
    "a//b",
    "a/",
    ".",
    "..",
    "a/./b",
    "a/../b",
    "../a",
    ".hidden",
    "a/.b",
    "sp ace",
    "tab\tx",
    "new\nline",
    "nul\x00",
    "é",
    "a\\b",
    "star*",
    "a.rec",
    "a.rec/b",
    "x" * 201,
    "/".join(["y" * 199] * 6),  # each part fine, too long in all
    42,
    b"bytes",
]


@pytest.mark.parametrize("name", BAD_NAMES, ids=repr)
@pytest.mark.pure
def test_bad_names_refused(tmp_path: Path, name: object) -> None:
    store = FolderStore(tmp_path)
    for verb in (
        lambda: store.put(name, {}),  # type: ignore[arg-type]
        lambda: store.fetch(name),  # type: ignore[arg-type]
        lambda: store.record(name),  # type: ignore[arg-type]
        lambda: store.entry(name),  # type: ignore[arg-type]
        lambda: store.delete(name),  # type: ignore[arg-type]
        lambda: name in store,
    ):
        with pytest.raises(BadName, match="A-Z a-z 0-9") as caught:
            verb()
        assert isinstance(caught.value, ValueError)
    assert list(tmp_path.rglob("*")) == []


@pytest.mark.parametrize(
    "name",
    ["cache/sha256:ab12", "run/tuesday/0", "machine/gpu-box-1", "a@b+c=d", "v1.2.3", "-x", "x" * 200],
)
@pytest.mark.pure
def test_good_names_accepted(tmp_path: Path, name: str) -> None:
    store = FolderStore(tmp_path)
    store.put(name, {"n": name}, b"1")
    assert list(store.scan("")) == [(name, {"n": name})]


@settings(max_examples=150, deadline=None)
@given(name=st.text(alphabet="ab.:/-_ é\\\x00", max_size=12))
@pytest.mark.pure
def test_a_name_is_stored_or_refused(tmp_path_factory, name: str) -> None:  # type: ignore[no-untyped-def]
    store = FolderStore(tmp_path_factory.mktemp("names"))
    try:
        store.put(name, {"n": name})
    except BadName:
        assert list(store.path.rglob("*.rec")) == []
        return
    assert store.record(name) == {"n": name}
    assert list(store.scan("")) == [(name, {"n": name})]


@pytest.mark.pure
def test_records_must_be_str_to_str(tmp_path: Path) -> None:
    store = FolderStore(tmp_path)
    with pytest.raises(TypeError, match="bytes under 'token'") as caught:
        store.put("a", {"token": b"secret-value"})
    assert "secret" not in str(caught.value)
    with pytest.raises(TypeError, match="key of type int"):
        store.put("a", {1: "x"})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="int under 'n'"):
        store.put("a", {"n": 3})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="mapping"):
        store.put("a", [("k", "v")])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="str"):
        store.put("a", {}, "text")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="int"):
        store.put("a", {}, 12)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="str"):
        store.put("a", {}, [b"ok", "text"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="contiguous"):
        store.put("a", {}, memoryview(b"abcdef")[::2])
    assert list(tmp_path.rglob("*")) == []  # refused before anything was written


# -- scan -------------------------------------------------------------------------------


@pytest.mark.pure
def test_prefix_semantics(tmp_path: Path) -> None:
    store = FolderStore(tmp_path)
    names = ["run/a/1", "run/a", "cache/x", "run/ab", "run/a/0", "run/a-b", "run/b/0", "run/a/0/z"]
    for name in names:
        store.put(name, {"n": name})

    def scanned(prefix: str) -> list[str]:
        return [name for name, record in store.scan(prefix) if record["n"] == name]

    assert scanned("") == sorted(names)
    # plain string order: '-' < '/' < letters, so run/a-b sits between run/a and run/a/0
    assert scanned("run/a") == ["run/a", "run/a-b", "run/a/0", "run/a/0/z", "run/a/1", "run/ab"]
    assert scanned("run/a/") == ["run/a/0", "run/a/0/z", "run/a/1"]
    assert scanned("run/a/0") == ["run/a/0", "run/a/0/z"]
    assert scanned("run/a/0/") == ["run/a/0/z"]
    assert scanned("ru") == scanned("run/") == sorted(n for n in names if n.startswith("run/"))
    assert scanned("run/b") == ["run/b/0"]
    assert scanned("run/a.r") == []  # a partial part is matched against names, not file names
    assert scanned("nothing/") == scanned("run/c") == scanned("run/a/1/") == []
    for bad in ("/run", "../", "run//", "run/../x", "run/ /"):
        with pytest.raises(BadName):
            list(store.scan(bad))


@pytest.mark.pure
def test_scan_ignores_what_is_not_an_entry(tmp_path: Path) -> None:
    store = FolderStore(tmp_path)
    store.put("run/a", {"n": "a"}, b"A")
    (tmp_path / "run" / ".a.rec.1.2.0badf00d.tmp").write_bytes(b"half a write")
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "x.rec").write_bytes(b"junk")
    (tmp_path / "README.md").write_text("notes")
    (tmp_path / "bad name.rec").write_bytes(b"junk")
    assert list(store.scan("")) == [("run/a", {"n": "a"})]
    assert store.fetch("run/a") == b"A"


@pytest.mark.pure
def test_scan_never_reads_a_blob(tmp_path: Path) -> None:
    store = FolderStore(tmp_path)
    record = {"state": "ok", "took_us": "12"}
    store.put("run/t/0", record, random.Random(2).randbytes(1 << 20))
    store.put("run/t/1", record)  # the same header and record, no blob
    cut = (tmp_path / "run" / "t" / "1.rec").stat().st_size
    # Leave the first file only its header and record: a scan still answers, a fetch cannot.
    os.truncate(tmp_path / "run" / "t" / "0.rec", cut)
    assert list(store.scan("run/t/")) == [("run/t/0", record), ("run/t/1", record)]
    assert store.record("run/t/0") == record
    with pytest.raises(StoreError, match="0.rec") as caught:
        store.fetch("run/t/0")
    assert "cut short" in str(caught.value)


# -- damage -----------------------------------------------------------------------------


@pytest.mark.pure
def test_damaged_files_are_refused(tmp_path: Path, capfd) -> None:
    store = FolderStore(tmp_path)
    store.put("d", {"state": "ok"}, b"payload")
    path = tmp_path / "d.rec"
    good = path.read_bytes()

    def damaged(raw: bytes) -> str:
        path.write_bytes(raw)
        messages = []
        for read in (store.record, store.fetch):
            with pytest.raises(StoreError) as caught:
                read("d")
            assert str(path) in str(caught.value)
            messages.append(str(caught.value))
        # a scan leaves it out and says so, once: one damaged entry never stops a reader
        folders.forget_told()
        assert list(store.scan("d")) == [] and list(store.scan("")) == []
        assert capfd.readouterr().err == f"somatize store: a scan leaves out 'd': {messages[0]}\n"
        return messages[0]

    at = good.index(b"ok")
    assert "checksum" in damaged(good[:at] + b"oK" + good[at + 2 :])  # a flipped record byte
    assert "checksum" in damaged(good.replace(b"0000000000000007", b"0000000000000008"))
    assert "header" in damaged(b"not a store file at all")
    assert "header" in damaged(good.replace(b"SMZS1", b"SMZS9"))
    assert "header" in damaged(good[:20])  # cut inside the header
    assert "cut short" in damaged(good[:45])  # cut inside the record
    path.write_bytes(good + b"extra")
    with pytest.raises(StoreError, match="d.rec"):
        store.fetch("d")
    path.write_bytes(good)
    assert store.entry("d") == ({"state": "ok"}, b"payload")


def test_failed_write_leaves_old_entry_and_no_temp(tmp_path: Path) -> None:
    resource = pytest.importorskip("resource")
    del resource
    # A real write failure: the child may write at most 1 MiB per file, then puts 4 MiB.
    script = """if True:
        import resource, signal, sys
        from somatize.errors import StoreError
        from somatize.store import FolderStore
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        store = FolderStore(sys.argv[1])
        store.put("keep", {"v": "old"}, b"o")
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        try:
            store.put("keep", {"v": "new"}, bytes(4 << 20))
        except StoreError as exc:
            print("refused", "unchanged" in str(exc), flush=True)
    """
    proc = _spawn(script, tmp_path)
    try:
        out, _ = proc.communicate(timeout=30)
    finally:
        _reap([proc])
    assert out.split() == ["refused", "True"]
    store = FolderStore(tmp_path)
    assert store.entry("keep") == ({"v": "old"}, b"o")
    assert _temps(tmp_path) == []


# -- concurrency ------------------------------------------------------------------------

SHARED = "shared/one"

_WRITER = """if True:
    import hashlib, random, sys
    from somatize.store import FolderStore
    root, writer, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    store = FolderStore(root)
    rng = random.Random(writer)
    print("ready", flush=True)
    sys.stdin.readline()  # start together
    for n in range(rounds):
        if n % 5 == 4:
            store.put("shared/one", {"writer": str(writer), "n": str(n), "sha": "none"})
            continue
        size = rng.choice([0, 1, 100, 4096, 65536, 300000]) + writer
        blob = rng.randbytes(size)
        record = {"writer": str(writer), "n": str(n), "size": str(size),
                  "sha": hashlib.sha256(blob).hexdigest()}
        shaped = [blob, memoryview(blob), [blob[: size // 2], bytearray(blob[size // 2 :])]]
        store.put("shared/one", record, shaped[n % 3])
"""


@pytest.mark.timeout(60)
def test_processes_writing_one_name(tmp_path: Path) -> None:
    store = FolderStore(tmp_path)
    store.put(SHARED, {"writer": "-", "n": "-", "sha": "none"})
    rounds = 100
    procs = [_spawn(_WRITER, tmp_path, i, rounds) for i in range(8)]
    try:
        for proc in procs:
            assert _line(proc) == "ready"
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        reads = 0
        seen = set()
        while any(proc.poll() is None for proc in procs):
            record, blob = store.entry(SHARED)  # never Missing: the name is always there
            _verify(record, blob)
            seen.add((record["writer"], record["n"]))
            for name, record in store.scan("shared/"):
                assert name == SHARED and set(record) >= {"writer", "n", "sha"}
            reads += 1
        assert [proc.wait(timeout=10) for proc in procs] == [0] * 8
    finally:
        _reap(procs)
    assert reads > 0 and len(seen) > 1
    entries = list(store.scan(""))
    assert [name for name, _ in entries] == [SHARED]
    record, blob = store.entry(SHARED)
    _verify(record, blob)
    assert record["n"] == str(rounds - 1)  # the last rename is some writer's last put
    assert _temps(tmp_path) == []


_BIG_WRITER = """if True:
    import hashlib, os, random, sys, time
    from somatize.store import FolderStore
    root, seed, freeze = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "freeze"
    store = FolderStore(root)
    rng = random.Random(seed)
    blobs = [rng.randbytes(8 << 20), rng.randbytes(5 << 20)]
    if freeze:
        # Stop inside put, after the data is written and before the rename, so the kill
        # certainly lands mid-put.
        def stuck(fd):
            print("stuck", flush=True)
            time.sleep(60)
        os.fsync = stuck
    print("ready", flush=True)
    for k in range(10 ** 6):
        blob = memoryview(blobs[k % 2])[k % 1000 :]
        record = {"k": str(k), "size": str(len(blob)), "sha": hashlib.sha256(blob).hexdigest()}
        store.put("big/%d" % (k % 3), record, blob)
"""


@pytest.mark.timeout(60)
def test_writers_killed_mid_put_leave_nothing_torn(tmp_path: Path) -> None:
    store = FolderStore(tmp_path)
    store.put("big/seed", {"sha": "none"})  # the folder exists before any writer starts
    rng = random.Random(7)
    for round_ in range(4):
        proc = _spawn(_BIG_WRITER, tmp_path, round_, "run")
        try:
            assert _line(proc) == "ready"
            threading.Event().wait(rng.uniform(0.01, 0.3))
            os.kill(proc.pid, signal.SIGKILL)
            assert proc.wait(timeout=10) == -signal.SIGKILL
        finally:
            _reap([proc])
        for name, _ in store.scan(""):
            _verify(*store.entry(name))  # every visible entry is whole
    visible = {name: store.record(name) for name, _ in store.scan("")}

    proc = _spawn(_BIG_WRITER, tmp_path, 9, "freeze")
    try:
        assert _line(proc) == "ready"
        assert _line(proc) == "stuck"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        _reap([proc])
    # The killed put is invisible: what was there before is still there, unchanged.
    assert {name: store.record(name) for name, _ in store.scan("")} == visible
    for name in visible:
        _verify(*store.entry(name))

    left = _temps(tmp_path)
    assert len(left) >= 1
    assert store.sweep() == 0  # fresh temp files are not swept by default
    assert store.sweep(older_than=0) == len(left)
    assert _temps(tmp_path) == []
    assert {name: store.record(name) for name, _ in store.scan("")} == visible


@pytest.mark.timeout(60)
def test_threads_read_whole_old_or_whole_new(tmp_path: Path) -> None:
    store = FolderStore(tmp_path)
    rng = random.Random(3)
    written: set[str] = {"none"}
    store.put("t/x", {"sha": "none", "n": "0"})
    done = threading.Event()
    failures: list[BaseException] = []

    def write() -> None:
        try:
            for n in range(1, 300):
                size = rng.choice([0, 10, 5000, 200_000])
                blob = None if n % 4 == 0 else rng.randbytes(size)
                sha = "none" if blob is None else hashlib.sha256(blob).hexdigest()
                written.add(sha)
                store.put("t/x", {"sha": sha, "size": str(size), "n": str(n)}, blob)
        except BaseException as exc:
            failures.append(exc)
        finally:
            done.set()

    def read() -> None:
        try:
            while not done.is_set():
                _verify(*store.entry("t/x"))
                assert store.record("t/x")["sha"] in written
                blob = store.fetch("t/x")
                assert (hashlib.sha256(blob).hexdigest() if blob is not None else "none") in written
                assert [name for name, _ in store.scan("t/")] == ["t/x"]
        except BaseException as exc:
            failures.append(exc)
            done.set()

    threads = [threading.Thread(target=write)] + [threading.Thread(target=read) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=50)
    assert not any(thread.is_alive() for thread in threads)
    assert failures == []
    assert store.record("t/x")["n"] == "299"
    assert _temps(tmp_path) == []


# -- create and stamp: what studies claim and judge with -----------------------------------


@pytest.mark.pure
def test_create_writes_only_when_nothing_is_there(tmp_path: Path) -> None:
    store = FolderStore(tmp_path)
    assert isinstance(store, ClaimingStore)
    assert store.create("study/trial/000000.000", {"runner": "a"}, [b"fa", b"cts"]) is True
    assert store.create("study/trial/000000.000", {"runner": "b"}, b"other") is False
    assert store.entry("study/trial/000000.000") == ({"runner": "a"}, bytearray(b"facts"))
    store.put("study/trial/000000.000", {"runner": "a", "state": "done"})  # its owner rewrites
    assert store.create("study/trial/000000.000", {"runner": "c"}) is False
    assert store.record("study/trial/000000.000") == {"runner": "a", "state": "done"}
    assert store.create("study/trial/000000.001", {"runner": "c"}) is True
    assert _temps(tmp_path) == []
    with pytest.raises(BadName):
        store.create("../x", {})
    with pytest.raises(TypeError):
        store.create("x", {"n": 1})  # type: ignore[dict-item]
    assert "x" not in store


@pytest.mark.pure
def test_a_three_verb_store_is_a_store_but_cannot_claim() -> None:
    class Plain:
        def put(self, name, record, blob=None): ...
        def scan(self, prefix):
            return iter(())

        def fetch(self, name): ...

    assert isinstance(Plain(), Store) and not isinstance(Plain(), ClaimingStore)


@pytest.mark.pure
def test_stamp_is_the_stores_and_moves_with_each_write(tmp_path: Path) -> None:
    store = FolderStore(tmp_path)
    with pytest.raises(Missing, match="judge/a"):
        store.stamp("study/judge/a")
    store.put("study/judge/a", {"runner": "a"})
    first = store.stamp("study/judge/a")
    assert first == os.stat(tmp_path / "study" / "judge" / "a.rec").st_mtime_ns
    os.utime(tmp_path / "study" / "judge" / "a.rec", ns=(first, first - 5_000_000_000))
    assert store.stamp("study/judge/a") == first - 5_000_000_000  # the file's, not a clock's
    store.put("study/judge/a", {"runner": "a"})  # rewritten: stamped afresh
    assert store.stamp("study/judge/a") >= first
    assert store.create("study/trial/000000.000", {}) and store.stamp("study/trial/000000.000") > 0


_CLAIMER = """if True:
    import sys
    from somatize.store import FolderStore
    root, who = sys.argv[1], sys.argv[2]
    store = FolderStore(root)
    print("ready", flush=True)
    sys.stdin.readline()  # start together
    won = [n for n in range(200) if store.create("race/%03d" % n, {"who": who})]
    print(" ".join(map(str, won)), flush=True)
"""


@pytest.mark.timeout(60)
def test_processes_creating_the_same_names_each_get_exactly_one(tmp_path: Path) -> None:
    procs = [_spawn(_CLAIMER, tmp_path, f"p{i}") for i in range(4)]
    try:
        for proc in procs:
            assert _line(proc) == "ready"
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        won = {f"p{i}": [int(n) for n in _line(proc).split()] for i, proc in enumerate(procs)}
        assert [proc.wait(timeout=10) for proc in procs] == [0] * 4
    finally:
        _reap(procs)
    claims = sorted(n for numbers in won.values() for n in numbers)
    assert claims == list(range(200))  # every name won once, none twice
    store = FolderStore(tmp_path)
    for who, numbers in won.items():
        assert all(store.record(f"race/{n:03d}") == {"who": who} for n in numbers)
    assert _temps(tmp_path) == []


@pytest.mark.pure
def test_names_lists_what_a_scan_finds_without_opening_an_entry(tmp_path):
    """``names`` is the listing a scan starts from: the same names, in the same order, links
    left out, and nothing opened (a damaged entry is listed; a scan leaves it out)."""
    store = FolderStore(tmp_path / "s")
    for n in (3, 1, 2, 10):
        store.put(f"run/a/{n}", {"n": str(n)})
    store.put("run/ab/1", {"n": "x"})
    os.symlink(tmp_path / "s" / "run" / "a" / "1.rec", tmp_path / "s" / "run" / "a" / "7.rec")
    assert (
        store.names("run/a/")
        == [name for name, _ in store.scan("run/a/")]
        == ["run/a/1", "run/a/10", "run/a/2", "run/a/3"]
    )
    assert store.names("run/a") == ["run/a/1", "run/a/10", "run/a/2", "run/a/3", "run/ab/1"]
    (tmp_path / "s" / "run" / "a" / "2.rec").write_bytes(b"not an entry")
    assert "run/a/2" in store.names("run/a/") and "run/a/2" not in dict(store.scan("run/a/"))
    assert store.names("nothing/") == []


@pytest.mark.pure
def test_what_sits_at_a_folders_name_is_named_once_and_read_as_nothing(tmp_path: Path, capfd) -> None:
    """Attack: a writer puts a file, or a FIFO, where a folder belongs (``run/r`` of a run's
    forwards); a scan and a listing read it as nothing there and say so once, naming it."""
    store = FolderStore(tmp_path)
    store.put("run/q/0", {"x": "1"})
    (tmp_path / "run" / "r").write_bytes(b"not a folder")
    os.mkfifo(tmp_path / "run" / "s")
    folders.forget_told()
    for _ in range(3):
        assert [name for name, _ in store.scan("run/")] == ["run/q/0"]
        assert store.names("run/") == ["run/q/0"]
    err = capfd.readouterr().err
    assert err.count(f"{tmp_path}/run/r is a file where only a folder belongs") == 1, err
    assert err.count(f"{tmp_path}/run/s is not a regular file (a FIFO") == 1, err


@pytest.mark.pure
def test_each_thing_planted_at_a_name_is_named_not_only_the_first(tmp_path: Path, capfd) -> None:
    """Attack: a long-lived reader (the view) names a planted name once; the writer then
    swaps what is there, kind after kind. Each new plant gets its line; the same one, none."""
    store = FolderStore(tmp_path)
    store.put("run/q/0", {"x": "1"})
    planted = tmp_path / "run" / "q" / "1.rec"
    folders.forget_told()
    os.symlink(tmp_path / "run" / "q" / "0.rec", planted)
    for _ in range(2):
        assert [name for name, _ in store.scan("run/q/")] == ["run/q/0"]
    planted.unlink()
    os.symlink(tmp_path / "nowhere", planted)  # another link: another thing, another line
    assert [name for name, _ in store.scan("run/q/")] == ["run/q/0"]
    planted.unlink()
    os.mkfifo(planted)
    for _ in range(2):
        assert [name for name, _ in store.scan("run/q/")] == ["run/q/0"]
    err = capfd.readouterr().err
    assert err.count(f"{planted} is a symbolic link") == 2, err
    assert err.count(f"{planted} is not a regular file (a FIFO") == 1, err


def test_folders_nested_deeper_than_any_name_stop_no_listing(tmp_path: Path, capfd) -> None:
    """A writer of the folder nests 1,200 folders under a study's trials: no entry's name
    (1,000 characters at most) reaches that deep, so a listing, a scan and a sweep go no
    deeper than a name can (they recursed once per folder, and a deep enough chain raised
    RecursionError in every runner and reader), and say once what is there."""
    store = FolderStore(tmp_path / "store")
    store.put("st/trial/000000.000", {"state": "done"})
    chain = os.open(tmp_path / "store" / "st" / "trial", os.O_RDONLY | os.O_DIRECTORY)
    opened = [chain]
    try:
        for _ in range(1200):  # by descriptor: the chain's path is longer than a path may be
            os.mkdir("a", dir_fd=opened[-1])
            opened.append(os.open("a", os.O_RDONLY | os.O_DIRECTORY, dir_fd=opened[-1]))
        assert store.names("st/") == ["st/trial/000000.000"]
        assert [name for name, _ in store.scan("st/")] == ["st/trial/000000.000"]
        assert store.sweep(0) == 0
        assert "nested deeper than any entry's name reaches" in capfd.readouterr().err
    finally:
        for parent in reversed(opened[:-1]):  # removed from the bottom up, without recursion
            os.rmdir("a", dir_fd=parent)
        for fd in opened:
            os.close(fd)
