"""Where somatize keeps things: a store of named entries, each a small record and a blob.

A store is three verbs. ``put(name, record, blob)`` writes an entry (replacing what was
there), ``scan(prefix)`` lists the records under a prefix without touching a blob, and
``fetch(name)`` reads one blob. A record is a small ``dict[str, str]`` that a scan can answer
questions from; a blob is bytes nobody reads unless they ask for that one entry.

This module knows nothing of codecs, facts, keys or caching: the cache, the recorder and the
workers decide what names and records mean. ``FolderStore`` is the one implementation: a
folder, one file per name, written atomically (temp file, fsync, rename) so several
processes on several machines sharing that folder never see a torn entry.

Two more verbs let processes that share nothing but the folder coordinate (a
``ClaimingStore``): ``create(name, record, blob)`` writes an entry only if none is there
(temp file, then a hard link, which is atomic and exclusive on a local disk and on NFS), and
``stamp(name)`` says when an entry was last written in the store's own clock (the file's
modification time, set by this kernel on a local disk and by the file server on NFS). A
study claims trials with the first and judges whether an attempt is still being written
with the second, comparing stamps only with stamps.

It is not a database: nothing spans two names (no transactions, no locks), the only query is
a name prefix, and a put's durability is the file system's (data and rename are fsynced).
"""

from __future__ import annotations

import io
import json
import os
import re
import secrets
import threading
import time
import zlib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

from somatize.errors import BadName, Missing, StoreError

BytesLike = bytes | bytearray | memoryview
Blob = BytesLike | Sequence[BytesLike] | None


@runtime_checkable
class Store(Protocol):
    """Anything that can put, scan and fetch named entries.

    ``put`` replaces whatever was stored under ``name``. ``blob`` may be one bytes-like
    object or a list/tuple of them, written in order as one blob. ``scan`` yields
    ``(name, record)`` pairs for every name starting with ``prefix``, in plain string order,
    and never reads a blob. ``fetch`` returns the blob (``None`` when the entry was put
    without one) and raises ``Missing`` when nothing is stored under ``name``.
    """

    def put(self, name: str, record: Mapping[str, str], blob: Blob = None) -> None: ...

    def scan(self, prefix: str) -> Iterator[tuple[str, dict[str, str]]]: ...

    def fetch(self, name: str) -> bytes | bytearray | None: ...


@runtime_checkable
class ClaimingStore(Store, Protocol):
    """A store that several processes can coordinate through: the three verbs, and two more.

    ``create(name, record, blob=None) -> bool`` writes an entry only if none is stored under
    ``name`` and says whether it did: of several creators of one name, exactly one gets
    ``True``. ``stamp(name) -> int`` says when the entry was last written, in the store's
    own clock (nanoseconds): stamps of one store compare with each other, never with a
    machine's clock. Studies claim trials with ``create`` and judge whether an attempt is
    still being written with ``stamp``. ``FolderStore`` is one.
    """

    def create(self, name: str, record: Mapping[str, str], blob: Blob = None) -> bool: ...

    def stamp(self, name: str) -> int: ...


# -- names ------------------------------------------------------------------------------

_SUFFIX = ".rec"
_COMPONENT = re.compile(r"[A-Za-z0-9_:@+=-][A-Za-z0-9._:@+=-]*")
_PARTIAL = re.compile(r"[A-Za-z0-9._:@+=-]*")
_COMPONENT_MAX = 200
_NAME_MAX = 1000
_ALLOWED = (
    "a name is one or more components joined by '/', each 1 to 200 characters of "
    "A-Z a-z 0-9 and . _ : @ + = -, not starting with '.' and not ending in '.rec', "
    "1000 characters in all (for example 'run/tuesday/0' or 'cache/sha256:ab12')"
)
# A temp file: '.' + the final file name + '.<pid>.<thread>.<random>.tmp'. It starts with a
# dot, which no component may, so it can never be mistaken for an entry.
_TEMP = re.compile(r"\..+\.rec\.\d+\.\d+\.[0-9a-f]{8}\.tmp")


