"""Peers speaking the wire by hand, for the tests that play an attacker, a slow client or a
worker that answers what it likes."""

from __future__ import annotations

import threading

import zmq

from somatize.wire import Hello, Ready, Runtime, Work, decode, encode

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


class FakeWorker:
    """A worker played by a ROUTER on a thread: Ready to every Hello, and to every Work what
    ``answer(work)`` returns (a message, a list of frames written by hand, or a tuple of
    those, sent one after the other); it counts the Works it received."""

    def __init__(self, answer) -> None:
        self.answer = answer
        self.works: list[Work] = []
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
            message = decode(frames)
            if isinstance(message, Hello):
                self.sock.send_multipart([route, *encode(Ready(RT))])
            elif isinstance(message, Work):
                self.works.append(message)
                replies = self.answer(message)
                for reply in replies if isinstance(replies, tuple) else (replies,):
                    self.sock.send_multipart([route, *(reply if isinstance(reply, list) else encode(reply))])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close(0)
