"""Names under a folder, opened one component at a time, never through a link.

A store's folder is shared: whoever else may write in it can put a symbolic link where a
folder or an entry belongs, pointing at anything this user may read or write (a root-only
folder, a secret). So no name under the root is ever given to the kernel as a path: the
root is opened once per operation, and each component below it is opened from its
parent's descriptor with ``O_NOFOLLOW`` (``openat``). A link is met, never followed. A
reader leaves it out and says so in one line, once per path; a writer refuses it
(``LinkMet``, an ``OSError`` whose text says what to do).

Files are opened with ``O_NONBLOCK`` too, so a FIFO planted under an entry's name answers
at once instead of hanging the reader; what is not a regular file is the caller's to refuse.

This module knows nothing of records or of what names mean: ``store`` does.
"""

from __future__ import annotations

import errno
import os
import stat
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
FOLDER = os.O_RDONLY | _O_DIRECTORY | _O_NOFOLLOW | _O_CLOEXEC
FILE = os.O_RDONLY | _O_NOFOLLOW | _O_CLOEXEC | getattr(os, "O_NONBLOCK", 0)
NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC

_LINK_TEXT = (
    "is a symbolic link, and a store never follows links; someone who may write this folder "
    "made it: remove it, and check who else may write there"
)


class LinkMet(OSError):
    """A link stands where a store folder or entry belongs; it was not followed."""

    def __init__(self, path: str) -> None:
        super().__init__(errno.ELOOP, _LINK_TEXT, path)


def is_link(dir_fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def open_file(dir_fd: int, name: str, where: str) -> int:
    """Open ``name`` in the folder ``dir_fd`` for reading; ``LinkMet`` when it is a link."""
    try:
        return os.open(name, FILE, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP or (exc.errno == errno.EMLINK and is_link(dir_fd, name)):
            raise LinkMet(where) from None  # (FreeBSD says EMLINK where Linux says ELOOP)
        raise


def open_folder(dir_fd: int, name: str, where: str, *, make: bool = False) -> int:
    """Open the folder ``name`` in ``dir_fd`` (made first when ``make`` and missing)."""
    try:
        return os.open(name, FOLDER, dir_fd=dir_fd)
    except FileNotFoundError:
        if not make:
            raise
    except OSError as exc:
        if exc.errno in (errno.ENOTDIR, errno.ELOOP) and is_link(dir_fd, name):
            raise LinkMet(where) from None
        raise
    try:
        os.mkdir(name, 0o777, dir_fd=dir_fd)
    except FileExistsError:
        pass  # made by another writer meanwhile, or a link or file planted there: see below
    else:
        sync(dir_fd)
    return open_folder(dir_fd, name, where)


class Descent:
    """Open folders along one path below a root, keeping those the next path shares.

    ``at(parts)`` returns the descriptor of the folder ``parts`` names (valid until the
    next ``at`` or ``close``). Paths asked in sorted order share their prefixes, so a scan
    opens each folder once, however many entries it reads from it.
    """

    def __init__(self, root: Path) -> None:
        self._root = root
        self._parts: list[str] = []
        self._fds: list[int] = []

    def at(self, parts: Sequence[str], *, make: bool = False) -> int:
        if not self._fds:
            self._fds.append(os.open(self._root, os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC))
        keep = 0
        while keep < min(len(parts), len(self._parts)) and parts[keep] == self._parts[keep]:
            keep += 1
        while len(self._parts) > keep:
            self._parts.pop()
            os.close(self._fds.pop())
        for part in parts[keep:]:
            where = "/".join([*self._parts, part])
            self._fds.append(open_folder(self._fds[-1], part, where, make=make))
            self._parts.append(part)
        return self._fds[-1]

    def close(self) -> None:
        while self._fds:
            os.close(self._fds.pop())
        self._parts.clear()

    def __enter__(self) -> Descent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def sync(dir_fd: int) -> None:
    """Make a rename, link or unlink in a folder durable; quietly skipped where unsupported."""
    try:
        os.fsync(dir_fd)
    except OSError:
        pass


# -- telling, once per path ----------------------------------------------------------------

_told: set[str] = set()
_told_lock = threading.Lock()
_TOLD_MAX = 10_000  # a folder full of planted links costs this much memory, then silence


def tell_once(path: Path, line: str) -> None:
    """``line`` on stderr, the first time this process says something about ``path``."""
    key = str(path)
    with _told_lock:
        if key in _told or len(_told) >= _TOLD_MAX:
            return
        _told.add(key)
    print(line, file=sys.stderr, flush=True)


def tell_link(root: Path, where: str) -> None:
    path = root / where
    tell_once(path, f"somatize store: {path} {_LINK_TEXT}; it is left out.")


def forget_told() -> None:
    """Say everything again (for tests that watch the lines)."""
    with _told_lock:
        _told.clear()
