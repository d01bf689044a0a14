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
credited. What is not for here: deciding what to answer (:mod:`somatize.fabric.worker.loop`).
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
from ..curve import peer_name
from ..logs import clip
from .pacing import TENANT_QUEUE

if TYPE_CHECKING:
    from ..conversation import WorkerSessions
    from ..logs import Limiter
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
    """The sending side of :class:`~somatize.fabric.worker.loop.WorkerLoop` (a mixin: the
    loop's attributes are its own)."""

    _front: Any
    _broker: str
    _control: list
    _outgoing: dict[tuple[bytes, int], tuple[To, _streams.Outgoing]]
    _pacer: Pacer | None  # a dialed worker's window and fair order (`.pacing`); None for a listening one
    _answers: zmq.Socket  # wakes the thread holding the socket (`_wake`)
    _outbox: queue.SimpleQueue
    hold: Hold  # whoever holds it sends at once; the others' answers wait for them
    _blocked: bool
    _inbound: _streams.Inbound
    _lines: Limiter
    _advised: dict[str, float]
    sessions: WorkerSessions
    imports: Imports
    withheld: int
    dropped: int
    _dropped_at: float
    patience: float

    if TYPE_CHECKING:  # the loop's own, or another mixin's (stubs for mypy alone: none at run time)

        def _push(self) -> zmq.Socket: ...

    def _forward_answers(self) -> None:
        while sockets.readable(self._answers):
            self._answers.recv()  # a wake-up: what to send is in the outbox
        self._flush()

    def _post(self, to: To, answer: Any, frames: list) -> None:
        """Queue an answer from any thread; the thread holding the socket sends it, in order."""
        self.imports.note()
        if isinstance(answer, (Failed, Refusal)):
            stale = self._stale(answer)
            # only an answer sent as itself is rewritten; one inside a carrier (pooled
            # segments) was told in `_run`, before it was written there
            if stale is not answer and variant_of(frames) is type(answer):
                answer, frames = stale, encode(stale)
        holder = self.hold.holder
        if holder == threading.get_ident():
            if self._outbox.empty():  # nothing queued before it: it leaves now, in order
                if self.sessions.answering(to.peer, answer):
                    self._deliver(to, frames)
                else:
                    self.withheld += 1
                return
            self._outbox.put((to, answer, frames))
            self._flush()
            return
        self._outbox.put((to, answer, frames))
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
        outbox = self._outbox
        while not outbox.empty():  # looked at first: an empty queue raising is the dearest part
            try:
                to, answer, frames = outbox.get_nowait()
            except queue.Empty:
                return
            if self.sessions.answering(to.peer, answer):
                self._deliver(to, frames)
            else:
                self.withheld += 1  # its exchange is over (the peer left, was revoked, or said Hello anew)

    def _refused(self, to: To, why: str) -> None:
        """Log a refusal through the limiter: a flood is counted, not printed."""
        whom = f"exchange {to.exchange} of tenant {to.tenant}" if to.exchange else peer_name(to.route)
        self._lines.say(logging.INFO, "refused %s: %s", whom, why)

    def _stale(self, answer: Any) -> Any:
        """``answer`` (a Failed or a Refusal), saying so when a file this worker imported
        changed on disk since (see :mod:`somatize.fabric.worker.imported`: its record decides, never the text)."""
        if answer.why.startswith("busy:") or getattr(answer, "hello", False) or getattr(answer, "recipe", False):
            return answer
        said = self.imports.explain(f"{answer.why}\n{getattr(answer, 'traceback', '')}")
        if said is None or said in answer.why:  # not stale, or said already (see `_run`)
            return answer
        now = time.monotonic()
        if now - self._advised.get(said, -1e9) >= ADVICE_EVERY:
            if len(self._advised) >= 64:
                self._advised.clear()
            self._advised[said] = now
            self._lines.say(logging.WARNING, "%s", said)
        return dataclasses.replace(answer, why=clip(f"{answer.why.rstrip('. ')}. {said}", 64 << 10))

    def _reply(self, to: To, answer: Any, *, refusing: bool = False) -> None:
        """Answer from the serving thread, if the conversation allows it. ``refusing``: a
        refusal of the message just received (it may name a Work that never opened)."""
        if isinstance(answer, Refusal):
            answer = self._stale(answer)
            # a busy spell is said once, by `_busy`; a recipe forgotten to make room is routine
            if not answer.why.startswith("busy:") and not answer.recipe:
                self._refused(to, answer.why)
        if self.sessions.answering(to.peer, answer, refusing=refusing):
            self._deliver(to, encode(answer))
        else:
            self.withheld += 1

    def _deliver(self, to: To, frames: list) -> None:
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
        pacer = self._pacer
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

    def _pump_paced(self, now: float) -> None:
        """Answers that waited for the window leave, one per tenant in turn, while it is open
        and the socket has room (a full socket is looked at again when it has room)."""
        pacer = self._pacer
        assert pacer is not None  # called only with a window that waits (`_turn`): a dialed worker's
        pacer.look(now)
        while pacer.waiting():
            if self._control and not self._push_control():
                self._blocked = True
                return
            if not sockets.writable(self._front):
                self._blocked = True
                return
            parts = pacer.next()
            if parts is None:  # the window is full: the broker's answer to a mark opens it
                return
            if self._send(parts) and pacer.sent_one():
                self._mark()

    def _drain(self, to: To, out: _streams.Outgoing) -> None:
        """Its Begin, then the chunks the credit allows, while the socket and the window have
        room; the rest wait here. A stream takes its place in the window beside the answers
        waiting (`_pump_paced`), never behind all of them: its client's credit bounds it."""
        chunks = out.chunks() if out.begun else None
        message: Begin | Chunk | None
        while True:
            if not self._room():
                if self._pacer is None or self._pacer.room():
                    self._blocked = True  # resumed when the socket has room (`_drain_streams`)
                break  # or when the broker answers a mark (`_turn`)
            if chunks is None:
                message, out.begun = out.begin(), True
                chunks = out.chunks()
            else:
                message = next(chunks, None)
                if message is None:
                    break
            parts = passed_on(tuple(encode(message)), exchange=to.exchange)
            if self._send(parts) and self._pacer is not None and self._pacer.sent_one():
                self._mark()
        if out.finished and out.credit >= _streams.WINDOW:
            self._settle(to.peer, out.sid)  # every byte credited: the session may go

    def _drain_streams(self) -> None:
        """Every turn: streams that waited for room go on, and settled ones are let go."""
        self._blocked = False
        for to, out in list(self._outgoing.values()):
            self._drain(to, out)

    def _settle(self, peer: bytes, sid: int) -> None:
        self._outgoing.pop((peer, sid), None)
        self.sessions.release(peer, sid)

    def _room(self) -> bool:
        """Whether the socket takes a message of a stream now, with no keepalive waiting
        before it and, to a broker, the window open."""
        if self._control and not self._push_control():
            return False
        if self._pacer is not None and not self._pacer.room():
            return False
        return sockets.writable(self._front)

    def _send(self, parts: list) -> bool:
        """True when it left. Never blocks: a peer that stops reading must not stall
        everyone else's answers; a keepalive waiting for room goes first (see `.dialing`)."""
        try:
            if self._control and not self._push_control():
                raise zmq.Again()
            sockets.send_frames(self._front, parts, sockets.NOBLOCK)
            return True
        except zmq.Again:
            if self._broker:  # a dialed worker's one peer: the broker, reached or not
                self._dropped(
                    f"the broker at {self._broker} is not taking messages (not connected yet, "
                    f"its handshake refused, or its queue full)"
                )
            else:
                self._dropped("its client is not reading its answers (its queue is full)")
        except zmq.ZMQError as exc:  # ROUTER_MANDATORY: the client is gone; say so, never silently
            self._dropped(f"its client is gone ({exc})")
        return False

    def _dropped(self, why: str) -> None:
        self.dropped += 1
        self._dropped_at = time.monotonic()  # a dialed worker says Hello closer meanwhile (`_hello_due`)
        if self.dropped == 1 or self.dropped % 1000 == 0:
            log.warning("an answer could not be delivered: %s (%d so far)", why, self.dropped)

    def _expire_streams(self, now: float) -> None:
        """Streams past their lifetime, or that nobody has moved for a while, are dropped."""
        for dropped in self._inbound.expire(now):  # its sender would wait to its deadline: tell it
            if dropped.reply is not None:
                self._reply(
                    dropped.reply,
                    Refusal(
                        f"this worker dropped the big message you were sending (stream {dropped.sid}): it came "
                        f"slower than {_streams.MIN_RATE >> 20} MiB/s after a grace of {_streams.GRACE:g} s; "
                        f"send it again, over a faster link or as a smaller value",
                        ref=dropped.ref,
                    ),
                    refusing=True,
                )
        idle = 3 * self.patience
        for key in [k for k, (_, out) in self._outgoing.items() if now - out.touched > idle]:
            self._settle(*key)

    def _push_control(self) -> bool:  # overridden by `Dialing`; a listening worker has no control
        return True

    def _mark(self) -> None:  # overridden by `Dialing`: only a dialed worker paces its answers
        pass
