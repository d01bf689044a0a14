"""The worker: one socket, answering Hello, Provision and Work, and never giving up.

A worker holds no state anyone cares about and knows nothing of graphs. It answers on a
ROUTER it listens on (Direct and Mount) or on a DEALER it dialed to a broker (Relayed).
Work runs on a small thread pool; facts go back as ``Saw`` the moment they happen, then
exactly one ``Done`` or ``Failed``. Anything malformed is answered ``Refused`` and the
loop goes on serving.

Only the serving thread touches the front socket. Answers and facts, from whatever thread
(a job on the pool, a parallel branch of a piece), go into one first-in-first-out outbox,
so a piece's facts always leave before its ``Done``; a thread other than the serving one
wakes the loop through an inproc socket of its own.
"""

from __future__ import annotations

import os
import queue
import socket
import sys
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import zmq

from ..engine import Piece, format_exception, run_piece
from ..errors import CodecError, NodeFailed, ProtocolError, Refused as RefusedError, SomatizeError
from ..facts import fact, microseconds
from ..graph import Step
from ..packing import Catalog
from ..record import report, self_report
from ..store import FolderStore
from ..wire import (
    Bye,
    Done,
    Failed,
    Hello,
    Provision,
    Ready,
    Refused,
    Runtime,
    Saw,
    Send,
    Work,
    compatible,
    decode,
    encode,
)
from . import mount as _mount
from . import sockets
from .curve import Guard, Keys, as_client, as_server
from . import stream as _stream

#: Frames that mark a message relayed by a broker: [RELAY, client route, *frames].
RELAY = b"\x00somatize-relay"
_MAX_PEERS = 10_000
_MAX_STREAMS = 8  # relayed messages being received at once


