"""A client's own forwards to one host take turns.

A worker runs ``--jobs`` pieces at once and refuses more as busy, at once and whoever sent
them: it never queues work, so a colleague's long job makes others hear ``Busy`` rather
than wait behind it unseen. But a client whose threads forward to the same host at once
expects what an actor gives: its calls run one after another. So when a worker turns a
piece away as busy (it ran nothing of it) while another forward of this client is running
on that host, the piece waits here for that forward to end and is sent again; only work
of someone else makes it ``Busy`` at once. The waiting pieces go in the order they were
turned away, one for each forward that ends, and within the forward's deadline.

Who counts: a forward is running on a host from when it is sent until its answer, whatever
the answer. A forward that is waiting for a turn is not running, so two that wait never
wait on each other.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import TypeVar

from ...pieces import Deadline
from .channel import PastDeadline

T = TypeVar("T")

#: How long a wait for a turn sleeps before it looks again whether a forward of this client
#: still runs on the host (a turn is handed on as each one ends: this only bounds a wait
#: whose wake-up was missed).
LOOK_AGAIN = 1.0


class _Host:
    __slots__ = ("ended", "running", "waiting")

    def __init__(self) -> None:
        self.running = 0  # forwards of this client sent to the host and not answered yet
        self.ended = 0  # how many have ended, ever: a turn handed on since one was sent
        self.waiting: collections.deque[threading.Event] = collections.deque()


class Turns:
    """This client's forwards running on each host, and those waiting for a turn there."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._hosts: dict[str, _Host] = {}

    def take(self, host: str, attempt: Callable[[], T], turned_away: type[BaseException],
             deadline: Deadline | None) -> T:
        """``attempt()`` (one forward to ``host``), sent again each time the worker turns it
        away as busy (``turned_away``) while a forward of this client runs there; raises
        ``turned_away`` when none does (someone else's work fills the worker), and
        ``PastDeadline`` if the deadline passes while it waits."""
        again = False
        while True:
            since = self._start(host)
            try:
                result = attempt()
            except turned_away:
                self._end(host, ran=False)
                if not self._wait(host, since, deadline, again):
                    self._drop_if_idle(host)
                    raise
                again = True
                continue
            except BaseException:
                self._end(host, ran=True)
                raise
            self._end(host, ran=True)
            return result

    def running(self, host: str) -> int:
        with self._lock:
            state = self._hosts.get(host)
            return 0 if state is None else state.running

    def waiting(self, host: str) -> int:
        with self._lock:
            state = self._hosts.get(host)
            return 0 if state is None else len(state.waiting)

    def _start(self, host: str) -> int:
        with self._lock:
            state = self._hosts.get(host)
            if state is None:
                state = self._hosts[host] = _Host()
            state.running += 1
            return state.ended

    def _end(self, host: str, *, ran: bool) -> None:
        """A forward's answer came (``ran``: it was not turned away, so whatever it held on
        the worker is free): the next in line sends again. One turned away hands on a turn
        only when it was the last of ours there, so that no waiter waits on nothing."""
        with self._lock:
            state = self._hosts[host]
            state.running -= 1
            if ran:
                state.ended += 1
            if state.waiting and (ran or not state.running):
                state.waiting.popleft().set()
            elif ran and not state.running and not state.waiting:
                del self._hosts[host]  # nothing of ours there: nothing kept

    def _wait(self, host: str, since: int, deadline: Deadline | None, again: bool) -> bool:
        """After a refusal as busy: True once this piece's turn has come (send it again),
        False if no forward of this client runs on the host (the refusal was not ours)."""
        mine = threading.Event()
        with self._lock:
            state = self._hosts[host]  # kept: only an answer that ran ends it
            if not state.running:
                # none of ours runs there now: one that ended since this was sent may be what
                # the worker was busy with (send again), or it is someone else's work
                return state.ended != since
            if again:
                state.waiting.appendleft(mine)  # turned away again: it keeps its place
            else:
                state.waiting.append(mine)
        try:
            while not mine.wait(LOOK_AGAIN if deadline is None else max(0.0, min(LOOK_AGAIN, deadline.left()))):
                if deadline is not None and deadline.left() <= 0:
                    raise PastDeadline(f"for a turn on `{host}` behind this client's other forwards there")
                if not self.running(host):
                    return True  # nothing of ours runs there any more (a wake-up missed): send again
            return True
        finally:
            with self._lock:
                state = self._hosts.get(host)
                if state is not None and mine in state.waiting:
                    state.waiting.remove(mine)

    def _drop_if_idle(self, host: str) -> None:
        with self._lock:
            state = self._hosts.get(host)
            if state is not None and not state.running and not state.waiting:
                del self._hosts[host]
