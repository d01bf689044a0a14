"""Names under a shared folder: the one way every reader and writer touches them.

A store's folder (and a study's, and the computing claims inside it) is shared: whoever
else may write in it can put anything where a folder or an entry belongs: a symbolic link
pointing at anything this user may read or write, a folder where a file belongs, a file
where a folder belongs, a FIFO that would hang a reader, a socket, a sparse file of a
terabyte. Every name below a root goes through the few primitives here, and they hold to
five rules:

- **No link is ever followed, at any level.** The root is opened once per operation (links
  above it are the user's own); each component below it is opened from its parent's
  descriptor with ``O_NOFOLLOW`` (``openat``), so a link is met, never followed.
- **Nothing blocks.** Files are opened ``O_NONBLOCK | O_NOCTTY``: a FIFO answers at once.
- **``fstat`` first, a regular file only, its size bounded before a byte is read.** The
  bound is the file's length (``st_size``), so a sparse file counts by its length, not by
  the blocks it holds on disk.
- **Every descriptor is closed, whatever happens** (each primitive closes what it opened
  before it raises; the caller closes only what it was handed).
- **A name held by anything else is blocked, and that is an answer, not a failure.** The
  primitives raise ``Blocked`` (a ``StoreError``; ``LinkMet`` is the kind for a link), and
  the callers turn it into a documented state: a reader treats the name as missing and
  says so in one line (``tell_blocked``: once per path, and rate-limited over all paths); a
  writer takes the next name, or counts that entry, claim or trial as blocked and moves
  on. Nothing here loops on a name or retries it.

The API (stable: other modules copy it unchanged):

``Blocked(where, held, doing="")``       the name ``where`` is held by ``held`` ("a link", "a
                                         folder", "a FIFO", "a file of 3 GiB", ...)
``LinkMet(where)``                       a ``Blocked`` whose holder is a link
``held_by(dir_fd, name) -> str | None``  what holds ``name`` (``None``: nothing, it is free)
``Descent(root).at(parts, make=False)``  the folder ``parts`` names below ``root``, made where
                                         missing with ``make``; ``FileNotFoundError`` when
                                         missing, ``Blocked`` when a component is not a folder
``open_regular(dir_fd, name, where, limit=None) -> (fd, stat)``
                                         a regular file, open for reading, and its ``fstat``;
                                         ``FileNotFoundError`` or ``Blocked``; the fd is yours
``read_regular(dir_fd, name, where, limit) -> bytes``
                                         a whole regular file of at most ``limit`` bytes
``read_at(root, parts, name, limit) -> bytes | None``
                                         the same from a root path; ``None`` when missing or
                                         blocked (the blocked one said in one line)
``new_temp(dir_fd, stem) -> (fd, temp)`` a fresh file beside ``stem`` (``O_EXCL``; a name
                                         taken means the next random name, a few times)
``replace(dir_fd, temp, name, where)``   rename ``temp`` over ``name`` (a link there is replaced,
                                         never followed); ``Blocked`` when a folder holds it
``link_new(dir_fd, temp, name, where) -> bool``
                                         hard-link ``temp`` to ``name`` only if ``name`` is
                                         free: True made, False a regular file already there,
                                         ``Blocked`` anything else there
``remove(dir_fd, name) -> bool``         unlink a file or a link (never what it names); a folder
                                         or nothing there: False
``sync(dir_fd)``                         make a rename, link or unlink durable
``tell_blocked(root, where, held)``, ``tell_once(path, line)``, ``forget_told()``
                                         one line on stderr per path, at most ``_BURST`` at once
                                         and one a second after that

This module knows nothing of records or of what names mean: ``store`` does.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from .errors import StoreError

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_O_NOCTTY = getattr(os, "O_NOCTTY", 0)
FOLDER = os.O_RDONLY | _O_DIRECTORY | _O_NOFOLLOW | _O_CLOEXEC | _O_NONBLOCK
FILE = os.O_RDONLY | _O_NOFOLLOW | _O_CLOEXEC | _O_NONBLOCK | _O_NOCTTY
NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC | _O_NOCTTY

_LINK_TEXT = (
    "is a symbolic link, and a store never follows links; someone who may write this folder "
    "made it: remove it, and check who else may write there"
)


class Blocked(StoreError):
    """The name ``where`` is held by something a store did not write (``held`` says what:
    a link, a folder where a file belongs, a file where a folder belongs, a FIFO, a socket,
    a file longer than the name may hold). Nothing was followed, opened past or read."""

    def __init__(self, where: str, held: str, doing: str = "") -> None:
        self.where = where
        self.held = held
        self.filename = where  # as an OSError names its path
        self.strerror = f"is {held}, which no store writes"
        super().__init__(
            f"{where} is {held}, which no store writes{f' ({doing})' if doing else ''}; "
            "someone who may write this folder put it there: remove it, and check who else may "
            "write there. Until then the name counts as blocked."
        )


class LinkMet(Blocked):
    """A link stands where a store folder or entry belongs; it was not followed."""

    def __init__(self, where: str) -> None:
        super().__init__(where, "a symbolic link")
        self.strerror = _LINK_TEXT


def kind_of(mode: int) -> str:
    """What a file of ``mode`` is, in words: "a file", "a folder", "a symbolic link"..."""
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "a file"


def held_by(dir_fd: int, name: str) -> str | None:
    """What holds ``name`` in the folder ``dir_fd`` ("a file", "a folder", "a symbolic
    link", ...), never following a link; ``None`` when nothing does (or it cannot be seen)."""
    try:
        return kind_of(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return None


def is_link(dir_fd: int, name: str) -> bool:
    return held_by(dir_fd, name) == "a symbolic link"


def _blocked(dir_fd: int, name: str, where: str, wanted: str) -> Blocked | None:
    """The ``Blocked`` for ``name`` when something other than ``wanted`` holds it."""
    held = held_by(dir_fd, name)
    if held is None or held == wanted:
        return None
    return LinkMet(where) if held == "a symbolic link" else Blocked(where, held)


# -- reading -----------------------------------------------------------------------------


def open_regular(dir_fd: int, name: str, where: str, limit: int | None = None) -> tuple[int, os.stat_result]:
    """Open the regular file ``name`` in ``dir_fd`` for reading, and ``fstat`` it.

    ``FileNotFoundError`` when nothing is there; ``Blocked`` when a link, a folder, a FIFO,
    a socket or a file longer than ``limit`` bytes (by its length: a sparse file too) holds
    the name. The descriptor returned is the caller's to close; on any error none is left.
    """
    try:
        fd = os.open(name, FILE, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EMLINK):  # (FreeBSD says EMLINK where Linux says ELOOP)
            raise LinkMet(where) from None
        if exc.errno == errno.ENXIO:  # a socket (or a FIFO with no writer, on some systems)
            raise Blocked(where, held_by(dir_fd, name) or "a socket") from None
        raise
    try:
        found = os.fstat(fd)
        if not stat.S_ISREG(found.st_mode):
            raise Blocked(where, kind_of(found.st_mode))
        if limit is not None and found.st_size > limit:
            raise Blocked(where, f"a file of {found.st_size} bytes", f"this name holds at most {limit}")
    except BaseException:
        os.close(fd)
        raise
    return fd, found


def read_regular(dir_fd: int, name: str, where: str, limit: int) -> bytes:
    """The whole regular file ``name`` (at most ``limit`` bytes, checked before reading)."""
    fd, found = open_regular(dir_fd, name, where, limit)
    try:
        want = found.st_size
        chunks, got = [], 0
        while got <= want:  # a file that grows while read is cut at its length + 1: never more
            chunk = os.read(fd, min(want + 1 - got, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
        data = b"".join(chunks)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise Blocked(where, "a file that grew while it was read", f"this name holds at most {limit}")
    return data


def read_at(root: str | os.PathLike[str], parts: Sequence[str], name: str, limit: int) -> bytes | None:
    """The regular file ``root/parts.../name`` (at most ``limit`` bytes), or ``None`` when it
    is missing or blocked; a blocked name is said in one line (`tell_blocked`)."""
    where = "/".join([*parts, name])
    try:
        with Descent(Path(root)) as descent:
            return read_regular(descent.at(parts), name, where, limit)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except Blocked as exc:
        tell_blocked(Path(root), exc.where, exc.held)
        return None


def open_file(dir_fd: int, name: str, where: str) -> int:
    """`open_regular`'s descriptor alone (kept for callers of the first version)."""
    return open_regular(dir_fd, name, where)[0]


# -- folders -----------------------------------------------------------------------------


def open_folder(dir_fd: int, name: str, where: str, *, make: bool = False) -> int:
    """Open the folder ``name`` in ``dir_fd`` (made first when ``make`` and missing, and
    the making synced).

    ``FileNotFoundError`` when missing (and not ``make``); ``Blocked`` when anything but a
    folder holds the name (a link, a file, a FIFO), whether it was there or planted while
    this call made the folder.
    """
    folder, made = _open_or_make(dir_fd, name, where, make=make)
    if made:
        sync(dir_fd)
    return folder


def _open_or_make(dir_fd: int, name: str, where: str, *, make: bool) -> tuple[int, bool]:
    """`open_folder`'s descriptor, and whether this call made the folder (not synced)."""
    try:
        return os.open(name, FOLDER, dir_fd=dir_fd), False
    except FileNotFoundError:
        if not make:
            raise
    except OSError as exc:
        if exc.errno in (errno.ENOTDIR, errno.ELOOP, errno.EMLINK):
            raise _blocked(dir_fd, name, where, "a folder") or Blocked(where, "something not a folder") from None
        raise
    made = True
    try:
        os.mkdir(name, 0o777, dir_fd=dir_fd)
    except FileExistsError:
        made = False  # made by another writer meanwhile, or something planted there: the open says
    try:
        return os.open(name, FOLDER, dir_fd=dir_fd), made
    except OSError as exc:
        if made:
            sync(dir_fd)  # what this call made stays made, and durable, whatever holds it now
        if exc.errno in (errno.ENOTDIR, errno.ELOOP, errno.EMLINK):
            raise _blocked(dir_fd, name, where, "a folder") or Blocked(where, "something not a folder") from None
        raise


class Descent:
    """Open folders along one path below a root, keeping those the next path shares.

    ``at(parts)`` returns the descriptor of the folder ``parts`` names (valid until the
    next ``at`` or ``close``). Paths asked in sorted order share their prefixes, so a scan
    opens each folder once, however many entries it reads from it. ``FileNotFoundError``
    when a folder is missing (and not ``make``), ``Blocked`` when anything else holds one.
    """

    def __init__(self, root: Path) -> None:
        self._root = root
        self._parts: list[str] = []
        self._fds: list[int] = []
        self._unsynced: set[int] = set()  # folders (descriptors here) a folder was made in

    def at(self, parts: Sequence[str], *, make: bool = False) -> int:
        """A folder made on the way is durable by the time this descent leaves its parent
        (``settle``, ``close``, or an ``at`` elsewhere): not at once, so that a writer who
        makes a folder and syncs an entry in it has the making committed with the entry's
        own sync, and the parent's sync finds nothing left to do (one journal commit, not
        two, on ext4 and XFS)."""
        if not self._fds:
            self._fds.append(os.open(self._root, os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC))
        keep = 0
        while keep < min(len(parts), len(self._parts)) and parts[keep] == self._parts[keep]:
            keep += 1
        while len(self._parts) > keep:
            self._parts.pop()
            self._leave(self._fds.pop())
        for part in parts[keep:]:
            where = "/".join([*self._parts, part])
            folder, made = _open_or_make(self._fds[-1], part, where, make=make)
            if made:
                self._unsynced.add(self._fds[-1])
            self._fds.append(folder)
            self._parts.append(part)
        return self._fds[-1]

    def settle(self) -> None:
        """Sync every folder a folder was made in: what this descent made is durable."""
        for folder in sorted(self._unsynced, key=self._fds.index, reverse=True):  # deepest first
            sync(folder)
        self._unsynced.clear()

    def close(self) -> None:
        self.settle()
        while self._fds:
            os.close(self._fds.pop())
        self._parts.clear()

    def _leave(self, folder: int) -> None:
        if folder in self._unsynced:
            self._unsynced.discard(folder)
            sync(folder)
        os.close(folder)

    def __enter__(self) -> Descent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- writing -----------------------------------------------------------------------------

_TEMP_TRIES = 8  # a random name taken 8 times running is no accident: say the folder is blocked


def new_temp(dir_fd: int, stem: str) -> tuple[int, str]:
    """A fresh file for writing beside ``stem``: ``.<stem>.<pid>.<thread>.<random>.tmp``,
    made with ``O_EXCL`` (nothing planted there is opened). A name already taken means the
    next random name; ``Blocked`` after a few. The descriptor is the caller's to close."""
    for _ in range(_TEMP_TRIES):
        temp = f".{stem}.{os.getpid()}.{threading.get_native_id()}.{secrets.token_hex(4)}.tmp"
        try:
            return os.open(temp, NEW_FILE, 0o666, dir_fd=dir_fd), temp
        except FileExistsError:
            continue
    raise Blocked(f".{stem}.*.tmp", "names taken at every try", "a temp file could not be made")


def replace(dir_fd: int, temp: str, name: str, where: str) -> None:
    """Rename ``temp`` over ``name`` in ``dir_fd``: what was there is replaced whole (a link
    or a FIFO is replaced itself, never followed); ``Blocked`` when a folder holds ``name``
    (``temp`` is then left for the caller to remove)."""
    try:
        os.replace(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
            raise _blocked(dir_fd, name, where, "a file") or Blocked(where, "a folder") from None
        raise


def link_new(dir_fd: int, temp: str, name: str, where: str) -> bool:
    """Hard-link ``temp`` to ``name`` only if nothing holds ``name`` (atomic and exclusive on
    a local disk and on NFS): True when this call made it, False when a regular file was
    already there (another writer's), ``Blocked`` when anything else holds it. On NFS a
    link whose reply was lost may be retried and answer "exists" although this call made
    it: ``temp``'s link count tells the two apart (2: ours)."""
    try:
        os.link(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
        return True
    except FileExistsError:
        if _linked_twice(dir_fd, temp):
            return True
        blocked = _blocked(dir_fd, name, where, "a file")
        if blocked is not None:
            raise blocked from None
        return False
    except OSError:
        if _linked_twice(dir_fd, temp):
            return True
        raise


def _linked_twice(dir_fd: int, temp: str) -> bool:
    try:
        return os.stat(temp, dir_fd=dir_fd, follow_symlinks=False).st_nlink == 2
    except OSError:
        return False


def remove(dir_fd: int, name: str) -> bool:
    """Unlink the file or link ``name`` (never what a link names); False when nothing, or a
    folder, is there (a folder planted at a file's name is left as it is)."""
    try:
        os.unlink(name, dir_fd=dir_fd)
    except (FileNotFoundError, IsADirectoryError, PermissionError, NotADirectoryError):
        return False  # (Linux says EISDIR for a folder, macOS EPERM)
    return True


def sync(dir_fd: int) -> None:
    """Make a rename, link or unlink in a folder durable; quietly skipped where unsupported."""
    try:
        os.fsync(dir_fd)
    except OSError:
        pass


# -- telling, once per path, and not too often -----------------------------------------------

_told: set[tuple[str, int]] = set()  # (path, hash of what was said of it)
_told_lock = threading.Lock()
_TOLD_MAX = 10_000  # a folder full of planted names costs this much memory, then silence
_BURST = 20  # lines said at once; after them, one a second
_bucket = {"tokens": float(_BURST), "at": 0.0, "unsaid": 0}


def tell_once(path: str | Path, line: str, planted: object = None) -> None:
    """``line`` on stderr, the first time this process says it about ``path``, and only
    while the rate allows (``_BURST`` lines at once, then one a second; the next line said
    counts those left unsaid). Something else said of the same path (a FIFO planted where a
    link was, a name read again after it was mended and damaged anew) is a line of its own:
    a long-lived view names each plant, not only the first at a name. So is the same
    thing said of another ``planted`` (what was found there, by identity)."""
    key = (str(path), hash((line, planted)))
    with _told_lock:
        if key in _told or len(_told) >= _TOLD_MAX:
            return
        _told.add(key)
        now = time.monotonic()
        tokens = min(float(_BURST), _bucket["tokens"] + (now - _bucket["at"]))
        _bucket["at"] = now
        if tokens < 1.0:
            _bucket["tokens"] = tokens
            _bucket["unsaid"] += 1
            return
        _bucket["tokens"] = tokens - 1.0
        unsaid, _bucket["unsaid"] = _bucket["unsaid"], 0
    if unsaid:
        line += f" ({unsaid} more such lines were left unsaid.)"
    print(line, file=sys.stderr, flush=True)


def tell_blocked(root: Path, where: str, held: str) -> None:
    """Say once that ``root/where`` is blocked by ``held``, so it is read as missing: once
    per thing planted there (a link put back after it was removed is named again)."""
    path = root / where
    try:
        found = os.lstat(path)  # never follows the last part: which thing, not what it names
        planted: object = (found.st_ino, found.st_ctime_ns)
    except OSError:
        planted = None
    if held == "a symbolic link":
        tell_once(path, f"somatize store: {path} {_LINK_TEXT}; it is left out.", planted)
    else:
        what = held if held.startswith("a file") else f"not a regular file ({held})"
        tell_once(
            path,
            f"somatize store: {path} is {what}, which no store writes; it is left out "
            "(read as nothing there). Remove it, and check who else may write there.",
            planted,
        )


def tell_link(root: Path, where: str) -> None:
    tell_blocked(root, where, "a symbolic link")


def forget_told() -> None:
    """Say everything again (for tests that watch the lines)."""
    with _told_lock:
        _told.clear()
        _bucket.update(tokens=float(_BURST), at=0.0, unsaid=0)
