"""The stand-in: who serves while a piece runs on the thread that received it.

With ``jobs=1`` a piece runs where it arrived, and that thread lets go of the socket
meanwhile. Once the piece has run ``STAND_IN_AFTER`` seconds, a stand-in thread takes the
socket and serves (probes answered, new work refused as busy, what the piece says sent)
until the piece returns and wants the socket back. The stand-in sleeps on an event
(``_began``) until then: one watch per process (`Watch`) wakes it for a piece still running
past ``STAND_IN_AFTER``, and the worker's close wakes it. A piece that returns sooner, as
most do, wakes no thread: a fleet of loops in one process shares the watch, which wakes at
most once per ``STAND_IN_AFTER`` while pieces run anywhere in the process.
"""

from __future__ import annotations

import os
import threading
import time
from typing import TYPE_CHECKING, Any

from .slots import Job, exit_now

if TYPE_CHECKING:
    from .. import sockets

#: How long a piece runs on the serving thread before a stand-in serves meanwhile (seconds).
STAND_IN_AFTER = 0.02


class Watch:
    """Looks, for every loop of this process, whether a piece that began where it arrived
    still runs ``STAND_IN_AFTER`` later, and then wakes that loop's stand-in. On a thread of
    its own (a daemon, started at the first piece), asleep while no piece runs.

    It looks every ``STAND_IN_AFTER`` at the loops it watches, by what each says (``_inline``:
    a piece runs there; ``_inline_seq``: which): a piece it finds running at two looks in a
    row has run at least ``STAND_IN_AFTER`` and at most twice that, and its stand-in is woken
    once. A loop found with no piece running is watched no more until its next piece. So
    starting a piece costs its loop one look-up in a dict (``arm``), and the lock only for the
    first piece after a quiet spell: the call that starts most pieces pays nothing more."""

    def __init__(self) -> None:
        # id(loop) -> [loop, the piece seen running at the last look, the piece whose stand-in was woken]
        self._watching: dict[int, list[Any]] = {}
        self._changed = threading.Condition()
        self._idle = True  # asleep with no loop to watch: the next piece wakes it
        self._thread: threading.Thread | None = None

    def arm(self, loop: Any, seq: int) -> None:
        """``loop``'s piece number ``seq`` began now (``loop._inline`` and ``loop._inline_seq``
        say so already)."""
        if id(loop) in self._watching:  # looked at already; one dropping it looks once more (`_look`)
            return
        with self._changed:
            self._watching.setdefault(id(loop), [loop, None, None])
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True, name="somatize-stand-in-watch")
                self._thread.start()
            elif self._idle:
                self._changed.notify()

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._watching:
                    self._idle = True
                    self._changed.wait()
                self._idle = False
            time.sleep(STAND_IN_AFTER)
            woken = self._look()
            for loop in woken:
                loop._began.set()

    def _look(self) -> list[Any]:
        """One look at every loop watched: the loops whose piece ran since the last look."""
        woken = []
        with self._changed:
            for key, entry in list(self._watching.items()):
                loop, seen, stood_in = entry
                inline = loop._inline
                seq = loop._inline_seq
                if inline is None:
                    del self._watching[key]
                    if loop._inline is not None:  # a piece began as it was dropped: `arm` found it watched
                        self._watching[key] = [loop, None, None]
                    continue
                if loop._inline is not inline:  # one piece ended and another began as it looked
                    entry[1] = None
                    continue
                if seq == seen and seq != stood_in:  # the same piece at two looks: it runs long
                    entry[2] = seq
                    woken.append(loop)
                entry[1] = seq
        return woken


WATCH = Watch()
# a child forked while the watch ran has its state and none of its thread: it starts afresh
os.register_at_fork(after_in_child=lambda: Watch.__init__(WATCH))


class StandIn:
    """Part of ``WorkerLoop``: its stand-in thread, and stopping while a piece is stuck."""

    stopping: sockets.Alarm
    patience: float
    exit_when_stuck: bool
    _began: threading.Event
    _hold: threading.Lock
    _holder: int | None
    _inline: Job | None
    _inline_seq: int
    _want_back: bool
    _running: dict[int, Job]
    _running_lock: threading.Lock

    if TYPE_CHECKING:  # the loop's own, or another mixin's (stubs for mypy alone: none at run time)

        def _poller(self) -> sockets.Poller: ...
        def _turn(self, poller: sockets.Poller, timeout_ms: int) -> None: ...
        def _flush(self) -> None: ...
        def close(self) -> None: ...

    def _held_young(self) -> list[tuple[float, Any]]:
        """The pieces in slots whose facts are still held (`.held`), each with when it will
        have run ``STAND_IN_AFTER``."""
        with self._running_lock:
            return [
                (job.started + STAND_IN_AFTER, job.held)
                for job in self._running.values()
                if job.held is not None and job.held.holding
            ]

    def _young_until(self) -> float:
        """When the first piece in a slot whose facts are held will have run long."""
        return min((due for due, _ in self._held_young()), default=float("inf"))

    def _release_held(self, now: float) -> None:
        """Pieces in slots that have run ``STAND_IN_AFTER``: what they said leaves now, and
        what they say later as they say it (for a piece where it arrived, the stand-in does
        this as it takes the socket)."""
        for due, held in self._held_young():
            if due <= now:
                held.release()

    def _stand_in(self) -> None:
        """On a thread of its own: serve while a piece runs where it arrived, once it has run
        ``STAND_IN_AFTER`` seconds (`WATCH` wakes it then); hand the socket back as soon as
        it returns."""
        me = threading.get_ident()
        poller: sockets.Poller | None = None
        while not self.stopping.is_set():
            if not self._began.wait(5.0):  # asleep until a piece runs long (close wakes it)
                continue
            self._began.clear()
            seen = self._inline_seq  # the piece the watch found running
            while not self.stopping.is_set():
                if self._inline is None or self._inline_seq != seen:
                    break  # it returned: the next is the watch's to look at
                if self._want_back or not self._hold.acquire(blocking=False):
                    self.stopping.wait(0.001)
                    continue
                self._holder = me
                try:
                    poller = poller or self._poller()
                    inline = self._inline
                    if inline is not None and inline.held is not None:
                        inline.held.release()  # it runs long: what it said leaves now, the rest as said
                    self._flush()  # what the piece said so far
                    while not self._want_back and not self.stopping.is_set():
                        self._turn(poller, 20)
                finally:
                    self._holder = None
                    self._hold.release()
        self._stop_stuck()

    def _stop_stuck(self) -> None:
        """Stopping while a piece runs where it arrived: give it a moment to return (the
        serving thread then closes), else close without it, and end the process if the
        command said so: a piece that never returns must not keep a stopped worker alive."""
        until = time.monotonic() + min(2.0, self.patience)
        while self._inline is not None and time.monotonic() < until:
            time.sleep(0.02)
        if self._inline is None or not self._hold.acquire(timeout=1.0):
            return
        try:
            self.close()
        finally:
            self._hold.release()
        if self.exit_when_stuck and self._inline is not None:
            exit_now()
