"""A client's one connection to its broker for every relayed host: channels as lanes.

A relayed channel used to be a connection of its own to the broker: a DEALER, a monitor and a
TCP connection for each relayed host a client had reached, kept for the session. A client
that reached a fleet ran out of sockets (ZeroMQ allows 1,023), and the broker held clients x
hosts connections. Here every relayed channel of a client is a *lane* of one connection: it
sends ``Relay(host, lane, inner)``, the broker keeps one exchange per (connection, host,
lane), and the broker's answers for a lane come back as ``Relay(lane, inner)``. Opening a
channel to a new host costs its Hello, never a connection.

One thread owns the socket (ZeroMQ sockets are not for sharing between threads): lanes hand
it what to send through a queue and a pipe that wakes it, and it sorts what arrives into the
lanes' queues. A message for a lane that closed is dropped (a late answer, as on a channel
thrown away); a refusal for no lane in particular (the broker closing the connection) goes to
every lane. The link also says what a channel's own monitor used to: whether the broker took
the connection, how often it dropped, and a handshake it refused.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import os
import queue
import threading
from typing import Any

import zmq

from ...errors import Closed, ProtocolError
from ...wire import Bye, Refusal, Relay, decode, encode, variant_of
from .. import sockets
from ..curve import HANDSHAKE_FAILED as _HANDSHAKE_FAILED
from ..curve import Keys, as_client

#: Messages kept for one lane before its oldest is dropped (a lane's channel reads each in
#: turn; what piles up is late answers to work given up on).
LANE_QUEUE = 4096


class Link:
    """One DEALER to the broker at ``address``, carrying the lanes of every relayed channel."""

    def __init__(self, address: str, patience: float, keys: Keys | None = None) -> None:
        self.address = address
        self.keys = keys
        self.linked = False  # the broker took the connection (a handshake completed)
        self.drops = 0  # how often the connection dropped
        self.refused: int | None = None  # the monitor event of a handshake the broker refused
        self._numbers = itertools.count(1)
        self._lanes: dict[int, collections.deque] = {}
        self._changed = threading.Condition()
        self._out: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._closed = False
        self.sock = sockets.dealer(patience)
        if keys is not None:
            as_client(self.sock, keys, None)
        self._monitor = self.sock.get_monitor_socket(
            zmq.EVENT_DISCONNECTED | _HANDSHAKE_FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED
        )
        self.sock.connect(address)
        self._thread = threading.Thread(target=self._run, daemon=True, name="somatize-link")
        self._thread.start()

    # -- lanes ---------------------------------------------------------------------------
    def lane(self, host: str) -> Lane:
        number = next(self._numbers)
        with self._changed:
            if self._closed:
                raise Closed("this broker was closed; make a new one")
            self._lanes[number] = collections.deque(maxlen=LANE_QUEUE)
        return Lane(self, host, number)

    def send(self, frames: list) -> None:
        if self._closed:
            raise Closed(f"the connection to the broker at {self.address} was closed")
        self._out.put(frames)
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"\0")

    def receive(self, number: int, timeout: float) -> list | None:
        """The next message for lane ``number``, or None after ``timeout`` seconds."""
        with self._changed:
            waiting = self._lanes.get(number)
            if waiting is None:
                return None
            if not waiting:
                self._changed.wait(timeout)
            return waiting.popleft() if waiting else None

    def forget(self, number: int) -> None:
        with self._changed:
            self._lanes.pop(number, None)

    def close(self) -> None:
        with self._changed:
            if self._closed:
                return
            self._closed = True
            self._changed.notify_all()
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"\0")
        self._thread.join(5)

    # -- the thread that owns the socket -----------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        pending: collections.deque = collections.deque()  # what the socket could not take yet
        try:
            while not self._closed:
                poller.poll(100 if not pending else 10)
                with contextlib.suppress(OSError):
                    os.read(self._wake_r, 65536)
                while True:
                    try:
                        pending.append(self._out.get_nowait())
                    except queue.Empty:
                        break
                while pending:
                    try:
                        self.sock.send_multipart(pending[0], zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break  # the broker reads slower than we write: the rest waits here
                    pending.popleft()
                for _ in range(1024):
                    try:
                        parts = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._sort(parts)
                while self._monitor.get(zmq.EVENTS) & zmq.POLLIN:
                    self._event(int.from_bytes(self._monitor.recv_multipart()[0][:2], "little"))
        finally:
            self._end()

    def _sort(self, parts: list) -> None:
        """A message from the broker, into the queue of the lane it names."""
        try:
            variant = variant_of(parts)
            if variant is Relay:
                relay = decode(parts)  # its header only: the lane's channel opens the rest
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
            self._changed.notify_all()

    def _event(self, event: int) -> None:
        with self._changed:
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.linked = True
            elif event & _HANDSHAKE_FAILED:
                self.refused = event
                self.drops += 1
            else:
                self.drops += 1
            self._changed.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed

    def _end(self) -> None:
        with self._changed:  # whatever ended the thread, the link is over: lanes hear it
            self._closed = True
            self.drops += 1
            self._changed.notify_all()
        with contextlib.suppress(zmq.ZMQError):
            if self.linked:  # the broker ends every exchange of this connection now
                self.sock.send_multipart(encode(Bye()), zmq.NOBLOCK)
        with contextlib.suppress(zmq.ZMQError):
            self.sock.disable_monitor()
        sockets.close(self._monitor, self.sock)
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)


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

    def receive(self, timeout: float) -> Any:
        return self.link.receive(self.number, timeout)

    def dropped(self) -> bool:
        """Whether the link dropped since this lane opened."""
        return self.link.drops != self.drops_seen

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.link.forget(self.number)
        if self.link.linked and not self.dropped():
            with contextlib.suppress(Closed):  # the worker ends its session for this lane
                self.send(encode(Bye()))
