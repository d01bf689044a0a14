"""A client's channel: one DEALER to one worker (or to the broker, for a relayed host).

A channel is used by one forward at a time; concurrent forwards borrow concurrent channels
(:class:`~somatize.fabric.client.handle.Broker` lends them). A channel that breaks is thrown away,
so a late answer from a worker that came back is never read. Its conversation (Hello,
Provision, Work and their answers) is checked by a
:class:`~somatize.fabric.conversation.ClientExchange`; what carries a message is a message
of the wire too: a ``Relay`` envelope naming the host for a relayed one, ``Begin`` /
``Chunk`` / ``Credit`` for a big relayed one (:mod:`somatize.fabric.streams`), ``Mounted`` for cargo in a
shared folder (:mod:`somatize.fabric.mount`).

Refusals: a refusal names the work it ends. ``Refusal(hello=True)`` (the worker forgot this
channel) or ``Refusal(recipe=True)`` (it holds no recipe by that digest) naming this Work
make the channel greet again, or send the recipe in full, and send the Work again: once
per Work, never more. A refusal that names no work, once the Work has been wholly sent, is
never taken for its answer: the channel ends with ``Refused`` saying the work's fate is not
known, and nothing is sent again. So a piece is never run twice by the library.

Before a value leaves, its codec kinds are checked against those the worker said at Hello
that it reads: a value it could not read is refused here, naming the kind, the host and
the fix, and no byte of it is sent.
"""

from __future__ import annotations

import itertools
import operator
import time
from collections.abc import Callable
from typing import Any

from ...codec.registered import readable_with, registered_now, registered_with
from ...engine import Deadline, Outcome, Piece
from ...errors import NodeFailed, ProtocolError, Refused
from ...packing import Packer
from ...wire import (
    Done,
    Failed,
    Hello,
    Located,
    NodeSpec,
    Provision,
    Ready,
    Recipe,
    Refusal,
    Runtime,
    Saw,
    Send,
    compatible,
    encode,
    peek_kinds,
    recipe_digest,
    short,
)
from .. import mount as _mount
from .. import proofs as _proofs
from .. import streams as _streams
from ..conversation import ClientExchange
from ..curve import Keys
from ..pieces import outcome_of, specs_of, work_of
from .cargo import Cargo
from .link import Lane
from .refusals import refusal, unreadable
from .transport import Transport

_refs = itertools.count(1)


#: Recipes whose digests are kept (for all channels: the packer gives the same spec for the
#: same node, unchanged, so the same specs make the same recipe), and digests one channel
#: keeps sending in full.
_MEMO_RECIPES = 256
_DIGESTS: dict[tuple, tuple[tuple[NodeSpec, ...], tuple, str | None]] = {}


