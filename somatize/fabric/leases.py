"""Pooled shared-memory segments: the Mount path between processes of one machine.

A fresh file per frame per message costs its page faults every time (a 256 MiB copy into
new tmpfs memory takes ~200 ms; into memory already faulted in, ~25 ms). Here the memory
is made once and reused.

Who does what (the rules of a lease):

- **The client creates and owns every segment.** Per mount folder, a process keeps a
  :class:`Pool` of segment files named like all cargo (``mount.NAME``: its pid and machine
  tag, so ``mount.sweep`` removes a dead client's), made 0600 with ``O_EXCL``, sized to a
  step of at most an eighth above the need (>= 1 MiB), pre-faulted once
  (``posix_fallocate``, then ``mmap`` with ``MAP_POPULATE``) and kept mapped. A request's
  frames are copied into one leased segment at 16-byte aligned offsets (:class:`Lending`),
  and the request names them as spans ``(file, offset, length)``; free segments go along as
  ``spare`` for the answer.
- **The worker attaches** (:class:`Attachments`): it maps a named segment only after
  checking it (no link followed, a regular file, this user's, one link, big enough), keeps
  the mapping (by name, inode and size; bounded, least recently used first out), and hands
  the node zero-copy views. It writes its answer's frames into a spare segment that fits,
  names a frame that is a view of an input segment as a span of it (no copy), and makes a
  new file named for the client for the rest (the client adopts it into its pool).
- **Acknowledgement is the answer.** A view the worker made stays tied to an *anchor*
  (a small NumPy array over the span, which every view built from it keeps alive). When
  the answer is written the worker looks at its anchors: a segment whose anchor is still
  alive is one a node kept a reference into, and the answer names it in ``kept``. The
  worker never unlinks a client's segment (``sweep`` of a dead pid aside).
- **The client unlinks.** At the terminal answer each segment goes back to the pool, once
  no view of it is alive here either (the same anchors: by default the answer's values are
  copies and nothing stays; with ``views=True`` the values are views and the segment comes
  back when the last one is freed). A ``kept`` segment is retired: unlinked, never reused.
  An exchange that ends without a terminal answer (a deadline, a worker or broker gone)
  retires its segments too, since a worker may still be writing into them. Ending twice
  changes nothing. The pool keeps at most ``IDLE_COUNT`` idle segments and
  ``IDLE_BYTES`` idle bytes (the least recently used go first), drops its idle ones when
  a broker closes, and unlinks all it made when the process exits.

Pooled segments are used only on a folder in memory (tmpfs, such as ``/dev/shm``): such a
folder is on one machine, where two mappings of one file are coherent. On any other
folder (a cluster filesystem) the Mount path writes one file per frame (:mod:`.mount`).
Nothing received is trusted: names, offsets and lengths are checked against the files
before anything is mapped or read.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import mmap
import os
import secrets
import stat
import threading
import weakref
from collections import OrderedDict, deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ProtocolError, Refused
from ..wire import Mounted, encode
from . import mount as _mount

ALIGN = 16
"""Frames start at offsets that are multiples of this (what any dtype needs)."""
SMALLEST = 1 << 20
"""The smallest segment."""
IDLE_COUNT = 8
"""Idle segments a pool keeps."""
IDLE_BYTES = 1 << 30
"""Idle bytes a pool keeps; a segment over this is unlinked when it comes back."""
SPARE = 4
"""Free segments a request offers for its answer."""
ATTACHED = 16
"""Segments a worker keeps mapped."""

_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_MAKE = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def size_for(need: int) -> int:
    """The size of a segment for ``need`` bytes: >= 1 MiB, and at most an eighth over the
    need (a power of two would waste up to half of memory that is faulted in and kept)."""
    if need <= SMALLEST:
        return SMALLEST
    step = max(4096, 1 << (need - 1).bit_length() - 4)
    return -(-need // step) * step


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _address(view: Any) -> tuple[int, int]:
    """The address and length of a contiguous buffer."""
    flat = np.frombuffer(view, np.uint8) if not isinstance(view, np.ndarray) else view
    return flat.__array_interface__["data"][0], flat.nbytes


def _byte_view(frame: Any) -> memoryview:
    view = memoryview(getattr(frame, "buffer", frame))
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B") if view.c_contiguous else memoryview(view.tobytes())
    return view


def _map(descriptor: int, size: int) -> mmap.mmap:
    return mmap.mmap(descriptor, size, flags=mmap.MAP_SHARED | _POPULATE,
                     prot=mmap.PROT_READ | mmap.PROT_WRITE)


def _open_folder(root: Path) -> int:
    try:
        return os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise Refused(f"the mount folder {root} cannot be opened: {exc}") from exc


# -- what a folder is ------------------------------------------------------------------------

_in_memory: dict[str, bool] = {}


def in_memory(folder: str | os.PathLike[str]) -> bool:
    """Whether ``folder`` is on a filesystem in memory (tmpfs): then it is on this machine
    alone, and pooled segments may be used there."""
    key = os.path.realpath(folder)
    known = _in_memory.get(key)
    if known is None:
        best, kind = "", ""
        try:
            with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as table:
                for line in table:
                    fields = line.split()
                    if " - " not in line or len(fields) < 5:
                        continue
                    point = fields[4].replace("\\040", " ")
                    after = line.split(" - ", 1)[1].split()
                    inside = key == point or key.startswith(point.rstrip("/") + "/")
                    if inside and len(point) >= len(best) and after:
                        best, kind = point, after[0]
        except OSError:
            kind = ""
        known = _in_memory[key] = kind == "tmpfs"
    return known


# -- the client's side -----------------------------------------------------------------------


class Segment:
    """One pooled file, mapped for as long as it lives."""

    __slots__ = ("name", "path", "size", "map", "view", "holds", "lent", "retired", "gone", "__weakref__")

    def __init__(self, name: str, path: Path, size: int, mapped: mmap.mmap) -> None:
        self.name = name
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
    def lease(self, need: int) -> Segment:
        with self.lock:
            self._released()
            best = None
            for seg in self.free.values():
                if seg.size >= need and (best is None or seg.size < best.size):
                    best = seg
            if best is not None:
                del self.free[best.name]
                best.lent = True
                return best
        seg = self._make(size_for(need))
        seg.lent = True
        return seg

    def spares(self, count: int) -> list[Segment]:
        """Up to ``count`` free segments, the largest first, lent to the caller."""
        with self.lock:
            self._released()
            chosen = sorted(self.free.values(), key=lambda s: -s.size)[:count]
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

    def adopt(self, name: str) -> Segment:
        """A file a worker made for this process's answer, taken into the pool."""
        directory = _open_folder(self.root)
        try:
            descriptor, info = _mount.opened(directory, self.root, name, writable=True, need=1)
        finally:
            os.close(directory)
        try:
            with contextlib.suppress(OSError):
                os.posix_fallocate(descriptor, 0, info.st_size)  # a hole would fault on reuse
            seg = Segment(name, self.root / name, info.st_size, _map(descriptor, info.st_size))
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
                if isinstance(name, str) and _mount.NAME.fullmatch(name) and name.startswith(self.prefix) \
                        and name not in self.known:
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

    def _make(self, size: int) -> Segment:
        name = f"{self.prefix}{secrets.token_hex(12)}-0"
        path = self.root / name
        for again in (True, False):
            try:
                directory = _open_folder(self.root)
                try:
                    descriptor = os.open(name, _MAKE, 0o600, dir_fd=directory)
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
            seg = Segment(name, path, size, _map(descriptor, size))
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


