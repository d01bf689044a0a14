"""Who may send what, when, and in answer to whom: every conversation of the fabric, sans IO.

Three views, each fed the messages that arrive (already decoded by :mod:`somatize.wire`)
and asked, before any socket class acts on one, "may this arrive now, from this peer?":

- :class:`ClientExchange` — a client channel's conversation with one worker;
- :class:`WorkerSessions` — a worker's view of each peer that talks to it;
- :class:`BrokerView` — a broker's view of each peer, each host offered to it, and each
  exchange it relays.

An illegal message raises :class:`Violation` (a :class:`~somatize.errors.ProtocolError`
whose ``why`` is the sentence to send back in ``Refusal``); the view is left as it was,
the refusal is counted, and nothing is delivered onward. Nothing here opens a socket,
reads a clock it is not handed, or guesses: like h11's ``_state.py``, the tables below
*are* the protocol, and ``tests/test_conversation.py`` feeds them messages with no
process started. The states and transitions are drawn in ``docs/conversation.md``.
"""

from __future__ import annotations

import itertools
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from ..errors import ProtocolError
from ..wire import (
    Bye,
    Done,
    Failed,
    Hello,
    Hosts,
    Provision,
    Ready,
    Recipe,
    Refusal,
    Relay,
    Runtime,
    Saw,
    Send,
    Where,
    Work,
    compatible,
    encode,
    recipe_digest,
    with_recipe,
)

__all__ = ["BrokerView", "ClientExchange", "Stale", "Unheld", "Unknown", "Violation", "WorkerSessions"]

TERMINAL = (Done, Failed, Refusal)


class Violation(ProtocolError):
    """A message that may not arrive now, from this peer: refused, counted, never delivered."""


class Unknown(Violation):
    """A message from a peer this side does not know: it never said Hello, or it was
    forgotten to make room. Refused with ``hello=True``: say Hello, then send it again."""


class Unheld(Violation):
    """A ``Work`` naming by digest a recipe this side does not hold for its peer (never sent
    in full on this connection, or forgotten to make room). Refused with ``recipe=True``:
    send the Work again with its recipe in full."""


class Stale(Violation):
    """An answer for an exchange that has ended (its client gave up, or went away): dropped
    and counted, and not answered — its sender did nothing wrong, and a refusal would read
    as a refusal of something it still holds."""


def _name(msg: object) -> str:
    return type(msg).__name__


# -- the client's side of one channel ------------------------------------------------------

#: state -> the answers that may arrive in it
_CLIENT_EXPECTS: dict[str, tuple[type, ...]] = {
    "new": (),
    "greeting": (Ready, Refusal),
    "ready": (),
    "provisioning": (Ready, Refusal),
    "working": (Saw, Send, Done, Failed, Refusal),
    "closed": (),
}


