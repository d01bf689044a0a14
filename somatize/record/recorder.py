"""Writing the record: a :class:`Recorder` files the facts of each forward into one entry.

A recorder is a watcher. It collects the facts of the forward that is open and, when
``finished`` or ``broke`` arrives, writes one entry ``run/<run>/<n>``: a small record a scan
can answer from (``run``, ``forward``, ``took_us``, ``state``, ``nodes``, ``facts`` and the
summarised ``<kind>.<field>`` values), and a blob with every fact of that forward, one JSON
object per line, in the order they arrived. A fact outside the engine's vocabulary
(``loss``, ``updated``, ``said``) comes after the forward it is about, so it is filed into
the record that closed last, which is written again.

Where entries are named (``run/<run>/<n>``) is this module's; the readers find them through
:func:`records_of` and :func:`entry_name`. Nothing here reads a blob.
"""

from __future__ import annotations

import json
import re
import secrets
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from ..errors import BadName, Missing, StoreError
from ..facts import CLOSING, ENGINE, Fact
from ..store import FolderStore, Store, check_name
from .shapes import Malformed, left_out, plain_json, read_blob, small_record

RUNS = "run/"
NUMBER = re.compile(r"[0-9]+")
#: Forwards a chunk holds. Each time a chunk of a run is whole (its last forward can no
#: longer be written again: the next one closed), the recorder also writes their records in
#: one entry, ``run/<run>/chunk/<k>`` (forwards ``k * CHUNK`` to ``(k + 1) * CHUNK - 1``), so
#: that the first look at a long run reads a hundred entries instead of a hundred thousand
#: (:func:`chunk_records`; the view's first look uses them). A chunk is what this recorder
#: wrote: a forward put again afterwards is newer than its chunk, and read on its own.
CHUNK = 1000
CHUNKS = "chunk"
#: The longest chunk file read back (bytes): a recorder's thousand records are a few hundred KiB.
CHUNK_MOST = 32 << 20
#: The entry that says a run ended, and how (``run/<run>/end``: ``how`` is ``ok`` or ``broke``,
#: ``forwards`` how many it had): written by :meth:`Recorder.close`, or when a watcher hears
#: the fact `ENDED` (``Trainer.fit`` says it as it returns or raises). A forward written after
#: it makes the run one that goes on (the readers compare their stamps).
END = "end"
#: The fact that a run (or a fit of it) ended: ``{"fact": "ended", "how": "ok" | "broke"}``.
ENDED = "ended"
_KIND = re.compile(r"[A-Za-z0-9_-]+")


