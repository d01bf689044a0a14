"""How a worker's answers leave: in order, only where the conversation allows, never blocking.

Answers and facts, from whatever thread (a job, a parallel branch of a piece), go into one
first-in-first-out outbox, so a piece's facts always leave before its ``Done``; the thread
holding the socket sends them, each checked by
:class:`~somatize.fabric.conversation.WorkerSessions` first (an answer for work that is not
open for that very peer is withheld and counted). Every send is ``NOBLOCK``: a peer that
stops reading loses its answers (counted), it never stalls the loop.

A big answer to a relayed exchange streams back (:mod:`somatize.fabric.streams`) under the client's
credit, and only while the socket has room: what waits for room waits in the worker, a
window per stream, so a dialed worker's keepalive (:mod:`somatize.fabric.worker.dialing`), tried before every
send, never queues behind a long stream. While an answer streams, its peer's session is
held (``WorkerSessions.hold``): it is not forgotten to make room until every byte of it is
credited. What is not for here: deciding what to answer (:mod:`somatize.fabric.worker.running`,
:mod:`somatize.fabric.worker.intake`).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Any, NamedTuple

import zmq

from ...wire import Begin, Chunk, Failed, Refusal, encode, variant_of
from ...wire.writing import passed_on
from .. import sockets
from .. import streams as _streams
from ..conversation import BUSY
from ..curve import peer_name
from ..logs import clip
from .pacing import TENANT_QUEUE

if TYPE_CHECKING:
    from ..conversation import WorkerSessions
    from ..logs import Limiter
    from .dialing import BrokerLink
    from .imported import Imports
    from .pacing import Pacer
    from .serving import Hold

log = logging.getLogger("somatize.worker")
#: Seconds between two log lines giving the same advice about stale imports.
ADVICE_EVERY = 60.0


class To(NamedTuple):
    """Who an answer goes to: a client's route (Direct), or an exchange a broker relays."""

    peer: bytes  # the sessions' name for it
    tenant: str = ""  # who the client is: its key, or "" on a keyless route (one per route)
    route: bytes = b""  # Direct: the ROUTER identity
    exchange: int = 0  # Relayed: the broker's number for the exchange


