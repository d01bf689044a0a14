"""The broker's side: a rendezvous that steps out of the way, and a relay of last resort.

A client asks "where is H?" once per host per session and gets a ``Located``: in this
process, through a shared directory, directly at an address, or relayed through here.
Spawned workers are started on the first such question and stopped when the broker
closes. Only for workers that dialed in (``--broker URL --offer H``) does cargo pass
through the broker, and then it is forwarded frame by frame, never decoded.

The loop never blocks: every send goes through the :class:`~somatize.fabric.broker.outbox.Outbox`
(``NOBLOCK``, a bounded queue per peer and tenant; a peer that does not read loses its
answers, counted), and what can take time (starting a spawned worker, checking one a client
says it lost, writing the bindings file) runs off this thread (:mod:`somatize.fabric.broker.checks`). Each
tenant (a key; without keys, a connection) has quotas: questions waiting for such a job,
answers waiting to be read, connections per key. Nobody's pace is another's wait.

This module serves (a graph talks to :mod:`somatize.fabric.client.handle`); it logs under
``somatize.broker``, every line a peer can cause through a limiter (`logs.Quiet`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import zmq

from ...errors import ProtocolError
from ...wire import (
    Bye,
    Hello,
    Hosts,
    Listed,
    Located,
    Ready,
    Refusal,
    Relay,
    Runtime,
    Where,
    compatible,
    decode,
    encode,
    ref_of,
    variant_of,
)
from .. import sockets
from ..conversation import Stale, Violation
from ..curve import Guard, Keys, as_server, peer_name
from ..hosts import Worker
from ..logs import Quiet
from . import answers as _answers
from . import bindings as _bindings
from .admitting import Admitting, size_of
from .checks import Helper
from .children import Spawned
from .ending import Ending
from .floods import Admission
from .outbox import DROPPED, GONE, LARGEST, PIPED, Outbox
from .peers import CLIENT, IDLE_SILENCE, WORKER, BrokerView  # what `conversation` names too, typed
from .probes import Probes
from .spawn import Child, Reach

#: Hosts that may dial in at once (a `Listed` answer lists 10,000 at most), and hosts one
#: worker key may serve at once (a SLURM job of that many nodes on one key; `--max-hosts-per-key`).
MAX_DIALED, MAX_HOSTS_PER_KEY = 10_000, 4096
#: Per tenant: connections of one key (`children.MAX_PENDING`: questions waiting for a start;
#: `admitting.MAX_UNREAD`: answers waiting for one connection to read them).
MAX_CONNECTIONS = 64
#: A connection not heard from for this long no longer counts against its key (seconds).
CONNECTION_IDLE = 60.0
_EVERYONE = frozenset((CLIENT, WORKER))
log = logging.getLogger("somatize.broker")


def _some(names: Any, most: int = 20) -> str:
    names = sorted(names)
    shown = ", ".join(f"`{n[:60]}`" for n in names[:most]) or "none"
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


class BrokerLoop(Admitting, Ending):
    """Answers ``Where`` and ``Hosts``, spawns, and relays. ``bind()`` then ``serve()``.

    Who may reach it: with keys, only peers whose CURVE key is in an allow folder (clients
    may ask and send work; worker keys may also offer hosts); without keys, whoever reaches
    its address (loopback or inproc only, unless ``--insecure``). What one allowed peer may
    do to another is the business of :class:`~somatize.fabric.conversation.BrokerView`.
    """

    def __init__(
        self,
        hosts: dict[str, Worker],
        *,
        patience: float = sockets.PATIENCE,
        private: bool = False,
        bindings: str | os.PathLike[str] | None = None,
        max_hosts_per_key: int = MAX_HOSTS_PER_KEY,
    ) -> None:
        for name, worker in hosts.items():
            if not isinstance(name, str) or not name:
                raise TypeError(f"a host's name is a non-empty string; got {name!r}")
            if not isinstance(worker, Worker):
                raise TypeError(
                    f"host `{name}` must be declared with `Worker.spawn(...)`, `Worker.at(...)` or "
                    f"`Worker.inprocess()`; got a `{type(worker).__name__}`"
                )
        self.private = private  # embedded: its clients are the process its children serve
        self.hosts = dict(hosts)
        self.patience = patience
        self.runtime = Runtime.here()
        self.view = BrokerView(set(hosts), patience=patience, max_dialed=MAX_DIALED, max_offers=max_hosts_per_key)
        # which key owns which dialed-in name, kept across restarts when given a file: a
        # restarted broker must not hand a name to whichever key says Hello first
        self.bindings = Path(bindings) if bindings is not None else None
        if self.bindings is not None:
            _bindings.check_folder(self.bindings)
            self.view.bindings.update(_bindings.read(self.bindings))
        self._written: dict[str, str] | None = self._keyed()
        self._looked_at = self.view.bindings.version  # the bindings' version last compared with the file
        self.endpoint = ""
        self.stopping = threading.Event()
        self._front: zmq.Socket | None = None
        self._drops: zmq.Socket | None = None
        self._outbox: Outbox | None = None
        self._guard: Guard | None = None
        self._lock = threading.Lock()
        self._helper = Helper()
        self._spawned = Spawned(self._helper, self._answer, runtime=self.runtime, patience=patience, private=private)
        self._connections: dict[str, OrderedDict[bytes, float]] = {}  # key -> route -> last heard
        self._reload_asked = False
        self._probes = Probes()  # which dialed workers to look at when connections drop
        # a dialed worker's route -> its last Hello (hashed, and its size), and when it was last heard
        self._keepalives: dict[bytes, tuple[int, int, float]] = {}
        self._admission = Admission()  # what each connection and key sent, and who is cut
        self._refusals = Quiet("refusals")
        self._comings = Quiet("hosts dialing in or leaving")  # a name moved to and fro is a flood too
        self._losses = Quiet("undelivered messages")

    @property
    def children(self) -> dict[str, Child]:
        """The workers this broker spawned, by host."""
        return self._spawned.children

    @property
    def dialed(self) -> dict:
        """The hosts served by workers that dialed in, by name."""
        return self.view.offers

    def bind(self, url: str, *, keys: Keys | None = None) -> str:
        # a frame bigger than any the broker takes cuts its peer in libzmq, before it is queued;
        # its queue to each peer holds a few messages, counted in bytes by the outbox (`outbox`)
        self._front = sockets.router(largest=LARGEST, queued=PIPED)
        # never a full queue from a peer: libzmq (4.3.5) aborts the process when a peer whose
        # inbound queue is full disconnects and a heartbeat (ours, or a PING it sent) is then
        # written (`!_io_error`, stream_engine_base.cpp:310). This loop reads as fast as
        # anything arrives, drops what it will not serve, and cuts a flooder (`floods`), so
        # the queue stays short.
        self._front.setsockopt(zmq.RCVHWM, 0)
        # a connection dropping (a dialed-in worker killed, or silent past its pings) makes
        # the broker probe that worker
        self._drops = self._front.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        # no pings of its own: timers in its one I/O thread that libzmq 4.3.5 cancels by a walk
        # over all of them (idle CPU grew with the fleet's square). A dialed worker's pings
        # have a time to live, hosts clients wait on are checked (`BrokerView.expire`), and
        # the kernel's keepalive finds a machine that went away.
        sockets.tcp_keepalive(self._front)
        if keys is not None:
            self._guard = Guard(sockets.context(), keys, log=log)
            as_server(self._front, keys)
            self._free(lambda: self.view.revoke(self._guard.allowed(), self._guard.workers), "at start")
        self._front.bind(url)
        self._outbox = Outbox(self._front)
        self.endpoint = sockets.bound_endpoint(self._front)
        if keys is not None and keys.allow is not None and not sockets.is_loopback(url):
            # clients on other machines: its children listen beside it, with keys, not on a socket file
            self._spawned.reach = Reach(self.endpoint.removeprefix("tcp://").rpartition(":")[0], keys.allow)
        return self.endpoint

    # -- the loop ----------------------------------------------------------------------
    def serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._front, zmq.POLLIN)
        poller.register(self._helper.wake, zmq.POLLIN)
        if self._drops is not None:
            poller.register(self._drops, zmq.POLLIN)
        try:
            while not self.stopping.is_set():
                if self._reload_asked:
                    self._reload_asked = False
                    self._reload()
                self._expire()
                assert self._outbox is not None  # set by `bind`, which comes first
                events = dict(poller.poll(20 if self._outbox.pending() else 200))
                self._take()  # what a peer said before its connection dropped is heard first (its Bye)
                if self._drops is not None and self._drops in events:  # (None is never polled)
                    dropped = []
                    while sockets.readable(self._drops):
                        dropped.append(self._drops.recv_multipart()[0])
                    if self._probes.dropped(dropped):
                        self._probe()
                elif self._probes.due and time.monotonic() >= self._probes.due:
                    self._probe()
                if self._helper.wake in events:
                    self._helper.deliver()
                for route in self._outbox.flush():
                    self._gone(route)
        finally:
            self.close()

    def close(self) -> None:
        self.stopping.set()
        self._helper.close()
        self._spawned.close()
        if self._front is not None and self._drops is not None and not self._front.closed:
            try:
                self._front.disable_monitor()
            except zmq.ZMQError:
                pass
        sockets.close(self._drops, self._front)
        if self._guard is not None:
            self._guard.close()
            self._guard = None

    def described(self) -> str:
        """Who may come in, for the start line."""
        return "no keys" if self._guard is None else f"CURVE keys: {self._guard.described()}"

    def reload(self) -> None:
        """Ask for the allow folders to be read again (from a signal handler: the serving
        thread does it at its next turn, never in the middle of a message)."""
        self._reload_asked = True

    def _left(self, hosts: list[str], offers: dict, why: str) -> None:
        for host in hosts:
            offer = offers.get(host)
            owner = offer.owner if offer is not None else self.view.bindings.get(host, "")
            if owner.startswith("route:") or not owner:
                who = "no keys" if offer is None else peer_name(offer.route)
            else:
                who = peer_name(b"", owner)
            more = self._comings.more()
            if more is not None:
                log.info("host `%s` left (%s): %s%s", host, who, why, more)

    def _refused(self, route: bytes, user: str, why: str) -> None:
        """Log a refusal, at most `quiet.LOUD` per `quiet.QUIET` seconds: a flood is counted, not printed."""
        more = self._refusals.more()
        if more is not None:
            log.info("refused %s: %s%s", peer_name(route, user), why, more)

    # -- sending: never blocking ------------------------------------------------------
    def _deliver(self, route: bytes, frames: list, tenant: str = "") -> None:
        assert self._outbox is not None  # set by `bind`: what is sent answers what `serve` read
        said = self._outbox.send(route, frames, tenant)
        if said == GONE:
            more = self._losses.more()
            if more is not None:
                log.info("a message to %s could not be delivered: its connection is gone%s", peer_name(route), more)
            self._gone(route)
        elif said == DROPPED and self._outbox.dropped_for(route) in (1, 1000, 100_000):
            more = self._losses.more()
            if more is not None:
                log.info(
                    "%s does not read what it is sent: %d messages for it dropped so far%s",
                    peer_name(route),
                    self._outbox.dropped_for(route),
                    more,
                )

    def _answer(self, route: Any, message: Any) -> None:
        try:
            frames = encode(message)
        except (ValueError, TypeError) as exc:  # over a wire limit: say so, and keep serving
            frames = encode(Refusal(f"the broker's answer did not fit in a message: {exc}"[:1000]))
        self._deliver(route, frames)

    def _gone(self, route: bytes) -> None:
        """ZeroMQ has no route of that id any more (not a full queue: that is only slow)."""
        assert self._outbox is not None  # set by `bind`: only a send or a read finds a route gone
        self._outbox.forget(route)
        self._leave(route, "its connection is gone")

    def _leave(self, route: bytes, why: str) -> None:
        """``route`` is gone or said Bye: its offers and exchanges end (at the cost of what it
        had, not of the fleet's size)."""
        offers = {h: self.view.offers[h] for h in self.view.offers_index.get(route, ())}
        self._left(self.view.leave(route), offers, why)
        self._probes.forget(route)
        self._keepalives.pop(route, None)
        self._tell_ended()

    def _handle(self, route: bytes, frames: list) -> None:
        now = time.monotonic()
        offering = route in self.view.offers_index
        if offering:
            kept = self._keepalives.get(route)
            if (
                kept is not None
                and now - kept[2] >= self.patience / 10
                and kept[1] == size_of(frames)
                and kept[0] == hash(b"".join(f.bytes for f in frames))
            ):
                # the very Hello it said before, at a keepalive's pace: nothing to count or decode
                self._keepalives[route] = (kept[0], kept[1], now)
                self.view.heard(route, now)
                return
        try:
            variant = variant_of(frames)  # a Relay's told by its first bytes
        except ProtocolError as exc:
            variant, junk = None, exc
        user = self._user(frames[0])
        if not self._admit(route, user, frames, variant is not Relay, now):
            return
        roles = _EVERYONE
        if self._guard is not None:
            roles = self._guard.roles(user)
            if not roles:  # its key was taken out of the allow folders since it connected (the
                # reload that took it out ended its exchanges and offers)
                if not self._refusal(route, user, frames[0], now):
                    self._refused(route, user, "its key is no longer in the allow-list")
                    self._answer(route, Refusal("this key is no longer allowed on this broker; ask its operator"))
                return
        self.view.heard(route, now)  # any message from a dialed worker says it is there
        if variant is Ready and offering:
            return  # its answer to our check (`_expire`): heard, nothing more to do
        # a worker key is a job's key: one connection per node it runs on, up to the hosts it may serve
        most = MAX_CONNECTIONS + (self.view.max_offers if WORKER in roles else 0)
        if user and not self._connected(user, route, now, most):
            if not self._refusal(route, user, frames[0], now):
                self._refused(route, user, f"this key already has {most} connections open here")
                self._answer(
                    route,
                    Refusal(
                        f"this key already has {most} connections open at this broker; "
                        f"use fewer, or wait {CONNECTION_IDLE:g} s after closing some"
                    ),
                )
            return
        relay: Relay | None = None
        try:
            if variant is None:
                raise junk
            if variant is Relay:
                decoded = decode(frames)
                assert isinstance(decoded, Relay)  # the variant its header names (`variant_of`)
                relay = decoded
                deliver = self.view.relay(route, user, relay, now)
                tenant = str(relay.exchange) if relay.exchange else self.view.tenant(route, user)
                if deliver is not None:
                    self._deliver(deliver.route, deliver.frames, tenant)
                if self.view.ending or self.view.cut:
                    self._tell_ended()
                return
            if variant not in (Hello, Where, Hosts, Bye):  # never decode values it will not use
                raise Violation(f"a broker does not answer a `{variant.__name__}`")
            message = decode(frames)
        except Stale:  # counted by the view; nobody is owed a word (an answer's client is gone,
            # or a Bye ended nothing), and it counts as a refusal here
            self._refusal(route, user, frames[0], now)
            return
        except ProtocolError as exc:
            if self._refusal(route, user, frames[0], now):
                return
            self._refused(route, user, exc.why)  # a relayed Work refused here is named: it ended
            refusal = Refusal(exc.why, ref=None if relay is None else ref_of(relay.inner))
            if relay is not None and relay.lane:  # to the channel it came from, among the client's many
                self._deliver(route, encode(Relay(lane=relay.lane, inner=tuple(encode(refusal)))))
            else:
                self._answer(route, refusal)
            return
        if isinstance(message, Hello):
            self._hello(route, user, roles, message, now)
            if route in self.view.offers_index:
                if not self._probes.knows(route):
                    self._probes.know(route, frames[0])
                self._keepalives[route] = (hash(b"".join(f.bytes for f in frames)), size_of(frames), now)
        elif isinstance(message, Where):
            answer = self._where(message, route, self.view.identity(route, user))
            if answer is not None:
                self._answer(route, answer)
        elif isinstance(message, Hosts):
            self._answer(route, self._listed())
        else:
            self._leave(route, "it said Bye")
            assert self._outbox is not None  # set by `bind`: this message was read from its front
            self._outbox.forget(route)
            if user:  # a channel closed: it no longer counts against its key's connections
                routes = self._connections.get(user)
                if routes is not None:
                    routes.pop(route, None)

    def _connected(self, key: str, route: bytes, now: float, most: int) -> bool:
        """Count ``route`` against ``key``'s connections: False past ``most``."""
        routes = self._connections.setdefault(key, OrderedDict())
        if route not in routes and len(routes) >= most:
            for old, heard in list(routes.items()):
                if now - heard > CONNECTION_IDLE and old not in self.view.offers_index:
                    del routes[old]
            if len(routes) >= most:
                return False
        routes[route] = now
        routes.move_to_end(route)
        return True

    # -- rendezvous --------------------------------------------------------------------
    def _hello(self, route: bytes, user: str, roles: frozenset, hello: Hello, now: float) -> None:
        why = compatible(self.runtime, hello.runtime, needs_pickle=False, me="this broker", them="you")
        if why is not None:
            self._refused(route, user, why)
            self._answer(route, Refusal(why))
            return
        try:
            said = self.view.hello(route, user, roles, hello, now)
        except Violation as refused:
            exc: Violation | None = refused
            if not self._still_served(hello.offering):  # its old connection is gone: the name is free
                try:
                    said = self.view.hello(route, user, roles, hello, now)
                except Violation as again:
                    exc = again
                else:
                    exc = None
            if exc is not None:
                self._refused(route, user, exc.why)
                self._answer(route, Refusal(exc.why))
                return
        if said == "offered":
            more = self._comings.more()
            if more is not None:
                log.info(
                    "host `%s` dialed in (%s, %s mode)%s",
                    hello.offering,
                    peer_name(route, user),
                    hello.runtime.mode or "project",
                    more,
                )
        self._keep_bindings()
        if said != "keepalive":
            self._answer(route, Ready(self.runtime))

    def _still_served(self, host: str | None) -> bool:
        """Whether the connection serving ``host`` is still there (asked when another offers
        it: a worker that dialed again after its connection dropped finds its name taken by
        the old connection until it is found gone). Without keys only; a key keeps its names."""
        offer = self.view.offers.get(host) if host else None
        if offer is None or not offer.owner.startswith("route:"):
            return True
        assert self._front is not None  # set by `bind`: a Hello read from it asks this
        try:
            self._front.send_multipart([offer.route, *encode(Ready(self.runtime))], zmq.NOBLOCK)
        except zmq.Again:
            return True  # slow, not gone
        except zmq.ZMQError:
            self._gone(offer.route)
            return False
        return True

    def _keyed(self) -> dict[str, str]:
        return {h: k for h, k in self.view.bindings.items() if not k.startswith("route:")}

    def _keep_bindings(self) -> None:
        """Write the bindings of keys to names when they changed, off this thread. Asked at
        every offer and keepalive: it looks at the fleet only when a binding did change."""
        if self.bindings is None or self.view.bindings.version == self._looked_at:
            return
        self._looked_at = self.view.bindings.version
        keyed = self._keyed()
        if keyed == self._written:
            return
        self._written = keyed
        path = self.bindings

        def written(result: Any) -> None:
            if isinstance(result, Exception):  # a full disk must not stop the serving
                self._written, self._looked_at = None, -1  # tried again at the next turn that asks
                more = self._losses.more()
                if more is not None:
                    log.warning("could not keep the host bindings in %s: %s%s", path, result, more)

        self._helper.submit("bindings", lambda: _bindings.write(path, keyed), written)

    def _expire(self) -> None:
        """Offers silent past their time are gone; hosts clients wait on, silent for a
        patience, are asked whether they are there: a Hello, answered by Ready (`BrokerView.expire`)."""
        gone = self.view.expire(time.monotonic())
        if self.view.checks:
            self._ask(self.view.checks, Hello(self.runtime))
        if self.view.orphaned:
            self._tell_orphaned()
        if gone:  # a keyed owner's binding outlives its offer: it names the key
            stalled = self.view.stalled
            self._left([h for h in gone if h in stalled], {}, f"silent for {1.5 * self.patience:g} s with work open")
            self._left([h for h in gone if h not in stalled], {}, f"silent for {IDLE_SILENCE * self.patience:g} s")
            self._prune()

    def _tell_orphaned(self) -> None:
        """Clients whose work was open when its worker was lost, the host offered again
        before they looked (they would find it there and wait for ever): told now."""
        orphaned, self.view.orphaned = self.view.orphaned, []
        for exchange in orphaned:
            assert self._outbox is not None  # set by `bind`: `serve` asks this
            self._outbox.forget(exchange.client, str(exchange.number))
            self._tell_client(
                exchange,
                Refusal(
                    f"the worker serving `{exchange.host}` was lost while the work sent there was open (silent "
                    f"past this broker's patience, or its connection dropped) and has dialed in again since: no "
                    f"answer to that work can come through; forward again"
                ),
            )

    def _prune(self) -> None:
        """Forget what was kept of routes that serve nothing any more (offers expired or
        revoked, rather than left)."""
        serving = self.view.offers_index
        self._probes.prune(serving)
        for route in [r for r in self._keepalives if r not in serving]:
            del self._keepalives[route]

    def _probe(self) -> None:
        """A dialed worker's connection dropped: is it gone? (`probes`; what waits already tells)"""
        suspects = [r for r in self._probes.take(time.monotonic()) if r in self.view.offers_index]
        assert self._outbox is not None  # set by `bind`: `serve` probes
        if suspects := [r for r in suspects if not self._outbox.waiting(r)]:
            self._ask(suspects, Ready(self.runtime))

    def _ask(self, routes: list[bytes], message: Any) -> None:
        """``message`` to each of ``routes``, now: a full queue is slow, never gone; no route is gone."""
        frames = encode(message)
        assert self._front is not None  # set by `bind`: `serve` asks
        for route in routes:
            try:
                self._front.send_multipart([route, *frames], zmq.NOBLOCK)
            except zmq.Again:
                pass
            except zmq.ZMQError:
                self._gone(route)

    def _listed(self) -> Listed:
        return _answers.listed(self.hosts, self.view.offers)

    def _listing(self) -> dict[str, str]:
        return _answers.listing(self.hosts, self.view.offers)

    def _where(self, where: Where, route: bytes, tenant: str) -> Located | Refusal | None:
        """The answer now, or None when a helper job will give it (a spawned host to start
        or to check)."""
        host = where.host
        declared = self.hosts.get(host)
        if declared is None:
            offer = self.view.offers.get(host)
            if offer is None:
                return Refusal(f"this broker knows no host `{host}` (it knows: {_some(self._listing())})")
            return Located(
                host,
                "relayed",
                address=self.endpoint,
                mode=offer.runtime.mode or "project",
                mount=offer.mount,
                seen=offer.token,
            )
        if declared.how == "inprocess":
            return Located(host, "inprocess")
        path = "mount" if declared.mount else "direct"
        if declared.how == "at":
            return Located(
                host,
                path,
                address=sockets.tcp_url(declared.address),
                mode=declared.mode,
                mount=declared.mount,
                key=declared.server_key(),
            )
        return self._spawned.where(host, declared, where, route, tenant)