class ClientExchange:
    """A client channel's conversation with one worker (directly, or relayed by a broker).

    ::

        new --Hello--> greeting --Ready--> ready --Work(ref)--> working --Done/Failed/Refusal(ref)--> ready
                                                 --Provision--> provisioning --Ready--> ready
                       working --Send(ref)--> ready (provision, then send the Work again)
                       any --Refusal to Hello/Provision, or a Violation--> closed

    An answer carrying the ref of an exchange this channel gave up on is stale: dropped and
    counted in ``stale``, never taken for the answer to the work now open.
    """

    def __init__(self) -> None:
        self.state = "new"
        self.ref: int | None = None
        self.stale = 0
        self._given_up: set[int] = set()

    def _sending(self, allowed: tuple[str, ...], what: str) -> None:
        if self.state not in allowed:
            raise Violation(f"this channel cannot send {what} while {self.state}")

    def hello_sent(self) -> None:
        self._sending(("new",), "Hello")
        self.state = "greeting"

    def provision_sent(self, digest: str) -> None:
        self._sending(("ready",), "Provision")
        self.state = "provisioning"

    def work_sent(self, ref: int) -> None:
        self._sending(("ready",), "Work")
        self.state, self.ref = "working", ref

    def forgotten(self) -> None:
        """The worker said it does not know this channel (``Refusal(hello=True)``): the
        channel says Hello again, as if new."""
        self._sending(("ready",), "Hello again")
        self.state = "new"

    def give_up(self) -> None:
        """The caller stopped waiting for the open work (a deadline): its answers are stale."""
        if self.ref is not None:
            self._given_up.add(self.ref)
        self.state, self.ref = "closed", None

    def receive(self, msg: object) -> object | None:
        """The answer, if it may arrive now; None for a stale one; raises ``Violation``."""
        if self.state == "working":
            ref = getattr(msg, "ref", None)
            if isinstance(msg, (Saw, Send, Done, Failed, Refusal)) and ref is not None and ref != self.ref:
                self.stale += 1
                return None
        if not isinstance(msg, _CLIENT_EXPECTS[self.state]):
            was, self.state = self.state, "closed"  # Rule 1: never guess the way back
            raise Violation(f"a worker may not answer a `{_name(msg)}` to a channel that is {was}")
        if self.state in ("greeting", "provisioning"):
            self.state = "ready" if isinstance(msg, Ready) else "closed"
        elif isinstance(msg, (Send, *TERMINAL)):
            self.state, self.ref = "ready", None
        return msg


# -- the worker's view of its peers -------------------------------------------------------


