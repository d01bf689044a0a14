"""The worker's serving loop: one socket, answering Hello, Provision and Work, never giving up.

A worker holds no state anyone cares about and knows nothing of graphs. It answers on a
ROUTER it listens on (Direct and Mount) or on a DEALER it dialed to a broker (Relayed).
Facts go back as ``Saw`` the moment they happen, then exactly one ``Done`` or ``Failed``.
Anything malformed or out of turn is answered ``Refusal`` and the loop goes on serving.

Who says what, when, is :class:`~somatize.fabric.conversation.WorkerSessions`'s: every
message is checked there before anything acts on it, and every answer before it leaves.
A peer is a client's route (Direct, Mount) or ``b"relay:%d" % exchange`` for an exchange a
broker relays. Only ``Hello`` and ``Bye`` are decoded from a peer that has not said
``Hello``: for anything else its header's variant is read (``wire.variant_of``) and the
message refused unopened. The carriers are opened here: ``Relay`` (what a broker passes
on), ``Begin``/``Chunk``/``Credit`` (a big message streamed through a broker, with
per-tenant quotas and a lifetime, :mod:`.streams`) and ``Mounted`` (cargo in a shared
folder, :mod:`.mount`).

What it survives, and how:

- its nodes: a node that hangs leaves the worker answering: a ``Hello`` (a probe) gets
  ``Ready`` saying how long the oldest work has run (``busy_us``), new work past the
  ``jobs`` slots a ``Refusal`` that starts with ``busy:`` (and a ``said`` fact, when the work
  is watched). Whatever a node raises, ``SystemExit`` and ``KeyboardInterrupt`` included,
  becomes a ``Failed`` naming it.
- its broker: a dialed worker says ``Hello`` again whenever its connection comes back and,
  told ``Refusal`` (a restarted broker that does not know it or its late answer, a name
  bound to another key), again after a backoff capped at ``MAX_BACKOFF``. It exits only
  on a signal.
- its client, for a spawned worker (``parent``): a thread of its own checks the parent, so a
  node stuck forever does not keep an orphan alive; if the serving thread does not close
  within a short grace, the process ends with ``os._exit``.

Where work runs. With ``jobs=1`` (the default) a piece runs on the thread that received it:
no hop to another thread and back, which would cost more than the rest of a small call.
That thread lets go of the socket while the piece runs, and a stand-in thread takes it
once the piece has run ``STAND_IN_AFTER`` seconds, serving (probes answered, new work
refused as busy) until the piece returns and the socket is handed back. With ``jobs=N``
every piece runs on one of N slot threads, and the serving thread never lets go.

Only the thread holding the socket (``_hold``) touches it, the sessions and the streams.
Answers and facts, from whatever thread (a job, a parallel branch of a piece), go into one
first-in-first-out outbox, so a piece's facts always leave before its ``Done``; the holder
sends them, woken through an inproc socket when it is polling, and whoever takes the socket
sends what waits there first.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import queue
import socket
import sys
import threading
import time
from typing import Any, NamedTuple

import zmq

from ..engine import format_exception, run_piece
from ..errors import CodecError, NodeFailed, ProtocolError, Refused, SomatizeError
from ..facts import fact, microseconds
from ..graph import Node
from ..packing import Catalog
from ..record import report, self_report
from ..store import FolderStore
from ..wire import (
    Begin,
    Bye,
    Chunk,
    Credit,
    Failed,
    Hello,
    Mounted,
    Provision,
    Ready,
    Refusal,
    Relay,
    Runtime,
    Saw,
    Send,
    Work,
    compatible,
    decode,
    encode,
    variant_of,
)
from . import leases as _leases
from . import mount as _mount
from . import sockets
from . import streams as _streams
from .conversation import Unheld, Unknown, Violation, WorkerSessions
from .curve import HANDSHAKE_FAILED as _HANDSHAKE_FAILED
from .curve import Guard, Keys, as_client, as_server, peer_name, user_of
from .heap import Heap
from .imported import Imports
from .pieces import done_of, piece_of

#: The longest a dialed worker waits before saying Hello again to a broker that refused it.
MAX_BACKOFF = 30.0
#: How often a spawned worker checks that whoever spawned it is still there (seconds).
PARENT_CHECK = 0.5
#: How long a piece runs on the serving thread before a stand-in serves meanwhile (seconds).
STAND_IN_AFTER = 0.02
_CARRIERS = (Relay, Mounted, Begin, Chunk, Credit)
log = logging.getLogger("somatize.worker")
#: Refusals logged per `_QUIET` seconds at most; past it they are counted, and the count said.
_LOUD, _QUIET = 20, 10.0


class NodeExit(Exception):
    """A node raised what is not an ``Exception`` (``SystemExit``, ``KeyboardInterrupt``,
    ``GeneratorExit``): carried as an ordinary error, so it fails the work, not the worker."""

    def __init__(self, raised: BaseException) -> None:
        super().__init__(f"{type(raised).__name__}: {raised}".rstrip(": "))
        self.raised = raised


class _To(NamedTuple):
    """Who an answer goes to: a client's route (Direct), or an exchange a broker relays."""

    peer: bytes  # the sessions' name for it
    tenant: str = ""  # who the client is, for quotas ("" on a direct route: one per route)
    route: bytes = b""  # Direct: the ROUTER identity
    exchange: int = 0  # Relayed: the broker's number for the exchange


