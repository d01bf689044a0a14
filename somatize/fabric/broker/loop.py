"""The broker's side: a rendezvous that steps out of the way, and a relay of last resort.

A client asks "where is H?" once per host per session and gets a ``Located``: in this
process, through a shared directory, directly at an address, or relayed through here.
Spawned workers are started on the first such question and stopped when the broker
closes. Only for workers that dialed in (``--broker URL --offer H``) does cargo pass
through the broker, and then it is forwarded frame by frame, never decoded.

What the broker does with a message is looked up in its conversation's table
(:data:`~somatize.fabric.conversation.broker.BROKER_TABLE`: who sends it, what it is -> a step, one method
here per step); whether it may arrive now, from this peer, and what to say to whom when an
exchange ends, is the view's (:class:`~somatize.fabric.broker.peers.BrokerView`, sans IO). This
loop moves frames and carries out what those give back.

The loop never blocks: its socket, the admission step and every send are its
:class:`~somatize.fabric.broker.front.Front`'s (``NOBLOCK``, a bounded queue per peer and
tenant; a peer that does not read loses its answers, counted), and what can take time
(starting a spawned worker, checking one a client says it lost, writing the bindings file)
runs off this thread (:mod:`somatize.fabric.broker.checks`). Each tenant (a key; without keys,
a connection) has quotas: questions waiting for such a job, answers waiting to be read,
connections per key. Nobody's pace is another's wait.

This module serves (a graph talks to :mod:`somatize.fabric.client.handle`); it logs under
``somatize.broker``, every line a peer can cause through a limiter (`logs.Quiet`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import zmq

from ...errors import BadKeys, ProtocolError
from ...wire import (
    Hello,
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
from ...wire.writing import passed_on
from .. import sockets
from ..conversation import Stale, Violation
from ..conversation.broker import BROKER_TABLE, Side, Step
from ..curve import Guard, Keys, peer_name
from ..hosts import Worker
from ..logs import Quiet
from . import answers as _answers
from . import bindings as _bindings
from .checks import Helper
from .children import Spawned
from .exchanges import Deliver, Forget
from .front import CONNECTION_IDLE, Front, size_of
from .peers import CLIENT, IDLE_SILENCE, WORKER, BrokerView
from .probes import Probes
from .spawn import Child, Reach

#: Hosts that may dial in at once (a `Listed` answer lists 10,000 at most), and hosts one
#: worker key may serve at once (a SLURM job of that many nodes on one key; `--max-hosts-per-key`).
MAX_DIALED, MAX_HOSTS_PER_KEY = 10_000, 4096
#: Per tenant: connections of one key (`children.MAX_PENDING`: questions waiting for a start;
#: `front.MAX_UNREAD`: answers waiting for one connection to read them; a connection idle for
#: `front.CONNECTION_IDLE` seconds no longer counts).
MAX_CONNECTIONS = 64
_EVERYONE = frozenset((CLIENT, WORKER))
log = logging.getLogger("somatize.broker")


class BrokerLoop:
    """Answers ``Where`` and ``Hosts``, spawns, and relays. ``bind()`` then ``serve()``.

    Who may reach it: with keys, only peers whose CURVE key is in an allow folder (clients
    may ask and send work; worker keys may also offer hosts); without keys, whoever reaches
    its address (loopback or inproc only, unless ``--insecure``). What one allowed peer may
    do to another is the business of :class:`~somatize.fabric.conversation.BrokerView`.
    """

    #: The method that carries out each step of the conversation's table (`conversation.BROKER_TABLE`;
    #: HEARD, a worker's answer to a check, is heard and nothing more).
    STEPS = {
        Step.GREET: "_greet",
        Step.LOCATE: "_locate",
        Step.LIST: "_list",
        Step.LEAVE: "_bye",
        Step.FORWARD: "_forward",
    }

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
        self.stopping = threading.Event()
        self.front = Front(self.view.offers_index, self._gone)
        self._guard: Guard | None = None
        self._helper = Helper()
        self._spawned = Spawned(
            self._helper, self.front.answer, runtime=self.runtime, patience=patience, private=private
        )
        self._reload_asked = False
        self._probes = Probes()  # which dialed workers to look at when connections drop
        # a dialed worker's route -> its last Hello (hashed, and its size), and when it was last heard
        self._keepalives: dict[bytes, tuple[int, int, float]] = {}
        self._comings = Quiet("hosts dialing in or leaving")  # a name moved to and fro is a flood too
        self._unkept = Quiet("failures to keep the bindings")  # tried again at every offer
        self._steps = {step: getattr(self, name) for step, name in self.STEPS.items()}

    @property
    def endpoint(self) -> str:
        return self.front.endpoint

    @property
    def children(self) -> dict[str, Child]:
        """The workers this broker spawned, by host."""
        return self._spawned.children

    @property
    def dialed(self) -> dict:
        """The hosts served by workers that dialed in, by name."""
        return self.view.offers

    def bind(self, url: str, *, keys: Keys | None = None) -> str:
        if keys is not None:
            self._guard = Guard(sockets.context(), keys, log=log)
            self._free(lambda: self.view.revoke(self._guard.allowed(), self._guard.workers), "at start")
        endpoint = self.front.bind(url, keys)
        if keys is not None and keys.allow is not None and not sockets.is_loopback(url):
            # clients on other machines: its children listen beside it, with keys, not on a socket file
            self._spawned.reach = Reach(endpoint.removeprefix("tcp://").rpartition(":")[0], keys.allow)
        return endpoint

    # -- the loop ----------------------------------------------------------------------
    def serve(self) -> None:
        poller = zmq.Poller()
        self.front.polled(poller)
        poller.register(self._helper.wake, zmq.POLLIN)
        try:
            while not self.stopping.is_set():
                if self._reload_asked:
                    self._reload_asked = False
                    self._reload()
                self._expire()
                events = dict(poller.poll(20 if self.front.pending() else 200))
                self.front.take(self._handle)  # what a peer said before its connection dropped is heard first (its Bye)
                dropped = self.front.dropped(events)
                if dropped is not None:
                    if self._probes.dropped(dropped):
                        self._probe()
                elif self._probes.due and time.monotonic() >= self._probes.due:
                    self._probe()
                if self._helper.wake in events:
                    self._helper.deliver()
                self.front.flush()
        finally:
            self.close()

    def close(self) -> None:
        self.stopping.set()
        self._helper.close()
        self._spawned.close()
        self.front.close()
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

    def _carry_out(self, actions: list[Deliver | Forget]) -> None:
        """Do what the view said to do (`BrokerView.tells`), in order."""
        for action in actions:
            if isinstance(action, Forget):
                self.front.forget(action.route, action.tenant)
            else:
                self.front.deliver(action.route, action.frames, action.tenant)

    def _gone(self, route: bytes) -> None:
        """ZeroMQ has no route of that id any more (not a full queue: that is only slow)."""
        self.front.forget(route)
        self._leave(route, "its connection is gone")

    def _leave(self, route: bytes, why: str) -> None:
        """``route`` is gone or said Bye: its offers and exchanges end (at the cost of what it
        had, not of the fleet's size)."""
        offers = {h: self.view.offers[h] for h in self.view.offers_index.get(route, ())}
        self._left(self.view.leave(route), offers, why)
        self._probes.forget(route)
        self._keepalives.pop(route, None)
        self._carry_out(self.view.tells())

    # -- one message: the admission step, the table, the step's method -------------------------
    def _handle(self, route: bytes, frames: list) -> None:
        now = time.monotonic()
        side = Side.SERVING if route in self.view.offers_index else Side.ASKING
        if side is Side.SERVING:
            kept = self._keepalives.get(route)
            if (
                kept is not None
                and now - kept[2] >= self.patience / 10
                and kept[1] == size_of(frames)
                and kept[0] == hash(b"".join(f.bytes for f in frames))
            ):
                # the very Hello it said before (GREET, a keepalive), at a keepalive's pace:
                # nothing to count or decode
                self._keepalives[route] = (kept[0], kept[1], now)
                self.view.heard(route, now)
                return
        try:
            variant = variant_of(frames)  # a Relay's told by its first bytes
        except ProtocolError as exc:
            variant, junk = None, exc
        user = self.front.user(frames[0])
        if not self.front.admit(route, user, frames, variant is not Relay, now):
            return
        roles = _EVERYONE
        if self._guard is not None:
            roles = self._guard.roles(user)
            if not roles:  # its key was taken out of the allow folders since it connected (the
                # reload that took it out ended its exchanges and offers)
                self._refuse(
                    route, user, frames[0], now, "this key is no longer allowed on this broker; ask its operator"
                )
                return
        self.view.heard(route, now)  # any message from a dialed worker says it is there
        step = BROKER_TABLE.get((side, variant)) if variant is not None else None
        if step is Step.HEARD:
            return  # its answer to our check (`_expire`): heard, nothing more to do
        # a worker key is a job's key: one connection per node it runs on, up to the hosts it may serve
        most = MAX_CONNECTIONS + (self.view.max_offers if WORKER in roles else 0)
        if user and not self.front.connected(user, route, now, most):
            self._refuse(
                route,
                user,
                frames[0],
                now,
                f"this key already has {most} connections open at this broker; "
                f"use fewer, or wait {CONNECTION_IDLE:g} s after closing some",
            )
            return
        try:
            if variant is None:
                raise junk
            if step is None:  # never decoded: it is answered by its variant alone
                raise Violation(f"a broker does not answer a `{variant.__name__}`")
            self._steps[step](route, user, roles, frames, decode(frames), now)
        except Stale:  # counted by the view; nobody is owed a word (an answer's client is gone,
            # or a Bye ended nothing), and it counts as a refusal here
            self.front.refusal(route, user, frames[0], now)
        except ProtocolError as exc:
            self._refuse(route, user, frames[0], now, exc.why)

    def _refuse(self, route: bytes, user: str, frame: Any, now: float, why: str, relay: Relay | None = None) -> None:
        """Refuse a message (counted at the admission step: past its share, its connection is
        cut, and nothing is said); a relayed Work refused here is named, on the lane it came from."""
        if self.front.refusal(route, user, frame, now):
            return
        self.front.refused(route, user, why)
        refusal = Refusal(why, ref=None if relay is None else ref_of(relay.inner))
        if relay is not None and relay.lane:  # to the channel it came from, among the client's many
            self.front.deliver(route, passed_on(tuple(encode(refusal)), lane=relay.lane))
        else:
            self.front.answer(route, refusal)

    def _forward(self, route: bytes, user: str, roles: frozenset, frames: list, message: Any, now: float) -> None:
        """A ``Relay``: to the other side of its exchange, as the view says (`BrokerView.relay`)."""
        relay = message
        assert isinstance(relay, Relay)  # the variant its header names (`variant_of`)
        try:
            deliver = self.view.relay(route, user, relay, now)
        except ProtocolError as exc:
            if isinstance(exc, Stale):  # owed no word: `_handle` counts it
                raise
            self._refuse(route, user, frames[0], now, exc.why, relay)
            return
        if deliver is not None:
            self.front.deliver(deliver.route, deliver.frames, deliver.tenant)
        if self.view.ending or self.view.cut:
            self._carry_out(self.view.tells())

    def _bye(self, route: bytes, user: str, roles: frozenset, frames: list, message: Any, now: float) -> None:
        """A ``Bye``: its offers and exchanges end; its connection no longer counts against its key."""
        self._leave(route, "it said Bye")
        self.front.forget(route)
        if user:
            self.front.closed(user, route)

    def _list(self, route: bytes, user: str, roles: frozenset, frames: list, message: Any, now: float) -> None:
        """``Hosts``: every host this broker knows (`answers.listed`)."""
        self.front.answer(route, _answers.listed(self.hosts, self.view.offers))

    def _locate(self, route: bytes, user: str, roles: frozenset, frames: list, message: Any, now: float) -> None:
        """``Where``: at once (`answers.located`), or once a helper job started or checked a
        spawned host's worker."""
        where = message
        assert isinstance(where, Where)  # the variant its header names
        answer = _answers.located(where, self.hosts, self.view.offers, self.endpoint)
        if answer is None:  # a spawned host: running and well, or to be started or checked
            tenant = self.view.identity(route, user)
            answer = self._spawned.where(where.host, self.hosts[where.host], where, route, tenant)
        if answer is not None:
            self.front.answer(route, answer)

    # -- rendezvous --------------------------------------------------------------------
    def _greet(self, route: bytes, user: str, roles: frozenset, frames: list, message: Any, now: float) -> None:
        """A ``Hello``: Ready to a client; an offer, or a keepalive, from a worker."""
        hello = message
        assert isinstance(hello, Hello)  # the variant its header names
        self._hello(route, user, roles, hello, now)
        if route in self.view.offers_index:
            if not self._probes.knows(route):
                self._probes.know(route, frames[0])
            self._keepalives[route] = (hash(b"".join(f.bytes for f in frames)), size_of(frames), now)

    def _hello(self, route: bytes, user: str, roles: frozenset, hello: Hello, now: float) -> None:
        why = compatible(self.runtime, hello.runtime, needs_pickle=False, me="this broker", them="you")
        if why is not None:
            self.front.refused(route, user, why)
            self.front.answer(route, Refusal(why))
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
                self.front.refused(route, user, exc.why)
                self.front.answer(route, Refusal(exc.why))
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
            self.front.answer(route, Ready(self.runtime))

    def _still_served(self, host: str | None) -> bool:
        """Whether the connection serving ``host`` is still there (asked when another offers
        it: a worker that dialed again after its connection dropped finds its name taken by
        the old connection until it is found gone). Without keys only; a key keeps its names."""
        offer = self.view.offers.get(host) if host else None
        if offer is None or not offer.owner.startswith("route:"):
            return True
        if self.front.now(offer.route, encode(Ready(self.runtime))):
            return True
        self._gone(offer.route)
        return False

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
                more = self._unkept.more()
                if more is not None:
                    log.warning("could not keep the host bindings in %s: %s%s", path, result, more)

        self._helper.submit("bindings", lambda: _bindings.write(path, keyed), written)

    # -- what ends without a peer's word: silence, drops, a reload -----------------------------
    def _expire(self) -> None:
        """Offers silent past their time are gone; hosts clients wait on, silent for a
        patience, are asked whether they are there: a Hello, answered by Ready (`BrokerView.expire`)."""
        gone = self.view.expire(time.monotonic())
        if self.view.checks:
            self.front.ask(self.view.checks, Hello(self.runtime))
        if self.view.orphaned:  # their host was offered again before their client looked
            self._carry_out(self.view.tells())
        if gone:  # a keyed owner's binding outlives its offer: it names the key
            stalled = self.view.stalled
            self._left([h for h in gone if h in stalled], {}, f"silent for {1.5 * self.patience:g} s with work open")
            self._left([h for h in gone if h not in stalled], {}, f"silent for {IDLE_SILENCE * self.patience:g} s")
            self._prune()

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
        if suspects := [r for r in suspects if not self.front.waiting(r)]:
            self.front.ask(suspects, Ready(self.runtime))

    def _reload(self) -> None:
        """Read the allow folders again; a key taken out loses its hosts and exchanges now.
        A folder that cannot be used refuses the new list as a whole: the old one stays."""
        guard = self._guard
        if guard is None:
            log.info("reload asked for, but this broker listens without keys: nothing to reload")
            return
        try:
            guard.reload()
        except BadKeys as exc:
            log.error("the allow-list was not reloaded, the old one stays (%s): %s", guard.described(), exc)
            return
        log.info("reloaded the allow-list: %s", guard.described())
        self._spawned.reload()  # children reached from other machines allow the same keys
        before = dict(self.view.offers)
        self._free(lambda: self.view.revoke(guard.allowed(), guard.workers), "at a reload")
        self._left([h for h in before if h not in self.view.offers], before, "its key was taken out of the allow-list")
        self._prune()
        self._carry_out(self.view.tells())  # the other side of each exchange ended is told
        self._keep_bindings()

    def _free(self, revoke: Any, when: str) -> None:
        """Run ``revoke`` and log each name it set free: bound to a key no longer a worker key."""
        before = dict(self.view.bindings)
        revoke()
        for host, owner in sorted(before.items()):
            if host not in self.view.bindings:
                log.info(
                    "host `%s` is free again %s: its key %s is no longer in --allow-workers",
                    host,
                    when,
                    peer_name(b"", owner),
                )
        self._keep_bindings()
