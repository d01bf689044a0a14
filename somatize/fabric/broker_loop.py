"""The broker's side: a rendezvous that steps out of the way, and a relay of last resort.

A client asks "where is H?" once per host per session and gets a ``Located``: in this
process, through a shared directory, directly at an address, or relayed through here.
Spawned workers are started on the first such question and stopped when the broker
closes. Only for workers that dialed in (``--broker URL --offer H``) does cargo pass
through the broker, and then it is forwarded frame by frame, never decoded.

This module serves; :mod:`somatize.fabric.broker` is what a graph talks to. It logs one
line per lifecycle event under ``somatize.broker`` (a host dialing in or leaving, a reload,
a refusal); the command attaches the handler (:mod:`.command`).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import zmq

from ..errors import BadKeys, ProtocolError, Refused
from ..wire import (
    MAX_NAME,
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
    variant_of,
)
from ..wire.limits import Z85
from . import sockets
from .conversation import CLIENT, WORKER, BrokerView, Stale, Violation
from .curve import Guard, Keys, as_server, peer_name, user_of
from .worker import Worker
from .spawn import Child

#: Hosts that may dial in at once (a `Listed` answer must fit in one message).
MAX_DIALED = 1000
#: The longest a broker waits for a spawned worker to answer a probe (seconds).
PROBE = 2.0
_EVERYONE = frozenset((CLIENT, WORKER))
#: Refusals logged per `_QUIET` seconds at most; past it they are counted, and the count said.
_LOUD, _QUIET = 20, 10.0
log = logging.getLogger("somatize.broker")


def _some(names: Any, most: int = 20) -> str:
    names = sorted(names)
    shown = ", ".join(f"`{n[:60]}`" for n in names[:most]) or "none"
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


class BrokerLoop:
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
        self.children: dict[str, Child] = {}
        self.view = BrokerView(set(hosts), patience=patience, max_dialed=MAX_DIALED)
        # which key owns which dialed-in name, kept across restarts when given a file: a
        # restarted broker must not hand a name to whichever key says Hello first
        self.bindings = Path(bindings) if bindings is not None else None
        if self.bindings is not None:
            self.view.bindings.update(read_bindings(self.bindings))
        self._written = self._keyed()
        self.endpoint = ""
        self.stopping = threading.Event()
        self._front: zmq.Socket | None = None
        self._drops: zmq.Socket | None = None
        self._guard: Guard | None = None
        self._lock = threading.Lock()
        self._refusals = _Quiet("refusals")
        self._comings = _Quiet("hosts dialing in or leaving")  # a name moved to and fro is a flood too

    @property
    def dialed(self) -> dict:
        """The hosts served by workers that dialed in, by name."""
        return self.view.offers

    def bind(self, url: str, *, keys: Keys | None = None) -> str:
        self._front = sockets.router()
        # a connection dropping (a dialed-in worker killed, or silent past the heartbeat)
        # makes the broker check which of its dialed-in workers are still there
        self._drops = self._front.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sockets.heartbeat(self._front, self.patience)
        if keys is not None:
            self._guard = Guard(sockets.context(), keys, log=log)
            as_server(self._front, keys)
        self._front.bind(url)
        self.endpoint = sockets.bound_endpoint(self._front)
        return self.endpoint

    # -- the loop ----------------------------------------------------------------------
    def serve(self) -> None:
        try:
            while not self.stopping.is_set():
                self._expire()
                if self._drops is not None and self._drops.get(zmq.EVENTS) & zmq.POLLIN:
                    while self._drops.get(zmq.EVENTS) & zmq.POLLIN:
                        self._drops.recv_multipart()
                    self._probe()
                if not sockets.poll(self._front, 0.2):
                    continue
                for _ in range(256):
                    if not self._front.get(zmq.EVENTS) & zmq.POLLIN:
                        break
                    self._handle(self._front.recv_multipart(copy=False))
        finally:
            self.close()

    def close(self) -> None:
        self.stopping.set()
        with self._lock:
            children, self.children = list(self.children.values()), {}
        for child in children:
            child.stop()
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
        """Read the allow folders again; a key taken out loses its hosts and exchanges now.
        A folder that cannot be used refuses the new list as a whole: the old one stays."""
        if self._guard is None:
            log.info("reload asked for, but this broker listens without keys: nothing to reload")
            return
        try:
            self._guard.reload()
        except BadKeys as exc:
            log.error("the allow-list was not reloaded, the old one stays (%s): %s", self._guard.described(), exc)
            return
        log.info("reloaded the allow-list: %s", self._guard.described())
        before = dict(self.view.offers)
        self.view.revoke(self._guard.allowed())
        self._left([h for h in before if h not in self.view.offers], before, "its key was taken out of the allow-list")
        self._keep_bindings()

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
        """Log a refusal, at most `_LOUD` per `_QUIET` seconds: a flood is counted, not printed."""
        more = self._refusals.more()
        if more is not None:
            log.info("refused %s: %s%s", peer_name(route, user), why, more)

    def _send(self, parts: list) -> None:
        try:
            self._front.send_multipart(parts, copy=False)
        except zmq.ZMQError as exc:  # ROUTER_MANDATORY: never a silent drop
            log.warning("a message to %s could not be delivered (%s)", peer_name(bytes(parts[0])), exc)

    def _answer(self, route: Any, message: Any) -> None:
        try:
            frames = encode(message)
        except (ValueError, TypeError) as exc:  # over a wire limit: say so, and keep serving
            frames = encode(Refusal(f"the broker's answer did not fit in a message: {exc}"[:1000]))
        self._send([route, *frames])

    def _handle(self, parts: list) -> None:
        if len(parts) < 2:
            return
        route, frames = parts[0].bytes, parts[1:]
        user, roles = "", _EVERYONE
        if self._guard is not None:
            user = user_of(parts[1])
            roles = self._guard.roles(user)
            if not roles:  # its key was taken out of the allow folders since it connected
                self.view.revoke(self._guard.allowed())
                self._refused(route, user, "its key is no longer in the allow-list")
                self._answer(route, Refusal("this key is no longer allowed on this broker; ask its operator"))
                return
        now = time.monotonic()
        try:
            variant = variant_of(frames)
            if variant is Relay:
                deliver = self.view.relay(route, user, decode(frames), now)
                self._send([deliver.route, *deliver.frames])
                return
            if variant not in (Hello, Where, Hosts, Bye):  # never decode values it will not use
                raise Violation(f"a broker does not answer a `{variant.__name__}`")
            message = decode(frames)
        except Stale:
            return  # counted by the view; the answer's client is gone and nobody is owed a word
        except ProtocolError as exc:
            self._refused(route, user, exc.why)
            self._answer(route, Refusal(exc.why))
            return
        if isinstance(message, Hello):
            self._hello(route, user, roles, message, now)
        elif isinstance(message, Where):
            self._answer(route, self._where(message))
        elif isinstance(message, Hosts):
            self._answer(route, Listed(self._listing()))
        else:
            before = dict(self.view.offers)
            self._left(self.view.leave(route), before, "it said Bye")

    # -- rendezvous --------------------------------------------------------------------
    def _hello(self, route: bytes, user: str, roles: frozenset, hello: Hello, now: float) -> None:
        why = compatible(self.runtime, hello.runtime, needs_pickle=False, me="this broker", them="you")
        if why is not None:
            self._refused(route, user, why)
            self._answer(route, Refusal(why))
            return
        try:
            said = self.view.hello(route, user, roles, hello, now)
        except Violation as exc:
            self._refused(route, user, exc.why)
            self._answer(route, Refusal(exc.why))
            return
        if said == "offered":
            more = self._comings.more()
            if more is not None:
                log.info("host `%s` dialed in (%s, %s mode)%s", hello.offering, peer_name(route, user),
                         hello.runtime.mode or "project", more)
        self._keep_bindings()
        if said != "keepalive":
            self._answer(route, Ready(self.runtime))

    def _keyed(self) -> dict[str, str]:
        return {h: k for h, k in self.view.bindings.items() if not k.startswith("route:")}

    def _keep_bindings(self) -> None:
        """Write the bindings of keys to names when they changed (atomically, 0600)."""
        keyed = self._keyed()
        if self.bindings is None or keyed == self._written:
            return
        try:
            write_bindings(self.bindings, keyed)
            self._written = keyed
        except OSError as exc:  # a full disk must not stop the serving; say so every time
            log.warning("could not keep the host bindings in %s: %s", self.bindings, exc)

    def _expire(self) -> None:
        """A dialed-in worker announces itself every `patience`; one silent for three is gone."""
        gone = self.view.expire(time.monotonic())
        if gone:  # a keyed owner's binding outlives its offer: it names the key
            self._left(gone, {}, f"silent for {3 * self.patience:g} s (three patiences)")

    def _probe(self) -> None:
        """Send each dialed-in worker a Ready; ROUTER_MANDATORY says which are gone."""
        hello = encode(Ready(self.runtime))
        for route in {o.route for o in self.view.offers.values()}:
            try:
                self._front.send_multipart([route, *hello], zmq.NOBLOCK)
            except zmq.ZMQError:
                before = dict(self.view.offers)
                self._left(self.view.leave(route), before, "its connection is gone")

    def _listing(self) -> dict[str, str]:
        listing = {name: ("inprocess" if w.how == "inprocess" else w.mode) for name, w in self.hosts.items()}
        listing.update({name: o.runtime.mode or "project" for name, o in self.view.offers.items()})
        return listing

    def _where(self, where: Where) -> Located | Refusal:
        host = where.host
        declared = self.hosts.get(host)
        if declared is None:
            offer = self.view.offers.get(host)
            if offer is None:
                return Refusal(f"this broker knows no host `{host}` (it knows: {_some(self._listing())})")
            return Located(host, "relayed", address=self.endpoint, mode=offer.runtime.mode or "project")
        if declared.how == "inprocess":
            return Located(host, "inprocess")
        path = "mount" if declared.mount else "direct"
        if declared.how == "at":
            return Located(
                host, path, address=sockets.tcp_url(declared.address), mode=declared.mode,
                mount=declared.mount, key=declared.server_key(),
            )
        with self._lock:
            child = self.children.get(host)
            if child is None:
                child = self.children[host] = Child(host, declared.argv, mode=declared.mode, mount=declared.mount)
            if where.lost:
                # a client's word is not enough to stop a worker others may use: look first
                limit = getattr(declared, "deadline", None)
                if self.private and where.waited_us:
                    # the one client of an embedded broker gave up on work after waited_us;
                    # a child still busy with work at least half that old is stuck in it
                    # (half: the client's wait includes the work's way there)
                    waited = where.waited_us / 2e6
                    limit = waited if limit is None else min(limit, waited)
                ended = self._check(child, limit)
                return Located(host, path, address=child.address, mode=declared.mode, mount=declared.mount, ended=ended)
            if not child.running:
                try:
                    child.start()
                except Refused as exc:
                    return Refusal(str(exc))
        return Located(host, path, address=child.address, mode=declared.mode, mount=declared.mount)

    def _check(self, child: Child, deadline: float | None) -> str | None:
        """Probe a spawned worker a client says it lost. Kill it only if it is gone, does
        not answer, or has run one piece of work past its host's deadline; return how it
        ended, or None when it is well (the client's trouble was elsewhere)."""
        child.settle(0.2)  # a child that was just killed may still be on its way out
        if not child.running:
            return child.ended()
        answer = _probe(child.address, self.runtime, min(PROBE, self.patience))
        if isinstance(answer, Ready) and (deadline is None or answer.busy_us <= deadline * 1_000_000):
            return None
        child.settle(0.1)
        if not child.running:
            return child.ended()
        why = (
            "stopped answering while still running" if not isinstance(answer, Ready)
            else f"was still running one piece of work after {answer.busy_us / 1e6:.0f} s, past its deadline of {deadline:g} s"
        )
        child.kill()  # the next forward starts afresh
        return why




def _probe(address: str, runtime: Runtime, timeout: float) -> Any:
    """Say Hello to a worker on a socket of its own; its answer, or None within ``timeout``."""
    sock = sockets.dealer(timeout)
    try:
        sock.connect(address)
        sock.send_multipart(encode(Hello(runtime)))
        if not sockets.poll(sock, timeout):
            return None
        return decode(sock.recv_multipart(copy=False))
    except (zmq.ZMQError, ProtocolError):
        return None
    finally:
        sockets.close(sock)


def read_bindings(path: Path) -> dict[str, str]:
    """The names bound to keys, from a file this broker wrote (a JSON map); none when it
    does not exist yet. Anything else in it is refused with a sentence."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    try:
        table = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{path} is not the bindings file this broker writes (a JSON map of host to key): {exc}") from exc
    if not isinstance(table, dict) or not all(
        isinstance(h, str) and 0 < len(h) <= MAX_NAME and isinstance(k, str) and len(k) == 40 and set(k) <= Z85
        for h, k in table.items()
    ):
        raise ValueError(f"{path} is not the bindings file this broker writes: it maps host names to Z85 public keys")
    return table


def write_bindings(path: Path, table: dict[str, str]) -> None:
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump(table, out, sort_keys=True, indent=1)
        out.flush()
        os.fsync(out.fileno())
    os.replace(temp, path)


class _Quiet:
    """At most `_LOUD` lines of one kind per `_QUIET` seconds: past it lines are counted, and
    the count is said with the next line logged. Whoever sends can make a broker log; nobody
    can make it flood its journal."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.said: list[float] = []
        self.unsaid = 0

    def more(self) -> str | None:
        """The suffix for a line that may be logged now (``""`` or the count left out), or
        None when this one is to be counted, not logged."""
        now = time.monotonic()
        self.said = [t for t in self.said if now - t < _QUIET]
        if len(self.said) >= _LOUD:
            self.unsaid += 1
            return None
        self.said.append(now)
        more = f" ({self.unsaid} more {self.what} were not logged)" if self.unsaid else ""
        self.unsaid = 0
        return more