class WorkerLoop:
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
        exit_when_stuck: bool = False,
    ) -> None:
        self.catalog = Catalog(mode)
        self.mode = mode
        self.mount = mount
        self.patience = patience
        self.parent = parent
        self.runtime = Runtime.here(mode=mode)
        self.sessions = WorkerSessions(self.runtime)
        self.served = 0
        self.dropped = 0  # answers that could not be delivered
        self.withheld = 0  # answers the conversation did not allow (to an exchange not open)
        # what the worker says about itself: into a store on a clock (an idle worker's
        # connection is one nobody reads), and down an open connection as a `said` fact
        self.reporting = reporting
        self.store = FolderStore(store) if store is not None else None
        self.machine = machine or socket.gethostname()
        self._said_at = 0.0
        self.jobs = max(1, int(jobs))
        # one job runs where it arrived (no hop); more run in slots
        self._slots = _Slots(self.jobs) if self.jobs > 1 else None
        # the process may end itself when stopping finds a node stuck (the command's choice)
        self.exit_when_stuck = exit_when_stuck
        self._hold = threading.Lock()  # whoever holds it serves: the socket is theirs
        self._holder: int | None = None
        self._inline: _Job | None = None  # the piece running where it arrived, if any
        self._inline_seq = 0
        self._want_back = False  # the piece returned: the stand-in hands the socket back
        self._last_check = self._last_report = 0.0
        self._running: dict[int, _Job] = {}  # what runs now, by token
        self._running_lock = threading.Lock()
        self._tokens = itertools.count(1)
        self._busy_said = False  # a busy spell is said on stderr once
        self._answers_url = sockets.unique_inproc("answers")
        self._answers = sockets.pair(zmq.PULL)
        self._answers.bind(self._answers_url)
        self._pushes: list[zmq.Socket] = []
        self._local = threading.local()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._owner = threading.get_ident()
        self._front: zmq.Socket | None = None
        self._guard: Guard | None = None
        self._offer: str | None = None
        self._broker = ""
        self._events: zmq.Socket | None = None  # a dialed worker's connection events
        self._accepted = False  # the broker answered our Hello with Ready
        self._lost = False  # the connection to the broker dropped, said once until it is back
        self._refusals: list[float] = []  # when the last refusals were logged
        self._unsaid = 0  # refusals not logged since
        self._refused_keys = False  # the broker's handshake refused our keys, said once
        self._backoff = 0.0  # seconds to the next Hello after a refusal (0: none pending)
        self._hello_at = self._refused_at = 0.0
        self._next_hello = 0.0
        self._inbound = _streams.Inbound()
        self._outgoing: dict[tuple[bytes, int], tuple[_To, _streams.Outgoing]] = {}
        self.stopping = threading.Event()
        self._closed = threading.Event()
        self._closing = threading.Lock()
        self.imports = Imports()  # what was imported, to tell stale code from a plain failure
        self.heap = Heap()  # cargo moved since the allocator last gave freed memory back

    # -- the front socket --------------------------------------------------------------
    def bind(self, url: str, *, keys: Keys | None = None) -> str:
        """Listen on ``url``; return the real endpoint (a port 0 becomes the chosen one).
        With ``keys`` only clients whose public key is in ``keys.allow`` get through."""
        self._front = sockets.router()
        if keys is not None:
            self._guard = Guard(sockets.context(), keys, log=log)
            as_server(self._front, keys)
        self._front.bind(url)
        return sockets.bound_endpoint(self._front)

    def dial(self, broker: str, offer: str, *, keys: Keys | None = None) -> None:
        """Connect to a broker and offer to serve the host called ``offer`` (Relayed).
        With ``keys``, ``keys.server_key`` is the broker's public key."""
        self._front = sockets.dealer(self.patience)
        if keys is not None:
            as_client(self._front, keys, None)
        # every (re)connection is a broker that may not know us: say Hello on each
        self._events = self._front.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | _HANDSHAKE_FAILED
        )
        self._front.connect(broker)
        self._broker = broker
        self._offer = offer
        self._announce(time.monotonic())

    # -- the loop ----------------------------------------------------------------------
    def serve(self) -> None:
        self._owner = threading.get_ident()
        self._hold.acquire()
        self._holder = self._owner
        if self.parent is not None:
            threading.Thread(target=self._watch_parent, daemon=True, name="somatize-parent").start()
        if self._slots is None:
            threading.Thread(target=self._stand_in, daemon=True, name="somatize-stand-in").start()
        poller = self._poller()
        self._last_check = time.monotonic()
        try:
            while not self.stopping.is_set():
                self._turn(poller, 200)
        finally:
            self.close()

    def _poller(self) -> zmq.Poller:
        poller = zmq.Poller()
        poller.register(self._front, zmq.POLLIN)
        poller.register(self._answers, zmq.POLLIN)
        if self._events is not None:
            poller.register(self._events, zmq.POLLIN)
        return poller

    def _turn(self, poller: zmq.Poller, timeout_ms: int) -> None:
        """One round of serving, by whoever holds the socket."""
        events = dict(poller.poll(timeout_ms))
        if self._answers in events:
            self._forward_answers()
        # a stand-in whose piece has returned takes nothing new: the socket goes back first
        if self._front in events and not (self._want_back and self._holder != self._owner):
            self._receive()
        if self._events is not None and self._events in events:
            self._connection_events()
        now = time.monotonic()
        if now - self._last_check >= 1.0:
            self._last_check = now
            self._expire_streams(now)
        if self.store is not None and self.reporting and now - self._last_report >= self.reporting:
            self._last_report = now
            self._report()
        if self._offer is not None:
            self._keep_offering(now)

    def _stand_in(self) -> None:
        """On a thread of its own: serve while a piece runs where it arrived, once it has run
        ``STAND_IN_AFTER`` seconds; hand the socket back as soon as it returns."""
        me = threading.get_ident()
        poller: zmq.Poller | None = None
        seen = -1
        while not self.stopping.wait(STAND_IN_AFTER):
            seq = self._inline_seq
            if self._inline is None or seq != seen:
                seen = seq  # not running, or a piece that started since the last look
                continue
            if self._want_back or not self._hold.acquire(blocking=False):
                continue
            self._holder = me
            try:
                poller = poller or self._poller()
                self._flush()  # what the piece said so far
                while not self._want_back and not self.stopping.is_set():
                    self._turn(poller, 20)
            finally:
                self._holder = None
                self._hold.release()
        self._stop_stuck()

    def _stop_stuck(self) -> None:
        """Stopping while a piece runs where it arrived: give it a moment to return (the
        serving thread then closes), else close without it, and end the process if the
        command said so: a piece that never returns must not keep a stopped worker alive."""
        until = time.monotonic() + min(2.0, self.patience)
        while self._inline is not None and time.monotonic() < until:
            time.sleep(0.02)
        if self._inline is None or not self._hold.acquire(timeout=1.0):
            return
        try:
            self.close()
        finally:
            self._hold.release()
        if self.exit_when_stuck and self._inline is not None:
            _exit_now()

    def _watch_parent(self) -> None:
        """On a thread of its own: a node that never returns must not keep an orphan alive."""
        while not self.stopping.wait(PARENT_CHECK):
            if os.getppid() != self.parent:
                log.warning("stopping: the process that spawned this worker (%s) is gone", self.parent)
                self.stopping.set()
                if not self._closed.wait(min(2.0, self.patience) + 1.0) and self.exit_when_stuck:
                    _exit_now()  # the serving thread is stuck: nobody will ever ask again
                return

    def running(self) -> int:
        """How many pieces of work run now."""
        return len(self._running)

    def _report(self) -> None:
        try:
            report(self.store, self.machine, self_report(self.served, machine=self.machine))
        except (OSError, SomatizeError) as exc:  # a full disk must not stop the serving
            log.warning("could not report to the store: %s", exc)

    def _said(self) -> dict[str, str] | None:
        """A `said` fact for the connection, at most once per reporting period."""
        if not self.reporting:
            return None
        now = time.monotonic()
        if now - self._said_at < self.reporting:
            return None
        self._said_at = now
        return fact("said", **self_report(self.served, machine=self.machine))

    def reload(self) -> None:
        """Read the allow-list of client keys again (a key removed is refused from now on).
        A folder that cannot be used raises ``BadKeys``; the old list stays."""
        if self._guard is None:
            log.info("reload asked for, but this worker listens without keys: nothing to reload")
            return
        self._guard.reload()
        log.info("reloaded the allow-list: %s", self._guard.described())

    def described(self) -> str:
        """Who may come in, for the start line."""
        if self._guard is not None:
            return f"CURVE keys: {self._guard.described()}"
        return "CURVE keys to the broker" if self._offer is not None else "no keys"

    def close(self) -> None:
        """Stop serving; never waits for work still running (its threads are daemons)."""
        self.stopping.set()
        with self._closing:
            if self._closed.is_set():
                return
            self._close()
            self._closed.set()

    def _close(self) -> None:
        if self._guard is not None:
            self._guard.close()
            self._guard = None
        if self._offer is not None and self._front is not None and not self._front.closed:
            try:
                self._front.send_multipart(encode(Bye()), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            if self._events is not None:
                try:
                    self._front.disable_monitor()
                except zmq.ZMQError:
                    pass
        if self._slots is not None:
            self._slots.close()
        sockets.close(self._events, self._front, self._answers, *self._pushes)

    # -- sending -------------------------------------------------------------------------
    def _forward_answers(self) -> None:
        while self._answers.get(zmq.EVENTS) & zmq.POLLIN:
            self._answers.recv()  # a wake-up: what to send is in the outbox
        self._flush()

    def _post(self, to: _To, answer: Any, frames: list) -> None:
        """Queue an answer from any thread; the thread holding the socket sends it, in order."""
        self.imports.note()
        if isinstance(answer, (Failed, Refusal)):
            stale = self._stale(answer)
            # only an answer sent as itself is rewritten; one inside a carrier (pooled
            # segments) was told in `_run`, before it was written there
            if stale is not answer and variant_of(frames) is type(answer):
                answer, frames = stale, encode(stale)
        self._outbox.put((to, answer, frames))
        holder = self._holder
        if holder == threading.get_ident():
            self._flush()
            return
        if holder is None:
            return  # nobody serves this instant: whoever takes the socket sends the outbox first
        self._wake()

    def _wake(self) -> None:
        """Wake the thread holding the socket out of its poll."""
        try:
            self._push().send(b"", zmq.NOBLOCK)
        except zmq.Again:
            pass  # a thousand wake-ups are pending already: the loop is on its way
        except zmq.ZMQError:
            pass  # closed: the worker is stopping, nobody sends anything any more

    def _flush(self) -> None:
        while True:
            try:
                to, answer, frames = self._outbox.get_nowait()
            except queue.Empty:
                return
            if self.sessions.answering(to.peer, answer):
                self._deliver(to, frames)
            else:
                self.withheld += 1  # its exchange is over (the peer left, or said Hello anew)

    def _refused(self, to: _To, why: str) -> None:
        """Log a refusal, at most `_LOUD` per `_QUIET` seconds: a flood is counted, not printed."""
        now = time.monotonic()
        self._refusals = [t for t in self._refusals if now - t < _QUIET]
        if len(self._refusals) >= _LOUD:
            self._unsaid += 1
            return
        self._refusals.append(now)
        more = f" ({self._unsaid} more refusals were not logged)" if self._unsaid else ""
        self._unsaid = 0
        whom = f"exchange {to.exchange} of tenant {to.tenant}" if to.exchange else peer_name(to.route)
        log.info("refused %s: %s%s", whom, _printable(why), more)

    def _stale(self, answer: Any) -> Any:
        """``answer`` (a Failed or a Refusal), saying so when it comes of code this worker
        imported before the files changed on disk (see :mod:`.imported`)."""
        if answer.why.startswith("busy:"):
            return answer
        said = self.imports.explain(f"{answer.why}\n{getattr(answer, 'traceback', '')}")
        if said is None or said in answer.why:  # not stale, or said already (see `_run`)
            return answer
        log.warning("%s", said)
        return dataclasses.replace(answer, why=_clip(f"{answer.why.rstrip('. ')}. {said}", 64 << 10))

    def _reply(self, to: _To, answer: Any) -> None:
        """Answer from the serving thread, if the conversation allows it."""
        if isinstance(answer, Refusal):
            answer = self._stale(answer)
            # a busy spell is said once, by `_busy`; a recipe forgotten to make room is routine
            if not answer.why.startswith("busy:") and not answer.recipe:
                self._refused(to, answer.why)
        if self.sessions.answering(to.peer, answer):
            self._deliver(to, encode(answer))
        else:
            self.withheld += 1

    def _deliver(self, to: _To, frames: list) -> None:
        """Send a message's frames to ``to``: straight to its route, or in a ``Relay`` back
        through the broker, a big one as a stream under the client's credit."""
        if not to.exchange:
            self._send([to.route, *frames])
            return
        if _streams.worth_streaming(frames):
            out = _streams.Outgoing(_streams.new_sid(), frames)
            self._outgoing[(to.peer, out.sid)] = (to, out)
            self._carry(to, encode(out.begin()))
            self._drain(to, out)
            return
        self._carry(to, frames)

    def _carry(self, to: _To, frames: list) -> None:
        self._send(encode(Relay(exchange=to.exchange, inner=tuple(frames))))

    def _drain(self, to: _To, out: _streams.Outgoing) -> None:
        for chunk in out.chunks():
            self._carry(to, encode(chunk))
        if out.finished:
            self._outgoing.pop((to.peer, out.sid), None)

    def _send(self, parts: list) -> None:
        # never blocks: a peer that stops reading must not stall everyone else's answers
        try:
            self._front.send_multipart(parts, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            if self._broker:  # a dialed worker's one peer: the broker, reached or not
                self._dropped(f"the broker at {self._broker} is not taking messages (not connected yet, "
                              f"its handshake refused, or its queue full)")
            else:
                self._dropped("its client is not reading its answers (its queue is full)")
        except zmq.ZMQError as exc:  # ROUTER_MANDATORY: the client is gone; say so, never silently
            self._dropped(f"its client is gone ({exc})")

    def _dropped(self, why: str) -> None:
        self.dropped += 1
        if self.dropped == 1 or self.dropped % 1000 == 0:
            log.warning("an answer could not be delivered: %s (%d so far)", why, self.dropped)

    def _expire_streams(self, now: float) -> None:
        """Streams past their lifetime, or that nobody has moved for a while, are dropped."""
        self._inbound.expire(now)
        idle = 3 * self.patience
        for key in [k for k, (_, out) in self._outgoing.items() if now - out.touched > idle]:
            del self._outgoing[key]

    # -- receiving -----------------------------------------------------------------------
    def _receive(self) -> None:
        for _ in range(64):  # bounded, so answers keep flowing under a flood of requests
            # stopped meanwhile (a piece that ran here, while the stand-in closed): leave it
            if self.stopping.is_set() or not self._front.get(zmq.EVENTS) & zmq.POLLIN:
                return
            parts = self._front.recv_multipart(copy=False)
            self.heap.moved(parts)
            try:
                if self._offer is None:  # ROUTER: [identity, *frames]
                    if len(parts) >= 2:
                        route = parts[0].bytes
                        if self._guard is not None and not self._guard.roles(user_of(parts[1])):
                            # its key was taken out of the allow folder since it connected
                            self.sessions.receive(route, Bye())
                            self._inbound.drop(route)
                            self._reply(_To(route, route=route), Refusal("this key is no longer allowed on this worker"))
                            continue
                        self._take(_To(route, route=route), parts[1:])
                else:
                    self._from_broker(parts)
            except Exception as exc:  # one message's trouble is never the whole worker's
                log.warning("a message could not be handled: %s: %s", type(exc).__name__, _printable(str(exc)))
            if self.heap.due():  # handled, and let go of: what big cargo freed goes back (`.heap`)
                parts = None
                self.heap.trim()

    def _attachments(self) -> _leases.Attachments:
        """The mappings of this worker's clients' pooled segments, kept between calls."""
        found = getattr(self, "_attached", None)
        if found is None:
            found = self._attached = _leases.Attachments(self.mount or "")
        return found

    def _take(self, to: _To, frames: list, *, opened: bool = False) -> None:
        """One message from ``to``: a carrier is opened, anything else checked by the
        conversation and acted on; whatever is refused is answered ``Refusal``."""
        mounted: Mounted | None = None
        try:
            # from a peer that has not said Hello only Hello and Bye are opened; the others
            # are told by their header's variant alone, and refused unopened
            if not self.sessions.greeted(to.peer) and variant_of(frames) not in (Hello, Bye):
                raise Unknown("say Hello first: this worker has not heard from you")
            message = decode(frames)  # a carrier comes back as itself, its cargo unopened
            if isinstance(message, _CARRIERS):
                if opened:
                    raise Violation(f"a `{type(message).__name__}` cannot travel inside another carrier")
                if isinstance(message, Relay):
                    raise Violation("a worker takes `Relay` envelopes only from the broker it dialed")
                if not isinstance(message, Mounted):
                    self._stream(to, message)
                    return
                if self.mount is None:
                    raise Violation("this worker sees no shared directory; start it with --mount DIR")
                if not message.files:  # cargo with no files of its client's is never swept
                    raise Violation("a `Mounted` names the files of its frames; this one names none")
                if message.spans:  # pooled segments: views of the client's memory, no copy
                    frames, mounted = self._attachments().take(message)
                else:  # one file per frame: the client removes them
                    mounted = message
                    frames, _ = _mount.read(mounted, self.mount)
                if variant_of(frames) is not Work:
                    raise Violation(f"a `Mounted` carries Work, not a `{variant_of(frames).__name__}`")
                message = decode(frames)
                frames = []  # only the work's input points into the segments now...
                if isinstance(mounted, _leases.Taken):
                    message = mounted.detach(message)  # ...and it is held by `mounted` until it runs
            message = self.sessions.receive(to.peer, message, to.tenant)
        except (ProtocolError, Refused) as exc:  # Violation is a ProtocolError
            why = getattr(exc, "why", None) or str(exc)
            self._reply(to, Refusal(why, hello=isinstance(exc, Unknown), recipe=isinstance(exc, Unheld)))
            return
        if isinstance(message, Hello):
            self._reply(to, self._ready())
        elif isinstance(message, Bye):
            self._inbound.drop(to.peer)
        elif isinstance(message, Provision):
            self._provision(to, message)
        else:
            self._work(to, message, mounted)

    def _stream(self, to: _To, message: Any) -> None:
        if isinstance(message, Credit):
            pending = self._outgoing.get((to.peer, message.sid))
            if pending is not None:
                pending[1].grant(message.amount)
                self._drain(*pending)
            return
        if isinstance(message, Begin):
            self._inbound.begin(to.peer, to.tenant or to.peer.hex(), message)
            return
        granted, frames = self._inbound.chunk(to.peer, message)
        self._deliver(to, encode(Credit(message.sid, granted)))
        if frames is not None:
            self._take(to, frames, opened=True)

    # -- the broker, for a dialed worker -------------------------------------------------
    def _from_broker(self, parts: list) -> None:
        """A relayed message for us, or the broker itself speaking: Ready to our Hello (or a
        probe), Refusal, a Hello checking on us."""
        try:
            variant = variant_of(parts)
            if variant is Relay:
                relay = decode(parts)  # its header only: the inner message is opened by _take
                if relay.exchange > 0:
                    peer = b"relay:%d" % relay.exchange
                    self._take(_To(peer, relay.tenant or "exchange:%d" % relay.exchange, exchange=relay.exchange),
                               list(relay.inner))
                return
            if variant not in (Ready, Refusal, Hello):
                raise ProtocolError(f"a broker does not send a worker a `{variant.__name__}`")
            message = decode(parts)
        except ProtocolError as exc:
            log.warning("the broker at %s sent what this worker does not take: %s", self._broker, exc.why)
            return
        now = time.monotonic()
        if isinstance(message, Ready):
            if not self._accepted:
                log.info("the broker at %s took this worker's offer of `%s`", self._broker, self._offer)
            self._accepted, self._backoff = True, 0.0
        elif isinstance(message, Refusal):
            # a restarted broker that does not know us (a late answer it cannot place), or a
            # refusal of our offer: neither is a reason to stop serving. Hello again, later.
            self._accepted = False
            self._refused_at = now
            self._backoff = min(MAX_BACKOFF, max(0.5, self._backoff * 2))
            self._next_hello = min(self._next_hello, now + self._backoff)
            log.warning("the broker at %s refused this worker: %s; saying Hello again in %g s",
                        self._broker, message.why, self._backoff)
        else:
            self._send(encode(self._ready()))  # the broker checking on us

    def _announce(self, now: float) -> None:
        """Hello to the broker: the first, a keepalive every patience, or again after a refusal."""
        self._send(encode(Hello(self.runtime, offering=self._offer)))
        self._hello_at = now
        self._next_hello = now + (self._backoff or self.patience)

    def _keep_offering(self, now: float) -> None:
        if self._backoff and self._refused_at < self._hello_at and now - self._hello_at > min(2.0, self.patience):
            # our last Hello drew no refusal: taken (a keepalive is answered with silence)
            self._backoff = 0.0
            self._accepted = True
            self._next_hello = self._hello_at + self.patience
        if now >= self._next_hello:
            self._announce(now)

    def _connection_events(self) -> None:
        while self._events is not None and self._events.get(zmq.EVENTS) & zmq.POLLIN:
            event = int.from_bytes(self._events.recv_multipart()[0][:2], "little")
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                if self._lost:
                    log.info("reached the broker at %s again; offering `%s`", self._broker, self._offer)
                self._lost = self._refused_keys = False
                self._backoff = 0.0
                self._announce(time.monotonic())  # perhaps a broker that restarted: it learns about us now
            elif event & _HANDSHAKE_FAILED:
                if not self._refused_keys:  # once per spell: ZeroMQ tries again every few seconds
                    self._refused_keys = True
                    log.error("the broker at %s refused this worker's CURVE handshake: is this worker's "
                              "public key in the broker's --allow-workers folder (then reload the broker), "
                              "and is --broker-key the broker's own `.key`? Dialing again meanwhile",
                              self._broker)
            elif event == zmq.EVENT_DISCONNECTED and not self._lost:
                self._accepted, self._lost = False, True
                log.warning("lost the broker at %s; dialing again", self._broker)

    # -- requests ----------------------------------------------------------------------
    def _ready(self) -> Ready:
        """Ready, saying how long the oldest running work has run (0: idle)."""
        oldest = self._oldest()
        busy_us = 0 if oldest is None else max(1, int((time.monotonic() - oldest.started) * 1e6))
        return Ready(self.runtime, busy_us=busy_us)

    def _oldest(self) -> _Job | None:
        with self._running_lock:
            return min(self._running.values(), key=lambda job: job.started, default=None)

    def _provision(self, to: _To, message: Provision) -> None:
        if self.mode == "network":
            why = compatible(self.runtime, self.sessions.runtime(to.peer), needs_pickle=True,
                             me="this worker", them="the client")
            if why is not None:
                self._reply(to, Refusal(why))
                return
        try:
            self.catalog.provision(message.digest, message.artifact)
        except Refused as exc:
            self._reply(to, Refusal(str(exc)))
            return
        self._reply(to, self._ready())

    def _work(self, to: _To, work: Work, mounted: Mounted | None) -> None:
        try:
            missing = self.catalog.missing(work.recipe.nodes)
        except Refused as exc:
            self._reply(to, Refusal(str(exc), ref=work.ref))
            return
        if missing:
            self._reply(to, Send(work.ref, tuple(missing)))
            return
        with self._running_lock:
            full = len(self._running) >= self.jobs
            if not full:
                token = next(self._tokens)
                job = self._running[token] = _Job(work.recipe.nodes[0].label if work.recipe.nodes else "?")
        if full:
            self._busy(to, work)
            return
        self._busy_said = False
        self.served += 1
        if self._slots is not None:
            self._slots.submit(self._run, token, job, to, work, mounted)
        else:
            self._run_here(token, job, to, work, mounted)

    def _run_here(self, token: int, job: _Job, to: _To, work: Work, mounted: Mounted | None) -> None:
        """Run a piece on this thread, letting go of the socket meanwhile (the stand-in
        takes it if the piece runs long), and take it back once the piece has returned."""
        me = threading.get_ident()
        self._inline = job
        self._inline_seq += 1
        self._holder = None
        self._hold.release()
        try:
            self._run(token, job, to, work, mounted)
        finally:
            self._want_back = True
            if self._holder not in (None, me):
                self._wake()  # the stand-in is polling: it hands the socket back now
            self._hold.acquire()
            self._holder = me
            self._want_back = False
            self._inline = None
            with self._running_lock:
                self._running.pop(token, None)
        self._flush()

    def _busy(self, to: _To, work: Work) -> None:
        """Every slot is taken: say so at once (the client makes it ``Busy``), never queue."""
        oldest = self._oldest()
        if oldest is None:  # it returned meanwhile: the client may simply send again
            node, seconds = "?", 0.0
        else:
            node, seconds = oldest.node, time.monotonic() - oldest.started
        slots = f"{self.jobs} piece{'s' if self.jobs > 1 else ''} of work at once"
        why = (f"busy: running `{node}` for {seconds:.0f} s; this worker runs {slots} and takes "
               f"new work once one returns (start it with --jobs N to run more at once)")
        if work.watched:
            said = fact("said", kind="busy", node=node, running_us=int(seconds * 1e6), jobs=self.jobs)
            self._reply(to, Saw(work.ref, said))
        self._reply(to, Refusal(why, ref=work.ref))
        if not self._busy_said:
            self._busy_said = True
            log.warning("%s", why)

    # -- a job, in a slot ----------------------------------------------------------------
    def _push(self) -> zmq.Socket:
        push = getattr(self._local, "push", None)
        if push is None:
            push = sockets.pair(zmq.PUSH)
            push.connect(self._answers_url)
            self._local.push = push
            self._pushes.append(push)
        return push

    def _run(self, token: int, job: _Job, to: _To, work: Work, mounted: Mounted | None) -> None:
        def told(fact: dict[str, str]) -> None:  # from any thread of the piece
            saw = Saw(work.ref, {k: _clip(v, 16 << 10) for k, v in fact.items()})
            self._post(to, saw, encode(saw))

        watch = told if work.watched else None  # nobody on the other side looks: no facts at all

        said = self._said()
        if said is not None and watch is not None:
            watch(said)
        started = time.perf_counter_ns()
        answer: Any
        built = False
        if isinstance(mounted, _leases.Taken):
            work = mounted.restore(work)  # its input, held here until the answer is written
        try:
            nodes = self._build(work, job)
            built = True
            outcome = run_piece(piece_of(work, nodes), watch)
            answer = done_of(work.ref, outcome, microseconds(time.perf_counter_ns() - started))
        except NodeFailed as exc:
            cause = exc.__cause__ or exc
            if isinstance(cause, NodeExit):
                cause = cause.raised
            answer = Failed(
                work.ref,
                # a node raised: what it raised; an import or a build: what was being done
                why=_clip(f"{type(cause).__name__}: {cause}" if built else str(exc), 64 << 10),
                node=exc.node,
                error=type(cause).__name__ if exc.__cause__ is not None else exc.error,
                traceback=_clip(format_exception(cause), 512 << 10),
            )
            # its traceback holds this frame, and the frames below it the message as it
            # arrived: kept in a local, that cycle would hold the input until a collection
            cause = None
        except Refused as exc:
            answer = Refusal(str(exc), ref=work.ref)
        except BaseException as exc:  # the worker's own trouble: still an answer, never a hang
            answer = _failed(work.ref, exc, traceback=format_exception(exc))
        if isinstance(answer, (Failed, Refusal)):
            answer = self._stale(answer)  # here, before it is written into a segment
        try:
            frames = encode(answer)
        except (CodecError, ValueError) as exc:  # unwritable, or over a wire limit
            answer = _failed(work.ref, exc, why=f"what this work produced cannot travel back: {exc}")
            frames = encode(answer)
        self.heap.moved(frames)
        if isinstance(mounted, _leases.Taken):
            # pooled: frames into a spare segment (a view of the input goes back as a span of
            # it), then everything of ours that points into the segments is let go of, and
            # an anchor still alive is a view a node kept: the answer names it in `kept`
            ref = work.ref
            try:
                mounted.write(frames)
            except (OSError, Refused, ProtocolError) as exc:
                mounted.write(encode(_failed(ref, exc, why=f"the answer could not be written to the shared folder: {exc}")))
            if hasattr(answer, "produced"):  # a Done: the conversation needs only its kind and ref
                answer = dataclasses.replace(answer, output=None, produced={})
            work = frames = outcome = cause = None  # noqa: F841 (the input, the output)
            frames = mounted.sealed()
        elif mounted is not None and self.mount is not None and len(frames) > 1:
            try:  # named for the client, which removes them once read
                frames, _ = _mount.write(frames, self.mount, answering=mounted)
            except (OSError, Refused) as exc:
                answer = _failed(work.ref, exc, why=f"the answer could not be written to the shared folder: {exc}")
                frames = encode(answer)
        if self._slots is not None:
            with self._running_lock:
                # the slot is free before the answer leaves: a client that sends again at
                # once never finds this worker busy with the work it just got the answer of
                self._running.pop(token, None)
        else:
            self._want_back = True  # a stand-in sends this answer, then takes nothing new
        self._post(to, answer, frames)


    def _build(self, work: Work, job: _Job) -> list[Node]:
        """The work's nodes, each in a guard (one per node and name, however often it appears)."""
        guarded: dict[tuple[int, str], _Guarded] = {}
        nodes: list[Node] = []
        for spec in work.recipe.nodes:
            node = self.catalog.build(spec)
            guard = guarded.get((id(node), spec.label))
            if guard is None:
                guard = guarded[(id(node), spec.label)] = _Guarded(node, spec.label, job)
            nodes.append(guard)
        return nodes


def _failed(ref: int, exc: BaseException, *, why: str | None = None, traceback: str = "") -> Failed:
    """The worker's own trouble (no node to blame) as a ``Failed``."""
    return Failed(
        ref,
        why=_clip(why or f"{type(exc).__name__}: {exc}", 64 << 10),
        node=None,
        error=type(exc).__name__,
        traceback=_clip(traceback, 512 << 10),
    )


class _Job:
    """One piece of work in a slot: when it started, and the node it is running now."""

    __slots__ = ("node", "started")

    def __init__(self, node: str) -> None:
        self.node = node
        self.started = time.monotonic()


class _Guarded(Node):
    """A node as a worker runs it: says which node runs now, and turns what is not an
    ``Exception`` into one (:class:`NodeExit`), so the engine names the node that raised."""

    def __init__(self, node: Node, label: str, job: _Job) -> None:
        self.node = node
        self.label = label
        self.job = job

    def forward(self, x: Any) -> Any:
        self.job.node = self.label
        try:
            return self.node.forward(x)
        except Exception:
            raise
        except BaseException as exc:
            raise NodeExit(exc) from exc


class _Slots:
    """``n`` daemon threads taking jobs in order. Daemons: a node that never returns must not
    keep the process from ending once the worker stops serving."""

    def __init__(self, n: int) -> None:
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._take, daemon=True, name=f"somatize-job-{i}") for i in range(n)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Any, *args: Any) -> None:
        self._tasks.put((fn, args))

    def close(self) -> None:
        for _ in self._threads:
            self._tasks.put(None)

    def _take(self) -> None:
        while True:
            task = self._tasks.get()
            if task is None:
                return
            fn, args = task
            try:
                fn(*args)
            except BaseException as exc:  # never lose the slot to a bug
                log.error("a job slot caught %s: %s", type(exc).__name__, exc)


def _exit_now() -> None:
    """End the process at once, after saying what is buffered (a stuck thread never returns)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(0)


def _printable(text: str) -> str:
    """Text for a log line: what is not printable (a route's NUL, say) escaped, never raw."""
    return text if text.isprintable() else text.encode("unicode_escape").decode("ascii")


def _clip(text: str, limit: int) -> str:
    """Texts that cross the wire are bounded; a user's huge message is cut, not refused."""
    return text if len(text) <= limit else text[: limit - 20] + " ... (cut)"
