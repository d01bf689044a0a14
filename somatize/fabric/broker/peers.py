"""The broker's view of its peers, sans IO: which key owns which host, which route may answer
which exchange, what a revoked key loses, and what to tell whom when an exchange ends.

Part of the conversation (:mod:`somatize.fabric.conversation`, which names these classes too):
the loop (:mod:`somatize.fabric.broker.loop`) looks up the conversation's `BROKER_TABLE` for
every message, asks the view "may this arrive now, from this peer?", and carries out what the
view gives back (:mod:`~somatize.fabric.broker.exchanges`' `Deliver`, `Forget`) without deciding
anything of its own. Tested with no process started (``tests/test_conversation.py``).
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Iterable
from typing import Any

from ...errors import ProtocolError
from ...wire import (
    CLOSING,
    Begin,
    Bye,
    Done,
    Failed,
    Hello,
    Mounted,
    Ready,
    Refusal,
    Relay,
    Send,
    Work,
    variant_of,
)
from ...wire.writing import passed_on
from ..conversation import KEEPALIVE, LEFT, Stale, Violation
from ..hosts import pool_of
from .bindings import Bindings
from .exchanges import Deliver, Exchange, Forget, Offer, bye, tell_client

CLIENT, WORKER = "client", "worker"


class Void(Stale):
    """A message that opens nothing and ends nothing (a client's relayed ``Bye`` for an
    exchange not open): nobody is owed a word, and the broker counts it as refused (a flood
    of them has its connection cut, `floods`)."""


#: Patiences an offer with no exchange open may be silent (three keepalives missed).
IDLE_SILENCE = 3 * KEEPALIVE
#: Seconds an exchange whose worker was lost with its work open is remembered, should that
#: worker dial in again before the exchange's client has looked (once a patience of its own).
LOST_FOR = 60.0


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
    - ``revoke`` forgets every offer, binding and exchange of identities no longer allowed
      (a binding or an offer lasts only while its key is a *worker* key), and returns the
      exchanges it ended, so the broker can tell their other side.
    - An exchange ended because its client left (said Bye or went away), or crowded out by
      newer ones, is put in ``ending``: the broker tells its worker (a ``Bye`` in it), which
      forgets that session then and not when newer ones crowd it out. A client's own ``Bye``
      on a channel ends its exchange as it passes. Crowding out takes an exchange with no
      work open first; one with work open is put in ``cut`` too, and its client is told the
      work's fate is unknown.
    - Any message from a route that serves hosts is a sign of life (``heard``), not only its
      keepalive Hello: a worker whose keepalives wait behind bulk answers is not silent.
    """

    def __init__(
        self,
        declared: set[str] | frozenset[str] = frozenset(),
        *,
        patience: float = 5.0,
        max_offers: int = 4096,
        max_bindings: int | None = None,
        max_dialed: int = 10_000,
        max_exchanges: int = 1024,
        max_open: int = 100_000,
    ) -> None:
        self.declared = frozenset(declared)
        self._declared_pools = frozenset(m[0] for m in map(pool_of, self.declared) if m is not None)
        self.patience = patience
        self.max_offers = max_offers
        self.max_bindings = 2 * max_offers if max_bindings is None else max_bindings
        self.max_dialed = max_dialed
        self.max_exchanges = max_exchanges
        self.max_open = max_open
        self.offers: dict[str, Offer] = {}
        self._routes: dict[bytes, set[str]] = {}  # route -> the hosts it serves (an index of offers)
        self._serving: dict[str, int] = {}  # owner -> how many hosts it serves
        self._heard: dict[bytes, float] = {}  # route serving hosts -> when it was last heard
        self._next_expiry = 0.0
        self.stalled: set[str] = set()  # what the last expire found gone with exchanges open
        self.checks: list[bytes] = []  # routes the last expire wants checked (a Hello, answered by Ready)
        self._busy_since: dict[str, float] = {}  # host held to the working limit -> since when
        self._held: dict[str, int] = {}  # host -> its exchanges with work open or a word unanswered
        self._next_held = 0.0  # when the hosts held closer are looked at next (`expire`)
        self._asked_at: dict[bytes, float] = {}  # route of a host held and silent -> when last checked
        self.bindings = Bindings()  # host -> owner, kept while the broker runs (keyed)
        self.exchanges: dict[int, Exchange] = {}
        self._by_pair: dict[tuple[bytes, str, int], int] = {}  # (client route, host, lane) -> number
        # indexes of the exchanges, so that a peer leaving costs what it had, not what all have
        self._of_route: dict[bytes, set[int]] = {}  # a client's or a worker's route -> numbers
        self._of_host: dict[str, set[int]] = {}
        self._of_tenant: dict[str, dict[int, None]] = {}
        # numbered from a random point, so a broker that restarted never reuses a number a
        # worker may still answer (its late answer would reach whoever holds that number now)
        self._numbers = itertools.count(secrets.randbelow(1 << 61) + 1)
        self.refused = 0
        self._told: list[Deliver | Forget] = []  # what revoke decided to say, for `tells`
        self.ending: list[Exchange] = []  # ended with their worker still there, not told yet
        self.cut: list[Exchange] = []  # crowded out while their client waited, not told yet
        # exchanges whose worker was lost with their work open, by host: should the host be
        # offered again before their client looked, that client would wait for ever (the
        # host is there, the answer can never come); told then (`orphaned`), never before:
        # a client that looks finds the host gone and says `Broken`, as it should
        self._lost: dict[str, dict[int, Exchange]] = {}
        self._lost_at: dict[str, float] = {}  # host -> when its losses were first looked at
        self.orphaned: list[Exchange] = []  # their host was offered again: their client is to be told

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
            raise self._refuse(
                f"host `{host}` is declared on this broker's table; a worker cannot dial in under its name"
            )
        owner = self.identity(route, key)
        member = pool_of(host)
        if member is None and (
            host in self._declared_pools
            or any(
                o != owner and (not owner.startswith("route:") or not o.startswith("route:"))
                for o in self.bindings.pool_owners(host)
            )
        ):
            raise self._refuse(
                f"`{host}` is the name of a pool served on this broker (`{host}#0`...); a worker "
                f"cannot dial in under it: offer another name"
            )
        if member is not None:  # a pool's members are one key's: nobody else's worker joins it
            pool = member[0]
            if pool in self._declared_pools:
                raise self._refuse(
                    f"`{host}` would join the pool `{pool}` declared on this broker's table; a worker "
                    f"cannot dial in to it"
                )
            keyed = not owner.startswith("route:")
            if any(o != owner and (keyed or not o.startswith("route:")) for o in self.bindings.pool_owners(pool)):
                raise self._refuse(
                    f"the pool `{pool}` is served by another worker key on this broker, and `{host}` would join "
                    f"it; offer a name of another pool (each pool's members are one key's)"
                )
        bound = self.bindings.get(host)
        if bound is not None and bound != owner:
            if bound.startswith("route:"):
                raise self._refuse(
                    f"host `{host}` is served by another connection to this broker (without keys, a name is "
                    f"the connection's that offered it, while it stays); offer another name"
                )
            raise self._refuse(
                f"host `{host}` is served by another worker key on this broker; offer another "
                f"name, or ask the broker's operator to restart it if that key was retired"
            )
        known = self.offers.get(host)
        if known is not None and known.route == route:
            known.seen = now
            return "keepalive"
        if known is None:
            serving = self._serving.get(owner, 0)
            if serving >= self.max_offers:
                raise self._refuse(f"this worker key already serves {serving} hosts, as many as one key may at once")
            if len(self.offers) >= self.max_dialed:
                raise self._refuse(f"this broker already serves {self.max_dialed} dialed-in hosts")
        if bound is None:
            held = self.bindings.count(owner)
            if held >= self.max_bindings:
                # a key whose nodes come and go (a batch job) keeps its newest names; the
                # oldest it no longer serves is let go, so nobody hoards names by the thousand
                idle = next((h for h in self.bindings.held(owner) if h not in self.offers), None)
                if idle is None:
                    raise self._refuse(f"this worker key holds {held} host names, as many as one key may")
                del self.bindings[idle]
            self.bindings[host] = owner
        if known is not None:  # the same owner from a new connection (it restarted): move
            moved = self._of_host.get(host, set()) & self._of_route.get(known.route, set())
            self.orphaned.extend(e for e in map(self.exchanges.get, moved) if e is not None and e.work_open)
            self._end_numbers(moved)
            self._drop(host)
        lost = self._lost.pop(host, None)
        if lost:  # its work open when its worker was lost: the clients still waiting are told
            self._lost_at.pop(host, None)
            self.orphaned.extend(lost.values())
        self.offers[host] = Offer(host, route, owner, hello.runtime, now, hello.mount, hello.seen)
        self._routes.setdefault(route, set()).add(host)
        self._serving[owner] = self._serving.get(owner, 0) + 1
        self._heard[route] = now
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
                self._heard.pop(offer.route, None)
        left = self._serving.get(offer.owner, 0) - 1
        if left > 0:
            self._serving[offer.owner] = left
        else:
            self._serving.pop(offer.owner, None)
        return offer

    def leave(self, route: bytes) -> list[str]:
        """``route`` said Bye or went away: forget its offers (keyless bindings with them)
        and every exchange it was part of. Returns the hosts it served."""
        gone = self.offered_by(route)
        for host in gone:
            offer = self._drop(host)
            if offer.owner.startswith("route:"):
                self.bindings.pop(host, None)
        for number in list(self._of_route.get(route, ())):
            exchange = self.exchanges[number]
            if exchange.worker == route and exchange.work_open:
                self._lose(exchange)
            self._end(exchange)
            if exchange.client == route:  # its worker is still there: it hears Bye
                self.ending.append(exchange)
        return gone

    def _lose(self, exchange: Exchange) -> None:
        """``exchange``'s worker is gone with its work open (`_lost`)."""
        if exchange.host not in self._lost and len(self._lost) >= self.max_dialed:
            return  # bounded as offers are
        lost = self._lost.setdefault(exchange.host, {})
        if len(lost) < self.max_exchanges:
            lost[exchange.number] = exchange
        self._lost_at.setdefault(exchange.host, 0.0)

    def expire(self, now: float) -> list[str]:
        """Offers that are gone, and the exchanges with them. A dialed worker's connection
        says it is there (its pings, every patience, have a time to live: ZeroMQ drops a
        connection silent past it, and the broker then probes); its keepalive, every
        `KEEPALIVE` patiences, is the net beneath: an idle offer silent for `IDLE_SILENCE`
        patiences is gone. A host with any exchange *held* (work open there that its worker
        has not ended, whoever spoke last, or a client's word not answered yet) is held to
        the working limit: silent for a patience it is checked (its route is in
        ``self.checks``: the broker says Hello, it answers Ready; asked again each quarter
        patience it stays silent), for one and a half it is gone (``self.stalled``). A worker
        running work says Hello every half patience (:mod:`somatize.fabric.worker.dialing`),
        from its serving thread, whatever the piece does: a long honest piece is never
        taken for a stopped worker. Silence is counted from when the host was last heard or
        first held, whichever is later, and never past the idle limit (exchanges opened
        again and again do not hold a silent host).

        The fleet is looked at every quarter patience (a walk over every offer); the hosts
        held, every sixteenth (a walk over those alone), so a stopped worker with work open
        is gone within one and a half patiences and a sixteenth of its last word. An
        exchange is never ended for being quiet (work may run for hours with nobody
        watching); what bounds them is ``max_exchanges`` per tenant and ``max_open`` in all,
        the least recently used ended first."""
        self.checks = []
        full = now >= self._next_expiry
        if not full and (now < self._next_held or not self._busy_since):
            return []
        self._next_held = now + self.patience / 16
        if full:
            self._next_expiry = now + self.patience / 4
        heard, busy, offers = self._heard, self._busy_since, self.offers
        idle, check, working = IDLE_SILENCE * self.patience, self.patience, 1.5 * self.patience
        gone, stalled = [], set()
        checks: dict[bytes, None] = {}  # the routes to ask, in order, each once
        offer: Offer | None  # each offer looked at below (held hosts: one that left is None)
        if full:
            for host, offer in offers.items():
                if host not in busy and now - max(offer.seen, heard.get(offer.route, 0.0)) > idle:
                    gone.append(host)
        asked, again = self._asked_at, self.patience / 4
        self._asked_at = {}
        for host, since in busy.items():
            offer = offers.get(host)
            if offer is None:
                continue
            last = max(offer.seen, heard.get(offer.route, 0.0))
            quiet = now - last
            if min(quiet, now - since) > working or quiet > idle:
                gone.append(host)
                stalled.add(host)
            elif min(quiet, now - since) > check:
                route = offer.route
                at = asked.get(route)
                if at is None or at < last or now - at >= again:  # asked once a quarter patience
                    at = now
                    checks[route] = None
                self._asked_at[route] = at
        self.stalled, self.checks = stalled, list(checks)
        for host in gone:
            offer = self._drop(host)
            if offer.owner.startswith("route:"):
                self.bindings.pop(host, None)
            numbers = set(self._of_host.get(host, ()))
            for exchange in map(self.exchanges.get, numbers):
                if exchange is not None and exchange.work_open:
                    self._lose(exchange)
            self._end_numbers(numbers)
        if full and self._lost_at:
            self._forget_losses(now)
        return gone

    def _forget_losses(self, now: float) -> None:
        """Losses older than `LOST_FOR` are forgotten: their clients have looked by then.
        Timed from the first full look after them (a loss is noted where no clock is at hand)."""
        for host, at in list(self._lost_at.items()):
            if not at:
                self._lost_at[host] = now
            elif now - at > LOST_FOR:
                del self._lost_at[host]
                self._lost.pop(host, None)

    @property
    def offers_index(self) -> dict[bytes, set[str]]:
        """Route -> the hosts it serves (read only)."""
        return self._routes

    def heard(self, route: bytes, now: float) -> None:
        """Any message from ``route``: the hosts it serves are alive (one entry per route,
        however many hosts it serves)."""
        if route in self._heard:
            self._heard[route] = now

    def revoke(self, allowed: set[str], workers: set[str] | None = None) -> list[bytes]:
        """Keys no longer allowed lose their offers, bindings and exchanges (keys no longer
        in ``workers``, their offers and bindings); returns the routes that lost offers. The
        other side of each exchange ended is told (`tells`): a worker whose client's key went
        hears a ``Bye`` in it; a client whose worker's key went hears that its work ended."""
        workers = allowed if workers is None else workers
        routes: set[bytes] = set()
        for host, offer in list(self.offers.items()):
            if not offer.owner.startswith("route:") and offer.owner not in workers:
                routes.add(offer.route)
                self._drop(host)
        for host, owner in list(self.bindings.items()):
            if not owner.startswith("route:") and owner not in workers:
                del self.bindings[host]
        revoked = [e for e in self.exchanges.values() if e.worker in routes or (e.key and e.key not in allowed)]
        for exchange in revoked:
            self._end(exchange)
            if exchange.key and exchange.key not in allowed:  # nothing more of it is delivered
                self._told += [Forget(exchange.client), Forget(exchange.worker, exchange.tenant), bye(exchange)]
            else:
                self._told += tell_client(
                    exchange,
                    f"the worker serving `{exchange.host}` is no longer allowed on this broker (its key was "
                    f"taken out of the allow-list): the work sent to it there ended",
                )
        return sorted(routes)

    def tells(self) -> list[Deliver | Forget]:
        """What the broker is to say, in order, because exchanges ended without their client's
        word: each worker whose exchange ended while it is still here (its client left, or
        newer exchanges crowded it out, or a key was revoked) hears a ``Bye`` in it and forgets
        that session now; each client whose work was open in an exchange that ended hears a
        ``Refusal`` (naming no work: its fate is not known), its answers still queued dropped.
        Taken once: the lists it reads are emptied."""
        told, self._told = self._told, []
        ending, self.ending = self.ending, []
        cut, self.cut = self.cut, []
        orphaned, self.orphaned = self.orphaned, []
        told += [bye(e) for e in ending if e.worker in self._routes]
        for exchange in cut:  # its client waits on an answer that will never come
            told += tell_client(
                exchange,
                f"this broker ended the exchange with `{exchange.host}` while the work sent there was "
                f"open: one client's connections hold at most {self.max_exchanges:,} exchanges (this "
                f"broker {self.max_open:,} in all), the least recently used ended first; use fewer hosts "
                f"at once, or more clients",
            )
        for exchange in orphaned:  # it would find the host there and wait for ever
            told += tell_client(
                exchange,
                f"the worker serving `{exchange.host}` was lost while the work sent there was open (silent "
                f"past this broker's patience, or its connection dropped) and has dialed in again since: no "
                f"answer to that work can come through; forward again",
            )
        return told

    # -- relaying ----------------------------------------------------------------------
    def relay(self, route: bytes, key: str, relay: Relay, now: float) -> Deliver | None:
        """Where a relayed message goes. From a worker: to the client of the exchange it
        names, if that exchange was sent to this very worker. From a client: to the worker
        serving ``relay.host``, in an exchange of the broker's numbering; None for a client's
        Bye in an exchange whose worker left (nothing to deliver). Raises `Stale` for a
        worker's answer in an exchange not open, `Void` for a client's Bye in none."""
        if self.offered_by(route):
            exchange = self.exchanges.get(relay.exchange)
            if exchange is None or exchange.worker != route:
                self.refused += 1
                raise Stale(f"this broker has no exchange {relay.exchange} open with you")
            exchange.touched = now
            self._answered(exchange, _variant(relay.inner), now)
            tenant = str(exchange.number)
            if exchange.lane:  # one of many channels over the client's connection: say which
                return Deliver(exchange.client, passed_on(relay.inner, lane=exchange.lane), tenant)
            return Deliver(exchange.client, list(relay.inner), tenant)
        if relay.exchange:
            raise self._refuse(
                "only a worker that offered a host here answers an exchange; say Hello with `offering` first"
            )
        offer = self.offers.get(relay.host)
        if offer is None:
            raise self._refuse(
                f"{LEFT}no worker serving `{relay.host}` is connected to this broker: it left, or has not "
                f"dialed in yet; forward again once it has (`Broker.knows` says when)"
            )
        tenant = self.tenant(route, key)
        number = self._by_pair.get((route, relay.host, relay.lane))
        exchange = self.exchanges.get(number) if number is not None else None
        variant = _told(relay.inner)  # read once, from the header's first bytes
        if (exchange is None or exchange.worker != offer.route) and variant is Bye:
            if exchange is None:  # opens nothing, ends nothing: refused and counted, answered nothing
                self.refused += 1
                raise Void(f"this broker has no exchange open with `{relay.host}` on that lane for a Bye to end")
            self._end(exchange)
            return None  # the Bye of an exchange whose worker left
        if exchange is None or exchange.worker != offer.route:
            if exchange is not None:
                self._end(exchange)
            mine = self._of_tenant.get(tenant, {})
            if len(mine) >= self.max_exchanges:
                self._crowd_out([self.exchanges[n] for n in mine])
            if len(self.exchanges) >= self.max_open:
                self._crowd_out(self.exchanges.values())
            exchange = Exchange(next(self._numbers), route, tenant, relay.host, offer.route, now, key, relay.lane)
            self._open(exchange)
        exchange.touched = now
        deliver = Deliver(offer.route, passed_on(relay.inner, exchange=exchange.number, tenant=tenant), tenant)
        if variant is Bye:  # the exchange is over, and the worker hears it
            self._end(exchange)
            return deliver
        self._asked(exchange, variant, now)
        return deliver

    def _crowd_out(self, candidates: Iterable[Exchange]) -> None:
        """The least recently used of ``candidates`` ends, one with no work open first; a client
        whose work was open is told (``cut``), and the worker too (``ending``)."""
        exchange = min(candidates, key=lambda e: (e.work_open, e.touched))
        if exchange.work_open:
            self.cut.append(exchange)
        self._end(exchange)
        self.ending.append(exchange)

    def _asked(self, exchange: Exchange, variant: type | None, now: float) -> None:
        """Its client said ``variant`` (anything but Bye, junk included, asks for an answer;
        a Work, bare, streamed or in a shared folder, opens work)."""
        if exchange.waiting and (exchange.work_open or variant not in _OPENS_WORK):
            return  # held already, and stays so: the common case costs one look
        self._mark(exchange, True, exchange.work_open or variant in _OPENS_WORK, now)

    def _answered(self, exchange: Exchange, variant: type | None, now: float) -> None:
        """Its worker said ``variant``: an answer ends the wait of its client, and what ends
        work (Done, Failed, Refusal, Send) the work open; a fact or a credit ends neither.
        The Ready that answers a Hello sent right behind by a Work leaves the work open."""
        if variant in _ANSWERS and exchange.held:
            self._mark(exchange, False, exchange.work_open and variant not in CLOSING, now)

    def _mark(self, exchange: Exchange, waiting: bool, work_open: bool, now: float) -> None:
        """Set what the exchange waits on; a host with any exchange held (work open there,
        whoever spoke last, or its client's word unanswered) is held to the working limit
        (`expire`), from when the first of them was held."""
        was = exchange.held
        exchange.waiting, exchange.work_open = waiting, work_open
        if exchange.held == was:
            return
        host = exchange.host
        count = self._held.get(host, 0) + (1 if not was else -1)
        if count > 0:
            self._held[host] = count
            self._busy_since.setdefault(host, now)
        else:
            self._held.pop(host, None)
            self._busy_since.pop(host, None)

    def _open(self, exchange: Exchange) -> None:
        number = exchange.number
        self.exchanges[number] = exchange
        self._by_pair[(exchange.client, exchange.host, exchange.lane)] = number
        self._of_route.setdefault(exchange.client, set()).add(number)
        self._of_route.setdefault(exchange.worker, set()).add(number)
        self._of_host.setdefault(exchange.host, set()).add(number)
        self._of_tenant.setdefault(exchange.tenant, {})[number] = None

    def _end(self, exchange: Exchange) -> None:
        number = exchange.number
        if self.exchanges.pop(number, None) is None:
            return
        if exchange.held:
            self._mark(exchange, False, False, exchange.touched)
        pair = (exchange.client, exchange.host, exchange.lane)
        if self._by_pair.get(pair) == number:
            del self._by_pair[pair]
        at: Any  # a route (bytes) or a host or tenant (str): the key of its own index
        for index, at in (
            (self._of_route, exchange.client),
            (self._of_route, exchange.worker),
            (self._of_host, exchange.host),
            (self._of_tenant, exchange.tenant),
        ):
            numbers = index.get(at)
            if numbers is not None and number in numbers:
                if isinstance(numbers, dict):
                    del numbers[number]
                else:
                    numbers.discard(number)
                if not numbers:
                    del index[at]

    def _end_numbers(self, numbers) -> None:  # noqa: ANN001 - exchange numbers
        for number in numbers:
            exchange = self.exchanges.get(number)
            if exchange is not None:
                self._end(exchange)


_ANSWERS = (Done, Failed, Refusal, Ready, Send)  # a worker's word that answers what its client waits on
_OPENS_WORK = (Work, Begin, Mounted)  # a client's: a Work, bare, streamed or in a shared folder


def _variant(inner: tuple) -> type | None:
    """The variant of a worker's relayed message, bare or in a shared folder, read from its
    header's first bytes; None for junk."""
    variant = _told(inner)
    return _told(inner[1:2]) if variant is Mounted and len(inner) > 1 else variant


def _told(inner: tuple) -> type | None:
    """The variant of a relayed message, bare (a client's ``Mounted`` carries a ``Work``),
    from its header's first bytes; None for junk."""
    try:
        return variant_of(inner)
    except (ProtocolError, TypeError):
        return None
