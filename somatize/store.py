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

import contextlib
import io
import os
import stat
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

from somatize.errors import Missing, StoreError
from somatize.folders import (
    FILE,
    Blocked,
    Descent,
    held_by,
    kind_of,
    link_new,
    new_temp,
    open_folder,
    open_regular,
    remove,
    replace,
    sync,
    tell_blocked,
    tell_once,
)
from somatize.store_file import LARGEST, blob_parts, header, read_blob, read_head, record_bytes, scan_record, write_all
from somatize.store_names import DEEPEST as _DEEPEST
from somatize.store_names import SUFFIX as _SUFFIX
from somatize.store_names import TEMP as _TEMP
from somatize.store_names import check_name, check_prefix, valid_part

__all__ = ["Blob", "ClaimingStore", "FolderStore", "Store", "check_name", "valid_part"]

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

    ``create(name, record, blob=None, *, durable=True) -> bool`` writes an entry only if
    none is stored under ``name`` and says whether it did: of several creators of one name,
    exactly one gets ``True``; ``durable=False`` asks only that the entry never show torn,
    not that it outlive a power cut (see ``FolderStore.create``). ``stamp(name) -> int``
    says when the entry was last written, in the store's own clock (nanoseconds): stamps of
    one store compare with each other, never with a machine's clock. Studies claim trials with ``create`` and judge whether an attempt is
    still being written with ``stamp``. ``FolderStore`` is one.
    """

    def create(self, name: str, record: Mapping[str, str], blob: Blob = None, *, durable: bool = True) -> bool: ...

    def stamp(self, name: str) -> int: ...


def scanned_record(store: Store, name: str) -> dict[str, str] | None:
    """The record of the entry ``name``, as a scan of that name reads it (any store: a scan
    is the one read every store has; a ``FolderStore`` reads the name alone, listing no
    folder); ``None`` when none shows there (missing, or held by something no store writes,
    which the scan names)."""
    if isinstance(store, FolderStore):
        for _, record in store.scan_names([name]):
            return record
        return None
    for found, record in store.scan(name):
        if found == name:
            return record
    return None


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

    Who may write the folder may write entries others read, and nothing more: every name
    goes through ``somatize.folders`` (opened from the root one component at a time, no link
    followed, nothing that blocks, a regular file of bounded length, every descriptor
    closed). A name held by anything a store does not write (a link, a folder where an
    entry belongs, a file where a folder belongs, a FIFO, a socket, an entry longer than
    ``largest``, a file or folder this user may not read) is *blocked*: reads treat it as
    nothing stored (``Missing``, left out of a scan, one line on stderr per name), and
    ``put`` and ``create`` raise ``Blocked`` (a ``StoreError``) for the caller to count that
    entry or claim as blocked and move on. An entry that is a regular file but not a store
    file is left out of a scan with one line, and refused by a read (``StoreError``).

    ``largest`` bounds the length of an entry read back (header, record and blob; by its
    length, so a sparse file counts in full); the default is half this machine's memory,
    so a planted entry can never make a read allocate more than that.

    Names use ':' (``cache/sha256:...``), which the file systems of Linux and macOS allow
    and Windows does not. On a case-insensitive file system, names differing only in case
    are the same entry. The object holds no state beyond its path, so one instance may be
    shared by any number of threads.
    """

    def __init__(self, path: str | os.PathLike[str], *, largest: int | None = None) -> None:
        root = Path(path)
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(
                f"Cannot use {root} as a store folder ({exc.strerror or exc}); "
                "give a path to a folder that exists or can be created."
            ) from exc
        self.path = root.resolve()  # the root is the user's to name: links above it are theirs
        self.largest = LARGEST if largest is None else int(largest)

    def __repr__(self) -> str:
        return f"FolderStore({str(self.path)!r})"

    def _where(self, name: object) -> tuple[list[str], str, Path]:
        """The folders and the file name of ``name``, and its path (for messages only)."""
        *folders, last = check_name(name).split("/")  # checked before any path is built
        return folders, last + _SUFFIX, self.path.joinpath(*folders, last + _SUFFIX)

    # -- the three verbs

    def put(self, name: str, record: Mapping[str, str], blob: Blob = None) -> None:
        """Write ``record`` (and ``blob``) under ``name``, replacing what was there.

        ``blob`` is bytes-like or a list/tuple of bytes-likes written in order; each is
        written straight from its buffer, never joined or copied.
        """
        folders, file, _ = self._where(name)
        with Descent(self.path) as descent, self._refusing(name):
            folder = self._folder(descent, folders, name)
            temp = self._written(name, folder, file, record, blob)
            try:
                replace(folder, temp, file, "/".join([*folders, file]))  # a link there is replaced, not followed
            except BaseException as exc:
                self._undo(folder, temp, name, exc)
                raise
            sync(folder)
            descent.settle()  # a folder made on the way: its making was committed with the entry

    def scan(self, prefix: str) -> Iterator[tuple[str, dict[str, str]]]:
        """Yield ``(name, record)`` for every name starting with ``prefix``, in string order.

        Only headers and records are read, never a blob. ``scan("")`` lists everything,
        ``scan("run/tuesday/")`` one folder, ``scan("run/tue")`` every name starting so.
        Entries that disappear while the scan runs are skipped, and so are links and files
        that are not store entries, each with one line on stderr: one bad entry never
        stops a scan. One listing per folder; one open per entry.
        """
        with Descent(self.path) as descent:
            yield from self._records(descent, self._names(descent, prefix))

    def scan_names(self, names: Iterable[str]) -> Iterator[tuple[str, dict[str, str]]]:
        """Yield ``(name, record)`` for each of ``names`` that is stored, in the order given,
        read as `scan` reads it (a link, or what is not a store entry, is left out with one
        line on stderr); a name with nothing stored under it is skipped. No folder is listed:
        what a caller knows the names of is read in one open each, however many entries
        share their folder."""
        checked = [check_name(name) for name in names]
        with Descent(self.path) as descent:
            yield from self._records(descent, checked)

    def _records(self, descent: Descent, names: Iterable[str]) -> Iterator[tuple[str, dict[str, str]]]:
        root = str(self.path)
        for name in names:
            *parts, last = name.split("/")
            try:
                fd = open_regular(descent.at(parts), last + _SUFFIX, name + _SUFFIX, self.largest)[0]
            except (FileNotFoundError, NotADirectoryError):
                continue  # deleted since it was listed, or never stored
            except Blocked as exc:
                tell_blocked(self.path, exc.where, exc.held)
                continue
            except PermissionError:
                tell_blocked(self.path, name + _SUFFIX, "a file this user may not read")
                continue
            except OSError as exc:
                raise StoreError(
                    f"Cannot read {name!r} from the store at {self.path} ({exc.strerror or exc})."
                ) from exc
            path = f"{root}/{name}{_SUFFIX}"
            try:
                try:
                    record = scan_record(fd, path)
                except StoreError as exc:
                    found = os.fstat(fd)  # which file: another planted later is named again
                    tell_once(
                        path,
                        f"somatize store: a scan leaves out {name!r}: {exc}",
                        (found.st_ino, found.st_ctime_ns),
                    )
                    continue
                finally:
                    os.close(fd)
            except OSError as exc:
                raise StoreError(
                    f"Cannot read {name!r} from the store at {self.path} ({exc.strerror or exc})."
                ) from exc
            yield name, record

    def names(self, prefix: str) -> list[str]:
        """The names starting with ``prefix``, in string order, from the folders' listings
        alone: no entry is opened (a run's last forwards are found without reading the
        thousands before them). Links and what is not a regular file are left out, as
        `scan` leaves them; an entry that is damaged inside is listed (`scan` would say so)."""
        with Descent(self.path) as descent:
            return self._names(descent, prefix)

    def _names(self, descent: Descent, prefix: str) -> list[str]:
        folders, partial = check_prefix(prefix)
        names: list[str] = []
        try:
            start = descent.at(folders)
        except (FileNotFoundError, NotADirectoryError):
            return names
        except Blocked as exc:
            tell_blocked(self.path, exc.where, exc.held)
            return names
        except PermissionError:
            tell_blocked(self.path, "/".join(folders), "a folder this user may not open")
            return names
        except OSError as exc:
            raise StoreError(f"Cannot list the store at {self.path} ({exc.strerror or exc}).") from exc
        self._list(start, "".join(part + "/" for part in folders), partial, names)
        names.sort()
        return names

    def fetch(self, name: str) -> bytearray | None:
        """Return the blob stored under ``name`` (``None`` when it was put without one).

        The blob is a ``bytearray`` of exactly its size, read in place.
        """
        return self.entry(name)[1]

    # -- the two verbs of a claiming store

    def create(self, name: str, record: Mapping[str, str], blob: Blob = None, *, durable: bool = True) -> bool:
        """Write ``record`` (and ``blob``) under ``name`` only if nothing is there yet.

        Returns ``True`` when this call made the entry, ``False`` when one already existed
        (which is left untouched). Of any number of processes, on any number of machines,
        creating one name at once, exactly one gets ``True``. Raises ``Blocked`` when the
        name, or a folder on its way, is held by something no store writes (a link, a
        folder, a FIFO): nobody can create it, and the caller counts it as blocked.

        The entry's bytes reach the disk before it gets its name, so no crash ever shows it
        torn. With ``durable=False`` the name itself is not synced: a power cut of the
        machine that holds the folder may take the entry back, whole, as if it had never
        been made (the folders made for it stay); the next ``put`` in its folder makes it
        durable. That saves one disk commit where losing the entry costs nothing: a study's
        claim, lost in the same power cut as the runner that made it, is a trial claimed
        again.

        The entry is written whole into a temp file, then hard-linked to its name. A link
        never replaces an existing name, so it is atomic and exclusive on a local disk and
        on NFS alike, where ``O_EXCL`` is not reliable on old clients. On NFS a link whose
        reply was lost may be retried by the client and answer "exists" although it was this
        call that made it; the temp file's link count tells the two apart (2: ours).
        """
        folders, file, _ = self._where(name)
        with Descent(self.path) as descent, self._refusing(name):
            folder = self._folder(descent, folders, name)
            temp = self._written(name, folder, file, record, blob)
            try:
                try:
                    made = link_new(folder, temp, file, "/".join([*folders, file]))
                except OSError as exc:
                    raise StoreError(
                        f"Cannot create {name!r} in the store at {self.path} "
                        f"({exc.strerror or exc}); a claiming store needs a file system with "
                        "hard links (a local disk or NFS; not FAT or some FUSE mounts)."
                    ) from exc
            finally:
                remove(folder, temp)
            if made:
                if durable:
                    sync(folder)
                descent.settle()  # a folder made on the way: its making was committed with the entry
            else:
                self._not_too_long(folder, file, "/".join([*folders, file]))
            return made

    def _not_too_long(self, folder: int, file: str, where: str) -> None:
        """``Blocked`` when the file another wrote at ``file`` is longer than a read takes:
        it is no entry (every read says missing), so nobody holds the name."""
        try:
            size = os.stat(file, dir_fd=folder, follow_symlinks=False).st_size
        except OSError:
            return
        if size > self.largest:
            raise Blocked(where, f"a file of {size} bytes", f"an entry holds at most {self.largest}")

    def stamp(self, name: str) -> int:
        """When ``name`` was last written, in the store's own clock: its modification time
        in nanoseconds.

        Only compare a stamp with another stamp of the same store, never with this
        machine's clock. On a local disk both come from this kernel's clock. On NFS both
        come from the file server's clock, since the server sets a file's time when the
        data arrives; the file is opened, not just looked up, so the client asks the server
        (close-to-open) rather than answering from its attribute cache. Raises ``Missing``
        when nothing is stored under ``name``, or when the name is blocked.
        """
        with self._open(name)[0] as file:
            return os.fstat(file.fileno()).st_mtime_ns

    @contextlib.contextmanager
    def _refusing(self, name: str) -> Iterator[None]:
        """A write met a blocked name: ``Blocked``, saying which entry it refuses (the
        primitive's own ``Blocked``, or ``LinkMet``, is its ``__cause__``)."""
        try:
            yield
        except Blocked as exc:
            raise Blocked(exc.where, exc.held, f"{name!r} cannot be written into the store at {self.path}") from exc

    def _undo(self, folder: int, temp: str, name: str, exc: BaseException) -> None:
        """A write that failed leaves nothing behind: its temp file goes, and an OS error
        becomes a ``StoreError`` that says the old entry is unchanged."""
        remove(folder, temp)
        if isinstance(exc, OSError):
            raise StoreError(
                f"Writing {name!r} into the store at {self.path} failed "
                f"({exc.strerror or exc}); the old entry, if any, is unchanged."
            ) from exc

    def _written(self, name: str, folder: int, file: str, record: Mapping[str, str], blob: Blob) -> str:
        """Write a whole entry into a fresh temp file beside ``file``, flushed to disk."""
        data = record_bytes(name, record)
        parts = blob_parts(name, blob)
        blob_len = None if parts is None else sum(part.nbytes for part in parts)
        head = header(len(data), blob_len)
        head += b"%08x\n" % zlib.crc32(data, zlib.crc32(head))
        try:
            fd, temp = new_temp(folder, file)
        except OSError as exc:
            raise StoreError(
                f"Cannot write {name!r} into the store at {self.path} ({exc.strerror or exc}); "
                "check that the folder is writable and nothing else sits at that path."
            ) from exc
        try:
            try:
                write_all(fd, memoryview(head + data))
                for part in parts or ():
                    write_all(fd, part)
                os.fsync(fd)
            finally:
                os.close(fd)
        except BaseException as exc:
            self._undo(folder, temp, name, exc)
            raise
        return temp

    def _folder(self, descent: Descent, folders: list[str], name: str) -> int:
        """The folder ``name`` is written in, made where missing; never through a link.
        ``Blocked`` when a folder on its way is held by anything else, or is a folder below
        the root that this user may not write in (someone else made it)."""
        try:
            return descent.at(folders, make=True)
        except PermissionError as exc:
            if folders:
                raise Blocked("/".join(folders), "a folder this user may not write in") from exc
            raise StoreError(
                f"Cannot write {name!r} into the store at {self.path} ({exc.strerror or exc}); "
                "check that the folder is writable."
            ) from exc
        except OSError as exc:
            raise StoreError(
                f"Cannot write {name!r} into the store at {self.path}: "
                f"{exc.filename or 'the folder'} {exc.strerror or exc}; check that the folder is "
                "writable and nothing else sits at that path."
            ) from exc

    # -- extras beyond the protocol

    def entry(
        self, name: str, admit: Callable[[bytearray, int], object] | None = None
    ) -> tuple[dict[str, str], bytearray | None]:
        """Return the record and the blob of ``name`` read from one file, so they belong
        together. ``admit(start, length)``, when given, sees the blob's first 64 KiB and its
        declared length before room is made for the rest, and may raise to refuse it (the
        engine passes ``codec.check_start``: a planted file declaring gigabytes is refused
        before they are read)."""
        opened, path = self._open(name)
        with opened as file:
            record, room, blob_len = read_head(file, path)
            return record, read_blob(file, path, room, blob_len, admit)

    def record(self, name: str) -> dict[str, str]:
        """Return the record stored under ``name`` without reading its blob."""
        opened, path = self._open(name)
        with opened as file:
            return read_head(file, path)[0]

    def holder(self, name: str) -> str | None:
        """What holds the entry ``name`` now: ``"a file"`` (an entry, or a file no read
        shows: one too long, another user's), ``"a folder"``, ``"a symbolic link"``, ``"a
        FIFO"``... (for a folder on the way, what holds that), never following a link;
        ``None`` when nothing does, or nothing can be seen. One descent of the folders; the
        name is opened, not only looked up, so that on NFS the server answers, not the
        client's cache (a study's fence is looked at so before every write of an attempt)."""
        folders, file, _ = self._where(name)
        try:
            with Descent(self.path) as descent:
                folder = descent.at(folders)
                try:
                    opened = os.open(file, FILE, dir_fd=folder)
                except FileNotFoundError:
                    return None
                except OSError:  # a link, a socket, a file this user may not read
                    return held_by(folder, file)
                try:
                    return kind_of(os.fstat(opened).st_mode)
                finally:
                    os.close(opened)
        except (FileNotFoundError, NotADirectoryError):
            return None  # a folder on the way is missing
        except Blocked as exc:
            return exc.held  # a folder on the way is held by something else
        except OSError:
            return None

    def __contains__(self, name: object) -> bool:
        folders, file, _ = self._where(name)
        try:
            with Descent(self.path) as descent:
                found = os.stat(file, dir_fd=descent.at(folders), follow_symlinks=False)
        except (OSError, Blocked):
            return False
        return stat.S_ISREG(found.st_mode) and found.st_size <= self.largest

    def delete(self, name: str) -> None:
        """Remove the entry under ``name``; nothing happens when there is none.

        Folders are left in place, so a put racing this delete never loses its folder.
        """
        folders, file, _ = self._where(name)
        try:
            with Descent(self.path) as descent:
                folder = descent.at(folders)
                if remove(folder, file):  # a link is removed itself, never what it names
                    sync(folder)
        except (FileNotFoundError, NotADirectoryError, Blocked):
            return
        except OSError as exc:
            raise StoreError(f"Cannot delete {name!r} from the store at {self.path} ({exc.strerror or exc}).") from exc

    def sweep(self, older_than: float = 3600.0) -> int:
        """Remove temp files last touched ``older_than`` seconds ago or more; return how many.

        Temp files are what a writer killed mid-put leaves behind. Sweeping one that a live
        writer is still filling makes that put fail, so keep ``older_than`` well above the
        longest put.
        """
        with Descent(self.path) as descent:
            return _sweep(descent.at([]), time.time() - older_than)

    def _open(self, name: str) -> tuple[io.FileIO, Path]:
        """The entry ``name``, open: a regular file of at most ``largest`` bytes; ``Missing``
        when nothing is there or the name is blocked (said once), and no descriptor left."""
        folders, file, path = self._where(name)
        where = "/".join([*folders, file])
        try:
            with Descent(self.path) as descent:
                fd = open_regular(descent.at(folders), file, where, self.largest)[0]
        except (FileNotFoundError, NotADirectoryError):
            raise Missing(
                f"Nothing is stored under {name!r} in the store at {self.path}; scan() lists what is there."
            ) from None
        except (Blocked, PermissionError) as exc:
            blocked = exc if isinstance(exc, Blocked) else Blocked(where, "a file this user may not read")
            tell_blocked(self.path, blocked.where, blocked.held)
            raise Missing(
                f"Nothing is stored under {name!r} in the store at {self.path}: "
                f"{blocked.where} {blocked.strerror}, so it counts as blocked."
            ) from None
        except OSError as exc:
            raise StoreError(f"Cannot read {name!r} from the store at {self.path} ({exc.strerror or exc}).") from exc
        try:
            return open(fd, "rb", buffering=0), path
        except BaseException:
            os.close(fd)
            raise

    def _list(self, folder: int, base: str, partial: str, names: list[str]) -> None:
        """Collect the names under ``folder`` (called ``base``) whose last part starts with
        ``partial``: one listing per folder, entries' kinds from the listing itself."""
        try:
            with os.scandir(folder) as listing:
                entries = list(listing)
        except PermissionError:
            tell_blocked(self.path, base.rstrip("/"), "a folder this user may not list")
            return
        except OSError as exc:
            raise StoreError(f"Cannot list the store folder {self.path / base} ({exc.strerror or exc}).") from exc
        for entry in entries:
            part = entry.name
            stem = part[: -len(_SUFFIX)] if part.endswith(_SUFFIX) else part
            if not stem.startswith(partial) or not valid_part(stem):
                continue
            try:
                if entry.is_symlink():
                    tell_blocked(self.path, base + part, "a symbolic link")
                elif entry.is_dir(follow_symlinks=False):
                    if part == stem and base.count("/") >= _DEEPEST:  # planted: no name reaches below it
                        tell_blocked(self.path, base + part, "a folder nested deeper than any entry's name reaches")
                    elif part == stem:
                        inner = open_folder(folder, part, base + part)
                        try:
                            self._list(inner, base + part + "/", "", names)
                        finally:
                            os.close(inner)
                    else:  # a folder where an entry belongs
                        tell_blocked(self.path, base + part, "a folder")
                elif part != stem and entry.is_file(follow_symlinks=False):
                    names.append(base + stem)
                elif part != stem:  # a FIFO, a socket or a device planted under an entry's name
                    tell_blocked(self.path, base + part, held_by(folder, part) or "something else")
                elif entry.is_file(follow_symlinks=False):  # a file at a folder's name: no entry has it
                    tell_blocked(self.path, base + part, "a file where only a folder belongs")
                else:
                    tell_blocked(self.path, base + part, held_by(folder, part) or "something else")
            except Blocked as exc:  # replaced by something else since it was listed
                tell_blocked(self.path, exc.where, exc.held)
            except PermissionError:
                tell_blocked(self.path, base + part, "a folder this user may not open")
            except OSError:
                continue  # gone while we looked


# -- file system helpers ----------------------------------------------------------------


def _sweep(folder: int, before: float, depth: int = 0) -> int:
    """Remove the temp files under ``folder`` (``depth`` folders below the root) last
    touched before ``before``; never via a link, never deeper than an entry's name reaches."""
    try:
        with os.scandir(folder) as listing:
            entries = list(listing)
    except OSError:
        return 0
    removed = 0
    for entry in entries:
        try:
            if entry.is_dir(follow_symlinks=False):
                if valid_part(entry.name) and depth < _DEEPEST:
                    inner = open_folder(folder, entry.name, entry.name)
                    try:
                        removed += _sweep(inner, before, depth + 1)
                    finally:
                        os.close(inner)
            elif _TEMP.fullmatch(entry.name) and entry.stat(follow_symlinks=False).st_mtime <= before:
                os.unlink(entry.name, dir_fd=folder)
                removed += 1
        except (OSError, Blocked):
            continue  # renamed into place, swept by someone else, or something planted meanwhile
    return removed
