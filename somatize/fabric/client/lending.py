"""The client's side of a lease (the rules are in :mod:`somatize.fabric.leases`): the
:class:`Pool` of segments this process creates and owns in each mount folder, and the
:class:`Lending` of one exchange, which copies a request into a leased segment, reads the
answer out, and gives the segments back (or retires them) however the exchange ends.

A segment belongs to the worker it was first lent to, for life: it is lent again, as input
or as a spare, only to that worker (``Segment.worker``: the host as the client reaches it),
never to another. Zeroing it on the way to another worker would hide its old bytes from the
new one, but not the new bytes from the old one, which may keep it mapped (a worker's
``Attachments`` do, by design, between calls); and it costs a pass over the segment each
time. So one pool per folder, its free segments kept apart by worker, and its bounds
(``IDLE_COUNT``, ``IDLE_BYTES``) over them all: memory does not grow with the workers.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import mmap
import os
import secrets
import threading
import weakref
from collections import OrderedDict, deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import ProtocolError, Refused
from ...wire import Mounted, encode
from .. import mount as _mount
from ..leases import MAKE, aligned, anchor_at, byte_view, map_shared, open_folder, size_for
from ..proofs import seal as _seal

IDLE_COUNT = 8
IDLE_BYTES = 1 << 30
SPARE = 4


class Segment:
    """One pooled file, mapped for as long as it lives."""

    __slots__ = ("name", "path", "size", "map", "view", "holds", "lent", "retired", "gone", "worker", "__weakref__")

    def __init__(self, name: str, path: Path, size: int, mapped: mmap.mmap, worker: str = "") -> None:
        self.name = name
        self.worker = worker  # the only worker it is ever lent to
        self.path = path
        self.size = size
        self.map = mapped
        self.view = memoryview(mapped)
        self.holds = 0  # live anchors into it, in this process
        self.lent = False  # part of an exchange not ended yet
        self.retired = False  # never reused: unlinked when nothing holds it any more
        self.gone = False  # unlinked

    def unlink(self) -> None:
        if not self.gone:
            self.gone = True
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()


class Pool:
    """The segments of one process in one folder. Thread-safe."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.lock = threading.Lock()
        self.free: OrderedDict[str, Segment] = OrderedDict()  # least recently used first
        self.known: dict[str, Segment] = {}  # every segment alive (free, lent, or held)
        self.prefix = f"{os.getpid()}-{_mount._tag()}"
        self.made = 0  # segments created, for tests and figures
        self.adopted = 0
        # anchors that died: their finalizer may run inside a locked region (a collection
        # can start at any allocation), so it only queues, and whoever holds the lock next
        # (or the finalizer itself, when the lock is free) settles them
        self.released: deque[Segment] = deque()

    # segments in and out
    def lease(self, need: int, worker: str = "") -> Segment:
        """A segment of at least ``need`` bytes for ``worker``: the smallest free one that
        was lent to it before, or a new one, which is its from now on."""
        with self.lock:
            self._released()
            best = None
            for seg in self.free.values():
                if seg.worker == worker and seg.size >= need and (best is None or seg.size < best.size):
                    best = seg
            if best is not None:
                del self.free[best.name]
                best.lent = True
                return best
        seg = self._make(size_for(need), worker)
        seg.lent = True
        return seg

    def spares(self, count: int, worker: str = "") -> list[Segment]:
        """Up to ``count`` free segments of ``worker``'s, the largest first, lent to the caller."""
        with self.lock:
            self._released()
            chosen = sorted((s for s in self.free.values() if s.worker == worker), key=lambda s: -s.size)[:count]
            for seg in chosen:
                del self.free[seg.name]
                seg.lent = True
            return chosen

    def settle(self, seg: Segment) -> None:
        """``seg`` may have come free: back to the pool (or unlinked, when retired or over
        the bounds) once it is neither lent nor held."""
        with self.lock:
            self._released()
            self._settle(seg)

    def collect(self) -> None:
        """Settle the segments whose last view died since the pool was last used."""
        with self.lock:
            self._released()

    def adopt(self, name: str, worker: str = "") -> Segment:
        """A file ``worker`` made for this process's answer, taken into the pool as its."""
        directory = open_folder(self.root)
        try:
            descriptor, info = _mount.opened(directory, self.root, name, writable=True, need=1)
        finally:
            os.close(directory)
        try:
            with contextlib.suppress(OSError):
                os.posix_fallocate(descriptor, 0, info.st_size)  # a hole would fault on reuse
            seg = Segment(name, self.root / name, info.st_size, map_shared(descriptor, info.st_size), worker)
        finally:
            os.close(descriptor)
        with self.lock:
            self.known[name] = seg
            self.adopted += 1
        return seg

    def drain(self) -> None:
        """Unlink every idle segment (a broker closed; the next exchange makes new ones),
        and the answers written for this process that nobody took in (see ``orphans``)."""
        with self.lock:
            self._released()
            self._trim(0, 0)
            self._orphans()
            self._leave()

    def close(self) -> None:
        """Unlink every segment this process made here, and every file a worker made for
        it (at exit)."""
        with self.lock:
            for seg in list(self.known.values()):
                seg.retired = True
                seg.unlink()
            self._trim(0, 0)
            self._orphans()
            self._leave()

    def discard(self, msg: Mounted) -> None:
        """An answer that arrived after its exchange ended (a deadline, a dropped link):
        unlink the files a worker made for this process in it, which nothing will adopt."""
        with self.lock:
            for name in msg.files:
                if (
                    isinstance(name, str)
                    and _mount.NAME.fullmatch(name)
                    and name.startswith(self.prefix)
                    and name not in self.known
                ):
                    with contextlib.suppress(OSError):
                        os.unlink(self.root / name)

    # inside the lock
    def _orphans(self) -> None:
        """Files named for this process that are not its segments: answers a worker wrote
        into new files for exchanges that ended before they were read."""
        try:
            names = os.listdir(self.root)
        except OSError:
            return
        for name in names:
            if name.startswith(self.prefix) and name not in self.known and _mount.NAME.fullmatch(name):
                with contextlib.suppress(OSError):
                    os.unlink(self.root / name)

    # inside the lock
    def _leave(self) -> None:
        """The default folder (``mount.own_path``), made for whoever needed it, goes when the
        last of them leaves it empty; a folder the user named stays theirs. A process that
        makes a segment just as another removes the folder makes the folder again (``_make``)."""
        if str(self.root) == _mount.own_path() and not self.known:
            with contextlib.suppress(OSError):  # not empty: someone else still uses it
                os.rmdir(self.root)

    def _released(self) -> None:
        while self.released:
            seg = self.released.popleft()
            seg.holds -= 1
            self._settle(seg)

    def _settle(self, seg: Segment) -> None:
        if seg.lent or seg.holds or seg.name not in self.known:
            return
        if seg.retired or seg.gone or seg.size > IDLE_BYTES:
            self._drop(seg)
            return
        self.free[seg.name] = seg
        self.free.move_to_end(seg.name)
        self._trim(IDLE_COUNT, IDLE_BYTES)

    def _trim(self, count: int, nbytes: int) -> None:
        idle = sum(s.size for s in self.free.values())
        while self.free and (len(self.free) > count or idle > nbytes):
            _, seg = self.free.popitem(last=False)
            idle -= seg.size
            self._drop(seg)

    def _drop(self, seg: Segment) -> None:
        self.free.pop(seg.name, None)
        self.known.pop(seg.name, None)
        seg.unlink()
        if not seg.holds:
            # nothing of ours points into it any more: the mapping can go now (a view a
            # caller still holds keeps it alive otherwise, and the mapping goes with it)
            with contextlib.suppress(BufferError, ValueError):
                seg.view.release()
                seg.map.close()

    def _make(self, size: int, worker: str) -> Segment:
        name = f"{self.prefix}{secrets.token_hex(12)}-0"
        path = self.root / name
        for again in (True, False):
            try:
                directory = open_folder(self.root)
                try:
                    descriptor = os.open(name, MAKE, 0o600, dir_fd=directory)
                finally:
                    os.close(directory)
                break
            except (FileNotFoundError, Refused):
                if not again or os.path.lexists(self.root):
                    raise
                _mount.private(self.root)  # the last user of the default folder just removed it
        try:
            try:
                os.posix_fallocate(descriptor, 0, size)
            except OSError as exc:
                raise Refused(
                    f"a shared-memory segment of {size:,} bytes could not be made in {self.root} "
                    f"({exc.strerror}): free memory there, or give `mount=` a larger folder"
                ) from exc
            seg = Segment(name, path, size, map_shared(descriptor, size), worker)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        finally:
            os.close(descriptor)
        with self.lock:
            self.known[name] = seg
            self.made += 1
        return seg


