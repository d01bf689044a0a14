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
now (its queue full of answers) waits in the link's ``control`` and takes the first place
that frees, ahead of every answer (the outbox asks :meth:`BrokerLink.cleared` before each
send), never dropped; and answers streaming back leave only while the socket has room, a
window at a time (the link's ``pacer``, :mod:`somatize.fabric.worker.pacing`), so a
keepalive never queues behind a long stream. ZMTP heartbeats (``sockets.heartbeat``) check
the connection itself beneath all of this.

What is not for here: the conversation with clients (:mod:`somatize.fabric.worker.intake`),
sending answers (:mod:`somatize.fabric.worker.outbox`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import zmq

from ...errors import ProtocolError
from ...wire import Bye, Hello, Located, Ready, Refusal, Relay, Where, decode, encode, variant_of
from .. import mount as _mount
from .. import sockets
from ..conversation import KEEPALIVE
from ..curve import HANDSHAKE_FAILED as _HANDSHAKE_FAILED
from ..curve import PROBE, Keys, as_client, speaks_curve
from .outbox import To
from .pacing import Pacer

if TYPE_CHECKING:
    from ...wire import Runtime
    from ..logs import Limiter

#: The longest a dialed worker waits before saying Hello again to a broker that refused it.
MAX_BACKOFF = 30.0
#: Messages a dialed worker's socket queues for the broker at most: what a keepalive that
#: is due can find ahead of it (answers over that wait in the worker, streams a window each).
QUEUED = 256
log = logging.getLogger("somatize.worker")


class BrokerLink:
    """A dialed worker's connection to its broker (Relayed), and everything it keeps about it:
    the offer and its keepalive, whether the broker took it, the control that goes ahead of
    every answer, and the window the answers go through (``pacer``). Made by
    :meth:`~somatize.fabric.worker.loop.WorkerLoop.dial`; handed ``ready`` (this worker's
    ``Ready`` now, for the broker's check) and the log limiter. Touched only by the thread
    holding the socket."""

    def __init__(
        self,
        broker: str,
        offer: str,
        *,
        keys: Keys | None,
        runtime: Runtime,
        patience: float,
        mount: str | None,
        ready: Callable[[], Ready],
        lines: Limiter,
    ) -> None:
        self.broker = broker
        self.offer = offer
        self.runtime = runtime
        self.patience = patience
        self.mount = mount
        self.ready = ready
        self.lines = lines
        # one ping a patience: it notices a broker that went away, and its time to live says
        # we are here (the broker drops a connection silent past it) without waking the
        # broker's loop; the keepalive, every KEEPALIVE patiences, is the net beneath
        self.front = sockets.dealer(patience, pings=1)
        self.front.setsockopt(zmq.SNDHWM, QUEUED)
        if keys is not None:
            as_client(self.front, keys, None)
        # every (re)connection is a broker that may not know us: say Hello on each
        self.events: zmq.Socket = self.front.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | _HANDSHAKE_FAILED
        )
        # a client that finds this file sees our folder: its cargo comes through it
        self.seen = _mount.mark(mount) if mount is not None else ""  # its token, named in every Hello
        self.front.connect(broker)
        self.pacer = Pacer()  # answers in a fair order, a window in flight (`.pacing`)
        self.marking = encode(Where(offer))  # a mark: the broker answers it once it read what came before
        self.keyed = keys is not None
        self.control: list = []  # what goes ahead of every answer: (kind, frames), kind "hello", "ready" or "mark"
        self.accepted = False  # the broker answered our Hello with Ready
        self.lost = False  # the connection to the broker dropped, said once until it is back
        self.refused_keys = False  # the broker's handshake refused our keys, said once
        self.backoff = 0.0  # seconds to the next Hello after a refusal (0: none pending)
        self.hello_at = self.refused_at = 0.0
        self.next_hello = 0.0

    def announce(self, now: float) -> None:
        """Hello to the broker: the first, a keepalive (`hello_due`), or again after a
        refusal. It goes ahead of every answer waiting; a newer one replaces one not yet out."""
        self.next_hello = now + (self.backoff or self.patience * (KEEPALIVE if self.accepted else 1))
        self.control = [m for m in self.control if m[0] != "hello"]
        hello = Hello(
            self.runtime,
            offering=self.offer,
            seen=self.seen,
            mount=os.path.abspath(self.mount) if self.mount is not None else None,
        )
        self.control.append(("hello", encode(hello)))
        self.push_control()

    def push_control(self) -> bool:
        """Send what control waits (a keepalive, a probe's Ready, a mark), ahead of everything
        else; True when nothing waits any more. Never blocks, never drops it: it waits for room."""
        while self.control:
            what, frames = self.control[0]
            try:
                self.front.send_multipart(frames, zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return False
            except zmq.ZMQError:
                self.control.clear()  # closed: the worker is stopping
                return True
            self.control.pop(0)
            if what == "hello":
                self.hello_at = time.monotonic()
            elif what == "mark":
                self.pacer.marked(time.monotonic())
        return True

    def waiting(self) -> bool:
        """Whether control waits for room on the socket."""
        return bool(self.control)

    def cleared(self) -> bool:
        """Whether nothing of control waits before an answer: what waited is sent now if the
        socket takes it. An answer leaves only after it (see :meth:`push_control`)."""
        return not self.control or self.push_control()

    def mark(self) -> None:
        """A mark behind the answers sent so far (`.pacing`): control, so it never waits
        for the window it opens, and it leaves before any answer sent after it."""
        self.control.append(("mark", self.marking))
        self.push_control()

    def keep_offering(self, now: float, waited: bool) -> None:
        """Every turn, first: a keepalive or a Hello again when due, else what control waits.
        ``waited``: clients may wait on this worker now (see :meth:`hello_due`)."""
        if self.backoff and self.refused_at < self.hello_at and now - self.hello_at > min(2.0, self.patience):
            # our last Hello drew no refusal: taken (a keepalive is answered with silence)
            self.backoff = 0.0
            self.accepted = True
            self.next_hello = self.hello_at + KEEPALIVE * self.patience
        if now >= self.hello_due(waited):
            self.announce(now)
        elif self.control:
            self.push_control()

    def hello_due(self, waited: bool) -> float:
        """When the next Hello is due: a keepalive every `KEEPALIVE` patiences, or every
        half patience while clients may wait on this worker (``waited``: work runs here, a
        stream goes out, or an answer found no room on the socket within the last patience;
        the broker holds a host with work open to the working limit: silent for a patience
        it is asked, for one and a half it is gone; two keepalives fit in that, so a long
        honest piece is never taken for a stopped worker). Said by whichever thread holds
        the socket (the stand-in, while a piece runs where it arrived), never by the piece.
        Clients that merely hold sessions here cost no more keepalives than an idle worker."""
        if self.accepted and not self.backoff and waited:
            return min(self.next_hello, self.hello_at + self.patience / 2)
        return self.next_hello

    def due(self, waited: bool) -> float:
        """When the link has something to do on its own: the next Hello, or, a Hello not
        refused yet after a refusal, the moment it is taken."""
        due = self.hello_due(waited)
        if self.backoff and self.refused_at < self.hello_at:  # a Hello not refused yet: taken, soon
            due = min(due, self.hello_at + min(2.0, self.patience))
        return due

    def connection_events(self) -> None:
        while sockets.readable(self.events):
            event = int.from_bytes(self.events.recv_multipart()[0][:2], "little")
            if event in (zmq.EVENT_HANDSHAKE_SUCCEEDED, zmq.EVENT_DISCONNECTED):
                self.pacer.reset()  # nothing of the old connection is in flight; no mark will be answered
                self.control = [m for m in self.control if m[0] != "mark"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                if self.lost:
                    log.info("reached the broker at %s again; offering `%s`", self.broker, self.offer)
                self.lost = self.refused_keys = False
                self.backoff = 0.0
                self.announce(time.monotonic())  # perhaps a broker that restarted: it learns about us now
            elif event & _HANDSHAKE_FAILED:
                if not self.refused_keys:  # once per spell: ZeroMQ tries again every few seconds
                    self.refused_keys = True
                    if self.keyed:
                        log.error(
                            "the broker at %s refused this worker's CURVE handshake: is this worker's "
                            "public key in the broker's --allow-workers folder (then reload the broker), "
                            "and is --broker-key the broker's own `.key`? Dialing again meanwhile",
                            self.broker,
                        )
                    elif speaks_curve(self.broker, PROBE):  # no keys, and the broker asks for them
                        log.error(
                            "the broker at %s listens with CURVE keys and this worker has none: start "
                            "it with --key and --broker-key, and put its public key in the broker's "
                            "--allow-workers folder. Dialing again meanwhile",
                            self.broker,
                        )
                    else:  # no keys: a handshake that failed is a broker too busy, or not a broker
                        log.warning(
                            "the handshake with the broker at %s failed (is it overloaded, or is "
                            "something else listening there?); dialing again",
                            self.broker,
                        )
            elif event == zmq.EVENT_DISCONNECTED and not self.lost:
                self.accepted, self.lost = False, True
                log.warning("lost the broker at %s; dialing again", self.broker)

    def heard(self, parts: list) -> tuple[To, list] | None:
        """What the broker sent: a relayed message for us, given back with whom it is from
        (the intake takes it), or the broker itself speaking, handled here: Ready to our
        Hello (or a probe), Refusal, a Hello checking on us."""
        try:
            variant = variant_of(parts)
            if variant is Relay:
                relay = decode(parts)  # its header only: the inner message is opened by the intake
                assert isinstance(relay, Relay)  # as its header's variant said
                if relay.exchange > 0:
                    peer = b"relay:%d" % relay.exchange
                    tenant = relay.tenant or f"exchange:{relay.exchange}"
                    return To(peer, tenant, exchange=relay.exchange), list(relay.inner)
                return None
            if variant is Located:  # its answer to our oldest mark: it read what came before
                self.pacer.answered()
                return None
            if variant not in (Ready, Refusal, Hello):
                raise ProtocolError(f"a broker does not send a worker a `{variant.__name__}`")
            message = decode(parts)
        except ProtocolError as exc:
            self.lines.say(
                logging.WARNING, "the broker at %s sent what this worker does not take: %s", self.broker, exc.why
            )
            return None
        now = time.monotonic()
        if isinstance(message, Ready):
            if not self.accepted:
                log.info("the broker at %s took this worker's offer of `%s`", self.broker, self.offer)
                self.next_hello = self.hello_at + KEEPALIVE * self.patience  # taken: the net beneath now
            self.accepted, self.backoff = True, 0.0
        elif isinstance(message, Refusal):
            self.pacer.answered()  # an answer in line: to a mark, perhaps (a broker that lost our offer)
            # a restarted broker that does not know us (a late answer it cannot place), or a
            # refusal of our offer: neither is a reason to stop serving. Hello again, later.
            self.accepted = False
            self.refused_at = now
            self.backoff = min(MAX_BACKOFF, max(0.5, self.backoff * 2))
            self.next_hello = min(self.next_hello, now + self.backoff)
            self.lines.say(
                logging.WARNING,
                "the broker at %s refused this worker: %s; saying Hello again in %g s",
                self.broker,
                message.why,
                self.backoff,
            )
        else:
            # the broker checking on us: control, like a keepalive
            self.control = [m for m in self.control if m[0] != "ready"]  # one is enough
            self.control.append(("ready", encode(self.ready())))
            self.push_control()
        return None

    def bye(self) -> None:
        """Closing: Bye to the broker (if the socket takes it now), and no more events."""
        if self.front.closed:
            return
        try:
            self.front.send_multipart(encode(Bye()), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        try:
            self.front.disable_monitor()
        except zmq.ZMQError:
            pass
