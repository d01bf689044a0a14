"""A client's one connection to its broker for every relayed host: channels as lanes.

Every relayed channel of a client is a *lane* of one connection, so a client that reaches
a fleet holds one socket (ZeroMQ allows 1,023) and the broker one connection per client, not
one per client and host. A lane sends ``Relay(host, lane, inner)``, the broker keeps one exchange per (connection, host,
lane), and the broker's answers for a lane come back as ``Relay(lane, inner)``. Opening a
channel to a new host costs its Hello, never a connection.

No thread of its own: the threads of the channels take turns with the socket (ZeroMQ sockets
are not for sharing, but may pass from one thread to another behind a lock). A thread that
sends while nobody holds the socket sends at once; one that waits for an answer while
nobody holds it holds it, and sorts whatever arrives into the lanes' queues until its own
lane has a message. The others wait on a condition, or leave what they send in a queue and
wake the holder through a pipe. So a forward from one thread costs no hand-over between
threads, and many threads still share one connection. A message for a lane that closed is
dropped (a late answer, as on a channel thrown away); a refusal for no lane in particular (the
broker closing the connection) goes to every lane. The link also says whether the broker
took the connection, how often it dropped, and a handshake it refused.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import os
import threading
import time
from typing import Any

import zmq

from ...errors import Closed, ProtocolError
from ...wire import Bye, Refusal, Relay, decode, encode, variant_of
from .. import sockets
from ..curve import HANDSHAKE_FAILED as _HANDSHAKE_FAILED
from ..curve import PROBE, Keys, as_client, hung_up

#: Messages kept for one lane before its oldest is dropped (a lane's channel reads each in
#: turn; what piles up is late answers to work given up on).
LANE_QUEUE = 4096
#: The longest a holder of the socket polls before it looks at the time and the link again,
#: and a waiting thread sleeps before it looks whether the socket is free (seconds).
SLICE = 0.05
_EVENTS_WATCHED = zmq.EVENT_DISCONNECTED | _HANDSHAKE_FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED


class Link:
    """One DEALER to the broker at ``address``, carrying the lanes of every relayed channel."""

    def __init__(self, address: str, patience: float, keys: Keys | None = None) -> None:
        self.address = address
        self.keys = keys
        self.patience = patience
        self.linked = False  # the broker took the connection (a handshake completed)
        self.drops = 0  # how often the connection dropped
        self.refused: int | None = None  # the monitor event of a handshake the broker refused
        self._numbers = itertools.count(1)
        self._lanes: dict[int, collections.deque] = {}
        self._changed = threading.Condition()  # the lanes' queues changed, or the socket is free
        self._waiting = 0  # threads asleep on `_changed`
        self._socket = threading.Lock()  # whoever holds it may use `sock` and `_monitor`
        self._out: collections.deque = collections.deque()  # what others left to send
        self._pending: collections.deque = collections.deque()  # what ZeroMQ could not take yet
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._closed = False
        self._bound: float | None = None  # the holder's deadline (``time.monotonic()``), if it has one
        self.sock = sockets.dealer(patience)
        if keys is not None:
            as_client(self.sock, keys, None)
        self._monitor = self.sock.get_monitor_socket(_EVENTS_WATCHED)
        self._poller = zmq.Poller()
        self._poller.register(self.sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)
        self.sock.connect(address)

    # -- lanes ---------------------------------------------------------------------------
    def lane(self, host: str) -> Lane:
        number = next(self._numbers)
        with self._changed:
            if self._closed:
                raise Closed("this broker was closed; make a new one")
            self._lanes[number] = collections.deque(maxlen=LANE_QUEUE)
        return Lane(self, host, number)

    def send(self, frames: list) -> None:
        """Send now when the socket is free; else the thread holding it sends it next."""
        if self._closed:
            raise Closed(f"the connection to the broker at {self.address} was closed")
        self._out.append(frames)
        if self._socket.acquire(blocking=False):
            self._release(self._flush())
        else:
            self._wake()

    def receive(self, number: int, timeout: float, bound: float | None = None) -> list | None:
        """The next message for lane ``number``, or None after ``timeout`` seconds.
        ``bound``: the caller's deadline (``time.monotonic()``), which a wait of its own
        while it holds the socket (a handshake's probe) does not pass."""
        until = time.monotonic() + timeout
        while True:
            with self._changed:
                waiting = self._lanes.get(number)
                if waiting or waiting is None or self._closed:
                    return waiting.popleft() if waiting else None
                left = until - time.monotonic()
                if left <= 0:
                    return None
                # tried under the condition: whoever lets go of the socket after this try
                # fails notifies this thread (`_release`), so no turn is missed
                if not self._socket.acquire(blocking=False):
                    self._waiting += 1  # another thread holds it: it sorts ours to us
                    try:
                        self._changed.wait(min(left, SLICE))
                    finally:
                        self._waiting -= 1
                    continue
            ok = True
            self._bound = bound
            try:
                ok = self._serve(number, until)
            finally:
                self._bound = None
                self._release(ok)

    def look(self, bound: float | None = None) -> None:
        """Read the connection's events now, if the socket is free (a channel borrowed after
        a while idle asks whether the link dropped meanwhile). ``bound``: as for ``receive``."""
        if not self._closed and self._socket.acquire(blocking=False):
            ok = True
            self._bound = bound
            try:
                ok = self._take()
            finally:
                self._bound = None
                self._release(ok)

    def forget(self, number: int) -> None:
        with self._changed:
            self._lanes.pop(number, None)

    def close(self) -> None:
        with self._changed:
            if self._closed:
                return
            self._closed = True
            self._changed.notify_all()
        self._wake()
        # the holder, if any, lets go within a slice (it sees `_closed`)
        if self._socket.acquire(timeout=5.0):
            try:
                self._end()
            finally:
                self._socket.release()

    @property
    def closed(self) -> bool:
        return self._closed

    def _wake(self) -> None:
        """Wake the thread holding the socket (its poll watches the pipe). Under the lock
        the pipe is closed under, so a descriptor number reused since is never written to."""
        with self._changed:
            if self._wake_w >= 0:
                with contextlib.suppress(OSError):  # full: the holder wakes anyway
                    os.write(self._wake_w, b"\0")

    # -- with the socket held ---------------------------------------------------------------
    def _serve(self, number: int, until: float) -> bool:
        """Sort what arrives into the lanes until lane ``number`` has a message, the time is
        up, or the link ends; False when it ended."""
        while not self._closed:
            if not self._flush() or not self._take():
                return False
            with self._changed:
                if self._lanes.get(number) or number not in self._lanes:
                    return True
            left = until - time.monotonic()
            if left <= 0:
                return True
            if self._pending:
                self._poller.register(self.sock, zmq.POLLIN | zmq.POLLOUT)
            try:
                ready = self._poller.poll(max(1, int(1000 * min(left, SLICE))))
            except zmq.ZMQError:
                return False
            finally:
                if self._pending:
                    self._poller.register(self.sock, zmq.POLLIN)
            if any(what == self._wake_r for what, _ in ready):  # another thread left something to send
                with contextlib.suppress(OSError):
                    os.read(self._wake_r, 65536)
        return True

    def _flush(self) -> bool:
        """Send what waits, as far as ZeroMQ takes it; False when the socket failed."""
        out, pending = self._out, self._pending
        while out:
            pending.append(out.popleft())
        try:
            while pending:
                sockets.send_frames(self.sock, pending[0], sockets.NOBLOCK)
                pending.popleft()
        except zmq.Again:
            pass  # the broker reads slower than we write: the rest waits here, in order
        except zmq.ZMQError:
            return False
        return True

    def _take(self) -> bool:
        """Read what arrived (up to a bound) and the connection's events; False when the
        socket failed."""
        sock, monitor = self.sock, self._monitor
        try:
            for _ in range(1024):
                if not sockets.readable(sock):
                    break
                self._sort(sockets.receive_frames(sock))
            while sockets.readable(monitor):
                self._event(int.from_bytes(monitor.recv_multipart()[0][:2], "little"))
        except zmq.ZMQError:
            return False
        return True

    def _release(self, ok: bool = True) -> None:
        """Let go of the socket; first end the link if it failed, or send what another thread
        left meanwhile, and wake the threads waiting (one of them may hold it next)."""
        if not ok or self._closed:
            try:
                self._end()
            finally:
                self._socket.release()
            return
        while True:
            self._socket.release()
            if not self._out or not self._socket.acquire(blocking=False):
                break  # nothing left, or the new holder sends it
            if not self._flush():
                self._release(False)
                return
        with self._changed:
            if self._waiting:
                self._changed.notify_all()

    def _sort(self, parts: list) -> None:
        """A message from the broker, into the queue of the lane it names."""
        try:
            variant = variant_of(parts)  # a Relay's told by its first bytes
            if variant is Relay:
                relay = decode(parts)  # its header only: the lane's channel opens the rest
                assert isinstance(relay, Relay)  # what `variant_of` said it is
                inner = list(relay.inner)
                lanes = [relay.lane]
            elif variant is Refusal:  # the broker's word for the connection: every lane hears it
                inner = list(parts)
                lanes = list(self._lanes)
            else:
                return  # nothing else is for a client's lanes
        except ProtocolError:
            return  # junk the broker would never send: not ours to act on
        with self._changed:
            for number in lanes:
                waiting = self._lanes.get(number)
                if waiting is not None:
                    waiting.append(inner)
            if self._waiting:
                self._changed.notify_all()

    def _event(self, event: int) -> None:
        # a failed handshake may be a hang-up: asked (up to PROBE, within the holder's
        # deadline) before the lanes' lock is taken
        refused = False
        if event & _HANDSHAKE_FAILED:
            bound = self._bound
            verdict = hung_up(
                event,
                self.keys,
                self.address,
                min(self.patience, PROBE),
                within=None if bound is None else bound - time.monotonic(),
            )
            if verdict is None:
                return  # not known in the holder's time: ZeroMQ tries again, and fails again, soon
            refused = not verdict
        with self._changed:
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.linked = True
            elif refused:
                self.refused = event
                self.drops += 1
            else:
                self.drops += 1
            self._changed.notify_all()

    def _end(self) -> None:
        """With the socket held (and kept: nobody uses it again): the link is over, whatever
        ended it; the lanes hear it, the broker is told, the sockets and the pipe close."""
        with self._changed:
            if self.sock.closed:
                return
            self._closed = True
            self.drops += 1  # closed or failed under a lane: each of them sees a drop
            self._changed.notify_all()
        with contextlib.suppress(zmq.ZMQError):
            if self.linked:  # the broker ends every exchange of this connection now
                self.sock.send_multipart(encode(Bye()), zmq.NOBLOCK)
        with contextlib.suppress(zmq.ZMQError):
            self.sock.disable_monitor()
        sockets.close(self._monitor, self.sock)
        with self._changed:
            for fd in (self._wake_r, self._wake_w):
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._wake_r = self._wake_w = -1


class Lane:
    """One relayed channel's share of a :class:`Link`: what it sends goes in a ``Relay``
    naming its host and number; what comes back for that number is its alone."""

    def __init__(self, link: Link, host: str, number: int) -> None:
        self.link = link
        self.host = host
        self.number = number
        self.drops_seen = link.drops  # the link's drops before this lane: not this lane's business
        self.closed = False

    def send(self, frames: list) -> None:
        self.link.send(encode(Relay(host=self.host, lane=self.number, inner=tuple(frames))))

    def receive(self, timeout: float, bound: float | None = None) -> Any:
        return self.link.receive(self.number, timeout, bound)

    def dropped(self, bound: float | None = None) -> bool:
        """Whether the link dropped since this lane opened (its events read first, when
        nobody else is reading them, within ``bound``, the caller's deadline)."""
        self.link.look(bound)
        return self.link.drops != self.drops_seen

    def close(self, *, quiet: bool = False) -> None:
        if self.closed:
            return
        self.closed = True
        self.link.forget(self.number)
        if not quiet and self.link.linked and not self.dropped():
            with contextlib.suppress(Closed):  # the worker ends its session for this lane
                self.send(encode(Bye()))
