"""A dialed worker's link to its broker: the offer, the keepalive, and what the broker says.

A worker that dials in (``--broker URL --offer NAME``) says ``Hello{offering}`` when it
connects, again on every reconnection (perhaps a broker that restarted), again after a
refusal (a backoff capped at ``MAX_BACKOFF``), and as a keepalive every ``KEEPALIVE``
patiences. Between keepalives its connection's pings (one a patience, with a time to live)
say it is there, and a Hello from the broker (a check, while clients wait on it) is
answered with Ready at once.

The keepalive is control, not bulk: it must reach the broker on time while the worker is
busy answering a flood or streaming a big answer. So the serving loop looks at its timer
first thing every turn, before it sends anything else; a keepalive the socket cannot take
now (its queue full of answers) waits in ``_control`` and takes the first place that frees,
ahead of every answer (:meth:`Outbox._send` tries it first), never dropped; and answers
streaming back leave only while the socket has room, a window at a time, so a keepalive
never queues behind a long stream. ZMTP heartbeats (``sockets.heartbeat``) check the
connection itself beneath all of this.

What is not for here: the conversation with clients (:mod:`somatize.fabric.worker.loop`), sending answers
(:mod:`somatize.fabric.worker.outbox`).
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any

import zmq

from ...errors import ProtocolError
from ...wire import Hello, Located, Ready, Refusal, Relay, Where, decode, encode, variant_of
from .. import mount as _mount
from .. import proofs as _proofs
from .. import sockets
from ..conversation import KEEPALIVE
from ..curve import HANDSHAKE_FAILED as _HANDSHAKE_FAILED
from ..curve import PROBE, Keys, as_client, speaks_curve
from .outbox import To
from .pacing import Pacer

if TYPE_CHECKING:
    from ...wire import Runtime
    from .. import streams as _streams
    from ..conversation import WorkerSessions
    from ..logs import Limiter
    from .slots import Job

#: The longest a dialed worker waits before saying Hello again to a broker that refused it.
MAX_BACKOFF = 30.0
#: Messages a dialed worker's socket queues for the broker at most: what a keepalive that
#: is due can find ahead of it (answers over that wait in the worker, streams a window each).
QUEUED = 256
log = logging.getLogger("somatize.worker")


class Dialing:
    """The broker side of :class:`~somatize.fabric.worker.loop.WorkerLoop` (a mixin: the
    loop's attributes are its own)."""

    _front: Any
    _offer: str | None
    _broker: str
    _events: zmq.Socket | None  # the connection's events (a monitor socket), once dialed
    _control: list
    patience: float
    mount: str | None
    _seen: str  # the token of our file in the mount folder, named in every Hello
    sessions: WorkerSessions  # clients with sessions here are waited on
    runtime: Runtime
    _identity: str
    _pacer: Pacer | None  # a dialed worker's window (`.pacing`), set by `dial`
    _marking: list  # a mark, encoded once (`dial`)
    _keyed: bool
    _accepted: bool
    _lost: bool
    _refused_keys: bool
    _backoff: float
    _hello_at: float
    _refused_at: float
    _next_hello: float
    _dropped_at: float
    _blocked: bool
    _running: dict[int, Job]
    _outgoing: dict[tuple[bytes, int], tuple[To, _streams.Outgoing]]
    _lines: Limiter

    if TYPE_CHECKING:  # the loop's own, or another mixin's (stubs for mypy alone: none at run time)

        def _take(self, to: To, frames: list, *, opened: bool = False) -> None: ...
        def _ready(self, proof: str = "") -> Ready: ...

    def dial(self, broker: str, offer: str, *, keys: Keys | None = None) -> None:
        """Connect to a broker and offer to serve the host called ``offer`` (Relayed).
        With ``keys``, ``keys.server_key`` is the broker's public key."""
        # one ping a patience: it notices a broker that went away, and its time to live says
        # we are here (the broker drops a connection silent past it) without waking the
        # broker's loop; the keepalive, every KEEPALIVE patiences, is the net beneath
        self._front = sockets.dealer(self.patience, pings=1)
        self._front.setsockopt(zmq.SNDHWM, QUEUED)
        if keys is not None:
            as_client(self._front, keys, None)
        # every (re)connection is a broker that may not know us: say Hello on each
        self._events = self._front.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | _HANDSHAKE_FAILED
        )
        if self.mount is not None and not self._seen:
            # a client that finds this file sees our folder: its cargo comes through it
            self._seen = _mount.mark(self.mount)
        self._front.connect(broker)
        self._broker = broker
        self._offer = offer
        self._identity = _proofs.identity(offer, None)  # what its clients' proofs are bound to
        self._pacer = Pacer()  # answers in a fair order, a window in flight (`.pacing`)
        self._marking = encode(Where(offer))  # a mark: the broker answers it once it read what came before
        self._keyed = keys is not None
        self._announce(time.monotonic())

    def _announce(self, now: float) -> None:
        """Hello to the broker: the first, a keepalive (`_hello_due`), or again after a
        refusal. It goes ahead of every answer waiting; a newer one replaces one not yet out."""
        self._next_hello = now + (self._backoff or self.patience * (KEEPALIVE if self._accepted else 1))
        self._control = [m for m in self._control if m[0] != "hello"]
        hello = Hello(
            self.runtime,
            offering=self._offer,
            seen=self._seen,
            mount=os.path.abspath(self.mount) if self.mount is not None else None,
        )
        self._control.append(("hello", encode(hello)))
        self._push_control()

    def _push_control(self) -> bool:
        """Send what control waits (a keepalive, a probe's Ready), ahead of everything else;
        True when nothing waits any more. Never blocks, never drops it: it waits for room."""
        while self._control:
            what, frames = self._control[0]
            try:
                self._front.send_multipart(frames, zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return False
            except zmq.ZMQError:
                self._control.clear()  # closed: the worker is stopping
                return True
            self._control.pop(0)
            if what == "hello":
                self._hello_at = time.monotonic()
            elif what == "mark":
                pacer = self._pacer
                assert pacer is not None  # marks are queued by `_mark`, only ever with a window (`dial`)
                pacer.marked(time.monotonic())
        return True

    def _mark(self) -> None:
        """A mark behind the answers sent so far (`.pacing`): control, so it never waits
        for the window it opens, and it leaves before any answer sent after it."""
        self._control.append(("mark", self._marking))
        self._push_control()

    def _keep_offering(self, now: float) -> None:
        if self._backoff and self._refused_at < self._hello_at and now - self._hello_at > min(2.0, self.patience):
            # our last Hello drew no refusal: taken (a keepalive is answered with silence)
            self._backoff = 0.0
            self._accepted = True
            self._next_hello = self._hello_at + KEEPALIVE * self.patience
        if now >= self._hello_due():
            self._announce(now)
        elif self._control:
            self._push_control()

    def _hello_due(self) -> float:
        """When the next Hello is due: a keepalive every `KEEPALIVE` patiences, or every
        half patience while clients may wait on this worker: work runs here, a stream goes
        out, or an answer found no room on the socket within the last patience (the broker
        holds a host with work open to the working limit: silent for a patience it is asked,
        for one and a half it is gone; two keepalives fit in that, so a long honest piece is
        never taken for a stopped worker). Said by whichever thread holds the socket (the
        stand-in, while a piece runs where it arrived), never by the piece. Clients that
        merely hold sessions here cost no more keepalives than an idle worker."""
        recently = time.monotonic() - self._dropped_at < self.patience
        if self._accepted and not self._backoff and (self._running or self._outgoing or self._blocked or recently):
            return min(self._next_hello, self._hello_at + self.patience / 2)
        return self._next_hello

    def _connection_events(self) -> None:
        while self._events is not None and sockets.readable(self._events):
            event = int.from_bytes(self._events.recv_multipart()[0][:2], "little")
            if event in (zmq.EVENT_HANDSHAKE_SUCCEEDED, zmq.EVENT_DISCONNECTED):
                pacer = self._pacer
                assert pacer is not None  # `dial` made both the events and the window
                pacer.reset()  # nothing of the old connection is in flight; no mark will be answered
                self._control = [m for m in self._control if m[0] != "mark"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                if self._lost:
                    log.info("reached the broker at %s again; offering `%s`", self._broker, self._offer)
                self._lost = self._refused_keys = False
                self._backoff = 0.0
                self._announce(time.monotonic())  # perhaps a broker that restarted: it learns about us now
            elif event & _HANDSHAKE_FAILED:
                if not self._refused_keys:  # once per spell: ZeroMQ tries again every few seconds
                    self._refused_keys = True
                    if self._keyed:
                        log.error(
                            "the broker at %s refused this worker's CURVE handshake: is this worker's "
                            "public key in the broker's --allow-workers folder (then reload the broker), "
                            "and is --broker-key the broker's own `.key`? Dialing again meanwhile",
                            self._broker,
                        )
                    elif speaks_curve(self._broker, PROBE):  # no keys, and the broker asks for them
                        log.error(
                            "the broker at %s listens with CURVE keys and this worker has none: start "
                            "it with --key and --broker-key, and put its public key in the broker's "
                            "--allow-workers folder. Dialing again meanwhile",
                            self._broker,
                        )
                    else:  # no keys: a handshake that failed is a broker too busy, or not a broker
                        log.warning(
                            "the handshake with the broker at %s failed (is it overloaded, or is "
                            "something else listening there?); dialing again",
                            self._broker,
                        )
            elif event == zmq.EVENT_DISCONNECTED and not self._lost:
                self._accepted, self._lost = False, True
                log.warning("lost the broker at %s; dialing again", self._broker)

    def _from_broker(self, parts: list) -> None:
        """A relayed message for us, or the broker itself speaking: Ready to our Hello (or a
        probe), Refusal, a Hello checking on us."""
        try:
            variant = variant_of(parts)
            if variant is Relay:
                relay = decode(parts)  # its header only: the inner message is opened by _take
                assert isinstance(relay, Relay)  # as its header's variant said
                if relay.exchange > 0:
                    peer = b"relay:%d" % relay.exchange
                    tenant = relay.tenant or f"exchange:{relay.exchange}"
                    self._take(To(peer, tenant, exchange=relay.exchange), list(relay.inner))
                return
            if variant is Located:  # its answer to our oldest mark: it read what came before
                pacer = self._pacer
                assert pacer is not None  # a dialed worker's (`dial` made it)
                pacer.answered()
                return
            if variant not in (Ready, Refusal, Hello):
                raise ProtocolError(f"a broker does not send a worker a `{variant.__name__}`")
            message = decode(parts)
        except ProtocolError as exc:
            self._lines.say(
                logging.WARNING, "the broker at %s sent what this worker does not take: %s", self._broker, exc.why
            )
            return
        now = time.monotonic()
        if isinstance(message, Ready):
            if not self._accepted:
                log.info("the broker at %s took this worker's offer of `%s`", self._broker, self._offer)
                self._next_hello = self._hello_at + KEEPALIVE * self.patience  # taken: the net beneath now
            self._accepted, self._backoff = True, 0.0
        elif isinstance(message, Refusal):
            pacer = self._pacer
            assert pacer is not None  # a dialed worker's (`dial` made it)
            pacer.answered()  # an answer in line: to a mark, perhaps (a broker that lost our offer)
            # a restarted broker that does not know us (a late answer it cannot place), or a
            # refusal of our offer: neither is a reason to stop serving. Hello again, later.
            self._accepted = False
            self._refused_at = now
            self._backoff = min(MAX_BACKOFF, max(0.5, self._backoff * 2))
            self._next_hello = min(self._next_hello, now + self._backoff)
            self._lines.say(
                logging.WARNING,
                "the broker at %s refused this worker: %s; saying Hello again in %g s",
                self._broker,
                message.why,
                self._backoff,
            )
        else:
            # the broker checking on us: control, like a keepalive
            self._control = [m for m in self._control if m[0] != "ready"]  # one is enough
            self._control.append(("ready", encode(self._ready())))
            self._push_control()
