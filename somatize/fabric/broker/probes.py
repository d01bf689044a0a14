"""Which dialed workers the broker probes, and when: only those whose connection dropped.

ZeroMQ says a connection dropped (a monitor's ``EVENT_DISCONNECTED``) with the descriptor it
was on, never with its route. Every message carries the descriptor it came on
(``ZMQ_SRCFD``), so the broker notes a dialed worker's descriptor as it offers, and when that
descriptor drops it probes that worker (a Ready: unreachable is gone, a full queue only
slow), and nobody else: a client's channel closing costs nothing, whatever the size of the
fleet. A worker whose descriptor is not known (over inproc) is probed at every drop.

Probes are made at most once a second, and again a second and two later, since ZeroMQ may
still hold the route of a connection that just dropped (its pipe ends after the event is
said), and nothing else would look before three patiences.
"""

from __future__ import annotations

from collections.abc import Container

import zmq

#: Probes made after a drop, a second apart.
ROUNDS = 3


class Probes:
    def __init__(self) -> None:
        self._fd_routes: dict[int, set[bytes]] = {}  # a dialed worker's descriptor -> its routes
        self._route_fd: dict[bytes, int] = {}
        self._suspects: set[bytes] = set()
        self._rounds = 0  # probes still to make, a second apart
        self._probed = 0.0
        self.due = 0.0  # when the next probe is due (0: none)

    def knows(self, route: bytes) -> bool:
        return route in self._route_fd

    def know(self, route: bytes, frame: zmq.Frame) -> None:
        """``route`` offers hosts; ``frame`` is a message it sent (its descriptor is noted)."""
        fd = frame.get(zmq.SRCFD)
        fd = fd if isinstance(fd, int) and fd >= 0 else -1
        self._route_fd[route] = fd
        self._fd_routes.setdefault(fd, set()).add(route)

    def forget(self, route: bytes) -> None:
        fd = self._route_fd.pop(route, None)
        if fd is None:
            return
        routes = self._fd_routes.get(fd)
        if routes is not None:
            routes.discard(route)
            if not routes:
                del self._fd_routes[fd]

    def prune(self, serving: Container[bytes]) -> None:
        """Forget the routes that no longer serve (their offers expired or were revoked)."""
        for route in [r for r in self._route_fd if r not in serving]:
            self.forget(route)

    def dropped(self, events: list[bytes]) -> bool:
        """Monitor events (``EVENT_DISCONNECTED``, the descriptor in bytes 2 to 6): whether a
        dialed worker is now suspect."""
        for event in events:
            fd = int.from_bytes(event[2:6], "little", signed=True) if len(event) >= 6 else -1
            self._suspects |= self._fd_routes.get(fd, set())
        self._suspects |= self._fd_routes.get(-1, set())
        if self._suspects:
            self._rounds = ROUNDS
        return bool(self._suspects)

    def take(self, now: float) -> set[bytes]:
        """The routes to probe now: none within a second of the last probe (it is then due
        when that second is over)."""
        if not self._rounds:
            return set()
        if now - self._probed < 1.0:
            self.due = self._probed + 1.0
            return set()
        self._rounds -= 1
        self._probed = now
        self.due = now + 1.0 if self._rounds else 0.0
        suspects = self._suspects
        if not self._rounds:
            self._suspects = set()
        return suspects
