"""The worker's side of a lease (the rules are in :mod:`somatize.fabric.leases`): the
:class:`Attachments` it keeps to its clients' segments, checked before anything is mapped,
and what one exchange took (:class:`Taken`): the views it handed the nodes, and where the
answer goes.
"""

from __future__ import annotations

import contextlib
import gc
import mmap
import os
import secrets
import stat
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ...errors import ProtocolError, Refused
from ...wire import Mounted, encode
from .. import mount as _mount
from ..leases import MAKE, address_of, aligned, anchor_at, byte_view, map_shared, open_folder, size_for

ATTACHED = 16


class _Attached:
    __slots__ = ("name", "inode", "size", "map", "view", "base")

    def __init__(self, name: str, inode: int, size: int, mapped: mmap.mmap) -> None:
        self.name = name
        self.inode = inode
        self.size = size
        self.map = mapped
        self.view = memoryview(mapped)
        self.base = address_of(self.view)[0]


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
                if (
                    info is not None
                    and info.st_ino == found.inode
                    and info.st_size == found.size
                    and info.st_nlink == 1
                    and stat.S_ISREG(info.st_mode)
                    and info.st_uid == os.geteuid()
                ):
                    self.maps.move_to_end(name)
                    if found.size < need:
                        raise ProtocolError(
                            f"a mounted message reads up to byte {need:,} of `{name}`, which has "
                            f"{found.size:,}: refused"
                        )
                    return found
                del self.maps[name]
            directory = open_folder(self.root)
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
                made = _Attached(name, info.st_ino, info.st_size, map_shared(descriptor, info.st_size))
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
        span) and the :class:`Taken` that answers it. Asked only for a request whose names
        its own session sealed (``WorkerSessions.carries``, before this): a segment is mapped
        for the session it was lent to, never for one that merely names it."""
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
            anchor = anchor_at(seg.view, offset, length, writable=True)
            taken.anchors.append((seg.name, weakref.ref(anchor)))
            # an ndarray is a buffer; numpy's stubs say so (`__buffer__`) only from Python 3.12
            frames.append(memoryview(anchor))  # type: ignore[arg-type]
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
            view = byte_view(frame)
            address, length = address_of(view)
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
            need = sum(aligned(v.nbytes) for _, v in copies)
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
                    view[offset : offset + v.nbytes] = v
                    spans[k] = (i, offset, v.nbytes)
                    offset += aligned(v.nbytes)
            finally:
                if made is not None:
                    view.release()
                    made.close()
        self.pending = (tuple(files), bytes(byte_view(frames[0])), tuple(spans))

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
        directory = open_folder(root)
        try:
            name = f"{self.owner}{secrets.token_hex(12)}-0"
            descriptor = os.open(name, MAKE, 0o600, dir_fd=directory)
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
