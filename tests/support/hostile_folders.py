"""The hostile-folder harness (issue 39, item 2): every name any piece reads or writes, and a
writer of the shared folder planting every kind of entry at each.

A store, a study's folder, the computing claims, the record and the view are folders that
others may write (the runbook makes a store group-writable). Whatever sits at a name a piece
uses, that piece must go on: no crash, no hang, no spin, no leak, the right answer where
there is one, and one line naming the name it could not use.

Three parts:

- ``NAMES``: every name the code makes, each from the code's own function or constant
  (``keys.cache_name``, ``computing._PREFIX``, ``history.attempt_name``,
  ``recorder.entry_name``/``chunk_name``, ``reports._MACHINES``) called for sample values,
  and the pattern every name of its kind matches. ``Tracer`` (run inside a piece's process)
  records every path the piece opens, lists, makes, renames or removes under its store, so
  a test can say that each one is a name of this table: a name added to the code without
  being added here fails that test.
- ``Planter``: a long-lived process run as ``nobody`` (``setpriv``) that plants one kind of
  entry at a path (``PLANTS``): a folder, links to a file, a folder and nothing, a FIFO, a
  socket, an empty file, a huge sparse file, bytes that are not UTF-8, JSON nested 100,000
  deep, JSON of the wrong types, non-finite numbers; and, in a folder, a chain of folders
  nested deeper than any entry's name reaches.
- ``Prober``: one process that imports everything once and then forks a child per check
  (several at once), so that hundreds of checks cost a fork each, not an interpreter and
  Optuna each. The child runs the piece (a cached forward, computing once, a study runner's
  ``main``, ``--show``, ``--watch``, the readers); the prober measures it from outside
  (``wait4``'s CPU time and peak memory, the child's descriptors from ``/proc``) and kills it
  past its time. The view is a real ``python -m somatize view`` process, asked over HTTP
  with its token, and measured from ``/proc`` the same way.

``verdict`` turns what was measured into the faults found; the bounds are constants below,
each with why.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from somatize import Node

SETPRIV = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]

# -- the bounds a piece keeps, whatever it meets --------------------------------------------

#: Descriptors a check may end with beyond those it began with. A piece may hold one or two
#: it reuses (a store's root, a log); one per read is a leak, and each check reads its name
#: ``REPEAT`` times, so a leak shows as ``REPEAT`` or more.
FD_SLACK = 2
#: How many times a check reads what it reads (a forward recalls, a reader reads).
REPEAT = 8
#: Peak memory a check may add to its process (bytes). The stores here hold a few KiB of
#: real data and every import is done before the check starts; a piece that reads a planted
#: file's declared length (the sparse plant: 384 MiB) or builds a copy of a deep nesting
#: goes past it by far.
MEMORY_MAX = 160 << 20
#: CPU a check may spend (seconds), beyond ``SPIN_SHARE`` of its wall time: its real work
#: (a few forwards, a study's four trials with the random sampler, a few reads) takes well
#: under this; a waiter that looks every 0.25 s spends a few percent of a core.
SPIN_ALLOWANCE_S = 1.5
#: The share of a core a check may use while it waits. The waiter that loops on a planted
#: link as a claim used 25-50% of a core.
SPIN_SHARE = 0.2
#: Lines naming the planted name a process may say: one for the read that met it, one for
#: the write it refused, each said once per process (rate-limited), however often it meets it.
LINES_MAX = 2
#: The sparse plant's length: what the issue's attack used (4 KiB on disk).
SPARSE_BYTES = 384 << 20
#: How deep the nested plant goes: far past any recursion limit.
DEEP = 100_000

# -- the names ---------------------------------------------------------------------------------

STUDY, RUN, MACHINE, RUNNER = "tune", "r", "box", "runner-a"
TRIAL = 1  # the trial whose names are planted at (trials 0, 2 and 3 are the unplanted ones)
TRIALS = 4
_KEY_HEX = "0123456789abcdef" * 4
_NUMBER_A, _NUMBER_B = 123456, 789  # sample numbers a name function formats, found again below


@dataclass(frozen=True)
class Name:
    """One kind of name the code makes: its sample (made by the code's own function) and
    the regular expression every name of that kind matches."""

    what: str
    sample: str
    pattern: str
    plantable: bool = True  # False: made fresh by each process (a random part), so only its folder is planted

    def folders(self) -> list[str]:
        parts = self.sample.split("/")
        return ["/".join(parts[:i]) for i in range(1, len(parts))]


def _pattern(sample: str, holes: dict[str, str]) -> str:
    """``sample`` as a pattern: each hole's sample text replaced by its expression."""
    out = re.escape(sample)
    for text, expression in holes.items():
        out = out.replace(re.escape(text), expression)
    return out


def names() -> list[Name]:
    """Every name the code makes, from the code's own functions and constants."""
    from somatize import computing, keys
    from somatize.record import recorder, reports
    from somatize.study import history

    key = "sha256:" + _KEY_HEX
    hexes = {_KEY_HEX: "[0-9a-f]{64}"}
    me = computing.Claims(None).me  # a claimer's name, as the code makes it: host-pid-random
    attempt = history.attempt_name(STUDY, _NUMBER_A, _NUMBER_B)
    numbers = {str(_NUMBER_A): r"[0-9]{6,}", str(_NUMBER_B): r"[0-9]{3,}"}
    return [
        Name("cache entry", keys.cache_name(key), _pattern(keys.cache_name(key), hexes)),
        Name("claim", computing._PREFIX + key, _pattern(computing._PREFIX + key, hexes)),
        # the judge's fresh entry (computing.Claims._now): named by each claimer anew
        Name(
            "claim judge",
            f"{computing._PREFIX}judge/{me}",
            _pattern(f"{computing._PREFIX}judge/{me}", {me: r"[A-Za-z0-9._-]+-[0-9]+-[0-9a-f]{8}"}),  # Claims._now
            plantable=False,
        ),
        Name("study definition", f"{STUDY}/study", re.escape(f"{STUDY}/study")),  # study._settle
        Name("attempt", attempt, _pattern(attempt, numbers)),
        Name(
            "study judge", f"{STUDY}/judge/{RUNNER}", re.escape(f"{STUDY}/judge/") + r"[A-Za-z0-9._-]+"
        ),  # study._abandoned
        Name(
            "forward record",
            recorder.entry_name(RUN, _NUMBER_A),
            _pattern(recorder.entry_name(RUN, _NUMBER_A), {str(_NUMBER_A): "[0-9]+"}),
        ),
        Name(
            "chunk",
            recorder.chunk_name(RUN, _NUMBER_A),
            _pattern(recorder.chunk_name(RUN, _NUMBER_A), {str(_NUMBER_A): "[0-9]+"}),
        ),
        Name("run end", recorder.end_name(RUN), re.escape(recorder.end_name(RUN))),  # Recorder.close
        Name("machine report", reports._MACHINES + MACHINE, re.escape(reports._MACHINES + MACHINE)),
    ]


def path_patterns() -> list[tuple[str, re.Pattern[str]]]:
    """What each name may appear as on the disk, relative to the store: its file, each folder
    it lies in, and a writer's temp file beside it (``store_names.TEMP``)."""
    from somatize import store_names

    out: list[tuple[str, re.Pattern[str]]] = []
    for name in names():
        parts = name.pattern.split("/")
        out.append((name.what, re.compile(name.pattern + re.escape(store_names.SUFFIX))))
        for i in range(1, len(parts)):
            out.append((f"folder of {name.what}", re.compile("/".join(parts[:i]))))
        temp = store_names.TEMP.pattern.replace(r"\..+\.rec", r"\." + parts[-1] + re.escape(store_names.SUFFIX))
        out.append((f"temp file of {name.what}", re.compile("/".join([*parts[:-1], temp]))))
    return out


def unknown_paths(touched: set[str]) -> list[str]:
    """The store-relative paths in ``touched`` that match no name of the table."""
    patterns = [pattern for _, pattern in path_patterns()]
    return sorted(p for p in touched if p and not any(pattern.fullmatch(p) for pattern in patterns))


# -- the tracer: every path a piece touches under its store ----------------------------------

TRACER = r"""
import builtins, os, sys
_root = os.path.realpath(os.environ["HOSTILE_ROOT"])
_log = open(os.environ["HOSTILE_TRACE"], "a", buffering=1)
_in = [False]

def _where(path, dir_fd=None):
    try:
        if isinstance(path, int):
            return os.readlink(f"/proc/self/fd/{path}")
        path = os.fsdecode(path)
        if dir_fd is not None and not os.path.isabs(path):
            return os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
        return os.path.abspath(path)
    except Exception:
        return None

def _note(path, dir_fd=None):
    if _in[0]:
        return
    _in[0] = True
    try:
        where = _where(path, dir_fd)
        if where and (where == _root or where.startswith(_root + "/")):
            _log.write(os.path.relpath(where, _root) + "\n")
    finally:
        _in[0] = False

def _wrap(name, *args_at):
    real = getattr(os, name)
    def traced(*args, **kwargs):
        for i, key in args_at:
            if len(args) > i:
                _note(args[i], kwargs.get(key))
            elif name == "scandir" and not args:
                pass
        return real(*args, **kwargs)
    traced.__wrapped__ = real
    setattr(os, name, traced)

for name in ("open", "stat", "lstat", "mkdir", "unlink", "remove", "rmdir", "listdir", "scandir", "truncate",
             "utime", "chmod", "readlink", "mkfifo"):
    if hasattr(os, name):
        _wrap(name, (0, "dir_fd"))
for name in ("replace", "rename"):
    _wrap(name, (0, "src_dir_fd"), (1, "dst_dir_fd"))
_real_link = os.link
def _link(src, dst, *, src_dir_fd=None, dst_dir_fd=None, follow_symlinks=True):
    _note(src, src_dir_fd)
    _note(dst, dst_dir_fd)
    return _real_link(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd, follow_symlinks=follow_symlinks)
os.link = _link
_real_open = builtins.open
def _open(file, *args, **kwargs):
    if not isinstance(file, int):
        _note(file)
    return _real_open(file, *args, **kwargs)
builtins.open = _open
"""


def read_trace(path: Path) -> set[str]:
    if not path.exists():
        return set()
    return {line for line in path.read_text().splitlines() if line and line != "."}


# -- the plants ---------------------------------------------------------------------------------

#: What may be planted where a store entry (a file) belongs.
ENTRY_PLANTS = (
    "folder",
    "link-file",
    "link-folder",
    "link-nothing",
    "fifo",
    "socket",
    "empty",
    "not-utf8",
    "nested",
    "nested-record",
    "types",
    "types-record",
    "nonfinite",
)
#: What may be planted where a folder belongs. ``deep`` keeps the folder and what it holds,
#: and nests a chain of folders in it, ``DEEP_CHAIN`` of them, past ``store_names.DEEPEST``
#: (no entry's name reaches that deep): a piece that walks the folder must stop at a name's
#: depth, not recurse to the bottom.
FOLDER_PLANTS = ("link-file", "link-folder", "link-nothing", "fifo", "socket", "empty", "not-utf8", "deep")
#: Deeper than any name (``store_names.DEEPEST`` is 499) and than Python's recursion limit
#: (1,000: a walk that recurses once a folder raises ``RecursionError`` here), its path still
#: shorter than a path may be (one letter a folder). ``shutil.rmtree`` recurses too: a chain
#: is removed with ``remove_tree``.
DEEP_CHAIN = 1100
#: The big one, everywhere: slow (its reading is what is measured).
SLOW_PLANTS = ("sparse",)


def remove_tree(path: str | Path) -> None:
    """``shutil.rmtree`` without recursion: a chain of folders deeper than Python's recursion
    limit (the ``deep`` plant) is removed too. A link is removed, never followed."""
    folders, stack = [], [str(path)]
    while stack:
        folder = stack.pop()
        folders.append(folder)
        for entry in os.scandir(folder):
            if entry.is_dir(follow_symlinks=False):
                stack.append(entry.path)
            else:
                os.unlink(entry.path)
    for folder in reversed(folders):
        os.rmdir(folder)


# The writer: the store's file format by hand (header, CRC, record), as `nobody` writes it.
PLANTER = (
    "from __future__ import annotations\nimport os\nfrom pathlib import Path\n"
    + inspect.getsource(remove_tree)
    + r"""
import json, os, shutil, socket, sys, zlib

def clear(path):
    if os.path.islink(path) or (os.path.exists(path) and not os.path.isdir(path)):
        os.unlink(path)
    elif os.path.isdir(path):
        remove_tree(path)  # hostile_folders.remove_tree, put before this program

def entry(record, blob, blob_len=None):
    head = b"SMZS1 %08x " % len(record) + (b"-" * 16 if blob is None and blob_len is None
                                            else b"%016x" % (len(blob) if blob_len is None else blob_len)) + b" "
    return head + b"%08x\n" % zlib.crc32(record, zlib.crc32(head)) + record

for line in sys.stdin:
    op = json.loads(line)
    try:
        path, kind = op["path"], op["kind"]
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if kind == "deep":  # beside what the folder holds: a chain, made by descriptor
            if not os.path.isdir(path) or os.path.islink(path):
                clear(path)
                os.mkdir(path)
            opened = [os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)]
            try:
                for _ in range(op["depth"]):
                    os.mkdir("d", dir_fd=opened[-1])
                    opened.append(os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=opened[-1]))
                    os.close(opened.pop(-2))
            finally:
                for fd in opened:
                    os.close(fd)
            print("planted", flush=True)
            continue
        clear(path)
        record = bytes.fromhex(op.get("record", ""))
        blob = bytes.fromhex(op["blob"]) if op.get("blob") is not None else None
        if kind == "folder":
            os.mkdir(path)
            with open(os.path.join(path, "x.rec"), "wb") as file:
                file.write(entry(record, blob) + (blob or b""))
        elif kind.startswith("link-"):
            os.symlink(op["target"], path)
        elif kind == "fifo":
            os.mkfifo(path)
        elif kind == "socket":
            held = socket.socket(socket.AF_UNIX)
            os.chdir(os.path.dirname(path))  # a socket's path is short: bound by its name, from its folder
            try:
                held.bind(os.path.basename(path))
            finally:
                os.chdir("/")
                held.close()
        elif kind == "empty":
            open(path, "wb").close()
        elif kind == "sparse":
            with open(path, "wb") as file:
                if op.get("entry"):
                    file.write(entry(record, None, op["length"]))
                file.truncate(op["length"] + (file.tell() if op.get("entry") else 0))
        elif kind == "raw":
            with open(path, "wb") as file:
                file.write(record)
        else:  # a store file, whole and checksummed, holding what `record` and `blob` say
            with open(path + ".planting", "wb") as file:
                file.write(entry(record, blob) + (blob or b""))
            os.replace(path + ".planting", path)
        if op.get("old"):
            os.utime(path, ns=(op["old"], op["old"]), follow_symlinks=False)
        print("planted", flush=True)
    except Exception as exc:
        print(f"failed {type(exc).__name__}: {exc}", flush=True)
"""
)


class Planter:
    """`nobody`, planting: one process for many plants, one line asked and answered each."""

    def __init__(self, python: str) -> None:
        self.process = subprocess.Popen(
            [*SETPRIV, python, "-c", PLANTER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/"
        )

    def plant(self, **op: Any) -> None:
        assert self.process.stdin and self.process.stdout
        self.process.stdin.write(json.dumps(op) + "\n")
        self.process.stdin.flush()
        ready, _, _ = select.select([self.process.stdout], [], [], 30)
        said = self.process.stdout.readline() if ready else "no answer in 30 s"
        assert said.strip() == "planted", f"planting {op['kind']} at {op['path']} as nobody: {said}"

    def close(self) -> None:
        with contextlib.suppress(Exception):
            if self.process.stdin:
                self.process.stdin.close()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _text(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), allow_nan=True)


def _deep() -> str:
    return "[" * DEEP + "]" * DEEP


def _wrong(value: str) -> str:
    """A value of the wrong type, as text: a list where a number or an object was, a
    superscript digit where a number was, an object where text was."""
    try:
        parsed = json.loads(value)
    except ValueError:
        return '{"a": [1]}'
    if isinstance(parsed, (int, float)) and not isinstance(parsed, bool):
        return "\u00b2"
    if isinstance(parsed, dict):
        return "[1]"
    if isinstance(parsed, list):
        return '{"a": 1}'
    return "[[1]]"


def _nonfinite(value: str, i: int) -> str:
    try:
        parsed = json.loads(value)
    except ValueError:
        return ("nan", "inf", "-inf", "1e999")[i % 4]
    if isinstance(parsed, (int, float)) and not isinstance(parsed, bool):
        return ("nan", "inf", "-inf", "1e999")[i % 4]
    if isinstance(parsed, dict):
        return _text({k: float(("nan", "inf", "-inf")[j % 3]) for j, k in enumerate(parsed)} or {"x": float("nan")})
    return "NaN"


def _blob_lines(blob: bytes | None, make) -> bytes | None:  # noqa: ANN001
    """A blob of JSON lines (a run's facts, an attempt's), each line remade by ``make``."""
    if not blob:
        return blob
    lines = bytes(blob).split(b"\n")
    out = []
    for i, line in enumerate(lines):
        if not line:
            out.append(line)
            continue
        try:
            item = json.loads(line)
        except ValueError:
            out.append(line)
            continue
        out.append(make(item, i).encode("utf-8", "surrogatepass"))
    return b"\n".join(out)


def _chunk_blob(blob: bytes | None, make) -> bytes | None:  # noqa: ANN001
    """A chunk's blob (one JSON list of [number, record]), its records remade by ``make``."""
    try:
        items = json.loads(bytes(blob))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return blob
    return make(items, 0).encode()


def content(kind: str, record: dict[str, str], blob: bytes | None, chunk: bool = False) -> tuple[bytes, bytes | None]:
    """The record line and the blob a store file planted as ``kind`` holds, made from the
    real ``record`` and ``blob`` the code wrote there."""
    lines = _chunk_blob if chunk else _blob_lines
    if kind == "nested":  # each value, and each line of the blob, nested DEEP deep
        text = _text({k: _deep() for k in record})
        return text.encode() + b"\n", lines(blob, lambda item, i: _deep())
    if kind == "nested-record":  # the record itself nested DEEP deep
        return ('{"a": ' + _deep() + "}\n").encode(), blob
    if kind == "types":  # each value text of the wrong type; each line of the blob a list
        text = _text({k: _wrong(v) for k, v in record.items()})
        return text.encode() + b"\n", lines(
            blob,
            lambda item, i: (
                _text([1]) if i % 2 == 0 else _text({k: [1] for k in item} if isinstance(item, dict) else {"fact": 5})
            ),
        )
    if kind == "types-record":  # values that are not text at all
        plain = [5, [1], None, True, {"a": 1}, 1.5]
        return _text({k: plain[i % len(plain)] for i, k in enumerate(record)}).encode() + b"\n", blob
    if kind == "nonfinite":
        text = _text({k: _nonfinite(v, i) for i, (k, v) in enumerate(record.items())})

        def nonfinite_line(item: Any, i: int) -> str:
            if isinstance(item, dict):
                return _text({k: (float("nan") if k not in ("fact", "node", "host") else v) for k, v in item.items()})
            return _text([[float("inf"), {"x": "nan"}]] if chunk else float("nan"))

        return text.encode() + b"\n", lines(blob, nonfinite_line)
    if kind == "not-utf8":  # a whole, checksummed file whose record is not UTF-8
        text = _text(record).encode()
        return text[:-1] + b', "\xff\xfe": "\xc3\x28\xa0\xa1"}\n', (b"\xff\xfe\xfd\n" + (blob or b"")) if blob else blob
    raise ValueError(kind)


@dataclass
class Site:
    """One place to plant: a store-relative name (an entry's, or a folder's) in some store."""

    what: str  # the table's name, e.g. "attempt" or "folder of attempt"
    name: str  # the store name (an entry) or the folder's store-relative path
    entry: bool

    @property
    def path(self) -> str:
        return self.name + ".rec" if self.entry else self.name


def sites(study: str = STUDY, run: str = RUN, key: str = "sha256:" + _KEY_HEX) -> dict[str, Site]:
    """Every place to plant for one study, one run and one cache key, by what it is: the
    entries' names made by the code's functions, and each folder they lie in (named by its
    shape, ``folder <study>/trial``, ``folder run/<run>/chunk``, so a case is named alike
    whatever the names)."""
    from somatize import computing, keys
    from somatize.record import recorder, reports
    from somatize.study import history

    judge = [n for n in names() if n.what == "claim judge"][0]
    entries = {
        "cache entry": keys.cache_name(key),
        "claim": computing._PREFIX + key,
        "study definition": f"{study}/study",
        "attempt": history.attempt_name(study, TRIAL, 0),
        "fence": history.attempt_name(study, TRIAL, 1),  # the next attempt of an abandoned one
        "study judge": f"{study}/judge/{RUNNER}",
        "forward record": recorder.entry_name(run, TRIAL),
        "chunk": recorder.chunk_name(run, 0),
        "run end": recorder.end_name(run),
        "machine report": reports._MACHINES + MACHINE,
    }
    out = {what: Site(what, name, True) for what, name in entries.items()}
    shapes = {study: "<study>", run: "<run>", f"{TRIAL:06d}": "<n>", key: "<key>"}
    for name in [*entries.values(), *judge.folders()]:
        parts = name.split("/")
        for i in range(1, len(parts) + (name in judge.folders())):
            folder = "/".join(parts[:i])
            shape = "/".join(shapes.get(p, p) for p in parts[:i])
            out.setdefault(f"folder {shape}", Site(f"folder {shape}", folder, False))
    return out


#: What the code writes at a site, for sites planted before it wrote there: an attempt of
#: a runner (``study/attempt.py``'s record), claimed and running.
SHAPES: dict[str, dict[str, str]] = {
    what: {
        "trial": str(TRIAL),
        "attempt": str(attempt),
        "config": '{"x": 1.0}',
        "state": "running",
        "score": "",
        "took_us": "5",
        "runner": "a-writer",
        "error": "",
        "facts": "0",
    }
    for what, attempt in (("attempt", 0), ("fence", 1))
}


def plant_at(planter: Planter, store: Path, site: Site, kind: str, targets: Path, *, old: int | None = None) -> None:
    """Plant ``kind`` at ``site`` in the store folder ``store`` (its folders open to others),
    from the real entry the code wrote there when there is one."""
    from somatize import FolderStore
    from somatize.errors import Missing

    where = store / site.path
    # Where the code wrote nothing yet, a record of the shape it writes there, so a damaged
    # one damages what a reader checks (an attempt's state, score and config), not a field
    # no reader looks at.
    record: dict[str, str] = dict(SHAPES.get(site.what, {"by": "a writer of this folder"}))
    blob: bytes | None = None
    if site.entry:
        with contextlib.suppress(Missing, OSError, Exception):
            record, found = FolderStore(store).entry(site.name)
            blob = bytes(found) if found is not None else None
    op: dict[str, Any] = {"path": str(where), "kind": kind}
    if old is not None:
        op["old"] = old
    if kind in ("nested", "nested-record", "types", "types-record", "nonfinite", "not-utf8") and site.entry:
        line, blob = content(kind, record, blob, chunk="/chunk/" in site.name)
        op["record"], op["blob"] = line.hex(), None if blob is None else blob.hex()
    elif kind == "not-utf8":  # where a folder belongs: a file of bytes that are not UTF-8
        op["kind"], op["record"] = "raw", b"\xff\xfe\xc3\x28 not text \xa0\xa1\n".hex()
    elif kind == "folder":
        op["record"] = (_text(record) + "\n").encode().hex()
    elif kind == "link-file":
        op["target"] = str(targets / "file.rec")
    elif kind == "link-folder":
        op["target"] = str(targets / "folder")
    elif kind == "link-nothing":
        op["target"] = str(targets / "nothing-here")
    elif kind == "deep":
        op["depth"] = DEEP_CHAIN
    elif kind == "sparse":
        op["length"], op["entry"] = SPARSE_BYTES, site.entry
        op["record"] = (_text(record) + "\n").encode().hex()
    _open_folders(store, site.path)
    open_all(store)  # what the piece wrote before the plant too: the writer may replace any of it
    planter.plant(**op)


def _open_folders(store: Path, path: str) -> None:
    """What a group-writable store gives everyone in the group: write in each folder on the way."""
    folder = store
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o777)
    for part in Path(path).parts[:-1]:
        folder = folder / part
        if folder.is_symlink() or not folder.is_dir():
            return
        folder.chmod(0o777)