class Outbox:
    """A worker's way out: the answers queued from any thread and the inproc sockets that wake
    the thread holding the socket, the streams going out, the answers it dropped (``dropped``,
    none delivered) or withheld (``withheld``, the conversation did not allow them), and the
    advice about stale imports it gave. Handed the sessions (who may be answered), the hold on
    the socket (whether its caller sends at once), what was imported and the log limiter;
    once the worker listens or dials, its socket and, dialed, its link to the broker
    (:meth:`attach`)."""

    def __init__(self, sessions: WorkerSessions, hold: Hold, imports: Imports, lines: Limiter) -> None:
        self.sessions = sessions
        self.hold = hold
        self.imports = imports
        self.lines = lines
        self.front: Any = None  # the worker's socket (`attach`)
        self.link: BrokerLink | None = None  # a dialed worker's link: its control goes first
        self.pacer: Pacer | None = None  # a dialed worker's window and fair order (the link's); None listening
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._answers_url = sockets.unique_inproc("answers")
        self.answers = sockets.pair(zmq.PULL)  # wakes the thread holding the socket (`wake`); it polls this
        self.answers.bind(self._answers_url)
        self._pushes: list[zmq.Socket] = []  # one per thread that ever woke it (`_push`)
        self._local = threading.local()
        self._outgoing: dict[tuple[bytes, int], tuple[To, _streams.Outgoing]] = {}
        self.blocked = False  # a stream waits for room on the socket
        self.dropped = 0  # answers that could not be delivered
        self.dropped_at = -1e9  # when the last one was (monotonic)
        self.withheld = 0  # answers the conversation did not allow (to an exchange not open)
        self._advised: dict[str, float] = {}  # advice about stale imports: when last said

    def attach(self, front: Any, link: BrokerLink | None = None) -> None:
        """The socket answers leave on, and a dialed worker's link to its broker."""
        self.front = front
        self.link = link
        self.pacer = link.pacer if link is not None else None

    def sockets(self) -> list[zmq.Socket]:
        """Its own sockets, for the worker's close: the one it is woken on, then each thread's."""
        return [self.answers, *self._pushes]

    # -- from any thread -----------------------------------------------------------------
    def post(self, to: To, answer: Any, frames: list) -> None:
        """Queue an answer from any thread; the thread holding the socket sends it, in order."""
        self.imports.note()
        if isinstance(answer, (Failed, Refusal)):
            stale = self.stale(answer)
            # only an answer sent as itself is rewritten; one inside a carrier (pooled
            # segments) was told by the runner, before it was written there
            if stale is not answer and variant_of(frames) is type(answer):
                answer, frames = stale, encode(stale)
        holder = self.hold.holder
        if holder == threading.get_ident():
            if self._queue.empty():  # nothing queued before it: it leaves now, in order
                if self.sessions.answering(to.peer, answer):
                    self.deliver(to, frames)
                else:
                    self.withheld += 1
                return
            self._queue.put((to, answer, frames))
            self.flush()
            return
        self._queue.put((to, answer, frames))
        if holder is None:
            return  # nobody serves this instant: whoever takes the socket sends the outbox first
        self.wake()

    def wake(self) -> None:
        """Wake the thread holding the socket out of its poll."""
        try:
            self._push().send(b"", zmq.NOBLOCK)
        except zmq.Again:
            pass  # a thousand wake-ups are pending already: the loop is on its way
        except zmq.ZMQError:
            pass  # closed: the worker is stopping, nobody sends anything any more

    def _push(self) -> zmq.Socket:
        """This thread's end of the wake-up: made at its first."""
        push = getattr(self._local, "push", None)
        if push is None:
            push = sockets.pair(zmq.PUSH)
            push.connect(self._answers_url)
            self._local.push = push
            self._pushes.append(push)
        return push

    def stale(self, answer: Any) -> Any:
        """``answer`` (a Failed or a Refusal), saying so when a file this worker imported
        changed on disk since (see :mod:`somatize.fabric.worker.imported`: its record decides, never the text)."""
        if answer.why.startswith(BUSY) or getattr(answer, "hello", False) or getattr(answer, "recipe", False):
            return answer
        said = self.imports.explain(f"{answer.why}\n{getattr(answer, 'traceback', '')}")
        if said is None or said in answer.why:  # not stale, or said already (by the runner)
            return answer
        now = time.monotonic()
        if now - self._advised.get(said, -1e9) >= ADVICE_EVERY:
            if len(self._advised) >= 64:
                self._advised.clear()
            self._advised[said] = now
            self.lines.say(logging.WARNING, "%s", said)
        return dataclasses.replace(answer, why=clip(f"{answer.why.rstrip('. ')}. {said}", 64 << 10))

    # -- by the thread holding the socket ------------------------------------------------
    def forward(self) -> None:
        """Woken (``answers`` polled readable): what waits in the outbox leaves."""
        while sockets.readable(self.answers):
            self.answers.recv()  # a wake-up: what to send is in the outbox
        self.flush()

    def flush(self) -> None:
        """Send what waits in the outbox, in order, each if the conversation allows it."""
        outbox = self._queue
        while not outbox.empty():  # looked at first: an empty queue raising is the dearest part
            try:
                to, answer, frames = outbox.get_nowait()
            except queue.Empty:
                return
            if self.sessions.answering(to.peer, answer):
                self.deliver(to, frames)
            else:
                self.withheld += 1  # its exchange is over (the peer left, was revoked, or said Hello anew)

    def _refused(self, to: To, why: str) -> None:
        """Log a refusal through the limiter: a flood is counted, not printed."""
        whom = f"exchange {to.exchange} of tenant {to.tenant}" if to.exchange else peer_name(to.route)
        self.lines.say(logging.INFO, "refused %s: %s", whom, why)

    def reply(self, to: To, answer: Any, *, refusing: bool = False) -> None:
        """Answer from the serving thread, if the conversation allows it. ``refusing``: a
        refusal of the message just received (it may name a Work that never opened)."""
        if isinstance(answer, Refusal):
            answer = self.stale(answer)
            # a busy spell is said once, by the runner; a recipe forgotten to make room is routine
            if not answer.why.startswith(BUSY) and not answer.recipe:
                self._refused(to, answer.why)
        if self.sessions.answering(to.peer, answer, refusing=refusing):
            self.deliver(to, encode(answer))
        else:
            self.withheld += 1

    def deliver(self, to: To, frames: list) -> None:
        """Send a message's frames to ``to``: straight to its route, or in a ``Relay`` back
        through the broker, a big one as a stream under the client's credit."""
        if not to.exchange:
            self._send([to.route, *frames])
            return
        if _streams.worth_streaming(frames):
            out = _streams.Outgoing(_streams.new_sid(), frames)
            self._outgoing[(to.peer, out.sid)] = (to, out)
            self.sessions.hold(to.peer, out.sid)  # its session stays until every byte is credited
            # its Begin leaves first, in `_drain`, as soon as there is room (`begun`: the worker's
            # own mark on a stream, which `streams.Outgoing` does not declare)
            out.begun = False
            self._drain(to, out)
            return
        self._carry(to, frames)

    def _carry(self, to: To, frames: list) -> None:
        """An answer in an exchange the broker relays, through the window (`.pacing`): now
        when it is open and nothing waits for it, else behind its tenant's others."""
        parts = passed_on(tuple(frames), exchange=to.exchange)  # its answer, checked as it was written
        pacer = self.pacer
        if pacer is None:
            self._send(parts)
        elif pacer.free():
            if self._send(parts) and pacer.sent_one():
                self._mark()
        elif not pacer.hold(to.tenant, parts):
            self._dropped(
                f"tenant {to.tenant or '?'} has {TENANT_QUEUE} answers waiting for the broker to read "
                f"what this worker sent before them (a flood's, most likely)"
            )

    def _mark(self) -> None:
        """A mark is due behind the answers sent (`.pacing`): the link sends it, as control."""
        link = self.link
        assert link is not None  # a window is a dialed worker's, and so is its link (`attach`)
        link.mark()

    def send_waiting(self, now: float) -> None:
        """Every turn, after what was read (a credit moves a stream, the broker's answer to a
        mark the window): a mark unanswered past its time is taken as read, streams that
        waited for room go on, and answers that waited for the window leave."""
        pacer = self.pacer
        if pacer is not None and not pacer.room():
            pacer.look(now)  # a mark unanswered past its time is taken as read
        if self._outgoing:
            self._drain_streams()
        else:
            self.blocked = False
        if pacer is not None and pacer.waiting():
            self._pump_paced(now)

    def _pump_paced(self, now: float) -> None:
        """Answers that waited for the window leave, one per tenant in turn, while it is open
        and the socket has room (a full socket is looked at again when it has room)."""
        pacer = self.pacer
        assert pacer is not None  # called only with a window that waits (`send_waiting`): a dialed worker's
        pacer.look(now)
        while pacer.waiting():
            if self.link is not None and not self.link.cleared():
                self.blocked = True
                return
            if not sockets.writable(self.front):
                self.blocked = True
                return
            parts = pacer.next()
            if parts is None:  # the window is full: the broker's answer to a mark opens it
                return
            if self._send(parts) and pacer.sent_one():
                self._mark()

    def credit(self, peer: bytes, sid: int, amount: int) -> None:
        """The client granted ``amount`` more of the stream ``sid`` going out to it: more leaves."""
        pending = self._outgoing.get((peer, sid))
        if pending is not None:
            pending[1].grant(amount)
            self._drain(*pending)

    def _drain(self, to: To, out: _streams.Outgoing) -> None:
        """Its Begin, then the chunks the credit allows, while the socket and the window have
        room; the rest wait here. A stream takes its place in the window beside the answers
        waiting (`_pump_paced`), never behind all of them: its client's credit bounds it."""
        chunks = out.chunks() if out.begun else None
        message: Begin | Chunk | None
        while True:
            if not self._room():
                if self.pacer is None or self.pacer.room():
                    self.blocked = True  # resumed when the socket has room (`_drain_streams`)
                break  # or when the broker answers a mark (`send_waiting`)
            if chunks is None:
                message, out.begun = out.begin(), True
                chunks = out.chunks()
            else:
                message = next(chunks, None)
                if message is None:
                    break
            parts = passed_on(tuple(encode(message)), exchange=to.exchange)
            if self._send(parts) and self.pacer is not None and self.pacer.sent_one():
                self._mark()
        if out.finished and out.credit >= _streams.WINDOW:
            self._settle(to.peer, out.sid)  # every byte credited: the session may go

    def _drain_streams(self) -> None:
        """Every turn: streams that waited for room go on, and settled ones are let go."""
        self.blocked = False
        for to, out in list(self._outgoing.values()):
            self._drain(to, out)

    def _settle(self, peer: bytes, sid: int) -> None:
        self._outgoing.pop((peer, sid), None)
        self.sessions.release(peer, sid)

    def forget(self, peer: bytes) -> None:
        """``peer``'s session ended (its key revoked): its streams going out are let go."""
        for key in [k for k in self._outgoing if k[0] == peer]:
            self._settle(*key)

    def expire(self, now: float, idle: float) -> None:
        """Streams going out that nobody has moved for ``idle`` seconds are dropped."""
        for key in [k for k, (_, out) in self._outgoing.items() if now - out.touched > idle]:
            self._settle(*key)

    def streaming(self) -> bool:
        """Whether a stream goes out."""
        return bool(self._outgoing)

    def waited_on(self, patience: float) -> bool:
        """Whether a client may be waiting on what goes out: a stream goes out, or waits for
        room, or an answer found no room on the socket within the last ``patience``."""
        recently = time.monotonic() - self.dropped_at < patience
        return bool(self._outgoing or self.blocked or recently)

    def window_due(self) -> float | None:
        """When the window, full, will open on its own (a mark taken as read), if it is full
        and waits on a mark."""
        if self.pacer is not None and not self.pacer.room():
            return self.pacer.look(time.monotonic())
        return None

    def _room(self) -> bool:
        """Whether the socket takes a message of a stream now, with no keepalive waiting
        before it and, to a broker, the window open."""
        if self.link is not None and not self.link.cleared():
            return False
        if self.pacer is not None and not self.pacer.room():
            return False
        return sockets.writable(self.front)

    def _send(self, parts: list) -> bool:
        """True when it left. Never blocks: a peer that stops reading must not stall
        everyone else's answers; a keepalive waiting for room goes first (see `.dialing`)."""
        try:
            if self.link is not None and not self.link.cleared():
                raise zmq.Again()
            sockets.send_frames(self.front, parts, sockets.NOBLOCK)
            return True
        except zmq.Again:
            if self.link is not None:  # a dialed worker's one peer: the broker, reached or not
                self._dropped(
                    f"the broker at {self.link.broker} is not taking messages (not connected yet, "
                    f"its handshake refused, or its queue full)"
                )
            else:
                self._dropped("its client is not reading its answers (its queue is full)")
        except zmq.ZMQError as exc:  # ROUTER_MANDATORY: the client is gone; say so, never silently
            self._dropped(f"its client is gone ({exc})")
        return False

    def _dropped(self, why: str) -> None:
        self.dropped += 1
        self.dropped_at = time.monotonic()  # a dialed worker says Hello closer meanwhile (`BrokerLink.hello_due`)
        if self.dropped == 1 or self.dropped % 1000 == 0:
            log.warning("an answer could not be delivered: %s (%d so far)", why, self.dropped)