@dataclass
class _Session:
    runtime: Runtime
    tenant: str
    cost: int  # its runtime's and its recipes' together
    open: dict[int, float] = field(default_factory=dict)  # ref -> when it started (monotonic)
    # the recipes this peer sent in full, by the digest this side computed: digest -> (recipe, cost)
    recipes: OrderedDict[str, tuple[Recipe, int]] = field(default_factory=OrderedDict)


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
    (it says Hello again if it comes back). Open work is never forgotten while it runs.

    Recipes: every recipe a peer sends in full (checked by ``decode``) is kept for that peer
    alone, under the digest computed here (``wire.recipe_digest``), so its next Work may name
    it by digest. At most ``max_recipes`` per peer and ``max_recipe_bytes`` of them, the least
    recently used forgotten first; a Hello starts afresh. A Work naming a digest its own peer
    did not send (another peer's, or a forgotten one) is refused ``recipe=True`` and runs
    nothing: one peer never runs under a recipe another sent.
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

    def greeted(self, peer: bytes) -> bool:
        return peer in self._sessions

    def runtime(self, peer: bytes) -> Runtime:
        """The runtime ``peer`` stated in its Hello."""
        return self._sessions[peer].runtime

    def receive(self, peer: bytes, msg: object, tenant: str = "") -> object:
        try:
            return self._receive(peer, msg, tenant)
        except Violation:
            self.refused += 1
            raise

    def _receive(self, peer: bytes, msg: object, tenant: str) -> object:
        if isinstance(msg, Hello):
            if msg.offering is not None:
                raise Violation("a worker takes no offers: `offering` is for a worker saying Hello to a broker")
            why = compatible(self.mine, msg.runtime, needs_pickle=False, me="this worker", them="the client")
            if why is not None:
                raise Violation(why)
            self._greet(peer, msg.runtime, tenant)
            return msg
        if isinstance(msg, Bye):
            self._forget(peer)
            return msg
        if not isinstance(msg, (Provision, Work)):
            raise Violation(f"a worker does not answer a `{_name(msg)}`")
        session = self._sessions.get(peer)
        if session is None:
            raise Unknown("say Hello first: this worker has not heard from you")
        self._sessions.move_to_end(peer)
        if isinstance(msg, Work):
            if msg.ref in session.open:
                raise Violation(f"work {msg.ref} is already running for you; give each Work a new ref")
            if msg.recipe is None:
                msg = self._recalled(session, msg)
            else:
                self._keep(peer, session, msg.recipe)
            session.open[msg.ref] = time.monotonic()
        return msg

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
        self._make_room(peer)

    def recipes(self, peer: bytes) -> int:
        """How many recipes are kept for ``peer`` (0 for a peer not known)."""
        session = self._sessions.get(peer)
        return 0 if session is None else len(session.recipes)

    def _greet(self, peer: bytes, runtime: Runtime, tenant: str) -> None:
        old = self._sessions.pop(peer, None)
        # a Hello renews a session: the work it has running stays its own, and nobody else's
        opened = old.open if old is not None and old.tenant == tenant else {}
        if old is not None:
            self._bytes -= old.cost
        cost = _runtime_cost(runtime)
        self._sessions[peer] = _Session(runtime, tenant, cost, opened)
        self._bytes += cost
        self._make_room(peer)

    def _make_room(self, peer: bytes) -> None:
        """Forget the least recently heard from peers (none with work open, never ``peer``)
        while over ``max_peers`` or ``max_bytes``."""
        while len(self._sessions) > self.max_peers or self._bytes > self.max_bytes:
            victim = next((p for p, s in self._sessions.items() if not s.open and p != peer), None)
            if victim is None:
                break
            self._forget(victim)

    def _forget(self, peer: bytes) -> None:
        session = self._sessions.pop(peer, None)
        if session is not None:
            self._bytes -= session.cost

    def answering(self, peer: bytes, answer: object) -> bool:
        """Whether ``answer`` may go to ``peer`` now; Send and the terminal answers close
        the work they answer."""
        ref = getattr(answer, "ref", None)
        if isinstance(answer, Ready) or (isinstance(answer, Refusal) and ref is None):
            return True
        session = self._sessions.get(peer)
        if session is None or ref not in session.open:
            return False
        if isinstance(answer, (Send, *TERMINAL)):
            del session.open[ref]
        return True

    def running(self) -> int:
        return sum(len(s.open) for s in self._sessions.values())

    def busy_us(self, now: float | None = None) -> int:
        """How long the oldest running work has run, in whole microseconds (0: idle)."""
        now = time.monotonic() if now is None else now
        started = [t for s in self._sessions.values() for t in s.open.values()]
        return int((now - min(started)) * 1_000_000) if started else 0


# -- the broker's view --------------------------------------------------------------------

CLIENT, WORKER = "client", "worker"


@dataclass
class Offer:
    """A host a worker that dialed in serves."""

    host: str
    route: bytes
    owner: str  # the key (Z85) that offered it, or "route:<hex>" where there are no keys
    runtime: Runtime
    seen: float


@dataclass
class Exchange:
    """One client's conversation with one relayed host, as the broker carries it."""

    number: int
    client: bytes  # the client's route
    tenant: str  # who the client is (key short id, or route)
    host: str
    worker: bytes  # the route of the worker it was sent to
    touched: float


@dataclass(frozen=True)
class Deliver:
    """What the broker's pump does with a relayed message: send ``frames`` to ``route``."""

    route: bytes
    frames: list


class BrokerView:
    """The broker's view: which key owns which host, which route may answer which exchange.

    - A host name a dialed worker offers is bound to the identity that offered it first (its
      CURVE key; without keys, its connection while it stays), while that key is allowed:
      another identity offering it is refused. Only identities with the worker role may
      offer, serving at most ``max_offers`` names at once and holding at most
      ``max_bindings`` (the oldest it no longer serves let go first).
    - A client's relayed message for host H opens (or reuses) an exchange numbered by the
      broker; the worker sees only that number and the client's tenant id. An answer is
      delivered only to the client of the exchange it names, and only if it comes from the
      worker that exchange was sent to; anything else is refused and delivered nowhere.
    - At most ``max_exchanges`` exchanges per tenant; the least recently used goes first.
    - ``revoke`` forgets every offer, binding and exchange of identities no longer allowed.
    """

    def __init__(
        self,
        declared: set[str] | frozenset[str] = frozenset(),
        *,
        patience: float = 5.0,
        max_offers: int = 256,
        max_bindings: int = 1024,
        max_dialed: int = 1000,
        max_exchanges: int = 64,
        max_open: int = 100_000,
    ) -> None:
        self.declared = frozenset(declared)
        self.patience = patience
        self.max_offers = max_offers
        self.max_bindings = max_bindings
        self.max_dialed = max_dialed
        self.max_exchanges = max_exchanges
        self.max_open = max_open
        self.offers: dict[str, Offer] = {}
        self._routes: dict[bytes, set[str]] = {}  # route -> the hosts it serves (an index of offers)
        self.bindings: dict[str, str] = {}  # host -> owner, kept while the broker runs (keyed)
        self.exchanges: dict[int, Exchange] = {}
        self._by_pair: dict[tuple[bytes, str], int] = {}
        # numbered from a random point, so a broker that restarted never reuses a number a
        # worker may still answer (its late answer would reach whoever holds that number now)
        self._numbers = itertools.count(secrets.randbelow(1 << 61) + 1)
        self.refused = 0

    @staticmethod
    def identity(route: bytes, key: str) -> str:
        return key if key else "route:" + route.hex()

    @staticmethod
    def tenant(route: bytes, key: str) -> str:
        return key[:8] if key else "route:" + route.hex()

    def _refuse(self, why: str) -> Violation:
        self.refused += 1
        return Violation(why)

    # -- offers ------------------------------------------------------------------------
    def hello(self, route: bytes, key: str, roles: frozenset[str], hello: Hello, now: float) -> str:
        """A Hello from ``route``: "client" (asks only), "offered" (a host is now served
        by it) or "keepalive" (it already served that host). Raises ``Violation``."""
        host = hello.offering
        if host is None:
            return "client"
        if WORKER not in roles:
            raise self._refuse(
                f"this key may ask for hosts but not offer one: to let it serve `{host}`, put its "
                f"public key in the broker's folder of worker keys (--allow-workers)"
            )
        if host in self.declared:
            raise self._refuse(f"host `{host}` is declared on this broker's table; a worker cannot dial in under its name")
        owner = self.identity(route, key)
        bound = self.bindings.get(host)
        if bound is not None and bound != owner:
            raise self._refuse(
                f"host `{host}` is served by another worker key on this broker; offer another "
                f"name, or ask the broker's operator to restart it if that key was retired"
            )
        known = self.offers.get(host)
        if known is not None and known.route == route:
            known.seen = now
            return "keepalive"
        if known is None:
            serving = sum(1 for o in self.offers.values() if o.owner == owner)
            if serving >= self.max_offers:
                raise self._refuse(f"this worker key already serves {serving} hosts, as many as one key may at once")
            if len(self.offers) >= self.max_dialed:
                raise self._refuse(f"this broker already serves {self.max_dialed} dialed-in hosts")
        if bound is None:
            held = [h for h, o in self.bindings.items() if o == owner]
            if len(held) >= self.max_bindings:
                # a key whose nodes come and go (a batch job) keeps its newest names; the
                # oldest it no longer serves is let go, so nobody hoards names by the thousand
                idle = next((h for h in held if h not in self.offers), None)
                if idle is None:
                    raise self._refuse(f"this worker key holds {len(held)} host names, as many as one key may")
                del self.bindings[idle]
            self.bindings[host] = owner
        if known is not None:  # the same owner from a new connection (it restarted): move
            self._end_exchanges(lambda e: e.worker == known.route and e.host == host)
        if known is not None:
            self._drop(host)
        self.offers[host] = Offer(host, route, owner, hello.runtime, now)
        self._routes.setdefault(route, set()).add(host)
        return "offered"

    def offered_by(self, route: bytes) -> list[str]:
        """The hosts ``route`` serves: asked of every relayed message, so an index, not a walk."""
        return sorted(self._routes.get(route, ()))

    def _drop(self, host: str) -> Offer:
        offer = self.offers.pop(host)
        hosts = self._routes.get(offer.route)
        if hosts is not None:
            hosts.discard(host)
            if not hosts:
                del self._routes[offer.route]
        return offer

    def leave(self, route: bytes) -> list[str]:
        """``route`` said Bye or went away: forget its offers (keyless bindings with them)
        and every exchange it was part of. Returns the hosts it served."""
        gone = self.offered_by(route)
        for host in gone:
            offer = self._drop(host)
            if offer.owner.startswith("route:"):
                self.bindings.pop(host, None)
        self._end_exchanges(lambda e: route in (e.worker, e.client))
        return gone

    def expire(self, now: float) -> list[str]:
        """Offers silent for three patiences are gone, and the exchanges with them. An
        exchange is never ended for being quiet (work may run for hours with nobody
        watching); what bounds them is ``max_exchanges`` per tenant and ``max_open`` in all,
        the least recently used ended first."""
        gone = [h for h, o in self.offers.items() if now - o.seen > 3 * self.patience]
        for host in gone:
            offer = self._drop(host)
            if offer.owner.startswith("route:"):
                self.bindings.pop(host, None)
        self._end_exchanges(lambda e: e.host in gone)
        return gone

    def revoke(self, allowed: set[str]) -> list[bytes]:
        """Keys no longer allowed lose their offers, bindings and exchanges; returns their routes."""
        routes: set[bytes] = set()
        for host, offer in list(self.offers.items()):
            if not offer.owner.startswith("route:") and offer.owner not in allowed:
                routes.add(offer.route)
                self._drop(host)
        for host, owner in list(self.bindings.items()):
            if not owner.startswith("route:") and owner not in allowed:
                del self.bindings[host]
        return sorted(routes)

    # -- relaying ----------------------------------------------------------------------
    def relay(self, route: bytes, key: str, relay: Relay, now: float) -> Deliver:
        """Where a relayed message goes. From a worker: to the client of the exchange it
        names, if that exchange was sent to this very worker. From a client: to the worker
        serving ``relay.host``, in an exchange of the broker's numbering."""
        if self.offered_by(route):
            exchange = self.exchanges.get(relay.exchange)
            if exchange is None or exchange.worker != route:
                self.refused += 1
                raise Stale(f"this broker has no exchange {relay.exchange} open with you")
            exchange.touched = now
            return Deliver(exchange.client, list(relay.inner))
        if relay.exchange:
            raise self._refuse("only a worker that offered a host here answers an exchange; say Hello with `offering` first")
        offer = self.offers.get(relay.host)
        if offer is None:
            raise self._refuse(f"no worker serving `{relay.host}` is connected to this broker")
        tenant = self.tenant(route, key)
        number = self._by_pair.get((route, relay.host))
        exchange = self.exchanges.get(number) if number is not None else None
        if exchange is None or exchange.worker != offer.route:
            if exchange is not None:
                self._end(exchange)
            mine = [e for e in self.exchanges.values() if e.tenant == tenant]
            if len(mine) >= self.max_exchanges:
                self._end(min(mine, key=lambda e: e.touched))
            if len(self.exchanges) >= self.max_open:
                self._end(min(self.exchanges.values(), key=lambda e: e.touched))
            exchange = Exchange(next(self._numbers), route, tenant, relay.host, offer.route, now)
            self.exchanges[exchange.number] = exchange
            self._by_pair[(route, relay.host)] = exchange.number
        exchange.touched = now
        return Deliver(offer.route, encode(Relay(exchange=exchange.number, tenant=tenant, inner=relay.inner)))

    def _end(self, exchange: Exchange) -> None:
        self.exchanges.pop(exchange.number, None)
        self._by_pair.pop((exchange.client, exchange.host), None)

    def _end_exchanges(self, which) -> None:  # noqa: ANN001 - a predicate on Exchange
        for exchange in [e for e in self.exchanges.values() if which(e)]:
            self._end(exchange)

    # -- what a broker answers itself --------------------------------------------------
    @staticmethod
    def answers_itself(msg: object) -> bool:
        return isinstance(msg, (Hello, Where, Hosts, Bye))
