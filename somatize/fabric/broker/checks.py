"""What a broker does off its serving thread: starting spawned workers, checking on one a
client says it lost, writing the bindings file.

Each of these can take seconds (``Child.start`` of a spawned host, a probe waiting for an
answer, a settle, an fsync), and the broker's one serving thread must never wait for them.
:class:`Helper` runs them on a few threads of its own, in order per *lane* (one lane per
host, so a start and a check of one host never overlap; one lane for the file), and hands
each result back to the serving thread: it queues ``(done, result)`` and wakes the loop
through an inproc socket, and the loop calls ``done(result)`` itself, where the view lives.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import zmq

from ...errors import ProtocolError
from ...wire import Hello, Ready, Runtime, decode, encode
from .. import sockets
from .spawn import Child

#: The longest a broker waits for a spawned worker to answer a probe (seconds).
PROBE = 2.0


class Helper:
    """Jobs off the serving thread; see the module's docstring."""

    def __init__(self, threads: int = 4) -> None:
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="somatize-broker-helper")
        self._lanes: dict[str, deque] = {}
        self._lock = threading.Lock()
        self._results: queue.SimpleQueue = queue.SimpleQueue()
        self.endpoint = sockets.unique_inproc("broker-helper")
        self.wake = sockets.pair(zmq.PULL)  # the serving thread polls it
        self.wake.bind(self.endpoint)
        self._bell = sockets.pair(zmq.PUSH)
        self._bell.connect(self.endpoint)
        self._bell_lock = threading.Lock()
        self.closed = False

    def busy(self, lane: str) -> bool:
        with self._lock:
            return lane in self._lanes

    def submit(self, lane: str, job: Callable[[], Any], done: Callable[[Any], None]) -> None:
        """Run ``job()`` after the jobs already in ``lane``; ``done(result)`` is called on
        the serving thread (by :meth:`deliver`). A job that raises hands back the exception."""
        with self._lock:
            if self.closed:
                return
            waiting = self._lanes.get(lane)
            if waiting is not None:
                waiting.append((job, done))
                return
            self._lanes[lane] = deque([(job, done)])
        self._pool.submit(self._run, lane)

    def _run(self, lane: str) -> None:
        while True:
            with self._lock:
                waiting = self._lanes.get(lane)
                if not waiting:
                    self._lanes.pop(lane, None)
                    return
                job, done = waiting[0]
            try:
                result = job()
            except Exception as exc:  # handed back: the serving thread says what went wrong
                result = exc
            with self._lock:
                waiting.popleft()
            self._results.put((done, result))
            with self._bell_lock:
                if not self._bell.closed:
                    try:
                        self._bell.send(b"", zmq.NOBLOCK)
                    except zmq.ZMQError:
                        pass  # the loop is woken by its poll timeout anyway

    def deliver(self) -> None:
        """On the serving thread: call ``done(result)`` for every job that finished."""
        while sockets.readable(self.wake):
            self.wake.recv(zmq.NOBLOCK)
        while True:
            try:
                done, result = self._results.get_nowait()
            except queue.Empty:
                return
            done(result)

    def close(self, wait: float = 5.0) -> None:
        with self._lock:
            self.closed = True
            for waiting in self._lanes.values():
                while len(waiting) > 1:
                    waiting.pop()  # what has not started never will
        self._pool.shutdown(wait=False, cancel_futures=True)
        until = time.monotonic() + wait  # a start under way ends before its child is stopped
        while time.monotonic() < until:
            with self._lock:
                if not self._lanes:
                    break
            time.sleep(0.02)
        with self._bell_lock:
            sockets.close(self._bell)
        sockets.close(self.wake)


def check(child: Child, deadline: float | None, runtime: Runtime, patience: float) -> str | None:
    """Probe a spawned worker a client says it lost (off the serving thread). Kill it only
    if it is gone, does not answer, or has run one piece of work past its host's deadline;
    return how it ended, or None when it is well (the client's trouble was elsewhere)."""
    child.settle(0.2)  # a child that was just killed may still be on its way out
    if not child.running:
        return child.ended()
    answer = probe(child.address, runtime, min(PROBE, patience))
    if isinstance(answer, Ready) and (deadline is None or answer.busy_us <= deadline * 1_000_000):
        return None
    child.settle(0.1)
    if not child.running:
        return child.ended()
    why = (
        "stopped answering while still running" if not isinstance(answer, Ready)
        else f"was still running one piece of work after {answer.busy_us / 1e6:.0f} s, past its deadline of {deadline:g} s"
    )
    child.kill()  # the next forward starts afresh
    return why


def probe(address: str, runtime: Runtime, timeout: float) -> Any:
    """Say Hello to a worker on a socket of its own; its answer, or None within ``timeout``."""
    sock = sockets.dealer(timeout)
    try:
        sock.connect(address)
        sock.send_multipart(encode(Hello(runtime)))
        if not sockets.poll(sock, timeout):
            return None
        return decode(sock.recv_multipart(copy=False))
    except (zmq.ZMQError, ProtocolError):
        return None
    finally:
        sockets.close(sock)
