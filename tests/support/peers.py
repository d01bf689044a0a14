"""Peers speaking the wire by hand, for the tests that play an attacker, a slow client or a
worker that answers what it likes."""

from __future__ import annotations

import contextlib
import socket
import threading

import zmq

from somatize.wire import Hello, Provision, Ready, Runtime, Work, decode, encode

RT = Runtime.here(mode="project")


class Raw:
    """One DEALER (one route) speaking the wire by hand. ``keys``: (public, secret, the
    server's public key) for CURVE; ``hwm``: its send high-water mark (0: unbounded)."""

    def __init__(self, endpoint: str, keys=None, *, hwm: int | None = None) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.linger = 0
        if hwm is not None:
            self.sock.sndhwm = hwm
        if keys is not None:
            self.sock.curve_publickey, self.sock.curve_secretkey, self.sock.curve_serverkey = keys
        self.sock.connect(endpoint)

    def send(self, message) -> None:
        self.sock.send_multipart(encode(message))

    def send_frames(self, frames) -> None:
        self.sock.send_multipart(list(frames))

    def answer(self, timeout: float = 15.0):
        """The next message, decoded, or None within ``timeout`` seconds."""
        if not self.sock.poll(int(timeout * 1000)):
            return None
        return decode(self.sock.recv_multipart(copy=False))

    def ask(self, message, timeout: float = 15.0):
        self.send(message)
        return self.answer(timeout)

    def close(self) -> None:
        self.sock.close(0)


#: An answer a played worker gives by closing its socket then and there, mid-call.
HANG_UP = object()


class FakeWorker:
    """A worker played by a ROUTER on a thread. To every Work, what ``answer(work)`` returns:
    a message, a list of frames written by hand, a tuple of those (sent one after the other),
    or ``HANG_UP``. To the n-th Hello, ``greet(hello, n)`` (``Ready(runtime)`` by default); to
    a ``Provision``, ``Ready`` (a network-mode worker taking code); anything else a client sends
    (a ``Credit``, a ``Bye``) is read and not answered. It keeps the Works, Hellos and
    provisioned digests it received; an answer the test wrote wrongly is kept in ``errors``
    and the worker serves on."""

    def __init__(self, answer, *, greet=None, runtime: Runtime = RT) -> None:
        self.answer, self.greet, self.runtime = answer, greet, runtime
        self.works: list[Work] = []
        self.hellos: list[Hello] = []
        self.provisions: list[str] = []
        self.errors: list[BaseException] = []
        self.hung_up = threading.Event()
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.linger = 0
        self.sock.bind("tcp://127.0.0.1:0")
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(50):
                continue
            route, *frames = self.sock.recv_multipart()
            try:
                message = decode(frames)
                if isinstance(message, Hello):
                    self.hellos.append(message)
                    replies = Ready(self.runtime) if self.greet is None else self.greet(message, len(self.hellos))
                elif isinstance(message, Provision):
                    self.provisions.append(message.digest)
                    replies = Ready(self.runtime)
                elif isinstance(message, Work):
                    self.works.append(message)
                    replies = self.answer(message)
                else:
                    continue
                for reply in replies if isinstance(replies, tuple) else (replies,):
                    if reply is HANG_UP:
                        self.sock.close(0)
                        self.hung_up.set()
                        return
                    self.sock.send_multipart([route, *(reply if isinstance(reply, list) else encode(reply))])
            except Exception as exc:  # noqa: BLE001 - the test's own mistake: said after it
                self.errors.append(exc)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close(0)


def within(seconds: float, call):
    """``call()`` on a thread of its own, which has to end within ``seconds``: a call that
    would hang fails the test instead."""
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:  # noqa: BLE001 - raised again on the test's thread
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"the call still waited after {seconds} s"
    if "error" in box:
        raise box["error"]
    return box["value"]


@contextlib.contextmanager
def socket_peer(serve):
    """A loopback TCP port, not ZeroMQ, whose every connection is handed to
    ``serve(conn, stop)`` on a thread of its own and closed after; yields (the port, a list
    with one item per connection accepted). ``serve`` returning at once hangs up."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    server.settimeout(0.05)
    stop = threading.Event()
    accepted: list[int] = []
    serving: list[threading.Thread] = []

    def each(conn) -> None:
        try:
            serve(conn, stop)
        except OSError:
            pass
        finally:
            conn.close()

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            accepted.append(1)
            thread = threading.Thread(target=each, args=(conn,), daemon=True)
            thread.start()
            serving.append(thread)

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1], accepted
    finally:
        stop.set()
        thread.join(5)
        for each_thread in serving:
            each_thread.join(5)
        server.close()


def curve_router() -> zmq.Socket:
    """A ROUTER that listens with a fresh CURVE key pair (not bound yet; linger 0)."""
    public, secret = zmq.curve_keypair()
    server = zmq.Context.instance().socket(zmq.ROUTER)
    server.linger = 0
    server.curve_server, server.curve_secretkey, server.curve_publickey = True, secret, public
    return server
