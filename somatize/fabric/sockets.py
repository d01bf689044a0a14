"""The one place ZeroMQ sockets are made, configured and closed.

Every socket gets a short linger (closing never blocks on a dead peer), every listening
socket a maximum message size, every ROUTER ``ROUTER_MANDATORY`` (a reply to a peer that
is gone raises instead of vanishing), every dialing socket ZMTP heartbeats (a peer that
stops answering is noticed within ``patience``). ``zmq.ZMQError`` is translated into
somatize's words (``Closed``, ``Broken``, ``Unreachable``) here and nowhere else.
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import os
import socket
import threading
from collections.abc import Iterator

import zmq

from ..errors import Broken, Closed

#: How long a socket may keep unsent messages after close, in milliseconds.
LINGER_MS = 100
#: The largest message a listening socket accepts (bytes); above it the peer is cut off.
MAX_MESSAGE = 16 << 30
#: How long, by default, a silent peer is waited for before it counts as gone (seconds).
PATIENCE = 5.0

_counter = itertools.count()
_lock = threading.Lock()

# The hot path's sends and receives: pyzmq's own backend, called with flags as plain ints
# (the sugar's `send_multipart` and `recv_multipart` are Python layers over the same calls,
# combining enum flags on every frame). Small frames are still copied, at pyzmq's
# `copy_threshold`, as `copy=False` does there.
_SEND, _RECV = zmq.backend.Socket.send, zmq.backend.Socket.recv
_POLL = zmq.backend.zmq_poll
NOBLOCK, SNDMORE = int(zmq.NOBLOCK), int(zmq.SNDMORE)
EVENTS, POLLIN, POLLOUT = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.POLLOUT)


def send_frames(sock: zmq.Socket, frames: list, flags: int = 0) -> None:
    """``sock.send_multipart(frames, flags, copy=False)``: every frame but the last with
    ``SNDMORE``. ZeroMQ takes a message whole or not at all (``zmq.Again`` on the first
    frame, with ``NOBLOCK``)."""
    last = len(frames) - 1
    for i in range(last):
        _SEND(sock, frames[i], flags | SNDMORE, False, False)
    _SEND(sock, frames[last], flags, False, False)


def receive_frames(sock: zmq.Socket, flags: int = 0) -> list:
    """``sock.recv_multipart(flags, copy=False)``: the frames of one message, as ``zmq.Frame``s
    (each says whether another follows: asking the socket costs an option look-up)."""
    frame = _RECV(sock, flags, False, False)
    parts = [frame]
    while frame.more:
        frame = _RECV(sock, 0, False, False)
        parts.append(frame)
    return parts


def receive_part(sock: zmq.Socket, flags: int = 0) -> zmq.Frame:
    """``sock.recv(flags, copy=False)``: one frame (``.more`` says whether another follows)."""
    return _RECV(sock, flags, False, False)


def readable(sock: zmq.Socket) -> bool:
    """Whether a message waits on ``sock`` now. Asked by a poll of no time rather than of the
    ``EVENTS`` option, which libzmq answers the same way (a poll asks it) but pyzmq reads
    by looking the option up in an ``enum`` on every call, a third of the cost. A closed
    socket raises ``zmq.ZMQError`` (``ENOTSOCK``), as reading the option does: pyzmq would
    poll descriptor 0 in its place."""
    if sock.closed:
        raise zmq.ZMQError(zmq.ENOTSOCK)
    return bool(_POLL([(sock, POLLIN)], 0))


def writable(sock: zmq.Socket) -> bool:
    """Whether ``sock`` takes a message now (asked as ``readable`` asks)."""
    if sock.closed:
        raise zmq.ZMQError(zmq.ENOTSOCK)
    return bool(_POLL([(sock, POLLOUT)], 0))


def context() -> zmq.Context:
    """The process's one ZeroMQ context (inproc endpoints only meet within one)."""
    return zmq.Context.instance()