def _shown(name: object) -> str:
    text = repr(name)
    return text if len(text) <= 80 else text[:77] + "..."


def valid_part(part: str) -> bool:
    return (
        len(part) <= _COMPONENT_MAX
        and _COMPONENT.fullmatch(part) is not None
        and not part.endswith(_SUFFIX)
    )


def _check_component(part: str, name: str) -> None:
    if not part:
        raise BadName(f"Store name {_shown(name)} has an empty component; {_ALLOWED}.")
    if len(part) > _COMPONENT_MAX:
        raise BadName(
            f"Store name {_shown(name)} has a component of {len(part)} characters; {_ALLOWED}."
        )
    if not valid_part(part):
        raise BadName(f"Store name {_shown(name)} cannot be used; {_ALLOWED}.")


def check_name(name: object) -> str:
    if not isinstance(name, str):
        raise BadName(f"A store name must be a str, not {type(name).__name__}; {_ALLOWED}.")
    if not name:
        raise BadName(f"A store name cannot be empty; {_ALLOWED}.")
    if name.startswith("/"):
        raise BadName(f"Store name {_shown(name)} starts with '/'; {_ALLOWED}.")
    if len(name) > _NAME_MAX:
        raise BadName(f"Store name {_shown(name)} is {len(name)} characters long; {_ALLOWED}.")
    for part in name.split("/"):
        _check_component(part, name)
    return name


def _check_prefix(prefix: object) -> tuple[list[str], str]:
    """Split a scan prefix into the folders it fully names and the partial rest."""
    if not isinstance(prefix, str):
        raise BadName(f"A scan prefix must be a str, not {type(prefix).__name__}.")
    if prefix.startswith("/") or len(prefix) > _NAME_MAX:
        raise BadName(f"Scan prefix {_shown(prefix)} cannot match any name; {_ALLOWED}.")
    *folders, partial = prefix.split("/")
    for part in folders:
        _check_component(part, prefix)
    if not _PARTIAL.fullmatch(partial):
        raise BadName(f"Scan prefix {_shown(prefix)} cannot match any name; {_ALLOWED}.")
    return folders, partial


# -- records ----------------------------------------------------------------------------

_RECORD_MAX = 64 << 20  # a record is small; bulk data belongs in the blob


def _record_bytes(name: str, record: object) -> bytes:
    if not isinstance(record, Mapping):
        raise TypeError(
            f"The record for {name!r} must be a mapping of str to str, "
            f"not {type(record).__name__}."
        )
    plain: dict[str, str] = {}
    for key, value in record.items():
        if not isinstance(key, str):
            raise TypeError(
                f"The record for {name!r} has a key of type {type(key).__name__}; "
                "record keys must be str."
            )
        if not isinstance(value, str):
            raise TypeError(
                f"The record for {name!r} holds a {type(value).__name__} under {key!r}; "
                "record values must be str (write the value down as text first)."
            )
        plain[key] = value
    try:
        text = json.dumps(plain, sort_keys=True, ensure_ascii=False, separators=(", ", ": "))
        data = (text + "\n").encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: escape everything instead, still exact
        text = json.dumps(plain, sort_keys=True, ensure_ascii=True, separators=(", ", ": "))
        data = (text + "\n").encode("ascii")
    if len(data) > _RECORD_MAX:
        raise StoreError(
            f"The record for {name!r} is {len(data)} bytes written down; a record holds at "
            f"most {_RECORD_MAX} bytes. Put bulk data in the blob."
        )
    return data


