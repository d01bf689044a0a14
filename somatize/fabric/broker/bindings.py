"""Which worker key owns which dialed-in host name: the map the broker asks on every offer
(``Bindings``), and the file that keeps it across a broker's restarts.

A restarted broker must not hand a name to whichever key says Hello first, so the names
bound to keys are written to ``--bindings FILE`` (a JSON map of host to Z85 public key).

Who may touch it: the broker's own user. The folder holding the file must be that user's and
writable by nobody else (checked at start, refused with the fix otherwise): whoever can write
there can replace the file, and so hand a name to their key. The file is written through a
temporary file of an unpredictable name, created with ``O_EXCL | O_NOFOLLOW`` (a link planted
there is never followed) and renamed over the old one, so a reader never sees half a file.
Reading refuses anything that is not the map this module writes.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from collections.abc import Iterable, Iterator, MutableMapping
from pathlib import Path

from ...wire import MAX_NAME
from ...wire.limits import Z85
from ..hosts import pool_of


def check_folder(path: Path) -> None:
    """Refuse a bindings file whose folder is another user's or writable by others, with the
    fix; a folder that does not exist yet is made, 0700."""
    folder = path.resolve().parent
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)  # systemd's StateDirectory= makes it too
        info = os.stat(folder)
    except OSError as exc:
        raise ValueError(f"the folder of the bindings file {path} cannot be used: {exc}") from exc
    if info.st_uid != os.geteuid():
        raise ValueError(
            f"the folder of the bindings file {path} ({folder}) belongs to another user (uid {info.st_uid}): "
            f"whoever owns it can hand a host name to their key. Keep the file in a folder of this user's, "
            f"like /var/lib/somatize"
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ValueError(
            f"the folder of the bindings file {path} ({folder}) can be written by others (mode "
            f"{stat.S_IMODE(info.st_mode):04o}): whoever writes there can hand a host name to their key. "
            f"Run `chmod go-w {folder}`, or keep the file in a folder of this user's"
        )


def read(path: Path) -> dict[str, str]:
    """The names bound to keys, from a file this broker wrote; none when it does not exist
    yet. Anything else in it is refused with a sentence."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise ValueError(f"{path} cannot be read as the bindings file (a link is never followed): {exc}") from exc
    with os.fdopen(fd) as source:
        text = source.read(64 << 20)
    try:
        table = json.loads(text)
    except ValueError as exc:
        raise ValueError(
            f"{path} is not the bindings file this broker writes (a JSON map of host to key): {exc}"
        ) from exc
    if not isinstance(table, dict) or not all(
        isinstance(h, str) and 0 < len(h) <= MAX_NAME and isinstance(k, str) and len(k) == 40 and set(k) <= Z85
        for h, k in table.items()
    ):
        raise ValueError(f"{path} is not the bindings file this broker writes: it maps host names to Z85 public keys")
    return table


def write(path: Path, table: dict[str, str]) -> None:
    """Write ``table`` to ``path`` atomically, 0600, never through a link."""
    fd, temp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)  # O_EXCL | O_NOFOLLOW
    try:
        with os.fdopen(fd, "w") as out:
            json.dump(table, out, sort_keys=True, indent=1)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temp, path)
    except BaseException:
        try:
            os.unlink(temp)
        except OSError:
            pass
        raise


class Bindings(MutableMapping):
    """Host name -> the owner it is bound to, with each owner's names in the order they were
    bound and a count of changes (``version``): what is asked of every offer (how many names a
    key holds, which it holds longest) costs the same whatever the size of the fleet."""

    def __init__(self) -> None:
        self._owner: dict[str, str] = {}
        self._held: dict[str, dict[str, None]] = {}  # owner -> its names, oldest first
        self._pools: dict[str, dict[str, int]] = {}  # pool -> owner -> how many of its members it holds
        self.version = 0

    def __getitem__(self, host: str) -> str:
        return self._owner[host]

    def __setitem__(self, host: str, owner: str) -> None:
        old = self._owner.get(host)
        if old == owner:
            return
        if old is not None:
            self._unhold(host, old)
        self._owner[host] = owner
        self._held.setdefault(owner, {})[host] = None
        member = pool_of(host)
        if member is not None:
            owners = self._pools.setdefault(member[0], {})
            owners[owner] = owners.get(owner, 0) + 1
        self.version += 1

    def __delitem__(self, host: str) -> None:
        self._unhold(host, self._owner.pop(host))
        self.version += 1

    def _unhold(self, host: str, owner: str) -> None:
        names = self._held[owner]
        del names[host]
        if not names:
            del self._held[owner]
        member = pool_of(host)
        if member is not None:
            owners = self._pools[member[0]]
            owners[owner] -= 1
            if not owners[owner]:
                del owners[owner]
                if not owners:
                    del self._pools[member[0]]

    def pool_owners(self, pool: str) -> Iterable[str]:
        """Who holds the members of ``pool`` (``gpu#0``, ``gpu#1``...)."""
        return self._pools.get(pool, {}).keys()

    def __iter__(self) -> Iterator[str]:
        return iter(self._owner)

    def __len__(self) -> int:
        return len(self._owner)

    def held(self, owner: str) -> list[str]:
        """The names ``owner`` holds, the longest held first."""
        return list(self._held.get(owner, ()))

    def count(self, owner: str) -> int:
        return len(self._held.get(owner, ()))