def unique_inproc(what: str) -> str:
    return f"inproc://somatize-{what}-{os.getpid()}-{next(_counter)}"


def router(*, mandatory: bool = True, largest: int = MAX_MESSAGE, queued: int | None = None) -> zmq.Socket:
    """A ROUTER. ``largest``: the biggest frame a peer may send (``MAXMSGSIZE``: libzmq cuts
    a peer that sends a bigger one); ``queued``: how many messages its queue to each peer
    takes (``SNDHWM``; ``ROUTER_MANDATORY`` makes a send past it ``EAGAIN``, never a loss).
    Its queue from each peer is never bounded here (``RCVHWM`` stays libzmq's own; see the
    broker's ``bind`` for why it must not be)."""
    sock = context().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, LINGER_MS)
    sock.setsockopt(zmq.MAXMSGSIZE, largest)
    if queued is not None:
        sock.setsockopt(zmq.SNDHWM, queued)
    if mandatory:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    return sock


def dealer(patience: float = PATIENCE, *, identity: bytes | None = None, pings: int = 4) -> zmq.Socket:
    sock = context().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, LINGER_MS)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    heartbeat(sock, patience, pings=pings)
    return sock


def heartbeat(sock: zmq.Socket, patience: float, *, pings: int = 4) -> None:
    """ZMTP heartbeats: ``pings`` pings a patience; the connection is dropped when a ping is
    not answered within patience, and the peer drops it when nothing came for the time to
    live a ping names (a patience, or one and a half intervals when that is longer). A
    client's sockets ping four times a patience (a stopped worker is noticed soon); a dialed
    worker's link once, which is how the broker knows it is there between its rare
    keepalives. The broker pings nobody: each ping it sent would be timers in its one I/O
    thread, which libzmq 4.3.5 cancels by walking all of them (a fleet's worth)."""
    interval = max(100, int(patience * 1000 / pings))
    sock.setsockopt(zmq.HEARTBEAT_IVL, interval)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(patience * 1000))
    sock.setsockopt(zmq.HEARTBEAT_TTL, min(6_553_500, max(int(patience * 1000), interval * 3 // 2)))


def tcp_keepalive(sock: zmq.Socket, idle_s: int = 60) -> None:
    """The kernel's keepalive on every connection ``sock`` makes: a peer whose machine went
    away is found by the operating system, at no cost to ZeroMQ's I/O thread (its
    heartbeats are timers there, one a connection)."""
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, idle_s)
    sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, 10)
    sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, 6)


def pair(kind: int) -> zmq.Socket:
    sock = context().socket(kind)
    sock.setsockopt(zmq.LINGER, LINGER_MS)
    return sock


def close(*socks: zmq.Socket | None) -> None:
    for sock in socks:
        if sock is not None and not sock.closed:
            with contextlib.suppress(zmq.ZMQError):
                sock.close(linger=LINGER_MS)


def bound_endpoint(sock: zmq.Socket) -> str:
    """The real endpoint after a bind (port 0 becomes the port the kernel chose)."""
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
    return endpoint.decode() if isinstance(endpoint, bytes) else str(endpoint)


def cut(frame: zmq.Frame, endpoint: str) -> bool:
    """Close the connection ``frame`` arrived on, if it is one this socket accepted at
    ``endpoint``: the peer sees its connection end (a ZeroMQ peer dials again by itself).

    ZeroMQ has no call that drops one peer of a ROUTER; its input queue cannot be bounded
    either (libzmq 4.3.5 aborts when a peer whose input was stopped by a high-water mark
    disconnects, see the broker's ``bind``). So a peer that floods is cut at the socket: the
    descriptor a message came from (``ZMQ_SRCFD``) is shut down, after checking that it is
    still a connection accepted at ``endpoint`` (a number reused by a file or another socket
    of this process is left alone). Returns whether a connection was shut down."""
    fd = frame.get(zmq.SRCFD)
    if not isinstance(fd, int) or fd < 0:
        return False  # inproc: there is no connection to cut
    try:
        conn = socket.socket(fileno=os.dup(fd))
    except OSError:
        return False
    try:
        if conn.type != socket.SOCK_STREAM or not _accepted_at(conn, endpoint):
            return False
        conn.shutdown(socket.SHUT_RDWR)
        return True
    except OSError:
        return False
    finally:
        conn.close()  # the duplicate only: libzmq closes its own when it sees the end