def _blob_parts(name: str, blob: object) -> list[memoryview] | None:
    if blob is None:
        return None
    items = blob if isinstance(blob, (list, tuple)) else (blob,)
    parts = []
    for item in items:
        if isinstance(item, str):
            raise TypeError(
                f"The blob for {name!r} holds a str; a blob is bytes-like "
                "(bytes, bytearray, memoryview) or a list/tuple of those. Encode the text first."
            )
        try:
            view = memoryview(item)  # type: ignore[arg-type]
        except TypeError:
            raise TypeError(
                f"The blob for {name!r} holds a {type(item).__name__}; a blob is bytes-like "
                "(bytes, bytearray, memoryview) or a list/tuple of those."
            ) from None
        if not view.c_contiguous:
            raise TypeError(
                f"The blob for {name!r} holds a non-contiguous {type(item).__name__}; "
                "pass a contiguous copy of it."
            )
        parts.append(view.cast("B") if view.ndim != 1 or view.format != "B" else view)
    return parts


# -- the file format --------------------------------------------------------------------
#
# <root>/<name>.rec holds, in order:
#   a 41-byte ASCII header line: b"SMZS1 " + record length (8 hex digits) + " " + blob length
#     (16 hex digits, or 16 '-' when the entry has no blob) + " " + CRC-32 (8 hex digits) + "\n"
#   the record: one line of UTF-8 JSON with sorted keys, ending in "\n"
#   the blob bytes, if any.
# The CRC covers the header up to the CRC field and the record, so a damaged length or
# record is caught. The blob carries no checksum: files only ever appear whole (rename), and
# hashing 256 MiB on every fetch is a cost nobody asked for.

_MAGIC = b"SMZS1 "
_HEADER = re.compile(rb"SMZS1 ([0-9a-f]{8}) ([0-9a-f]{16}|-{16}) ([0-9a-f]{8})\n")
_HEADER_SIZE = 41
_CRC_AT = 32  # the CRC covers header[:32] and the record
_NO_BLOB = b"-" * 16
_CHUNK = 1 << 30  # one write() at most; some systems refuse more than 2 GiB at once


def _header(record_len: int, blob_len: int | None) -> bytes:
    blob_field = _NO_BLOB if blob_len is None else b"%016x" % blob_len
    return _MAGIC + b"%08x " % record_len + blob_field + b" "


def _read_exact(file: io.FileIO, size: int, path: Path) -> bytearray:
    buffer = bytearray(size)
    view = memoryview(buffer)
    done = 0
    while done < size:
        got = file.readinto(view[done:])
        if not got:
            raise StoreError(
                f"The store file {path} ends early (read {done} of {size} bytes); it was cut "
                "short or altered outside somatize. Delete it and put the entry again."
            )
        done += got
    return buffer


def _read_head(file: io.FileIO, path: Path) -> tuple[dict[str, str], int, int | None]:
    """Read the header and the record, and nothing of the blob (the file is unbuffered)."""
    size = os.fstat(file.fileno()).st_size
    head = bytes(_read_exact(file, min(size, _HEADER_SIZE), path))
    found = _HEADER.fullmatch(head)
    if found is None:
        raise StoreError(
            f"The store file {path} does not start with a somatize store header; it is not "
            "a store entry, or was damaged. Delete it and put the entry again."
        )
    record_len = int(found[1], 16)
    blob_len = None if found[2] == _NO_BLOB else int(found[2], 16)
    if record_len > _RECORD_MAX or _HEADER_SIZE + record_len > size:
        raise StoreError(
            f"The store file {path} declares a record of {record_len} bytes but holds "
            f"{size} bytes in all; it was cut short or damaged. Delete it and put the entry again."
        )
    body = bytes(_read_exact(file, record_len, path))
    if zlib.crc32(body, zlib.crc32(head[:_CRC_AT])) != int(found[3], 16):
        raise StoreError(
            f"The store file {path} fails its checksum; its header or record was damaged. "
            "Delete it and put the entry again."
        )
    try:
        record = json.loads(body)
    except (ValueError, RecursionError):
        record = None
    if not isinstance(record, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in record.items()
    ):
        raise StoreError(
            f"The store file {path} holds a record that is not a JSON object of strings; "
            "it was not written by somatize. Delete it and put the entry again."
        )
    return record, size - _HEADER_SIZE - record_len, blob_len


