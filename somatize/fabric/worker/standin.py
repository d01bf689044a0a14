"""The stand-in: who serves while a piece runs on the thread that received it.

With ``jobs=1`` a piece runs where it arrived, and that thread lets go of the socket
meanwhile. Once the piece has run ``STAND_IN_AFTER`` seconds, a stand-in thread takes the
socket and serves (probes answered, new work refused as busy, what the piece says sent)
until the piece returns and wants the socket back. Idle, the stand-in sleeps on an event
(``_began``), set when a piece begins and when the worker closes.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import zmq

from .slots import exit_now

#: How long a piece runs on the serving thread before a stand-in serves meanwhile (seconds).
STAND_IN_AFTER = 0.02


class StandIn:
    """Part of ``WorkerLoop``: its stand-in thread, and stopping while a piece is stuck."""

    stopping: Any
    patience: float
    exit_when_stuck: bool
    _began: threading.Event
    _hold: Any
    _holder: int | None
    _inline: Any
    _inline_seq: int
    _want_back: bool

    def _stand_in(self) -> None:
        """On a thread of its own: serve while a piece runs where it arrived, once it has run
        ``STAND_IN_AFTER`` seconds; hand the socket back as soon as it returns."""
        me = threading.get_ident()
        poller: zmq.Poller | None = None
        while not self.stopping.is_set():
            if not self._began.wait(5.0):  # idle, it sleeps (close wakes it)
                continue
            self._began.clear()
            seen = -1
            while not self.stopping.wait(STAND_IN_AFTER):
                seq = self._inline_seq
                if self._inline is None:
                    break  # it returned: wait for the next
                if seq != seen:
                    seen = seq  # a piece that started since the last look
                    continue
                if self._want_back or not self._hold.acquire(blocking=False):
                    continue
                self._holder = me
                try:
                    poller = poller or self._poller()
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
