"""How a client's channel moves its messages: :class:`Transport`, which each
:class:`~.channel.Channel` holds (the channel holds the conversation and decides what goes;
its transport carries it, and hands back what came).

Sending: over the channel's own DEALER, or its lane of the client's one link to the broker;
a relayed message worth streaming goes as ``Begin`` and ``Chunk`` under the broker's credit,
so never more than a window of it sits in the broker. Receiving: on the calling thread, in
the receive itself (``RCVTIMEO``, ``LOOK_EVERY_MS``), as a bare socket would; every message
is a carrier (a piece of a stream, a credit, a message in a shared folder: the channel's
:class:`~.cargo.Cargo` reads that), opened here, or an answer, which the conversation
(:class:`~somatize.fabric.conversation.ClientExchange`) checks before anything acts on it.
Between receives the link is looked at: its events (a drop, a handshake refused), the
broker's word on a relayed worker, how long this waited, and the deadline.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import zmq

from ...engine import Deadline
from ...errors import Broken, Busy, KeysRefused, ProtocolError, Unreachable
from ...wire import CARRIERS, Begin, Bye, Chunk, Credit, Done, Failed, Mounted, Refusal, Relay, decode, encode
from .. import sockets
from .. import streams as _streams
from ..curve import HANDSHAKE_FAILED as _HANDSHAKE_FAILED
from ..curve import PROBE, as_client, hung_up
from .refusals import handshake_failed

if TYPE_CHECKING:
    from ...wire import Located
    from ..conversation import ClientExchange
    from ..curve import Keys
    from .cargo import Cargo
    from .link import Lane

#: How long a receive waits for an answer before the link's events, the broker's word and
#: the deadline are looked at (milliseconds): a link that drops is told within this.
LOOK_EVERY_MS = 50
#: A connected worker that does not answer Hello within this many patiences is Busy.
BUSY_FACTOR = 11


class Dropped(Broken):
    """The channel's own connection dropped: for a relayed host, that is the broker's."""


class PastDeadline(Exception):
    """A wait ran past the deadline; the broker turns it into ``Overdue`` with the names."""

    def __init__(self, waiting: str) -> None:
        super().__init__(waiting)
        self.waiting, self.waited = waiting, 0.0  # seconds since the work given up on was sent (0: none was)


#: A direct channel taken again within this long of being given back is not asked whether
#: its link dropped meanwhile (seconds): see ``Transport.dropped_while_idle``.
BACK_AT_ONCE = 0.002


class Transport:
    """How one :class:`~.channel.Channel`'s messages move: over a DEALER of its own, or its
    lane of the client's one link to the broker. It sends what the channel hands it and
    gives back the answers its conversation (``exchange``, which the channel holds too)
    lets through; a ``Mounted`` message it hands to the channel's ``cargo``. The channel
    decides; this carries."""

    def __init__(
        self,
        located: Located,
        address: str,
        patience: float,
        exchange: ClientExchange,
        cargo: Cargo,
        *,
        keys: Keys | None = None,
        server_key: bytes | None = None,
        still_there: Callable[[float], bool] | None = None,
        lane: Lane | None = None,
        ended: Any = None,
    ) -> None:
        self.host = located.host
        self.address = address
        self.relayed = located.path == "relayed"
        self.patience = patience
        self._declared = bool(located.key)  # the worker's key was declared (said when a handshake fails)
        self.keys, self.server_key = keys, server_key  # for the sentence when a handshake fails
        self.exchange = exchange
        self.cargo = cargo
        #: set when the broker that made this channel is closed (a ``threading.Event``): a
        #: wait for an answer then ends within a look, as ``Dropped``, which the broker says as ``Closed``
        self.ended = ended
        #: when the channel was last given back, idle (``time.monotonic()``; the broker sets it)
        self.idle_since = -1e9
        self.lane = lane  # a relayed channel: a lane of the client's one link to the broker
        self.still_there = still_there
        self._checked = time.monotonic()
        self.sock: zmq.Socket | None  # None exactly when `lane` is not
        self.monitor: zmq.Socket | None  # None exactly when `lane` is not
        if lane is not None:
            self.sock = self.monitor = None
            self.linked = lane.link.linked
        else:
            self.sock = sockets.dealer(patience)
            if keys is not None:
                as_client(self.sock, keys, server_key)
            # an established link dropping, or a server refusing our key
            self.monitor = self.sock.get_monitor_socket(
                zmq.EVENT_DISCONNECTED | _HANDSHAKE_FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED
            )
            self.linked = False  # the ZeroMQ handshake completed: someone is there
            # a receive waits this long for an answer, then the link is looked at (`_pump`)
            self.sock.setsockopt(zmq.RCVTIMEO, LOOK_EVERY_MS)
            self.sock.connect(self.address)
        self._outgoing: _streams.Outgoing | None = None
        self._inbound = _streams.Inbound(per_tenant=1, total=1)  # one answer at a time
        self._early: list = []  # answers that came while a stream went out, not read yet

    def close(self, *, quiet: bool = False) -> None:
        """``quiet``: a lane says no Bye of its own (its link is ending too: the broker then
        tells each worker of the link's exchanges: one message less per lane)."""
        if self.lane is not None:
            self.lane.close(quiet=quiet)  # its worker hears Bye; the link stays for the other lanes
            return
        sock = self.sock
        assert sock is not None  # a channel with no lane has a socket of its own
        if self.relayed and self.linked and not sock.closed:
            try:  # the broker ends this connection's exchanges now, not when they are crowded out
                sock.send_multipart(encode(Bye()), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        if not sock.closed:
            try:
                sock.disable_monitor()
            except zmq.ZMQError:
                pass
        sockets.close(self.monitor, sock)

    def dropped_while_idle(self) -> bool:
        """Whether the link dropped since the last work (a worker or broker restarted
        between calls): nothing of this channel's is in flight, so a fresh channel takes
        its place rather than the next work being lost to the drop.

        A direct channel taken again within ``BACK_AT_ONCE`` of its last answer (a loop of
        calls, most of them) is not asked: its link's events are read by a system call,
        and a drop within those two milliseconds is no likelier than one while the Work is
        sent a moment later, which nothing before the send could see either; both are told
        alike, by the wait for the answer watching the link. A worker that was stopped
        and started again is never back within that time."""
        if self.lane is not None:
            return self.lane.dropped() or self.lane.link.refused is not None
        if time.monotonic() - self.idle_since < BACK_AT_ONCE:
            return False
        dropped = False
        monitor = self.monitor
        assert monitor is not None  # a channel with no lane has a socket and a monitor of its own
        try:
            while sockets.readable(monitor):
                event = int.from_bytes(monitor.recv_multipart()[0][:2], "little")
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self.linked = True
                else:  # dropped, or a handshake refused (a fresh channel says why)
                    dropped = True
        except zmq.ZMQError:
            return True
        return dropped

    # -- sending -------------------------------------------------------------------------
    def send(self, frames: list, deadline: Deadline | None = None) -> None:
        if self.relayed and _streams.worth_streaming(frames):
            self._stream_out(frames, deadline)  # relayed: never more than a window in the broker
            return
        self._raw(frames)

    def _raw(self, frames: list) -> None:
        if self.lane is not None:  # the link puts it in an envelope naming host and lane
            self.lane.send(frames)
            return
        if self.relayed:  # the broker opens the envelope and passes the message on
            frames = encode(Relay(host=self.host, inner=tuple(frames)))
        try:  # the sentence and its context manager only when it fails: this runs every call
            # no lane: a socket of its own (not checked here: this runs every call)
            sockets.send_frames(self.sock, frames)  # type: ignore[arg-type]
        except zmq.ZMQError as exc:
            with sockets.translated(f"the worker for `{self.host}` at {self.address}"):
                raise exc

    def _stream_out(self, frames: list, deadline: Deadline | None = None) -> None:
        out = self._outgoing = _streams.Outgoing(_streams.new_sid(), frames)
        try:
            self._raw(encode(out.begin()))
            while True:
                for chunk in out.chunks():
                    self._raw(encode(chunk))
                if out.finished:
                    return
                message = self._pump(None, "to send the rest of a stream", deadline)  # a credit, most likely
                if message is not None:
                    self._early.append(message)  # an answer before the end (a refusal)
                    if isinstance(message, (Refusal, Failed, Done)):
                        return  # the worker gave up on this message: no credit will come
        finally:
            self._outgoing = None

    # -- receiving -----------------------------------------------------------------------
    def next(self, answer_by: float | None, waiting: str, deadline: Deadline | None) -> Any:
        """The next answer from the worker. Raises if it goes away, if it is not reached by
        ``answer_by`` (``time.monotonic()``), or (``PastDeadline``) past ``deadline``."""
        if self._early:
            return self._early.pop(0)
        while True:
            message = self._pump(answer_by, waiting, deadline)
            if message is not None:
                return message

    def _pump(self, answer_by: float | None, waiting: str, deadline: Deadline | None) -> Any:
        """Take in one message: an answer the conversation allows now (returned), or a
        carrier, a piece of a stream or a stale answer (None)."""
        while True:
            if deadline is not None and deadline.left() < 0:
                self.exchange.give_up()
                raise PastDeadline(waiting)
            if self.lane is not None:
                parts = self.lane.receive(0.05, None if deadline is None else deadline.until)
                if parts is not None:
                    break
            else:  # waits up to LOOK_EVERY_MS, on the calling thread, as a bare socket would
                try:
                    # no lane: a socket of its own (not checked here: this runs every call)
                    parts = sockets.receive_frames(self.sock)  # type: ignore[arg-type]
                    break
                except zmq.Again:
                    pass
            self._watch_link(answer_by, waiting, deadline)
        try:
            message = self._open(decode(parts))
            return None if message is None else self.exchange.receive(message)
        except ProtocolError as exc:
            raise ProtocolError(
                f"what the worker for `{self.host}` at {self.address} sent could not be taken, so "
                f"this channel was dropped: {exc.why}"
            ) from exc

    def _open(self, message: Any) -> Any:
        """A carrier opened: the message it completes, or None while there is none yet."""
        if not isinstance(message, CARRIERS):  # most answers: nothing to open
            return message
        if isinstance(message, Credit):
            if self._outgoing is not None and self._outgoing.sid == message.sid:
                self._outgoing.grant(message.amount)
            return None
        if isinstance(message, Begin):
            self._inbound.begin(b"", "", message)
            return None
        if isinstance(message, Chunk):
            granted, frames = self._inbound.chunk(b"", message)
            self._raw(encode(Credit(message.sid, granted)))
            return None if frames is None else self._open(decode(frames))
        if isinstance(message, Mounted):  # read from the shared folder
            return self.cargo.opened(message)
        if isinstance(message, Relay):
            raise ProtocolError("a `Relay` envelope reached a client; the broker opens them")
        return message

    def _watch_link(self, answer_by: float | None, waiting: str, deadline: Deadline | None) -> None:
        """Between polls: the broker closed meanwhile, the link's events, the broker's word
        on a relayed worker, and how long this client has waited."""
        if self.ended is not None and self.ended.is_set():
            # the broker turns it into `Closed`, naming what ran there (`Broker._lost`)
            self.exchange.give_up()
            raise Dropped(f"this client was closed while this call waited {waiting} for `{self.host}`")
        if self.lane is not None:
            link = self.lane.link
            if link.refused is not None:
                raise KeysRefused(self._refusal(link.refused))
            if self.lane.dropped(None if deadline is None else deadline.until):
                raise Dropped(f"the connection to {self.address} dropped")
            self.linked = link.linked
        else:
            monitor = self.monitor
            assert monitor is not None  # a channel with no lane has a socket and a monitor of its own
            while sockets.readable(monitor):  # every event since the last look
                event = int.from_bytes(monitor.recv_multipart()[0][:2], "little")
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self.linked = True
                    continue
                if event & _HANDSHAKE_FAILED:
                    # the probe is a wait of this call's too: within what its deadline leaves
                    verdict = hung_up(
                        event,
                        self.keys,
                        self.address,
                        min(self.patience, PROBE),
                        within=None if deadline is None else deadline.left(),
                    )
                    if verdict is None or (deadline is not None and deadline.left() < 0):
                        self.exchange.give_up()
                        raise PastDeadline(waiting)
                    if verdict:
                        raise Dropped(f"the connection to {self.address} dropped during its handshake")
                    raise KeysRefused(self._refusal(event))
                raise Dropped(f"the connection to {self.address} dropped")
        if self.still_there is not None and time.monotonic() - self._checked > self.patience:
            self._checked = time.monotonic()
            if not self.still_there(bounded(self.patience * 2, deadline)):
                if deadline is not None and deadline.left() < 0:
                    self.exchange.give_up()
                    raise PastDeadline(waiting)
                raise Broken(f"the worker serving `{self.host}` through the broker is gone")
        if answer_by is not None and self.linked and time.monotonic() > answer_by + self.patience * BUSY_FACTOR:
            raise Busy(
                f"the worker for `{self.host}` at {self.address} is connected and alive, and has "
                f"not answered (this client waited {waiting}) for {self.patience * (BUSY_FACTOR + 1):.0f} s: "
                f"it is busy with other work (it runs one piece at a time unless started with --jobs N)"
            )
        if answer_by is not None and not self.linked and time.monotonic() > answer_by and self.relayed:
            raise Unreachable(
                f"the broker at {self.address} did not take this connection for `{self.host}` within "
                f"{self.patience:.0f} s (this client waited {waiting}): is it overloaded, or gone? "
                f"`systemctl status somatize-broker` on its machine says"
            )
        if answer_by is not None and not self.linked and time.monotonic() > answer_by:
            raise Unreachable(
                f"nobody answered at {self.address} for `{self.host}` within {self.patience:.0f} s "
                f"(this client waited {waiting}): is a worker listening there? Start one with "
                f"`python -m somatize.worker --listen {self.address.split('://')[-1]}`."
            )

    def _refusal(self, event: int) -> str:
        """Why the handshake failed, with the fix, from whose keys this channel used."""
        return handshake_failed(
            event,
            host=self.host,
            address=self.address,
            relayed=self.relayed,
            keys=self.keys,
            server_key=self.server_key,
            declared=self._declared,
        )


def bounded(seconds: float, deadline: Deadline | None) -> float:
    """``seconds``, or less when the deadline comes first (never below a moment)."""
    return seconds if deadline is None else max(0.05, min(seconds, deadline.left()))
