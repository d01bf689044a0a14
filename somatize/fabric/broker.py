"""The broker's side: a rendezvous that steps out of the way, and a relay of last resort.

A client asks "where is H?" once per host per session and gets a ``Located``: in this
process, through a shared directory, directly at an address, or relayed through here.
Spawned workers are started on the first such question and stopped when the broker
closes. Only for workers that dialed in (``--broker URL --offer H``) does cargo pass
through the broker, and then it is forwarded frame by frame, never decoded.

This module serves; :mod:`somatize.fabric.client` is what a graph talks to.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

import zmq

from ..errors import ProtocolError, Refused as RefusedError
from ..wire import Bye, Hello, Hosts, Listed, Located, Ready, Refused, Runtime, Where, compatible, decode, encode
from . import sockets
from .curve import Guard, Keys, as_server
from .declare import Worker
from .serve import RELAY
from .spawn import Child


#: Hosts that may dial in at once (a `Listed` answer must fit in one message).
MAX_DIALED = 1000


def _some(names: Any, most: int = 20) -> str:
    names = sorted(names)
    shown = ", ".join(f"`{n[:60]}`" for n in names[:most]) or "none"
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


class _Dialed:
    """A worker that dialed in and offered a host."""

    def __init__(self, route: bytes, runtime: Runtime) -> None:
        self.route = route
        self.runtime = runtime
        self.seen = time.monotonic()


class BrokerServer:
    """Answers ``Where`` and ``Hosts``, spawns, and relays. ``bind()`` then ``serve()``."""

    def __init__(self, hosts: dict[str, Worker], *, patience: float = sockets.PATIENCE) -> None:
        for name, worker in hosts.items():
            if not isinstance(name, str) or not name:
                raise TypeError(f"a host's name is a non-empty string; got {name!r}")
            if not isinstance(worker, Worker):
                raise TypeError(
                    f"host `{name}` must be declared with `Worker.spawn(...)`, `Worker.at(...)` or "
                    f"`Worker.inprocess()`; got a `{type(worker).__name__}`"
                )
        self.hosts = dict(hosts)
        self.patience = patience
        self.runtime = Runtime.here()
        self.children: dict[str, Child] = {}
        self.dialed: dict[str, _Dialed] = {}
        self.endpoint = ""
        self.stopping = threading.Event()
        self._front: zmq.Socket | None = None
        self._drops: zmq.Socket | None = None
        self._guard: Guard | None = None
        self._lock = threading.Lock()

    def bind(self, url: str, *, keys: Keys | None = None) -> str:
        self._front = sockets.router()
        # a connection dropping (a dialed-in worker killed, or silent past the heartbeat)
        # makes the broker check which of its dialed-in workers are still there
        self._drops = self._front.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sockets.heartbeat(self._front, self.patience)
        if keys is not None:
            self._guard = Guard(sockets.context(), keys)
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

    def reload(self) -> None:
        if self._guard is not None:
            self._guard.reload()

    def _send(self, parts: list) -> None:
        try:
            self._front.send_multipart(parts, copy=False)
        except zmq.ZMQError as exc:  # ROUTER_MANDATORY: never a silent drop
            print(f"somatize broker: a message could not be delivered ({exc})", file=sys.stderr)

    def _answer(self, route: Any, message: Any) -> None:
        try:
            frames = encode(message)
        except (ValueError, TypeError) as exc:  # over a wire limit: say so, and keep serving
            frames = encode(Refused(f"the broker's answer did not fit in a message: {exc}"[:1000]))
        self._send([route, *frames])

    def _handle(self, parts: list) -> None:
        if len(parts) < 2:
            return
        route, frames = parts[0], parts[1:]
        marker = frames[0].bytes
        if marker == RELAY:
            self._relay(route, frames)
            return
        try:
            message = decode(frames)
        except ProtocolError as exc:
            self._answer(route, Refused(exc.why))
            return
        if isinstance(message, Hello):
            self._hello(route, message)
        elif isinstance(message, Where):
            self._answer(route, self._where(message))
        elif isinstance(message, Hosts):
            self._answer(route, Listed(self._listing()))
        elif isinstance(message, Bye):
            self._forget(route.bytes)
        else:
            self._answer(route, Refused(f"a broker does not answer a `{type(message).__name__}`"))

    # -- rendezvous --------------------------------------------------------------------
    def _hello(self, route: Any, hello: Hello) -> None:
        why = compatible(self.runtime, hello.runtime, needs_pickle=False)
        if why is not None:
            self._answer(route, Refused(why))
            return
        if hello.offering is not None:
            declared = self.hosts.get(hello.offering)
            if declared is not None:
                self._answer(
                    route,
                    Refused(f"host `{hello.offering}` is declared on this broker as {declared.how}; a worker cannot dial in under its name"),
                )
                return
            known = self.dialed.get(hello.offering)
            if known is not None and known.route == route.bytes:
                known.seen = time.monotonic()
                return  # a keepalive: nothing to say
            if known is None and len(self.dialed) >= MAX_DIALED:
                self._answer(route, Refused(f"this broker already serves {MAX_DIALED} dialed-in hosts"))
                return
            self.dialed[hello.offering] = _Dialed(route.bytes, hello.runtime)
        self._answer(route, Ready(self.runtime))

    def _expire(self) -> None:
        """A dialed-in worker announces itself every `patience`; one silent for three is gone."""
        now = time.monotonic()
        for name, dialed in list(self.dialed.items()):
            if now - dialed.seen > 3 * self.patience:
                del self.dialed[name]

    def _probe(self) -> None:
        """Send each dialed-in worker a Ready; ROUTER_MANDATORY says which are gone."""
        hello = encode(Ready(self.runtime))
        for name, dialed in list(self.dialed.items()):
            try:
                self._front.send_multipart([dialed.route, *hello], zmq.NOBLOCK)
            except zmq.ZMQError:
                del self.dialed[name]

    def _forget(self, route: bytes) -> None:
        for name, dialed in list(self.dialed.items()):
            if dialed.route == route:
                del self.dialed[name]

    def _listing(self) -> dict[str, str]:
        listing = {name: ("inprocess" if w.how == "inprocess" else w.mode) for name, w in self.hosts.items()}
        listing.update({name: d.runtime.mode or "project" for name, d in self.dialed.items()})
        return listing

    def _where(self, where: Where) -> Located | Refused:
        host = where.host
        declared = self.hosts.get(host)
        if declared is None:
            dialed = self.dialed.get(host)
            if dialed is None:
                return Refused(f"this broker knows no host `{host}` (it knows: {_some(self._listing())})")
            return Located(host, "relayed", address=self.endpoint, mode=dialed.runtime.mode or "project")
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
                child.settle(0.2)  # a killed child may still be on its way out
                ended = child.ended() if not child.running else "stopped answering while still running"
                child.kill()  # no grace for one that stopped answering; the next forward starts afresh
                return Located(host, path, address=child.address, mode=declared.mode, mount=declared.mount, ended=ended)
            if not child.running:
                try:
                    child.start()
                except RefusedError as exc:
                    return Refused(str(exc))
        return Located(host, path, address=child.address, mode=declared.mode, mount=declared.mount)

    # -- relaying ----------------------------------------------------------------------
    def _relay(self, route: Any, frames: list) -> None:
        """[RELAY, host, *msg] from a client -> [worker, RELAY, client, *msg];
        [RELAY, client, *msg] from a dialed worker -> [client, *msg]."""
        if len(frames) < 3:
            self._answer(route, Refused("a relayed message has the mark, a destination and a message"))
            return
        destination = frames[1].bytes
        sender = route.bytes
        for name, dialed in self.dialed.items():
            if dialed.route == sender:  # from a worker, back to its client
                dialed.seen = time.monotonic()
                self._send([destination, *frames[2:]])
                return
        host = destination.decode(errors="replace")
        dialed = self.dialed.get(host)
        if dialed is None:
            self._answer(route, Refused(f"no worker serving `{host}` is connected to this broker"))
            return
        self._send([dialed.route, RELAY, sender, *frames[2:]])
