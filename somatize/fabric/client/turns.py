"""A client's own forwards to one host take turns.

A worker runs ``--jobs`` pieces at once and refuses more as busy, at once and whoever sent
them: it never queues work, so a colleague's long job makes others hear ``Busy`` rather
than wait behind it unseen. But a client whose threads forward to the same host at once
expects what an actor gives: its calls run one after another. So when a worker turns a
piece away as busy (it ran nothing of it) while another forward of this client is running
on that host, the piece waits here for that forward to end and is sent again; only work
of someone else makes it ``Busy`` at once.

The line: the pieces turned away wait in the order they were turned away (one turned away
again keeps its place), and a new forward to a host where some wait goes behind them, so a
thread forwarding in a loop cannot starve another. Each forward of this client that ends on
the host hands its turn to the first in line; one whose worker is lost (``lost``: the worker
went away, nobody answers) hands it to all of them at once, so each finds out for itself at
once rather than one patience after another. A piece gives up its place at its deadline, and
a turn it was handed goes on to the next.

Who counts: a forward is running on a host from when it is sent until its answer, whatever
the answer. A forward that is waiting for a turn is not running, so two that wait never
wait on each other. Everything a turn depends on changes under one lock.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Collection, Sequence
from typing import TypeVar

from ...pieces import Deadline
from .transport import PastDeadline

T = TypeVar("T")

#: How long a wait for a turn sleeps before it looks again whether a forward of this client
#: still runs on the host (a turn is handed on as each one ends: this only bounds a wait
#: whose wake-up was missed).
LOOK_AGAIN = 1.0


class _Host:
    __slots__ = ("chosen", "ended", "handed", "running", "waiting")

    def __init__(self) -> None:
        self.running = 0  # forwards of this client sent to the host and not answered yet
        self.ended = 0  # how many of them have ended, ever: one ended since this one was sent?
        self.handed = 0  # turns handed to pieces in line that have not been sent again yet
        self.chosen = 0  # pieces that chose this pool member and are on their way to `take`
        self.waiting: collections.deque[threading.Event] = collections.deque()

    def idle(self) -> bool:
        return not (self.running or self.handed or self.waiting or self.chosen)

    def load(self) -> int:
        return self.running + self.handed + len(self.waiting) + self.chosen

    def hand_on(self, everyone: bool = False) -> None:
        for _ in range(len(self.waiting) if everyone else min(1, len(self.waiting))):
            self.waiting.popleft().set()
            self.handed += 1


class Turns:
    """This client's forwards running on each host, and those waiting for a turn there."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._hosts: dict[str, _Host] = {}
        self._turn = 0  # where the next choice among equally loaded members starts

    def choose(self, members: Sequence[str], besides: Collection[str] = ()) -> str:
        """The member of a pool (not in ``besides``) where this client has the least work
        (running, in line, or on its way), ties taken in turn; counted as on its way there
        until :meth:`take` (``chosen=True``) or :meth:`unchoose`."""
        with self._lock:
            count = len(members)
            start = self._turn % count
            self._turn += 1
            best, least = "", -1
            for i in range(count):
                host = members[(start + i) % count]
                if host in besides:
                    continue
                state = self._hosts.get(host)
                load = 0 if state is None else state.load()
                if least < 0 or load < least:
                    best, least = host, load
                    if load == 0:
                        break
            if least < 0:
                raise ValueError("every member was tried")
            state = self._hosts.get(best)
            if state is None:
                state = self._hosts[best] = _Host()
            state.chosen += 1
            return best

    def unchoose(self, host: str) -> None:
        """A piece that chose ``host`` will not be sent there after all (it failed before)."""
        with self._lock:
            state = self._hosts.get(host)
            if state is not None and state.chosen:
                state.chosen -= 1
                if state.idle():
                    del self._hosts[host]

    def take(
        self,
        host: str,
        attempt: Callable[[], T],
        turned_away: type[BaseException],
        deadline: Deadline | None,
        lost: tuple[type[BaseException], ...] = (),
        *,
        chosen: bool = False,
    ) -> T:
        """``attempt()`` (one forward to ``host``), sent again each time the worker turns it
        away as busy (``turned_away``) while a forward of this client runs there; raises
        ``turned_away`` when none does (someone else's work fills the worker), and
        ``PastDeadline`` if the deadline passes while it waits for a turn. ``chosen``: the
        piece chose ``host`` among a pool's members (:meth:`choose`), and is now here."""
        with self._lock:  # most forwards: nobody in line, so counted as running at once
            state = self._hosts.get(host)
            if state is None:
                state = self._hosts[host] = _Host()
            if chosen and state.chosen:
                state.chosen -= 1
            if state.waiting or state.handed:
                since = None
            else:
                state.running += 1
                since = state.ended
        if since is None:
            since = self._start(host, deadline)
        again = False
        while True:
            try:
                result = attempt()
            except turned_away:
                since = self._turned_away(host, since, deadline, again)
                if since is None:
                    raise
                again = True
                continue
            except lost:
                self._end(host, lost=True)
                raise
            except BaseException:
                self._end(host)
                raise
            with self._lock:  # `_end`, as most forwards end: an answer, and nobody in line
                state = self._hosts[host]
                state.running -= 1
                state.ended += 1
                if state.waiting:
                    state.hand_on()
                elif state.idle():
                    del self._hosts[host]  # nothing of ours there: nothing kept
            return result

    def running(self, host: str) -> int:
        with self._lock:
            state = self._hosts.get(host)
            return 0 if state is None else state.running

    def waiting(self, host: str) -> int:
        with self._lock:
            state = self._hosts.get(host)
            return 0 if state is None else len(state.waiting)

    def _start(self, host: str, deadline: Deadline | None) -> int:
        """Count a new forward as running, behind the line if there is one; its ``since``."""
        with self._lock:
            state = self._hosts.get(host)
            if state is None:
                state = self._hosts[host] = _Host()
            if not (state.waiting or state.handed):
                state.running += 1
                return state.ended
            mine = threading.Event()
            state.waiting.append(mine)  # others wait for a turn: this one goes behind them
        return self._wait(host, state, mine, deadline)

    def _end(self, host: str, *, lost: bool = False) -> None:
        """A forward's answer came (or it failed), so what it held on the worker is free: the
        next in line sends again (``lost``: everyone in line does)."""
        with self._lock:
            state = self._hosts[host]
            state.running -= 1
            state.ended += 1
            state.hand_on(everyone=lost)
            if state.idle():
                del self._hosts[host]  # nothing of ours there: nothing kept

    def _turned_away(self, host: str, since: int, deadline: Deadline | None, again: bool) -> int | None:
        """After a refusal as busy: the new ``since`` once this piece may be sent again (it
        counts as running again), or None if no forward of this client runs on the host and
        none ended since it was sent (the worker is busy with someone else's work)."""
        with self._lock:
            state = self._hosts[host]  # this piece still counts as running: it is there
            state.running -= 1
            if state.running or state.handed:  # ours hold the worker, or are about to: wait
                mine = threading.Event()
                if again:
                    state.waiting.appendleft(mine)  # turned away again: it keeps its place
                else:
                    state.waiting.append(mine)
            elif state.ended != since:  # one of ours ended since it was sent: what the worker was busy with
                state.running += 1
                return state.ended
            else:  # someone else's work: this one hears Busy, and the next in line tries in turn
                state.hand_on()
                if state.idle():
                    del self._hosts[host]
                return None
        return self._wait(host, state, mine, deadline)

    def _wait(self, host: str, state: _Host, mine: threading.Event, deadline: Deadline | None) -> int:
        """Wait in line until handed a turn; then counted as running. Its ``since``."""
        turn = False
        try:
            while not mine.wait(LOOK_AGAIN if deadline is None else max(0.0, min(LOOK_AGAIN, deadline.left()))):
                if deadline is not None and deadline.left() <= 0:
                    raise PastDeadline(f"for a turn on `{host}` behind this client's other forwards there")
                with self._lock:
                    if not (state.running or state.handed) and mine in state.waiting:
                        state.waiting.remove(mine)  # a wake-up missed: nobody would hand one on
                        state.running += 1
                        return state.ended
            turn = True
            with self._lock:
                state.handed -= 1
                state.running += 1
                return state.ended
        finally:
            if not turn:  # gave up its place (its deadline, or interrupted)
                with self._lock:
                    if mine in state.waiting:
                        state.waiting.remove(mine)
                    elif mine.is_set():  # a turn handed to it meanwhile: it goes to the next
                        state.handed -= 1
                        state.hand_on()
                    if state.idle() and self._hosts.get(host) is state:
                        del self._hosts[host]