class Channel:
    """One DEALER to one worker (directly, or through the broker for a relayed host): its
    conversation, which it holds and decides (``exchange``, a :class:`ClientExchange`), and
    the two pieces it owns: its ``transport`` (:class:`~.transport.Transport`), which moves
    its messages, and its ``cargo`` (:class:`~.cargo.Cargo`), where the big frames of its
    work go and come back from once its worker proved it sees a shared folder.

    The pump (the transport's): every message that arrives is a carrier (a piece of a
    stream, a credit, a mounted message), opened there, or an answer, which
    :class:`ClientExchange` checks against the state of the conversation before anything
    acts on it. A stale answer (of work given up on) is dropped and counted; an illegal one
    breaks the channel.
    """

    def __init__(
        self,
        located: Located,
        address: str,
        packer: Packer,
        provisioned: set[str],
        patience: float,
        *,
        keys: Keys | None = None,
        server_key: bytes | None = None,
        still_there: Callable[[float], bool] | None = None,
        deadline: Deadline | None = None,
        lane: Lane | None = None,
        views: bool = False,
        ended: Any = None,
    ) -> None:
        """``views``: answers' arrays as views of the segments lent (see ``Worker(views=)``);
        ``ended``: set when the broker that made this channel is closed (a
        ``threading.Event``): a wait for an answer then ends within a look."""
        self.host = located.host
        self.located = located
        self.packer = packer
        self.provisioned = provisioned
        self.patience = patience
        self.address = address
        self.relayed = located.path == "relayed"
        # where cargo may go, once the worker proves on this channel that it sees it (`_say_hello`)
        self._may_mount = _mount.folder_of(located)
        self._proving = _proofs.expected(located)  # who the worker must prove it is
        self._challenge: _proofs.Challenge | None = None  # the proof asked of the worker, not yet answered
        self.exchange = ClientExchange()
        # where its work's big frames go (whose segments they are lent: `lending`)
        self.cargo = Cargo(f"{self._proving}@{located.address}", views=views)
        self.transport = Transport(
            located,
            address,
            patience,
            self.exchange,
            self.cargo,
            keys=keys,
            server_key=server_key,
            still_there=still_there,
            lane=lane,
            ended=ended,
        )
        self.bound: Deadline | None = None  # the deadline the open work runs under
        self.sent_at: float | None = None  # when the open work was sent
        self.reads: frozenset[str] = frozenset()  # the kinds the worker said it reads
        self._sure_for: object = None  # the registry (`registered_now`) for which it reads all ours
        # recipes: sent in full once per connection, then named by digest (see `run`)
        self.held: set[str] = set()  # digests sent in full since the last Hello
        self._unkept: set[str] = set()  # ...that the worker did not keep: sent in full from then on
        self._last_full: str | None = None  # the digest of the last recipe sent in full
        self._greeting: float | None = None  # a Hello's answer is due by then, not yet read
        try:
            self._say_hello()  # a project-mode channel reads its answer with the first Work's (`run`)
            if self.packer.mode != "project":
                self._greeted(deadline)
        except BaseException:
            self.close()
            raise

    def close(self, *, quiet: bool = False) -> None:
        """``quiet``: a lane says no Bye of its own (its link is ending too: the broker then
        tells each worker of the link's exchanges: one message less per lane)."""
        self.cargo.let_go(self.exchange.state)
        self._unchallenge()
        self.transport.close(quiet=quiet)

    @property
    def lane(self) -> Lane | None:
        """A relayed channel's lane of the client's one link to the broker (its transport's);
        None: a socket of its own."""
        return self.transport.lane

    def dropped_while_idle(self) -> bool:
        """Whether the link dropped since the last work: see ``Transport.dropped_while_idle``."""
        return self.transport.dropped_while_idle()

    def given_back(self) -> None:
        """Given back, idle, now (``Transport.idle_since``)."""
        self.transport.idle_since = time.monotonic()

    def waited(self) -> float:
        """Seconds since the open work was sent (0 when none was)."""
        return 0.0 if self.sent_at is None else time.monotonic() - self.sent_at

    # -- the conversation ----------------------------------------------------------------
    def _hello(self, deadline: Deadline | None) -> None:
        self._say_hello()
        self._greeted(deadline)

    def _say_hello(self) -> None:
        self.held.clear()  # a worker greeted (again) holds no recipe of ours
        self._unkept.clear()
        self._sure_for = None  # and what it reads is what its answer to this Hello says
        self.exchange.hello_sent()
        self._mine = Runtime.here(mode=self.packer.mode)
        # a folder is believed seen by this worker only once it proves it, now: a new session
        # (a worker greeted again may be another process) proves it anew, under a new key
        self._unchallenge()
        self.cargo.proved(None, None)
        if self._may_mount is not None:
            try:
                self._challenge = _proofs.challenge(self._may_mount, named_by_peer=self.located.path != "mount")
            except Refused as exc:  # a declared folder that may not hold cargo: said by the first cargo
                self.cargo.unusable = exc
        self.transport.send(
            encode(Hello(self._mine, prove=self._challenge.name if self._challenge is not None else ""))
        )
        self._greeting = time.monotonic() + self.patience  # when its answer is due

    def _unchallenge(self) -> None:
        challenge, self._challenge = self._challenge, None
        if challenge is not None:
            challenge.remove()

    def _greeted(self, deadline: Deadline | None) -> None:
        """The answer to the Hello sent (`_say_hello`), read and checked."""
        answer_by, self._greeting = self._greeting, None
        answer = self.transport.next(answer_by, "for the worker to answer Hello", deadline)
        challenge = self._challenge
        self._unchallenge()  # read by now, or never
        if challenge is not None and isinstance(answer, Ready) and challenge.proves(answer.proof, self._proving):
            self.cargo.proved(self._may_mount, _proofs.seal_key(challenge.nonce))
        mine = self._mine
        if isinstance(answer, Refusal):
            raise refusal(
                answer.why,
                f"{self._refuser()} refused this client a channel to `{self.host}`",
                busy=f"the worker for `{self.host}` is busy and took no new client",
            )
        self.reads = frozenset(answer.runtime.kinds)
        why = compatible(mine, answer.runtime, needs_pickle=self.packer.mode == "network")
        if why is None and self.packer.mode == "network" and answer.runtime.mode != "network":
            why = (
                f"the worker for `{self.host}` runs in {answer.runtime.mode or 'project'} mode and "
                f'takes no code by value; declare it with mode="project", or start it with --mode network'
            )
        if why is not None:
            raise Refused(why)

    def run(
        self, piece: Piece, watch: Any, deadline: Deadline | None = None, *, host: Callable[[], Deadline] | None = None
    ) -> Outcome:
        """Send ``piece`` and wait for its outcome. ``deadline`` (the forward's) bounds every
        wait; ``host`` starts the host's own deadline, which bounds the waits from when the
        Work is first sent (after its code was handed over), the sooner of the two."""
        if watch is None and deadline is None and host is None and self._greeting is None:
            outcome = self._express(piece)
            if outcome is not None:
                return outcome
        ref = next(_refs)
        specs = specs_of(piece, self.packer)  # packed once per group, kept with the graph's plan
        watched = watch is not None
        # the recipe travels in full the first time on this connection, then by its digest
        digest = self._digest_of(specs, piece.shape)
        named = digest if digest is not None and digest in self.held else ""
        written_with = registered_now()
        frames = encode(work_of(piece, ref, specs, watched=watched, named=named))
        code = tuple(
            dict.fromkeys(s.target for s in specs if s.source == "network" and s.target not in self.provisioned)
        )
        if self._greeting is not None and not self._may_follow_hello(frames, code):
            self._greeted(deadline)
        if self._greeting is None:
            self._check_kinds(frames, written_with)
        try:
            self._provision(code, deadline)
            if host is not None:
                deadline = host().sooner(deadline)
            self.bound = deadline
            return self._settle(piece, ref, specs, digest, named, frames, None, watch, deadline)
        finally:
            self.cargo.let_go(self.exchange.state)

    def _express(self, piece: Piece) -> Outcome | None:
        """A repeated small call, the short way: no watcher, no deadline, the channel
        greeted, the worker holding its recipe for this connection and its code, its kinds
        known readable, and one scalar in, with no keys or placement, so that its ``Work`` is
        one frame msgspec writes without a ``Work`` being built. None, having sent nothing,
        for any other piece (``run`` takes it the general way). Once sent, an answer other
        than its ``Done`` is taken as the general way takes it (``_settle``): a refusal, a
        request for code, a failure."""
        if piece.keys or self.transport.lane is not None:
            return None
        specs = specs_of(piece, self.packer)
        digest = self._digest_of(specs, piece.shape)
        if digest is None or digest not in self.held or self._sure_for is not registered_now():
            return None
        for spec in specs:
            if spec.source == "network" and spec.target not in self.provisioned:
                return None
        for step in piece.steps:
            if step.device is not None:
                return None
        ref = next(_refs)
        frames = short.work_frames(ref, piece.value, False, digest)
        if frames is None:
            return None
        self.bound = None
        try:
            self._send_work(ref, frames)
            answer = self._answer(None)
            if type(answer) is Done:
                return self._outcome(answer, piece)
            return self._settle(piece, ref, specs, digest, digest, frames, answer, None, None)
        finally:
            cargo = self.cargo
            if cargo.mounted or cargo.lending is not None:  # this runs every call: most hold none
                cargo.let_go(self.exchange.state)

    def _settle(
        self,
        piece: Piece,
        ref: int,
        specs: tuple[NodeSpec, ...],
        digest: str | None,
        named: str,
        frames: list,
        answer: Any,
        watch: Any,
        deadline: Deadline | None,
    ) -> Outcome:
        """Send the Work (``frames``, its recipe ``named`` by ``digest`` or in full) and take
        its answers until its outcome; with ``answer``, it was sent already and that came
        back first. A request for code is met, a worker that forgot this channel greeted again
        and one without the recipe sent it in full, and the Work goes again: once, never more."""
        resent = False
        for _ in range(4):
            if answer is None:
                self._send_work(ref, frames, deadline)
                if self._greeting is not None:  # the Work went right behind the Hello: its answer first
                    self._greeted(deadline)
                if digest is not None and not named:
                    self._last_full = digest
                    if digest not in self._unkept:
                        self.held.add(digest)  # in full: the worker keeps it for this connection
                answer = self._answer(watch, deadline)
            if isinstance(answer, Send):
                self.provisioned.difference_update(answer.digests)
                self._provision(answer.digests, deadline, asked=True)
                answer = None
                continue
            if answer is self.exchange.unplaced:
                assert answer is not None  # an answer taken (never None): `unplaced` is set
                raise Refused(
                    f"the worker for `{self.host}` refused without naming the work sent to it, "
                    f"after it was sent: {answer.why}. That is not this work's answer, so whether "
                    f"it ran is not known; it was not sent again (it may have run)"
                )
            if isinstance(answer, Refusal) and (answer.hello or answer.recipe):
                if resent:
                    raise Refused(
                        f"the worker for `{self.host}` asked again, for the same work, to be "
                        f"greeted again or for its recipe in full ({answer.why}); it was sent "
                        f"again once, and is not sent a third time"
                    )
                resent = True
                refusal, answer = answer, None
                hello = refusal.hello
                if hello:
                    # the worker forgot this channel to make room for others: greet it again
                    self.exchange.forgotten()
                    self._hello(deadline)
                elif digest is not None:
                    # it does not hold the recipe: forgotten to make room for others (it
                    # goes in full this once), or never kept, when no other recipe went
                    # in full since (too big to keep: it goes in full from now on)
                    self.held.discard(digest)
                    if digest == self._last_full and len(self._unkept) < _MEMO_RECIPES:
                        self._unkept.add(digest)
                if named:
                    named = ""
                    written_with = registered_now()
                    frames = encode(work_of(piece, ref, specs, watched=watch is not None))
                    self._check_kinds(frames, written_with)
                    continue
                if hello:
                    continue
                answer = refusal  # the recipe went in full, and it asks for it in full: refused
            return self._conclude(answer, piece)
        raise Refused(
            f"the worker for `{self.host}` kept asking for the same artifacts, to be greeted "
            f"again, or for the recipe in full"
        )

    def _digest_of(self, specs: tuple[NodeSpec, ...], shape: tuple) -> str | None:
        """The digest of the recipe of ``specs`` and ``shape`` (None: it always travels in
        full), once per recipe in this process: the packer gives the very same spec for a
        node packed again unchanged, so a graph made anew for each call finds it too."""
        key = tuple(map(id, specs))
        kept = _DIGESTS.get(key)
        if kept is not None and all(map(operator.is_, kept[0], specs)) and (kept[1] is shape or kept[1] == shape):
            return kept[2]
        try:
            digested = recipe_digest(Recipe(specs, shape))
        except Exception:  # a value that cannot be written: `encode` says so, in full
            digested = None
        digest = digested.digest if digested is not None else None
        if len(_DIGESTS) >= _MEMO_RECIPES:  # a few recipes in use: forgotten all at once
            _DIGESTS.clear()
        _DIGESTS[key] = (specs, shape, digest)
        return digest

    def _may_follow_hello(self, frames: list, code: tuple[str, ...]) -> bool:
        """Whether a first Work may go right behind its channel's Hello: to a project-mode
        worker (which refuses the Work of a client whose Hello it refused, on the checks this
        side makes), with nothing to check against what it says at Hello (code to hand over;
        a value of a kind some workers cannot read, which always travels in a frame of its
        own: a header alone holds plain values and NumPy scalars), and not streamed."""
        if self.packer.mode != "project" or code or len(frames) != 1:
            return False
        return not (self.relayed and _streams.worth_streaming(frames))

    def _check_kinds(self, frames: list, written_with: object) -> None:
        """Refuse, before a byte of it is sent, a value of a kind the worker cannot read.

        The worker said at Hello which kinds it reads. Usually that is every kind this
        process writes, and that is checked once per state of the registry; otherwise, or
        when the registry changed since ``written_with`` (the registry ``frames`` were
        written with, ``registered_now()``: another thread forgot a codec in between), the
        message's own kinds are read from its header. A network-mode worker also reads the
        kinds whose codecs travel inside the artifacts (see :mod:`somatize.packing`).
        """
        now = registered_now()
        if now is written_with:
            if now is self._sure_for:
                return
            writable = set(readable_with(now))  # the registry the token is, not as it is now
            if self.packer.mode == "network":
                writable.difference_update(registered_with(now))
            if writable <= self.reads:
                self._sure_for = now
                return
        missing = peek_kinds(frames) - self.reads
        if self.packer.mode == "network":
            missing.difference_update(registered_with(written_with))
        if missing:
            raise unreadable(sorted(missing), self.host)

    def _provision(self, digests: tuple[str, ...], deadline: Deadline | None = None, *, asked: bool = False) -> None:
        """Hand the worker the artifacts ``digests`` names, one after the other. ``asked``: the
        worker named them (a ``Send``): one this client never made is not code it offered."""
        for digest in digests:
            try:
                artifact = self.packer.artifact(digest)
            except KeyError:
                if not asked:
                    raise
                raise ProtocolError(
                    f"the worker for `{self.host}` at {self.address} asked for code this client never "
                    f"offered it (`{digest[:19]}…`): its answer was not taken, and this channel was dropped"
                ) from None
            self.exchange.provision_sent()
            self.transport.send(encode(Provision(digest, artifact)), deadline)
            answer = self.transport.next(None, "for the worker to take an artifact", deadline)
            if isinstance(answer, Refusal) and answer.hello:
                self.exchange.forgotten()
                self._hello(deadline)
                self.exchange.provision_sent()
                self.transport.send(encode(Provision(digest, artifact)), deadline)
                answer = self.transport.next(None, "for the worker to take an artifact", deadline)
            if isinstance(answer, Refusal):
                raise Refused(f"the worker for `{self.host}` refused the code sent to it: {answer.why}")
            self.provisioned.add(digest)

    def _send_work(self, ref: int, frames: list, deadline: Deadline | None = None) -> None:
        frames = self.cargo.laid(frames)  # its big frames into the shared folder, when one is proved
        self.exchange.work_sent(ref)
        self.sent_at = time.monotonic()
        self.transport.send(frames, deadline)
        self.exchange.work_delivered()  # whole: a refusal naming no work is not its answer now

    def _answer(self, watch: Any, deadline: Deadline | None = None) -> Any:
        """The work's answer (Send or terminal); its facts go to ``watch`` meanwhile."""
        while True:
            answer = self.transport.next(None, "for the work's answer", deadline)
            if not isinstance(answer, Saw):
                for fact in answer.saw if watch is not None and type(answer) is Done else ():
                    watch(_as_said(fact))  # what a work that finished at once said (`worker.held`)
                return answer
            if watch is not None:
                watch(_as_said(answer.fact))

    def _outcome(self, done: Done, piece: Piece) -> Outcome:
        """The outcome ``done`` says. One that says it produced the output of a step this
        client did not ask it to keep (its cached steps' keys) is not taken: what it holds
        there could be anything, under any key."""
        if done.produced and not done.produced.keys() <= piece.keys.keys():
            unasked = sorted(set(done.produced) - set(piece.keys))
            raise ProtocolError(
                f"the worker for `{self.host}` at {self.address} answered with the output of step "
                f"{', '.join(map(str, unasked[:5]))} to keep, which this client did not ask it to keep: "
                f"its answer was not taken, and this channel was dropped"
            )
        return outcome_of(done)

    def _conclude(self, answer: Any, piece: Piece) -> Outcome:
        if isinstance(answer, Done):
            return self._outcome(answer, piece)
        if isinstance(answer, Failed):
            node = answer.node or ", ".join(s.label for s in piece.steps)
            where = (
                f"node `{answer.node}` on `{self.host}` raised"
                if answer.node
                else f"the work on `{self.host}` ({node}) failed:"
            )
            raise NodeFailed(
                f"{where} {answer.why}",
                node=node,
                error=answer.error,
                host=self.host,
                remote_traceback=answer.traceback or None,
            )
        # the conversation let through only Done, Failed or Refusal here
        raise refusal(
            answer.why,
            f"{self._refuser()} refused the work for `{self.host}`",
            busy=f"the worker for `{self.host}` is busy and took no new work",
        )

    def _refuser(self) -> str:
        """Who a refusal came from: a relayed one may be the broker's (its worker left)."""
        return f"the broker at {self.address} (or the worker behind it)" if self.relayed else "the worker"


def _as_said(fact: dict[str, str]) -> dict[str, str]:
    """A worker's fact as its worker may say it: a ``host`` of its own that starts with ``#``
    (which the client reads as a pool member's mark, ``gpu#2``) loses the mark, so a worker
    serving ``w1`` cannot have its facts read as from ``w1#7``."""
    host = fact.get("host")
    if host is None or not host.startswith("#"):
        return fact
    return {**fact, "host": host.lstrip("#") or "?"}
