"""Who serves a worker's socket now: the hold on it.

Only the thread holding it touches the socket, the sessions and the streams: the serving
thread (:meth:`~somatize.fabric.worker.loop.WorkerLoop.serve`), or the stand-in while a
piece runs long where it arrived (:mod:`somatize.fabric.worker.standin`). An answer from any
other thread goes into the outbox (:mod:`somatize.fabric.worker.outbox`), which asks the hold
whether its caller may send at once.
"""

from __future__ import annotations

import threading


class Hold:
    """The lock whoever serves holds, which thread holds it now, and which thread serves."""

    __slots__ = ("holder", "lock", "owner")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.holder: int | None = None  # the thread holding it now; None while nobody serves
        self.owner = threading.get_ident()  # the serving thread (`WorkerLoop.serve` says which)

    def take(self) -> None:
        """Wait for the socket, and hold it."""
        self.lock.acquire()
        self.holder = threading.get_ident()

    def try_take(self) -> bool:
        """Hold the socket if nobody does; True when this thread holds it now."""
        if not self.lock.acquire(blocking=False):
            return False
        self.holder = threading.get_ident()
        return True

    def let_go(self) -> None:
        """Let go of the socket: whoever takes it next serves."""
        self.holder = None
        self.lock.release()