def _read_blob(
    file: io.FileIO, path: Path, room: int, blob_len: int | None
) -> bytearray | None:
    if blob_len is None and room == 0:
        return None
    if blob_len is None or room != blob_len:
        raise StoreError(
            f"The store file {path} holds {room} bytes after its record but its header "
            f"declares {'no blob' if blob_len is None else f'{blob_len} bytes'}; it was cut "
            "short or altered. Delete it and put the entry again."
        )
    return _read_exact(file, blob_len, path)  # exact size, filled in place: no second copy


# -- the folder -------------------------------------------------------------------------


class FolderStore:
    """A store in a folder: each name is one file ``<path>/<name>.rec``.

    ``run/tuesday`` and ``run/tuesday/0`` live side by side as ``run/tuesday.rec`` and
    ``run/tuesday/0.rec``. Every put goes to a temp file in the same folder (a name starting
    with '.' and containing '.tmp'), is flushed to disk, and is renamed over the entry, so a
    reader sees the whole old entry or the whole new one, and concurrent writers of one name
    never corrupt it (the last rename wins). A writer killed mid-put leaves only a temp file,
    which every read ignores and ``sweep`` removes.

    ``fetch`` returns a ``bytearray`` of exactly the blob's size, filled in place: it is
    bytes-like and writable, so callers can use it without another copy.

    Names use ':' (``cache/sha256:...``), which the file systems of Linux and macOS allow
    and Windows does not. On a case-insensitive file system, names differing only in case
    are the same entry. The object holds no state beyond its path, so one instance may be
    shared by any number of threads.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        root = Path(path)
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(
                f"Cannot use {root} as a store folder ({exc.strerror or exc}); "
                "give a path to a folder that exists or can be created."
            ) from exc
        self.path = root.resolve()

    def __repr__(self) -> str:
        return f"FolderStore({str(self.path)!r})"

    def _file(self, name: object) -> Path:
        *folders, last = check_name(name).split("/")  # checked before any path is built
        return self.path.joinpath(*folders, last + _SUFFIX)

    # -- the three verbs

    def put(self, name: str, record: Mapping[str, str], blob: Blob = None) -> None:
        """Write ``record`` (and ``blob``) under ``name``, replacing what was there.

        ``blob`` is bytes-like or a list/tuple of bytes-likes written in order; each is
        written straight from its buffer, never joined or copied.
        """
        target = self._file(name)
        temp = self._written(name, target, record, blob)
        try:
            os.replace(temp, target)
        except BaseException as exc:
            _unlink_quietly(temp)
            if isinstance(exc, OSError):
                raise StoreError(
                    f"Writing {name!r} into the store at {self.path} failed "
                    f"({exc.strerror or exc}); the old entry, if any, is unchanged."
                ) from exc
            raise
        _sync_folder(target.parent)

    def scan(self, prefix: str) -> Iterator[tuple[str, dict[str, str]]]:
        """Yield ``(name, record)`` for every name starting with ``prefix``, in string order.

        Only headers and records are read, never a blob. ``scan("")`` lists everything,
        ``scan("run/tuesday/")`` one folder, ``scan("run/tue")`` every name starting so.
        Entries that disappear while the scan runs are skipped.
        """
        folders, partial = _check_prefix(prefix)
        start = self.path.joinpath(*folders)
        base = "".join(part + "/" for part in folders)
        names: list[str] = []
        _list_names(start, base, partial, names)
        names.sort()
        for name in names:
            try:
                path = self._file(name)
                with open(path, "rb", buffering=0) as file:
                    record, _, _ = _read_head(file, path)
            except (FileNotFoundError, NotADirectoryError):
                continue  # deleted (or replaced by a folder) since it was listed
            except OSError as exc:
                raise StoreError(
                    f"Cannot read {name!r} from the store at {self.path} ({exc.strerror or exc})."
                ) from exc
            yield name, record

    def fetch(self, name: str) -> bytearray | None:
        """Return the blob stored under ``name`` (``None`` when it was put without one).

        The blob is a ``bytearray`` of exactly its size, read in place.
        """
        return self.entry(name)[1]

    # -- the two verbs of a claiming store

    def create(self, name: str, record: Mapping[str, str], blob: Blob = None) -> bool:
        """Write ``record`` (and ``blob``) under ``name`` only if nothing is there yet.

        Returns ``True`` when this call made the entry, ``False`` when one already existed
        (which is left untouched). Of any number of processes, on any number of machines,
        creating one name at once, exactly one gets ``True``.

        The entry is written whole into a temp file, then hard-linked to its name. A link
        never replaces an existing name, so it is atomic and exclusive on a local disk and
        on NFS alike, where ``O_EXCL`` is not reliable on old clients. On NFS a link whose
        reply was lost may be retried by the client and answer "exists" although it was this
        call that made it; the temp file's link count tells the two apart (2: ours).
        """
        target = self._file(name)
        temp = self._written(name, target, record, blob)
        try:
            try:
                os.link(temp, target)
                made = True
            except FileExistsError:
                made = _linked_twice(temp)
            except OSError as exc:
                if not _linked_twice(temp):
                    raise StoreError(
                        f"Cannot create {name!r} in the store at {self.path} "
                        f"({exc.strerror or exc}); a claiming store needs a file system with "
                        "hard links (a local disk or NFS; not FAT or some FUSE mounts)."
                    ) from exc
                made = True
        finally:
            _unlink_quietly(temp)
        if made:
            _sync_folder(target.parent)
        return made

    def stamp(self, name: str) -> int:
        """When ``name`` was last written, in the store's own clock: its modification time
        in nanoseconds.

        Only compare a stamp with another stamp of the same store, never with this
        machine's clock. On a local disk both come from this kernel's clock. On NFS both
        come from the file server's clock, since the server sets a file's time when the
        data arrives; the file is opened, not just looked up, so the client asks the server
        (close-to-open) rather than answering from its attribute cache. Raises ``Missing``
        when nothing is stored under ``name``.
        """
        path = self._file(name)
        with self._open(name, path) as file:
            return os.fstat(file.fileno()).st_mtime_ns

    def _written(self, name: str, target: Path, record: Mapping[str, str], blob: Blob) -> Path:
        """Write a whole entry into a fresh temp file beside ``target``, flushed to disk."""
        data = _record_bytes(name, record)
        parts = _blob_parts(name, blob)
        blob_len = None if parts is None else sum(part.nbytes for part in parts)
        head = _header(len(data), blob_len)
        head += b"%08x\n" % zlib.crc32(data, zlib.crc32(head))
        folder = target.parent
        temp = folder / (
            f".{target.name}.{os.getpid()}.{threading.get_native_id()}.{secrets.token_hex(4)}.tmp"
        )
        try:
            _make_folders(folder, self.path)
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC, 0o666)
        except OSError as exc:
            raise StoreError(
                f"Cannot write {name!r} into the store at {self.path} ({exc.strerror or exc}); "
                "check that the folder is writable and nothing else sits at that path."
            ) from exc
        try:
            try:
                _write_all(fd, memoryview(head + data))
                for part in parts or ():
                    _write_all(fd, part)
                os.fsync(fd)
            finally:
                os.close(fd)
        except BaseException as exc:
            _unlink_quietly(temp)
            if isinstance(exc, OSError):
                raise StoreError(
                    f"Writing {name!r} into the store at {self.path} failed "
                    f"({exc.strerror or exc}); the old entry, if any, is unchanged."
                ) from exc
            raise
        return temp

    # -- extras beyond the protocol

    def entry(self, name: str) -> tuple[dict[str, str], bytearray | None]:
        """Return the record and the blob of ``name`` read from one file, so they belong together."""
        path = self._file(name)
        with self._open(name, path) as file:
            record, room, blob_len = _read_head(file, path)
            return record, _read_blob(file, path, room, blob_len)

    def record(self, name: str) -> dict[str, str]:
        """Return the record stored under ``name`` without reading its blob."""
        path = self._file(name)
        with self._open(name, path) as file:
            return _read_head(file, path)[0]

    def __contains__(self, name: object) -> bool:
        return self._file(name).is_file()

    def delete(self, name: str) -> None:
        """Remove the entry under ``name``; nothing happens when there is none.

        Folders are left in place, so a put racing this delete never loses its folder.
        """
        path = self._file(name)
        try:
            os.unlink(path)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise StoreError(
                f"Cannot delete {name!r} from the store at {self.path} ({exc.strerror or exc})."
            ) from exc
        _sync_folder(path.parent)

    def sweep(self, older_than: float = 3600.0) -> int:
        """Remove temp files last touched ``older_than`` seconds ago or more; return how many.

        Temp files are what a writer killed mid-put leaves behind. Sweeping one that a live
        writer is still filling makes that put fail, so keep ``older_than`` well above the
        longest put.
        """
        now = time.time()
        removed = 0
        for temp in _list_temps(self.path):
            try:
                if now - temp.stat().st_mtime >= older_than:
                    temp.unlink()
                    removed += 1
            except FileNotFoundError:
                continue  # renamed into place, or swept by someone else
        return removed

    def _open(self, name: str, path: Path) -> io.FileIO:
        try:
            return open(path, "rb", buffering=0)
        except (FileNotFoundError, NotADirectoryError):
            raise Missing(
                f"Nothing is stored under {name!r} in the store at {self.path}; "
                "scan() lists what is there."
            ) from None
        except OSError as exc:
            raise StoreError(
                f"Cannot read {name!r} from the store at {self.path} ({exc.strerror or exc})."
            ) from exc


# -- file system helpers ----------------------------------------------------------------

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def _write_all(fd: int, view: memoryview) -> None:
    done, size = 0, view.nbytes
    while done < size:
        done += os.write(fd, view[done : done + _CHUNK])


def _unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _linked_twice(temp: Path) -> bool:
    """Whether ``temp`` was linked to its entry's name: its link count is then 2."""
    try:
        return os.stat(temp).st_nlink == 2
    except OSError:
        return False


