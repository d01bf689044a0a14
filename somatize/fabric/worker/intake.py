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

The express way in (:meth:`Intake.expressed`): a ``Work`` that names a recipe its peer sent
before, of one scalar and nothing else (most calls), is read by msgspec alone and asked of
the conversation in one look (``WorkerSessions.recall``), which gives it back opened exactly
when ``receive`` would; anything else, or anything the conversation would refuse, goes the
general way above untouched, which says what is wrong.

What the conversation allows (a ``Hello``, a ``Provision``, a ``Work`` with its cargo) is
given back to the loop, which acts on it (:mod:`somatize.fabric.worker.loop`); what it
refuses is answered here, through the outbox.

What is not for here: the socket loop and revocation (:mod:`somatize.fabric.worker.loop`),
running work (:mod:`somatize.fabric.worker.running`), sending (:mod:`somatize.fabric.worker.outbox`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from ...errors import ProtocolError, Refused
from ...wire import (
    Begin,
    Credit,
    Hello,
    Mounted,
    Provision,
    Refusal,
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
from ..conversation import Act, Unheld, Unknown, Violation
from . import attachments as _attachments
from .attachments import Taken
from .outbox import To

if TYPE_CHECKING:
    from ..conversation import WorkerSessions
    from .outbox import Outbox

#: What the conversation lets a worker act on: the act (`conversation.WORKER_TABLE`), the
#: message, and the cargo of a Work that came in a shared folder.
Allowed = tuple[Act, Hello | Provision | Work, Mounted | Taken | None]


class Intake:
    """What arrives at a worker, opened and asked of the conversation. Owns the streams
    coming in (``inbound``), the mappings of its clients' pooled segments, who this worker is
    to its clients (``identity``, for the proofs it answers; the loop sets it as it binds or
    dials) and a count of pieces of streams that arrived for nobody (``withheld``). Handed
    the sessions, the mount folder and the outbox (refusals, credits for streams both ways).
    Touched only by the thread holding the socket."""

    def __init__(self, sessions: WorkerSessions, mount: str | None, outbox: Outbox) -> None:
        self.sessions = sessions
        self.mount = mount
        self.outbox = outbox
        self.identity = _proofs.identity(None, None)  # who this worker is to its clients (`proofs.identity`)
        self.inbound = _streams.Inbound()  # big messages streaming in through a broker
        self.withheld = 0  # pieces of streams for nobody: dropped, never answered
        self._attached: _attachments.Attachments | None = None

    def _attachments(self) -> _attachments.Attachments:
        """The mappings of this worker's clients' pooled segments, kept between calls."""
        found = self._attached
        if found is None:
            found = self._attached = _attachments.Attachments(self.mount or "")
        return found

    def take(self, to: To, frames: list, *, opened: bool = False) -> Allowed | None:
        """One message from ``to``: what the conversation's table says to do with it
        (`WorkerSessions.step`, asked of its header's variant before anything is opened), done
        here for a carrier (a stream's piece carried, a ``Mounted`` opened into the Work it
        carries, a chunk for nobody dropped) and for a Bye (its streams in go); a Hello, a
        Provision or a Work is given back with its act, for the loop to carry out. Whatever is
        refused is answered ``Refusal``, naming the Work it refuses (read from its header),
        unless that ref is open (a duplicate)."""
        mounted: Mounted | Taken | None = None  # its cargo, in a shared folder
        arrived = frames
        try:
            kind = variant_of(frames)
            act = self.sessions.step(to.peer, kind)  # from a peer not greeted, only Hello and Bye get past
            if act is Act.DROP:  # a chunk or credit of no stream: a refusal would read as an answer
                self.withheld += 1
                return None
            if opened and act in (Act.CARRY, Act.OPEN):
                raise Violation(f"a `{kind.__name__}` cannot travel inside another carrier")
            message = decode(frames)  # a carrier comes back as itself, its cargo unopened
            if act is Act.CARRY:
                return self._stream(to, message)
            if act is Act.OPEN:
                assert isinstance(message, Mounted)  # the table's OPEN is a Mounted's
                message, mounted = self._open(to, message)
                act = Act.RUN  # the Work it carried runs: the table's (GREETED, Work)
            # the conversation gives back only these (its `receive` is typed `object`)
            message = self.sessions.receive(to.peer, message, to.tenant, now=time.monotonic(), act=act)
        except (ProtocolError, Refused) as exc:  # Violation is a ProtocolError
            why = getattr(exc, "why", None) or str(exc)
            ref = ref_of(arrived)
            if ref is not None and self.sessions.is_open(to.peer, ref):
                ref = None  # a second Work with the ref of one running: this refusal ends nothing
            refused = Refusal(why, ref=ref, hello=isinstance(exc, Unknown), recipe=isinstance(exc, Unheld))
            self.outbox.reply(to, refused, refusing=True)
            return None
        if act is Act.FORGET:
            self.inbound.drop(to.peer)
            return None
        assert isinstance(message, (Hello, Provision, Work))  # what the table lets the loop act on
        return act, message, mounted

    def _open(self, to: To, message: Mounted) -> tuple[Work, Mounted | Taken]:
        """The Work a ``Mounted`` carries, and what holds its cargo: only files this very
        session lent, under its seal, asked before anything is opened."""
        if self.mount is None:
            raise Violation("this worker sees no shared directory; start it with --mount DIR")
        if not message.files:  # cargo with no files of its client's is never swept
            raise Violation("a `Mounted` names the files of its frames; this one names none")
        self.sessions.carries(to.peer, message)
        mounted: Mounted | Taken
        if message.spans:  # pooled segments: views of the client's memory, no copy
            frames, mounted = self._attachments().take(message)
        else:  # one file per frame: the client removes them
            mounted = message
            frames, _ = _mount.read(mounted, self.mount)
        if variant_of(frames) is not Work:
            raise Violation(f"a `Mounted` carries Work, not a `{variant_of(frames).__name__}`")
        work = decode(frames)
        assert isinstance(work, Work)  # the variant its header names
        del frames  # only the work's input points into the segments now...
        if isinstance(mounted, Taken):
            work = mounted.detach(work)  # ...and it is held by `mounted` until it runs
        return work, mounted

    def prove(self, peer: bytes, hello: Hello) -> str:
        """The answer to a Hello naming a proof's file (``Hello.prove``): what this worker
        read there, bound to who it is, and the key of the session's seals from it; ``""``
        when it reads nothing there (it does not see the client's folder, or has none)."""
        if not hello.prove or self.mount is None:
            return ""
        nonce = _proofs.answer(self.mount, hello.prove)
        if nonce is None:
            return ""
        self.sessions.proven(peer, _proofs.seal_key(nonce))
        return _proofs.proof_of(nonce, self.identity)

    def expressed(self, to: To, frame: Any) -> Work | None:
        """The express way in: a ``Work`` naming a recipe ``to`` sent before, of one scalar
        and nothing else (``wire.short.express``: read by msgspec, every field checked),
        from a peer the conversation knows, with its recipe and opened; None for anything
        else, looked at no further (:meth:`take` reads it the general way and says what is
        wrong). Skips the carriers, the variant checks and the general decoder, none of
        which such a frame needs."""
        work = short.express(short.head_of(frame))
        if type(work) is not Work:
            return None
        return self.sessions.recall(to.peer, work, now=time.monotonic())

    def _stream(self, to: To, message: Any) -> Allowed | None:
        if isinstance(message, Credit):
            self.outbox.credit(to.peer, message.sid, message.amount)
            return None
        if isinstance(message, Begin):
            self.inbound.begin(to.peer, to.tenant or to.peer.hex(), message, reply=to)
            return None
        granted, frames = self.inbound.chunk(to.peer, message)
        self.outbox.deliver(to, encode(Credit(message.sid, granted)))
        if frames is not None:
            return self.take(to, frames, opened=True)
        return None

    def drop(self, peer: bytes) -> None:
        """``peer``'s session is over (it left, or its key was revoked): its streams in go."""
        self.inbound.drop(peer)

    def streaming(self) -> bool:
        """Whether a stream comes in."""
        return bool(self.inbound)

    def expire(self, now: float) -> None:
        """Streams coming in past their lifetime, or that nobody moved for a while, are
        dropped, and their senders told."""
        for dropped in self.inbound.expire(now):  # its sender would wait to its deadline: tell it
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
