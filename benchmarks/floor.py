"""The floor: raw pyzmq, DEALER -> ROUTER, with an echo server in another process.

``python benchmarks/floor.py`` binds a ROUTER on a Unix socket in a fresh folder (``ipc://``,
the transport a spawned worker listens on, so the floor and the path measured against it
cross the same kind of socket), prints ``floor ready ipc://...`` and sends every message
back to whoever sent it, frames untouched (received and sent with ``copy=False``: libzmq's
buffers are handed back, never copied by Python) until SIGTERM, or until its parent goes
away. ``python benchmarks/floor.py tcp`` binds on a loopback port instead (the kernel picks
it): on the tables' machine a small round trip costs about a quarter more over TCP than
over a Unix socket, so a floor over TCP would flatter whatever runs over ``ipc://``.

The client side is :class:`Floor`: what somatize is measured against, with no header to
encode, no codec, no engine; the least any message over ZeroMQ between two processes costs.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile

import numpy as np
import zmq

ANNOUNCE = "floor ready "


class Floor:
    """A DEALER connected to the echo server: one round trip per call."""

    def __init__(self, endpoint: str) -> None:
        self.context = zmq.Context()
        self.sock = self.context.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.server_pid = 0  # the echo server's, when it is known

    def small(self, payload: bytes) -> bytes:
        """A round trip of a small message, copied (the fast way for small frames)."""
        self.sock.send(payload)
        return self.sock.recv()

    def array(self, x: np.ndarray) -> np.ndarray:
        """A round trip of an array's bytes, zero-copy both ways; the answer as an array
        over libzmq's buffer, as a reader of the answer would want it."""
        self.sock.send(memoryview(x).cast("B"), copy=False)
        frame = self.sock.recv(copy=False)
        return np.frombuffer(frame.buffer, dtype=x.dtype)

    def close(self) -> None:
        self.sock.close(linger=0)
        self.context.term()


def serve(transport: str = "ipc") -> int:
    if transport not in ("ipc", "tcp"):
        raise SystemExit(f"floor.py takes ipc (the default) or tcp; got {transport!r}")
    folder = tempfile.mkdtemp(prefix="somatize-floor-") if transport == "ipc" else None
    context = zmq.Context()
    sock = context.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 200)  # a blocking receive, woken now and then to look around
    sock.bind(f"ipc://{folder}/floor.sock" if folder else "tcp://127.0.0.1:0")
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    parent = os.getppid()
    print(ANNOUNCE + sock.getsockopt_string(zmq.LAST_ENDPOINT), flush=True)
    try:
        while not stopping:
            try:
                frames = sock.recv_multipart(copy=False)
            except zmq.Again:
                if os.getppid() != parent:
                    break  # whoever started us is gone
                continue
            sock.send_multipart(frames, copy=False)
    finally:
        sock.close(linger=0)
        context.term()
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(serve(*sys.argv[1:2]))
