"""How a worker takes a message in, and from whom: carriers opened, the conversation asked.

Every message from a peer is checked by
:class:`~somatize.fabric.conversation.WorkerSessions` before anything acts on it. From a peer
that has not said ``Hello`` only ``Hello`` and ``Bye`` are decoded; anything else is refused
by its header's variant alone (``Refusal(hello=True)``), except a piece of a stream
(``Chunk``, ``Credit``), which is dropped and counted: its stream was refused at its
``Begin``, or its session ended, and a refusal would read as an answer. A refusal of a
``Work`` names its ref (read from the header, ``wire.ref_of``), so the client never takes
it for the answer to another; a second Work with the ref of one still running is refused
without a ref, and the running one goes on.

The express way in (``_expressed``): a ``Work`` that names a recipe its peer sent before,
of one scalar and nothing else (most calls), is read by msgspec alone and asked of the
conversation in one look (``WorkerSessions.recall``), which gives it back opened exactly
when ``receive`` would; anything else, or anything the conversation would refuse, goes the
general way above untouched, which says what is wrong.

Revocation: after a reload of the allow-list (a listening worker with keys), every session
of a key no longer allowed ends (:meth:`Intake._revoke`).

What is not for here: the socket loop (:mod:`somatize.fabric.worker.loop`), sending (:mod:`somatize.fabric.worker.outbox`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from ...errors import ProtocolError, Refused
from ...wire import (
    Begin,
    Bye,
    Chunk,
    Credit,
    Hello,
    Mounted,
    Provision,
    Refusal,
    Relay,
    Work,
    decode,
    encode,
    ref_of,
    short,
    variant_of,
)
from .. import mount as _mount
from .. import proofs as _proofs
from .. import streams as _streams
from ..conversation import Unheld, Unknown, Violation
from . import attachments as _attachments
from .outbox import To

if TYPE_CHECKING:
    from ..conversation import WorkerSessions
    from ..curve import Guard
    from .outbox import Outbox
    from .running import Runner

_CARRIERS = (Relay, Mounted, Begin, Chunk, Credit)


class Intake:
    """The receiving side of :class:`~somatize.fabric.worker.loop.WorkerLoop` (a mixin: the
    loop's attributes are its own)."""

    sessions: WorkerSessions
    mount: str | None
    _identity: str  # who this worker is to its clients (`proofs.identity`)
    withheld_pieces: int
    _guard: Guard | None  # a listening worker's allow-list of client keys, when it has keys
    _revoking: bool
    runner: Runner
    _inbound: _streams.Inbound
    outbox: Outbox

    if TYPE_CHECKING:  # the loop's own, or another mixin's (stubs for mypy alone: none at run time)

        def _provision(self, to: To, message: Provision) -> None: ...

    def _revoke(self) -> None:
        """On the thread holding the socket, after a reload: every session of a key no
        longer allowed ends. Its open work is refused (naming it) and abandoned: the piece
        runs no further node, and nothing it says afterwards leaves (its session is gone)."""
        self._revoking = False
        if self._guard is None:
            return
        allowed = self._guard.allowed()
        why = "this key is no longer allowed on this worker"
        for peer, tenant in self.sessions.peers():
            if not tenant or tenant in allowed:
                continue
            self.runner.abandon(peer)
            to = To(peer, tenant, route=peer)
            for ref in self.sessions.forget(peer):  # the last it hears of that work
                self.outbox.reply(to, Refusal(f"{why}; its work {ref} was abandoned", ref=ref), refusing=True)
            self._inbound.drop(peer)
            self.outbox.forget(peer)

    def _attachments(self) -> _attachments.Attachments:
        """The mappings of this worker's clients' pooled segments, kept between calls."""
        found = getattr(self, "_attached", None)
        if found is None:
            found = self._attached = _attachments.Attachments(self.mount or "")
        return found

    def _take(self, to: To, frames: list, *, opened: bool = False) -> None:
        """One message from ``to``: a carrier is opened, anything else checked by the
        conversation and acted on; whatever is refused is answered ``Refusal``, naming the
        Work it refuses (read from its header), unless that ref is open (a duplicate)."""
        mounted: Mounted | _attachments.Taken | None = None  # its cargo, in a shared folder
        arrived = frames
        try:
            # from a peer that has not said Hello only Hello and Bye are opened; the others
            # are told by their header's variant alone, and refused unopened
            if not self.sessions.greeted(to.peer):
                variant = variant_of(frames)
                if variant in (Chunk, Credit):
                    # of a stream refused at its Begin, or of an answer to a session that
                    # ended: nothing in it is for anyone; a refusal would read as an answer
                    self.withheld_pieces += 1
                    return
                if variant not in (Hello, Bye):
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
                # only files this very session lent, under its seal: before anything is opened
                self.sessions.carries(to.peer, message)
                if message.spans:  # pooled segments: views of the client's memory, no copy
                    frames, mounted = self._attachments().take(message)
                else:  # one file per frame: the client removes them
                    mounted = message
                    frames, _ = _mount.read(mounted, self.mount)
                if variant_of(frames) is not Work:
                    raise Violation(f"a `Mounted` carries Work, not a `{variant_of(frames).__name__}`")
                message = decode(frames)
                frames = []  # only the work's input points into the segments now...
                if isinstance(mounted, _attachments.Taken):
                    message = mounted.detach(message)  # ...and it is held by `mounted` until it runs
            # the conversation gives back only these (its `receive` is typed `object`)
            message = self.sessions.receive(to.peer, message, to.tenant, now=time.monotonic())
        except (ProtocolError, Refused) as exc:  # Violation is a ProtocolError
            why = getattr(exc, "why", None) or str(exc)
            ref = ref_of(arrived)
            if ref is not None and self.sessions.is_open(to.peer, ref):
                ref = None  # a second Work with the ref of one running: this refusal ends nothing
            refused = Refusal(why, ref=ref, hello=isinstance(exc, Unknown), recipe=isinstance(exc, Unheld))
            self.outbox.reply(to, refused, refusing=True)
            return
        if isinstance(message, Hello):
            self.outbox.reply(to, self.runner.ready(proof=self._prove(to.peer, message)))
        elif isinstance(message, Bye):
            self._inbound.drop(to.peer)
        elif isinstance(message, Provision):
            self._provision(to, message)
        else:
            self.runner.start(to, message, mounted)

    def _prove(self, peer: bytes, hello: Hello) -> str:
        """The answer to a Hello naming a proof's file (``Hello.prove``): what this worker
        read there, bound to who it is, and the key of the session's seals from it; ``""``
        when it reads nothing there (it does not see the client's folder, or has none)."""
        if not hello.prove or self.mount is None:
            return ""
        nonce = _proofs.answer(self.mount, hello.prove)
        if nonce is None:
            return ""
        self.sessions.proven(peer, _proofs.seal_key(nonce))
        return _proofs.proof_of(nonce, self._identity)

    def _expressed(self, to: To, frame: Any) -> Work | None:
        """The express way in: a ``Work`` naming a recipe ``to`` sent before, of one scalar
        and nothing else (``wire.short.express``: read by msgspec, every field checked),
        from a peer the conversation knows, with its recipe and opened; None for anything
        else, looked at no further (``_take`` reads it the general way and says what is
        wrong). Skips the carriers, the variant checks and the general decoder, none of
        which such a frame needs."""
        work = short.express(short.head_of(frame))
        if type(work) is not Work:
            return None
        return self.sessions.recall(to.peer, work, now=time.monotonic())

    def _stream(self, to: To, message: Any) -> None:
        if isinstance(message, Credit):
            self.outbox.credit(to.peer, message.sid, message.amount)
            return
        if isinstance(message, Begin):
            self._inbound.begin(to.peer, to.tenant or to.peer.hex(), message, reply=to)
            return
        granted, frames = self._inbound.chunk(to.peer, message)
        self.outbox.deliver(to, encode(Credit(message.sid, granted)))
        if frames is not None:
            self._take(to, frames, opened=True)

    def _expire_inbound(self, now: float) -> None:
        """Streams coming in past their lifetime are dropped, and their senders told."""
        for dropped in self._inbound.expire(now):  # its sender would wait to its deadline: tell it
            if dropped.reply is not None:
                self.outbox.reply(
                    dropped.reply,
                    Refusal(
                        f"this worker dropped the big message you were sending (stream {dropped.sid}): it came "
                        f"slower than {_streams.MIN_RATE >> 20} MiB/s after a grace of {_streams.GRACE:g} s; "
                        f"send it again, over a faster link or as a smaller value",
                        ref=dropped.ref,
                    ),
                    refusing=True,
                )