_pools: dict[str, Pool] = {}
_pools_lock = threading.Lock()


def pool(folder: str | os.PathLike[str]) -> Pool:
    """This process's pool in ``folder`` (checked and made private by ``mount.private``)."""
    root = _mount.private(folder)
    key = str(root)
    with _pools_lock:
        found = _pools.get(key)
        if found is None or found.prefix != f"{os.getpid()}-{_mount._tag()}":  # a fork starts afresh
            found = _pools[key] = Pool(root)
        return found


def drain(folder: str | os.PathLike[str]) -> None:
    """Unlink this process's idle segments in ``folder``, if it has a pool there."""
    with _pools_lock:
        found = _pools.get(str(Path(folder)))
    if found is not None:
        found.drain()


@atexit.register
def _at_exit() -> None:
    with _pools_lock:
        pools = [p for p in _pools.values() if p.prefix.startswith(f"{os.getpid()}-")]
    for each in pools:
        each.close()


class Lending:
    """The client's side of one mounted exchange: the segments it lent, and what it read.

    ``send`` copies a request's frames into a leased segment and returns the ``Mounted``
    frames to send, sealed with the session's key (the same segments when the request is
    sent again, sealed anew: a worker greeted again holds a new key); ``receive`` turns an
    answer's spans into frames; ``end`` gives everything back (idempotent), or retires it
    when no terminal answer came. ``worker`` names the worker it lends to (``Segment.worker``)."""

    def __init__(self, pool_: Pool, worker: str = "") -> None:
        self.pool = pool_
        self.worker = worker
        self.mine: dict[str, Segment] = {}  # lent to this exchange, by name
        self.sent: Mounted | None = None
        self.ended = False

    def send(self, frames: Sequence[Any], seal_key: bytes | None = None) -> list:
        """The ``Mounted`` frames standing for ``frames``, its names sealed with ``seal_key``
        (the key of the session it goes to: ``proofs.seal_key``)."""
        if self.sent is not None:
            return encode(self._sealed(self.sent, seal_key))
        views = [byte_view(f) for f in frames[1:]]
        need = sum(aligned(v.nbytes) for v in views)
        seg = self.pool.lease(max(need, 1), self.worker)
        self.mine[seg.name] = seg
        spans = []
        offset = 0
        for v in views:
            seg.view[offset : offset + v.nbytes] = v
            spans.append((0, offset, v.nbytes))
            offset += aligned(v.nbytes)
        spare = self.pool.spares(SPARE, self.worker)
        for s in spare:
            self.mine[s.name] = s
        header = frames[0] if isinstance(frames[0], (bytes, memoryview)) else byte_view(frames[0])
        files, spares = (seg.name,), tuple(s.name for s in spare)
        self.sent = Mounted(
            files,
            header=header,
            spans=tuple(spans),
            spare=spares,
            seal=_seal(seal_key, files, spares) if seal_key is not None else "",
        )
        return encode(self.sent)

    @staticmethod
    def _sealed(msg: Mounted, key: bytes | None) -> Mounted:
        sealed = _seal(key, msg.files, msg.spare) if key is not None else ""
        return msg if sealed == msg.seal else dataclasses.replace(msg, seal=sealed)

    def receive(self, msg: Mounted) -> list:
        """The frames of an answer: its header, then a read-only view per span, each
        anchored (see ``anchor_at``). ``ProtocolError`` for a name or a span that is not one
        of this exchange's segments or a new file the worker made for this process."""
        if not msg.spans and msg.files:
            raise ProtocolError("an answer to a pooled request names whole files without spans")
        segs: list[Segment] = []
        for name in msg.files:
            seg = self.mine.get(name)
            if seg is None:
                if not name.startswith(self.pool.prefix) or name in self.pool.known:
                    raise ProtocolError(
                        f"the answer names `{name[:80]}`, which is no segment this exchange lent "
                        f"and no file made for this process: refused"
                    )
                seg = self.pool.adopt(name, self.worker)
                seg.lent = True
                self.mine[name] = seg
            segs.append(seg)
        for name in msg.kept:
            seg = self.mine.get(name)
            if seg is None:
                raise ProtocolError(f"the answer says it kept `{name[:80]}`, which this exchange did not lend")
            seg.retired = True
        frames: list = [msg.header]
        for i, offset, length in msg.spans:
            seg = segs[i]
            if offset + length > seg.size:
                raise ProtocolError(
                    f"the answer reads {length:,} bytes at {offset:,} of `{seg.name}`, which has {seg.size:,}: refused"
                )
            frames.append(self._hold(seg, offset, length).data)  # memoryview(the anchor)
        return frames

    def _hold(self, seg: Segment, offset: int, length: int) -> np.ndarray:
        anchor = anchor_at(seg.view, offset, length, writable=False)
        with self.pool.lock:
            seg.holds += 1
        weakref.finalize(anchor, _let_go, self.pool, seg)
        return anchor

    def end(self, answered: bool) -> None:
        """The exchange is over: each segment back to the pool once nothing holds it, or
        retired (unlinked, never reused) when the worker kept it or, ``answered`` False,
        no terminal answer came (the worker may still be writing there)."""
        if self.ended:
            return
        self.ended = True
        for seg in self.mine.values():
            if not answered:
                seg.retired = True  # a worker may still write there: never reused
            seg.lent = False
            self.pool.settle(seg)
        self.mine = {}
        self.sent = None


def _let_go(pool_: Pool, seg: Segment) -> None:
    """An anchor died (a finalizer: any thread, any moment, maybe inside the pool's lock)."""
    pool_.released.append(seg)
    if pool_.lock.acquire(blocking=False):
        try:
            pool_._released()
        finally:
            pool_.lock.release()
