"""Pooled shared-memory segments, the Mount path between processes of one machine: the
rules of a lease, and what both sides need to follow them.

The client's side is :mod:`somatize.fabric.client.lending`, the worker's
:mod:`somatize.fabric.worker.attachments`; this module is what they share.

A fresh file per frame per message costs its page faults every time (a 256 MiB copy into
new tmpfs memory takes ~200 ms; into memory already faulted in, ~25 ms). Here the memory
is made once and reused.

Who does what (the rules of a lease):

- **The client creates and owns every segment.** Per mount folder, a process keeps a
  :class:`~somatize.fabric.client.lending.Pool` of segment files named like all cargo (``mount.NAME``: its pid and machine
  tag, so ``mount.sweep`` removes a dead client's), made 0600 with ``O_EXCL``, sized to a
  step of at most an eighth above the need (>= 1 MiB), pre-faulted once
  (``posix_fallocate``, then ``mmap`` with ``MAP_POPULATE``) and kept mapped. A request's
  frames are copied into one leased segment at 16-byte aligned offsets (:class:`~somatize.fabric.client.lending.Lending`),
  and the request names them as spans ``(file, offset, length)``; free segments go along as
  ``spare`` for the answer.
- **The worker attaches** (:class:`~somatize.fabric.worker.attachments.Attachments`): it maps a named segment only after
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

import mmap
import os
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import Refused

ALIGN = 16
"""Frames start at offsets that are multiples of this (what any dtype needs)."""
SMALLEST = 1 << 20
"""The smallest segment."""
"""Idle segments a pool keeps."""
"""Idle bytes a pool keeps; a segment over this is unlinked when it comes back."""
"""Free segments a request offers for its answer."""
"""Segments a worker keeps mapped."""

_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
MAKE = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def size_for(need: int) -> int:
    """The size of a segment for ``need`` bytes: >= 1 MiB, and at most an eighth over the
    need (a power of two would waste up to half of memory that is faulted in and kept)."""
    if need <= SMALLEST:
        return SMALLEST
    step = max(4096, 1 << (need - 1).bit_length() - 4)
    return -(-need // step) * step


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def address_of(view: Any) -> tuple[int, int]:
    """The address and length of a contiguous buffer."""
    flat = np.frombuffer(view, np.uint8) if not isinstance(view, np.ndarray) else view
    return flat.__array_interface__["data"][0], flat.nbytes


def byte_view(frame: Any) -> memoryview:
    view = memoryview(getattr(frame, "buffer", frame))
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B") if view.c_contiguous else memoryview(view.tobytes())
    return view


def map_shared(descriptor: int, size: int) -> mmap.mmap:
    return mmap.mmap(descriptor, size, flags=mmap.MAP_SHARED | _POPULATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def open_folder(root: Path) -> int:
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


def anchor_at(seg_view: memoryview, offset: int, length: int, *, writable: bool) -> np.ndarray:
    """A NumPy array over ``length`` bytes at ``offset``: every view built from the frame
    made of it keeps it alive, so whether it is alive says whether anything still points
    into the segment there."""
    anchor = np.frombuffer(seg_view, np.uint8, count=length, offset=offset)
    if not writable:
        anchor.flags.writeable = False
    return anchor