class Server:
    """A worker's serving loop. ``bind()`` or ``dial()`` first, then ``serve()``."""

    def __init__(
        self,
        *,
        mode: str = "project",
        mount: str | None = None,
        jobs: int = 1,
        patience: float = sockets.PATIENCE,
        parent: int | None = None,
        store: str | None = None,
        reporting: float | None = None,
        machine: str | None = None,
    ) -> None:
        self.catalog = Catalog(mode)
        self.mode = mode
        self.mount = mount
        self.patience = patience
        self.parent = parent
        self.runtime = Runtime.here(mode=mode)
        self.served = 0
        self.dropped = 0
        # what the worker says about itself: into a store on a clock (an idle worker's
        # connection is one nobody reads), and down an open connection as a `said` fact
        self.reporting = reporting
        self.store = FolderStore(store) if store is not None else None
        self.machine = machine or socket.gethostname()
        self._said_at = 0.0
        self._inline = jobs == 1
        self._jobs = ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="somatize-job")
        self._answers_url = sockets.unique_inproc("answers")
        self._answers = sockets.pair(zmq.PULL)
        self._answers.bind(self._answers_url)
        self._pushes: list[zmq.Socket] = []
        self._local = threading.local()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._owner = threading.get_ident()
        self._peers: OrderedDict[bytes, Runtime] = OrderedDict()
        self._front: zmq.Socket | None = None
        self._guard: Guard | None = None
        self._offer: str | None = None
        self._incoming: dict[bytes, _stream.Incoming] = {}
        self._outgoing: dict[bytes, tuple[list, _stream.Outgoing]] = {}
        self.stopping = threading.Event()

    # -- the front socket --------------------------------------------------------------
    def bind(self, url: str, *, keys: Keys | None = None) -> str:
        """Listen on ``url``; return the real endpoint (a port 0 becomes the chosen one).
        With ``keys`` only clients whose public key is in ``keys.allow`` get through."""
        self._front = sockets.router()
        if keys is not None:
            self._guard = Guard(sockets.context(), keys)
            as_server(self._front, keys)
        self._front.bind(url)
        return sockets.bound_endpoint(self._front)

    def dial(self, broker: str, offer: str, *, keys: Keys | None = None) -> None:
        """Connect to a broker and offer to serve the host called ``offer`` (Relayed).
        With ``keys``, ``keys.server_key`` is the broker's public key."""
        self._front = sockets.dealer(self.patience)
        if keys is not None:
            as_client(self._front, keys, None)
        self._front.connect(broker)
        self._offer = offer
        self._announce()

    def _announce(self) -> None:
        self._front.send_multipart(encode(Hello(self.runtime, offering=self._offer)))

    # -- the loop ----------------------------------------------------------------------
    def serve(self) -> None:
        self._owner = threading.get_ident()
        poller = zmq.Poller()
        poller.register(self._front, zmq.POLLIN)
        poller.register(self._answers, zmq.POLLIN)
        last_check = last_announce = time.monotonic()
        last_report = 0.0
        try:
            while not self.stopping.is_set():
                events = dict(poller.poll(200))
                if self._answers in events:
                    self._forward_answers()
                if self._front in events:
                    self._receive()
                now = time.monotonic()
                if now - last_check >= 1.0:
                    last_check = now
                    self._expire_streams(now)
                    if self.parent is not None and os.getppid() != self.parent:
                        break  # whoever spawned us is gone: nobody will ever ask again
                if self.store is not None and self.reporting and now - last_report >= self.reporting:
                    last_report = now
                    self._report()
                if self._offer is not None and now - last_announce >= self.patience:
                    last_announce = now
                    self._announce()  # a restarted broker learns about us again
        finally:
            self.close()

    def _report(self) -> None:
        try:
            report(self.store, self.machine, self_report(self.served))
        except (OSError, SomatizeError) as exc:  # a full disk must not stop the serving
            print(f"somatize worker: could not report to the store: {exc}", file=sys.stderr)

    def _said(self) -> dict[str, str] | None:
        """A `said` fact for the connection, at most once per reporting period."""
        if not self.reporting:
            return None
        now = time.monotonic()
        if now - self._said_at < self.reporting:
            return None
        self._said_at = now
        return fact("said", **self_report(self.served))

    def reload(self) -> None:
        """Read the allow-list of client keys again (a key removed is refused from now on)."""
        if self._guard is not None:
            self._guard.reload()

    def close(self) -> None:
        self.stopping.set()
        if self._guard is not None:
            self._guard.close()
            self._guard = None
        if self._offer is not None and self._front is not None and not self._front.closed:
            try:
                self._front.send_multipart(encode(Bye()), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        self._jobs.shutdown(wait=True, cancel_futures=True)
        sockets.close(self._front, self._answers, *self._pushes)

    def _forward_answers(self) -> None:
        while self._answers.get(zmq.EVENTS) & zmq.POLLIN:
            self._answers.recv()  # a wake-up: what to send is in the outbox
        self._flush()

    def _post(self, parts: list) -> None:
        """Queue an answer from any thread; the serving thread sends it in order."""
        self._outbox.put(parts)
        if threading.get_ident() == self._owner:
            self._flush()
        else:
            self._push().send(b"")

    def _flush(self) -> None:
        while True:
            try:
                parts = self._outbox.get_nowait()
            except queue.Empty:
                return
            self._deliver(parts)

    def _deliver(self, parts: list) -> None:
        """Send an answer (route + frames) to its client; on a relayed route a big one
        goes as a stream under the client's credit."""
        width = 1 if self._offer is None else 2
        route, frames = parts[:width], parts[width:]
        if self._offer is not None and _stream.worth_streaming(frames):
            out = _stream.Outgoing(_stream.new_id(), frames)
            self._outgoing[_key(route) + b"#" + out.sid] = (route, out)
            self._send(route + out.begin())
            self._drain(route, out)
            return
        self._send(parts)

    def _send(self, parts: list) -> None:
        # never blocks: a peer that stops reading must not stall everyone else's answers
        try:
            self._front.send_multipart(parts, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self._dropped("its client is not reading its answers (its queue is full)")
        except zmq.ZMQError as exc:  # ROUTER_MANDATORY: the client is gone; say so, never silently
            self._dropped(f"its client is gone ({exc})")

    def _dropped(self, why: str) -> None:
        self.dropped += 1
        if self.dropped == 1 or self.dropped % 1000 == 0:
            print(f"somatize worker: an answer could not be delivered: {why} "
                  f"({self.dropped} so far)", file=sys.stderr)

    def _expire_streams(self, now: float) -> None:
        """Streams nobody has moved for a while belong to clients that went away."""
        idle = 3 * self.patience
        for table in (self._incoming, self._outgoing):
            for key in [k for k, v in table.items() if now - _touched(v) > idle]:
                del table[key]

    def _drain(self, route: list, out: _stream.Outgoing) -> None:
        for chunk in out.chunks():
            self._send(route + chunk)
        if out.finished:
            self._outgoing.pop(_key(route) + b"#" + out.sid, None)

    def _stream_in(self, route: list, frames: list) -> None:
        key = b""
        try:
            kind, sid, payload = _stream.parse(frames)
            key = _key(route) + b"#" + sid
            if kind == _stream.CREDIT:
                pending = self._outgoing.get(key)
                if pending is not None:
                    pending[1].grant(payload)  # type: ignore[arg-type]
                    self._drain(*pending)
                return
            if kind == _stream.BEGIN:
                if len(self._incoming) >= _MAX_STREAMS:
                    raise ProtocolError("this worker is already receiving as many relayed messages as it takes; try again")
                self._incoming[key] = _stream.Incoming(sid, payload)  # type: ignore[arg-type]
                return
            incoming = self._incoming.get(key)
            if incoming is None:
                raise ProtocolError("a stream chunk arrived for a stream that never began")
            self._send(route + _stream.credit(sid, incoming.add(payload)))  # type: ignore[arg-type]
        except ProtocolError as exc:
            self._incoming.pop(key, None)  # what came of it so far is dropped, never guessed at
            self._reply(route, Refused(exc.why))
            return
        if incoming.complete:
            del self._incoming[key]
            self._handle(route, incoming.frames)

    def _receive(self) -> None:
        for _ in range(64):  # bounded, so answers keep flowing under a flood of requests
            if not self._front.get(zmq.EVENTS) & zmq.POLLIN:
                return
            parts = self._front.recv_multipart(copy=False)
            route, frames = self._split(parts)
            if route is None:
                continue
            if frames and _head(frames[0]) == _stream.MARK:
                self._stream_in(route, frames)
                continue
            self._handle(route, frames)

    def _split(self, parts: list) -> tuple[list | None, list]:
        if self._offer is None:  # ROUTER: [identity, *frames]
            return [parts[0]], parts[1:]
        if len(parts) >= 2 and parts[0].bytes == RELAY:  # relayed by the broker
            return [RELAY, parts[1]], parts[2:]
        # the broker speaking to us directly: Ready to our Hello, or Refused
        try:
            message = decode(parts)
        except ProtocolError:
            return None, []
        if isinstance(message, Refused):
            print(f"somatize worker: the broker refused this worker: {message.why}", file=sys.stderr)
            self.stopping.set()
        return None, []

    def _reply(self, route: list, message: Any) -> None:
        self._send(route + encode(message))

    # -- requests ----------------------------------------------------------------------
    def _handle(self, route: list, frames: list) -> None:
        made: list = []
        try:
            if frames and _head(frames[0]) == _mount.MARK:
                if self.mount is None:
                    raise ProtocolError("this worker sees no shared directory; start it with --mount DIR")
                frames, made = _mount.read(frames, self.mount)
            message = decode(frames)
        except ProtocolError as exc:
            self._reply(route, Refused(exc.why))
            return
        peer = _key(route)
        if isinstance(message, Hello):
            self._hello(route, peer, message)
        elif isinstance(message, Bye):
            self._peers.pop(peer, None)
        elif peer not in self._peers:
            self._reply(route, Refused("say Hello first: this worker has not heard from you"))
        elif isinstance(message, Provision):
            self._provision(route, peer, message)
        elif isinstance(message, Work):
            self._work(route, message, mounted=bool(made))
        else:
            self._reply(route, Refused(f"a worker does not answer a `{type(message).__name__}`"))

    def _hello(self, route: list, peer: bytes, message: Hello) -> None:
        why = compatible(self.runtime, message.runtime, needs_pickle=False)
        if why is not None:
            self._reply(route, Refused(why))
            return
        self._peers[peer] = message.runtime
        self._peers.move_to_end(peer)
        while len(self._peers) > _MAX_PEERS:
            self._peers.popitem(last=False)
        self._reply(route, Ready(self.runtime))

    def _provision(self, route: list, peer: bytes, message: Provision) -> None:
        if self.mode == "network":
            why = compatible(self.runtime, self._peers[peer], needs_pickle=True)
            if why is not None:
                self._reply(route, Refused(why))
                return
        try:
            self.catalog.provision(message.digest, message.artifact)
        except RefusedError as exc:
            self._reply(route, Refused(str(exc)))
            return
        self._reply(route, Ready(self.runtime))

    def _work(self, route: list, work: Work, *, mounted: bool) -> None:
        try:
            missing = self.catalog.missing(work.recipe.nodes)
        except RefusedError as exc:
            self._reply(route, Refused(str(exc), ref=work.ref))
            return
        if missing:
            self._reply(route, Send(work.ref, tuple(missing)))
            return
        self.served += 1
        if self._inline:
            # one piece of work at a time, on this thread: no hop there and back. Requests
            # wait in the socket meanwhile; the connection itself stays alive (libzmq's own
            # thread answers heartbeats), so a client sees a busy worker, not a dead one.
            self._run(route, work, mounted)
        else:
            self._jobs.submit(self._run, route, work, mounted)

    # -- a job, on a pool thread -------------------------------------------------------
    def _push(self) -> zmq.Socket:
        push = getattr(self._local, "push", None)
        if push is None:
            push = sockets.pair(zmq.PUSH)
            push.connect(self._answers_url)
            self._local.push = push
            self._pushes.append(push)
        return push

    def _run(self, route: list, work: Work, mounted: bool) -> None:
        def watch(fact: dict[str, str]) -> None:  # from any thread of the piece
            fact = {k: _clip(v, 16 << 10) for k, v in fact.items()}
            self._post(route + encode(Saw(work.ref, fact)))

        if not work.watched:
            watch = None  # nobody on the other side looks: send no facts at all

        said = self._said()
        if said is not None and watch is not None:
            watch(said)
        started = time.perf_counter_ns()
        answer: Any
        try:
            steps = tuple(
                Step(
                    self.catalog.build(spec),
                    name=spec.label,
                    cache=spec.cache,
                    device=work.placement.get(index),
                )
                for index, spec in enumerate(work.recipe.nodes)
            )
            outcome = run_piece(Piece("", steps, work.recipe.shape, work.input, dict(work.keys)), watch)
            answer = Done(work.ref, outcome.output, outcome.produced, microseconds(time.perf_counter_ns() - started))
        except NodeFailed as exc:
            cause = exc.__cause__ or exc
            answer = Failed(
                work.ref,
                why=_clip(f"{type(cause).__name__}: {cause}", 64 << 10),
                node=exc.node,
                error=exc.error,
                traceback=_clip(format_exception(cause), 512 << 10),
            )
        except RefusedError as exc:
            answer = Refused(str(exc), ref=work.ref)
        except Exception as exc:  # the worker's own trouble: still an answer, never a hang
            answer = Failed(
                work.ref,
                why=_clip(f"{type(exc).__name__}: {exc}", 64 << 10),
                node=None,
                error=type(exc).__name__,
                traceback=_clip(format_exception(exc), 512 << 10),
            )
        try:
            frames = encode(answer)
        except (CodecError, ValueError) as exc:  # unwritable, or over a wire limit
            frames = encode(
                Failed(
                    work.ref,
                    why=_clip(f"what this work produced cannot travel back: {exc}", 64 << 10),
                    node=None,
                    error=type(exc).__name__,
                    traceback="",
                )
            )
        if mounted and self.mount is not None and len(frames) > 1:
            frames, _ = _mount.write(frames, self.mount)  # the client removes them once read
        self._post(route + frames)


def _key(route: list) -> bytes:
    return b"/".join(part if isinstance(part, bytes) else part.bytes for part in route)



def _clip(text: str, limit: int) -> str:
    """Texts that cross the wire are bounded; a user's huge message is cut, not refused."""
    return text if len(text) <= limit else text[: limit - 20] + " ... (cut)"


def _head(frame: object) -> bytes:
    """The first bytes of a frame, enough to tell a mark (zmq frames and bytearrays alike)."""
    view = memoryview(frame.buffer if hasattr(frame, "buffer") else frame)  # type: ignore[union-attr, arg-type]
    return bytes(view) if view.nbytes <= 32 else b""


def _touched(entry: object) -> float:
    stream = entry[1] if isinstance(entry, tuple) else entry
    return stream.touched  # type: ignore[union-attr]
