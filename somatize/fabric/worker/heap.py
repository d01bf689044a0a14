"""Giving back the memory a process freed, for one that moves big messages (a worker).

glibc's ``malloc`` keeps what is freed inside its arenas, for reuse, and returns it to the
system only from the top of a heap. A worker copies cargo off its socket (libzmq's I/O
thread, in an arena of its own) and into values (its serving thread), so after a burst of
big Works it would keep tens of MiB it no longer uses. ``malloc_trim(0)`` hands the free
pages of every arena back, in a few milliseconds at most.

:class:`Heap` counts the bytes of cargo that went through (in and out) and trims once every
``TRIM_AFTER`` of them, after the message that crossed the line has been let go of: a few
milliseconds per 16 MiB moved, nothing at all for small calls. Where the C library has no
such call (musl, macOS, Windows), there is nothing to do.

What it is not: a bound. What a process keeps on purpose (the catalog's built nodes, its
sessions) stays kept; those have bounds of their own.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Iterable
from typing import Any

__all__ = ["TRIM_AFTER", "Heap", "trim"]

#: Bytes of cargo moved between two trims: with less, what the allocator keeps is small.
TRIM_AFTER = 16 << 20

_trim: Any = None  # glibc's malloc_trim, looked up on first use (False: there is none)


def trim() -> bool:
    """Hand the free pages of every ``malloc`` arena back to the system; whether any went."""
    global _trim
    if _trim is None:
        _trim = _lookup()
    return bool(_trim and _trim(0))


def _lookup() -> Any:
    if not sys.platform.startswith("linux"):
        return False
    try:
        found = ctypes.CDLL(None).malloc_trim  # the C library this process already uses
    except (OSError, AttributeError):  # musl, or a libc that does not say
        return False
    found.argtypes = [ctypes.c_size_t]
    found.restype = ctypes.c_int
    return found


class Heap:
    """Counts cargo moved (``moved``) and says when a trim is due (``due``).

    Safe to call from many threads: a count lost to a race delays a trim, nothing else.
    """

    def __init__(self, every: int = TRIM_AFTER) -> None:
        self.every = max(1, int(every))
        self.count = 0
        self.trims = 0

    def moved(self, frames: Iterable[Any]) -> None:
        """Count the bytes of a message's frames (bytes, memoryviews, ``zmq.Frame``s)."""
        n = 0
        for f in frames:
            n += f.nbytes if isinstance(f, memoryview) else len(f)
        self.count += n

    def received(self, frames: list) -> None:
        """``moved`` for the frames a socket gave (``zmq.Frame``s: their length is in bytes)."""
        self.count += sum(map(len, frames))

    def due(self) -> bool:
        return self.count >= self.every

    def trim(self) -> bool:
        """Trim now and start counting again; whether any memory went back."""
        self.count = 0
        self.trims += 1
        return trim()
