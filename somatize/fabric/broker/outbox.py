"""The broker's outbox: every send non-blocking, a bounded queue per peer, fair per tenant.

A broker serves everyone from one thread, so no send of its may ever wait for one peer.
Each message goes out with ``NOBLOCK``. When ZeroMQ's own queue to that peer is full
(``EAGAIN``: the peer reads slower than it is written to) the message waits here, in a
queue of that peer's, behind the tenant it is for; what waits is tried again at every turn
of the loop, one tenant after another, so a tenant that floods a worker fills only its own
queue. A queue past its bound loses the message, and the loss is counted against the peer:
a peer that does not read loses its answers, and never stalls anyone else.

What the broker holds for one peer is counted in bytes wherever it lies. ZeroMQ's queue in
front of this one takes at most `PIPED` messages (the broker's ``SNDHWM``, set by
``sockets.router``), each at most `LARGEST` bytes (the admission step refuses a bigger
message, and the socket's ``MAXMSGSIZE`` cuts a peer sending a bigger frame), and its
connection writes one more. Every message sent into that queue is counted against the
peer (the last ``PIPED + 1`` sent: whatever of them ZeroMQ still holds is among them), and
what waits here may fill the peer's bound, `PEER_BYTES`, only up to what those take.

``EAGAIN`` is *slow*, never *gone*: only ``EHOSTUNREACH`` (``ROUTER_MANDATORY``: ZeroMQ has
no route of that id any more) says a peer left, and the outbox says so to its owner.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

import zmq

from ..sockets import NOBLOCK, send_frames
from ..streams import CHUNK

#: Messages held for one tenant at one peer while ZeroMQ's queue to it is full.
HELD = 256
#: Bytes held for one peer (ZeroMQ's queue to it and what waits here, all tenants together),
#: and what waits here for every peer together.
PEER_BYTES, ALL_BYTES = 64 << 20, 512 << 20
#: The largest message the broker takes or sends, all its frames together: a stream's chunk
#: and room for its envelope (a bigger message travels as a stream, `streams`).
LARGEST = CHUNK + (64 << 10)
#: Messages ZeroMQ's own queue to one peer holds (the broker's ``SNDHWM``): a stream's window
#: of chunks and as many again.
PIPED = 8
assert (PIPED + 1) * LARGEST < PEER_BYTES, "ZeroMQ's queue to a peer must fit in its bound"
#: Peers whose losses, and sizes sent, are remembered (the most recent ones; one with
#: messages waiting here is never let go).
REMEMBERED = 4096

SENT, HELD_BACK, DROPPED, GONE = "sent", "held", "dropped", "gone"


def _size(frames: list) -> int:
    return sum(len(memoryview(f).cast("B")) if not isinstance(f, zmq.Frame) else len(f.bytes) for f in frames)


@dataclass
class _Peer:
    queues: OrderedDict[str, deque] = field(default_factory=OrderedDict)  # tenant -> frames lists
    bytes: int = 0  # what waits here
    sent: deque = field(default_factory=deque)  # sizes of the last PIPED + 1 sent into ZeroMQ's queue
    piped: int = 0  # their sum: at least what ZeroMQ still holds for the peer


class Outbox:
    """Sends on a ROUTER ``front`` and never blocks; see the module's docstring."""

    def __init__(
        self,
        front: zmq.Socket,
        *,
        held: int = HELD,
        peer_bytes: int = PEER_BYTES,
        all_bytes: int = ALL_BYTES,
        piped: int = PIPED,
    ) -> None:
        self.front = front
        self.held, self.peer_bytes, self.all_bytes = held, peer_bytes, all_bytes
        self.piped = piped
        self._peers: OrderedDict[bytes, _Peer] = OrderedDict()  # the peers sent to lately, the oldest first
        self._busy: dict[bytes, _Peer] = {}  # those with messages waiting here
        self._losses: OrderedDict[bytes, int] = OrderedDict()  # route -> messages lost, recent peers only
        self._bytes = 0
        self.dropped = 0  # messages lost, in all

    def waiting(self, route: bytes) -> int:
        """How many messages wait for ``route``."""
        peer = self._busy.get(route)
        return 0 if peer is None else sum(len(q) for q in peer.queues.values())

    def dropped_for(self, route: bytes) -> int:
        return self._losses.get(route, 0)

    def send(self, route: bytes, frames: list, tenant: str = "") -> str:
        """``SENT``, ``HELD_BACK`` (it waits here), ``DROPPED`` (over a bound) or ``GONE``."""
        size = _size(frames)
        peer = self._peer(route)
        if not peer.queues:
            if peer.piped + size > self.peer_bytes:  # bigger than ZeroMQ's queue may ever hold
                return self._lost(route)
            try:
                send_frames(self.front, [route, *frames], NOBLOCK)
            except zmq.Again:
                pass
            except zmq.ZMQError as exc:
                if exc.errno == zmq.EHOSTUNREACH:
                    self.forget(route)
                    return GONE
                raise
            else:
                self._piped(peer, size)
                return SENT
        queue = peer.queues.get(tenant)
        if (
            (queue is not None and len(queue) >= self.held)
            or peer.bytes + peer.piped + size > self.peer_bytes
            or self._bytes + size > self.all_bytes
        ):
            return self._lost(route)
        if queue is None:
            queue = peer.queues[tenant] = deque()
            self._busy[route] = peer
        queue.append((frames, size))
        peer.bytes += size
        self._bytes += size
        return HELD_BACK

    def _peer(self, route: bytes) -> _Peer:
        peers = self._peers
        peer = peers.get(route)
        if peer is None:
            peer = peers[route] = _Peer()
            if len(peers) > REMEMBERED:
                oldest = next(iter(peers))
                if not peers[oldest].queues:
                    del peers[oldest]
        else:
            peers.move_to_end(route)
        return peer

    def _lost(self, route: bytes) -> str:
        self._losses[route] = self._losses.pop(route, 0) + 1
        if len(self._losses) > REMEMBERED:
            self._losses.popitem(last=False)
        self.dropped += 1
        return DROPPED

    def _piped(self, peer: _Peer, size: int) -> None:
        """``size`` bytes went into ZeroMQ's queue to ``peer``: counted until ``PIPED + 1``
        more have gone after them (the queue holds ``PIPED``, its connection writes one)."""
        peer.sent.append(size)
        peer.piped += size
        if len(peer.sent) > self.piped + 1:
            peer.piped -= peer.sent.popleft()

    def piped_for(self, route: bytes) -> int:
        """At least what ZeroMQ holds for ``route`` now, in bytes (counted as it went in)."""
        peer = self._peers.get(route)
        return 0 if peer is None else peer.piped

    def flush(self) -> list[bytes]:
        """Send what waits, one message per tenant in turn, until each peer's queue is full
        again; returns the routes found gone."""
        gone = []
        for route, peer in list(self._busy.items()):
            if not peer.queues:
                del self._busy[route]
                continue
            try:
                self._drain(route, peer)
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EHOSTUNREACH:
                    raise
                gone.append(route)
                self.forget(route)
                continue
            if not peer.queues:
                del self._busy[route]
        return gone

    def _drain(self, route: bytes, peer: _Peer) -> None:
        while peer.queues:
            for tenant in list(peer.queues):
                queue = peer.queues[tenant]
                frames, size = queue[0]
                try:
                    send_frames(self.front, [route, *frames], NOBLOCK)
                except zmq.Again:
                    return
                self._piped(peer, size)
                queue.popleft()
                peer.bytes -= size
                self._bytes -= size
                if not queue:
                    del peer.queues[tenant]
                else:
                    peer.queues.move_to_end(tenant)  # the next turn is another tenant's

    def forget(self, route: bytes, tenant: str | None = None) -> int:
        """Drop what waits for ``route`` (only ``tenant``'s, if given); returns how many."""
        if tenant is None:
            self._losses.pop(route, None)
        peer = self._peers.get(route)
        if peer is None:
            return 0
        tenants = list(peer.queues) if tenant is None else [tenant] if tenant in peer.queues else []
        n = 0
        for t in tenants:
            for _, size in peer.queues.pop(t):
                peer.bytes -= size
                self._bytes -= size
                n += 1
        if tenant is None:
            del self._peers[route]
        if not peer.queues:
            self._busy.pop(route, None)
        return n

    def pending(self) -> bool:
        return bool(self._busy)
