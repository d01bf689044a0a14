"""The broker's front socket: what it reads, the one admission step every message passes
first, and what it sends, never blocking.

`Front.take` reads up to a thousand messages a turn. Each is counted by `floods.Admission`,
per connection and per key, before anything else is done with it (`admit`; a peer that does
not read its answers is counted and dropped unread; `refusal` counts a message refused, or one
that opened or ended nothing). Past its share, the connection it came on is closed (`cut`).
What is admitted goes to the handler the loop gave (its `_handle`). Sends go through the
:class:`~somatize.fabric.broker.outbox.Outbox` (``NOBLOCK``, a bounded queue per peer and
tenant); a route ZeroMQ no longer has is handed to ``gone``, the loop's, which ends what it had.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Collection
from typing import Any

import zmq

from ...wire import Refusal, encode
from .. import sockets
from ..curve import Keys, as_server, peer_name, user_of
from ..logs import Quiet
from .floods import Admission
from .outbox import DROPPED, GONE, LARGEST, PIPED, Outbox

#: Answers waiting for one connection to read them: past it, its questions are dropped
#: unanswered (counted as questions at the admission step).
MAX_UNREAD = 64
#: A connection not heard from for this long no longer counts against its key (seconds).
CONNECTION_IDLE = 60.0
log = logging.getLogger("somatize.broker")


def size_of(frames: list) -> int:
    """A message's bytes, all its frames together (a ``zmq.Frame``'s length is its bytes')."""
    return sum(map(len, frames))


