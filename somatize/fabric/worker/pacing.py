"""A dialed worker's answers to its broker: a fair order across tenants, and never more in
flight than the broker has read.

A dialed worker has one connection, to its broker, and every tenant's answers share it.
What the worker writes there is not what the broker has read: between them are the
worker's queue, the kernel's buffers (megabytes on a fast link: tens of thousands of small
messages) and the broker's own queue for the connection (unbounded, see
``BrokerLoop.bind``), which the broker reads in turn with every other connection it has.
Under a flood of relayed Hellos or Works from many connections, the worker answered each at
once and the socket always took it, so a victim's ``Done`` was written behind hundreds of
thousands of the flood's ``Ready``s and reached the broker long after its client's deadline.
A full socket says nothing here, so the worker counts instead:

- **A window in flight.** At most ``WINDOW`` answers are in flight past the last *mark*
  the broker answered. A mark is a ``Where`` for the worker's own host, sent in line with
  the answers every ``MARK_EVERY`` of them; the broker answers it (``Located``) only once it
  has read every answer before it, so its answer says how far the broker has read. A mark
  not answered within ``MARK_LOST`` seconds (a broker that restarted, or does not answer)
  is taken as read: the window then opens at that pace, never stays shut.
- **A fair order.** Answers that find the window full wait here in a queue per tenant (the
  broker's id for the client) and leave one per tenant in turn, so another tenant's answer
  waits behind at most one of the flood's per turn, and the window. A tenant's queue holds
  at most ``TENANT_QUEUE`` answers, all of them together ``WAITING_BYTES``: past that an
  answer is dropped and counted, the flood's, since an honest client has an answer or two
  waiting at a time.

Control (the keepalive, the Ready to the broker's check) never waits here: it goes ahead of
everything (:mod:`somatize.fabric.worker.dialing`). Sans IO: the outbox sends what this says
(:mod:`somatize.fabric.worker.outbox`), and the link to the broker owns it.
"""

from __future__ import annotations

from collections import OrderedDict, deque

import zmq

#: Answers in flight to the broker past the last mark it answered.
WINDOW = 256
#: A mark every this many answers sent.
MARK_EVERY = 64
#: Seconds after which a mark not answered is taken as read.
MARK_LOST = 1.0
#: Answers waiting per tenant, and bytes waiting in all, past which an answer is dropped.
TENANT_QUEUE, WAITING_BYTES = 64, 256 << 20


def _size(frames: list) -> int:
    return sum(memoryview(f).nbytes if not isinstance(f, zmq.Frame) else len(f.buffer) for f in frames)


class Pacer:
    """How many answers are in flight, the marks that will say how far the broker read, and
    what waits for the window, per tenant."""

    __slots__ = ("_bytes", "_marks", "_queues", "acked", "lost", "sent")

    def __init__(self) -> None:
        self.sent = 0  # answers sent on this connection
        self.acked = 0  # of them, read by the broker as far as the marks say
        self.lost = 0  # marks taken as read for want of an answer
        self._marks: deque[tuple[int, float]] = deque()  # (answers sent before it, when)
        self._queues: OrderedDict[str, deque] = OrderedDict()  # tenant -> its answers waiting
        self._bytes = 0

    def room(self) -> bool:
        """Whether the window takes another answer."""
        return self.sent - self.acked < WINDOW

    def free(self) -> bool:
        """Whether an answer may leave now: the window has room and nothing waits before it."""
        return not self._queues and self.sent - self.acked < WINDOW

    def waiting(self) -> bool:
        return bool(self._queues)

    def hold(self, tenant: str, frames: list) -> bool:
        """Keep ``frames`` for the window, behind ``tenant``'s others; False when over a bound."""
        queue = self._queues.get(tenant)
        size = _size(frames)
        if (queue is not None and len(queue) >= TENANT_QUEUE) or self._bytes + size > WAITING_BYTES:
            return False
        if queue is None:
            queue = self._queues[tenant] = deque()
        queue.append((frames, size))
        self._bytes += size
        return True

    def next(self) -> list | None:
        """The next answer to send: the first of the tenant whose turn it is (then its turn
        goes to the next tenant), or None when nothing waits or the window is full."""
        if not self._queues or self.sent - self.acked >= WINDOW:
            return None
        tenant, queue = next(iter(self._queues.items()))
        frames, size = queue.popleft()
        self._bytes -= size
        if queue:
            self._queues.move_to_end(tenant)
        else:
            del self._queues[tenant]
        return frames

    def sent_one(self) -> bool:
        """An answer left; True when a mark is due behind it."""
        self.sent += 1
        last = self._marks[-1][0] if self._marks else self.acked
        return self.sent - last >= MARK_EVERY

    def marked(self, now: float) -> None:
        """A mark left, behind every answer sent so far."""
        self._marks.append((self.sent, now))

    def answered(self) -> None:
        """The broker answered the oldest mark: it has read every answer sent before it."""
        if self._marks:
            self.acked = max(self.acked, self._marks.popleft()[0])

    def look(self, now: float) -> float | None:
        """Marks unanswered for ``MARK_LOST`` are taken as read; returns when the oldest
        still out will be, if the window waits on it (for the serving loop's timer)."""
        while self._marks and now - self._marks[0][1] >= MARK_LOST:
            self.lost += 1
            self.answered()
        if self._marks and not self.room():
            return self._marks[0][1] + MARK_LOST
        return None

    def reset(self) -> None:
        """The connection is new (or came back): nothing of the old one is in flight."""
        self._marks.clear()
        self.acked = self.sent