def _anchor(seg_view: memoryview, offset: int, length: int, *, writable: bool) -> np.ndarray:
    """A NumPy array over ``length`` bytes at ``offset``: every view built from the frame
    made of it keeps it alive, so whether it is alive says whether anything still points
    into the segment there."""
    anchor = np.frombuffer(seg_view, np.uint8, count=length, offset=offset)
    if not writable:
        anchor.flags.writeable = False
    return anchor


class Lending:
    """The client's side of one mounted exchange: the segments it lent, and what it read.

    ``send`` copies a request's frames into a leased segment and returns the ``Mounted``
    frames to send (the same ones when the request is sent again); ``receive`` turns an
    answer's spans into frames; ``end`` gives everything back (idempotent), or retires it
    when no terminal answer came."""

    def __init__(self, pool_: Pool) -> None:
        self.pool = pool_
        self.mine: dict[str, Segment] = {}  # lent to this exchange, by name
        self.sent: list | None = None
        self.ended = False

    def send(self, frames: Sequence[Any]) -> list:
        if self.sent is not None:
            return self.sent
        views = [_byte_view(f) for f in frames[1:]]
        need = sum(_aligned(v.nbytes) for v in views)
        seg = self.pool.lease(max(need, 1))
        self.mine[seg.name] = seg
        spans = []
        offset = 0
        for v in views:
            seg.view[offset:offset + v.nbytes] = v
            spans.append((0, offset, v.nbytes))
            offset += _aligned(v.nbytes)
        spare = self.pool.spares(SPARE)
        for s in spare:
            self.mine[s.name] = s
        header = frames[0] if isinstance(frames[0], (bytes, memoryview)) else _byte_view(frames[0])
        self.sent = encode(Mounted((seg.name,), header=header, spans=tuple(spans),
                                   spare=tuple(s.name for s in spare)))
        return self.sent

    def receive(self, msg: Mounted) -> list:
        """The frames of an answer: its header, then a read-only view per span, each
        anchored (see ``_anchor``). ``ProtocolError`` for a name or a span that is not one
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
                seg = self.pool.adopt(name)
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
                    f"the answer reads {length:,} bytes at {offset:,} of `{seg.name}`, which has "
                    f"{seg.size:,}: refused"
                )
            frames.append(memoryview(self._hold(seg, offset, length)))
        return frames

    def _hold(self, seg: Segment, offset: int, length: int) -> np.ndarray:
        anchor = _anchor(seg.view, offset, length, writable=False)
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


# -- the worker's side -----------------------------------------------------------------------


class _Attached:
    __slots__ = ("name", "inode", "size", "map", "view", "base")

    def __init__(self, name: str, inode: int, size: int, mapped: mmap.mmap) -> None:
        self.name = name
        self.inode = inode
        self.size = size
        self.map = mapped
        self.view = memoryview(mapped)
        self.base = _address(self.view)[0]


class Attachments:
    """A worker's mappings of its clients' segments in one folder, kept between calls so
    that a repeated call pays no new faults. Bounded (``ATTACHED``, least recently used
    out); one whose file went away or was replaced is mapped anew. Used by one thread at a
    time (the worker takes and answers under its own lock)."""

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.root = Path(folder)
        self.maps: OrderedDict[str, _Attached] = OrderedDict()
        self.lock = threading.Lock()
        self.mapped = 0  # mappings made, for tests and figures
        self.seen = 0  # the folder's mtime when last pruned

    def attach(self, name: str, need: int) -> _Attached:
        with self.lock:
            found = self.maps.get(name)
            if found is not None:
                try:
                    info = os.stat(self.root / name, follow_symlinks=False)
                except OSError:
                    info = None
                if info is not None and info.st_ino == found.inode and info.st_size == found.size \
                        and info.st_nlink == 1 and stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid():
                    self.maps.move_to_end(name)
                    if found.size < need:
                        raise ProtocolError(
                            f"a mounted message reads up to byte {need:,} of `{name}`, which has "
                            f"{found.size:,}: refused"
                        )
                    return found
                del self.maps[name]
            directory = _open_folder(self.root)
            try:
                descriptor, info = _mount.opened(directory, self.root, name, writable=True, need=need)
            finally:
                os.close(directory)
            try:
                if info.st_size == 0:
                    raise ProtocolError(f"a mounted message names `{name}`, an empty file: a segment is never empty")
                if info.st_blocks * 512 < info.st_size:
                    # a pool allocates every segment whole; a file with holes would make this
                    # worker allocate (or fault with SIGBUS on a full folder) what nobody sent
                    raise ProtocolError(
                        f"a mounted message names `{name}`, a file with holes ({info.st_blocks * 512:,} of "
                        f"{info.st_size:,} bytes allocated): a segment is allocated whole; refused"
                    )
                made = _Attached(name, info.st_ino, info.st_size, _map(descriptor, info.st_size))
            except OSError as exc:
                raise ProtocolError(f"`{name}` in {self.root} could not be mapped: {exc.strerror}") from exc
            finally:
                os.close(descriptor)
            self.maps[name] = made
            self.mapped += 1
            while len(self.maps) > ATTACHED:
                self.maps.popitem(last=False)  # a node holding a view keeps that mapping alive
            return made

    def prune(self) -> None:
        """Let go of the mappings of files that went away (a client unlinked them: their
        memory is freed once nobody maps it). Looks only when the folder changed."""
        try:
            changed = os.stat(self.root).st_mtime_ns
        except OSError:
            return
        with self.lock:
            if changed == self.seen:
                return
            self.seen = changed
            for name, seg in list(self.maps.items()):
                try:
                    info = os.stat(self.root / name, follow_symlinks=False)
                except OSError:
                    info = None
                if info is None or info.st_ino != seg.inode:
                    del self.maps[name]

    def take(self, msg: Mounted) -> tuple[list, Taken]:
        """The frames of a pooled request (its header, then a writable, anchored view per
        span) and the :class:`Taken` that answers it."""
        self.prune()
        owner = _owner(msg.files[0]) if msg.files else None
        for name in (*msg.files, *msg.spare):
            if _owner(name) != owner:
                raise ProtocolError(
                    f"a mounted message names `{name[:80]}` and `{msg.files[0][:80]}`, files of two "
                    f"different owners: one message names only its client's files"
                )
        ends = [0] * len(msg.files)
        for i, offset, length in msg.spans:
            ends[i] = max(ends[i], offset + length)
        taken = Taken(self, owner or "", tuple(msg.spare))
        taken.first = msg.files[0]
        attached = [self.attach(name, ends[i]) for i, name in enumerate(msg.files)]
        frames: list = [msg.header]
        for i, offset, length in msg.spans:
            seg = attached[i]
            taken.inputs[seg.name] = seg
            anchor = _anchor(seg.view, offset, length, writable=True)
            taken.anchors.append((seg.name, weakref.ref(anchor)))
            frames.append(memoryview(anchor))
        return frames, taken


def _owner(name: str) -> str | None:
    match = _mount.NAME.fullmatch(name)
    return f"{match.group(1)}-{match.group(2)}" if match else None


class Taken:
    """The worker's side of one pooled exchange: the input segments it attached, weak
    references to the anchors of the views it made, the spare segments offered, and the
    request's input, held here rather than in the ``Work`` (so that, once the work has run
    and its answer is written, nothing of the worker's own points into a segment and a live
    anchor means a node kept a view)."""

    def __init__(self, attachments: Attachments, owner: str, spare: tuple[str, ...]) -> None:
        self.attachments = attachments
        self.owner = owner
        self.spare = spare
        self.inputs: dict[str, _Attached] = {}
        self.anchors: list[tuple[str, weakref.ref]] = []
        self.input: Any = None
        self.pending: tuple | None = None
        self.first = ""  # the request's first file: where an empty frame points

    def detach(self, work: Any) -> Any:
        """``work`` without its input, which this holds until the work runs."""
        import dataclasses

        self.input = work.input
        return dataclasses.replace(work, input=None)

    def restore(self, work: Any) -> Any:
        """``work`` with its input back (this lets go of it)."""
        import dataclasses

        value, self.input = self.input, None
        return dataclasses.replace(work, input=value)

    def write(self, frames: Sequence[Any]) -> None:
        """Place an answer's frames: a view of an input segment as a span of it, the rest
        copied into a spare segment that fits, or a new file named for the client. Keeps
        only the header and the spans: the caller then lets go of the answer, and
        ``sealed`` says what was kept."""
        files: list[str] = []
        index: dict[str, int] = {}

        def slot(name: str) -> int:
            if name not in index:
                index[name] = len(files)
                files.append(name)
            return index[name]

        spans: list[tuple[int, int, int] | None] = []
        copies: list[tuple[int, memoryview]] = []
        for k, frame in enumerate(frames[1:]):
            view = _byte_view(frame)
            address, length = _address(view)
            if length == 0:
                spans.append((slot(self.first), 0, 0))
                continue
            for seg in self.inputs.values():
                if seg.base <= address and address + length <= seg.base + seg.size:
                    spans.append((slot(seg.name), address - seg.base, length))
                    break
            else:
                spans.append(None)
                copies.append((k, view))
        if copies:
            need = sum(_aligned(v.nbytes) for _, v in copies)
            target = self._spare_for(need)
            if target is not None:
                view, name = target.view, target.name
                made = None
            else:
                name, made = self._new_file(need)
                view = memoryview(made)
            try:
                offset = 0
                i = slot(name)
                for k, v in copies:
                    view[offset:offset + v.nbytes] = v
                    spans[k] = (i, offset, v.nbytes)
                    offset += _aligned(v.nbytes)
            finally:
                if made is not None:
                    view.release()
                    made.close()
        self.pending = (tuple(files), bytes(_byte_view(frames[0])), tuple(spans))

    def sealed(self) -> list:
        """The answer's frames: a ``Mounted`` whose ``kept`` names each input segment a
        live anchor still points into, or the header alone when there is neither a frame
        nor a kept segment. Call it once the answer's values are let go of."""
        assert self.pending is not None
        files, header, spans = self.pending
        self.pending = None
        if any(ref() is not None for _, ref in self.anchors):
            # a cycle may hold the last reference (an exception's traceback holds the frames
            # of the node that raised, with its input): the young generations, once
            gc.collect(1)
        kept = tuple(dict.fromkeys(name for name, ref in self.anchors if ref() is not None))
        self.anchors = []
        self.inputs = {}
        if not spans and not kept:
            return [header]
        return encode(Mounted(files, header=header, spans=spans, kept=kept))

    def _spare_for(self, need: int) -> _Attached | None:
        best = None
        for name in self.spare:
            try:
                seg = self.attachments.attach(name, need)
            except ProtocolError:
                continue  # too small, or gone: another may fit
            if seg.name in self.inputs:
                continue
            if best is None or seg.size < best.size:
                best = seg
        return best

    def _new_file(self, need: int) -> tuple[str, mmap.mmap]:
        root = self.attachments.root
        size = size_for(need)
        directory = _open_folder(root)
        try:
            name = f"{self.owner}{secrets.token_hex(12)}-0"
            descriptor = os.open(name, _MAKE, 0o600, dir_fd=directory)
        finally:
            os.close(directory)
        try:
            try:  # allocated before it is written: a full folder is an error here, never a SIGBUS
                os.posix_fallocate(descriptor, 0, size)
            except OSError as exc:
                raise Refused(
                    f"the answer needs {size:,} bytes in {root} and the folder has no room ({exc.strerror}); "
                    f"free memory there"
                ) from exc
            return name, mmap.mmap(descriptor, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(root / name)
            raise
        finally:
            os.close(descriptor)