def open_all(folder: Path) -> None:
    """Every folder under ``folder`` open to others, as a group-writable store's are."""
    for path in [folder, *folder.rglob("*")]:
        if path.is_dir() and not path.is_symlink():
            path.chmod(0o777)


def make_targets(base: Path, planter: Planter) -> Path:
    """What the links point at: a store file, a folder holding one (both `nobody`'s), and nothing."""
    targets = base / "targets"
    targets.mkdir()
    targets.chmod(0o777)
    planter.plant(
        path=str(targets / "file.rec"), kind="store", record=(_text({"by": "link target"}) + "\n").encode().hex()
    )
    planter.plant(
        path=str(targets / "folder" / "0.rec"),
        kind="store",
        record=(_text({"by": "link target"}) + "\n").encode().hex(),
    )
    return targets


# -- the prober: checks forked from one warm process -------------------------------------------

PARALLEL = 8  # checks at once: hung checks (asleep, mostly) overlap their waits; the machine is shared


@dataclass
class Measured:
    """What one check did, as the prober saw it."""

    id: str
    rc: int | None = None  # the child's exit status (None: killed past its time)
    hung: bool = False
    wall: float = 0.0
    cpu: float = 0.0
    memory: int = 0  # peak bytes beyond the prober's own
    fds_before: int = 0
    fds_after: int = 0
    fds_most: int = 0
    stdout: str = ""
    stderr: str = ""
    result: dict[str, Any] = field(default_factory=dict)