class Recorder:
    """A watcher that writes one record per forward into ``store``, under ``run/<run>/<n>``.

    ``run`` names the run; a run nobody named gets a sortable UTC name such as
    ``2026-11-29T10-01-02-ab12`` (see :attr:`run`). Giving the name of a run that already
    has records continues its numbering. ``summarising`` lists the kinds (``["loss"]``)
    whose fields are copied into the record itself as ``<kind>.<field>``, so a scan can
    draw their curve without reading a blob; when a kind is said several times in one
    forward, the last value of each field wins.

    Facts of the engine's vocabulary belong to the forward that is open; ``finished`` or
    ``broke`` close it and only then is anything written. Any other fact is filed into the
    forward that closed last, and that entry is written again. One said before any forward
    of this recorder closed waits, and is filed with the first one.

    Facts may arrive from several threads at once. Forwards run at the same time into one
    recorder each keep their own facts: the engine asks the recorder for a watcher of one
    forward (:meth:`for_forward`), and a forward is numbered when it closes.
    """

    def __init__(self, store: Store, run: str | None = None, summarising: Iterable[str] = ()) -> None:
        if not isinstance(store, Store):
            raise TypeError(
                f"Recorder(store) needs a store (something with put, scan and fetch, such as "
                f"`FolderStore(path)`); got a `{type(store).__name__}`."
            )
        self._store = store
        self._summarising = _kinds(summarising)
        self._lock = threading.Lock()
        if run is None:
            self._run, self._next = _fresh_run(store)
        else:
            self._run = check_run(run, "Recorder(run=...)")
            self._next = _next_number(store, self._run)
        self._open: list[Fact] = []
        self._open_lines: list[bytes] = []
        self._kept: dict[int, dict[str, str]] = {}  # the records of the chunk not yet whole
        # the forward that closed last: its number, facts and written lines
        self._last: tuple[int, list[Fact], list[bytes]] | None = None

    @property
    def run(self) -> str:
        """The run's name, given or made up; ``runs(store)`` lists it once a forward closed."""
        return self._run

    @property
    def summarising(self) -> tuple[str, ...]:
        return self._summarising

    def __repr__(self) -> str:
        extra = f", summarising={list(self._summarising)!r}" if self._summarising else ""
        return f"Recorder({self._store!r}, run={self._run!r}{extra})"

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> None:
        self.close(how="ok" if kind is None else "broke")

    def close(self, how: str = "ok") -> None:
        """Say that the run ended, ``how`` (``"ok"`` or ``"broke"``): the view shows it ended
        rather than gone silent. Nothing stops a later forward (the run then goes on); the
        recorder holds nothing to let go of. ``with Recorder(...) as rec:`` closes it."""
        if how not in ("ok", "broke"):
            raise ValueError(f'a run ends "ok" or "broke"; got {how!r}')
        with self._lock:
            self._store.put(end_name(self._run), {"run": self._run, "how": how, "forwards": str(self._next)})

    def __call__(self, fact: Mapping[str, str]) -> None:
        """Take one fact: file it, and write when a forward closes or a closed one grows."""
        f = _checked(fact)
        if f["fact"] == ENDED:  # not a forward's: the run's end, in an entry of its own
            self.close("broke" if f.get("how") == "broke" else "ok")
            return
        line = _line(f)
        with self._lock:
            # the lock is held across the put, so two rewrites of one entry land in order
            kind = f["fact"]
            if kind in ENGINE or self._last is None:
                self._open.append(f)
                self._open_lines.append(line)
                if kind in CLOSING:
                    number, self._next = self._next, self._next + 1
                    self._last = (number, self._open, self._open_lines)
                    self._open, self._open_lines = [], []
                    self._write(number, self._last[1], self._last[2])
            else:
                number, filed, lines = self._last
                filed.append(f)
                lines.append(line)
                self._write(number, filed, lines)

    def for_forward(self) -> _OneForward:
        """A watcher for one forward: its engine facts are kept apart from any other
        forward's until it closes. The engine calls this once per forward."""
        return _OneForward(self)

    def _close(self, filed: list[Fact], lines: list[bytes]) -> None:
        with self._lock:
            if self._open:  # said before any forward closed: filed with the first
                filed, lines = self._open + filed, self._open_lines + lines
                self._open, self._open_lines = [], []
            number, self._next = self._next, self._next + 1
            self._last = (number, filed, lines)
            self._write(number, filed, lines)

    def _write(self, number: int, filed: list[Fact], lines: list[bytes]) -> None:
        record = _summary(self._run, number, filed, self._summarising)
        self._store.put(entry_name(self._run, number), record, list(lines))
        first = number not in self._kept
        self._kept[number] = record
        if first and number % CHUNK == 0 and number:  # the chunk before is whole now
            self._write_chunk(number // CHUNK - 1)

    def _write_chunk(self, k: int) -> None:
        """The records of chunk ``k`` in one entry, if this recorder wrote all of them (one
        that went on with a run from its middle did not: that chunk is left unwritten)."""
        numbers = range(k * CHUNK, (k + 1) * CHUNK)
        records = [(n, self._kept.pop(n)) for n in numbers if n in self._kept]
        if len(records) == CHUNK:
            self._store.put(
                chunk_name(self._run, k),
                {"run": self._run, "first": str(k * CHUNK), "count": str(CHUNK)},
                json.dumps(records).encode("ascii"),
            )


class _OneForward:
    """What a :class:`Recorder` hands the engine for one forward."""

    __slots__ = ("_recorder", "_facts", "_lines", "_lock")

    def __init__(self, recorder: Recorder) -> None:
        self._recorder = recorder
        self._facts: list[Fact] = []
        self._lines: list[bytes] = []
        self._lock = threading.Lock()  # this forward's branches report from several threads

    def __call__(self, fact: Mapping[str, str]) -> None:
        f = _checked(fact)
        if f["fact"] not in ENGINE:
            self._recorder(f)  # said by someone else: the recorder files it
            return
        with self._lock:
            self._facts.append(f)
            self._lines.append(_line(f))
            if f["fact"] not in CLOSING:
                return
            filed, lines = self._facts, self._lines
            self._facts, self._lines = [], []
        self._recorder._close(filed, lines)


def _summary(run: str, number: int, filed: list[Fact], summarising: tuple[str, ...]) -> dict[str, str]:
    """The record of one forward: everything in it follows from its facts alone."""
    closing: Fact = {}
    names: set[str] = set()
    summaries: dict[str, str] = {}
    for f in filed:
        kind = f["fact"]
        if kind in CLOSING:
            closing = f
        elif kind in ("ran", "recalled") and "node" in f:
            names.add(f["node"])
        if kind in summarising:
            for field, value in f.items():
                if field != "fact":
                    summaries[f"{kind}.{field}"] = value
    record = {
        "run": run,
        "forward": str(number),
        "state": "broke" if closing.get("fact") == "broke" else "ok",
        "nodes": str(len(names)),
        "facts": str(len(filed)),
    }
    if "took_us" in closing:
        record["took_us"] = closing["took_us"]
    if record["state"] == "broke" and "error" in closing:
        record["error"] = closing["error"]
    if summarising:
        record["summarising"] = " ".join(summarising)
    record.update(summaries)
    return record


def _checked(fact: object) -> Fact:
    if not isinstance(fact, Mapping):
        raise TypeError(
            f"a recorder is told facts, which are dicts of text; got a `{type(fact).__name__}`. "
            f"Build one with `somatize.fact('loss', value=0.25)`."
        )
    out: Fact = {}
    for key, value in fact.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(
                f"a fact is a dict of text, and this one holds {key!r}: {value!r} "
                f"(a `{type(value).__name__}`). Build it with `somatize.fact(...)`, which "
                f"writes numbers down as text."
            )
        out[key] = value
    if not out.get("fact"):
        raise TypeError(
            f"a fact names its kind under 'fact', and this one does not: {out!r}. "
            f"Build it with `somatize.fact('loss', value=0.25)`."
        )
    return out


def _line(f: Fact) -> bytes:
    try:
        return (json.dumps(f, ensure_ascii=False) + "\n").encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: escape everything, still exact
        return (json.dumps(f) + "\n").encode("ascii")


def _kinds(summarising: object) -> tuple[str, ...]:
    if isinstance(summarising, str) or not isinstance(summarising, Iterable):
        raise TypeError(f"`summarising=` takes a list of kinds, such as `['loss']`; got {summarising!r}.")
    kinds: list[str] = []
    for kind in summarising:
        if not isinstance(kind, str) or not _KIND.fullmatch(kind):
            raise ValueError(
                f"`summarising=` names kinds of facts, such as 'loss': letters, digits, '_' "
                f"and '-' (no dot: the record calls a field '<kind>.<field>'); got {kind!r}."
            )
        if kind not in kinds:
            kinds.append(kind)
    return tuple(kinds)


def check_run(run: object, where: str) -> str:
    if not isinstance(run, str):
        raise BadName(f"{where}: a run's name is a str, not a `{type(run).__name__}`.")
    if "/" in run:
        raise BadName(f"{where}: a run's name is one store name component, with no '/'; got {run!r}.")
    try:
        check_name(entry_name(run, 0))
    except BadName as exc:
        raise BadName(f"{where}: {run!r} cannot name a run. {exc}") from None
    return run


def _fresh_run(store: Store) -> tuple[str, int]:
    """A name nobody used: UTC time to the second (so names sort), and a random suffix."""
    stamp = time.strftime("%Y-%m-%dT%H-%M-%S", time.gmtime())
    while True:
        run = f"{stamp}-{secrets.token_hex(2)}"
        if _next_number(store, run) == 0:
            return run, 0


def _next_number(store: Store, run: str) -> int:
    numbers = forward_numbers(store, run)
    return numbers[-1] + 1 if numbers else 0


def forward_numbers(store: Store, run: str) -> list[int]:
    """The numbers of ``run``'s forwards, in order: from a listing where the store lists
    names alone (``FolderStore.names``), from a scan otherwise."""
    if isinstance(store, FolderStore):
        return sorted(number for number, _ in numbered(store.names(f"{RUNS}{run}/"), run))
    return [number for number, _ in records_of(store, run)]


def entry_name(run: str, number: int) -> str:
    return f"{RUNS}{run}/{number}"


def end_name(run: str) -> str:
    """Where ``run``'s end is said (`END`)."""
    return f"{RUNS}{run}/{END}"


def chunk_name(run: str, k: int) -> str:
    return f"{RUNS}{run}/{CHUNKS}/{k}"


def chunk_records(store: Store, run: str, k: int) -> dict[int, dict[str, str]] | None:
    """The records chunk ``k`` of ``run`` holds, by forward number; None where there is no
    such chunk or it is not what a recorder writes (it was written by someone else's
    process: each item is checked, and one that is not a forward of that chunk with a
    record of text spoils the chunk, whose forwards are then read one by one)."""
    name = chunk_name(run, k)
    try:
        blob = read_blob(store, name, CHUNK_MOST)
        items = plain_json(bytes(blob).decode("utf-8"), 3) if blob is not None else None
    except (Missing, StoreError):  # not there, or blocked (the store said so)
        return None
    except ValueError as exc:  # (Malformed and UnicodeDecodeError are ValueErrors)
        left_out(store, name, f"{exc}; its forwards are read one by one")
        return None
    if not isinstance(items, list) or len(items) > CHUNK:
        left_out(store, name, f"its blob is not a list of at most {CHUNK} forwards; they are read one by one")
        return None
    out: dict[int, dict[str, str]] = {}
    for item in items:
        if not (
            isinstance(item, list)
            and len(item) == 2
            and type(item[0]) is int
            and k * CHUNK <= item[0] < (k + 1) * CHUNK
            and isinstance(item[1], dict)
            and all(type(v) is str for v in item[1].values())
        ):
            left_out(
                store,
                name,
                f"an item of it is not [a forward of chunk {k}, a record of text]; its forwards are read one by one",
            )
            return None
        out[item[0]] = item[1]
    return out


def records_of(store: Store, run: str) -> list[tuple[int, dict[str, str]]]:
    """The records of one run, by forward number: one scan. A record too big to be a
    recorder's (:data:`.shapes.RECORD_MOST`) is left out with one line."""
    found = []
    for number, record in numbered(store.scan(f"{RUNS}{run}/"), run):
        try:
            found.append((number, small_record(record)))
        except Malformed as exc:
            left_out(store, entry_name(run, number), exc)
    found.sort(key=lambda item: item[0])
    return found


def numbered(entries: Iterable, run: str) -> Iterator[tuple[int, Any]]:
    """``(forward number, what came with it)`` for the entries of ``run`` that are forwards,
    from ``(name, x)`` pairs or from names alone."""
    start = len(RUNS) + len(run) + 1
    for entry in entries:
        name, x = (entry, None) if isinstance(entry, str) else entry
        rest = name[start:]
        if NUMBER.fullmatch(rest):
            yield int(rest), x
