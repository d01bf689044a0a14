"""What a broker does off its serving thread: starting spawned workers, checking on one a
client says it lost (looking, never killing on a client's word: :func:`check`), writing the
bindings file.

Each of these can take seconds (``Child.start`` of a spawned host, a probe waiting for an
answer, a settle, an fsync), and the broker's one serving thread must never wait for them.
:class:`Helper` runs them on a few threads of its own, in order per *lane* (one lane per
host, so a start and a check of one host never overlap; one lane for the file), and hands
each result back to the serving thread: it queues ``(done, result)`` and wakes the loop
through an inproc socket, and the loop calls ``done(result)`` itself, where the view lives.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import zmq

from ...errors import ProtocolError
from ...wire import Hello, Ready, Runtime, decode, encode
from .. import sockets
from ..curve import HANDSHAKE_FAILED, Keys, as_client
from ..logs import Quiet
from .spawn import Child

log = logging.getLogger("somatize.broker")

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


@dataclass(frozen=True)
class Look:
    """What one probe of a worker found."""

    answer: Any = None  # what the worker said to Hello (a ``Ready`` when it serves), or None
    reached: bool = False  # its ZeroMQ completed the handshake: the process is there, its I/O runs
    refused: int = 0  # the monitor event of a handshake that failed (keys it does not accept)


def check(child: Child, deadline: float | None, runtime: Runtime, patience: float) -> str | None:
    """Look at a spawned worker a client says it lost (off the serving thread); return how
    it ended, or None when it is not stopped (well, or not reached: then left running).

    A client's word makes the broker look, never kill: the worker is stopped only on the
    broker's own evidence that it is stuck, which is one of: its process is stopped (its
    state, as the kernel says: SIGSTOP); its ZeroMQ took the probe's connection and the
    worker said nothing within the probe (its loop is stuck, in C code that holds the GIL,
    say); it said it has run one piece of work past ``deadline``. A probe that cannot reach
    the worker (its handshake fails or never completes, and the process runs) is said in the
    broker's log and kills nothing: a check that cannot see is no evidence.

    The probe speaks the worker's language: for a child that listens with keys, the key pair
    the broker made for its checks, which that child allows (:class:`~.spawn.Child`)."""
    child.settle(0.2)  # a child that was just killed may still be on its way out
    if not child.running:
        return child.ended()
    look = probe(child.address, runtime, min(PROBE, patience), keys=child.checker)
    answer = look.answer
    if answer is not None and (
        not isinstance(answer, Ready) or deadline is None or answer.busy_us <= deadline * 1_000_000
    ):
        return None  # it answered: alive (a refusal too: one whose sessions are full is busy, not stuck)
    child.settle(0.1)
    if not child.running:
        return child.ended()
    if isinstance(answer, Ready):
        why = (
            f"was still running one piece of work after {answer.busy_us / 1e6:.0f} s, "
            f"past its deadline of {deadline:g} s"
        )
    elif child.stopped:
        why = "stopped answering while still running: its process is stopped (SIGSTOP)"
    elif look.reached:
        why = (
            "stopped answering while still running: it took the broker's connection and said "
            f"nothing within {min(PROBE, patience):g} s"
        )
    else:
        more = _unreached.more()
        if more is not None:
            said = (
                "it refused the check's handshake (its allow folder does not hold the key the broker checks it with)"
                if look.refused
                else f"its handshake did not complete within {min(PROBE, patience):g} s"
            )
            log.warning(
                "a client said it lost `%s`; the broker could not check it at %s: %s. It is left "
                "running: a check that cannot reach a worker stops nothing%s",
                child.host,
                child.address,
                said,
                more,
            )
        return None
    child.kill()  # the next forward starts afresh
    return why


#: What the checks that could not reach a worker say in the log, bounded.
_unreached = Quiet("checks that could not reach a worker")


def probe(address: str, runtime: Runtime, timeout: float, *, keys: Keys | None = None) -> Look:
    """Say Hello to a worker on a socket of its own, with ``keys`` when it listens with
    CURVE (their ``server_key`` its public key); what came of it within ``timeout``."""
    reached, refused = False, 0
    sock = sockets.dealer(timeout)
    monitor = None
    try:
        if keys is not None:
            as_client(sock, keys, None)
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | HANDSHAKE_FAILED)
        sock.connect(address)
        sock.send_multipart(encode(Hello(runtime)))
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        until = time.monotonic() + timeout
        while (left := until - time.monotonic()) > 0:
            ready = dict(poller.poll(max(1, int(left * 1000))))
            if sock in ready:
                return Look(decode(sock.recv_multipart(copy=False)), True)
            while sockets.readable(monitor):
                event = int.from_bytes(monitor.recv_multipart()[0][:2], "little")
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    reached = True
                elif event & HANDSHAKE_FAILED:
                    refused = event
            if refused and not reached:
                break  # ZeroMQ would try again and again: the first refusal says it
        return Look(None, reached, refused)
    except (zmq.ZMQError, ProtocolError):
        return Look(None, reached, refused)
    finally:
        if monitor is not None:
            with contextlib.suppress(zmq.ZMQError):
                sock.disable_monitor()
        sockets.close(monitor, sock)
