"""What the broker reads, and the one admission step every message passes first.

`Admitting.serve`'s turn reads up to a thousand messages (`_take`). Each is counted by
`floods.Admission`, per connection and per key, before anything else is done with it
(`_admit`; `_unread` for a peer that does not read its answers; `_refusal` for a message
refused or one that opened or ended nothing). Past its share, the connection it came on is
closed (`_cut`). What is admitted goes to the loop's `_handle`. A mixin of
:class:`~somatize.fabric.broker.loop.BrokerLoop`, whose state it reads: the front socket, the
admission counters, the outbox and the view.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import zmq

from ...wire import Refusal, encode
from .. import sockets
from ..curve import peer_name, user_of
from .outbox import LARGEST

if TYPE_CHECKING:
    from collections import OrderedDict

    from ..curve import Guard
    from ..logs import Quiet
    from .floods import Admission
    from .outbox import Outbox
    from .peers import BrokerView

#: Answers waiting for one connection to read them: past it, its questions are dropped
#: unanswered (counted as questions at the admission step).
MAX_UNREAD = 64
log = logging.getLogger("somatize.broker")


def size_of(frames: list) -> int:
    """A message's bytes, all its frames together (a ``zmq.Frame``'s length is its bytes')."""
    return sum(map(len, frames))


class Admitting:
    """Reading, and the admission step (see the module)."""

    # the loop's state read here: annotations alone, for the type checker (nothing is set here)
    view: BrokerView
    endpoint: str
    _front: zmq.Socket | None
    _outbox: Outbox | None
    _guard: Guard | None
    _admission: Admission
    _connections: dict[str, OrderedDict[bytes, float]]
    _losses: Quiet

    if TYPE_CHECKING:  # the loop's methods called here (defined here, they would hide the loop's)

        def _handle(self, route: bytes, frames: list) -> None: ...
        def _refused(self, route: bytes, user: str, why: str) -> None: ...
        def _answer(self, route: Any, message: Any) -> None: ...

    def _take(self, most: int = 1024) -> None:
        """Read up to ``most`` messages, each through the admission step (`_admit`, or
        `_unread` for a peer that does not read its answers) before anything else is done
        with it. Never left queued in ZeroMQ: see `bind`."""
        front, outbox = self._front, self._outbox
        assert front is not None and outbox is not None  # both set by `bind`, before `serve` reads
        severed, waiting, offers = self._admission.severed, outbox.waiting, self.view.offers_index
        receive, noblock = sockets.receive_part, sockets.NOBLOCK
        for _ in range(most):
            try:  # raised once a turn, not asked of every message: a flood is read at the least cost
                part = receive(front, noblock)
            except zmq.Again:
                self._admission.caught_up()
                return
            if not part.more:
                continue
            route = part.bytes
            frames = sockets.receive_frames(front)
            if severed(route):  # what a cut connection queued before it was cut
                continue
            if waiting(route) >= MAX_UNREAD and route not in offers:
                self._unread(route, frames)
                continue
            self._handle(route, frames)
        self._admission.fell_behind(time.monotonic())

    def _unread(self, route: bytes, frames: list) -> None:
        """A message from a peer that does not read its answers: counted as a question at the
        admission step (past its share, its connection is cut), and dropped unanswered, never
        decoded, at the least cost this loop can pay (a flood of them costs a read and a count)."""
        admission = self._admission
        now = time.monotonic()
        cut = admission.behind(now) and admission.admit(
            route, self._user(frames[0]) or None, size_of(frames), True, False, now
        )
        if cut:
            self._cut(route, frames[0], cut)
        else:
            assert self._outbox is not None  # set by `bind`: this message was read from its front
            self._outbox.dropped += 1

    def _cut(self, route: bytes, frame: zmq.Frame, why: str) -> None:
        """Close the connection of a peer that floods (`sockets.cut`): read and dropped, its
        messages would still pile up in ZeroMQ faster than this loop reads them (nothing
        bounds that queue, see `bind`); cut, it must dial again, and what it queued goes with
        the connection. Only while ZeroMQ still has its route (the refusal that says why is
        sent, or finds its queue full), so the connection cut is the one ``frame`` came from."""
        assert self._front is not None  # set by `bind`: ``frame`` came on it
        try:
            self._front.send_multipart(
                [
                    route,
                    *encode(
                        Refusal(f"the broker closed this connection: {why}; send less often, and read its answers")
                    ),
                ],
                zmq.NOBLOCK,
            )
        except zmq.Again:
            pass
        except zmq.ZMQError:
            return  # gone already
        self._admission.sever(route)
        assert self._outbox is not None  # set by `bind`, with the front ``frame`` came on
        self._outbox.dropped += 1
        user = self._user(frame)
        if user:  # closed here: it no longer counts against its key's connections
            routes = self._connections.get(user)
            if routes is not None:
                routes.pop(route, None)
        if sockets.cut(frame, self.endpoint):
            self._outbox.forget(route)
            more = self._losses.more()
            if more is not None:
                log.info("closed the connection of %s: %s%s", peer_name(route, user), why, more)

    def _user(self, frame: zmq.Frame) -> str:
        return user_of(frame) if self._guard is not None else ""

    def _admit(self, route: bytes, user: str, frames: list, question: bool, now: float) -> bool:
        """The one admission step (`floods.Admission`): every message from every connection
        is counted, per connection and per key, before anything else is done with it.
        False when it is not to be served: its connection was cut, or it is too big (refused).
        A peer that does not read what it is sent is counted by `_unread` instead."""
        worker = route in self.view.offers_index
        size = size_of(frames)
        cut = self._admission.admit(route, user or None, size, question, worker, now)
        if cut:
            self._cut(route, frames[0], cut)
            return False
        if size > LARGEST:
            if not self._refusal(route, user, frames[0], now):
                why = self._admission.too_big(size)
                self._refused(route, user, why)
                self._answer(route, Refusal(why))
            return False
        return True

    def _refusal(self, route: bytes, user: str, frame: zmq.Frame, now: float) -> bool:
        """Count a message refused, or one that opened or ended nothing: True when its
        connection was cut for it (past its share, `floods`)."""
        cut = self._admission.refused(route, user or None, route in self.view.offers_index, now)
        if not cut:
            return False
        self._cut(route, frame, cut)
        return True
