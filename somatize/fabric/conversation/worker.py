"""The worker's side: `WORKER_TABLE`, and `WorkerSessions`, its view of each peer that talks to it."""

from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass, field

from ...errors import ProtocolError
from ...wire import (
    CLOSING,
    Begin,
    Bye,
    Chunk,
    Credit,
    Done,
    Hello,
    Mounted,
    Provision,
    Ready,
    Recipe,
    Refusal,
    Relay,
    Runtime,
    Work,
    compatible,
    recipe_digest,
    with_recipe,
)
from ..proofs import sealed
from .violations import BUSY, Unheld, Unknown, Violation, name_of

# -- the worker's view of its peers -------------------------------------------------------


class Session(enum.StrEnum):
    """Where a peer is in its conversation with a worker."""

    UNKNOWN = "unknown"  # it never said Hello, or was forgotten (at its Bye, or to make room)
    GREETED = "greeted"


class Act(enum.StrEnum):
    """What a worker does with what a peer sent (`WORKER_TABLE`); its intake has one method per act."""

    GREET = "greet"
    FORGET = "forget"
    PROVISION = "provision"
    RUN = "run"
    CARRY = "carry"
    OPEN = "open"
    DROP = "drop"


#: What each `Act` does, in a sentence (``docs/conversation.md`` shows it).
ACTS = {
    Act.GREET: "`Ready` (with its proof, if the Hello asked for one); a Hello renews a session, its open work its own",
    Act.FORGET: "the session ends, with the streams it was sending",
    Act.PROVISION: "imports what it names, then `Ready`",
    Act.RUN: "runs the Work (its ref not open already; a recipe named by digest, its own): `Saw`..., then `Done` or `Failed`",
    Act.CARRY: "carried: a stream's bytes, or its credit (`streams`)",
    Act.OPEN: "its files opened, if its seal is the session's, and the Work inside taken as if sent",
    Act.DROP: "counted, never answered: of no stream (a refusal would read as an answer)",
}


@dataclass(frozen=True)
class Refuse:
    """A table's refusal: ``kind`` (a `Violation`) saying ``why``."""

    kind: type[Violation]
    why: str


_SAY_HELLO = "say Hello first: this worker has not heard from you"
_S = Session
#: The worker's side: (a peer's session, what it sends) -> (its next session, what the worker
#: does), or the refusal. Anything else is refused: unopened from a peer not greeted (only
#: Hello and Bye are decoded from one), as a message a worker does not answer from one greeted.
WORKER_TABLE: dict[tuple[Session, type], tuple[Session, Act] | Refuse] = {
    (_S.UNKNOWN, Hello): (_S.GREETED, Act.GREET),
    (_S.GREETED, Hello): (_S.GREETED, Act.GREET),
    (_S.UNKNOWN, Bye): (_S.UNKNOWN, Act.FORGET),
    (_S.GREETED, Bye): (_S.UNKNOWN, Act.FORGET),
    (_S.GREETED, Provision): (_S.GREETED, Act.PROVISION),
    (_S.GREETED, Work): (_S.GREETED, Act.RUN),
    (_S.GREETED, Begin): (_S.GREETED, Act.CARRY),
    (_S.GREETED, Chunk): (_S.GREETED, Act.CARRY),
    (_S.GREETED, Credit): (_S.GREETED, Act.CARRY),
    (_S.GREETED, Mounted): (_S.GREETED, Act.OPEN),
    (_S.UNKNOWN, Chunk): (_S.UNKNOWN, Act.DROP),
    (_S.UNKNOWN, Credit): (_S.UNKNOWN, Act.DROP),
    (_S.GREETED, Relay): Refuse(Violation, "a worker takes `Relay` envelopes only from the broker it dialed"),
}


def _step(state: Session, kind: type) -> tuple[Session, Act] | Refuse:
    found = WORKER_TABLE.get((state, kind))
    if found is not None:
        return found
    if state is Session.UNKNOWN:
        return Refuse(Unknown, _SAY_HELLO)
    return Refuse(Violation, f"a worker does not answer a `{kind.__name__}`")


@dataclass
class _Session:
    runtime: Runtime
    tenant: str
    cost: int  # its runtime's and its recipes' together
    open: dict[int, float] = field(default_factory=dict)  # ref -> when it started (monotonic)
    streams: set[int] = field(default_factory=set)  # answers streaming to it, not yet all credited
    # the recipes this peer sent in full, by the digest this side computed: digest -> (recipe, cost)
    recipes: OrderedDict[str, tuple[Recipe, int]] = field(default_factory=OrderedDict)
    # the key of its seals, once its Hello proved it shares this worker's folder (`proofs`)
    seal: bytes | None = None