def _accepted_at(conn: socket.socket, endpoint: str) -> bool:
    try:
        here, there = conn.getsockname(), conn.getpeername()
    except OSError:
        return False  # a listening socket, or not a socket: never ours to cut
    if endpoint.startswith("ipc://"):
        return here == endpoint[len("ipc://") :] and conn.family == socket.AF_UNIX
    if not endpoint.startswith("tcp://") or not there:
        return False
    port = endpoint.rsplit(":", 1)[-1]
    return isinstance(here, tuple) and str(here[1]) == port


def tcp_url(address: str) -> str:
    """``"7000"``, ``"host:7000"`` or ``"tcp://host:7000"`` as a ZeroMQ URL (host defaults
    to 127.0.0.1)."""
    if "://" in address:
        return address
    if ":" not in address:
        return f"tcp://127.0.0.1:{address}"
    host, _, port = address.rpartition(":")
    return f"tcp://{host or '127.0.0.1'}:{port}"


def is_loopback(url: str) -> bool:
    """Whether binding ``url`` exposes it only to this machine."""
    if url.startswith(("inproc://", "ipc://")):
        return True
    host = url.split("://", 1)[-1].rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@contextlib.contextmanager
def translated(where: str) -> Iterator[None]:
    """Turn ZeroMQ's errors into somatize's, naming ``where``."""
    try:
        yield
    except zmq.ZMQError as exc:
        if exc.errno in (zmq.ENOTSOCK, zmq.ETERM):
            raise Closed(f"{where}: the connection was closed on this side") from exc
        if exc.errno == zmq.EHOSTUNREACH:
            raise Broken(f"{where}: the peer is no longer connected") from exc
        raise Broken(f"{where}: {exc}") from exc


class Poller(zmq.Poller):
    """A loop's poll that remembers whether it also waits for room to send (``waiting``), so
    a socket is registered anew only when that changes."""

    waiting = False


def poll(sock: zmq.Socket, timeout: float) -> bool:
    """Whether a message is waiting on ``sock`` within ``timeout`` seconds."""
    return bool(sock.poll(int(timeout * 1000), zmq.POLLIN))


class Alarm(threading.Event):
    """An ``Event`` a ``zmq.Poller`` can wait on: once set, its ``fileno`` is readable, so a
    loop that polls with long timeouts still stops at once, whichever thread (or signal
    handler) sets it. The descriptor pair is made at the first ``fileno`` (only a loop that
    polls pays for it) and closed by ``close``; a set after that is only an ``Event``'s."""

    def __init__(self) -> None:
        super().__init__()
        self._pair: tuple[socket.socket, socket.socket] | None = None
        self._made = threading.Lock()

    def fileno(self) -> int:
        pair = self._pair  # made already: every poll asks, so no lock for it
        if pair is not None:
            return pair[0].fileno()
        with self._made:
            if self._pair is None:
                self._pair = socket.socketpair()
                for end in self._pair:
                    end.setblocking(False)
                if self.is_set():
                    self._ring()
            return self._pair[0].fileno()

    def set(self) -> None:
        super().set()
        self._ring()

    def _ring(self) -> None:
        pair = self._pair
        if pair is not None:
            with contextlib.suppress(OSError):  # full (rung already) or closed: nothing to add
                pair[1].send(b"\0")

    def close(self) -> None:
        with self._made:
            pair, self._pair = self._pair, None
        if pair is not None:
            for end in pair:
                end.close()
