"""A peer speaking the wire by hand, for the tests that play an attacker or a slow client."""

from __future__ import annotations

import zmq

from somatize.wire import decode, encode


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
