"""The stand-in: who serves while a piece runs on the thread that received it.

With ``jobs=1`` a piece runs where it arrived, and that thread lets go of the socket
meanwhile (:meth:`StandIn.run`). Once the piece has run ``STAND_IN_AFTER`` seconds, a
stand-in thread takes the socket and serves (probes answered, new work refused as busy,
what the piece says sent) until the piece returns and wants the socket back. The stand-in
sleeps on an event (``began``) until then: one watch per process (`Watch`) wakes it for a
piece still running past ``STAND_IN_AFTER``, and the worker's close wakes it. A piece that
returns sooner, as most do, wakes no thread: a fleet of loops in one process shares the
watch, which wakes at most once per ``STAND_IN_AFTER`` while pieces run anywhere in the
process.

What is not for here: what one turn of serving does (the loop's), what a piece is and how
it runs (:mod:`somatize.fabric.worker.running`).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .slots import Job, exit_now

if TYPE_CHECKING:
    from .. import sockets
    from .serving import Hold

#: How long a piece runs on the serving thread before a stand-in serves meanwhile (seconds).
STAND_IN_AFTER = 0.02


class Watch:
    """Looks, for every stand-in of this process, whether a piece that began where it arrived
    still runs ``STAND_IN_AFTER`` later, and then wakes that stand-in. On a thread of its own
    (a daemon, started at the first piece), asleep while no piece runs.

    It looks every ``STAND_IN_AFTER`` at the stand-ins it watches, by what each says
    (``inline``: a piece runs there; ``seq``: which): a piece it finds running at two looks in
    a row has run at least ``STAND_IN_AFTER`` and at most twice that, and its stand-in is
    woken once. A stand-in found with no piece running is watched no more until its next
    piece. So starting a piece costs its loop one look-up in a dict (``arm``), and the lock
    only for the first piece after a quiet spell: the call that starts most pieces pays
    nothing more."""

    def __init__(self) -> None:
        # id(stand-in) -> [stand-in, the piece seen running at the last look, the piece whose stand-in was woken]
        self._watching: dict[int, list[Any]] = {}
        self._changed = threading.Condition()
        self._idle = True  # asleep with nothing to watch: the next piece wakes it
        self._thread: threading.Thread | None = None

    def arm(self, standin: Any, seq: int) -> None:
        """``standin``'s piece number ``seq`` began now (its ``inline`` and ``seq`` say so
        already)."""
        if id(standin) in self._watching:  # looked at already; one dropping it looks once more (`_look`)
            return
        with self._changed:
            self._watching.setdefault(id(standin), [standin, None, None])
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
            for standin in woken:
                standin.began.set()

    def _look(self) -> list[Any]:
        """One look at every stand-in watched: those whose piece ran since the last look."""
        woken = []
        with self._changed:
            for key, entry in list(self._watching.items()):
                standin, seen, stood_in = entry
                inline = standin.inline
                seq = standin.seq
                if inline is None:
                    del self._watching[key]
                    if standin.inline is not None:  # a piece began as it was dropped: `arm` found it watched
                        self._watching[key] = [standin, None, None]
                    continue
                if standin.inline is not inline:  # one piece ended and another began as it looked
                    entry[1] = None
                    continue
                if seq == seen and seq != stood_in:  # the same piece at two looks: it runs long
                    entry[2] = seq
                    woken.append(standin)
                entry[1] = seq
        return woken


WATCH = Watch()
# a child forked while the watch ran has its state and none of its thread: it starts afresh
os.register_at_fork(after_in_child=lambda: Watch.__init__(WATCH))


class StandIn:
    """A loop's stand-in: the piece running where it arrived, the wake-up of the thread that
    serves meanwhile, and whether the piece's thread wants the socket back. Handed the hold
    on the socket and the worker's stop; what a turn of serving does is handed to
    :meth:`serve`."""

    def __init__(self, hold: Hold, stopping: sockets.Alarm) -> None:
        self.hold = hold
        self.stopping = stopping
        self.began = threading.Event()  # a piece runs long (`WATCH` sets it), or the worker closes
        self.want_back = False  # the piece returned: the stand-in hands the socket back
        self.inline: Job | None = None  # the piece running where it arrived, if any
        self.seq = 0  # which piece that is: the watch tells one from the next

    def run(self, job: Job, wake: Callable[[], None], fn: Callable[..., None], *args: Any) -> None:
        """Run a piece (``fn(*args)``) on this thread, letting go of the socket meanwhile (the
        stand-in takes it if the piece runs long), and take it back once the piece has
        returned; ``wake`` wakes the stand-in out of its poll, to hand the socket back now."""
        me = threading.get_ident()
        self.inline = job
        self.seq += 1
        WATCH.arm(self, self.seq)  # its stand-in is woken only if it runs long
        self.hold.let_go()
        try:
            fn(*args)
        finally:
            self.want_back = True
            if self.hold.holder not in (None, me):
                wake()  # the stand-in is polling: it hands the socket back now
            self.hold.take()
            self.want_back = False
            self.inline = None

    def returned(self) -> None:
        """The piece running where it arrived has its answer: a stand-in sends it, then takes
        nothing new."""
        self.want_back = True

    def giving_back(self) -> bool:
        """Whether a stand-in serving now is to take nothing new: the piece has returned."""
        return self.want_back and self.hold.holder != self.hold.owner

    def wake(self) -> None:
        """Wake the stand-in (asleep while no piece runs long): the worker closes."""
        self.began.set()

    def serve(
        self,
        poller: Callable[[], sockets.Poller],
        turn: Callable[[sockets.Poller, int], None],
        flush: Callable[[], None],
    ) -> None:
        """On a thread of its own, until the worker stops: serve while a piece runs where it
        arrived, once it has run ``STAND_IN_AFTER`` seconds (`WATCH` wakes it then); hand
        the socket back as soon as it returns. ``poller`` makes the poll it serves with,
        ``turn`` is one round of serving, ``flush`` sends what waits in the outbox."""
        polled: sockets.Poller | None = None
        while not self.stopping.is_set():
            if not self.began.wait(5.0):  # asleep until a piece runs long (close wakes it)
                continue
            self.began.clear()
            seen = self.seq  # the piece the watch found running
            while not self.stopping.is_set():
                if self.inline is None or self.seq != seen:
                    break  # it returned: the next is the watch's to look at
                if self.want_back or not self.hold.try_take():
                    self.stopping.wait(0.001)
                    continue
                try:
                    polled = polled or poller()
                    inline = self.inline
                    if inline is not None and inline.held is not None:
                        inline.held.release()  # it runs long: what it said leaves now, the rest as said
                    flush()  # what the piece said so far
                    while not self.want_back and not self.stopping.is_set():
                        turn(polled, 20)
                finally:
                    self.hold.let_go()

    def stop_stuck(self, patience: float, close: Callable[[], None], exit_when_stuck: bool) -> None:
        """Stopping while a piece runs where it arrived: give it a moment to return (the
        serving thread then closes), else ``close`` without it, and end the process if the
        command said so (``exit_when_stuck``): a piece that never returns must not keep a
        stopped worker alive."""
        until = time.monotonic() + min(2.0, patience)
        while self.inline is not None and time.monotonic() < until:
            time.sleep(0.02)
        if self.inline is None or not self.hold.lock.acquire(timeout=1.0):
            return
        try:
            close()
        finally:
            self.hold.lock.release()
        if exit_when_stuck and self.inline is not None:
            exit_now()