def _sync_folder(folder: Path) -> None:
    """Make a rename or unlink in ``folder`` durable; quietly skipped where unsupported."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _make_folders(folder: Path, root: Path) -> None:
    """Create ``folder`` and any missing parents below ``root``, each made durable."""
    if folder.is_dir():
        return
    if folder != root:
        _make_folders(folder.parent, root)
    try:
        folder.mkdir()
    except FileExistsError:
        if not folder.is_dir():
            raise
        return
    _sync_folder(folder.parent)


def _list_names(folder: Path, base: str, partial: str, names: list[str]) -> None:
    """Collect the names under ``folder`` (called ``base``) whose last part starts with ``partial``."""
    try:
        entries = list(os.scandir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return
    except OSError as exc:
        raise StoreError(f"Cannot list the store folder {folder} ({exc.strerror or exc}).") from exc
    for entry in entries:
        part = entry.name
        try:
            if entry.is_dir():
                if part.startswith(partial) and valid_part(part):
                    _list_names(Path(entry.path), base + part + "/", "", names)
            elif part.endswith(_SUFFIX) and entry.is_file():
                stem = part[: -len(_SUFFIX)]
                if stem.startswith(partial) and valid_part(stem):
                    names.append(base + stem)
        except OSError:
            continue  # gone while we looked


def _list_temps(folder: Path) -> Iterator[Path]:
    try:
        entries = list(os.scandir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return
    for entry in entries:
        try:
            if entry.is_dir():
                if valid_part(entry.name):
                    yield from _list_temps(Path(entry.path))
            elif _TEMP.fullmatch(entry.name):
                yield Path(entry.path)
        except OSError:
            continue