def _recipe_cost(size: int) -> int:
    """Bytes a kept recipe holds, roughly: its canonical form, as Python objects."""
    return 512 + 8 * size


def _runtime_cost(runtime: Runtime) -> int:
    """Bytes a remembered runtime holds, roughly: what a peer makes this side keep."""
    return 200 + sum(len(k) + 60 for k in runtime.kinds)


class WorkerSessions:
    """A worker's view of each peer: Hello first, then Provision and Work; answers only to
    work that is open. A peer is a route (Direct, Mount) or ``b"relay:%d" % exchange``.

    What is kept per peer is bounded: at most ``max_peers`` sessions and ``max_bytes`` of
    remembered runtimes and recipes in all, the least recently heard from forgotten first
    (it says Hello again if it comes back). A session with an answer in flight (work open,
    or an answer streaming to it that is not yet all credited, see ``hold``) is never
    forgotten to make room: when only such sessions are left, the newcomer's Hello is
    refused (``busy:``), and a recipe that does not fit is not kept (its Work still runs).

    Recipes: every recipe a peer sends in full (checked by ``decode``) is kept for that peer
    alone, under the digest computed here (``wire.recipe_digest``), so its next Work may name
    it by digest. At most ``max_recipes`` per peer and ``max_recipe_bytes`` of them, the least
    recently used forgotten first; a Hello starts afresh. A Work naming a digest its own peer
    did not send (another peer's, or a forgotten one) is refused ``recipe=True`` and runs
    nothing: one peer never runs under a recipe another sent.

    Cargo: a ``Mounted`` may arrive only from a peer whose Hello proved that it shares this
    worker's folder (``proven``), and only naming files under that session's seal
    (``carries``, asked before any file is opened): a segment lent to one session opens
    nothing in another, whatever its name. A Hello renews the session, and its key with it.
    """

    def __init__(
        self,
        runtime: Runtime,
        *,
        max_peers: int = 10_000,
        max_bytes: int = 16 << 20,
        max_recipes: int = 64,
        max_recipe_bytes: int = 1 << 20,
    ) -> None:
        self.mine = runtime
        self.max_peers = max_peers
        self.max_bytes = max_bytes
        self.max_recipes = max_recipes
        self.max_recipe_bytes = max_recipe_bytes
        self.refused = 0
        self._sessions: OrderedDict[bytes, _Session] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def greeted(self, peer: bytes) -> bool:
        return peer in self._sessions

    def step(self, peer: bytes, kind: type) -> Act:
        """What to do with a message of ``kind`` from ``peer`` now (`WORKER_TABLE`), asked before it
        is opened; raises (and counts) the table's refusal."""
        found = _step(_S.GREETED if peer in self._sessions else _S.UNKNOWN, kind)
        if isinstance(found, Refuse):
            self.refused += 1
            raise found.kind(found.why)
        return found[1]

    def runtime(self, peer: bytes) -> Runtime:
        """The runtime ``peer`` stated in its Hello."""
        return self._sessions[peer].runtime

    def receive(
        self, peer: bytes, msg: object, tenant: str = "", *, now: float, act: Act | None = None
    ) -> Hello | Bye | Provision | Work:
        """``msg`` from ``peer`` at ``now`` (the caller's monotonic clock), as it may be acted
        on (a Work named by its recipe's digest comes back with the recipe), or ``Violation``.
        ``act``: what `step` answered for it already (not looked up again)."""
        try:
            return self._receive(peer, msg, tenant, now, act)
        except Violation:
            self.refused += 1
            raise

    def recall(self, peer: bytes, work: Work, *, now: float) -> Work | None:
        """``work``, which names its recipe by digest, with that recipe and opened, as
        ``receive`` would give it back; None, refusing nothing, when ``receive`` would refuse
        it (a peer that did not say Hello, a ref still open, a recipe not held, keys that do
        not fit it): ``receive`` then says why. The worker's express way in asks this first."""
        session = self._sessions.get(peer)  # the table's (GREETED, Work) -> RUN, and its checks below
        if session is None or type(work) is not Work or work.recipe is not None or work.ref in session.open:
            return None
        kept = session.recipes.get(work.recipe_digest)
        if kept is None:
            return None
        try:  # what `_receive` does with such a Work, in its order, with nothing left to ask
            opened = with_recipe(work, kept[0])
        except ProtocolError:  # the recipe and the work do not fit
            return None
        self._sessions.move_to_end(peer)
        session.recipes.move_to_end(work.recipe_digest)
        session.open[work.ref] = now
        return opened

    def _receive(
        self, peer: bytes, msg: object, tenant: str, now: float, act: Act | None
    ) -> Hello | Bye | Provision | Work:
        session = self._sessions.get(peer)
        if act is None:
            found = _step(_S.UNKNOWN if session is None else _S.GREETED, type(msg))
            if isinstance(found, Refuse):
                raise found.kind(found.why)
            act = found[1]
        if act is Act.GREET:
            assert isinstance(msg, Hello)  # the table's GREET is a Hello's
            if msg.offering is not None:
                raise Violation("a worker takes no offers: `offering` is for a worker saying Hello to a broker")
            why = compatible(self.mine, msg.runtime, needs_pickle=False, me="this worker", them="the client")
            if why is not None:
                raise Violation(why)
            self._greet(peer, msg.runtime, tenant)
            return msg
        if act is Act.FORGET:
            assert isinstance(msg, Bye)  # the table's FORGET is a Bye's
            self._forget(peer)
            return msg
        if act not in (Act.PROVISION, Act.RUN) or session is None:  # a carrier: its intake's, not this
            raise Violation(f"a worker does not answer a `{name_of(msg)}`")
        self._sessions.move_to_end(peer)
        if isinstance(msg, Work):
            if msg.ref in session.open:
                raise Violation(f"work {msg.ref} is already running for you; give each Work a new ref")
            if msg.recipe is None:
                msg = self._recalled(session, msg)
            else:
                self._keep(peer, session, msg.recipe)
            session.open[msg.ref] = now
        assert isinstance(msg, (Provision, Work))  # the table's PROVISION and RUN
        return msg

    def proven(self, peer: bytes, key: bytes) -> None:
        """``peer``'s Hello, just greeted, proved that it shares this worker's folder: the
        key of the seals of its requests (``proofs.seal_key``)."""
        session = self._sessions.get(peer)
        if session is not None:
            session.seal = key

    def carries(self, peer: bytes, mounted: Mounted) -> None:
        """May ``peer`` name these files? Only under its own session's seal; raises
        ``Violation`` (``Unknown`` for a peer that did not say Hello), before anything is
        opened."""
        session = self._sessions.get(peer)
        if session is None:
            self.refused += 1
            raise Unknown(_SAY_HELLO)
        if session.seal is None:
            self.refused += 1
            raise Violation(
                "a `Mounted` names files in this worker's folder, and your Hello proved no folder: a "
                "client sends cargo through a folder only once the worker proved it sees it "
                "(`Hello.prove`); send it on the socket"
            )
        if not sealed(session.seal, mounted.files, mounted.spare, mounted.seal):
            self.refused += 1
            raise Violation(
                "a `Mounted` names files that your session did not lend (its seal is not this session's): "
                "a worker maps only the segments lent to the exchange that names them"
            )

    def _recalled(self, session: _Session, work: Work) -> Work:
        kept = session.recipes.get(work.recipe_digest)
        if kept is None:
            raise Unheld(
                f"this worker holds no recipe {work.recipe_digest[:19]}... from you (it was never "
                f"sent here in full on this connection, or was forgotten to make room): send the "
                f"Work again with its recipe"
            )
        session.recipes.move_to_end(work.recipe_digest)
        try:
            return with_recipe(work, kept[0])
        except ProtocolError as exc:
            raise Violation(exc.why) from None

    def _keep(self, peer: bytes, session: _Session, recipe: Recipe) -> None:
        """Keep a recipe that arrived in full, checked, for this peer alone."""
        try:
            digested = recipe_digest(recipe)
        except Exception:  # a registered kind's own dump failing: such a recipe has no digest anyway
            return
        if digested is None:  # values in frames: it always travels in full
            return
        cost = _recipe_cost(digested.size)
        if cost > self.max_recipe_bytes:
            return
        old = session.recipes.pop(digested.digest, None)
        if old is not None:
            session.cost -= old[1]
            self._bytes -= old[1]
        session.recipes[digested.digest] = (recipe, cost)
        session.cost += cost
        self._bytes += cost
        held = sum(c for _, c in session.recipes.values())
        while len(session.recipes) > self.max_recipes or held > self.max_recipe_bytes:
            _, (_, dropped) = session.recipes.popitem(last=False)
            held -= dropped
            session.cost -= dropped
            self._bytes -= dropped
        if not self._make_room(peer):  # every other session has an answer in flight
            kept = session.recipes.pop(digested.digest, None)
            if kept is not None:  # not kept: its Work runs, and the next one comes in full
                session.cost -= kept[1]
                self._bytes -= kept[1]

    def recipes(self, peer: bytes) -> int:
        """How many recipes are kept for ``peer`` (0 for a peer not known)."""
        session = self._sessions.get(peer)
        return 0 if session is None else len(session.recipes)

    def _greet(self, peer: bytes, runtime: Runtime, tenant: str) -> None:
        old = self._sessions.pop(peer, None)
        # a Hello renews a session: what it has in flight stays its own, and nobody else's
        mine = old if old is not None and old.tenant == tenant else None
        opened = mine.open if mine is not None else {}
        streams = mine.streams if mine is not None else set()
        if old is not None:
            self._bytes -= old.cost
        cost = _runtime_cost(runtime)
        self._sessions[peer] = session = _Session(runtime, tenant, cost, opened, streams)
        self._bytes += cost
        if not self._make_room(peer) and not (session.open or session.streams):
            self._forget(peer)
            raise Violation(
                f"{BUSY}this worker holds as many sessions as it may, and every one has an answer "
                "in flight; say Hello again once one has finished"
            )

    def _make_room(self, peer: bytes) -> bool:
        """Forget the least recently heard from peers (none with an answer in flight, never
        ``peer``) while over ``max_peers`` or ``max_bytes``; False when that is not enough."""
        while len(self._sessions) > self.max_peers or self._bytes > self.max_bytes:
            victim = next((p for p, s in self._sessions.items() if not (s.open or s.streams) and p != peer), None)
            if victim is None:
                return False
            self._forget(victim)
        return True

    def _forget(self, peer: bytes) -> None:
        session = self._sessions.pop(peer, None)
        if session is not None:
            self._bytes -= session.cost

    def answering(self, peer: bytes, answer: object, *, refusing: bool = False) -> bool:
        """Whether ``answer`` may go to ``peer`` now; Send and the terminal answers close
        the work they answer. ``refusing``: ``answer`` refuses the message ``peer`` just
        sent, and may name a Work that never opened (refused on arrival)."""
        if type(answer) is Done:  # most answers: what follows, for a Done
            session = self._sessions.get(peer)
            if session is None or answer.ref not in session.open:
                return False
            del session.open[answer.ref]
            return True
        ref = getattr(answer, "ref", None)
        if isinstance(answer, Ready) or (isinstance(answer, Refusal) and ref is None):
            return True
        session = self._sessions.get(peer)
        if session is None or ref not in session.open:
            return refusing and isinstance(answer, Refusal)
        if isinstance(answer, CLOSING):
            del session.open[ref]
        return True

    def is_open(self, peer: bytes, ref: int) -> bool:
        """Whether work ``ref`` of ``peer`` is open (a refusal of a duplicate must not name it)."""
        session = self._sessions.get(peer)
        return session is not None and ref in session.open

    def hold(self, peer: bytes, sid: int) -> None:
        """An answer streams to ``peer`` as stream ``sid``: its session is not forgotten to
        make room until ``release``."""
        session = self._sessions.get(peer)
        if session is not None:
            session.streams.add(sid)

    def release(self, peer: bytes, sid: int) -> None:
        """Stream ``sid`` to ``peer`` was all credited, or dropped."""
        session = self._sessions.get(peer)
        if session is not None:
            session.streams.discard(sid)

    def forget(self, peer: bytes) -> list[int]:
        """End ``peer``'s session (its key was revoked): nothing more is answered to it.
        Returns the refs of its work that was open."""
        session = self._sessions.get(peer)
        refs = [] if session is None else list(session.open)
        self._forget(peer)
        return refs

    def peers(self) -> list[tuple[bytes, str]]:
        """Every peer known, with its tenant (a direct peer's is its key, where there are keys)."""
        return [(peer, s.tenant) for peer, s in self._sessions.items()]

    def running(self) -> int:
        return sum(len(s.open) for s in self._sessions.values())

    def busy_us(self, now: float) -> int:
        """How long the oldest running work has run at ``now``, in whole microseconds (0: idle)."""
        started = [t for s in self._sessions.values() for t in s.open.values()]
        return int((now - min(started)) * 1_000_000) if started else 0