class Front:
    """The broker's ROUTER and what guards it: reading, admission, connections per key, sending.

    ``serving`` is the routes that serve hosts (the view's index, read, never written here):
    a worker's messages are counted as a worker's, and a worker is never cut for not reading.
    ``gone`` is called with a route ZeroMQ no longer has (a send found it gone).
    """

    def __init__(self, serving: Collection[bytes], gone: Callable[[bytes], None]) -> None:
        self.serving = serving
        self.gone = gone
        self.endpoint = ""
        self.keyed = False  # peers are told apart by their CURVE keys
        self.admission = Admission()  # what each connection and key sent, and who is cut
        self.connections: dict[str, OrderedDict[bytes, float]] = {}  # key -> route -> last heard
        self._socket: zmq.Socket | None = None
        self._drops: zmq.Socket | None = None
        self._outbox: Outbox | None = None
        self._refusals = Quiet("refusals")
        self._losses = Quiet("undelivered messages")

    # -- the socket ------------------------------------------------------------------------
    def bind(self, url: str, keys: Keys | None) -> str:
        """Listen on ``url`` (with ``keys``, CURVE); the real endpoint."""
        # a frame bigger than any the broker takes cuts its peer in libzmq, before it is queued;
        # its queue to each peer holds a few messages, counted in bytes by the outbox (`outbox`)
        front = self._socket = sockets.router(largest=LARGEST, queued=PIPED)
        # never a full queue from a peer: libzmq (4.3.5) aborts the process when a peer whose
        # inbound queue is full disconnects and a heartbeat (ours, or a PING it sent) is then
        # written (`!_io_error`, stream_engine_base.cpp:310). `take` reads as fast as anything
        # arrives, drops what will not be served, and cuts a flooder (`floods`): the queue stays short.
        front.setsockopt(zmq.RCVHWM, 0)
        # a connection dropping (a dialed-in worker killed, or silent past its pings) makes
        # the broker probe that worker
        self._drops = front.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        # no pings of its own: timers in its one I/O thread that libzmq 4.3.5 cancels by a walk
        # over all of them (idle CPU grew with the fleet's square). A dialed worker's pings
        # have a time to live, hosts clients wait on are checked (`BrokerView.expire`), and
        # the kernel's keepalive finds a machine that went away.
        sockets.tcp_keepalive(front)
        if keys is not None:
            as_server(front, keys)
            self.keyed = True
        front.bind(url)
        self._outbox = Outbox(front)
        self.endpoint = sockets.bound_endpoint(front)
        return self.endpoint

    def polled(self, poller: zmq.Poller) -> None:
        """Register what the serving loop waits on: the socket, and its drops."""
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._drops, zmq.POLLIN)

    def dropped(self, events: dict) -> list[bytes] | None:
        """The routes whose connections dropped, when ``events`` (a poll's) says some did."""
        if self._drops is None or self._drops not in events:
            return None
        dropped = []
        while sockets.readable(self._drops):
            dropped.append(self._drops.recv_multipart()[0])
        return dropped

    def close(self) -> None:
        if self._socket is not None and self._drops is not None and not self._socket.closed:
            try:
                self._socket.disable_monitor()
            except zmq.ZMQError:
                pass
        sockets.close(self._drops, self._socket)

    # -- reading ---------------------------------------------------------------------------
    def user(self, frame: zmq.Frame) -> str:
        """The key (Z85) ``frame`` came with; "" without keys."""
        return user_of(frame) if self.keyed else ""

    def take(self, handle: Callable[[bytes, list], None], most: int = 1024) -> None:
        """Read up to ``most`` messages and hand each to ``handle``, having dropped what a cut
        connection queued and what a peer that does not read its answers asks (counted as a
        question: past its share, it is cut). Never left queued in ZeroMQ: see `bind`."""
        front, outbox = self._socket, self._outbox
        assert front is not None and outbox is not None  # both set by `bind`, before `serve` reads
        severed, waiting, serving = self.admission.severed, outbox.waiting, self.serving
        receive, noblock = sockets.receive_part, sockets.NOBLOCK
        for _ in range(most):
            try:  # raised once a turn, not asked of every message: a flood is read at the least cost
                part = receive(front, noblock)
            except zmq.Again:
                self.admission.caught_up()
                return
            if not part.more:
                continue
            route = part.bytes
            frames = sockets.receive_frames(front)
            if severed(route):  # what a cut connection queued before it was cut
                continue
            if waiting(route) >= MAX_UNREAD and route not in serving:
                self._unread(route, frames)
                continue
            handle(route, frames)
        self.admission.fell_behind(time.monotonic())

    def _unread(self, route: bytes, frames: list) -> None:
        """A message from a peer that does not read its answers: counted as a question at the
        admission step, and dropped unanswered, never decoded, at the least cost this loop
        can pay (a flood of them costs a read and a count)."""
        admission = self.admission
        now = time.monotonic()
        cut = admission.behind(now) and admission.admit(
            route, self.user(frames[0]) or None, size_of(frames), True, False, now
        )
        if cut:
            self.cut(route, frames[0], cut)
        else:
            assert self._outbox is not None  # set by `bind`: this message was read from its socket
            self._outbox.dropped += 1

    def admit(self, route: bytes, user: str, frames: list, question: bool, now: float) -> bool:
        """The one admission step (`floods.Admission`): every message from every connection
        is counted, per connection and per key, before anything else is done with it.
        False when it is not to be served: its connection was cut, or it is too big (refused)."""
        size = size_of(frames)
        cut = self.admission.admit(route, user or None, size, question, route in self.serving, now)
        if cut:
            self.cut(route, frames[0], cut)
            return False
        if size > LARGEST:
            if not self.refusal(route, user, frames[0], now):
                why = self.admission.too_big(size)
                self.refused(route, user, why)
                self.answer(route, Refusal(why))
            return False
        return True

    def refusal(self, route: bytes, user: str, frame: zmq.Frame, now: float) -> bool:
        """Count a message refused, or one that opened or ended nothing: True when its
        connection was cut for it (past its share, `floods`)."""
        cut = self.admission.refused(route, user or None, route in self.serving, now)
        if not cut:
            return False
        self.cut(route, frame, cut)
        return True

    def refused(self, route: bytes, user: str, why: str) -> None:
        """Log a refusal through a limiter: a flood is counted, not printed."""
        more = self._refusals.more()
        if more is not None:
            log.info("refused %s: %s%s", peer_name(route, user), why, more)

    def cut(self, route: bytes, frame: zmq.Frame, why: str) -> None:
        """Close the connection of a peer that floods (`sockets.cut`): read and dropped, its
        messages would still pile up in ZeroMQ faster than the broker reads them (nothing
        bounds that queue, see `bind`); cut, it must dial again, and what it queued goes with
        the connection. Only while ZeroMQ still has its route (the refusal that says why is
        sent, or finds its queue full), so the connection cut is the one ``frame`` came from."""
        assert self._socket is not None and self._outbox is not None  # set by `bind`: ``frame`` came on it
        why_frames = encode(Refusal(f"the broker closed this connection: {why}; send less often, and read its answers"))
        if not self.now(route, why_frames):
            return  # gone already
        self.admission.sever(route)
        self._outbox.dropped += 1
        user = self.user(frame)
        if user:  # closed here: it no longer counts against its key's connections
            self.closed(user, route)
        if sockets.cut(frame, self.endpoint):
            self._outbox.forget(route)
            more = self._losses.more()
            if more is not None:
                log.info("closed the connection of %s: %s%s", peer_name(route, user), why, more)

    # -- connections per key ---------------------------------------------------------------
    def connected(self, key: str, route: bytes, now: float, most: int) -> bool:
        """Count ``route`` against ``key``'s connections: False past ``most``."""
        routes = self.connections.setdefault(key, OrderedDict())
        if route not in routes and len(routes) >= most:
            for old, heard in list(routes.items()):
                if now - heard > CONNECTION_IDLE and old not in self.serving:
                    del routes[old]
            if len(routes) >= most:
                return False
        routes[route] = now
        routes.move_to_end(route)
        return True

    def closed(self, key: str, route: bytes) -> None:
        """``route`` of ``key`` closed: it no longer counts against the key's connections."""
        routes = self.connections.get(key)
        if routes is not None:
            routes.pop(route, None)

    # -- sending: never blocking -------------------------------------------------------------
    def deliver(self, route: bytes, frames: list, tenant: str = "") -> None:
        """``frames`` to ``route``, queued as ``tenant``'s; a route gone is handed to ``gone``."""
        assert self._outbox is not None  # set by `bind`: what is sent answers what was read
        said = self._outbox.send(route, frames, tenant)
        if said == GONE:
            more = self._losses.more()
            if more is not None:
                log.info("a message to %s could not be delivered: its connection is gone%s", peer_name(route), more)
            self.gone(route)
        elif said == DROPPED and self._outbox.dropped_for(route) in (1, 1000, 100_000):
            more = self._losses.more()
            if more is not None:
                dropped = self._outbox.dropped_for(route)
                log.info(
                    "%s does not read what it is sent: %d messages for it dropped so far%s",
                    peer_name(route),
                    dropped,
                    more,
                )

    def answer(self, route: Any, message: Any) -> None:
        """``message``, the broker's own answer, to ``route``."""
        try:
            frames = encode(message)
        except (ValueError, TypeError) as exc:  # over a wire limit: say so, and keep serving
            frames = encode(Refusal(f"the broker's answer did not fit in a message: {exc}"[:1000]))
        self.deliver(route, frames)

    def ask(self, routes: list[bytes], message: Any) -> None:
        """``message`` to each of ``routes``, now, past the outbox (a check: it must not wait
        behind the answers queued there); a full queue is slow, never gone."""
        frames = encode(message)
        for route in routes:
            if not self.now(route, frames):
                self.gone(route)

    def now(self, route: bytes, frames: list) -> bool:
        """Send ``frames`` to ``route`` now, past the outbox; False when the route is gone
        (a full queue is slow, not gone: True)."""
        assert self._socket is not None  # set by `bind`: `serve` asks
        try:
            self._socket.send_multipart([route, *frames], zmq.NOBLOCK)
        except zmq.Again:
            pass
        except zmq.ZMQError:
            return False
        return True

    def flush(self) -> None:
        """Send what the outbox holds, as far as the peers read; a route gone is handed to ``gone``."""
        assert self._outbox is not None  # set by `bind`, which comes before `serve`
        for route in self._outbox.flush():
            self.gone(route)

    def forget(self, route: bytes, tenant: str | None = None) -> None:
        """Drop what waits for ``route`` (only ``tenant``'s, if given)."""
        assert self._outbox is not None  # set by `bind`
        self._outbox.forget(route, tenant)

    def waiting(self, route: bytes) -> int:
        """How many messages wait in the outbox for ``route``."""
        assert self._outbox is not None  # set by `bind`
        return self._outbox.waiting(route)

    def pending(self) -> bool:
        """Whether anything waits in the outbox (the loop then polls for a shorter time)."""
        return self._outbox is not None and self._outbox.pending()
