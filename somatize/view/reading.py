"""The store as the view reads it: bounded, read-only, and never crashed, swollen or leaked.

Everything the view shows comes from files others may write (a colleague in the store's
group, as the runbook sets it up), so every read here is made the same way:

- the name is opened from the root one folder at a time, never through a link
  (``somatize.folders``), without blocking (a FIFO answers at once);
- ``fstat`` first: what is not a regular file (a folder where an entry belongs, a FIFO, a
  socket) is *blocked*, read as nothing stored, with one line on stderr naming it;
- sizes are checked before a byte is read, by the file's length (a sparse file counts by
  its length, not by what it holds on disk): a record longer than :data:`MOST_RECORD`, a
  forward's facts longer than :data:`MOST_FACTS`, any other blob longer than
  :data:`MOST_BLOB` is blocked too;
- a forward's facts are checked for the shape a recorder writes (one JSON object of text
  per line); a blob that is not that is read as no facts, with one line;
- every descriptor is closed whatever happens.

So a reader of :mod:`somatize.record` given a :class:`ViewStore` sees a damaged entry as a
missing one, and a page answers with what else there is. Nothing here writes: a put, a
create, a delete or a sweep raises.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import NoReturn

from ..errors import Missing, StoreError
from ..folders import Blocked as Held
from ..folders import Descent, LinkMet, open_file, tell_blocked, tell_link, tell_once
from ..record.recorder import CHUNKS, NUMBER, RUNS
from ..store import FolderStore
from ..store_file import scan_record
from ..store_names import SUFFIX as _SUFFIX
from ..store_names import check_name

#: The longest record the view reads (bytes written down): a forward's or a trial's
#: record is a few KiB; a longer one was not written by a recorder or a runner.
MOST_RECORD = 1 << 20
#: The longest blob of a forward's facts the view reads: some 20,000 facts.
MOST_FACTS = 4 << 20
#: The longest other blob (a run's chunk: a recorder's records of a thousand forwards).
MOST_BLOB = 32 << 20
#: The longest line of a forward's facts (one fact).
MOST_FACT = 64 << 10

_HEADER = re.compile(rb"SMZS1 ([0-9a-f]{8}) ([0-9a-f]{16}|-{16}) [0-9a-f]{8}\n")
_HEADER_SIZE = 41


class Blocked(Missing):
    """Something other than an entry a reader can use stands at a name: read as nothing."""


class ViewStore(FolderStore):
    """A ``FolderStore`` that only reads, each read bounded (see the module)."""

    def record(self, name: str) -> dict[str, str]:
        return self._entry(name, blob=False)[0]

    # no `admit`: the view reads an entry whole, each read bounded by its own limits
    def entry(self, name: str) -> tuple[dict[str, str], bytearray | None]:  # type: ignore[override]
        return self._entry(name, blob=True)

    def fetch(self, name: str) -> bytearray | None:
        return self._entry(name, blob=True)[1]

    def stamp(self, name: str) -> int:
        folders, file, path = self._where(name)
        fd = self._opened(name, folders, file, path)
        try:
            found = os.fstat(fd)
            if not stat.S_ISREG(found.st_mode):
                self._blocked(path, "is not a regular file")
            return found.st_mtime_ns
        finally:
            os.close(fd)

    def scan(self, prefix: str) -> Iterator[tuple[str, dict[str, str]]]:
        """The store's scan, each record read as `record` reads it: what is blocked is left
        out (with its one line), and never stops the scan."""
        with Descent(self.path) as descent:
            yield from self._records(descent, self._names(descent, prefix))

    def scan_names(self, names: Iterable[str]) -> Iterator[tuple[str, dict[str, str]]]:
        """The records of ``names``, read as `scan` reads them (a name with nothing there
        is skipped)."""
        checked = [check_name(name) for name in names]
        with Descent(self.path) as descent:
            yield from self._records(descent, checked)

    def _records(self, descent: Descent, names: Iterable[str]) -> Iterator[tuple[str, dict[str, str]]]:
        for name in names:
            *folders, last = name.split("/")
            path = self.path.joinpath(*folders, last + _SUFFIX)
            try:
                fd = open_file(descent.at(folders), last + _SUFFIX, name + _SUFFIX)
            except (FileNotFoundError, NotADirectoryError):
                continue  # gone since it was listed
            except LinkMet as exc:
                tell_link(self.path, str(exc.filename))
                continue
            except Held as exc:  # a FIFO, a socket, a folder where an entry or a file where a folder belongs
                tell_blocked(self.path, exc.where, exc.held)
                continue
            except OSError as exc:
                tell_once(path, f"somatize view: {path} cannot be opened ({exc.strerror or exc}); it is left out")
                continue
            try:
                record = self._read(fd, name, path, blob=False)[0]
            except Missing:
                continue
            finally:
                os.close(fd)
            yield name, record

    # -- what the view never does

    def put(self, name: str, record: object, blob: object = None) -> NoReturn:
        raise StoreError("the view only reads its store; nothing it does writes there")

    create = delete = sweep = put  # type: ignore[assignment]

    # -- one read

    def _entry(self, name: str, *, blob: bool) -> tuple[dict[str, str], bytearray | None]:
        folders, file, path = self._where(name)
        fd = self._opened(name, folders, file, path)
        try:
            return self._read(fd, name, path, blob=blob)
        finally:
            os.close(fd)

    def _opened(self, name: str, folders: list[str], file: str, path: Path) -> int:
        try:
            with Descent(self.path) as descent:
                return open_file(descent.at(folders), file, "/".join([*folders, file]))
        except (FileNotFoundError, NotADirectoryError):
            raise Missing(f"Nothing is stored under {name!r} in the store at {self.path}.") from None
        except LinkMet as exc:
            tell_link(self.path, str(exc.filename))
            raise Blocked(f"{path} is a link; the view never follows one.") from None
        except Held as exc:
            tell_blocked(self.path, exc.where, exc.held)
            raise Blocked(f"{path}: {exc.where} is {exc.held}, which no store writes.") from None
        except OSError as exc:  # a socket (ENXIO), a file closed to this user, ...
            self._blocked(path, f"cannot be opened ({exc.strerror or exc})")

    def _read(self, fd: int, name: str, path: Path, *, blob: bool) -> tuple[dict[str, str], bytearray | None]:
        found = os.fstat(fd)
        planted = (found.st_ino, found.st_ctime_ns)  # which file: one planted later is named again
        if not stat.S_ISREG(found.st_mode):
            self._blocked(path, "is not a regular file (a folder, a FIFO or a device where an entry belongs)", planted)
        size = found.st_size
        head = os.pread(fd, _HEADER_SIZE, 0)
        matched = _HEADER.fullmatch(head)
        if matched is None:
            self._blocked(path, "does not start with a store header", planted)
        record_len = int(matched[1], 16)
        blob_len = None if matched[2].startswith(b"-") else int(matched[2], 16)
        if record_len > MOST_RECORD:
            self._blocked(
                path, f"declares a record of {record_len} bytes; the view reads {MOST_RECORD} at most", planted
            )
        if _HEADER_SIZE + record_len + (blob_len or 0) != size:
            self._blocked(path, f"is {size} bytes long, not what its header declares", planted)
        try:
            record = scan_record(fd, path)  # the header and record again, checked (CRC, JSON of text)
        except StoreError as exc:
            self._blocked(path, str(exc), planted)
        if not blob or blob_len is None:
            return record, None
        most = _most_blob(name)
        if blob_len > most:
            tell_once(
                path,
                f"somatize view: {path} holds a blob of {blob_len} bytes; the view reads "
                f"{most} at most there, so it shows none (someone who may write the store wrote it)",
                planted,
            )
            return record, None
        data = _read_at(fd, blob_len, _HEADER_SIZE + record_len)
        if data is None:
            self._blocked(path, "ended early while it was read", planted)
        if _is_forward(name) and not _facts_shape(data):
            tell_once(
                path,
                f"somatize view: {path} holds facts that are not one JSON object of text per "
                "line, as a recorder writes them; the view shows none for it",
                planted,
            )
            return record, None
        return record, data

    def _blocked(self, path: Path, why: str, planted: object = None) -> NoReturn:
        tell_once(
            path,
            f"somatize view: {path} {why}; it is read as nothing stored (someone who may write the store put it there)",
            planted,
        )
        raise Blocked(f"{path} {why}.")


def _read_at(fd: int, size: int, offset: int) -> bytearray | None:
    data = bytearray(size)
    view = memoryview(data)
    done = 0
    while done < size:
        got = os.preadv(fd, [view[done:]], offset + done)
        if not got:
            return None
        done += got
    return data


def _is_forward(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 3 and parts[0] + "/" == RUNS and NUMBER.fullmatch(parts[2]) is not None


def _most_blob(name: str) -> int:
    if _is_forward(name):
        return MOST_FACTS
    parts = name.split("/")
    return MOST_BLOB if len(parts) == 4 and parts[2] == CHUNKS else MOST_FACTS


def _facts_shape(data: bytearray) -> bool:
    """Whether ``data`` is what a recorder writes as a forward's facts: UTF-8, lines of one
    JSON object each, of text, none longer than :data:`MOST_FACT`."""
    try:
        text = bytes(data).decode("utf-8")
    except UnicodeDecodeError:
        return False
    for line in text.split("\n"):
        if not line:
            continue
        if len(line) > MOST_FACT:
            return False
        try:
            fact = json.loads(line)
        except (ValueError, RecursionError):
            return False
        if not isinstance(fact, dict) or not all(type(v) is str for v in fact.values()):
            return False
    return True
