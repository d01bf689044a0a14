"""The broker's outbox: every send non-blocking, a bounded queue per peer, fair per tenant.

A broker serves everyone from one thread, so no send of its may ever wait for one peer.
Each message goes out with ``NOBLOCK``. When ZeroMQ's own queue to that peer is full
(``EAGAIN``: the peer reads slower than it is written to) the message waits here, in a
queue of that peer's, behind the tenant it is for; what waits is tried again at every turn
of the loop, one tenant after another, so a tenant that floods a worker fills only its own
queue. A queue past its bound loses the message, and the loss is counted against the peer:
a peer that does not read loses its answers, and never stalls anyone else.

``EAGAIN`` is *slow*, never *gone*: only ``EHOSTUNREACH`` (``ROUTER_MANDATORY``: ZeroMQ has
no route of that id any more) says a peer left, and the outbox says so to its owner.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

import zmq

from ..sockets import NOBLOCK, send_frames

#: Messages held for one tenant at one peer while ZeroMQ's queue to it is full.
HELD = 256
#: Bytes held for one peer, all tenants together, and for every peer together.
HELD_BYTES, ALL_BYTES = 64 << 20, 512 << 20
#: Peers whose losses are remembered (the most recent ones), for the log's counts.
REMEMBERED = 4096

SENT, HELD_BACK, DROPPED, GONE = "sent", "held", "dropped", "gone"


def _size(frames: list) -> int:
    return sum(len(memoryview(f).cast("B")) if not isinstance(f, zmq.Frame) else len(f.bytes) for f in frames)


@dataclass
class _Peer:
    queues: OrderedDict[str, deque] = field(default_factory=OrderedDict)  # tenant -> frames lists
    bytes: int = 0


class Outbox:
    """Sends on a ROUTER ``front`` and never blocks; see the module's docstring."""

    def __init__(self, front: zmq.Socket, *, held: int = HELD, held_bytes: int = HELD_BYTES,
                 all_bytes: int = ALL_BYTES) -> None:
        self.front = front
        self.held, self.held_bytes, self.all_bytes = held, held_bytes, all_bytes
        self._peers: dict[bytes, _Peer] = {}
        self._losses: OrderedDict[bytes, int] = OrderedDict()  # route -> messages lost, recent peers only
        self._bytes = 0
        self.dropped = 0  # messages lost, in all

    def waiting(self, route: bytes) -> int:
        """How many messages wait for ``route``."""
        peer = self._peers.get(route)
        return 0 if peer is None else sum(len(q) for q in peer.queues.values())

    def dropped_for(self, route: bytes) -> int:
        return self._losses.get(route, 0)

    def send(self, route: bytes, frames: list, tenant: str = "") -> str:
        """``SENT``, ``HELD_BACK`` (it waits here), ``DROPPED`` (over a bound) or ``GONE``."""
        peer = self._peers.get(route)
        if peer is None or not peer.queues:
            try:
                send_frames(self.front, [route, *frames], NOBLOCK)
                return SENT
            except zmq.Again:
                pass
            except zmq.ZMQError as exc:
                if exc.errno == zmq.EHOSTUNREACH:
                    self.forget(route)
                    return GONE
                raise
        peer = self._peers.setdefault(route, _Peer())
        queue = peer.queues.get(tenant)
        size = _size(frames)
        if (queue is not None and len(queue) >= self.held) or peer.bytes + size > self.held_bytes \
                or self._bytes + size > self.all_bytes:
            self._losses[route] = self._losses.pop(route, 0) + 1
            if len(self._losses) > REMEMBERED:
                self._losses.popitem(last=False)
            self.dropped += 1
            return DROPPED
        if queue is None:
            queue = peer.queues[tenant] = deque()
        queue.append((frames, size))
        peer.bytes += size
        self._bytes += size
        return HELD_BACK

    def flush(self) -> list[bytes]:
        """Send what waits, one message per tenant in turn, until each peer's queue is full
        again; returns the routes found gone."""
        gone = []
        for route, peer in list(self._peers.items()):
            if not peer.queues:
                del self._peers[route]
                continue
            try:
                self._drain(route, peer)
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EHOSTUNREACH:
                    raise
                gone.append(route)
                self.forget(route)
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
        return n

    def pending(self) -> bool:
        return any(p.queues for p in self._peers.values())