def _fds(pid: int | str = "self") -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def _rss(pid: int | str = "self", key: str = "VmRSS") -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _cpu(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


class Tenfold(Node):
    """The cached node every forward check runs: ``10 * x + 1``."""

    def forward(self, x):  # noqa: ANN001, ANN201
        return 10 * x + 1


def node():  # noqa: ANN201
    return Tenfold().named("tenfold").frozen().cached()


def _op(op: str, spec: dict[str, Any]) -> dict[str, Any]:
    """One check's piece, run in the forked child; what it answered."""
    if op == "forward":
        from somatize import FolderStore, computing

        if spec.get("patience"):
            computing.PATIENCE = spec["patience"]
        graph = node()
        answers = [
            graph.forward(spec["x"], store=FolderStore(spec["store"]), deadline=spec.get("deadline"))
            for _ in range(spec.get("times", REPEAT))
        ]
        return {"answers": answers}
    if op == "command":
        from somatize.__main__ import main

        try:
            return {"rc": main(spec["argv"])}
        except SystemExit as exc:
            return {"rc": exc.code if isinstance(exc.code, int) else 2}
    if op == "readers":
        return _readers(spec)
    raise ValueError(op)


def _summary(value: Any) -> Any:
    """What a reader answered, small: enough to judge it, never the whole of it."""
    if isinstance(value, list):
        return {"len": len(value), "items": [_summary(v) for v in value[:8]]}
    if isinstance(value, dict):
        return {
            str(k)[:40]: (v if isinstance(v, (int, str, type(None))) and len(str(v)) < 80 else type(v).__name__)
            for k, v in list(value.items())[:12]
        }
    if isinstance(value, tuple):
        return [_summary(v) for v in value]
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else str(value)
    return value if isinstance(value, (int, str, type(None))) else type(value).__name__


READERS = (
    "runs",
    "forwards",
    "curve",
    "curve_costs",
    "facts",
    "nodes",
    "fleet",
    "latest",
    "trials",
    "best",
    "machines",
    "scores",
    "run_end",
)


def _readers(spec: dict[str, Any]) -> dict[str, Any]:
    """Every reader of ``somatize.record`` over one store, each ``REPEAT`` times; per reader
    what it answered (or raised), and the descriptors it left."""
    import traceback

    from somatize import FolderStore, record

    store = FolderStore(spec["store"])
    calls = {
        "runs": lambda: record.runs(store),
        "forwards": lambda: record.forwards(store, RUN),
        "curve": lambda: record.curve(store, RUN),
        "curve_costs": lambda: record.curve_costs(store, RUN),
        "facts": lambda: record.facts(store, RUN, spec.get("forward", TRIAL)),
        "nodes": lambda: record.nodes(store, RUN),
        "fleet": lambda: record.fleet(store, RUN),
        "latest": lambda: record.latest(store),
        "trials": lambda: record.trials(store, STUDY),
        "best": lambda: record.best(store, STUDY),
        "machines": lambda: str(record.machines(store, RUN, as_text=True)),
        "scores": lambda: str(record.scores(store, STUDY, as_text=True)),
        "run_end": lambda: record.run_end(store, RUN),
    }
    out: dict[str, Any] = {}
    progress = Path(spec["progress"])
    for name in spec["readers"]:
        progress.write_text(name)
        before = _fds()
        try:
            answers = [calls[name]() for _ in range(REPEAT)]
            out[name] = {"answer": _summary(answers[-1]), "fds": _fds() - before}
        except BaseException as exc:  # noqa: BLE001 - what a reader raised is what is measured
            out[name] = {
                "raised": f"{type(exc).__name__}: {str(exc)[:300]}",
                "traceback": "".join(traceback.format_exception(exc))[-1500:],
                "fds": _fds() - before,
            }
    progress.write_text("")
    return out


def _child(command: dict[str, Any], folder: Path) -> None:
    """In the forked child: run the check, its output and answer into files; never return."""
    code = 0
    try:
        out = os.open(folder / "stdout", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        err = os.open(folder / "stderr", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.close(out)
        os.close(err)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        import traceback

        before = _fds()
        try:
            result = _op(command["op"], command["spec"])
        except BaseException as exc:  # noqa: BLE001 - a crash is what is measured
            result = {
                "raised": f"{type(exc).__name__}: {str(exc)[:300]}",
                "traceback": "".join(traceback.format_exception(exc))[-3000:],
            }
        import gc

        gc.collect()
        result["fds_before"], result["fds_after"] = before, _fds()
        sys.stdout.flush()
        sys.stderr.flush()
        (folder / "result.json").write_text(json.dumps(result, default=str))
    except BaseException:  # noqa: BLE001
        code = 3
    finally:
        os._exit(code)


def prober_main() -> None:
    """The prober: import, warm up, then fork a child per command read (``PARALLEL`` at once)."""
    from somatize import FolderStore

    warm = Path(tempfile.mkdtemp(prefix="hostile-warm-"))
    try:  # every import a check needs, done once here
        import optuna  # noqa: F401

        import somatize.__main__  # noqa: F401
        import somatize.record  # noqa: F401
        import somatize.study.command  # noqa: F401

        node().forward(1, store=FolderStore(warm))
        _readers({"store": str(warm), "readers": READERS, "progress": str(warm / "progress")})
    finally:
        shutil.rmtree(warm, ignore_errors=True)
    print("ready", flush=True)
    waiting: list[dict[str, Any]] = []
    running: dict[int, tuple[dict[str, Any], float, int, int]] = {}
    reading, pending = True, b""
    while reading or waiting or running:
        if reading:  # the commands as they come, read from the descriptor (no buffer select cannot see)
            ready, _, _ = select.select([0], [], [], 0.02 if running or waiting else None)
            if ready:
                chunk = os.read(0, 1 << 20)
                if not chunk:
                    reading = False
                pending += chunk
                *lines, pending = pending.split(b"\n")
                waiting += [json.loads(line) for line in lines if line.strip()]
        while waiting and len(running) < PARALLEL:
            command = waiting.pop(0)
            folder = Path(command["folder"])
            folder.mkdir(parents=True, exist_ok=True)
            base_rss = _rss()
            pid = os.fork()
            if pid == 0:
                _child(command, folder)
            running[pid] = (command, time.monotonic(), base_rss, _fds(pid))
        for pid, (command, started, base_rss, fds) in list(running.items()):
            done, status, usage = os.wait4(pid, os.WNOHANG)
            most = max(fds, _fds(pid)) if done == 0 else fds
            running[pid] = (command, started, base_rss, most)
            late = done == 0 and time.monotonic() - started > command["timeout"]
            if late:
                cpu = _cpu(pid)
                os.kill(pid, signal.SIGKILL)
                _, status, usage = os.wait4(pid, 0)
            elif done == 0:
                continue
            del running[pid]
            folder = Path(command["folder"])
            result_file = folder / "result.json"
            said = json.loads(result_file.read_text()) if result_file.exists() else {}
            measured = Measured(
                id=command["id"],
                rc=None if late else os.waitstatus_to_exitcode(status),
                hung=late,
                wall=time.monotonic() - started,
                cpu=cpu if late else usage.ru_utime + usage.ru_stime,
                memory=max(0, usage.ru_maxrss * 1024 - base_rss),
                fds_before=said.pop("fds_before", 0),
                fds_after=said.pop("fds_after", 0),
                fds_most=most,
                stdout=_tail(folder / "stdout"),
                stderr=_tail(folder / "stderr"),
                result=said,
            )
            if late:
                progress = folder / "progress"
                if progress.exists() and progress.read_text():
                    measured.result["hung_in"] = progress.read_text()
            print(json.dumps(measured.__dict__), flush=True)
        if running and not reading:
            time.sleep(0.02)


def _tail(path: Path, most: int = 20_000) -> str:
    """What a child printed: its beginning and its end, each line cut to 2,000 characters
    (a line that quotes a planted nesting whole is 200 KB)."""
    try:
        data = path.read_bytes()
    except OSError:
        return ""
    text = data.decode("utf-8", "replace")
    lines = [line if len(line) <= 2000 else line[:2000] + f"... ({len(line)} characters)" for line in text.splitlines()]
    text = "\n".join(lines)
    return text if len(text) <= 2 * most else text[:most] + "\n...\n" + text[-most:]


class Prober:
    """The prober process, from the test's side: ``run(commands)`` answers each one."""

    def __init__(self, env: dict[str, str]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", "import hostile_folders; hostile_folders.prober_main()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
        )
        self._pending = b""
        assert self._line(120) == "ready", "the prober did not start"

    def _line(self, seconds: float) -> str:
        """The next line the prober says, read from its descriptor (so that select sees
        every byte not yet taken: a buffered reader would hide the lines it read ahead)."""
        assert self.process.stdout
        until = time.monotonic() + seconds
        while b"\n" not in self._pending:
            ready, _, _ = select.select([self.process.stdout.fileno()], [], [], max(0.0, until - time.monotonic()))
            if not ready:
                return ""
            chunk = os.read(self.process.stdout.fileno(), 1 << 20)
            if not chunk:
                return ""
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return line.decode().strip()

    def run(self, commands: list[dict[str, Any]], longest: float) -> dict[str, Measured]:
        assert self.process.stdin
        for command in commands:
            self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        out: dict[str, Measured] = {}
        until = time.monotonic() + longest
        while len(out) < len(commands) and time.monotonic() < until:
            line = self._line(until - time.monotonic())
            if line:
                measured = Measured(**json.loads(line))
                out[measured.id] = measured
        return out

    def close(self) -> None:
        with contextlib.suppress(Exception):
            if self.process.stdin:
                self.process.stdin.close()
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


# -- verdicts ------------------------------------------------------------------------------------


def naming(stderr: str, site: Site) -> list[str]:
    """The lines of ``stderr`` that name the planted name (or its last part, where that
    alone names it: a cache key)."""
    last = site.name.rsplit("/", 1)[-1]
    needles = [site.name] + ([last] if len(last) >= 16 else [])
    # the name itself, not a longer name it begins ("run" in "run/r/1" names the run, not `run`)
    found = re.compile("|".join(r"(?<![\w.-])" + re.escape(needle) + r"(?![\w/-])" for needle in needles))
    return [line for line in stderr.splitlines() if found.search(line)]


def verdict(measured: Measured | None, site: Site, kind: str, *, line_needed: bool = True) -> list[str]:
    """The faults one check shows: each a short sentence; none when it kept every bound."""
    if measured is None:
        return ["no answer from the prober (it stopped or ran past its time)"]
    faults = []
    if measured.hung:
        where = measured.result.get("hung_in")
        faults.append(f"hung: still running after {measured.wall:.1f} s" + (f" (in {where})" if where else ""))
    elif measured.rc not in (0,):
        faults.append(f"its process ended with status {measured.rc}")
    raised = measured.result.get("raised")
    if raised:
        faults.append(f"raised {raised}")
    if "Traceback (most recent call last)" in measured.stderr:
        faults.append("printed a traceback: " + measured.stderr.strip().splitlines()[-1][:200])
    if measured.cpu > SPIN_ALLOWANCE_S + SPIN_SHARE * measured.wall:
        faults.append(f"spun: {measured.cpu:.1f} s of CPU in {measured.wall:.1f} s")
    leaked = (measured.fds_most if measured.hung else measured.fds_after) - measured.fds_before
    if leaked > FD_SLACK and not measured.hung:
        faults.append(f"leaked {leaked} descriptors")
    if measured.memory > MEMORY_MAX:
        faults.append(f"grew by {measured.memory >> 20} MiB")
    if line_needed and not measured.hung:
        said = naming(measured.stderr, site)
        if not said:
            faults.append(f"said no line naming {site.name!r}")
        elif len(said) > LINES_MAX:
            faults.append(f"said {len(said)} lines naming {site.name!r} (at most {LINES_MAX})")
    return faults
