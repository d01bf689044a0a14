"""The channels a :class:`~somatize.fabric.client.handle.Broker` keeps between calls, and
how a call borrows one and gives it back: :class:`Channels`, which the broker handle holds.

A call borrows an idle channel to its host (one whose peer went away between calls is
closed, and a fresh one says Hello), or makes one: a DEALER to the worker, or, for a host
reached through the broker, a lane of the client's one link to it (:mod:`.link`). Given
back, it waits for the next call, the least recently used closed past ``MAX_IDLE``
(``MAX_IDLE_LANES`` for lanes). Keys: a declared key for the host first, then the key
the broker located it with (a client with none is refused, saying what to pass).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

from ...engine import Deadline
from ...errors import Closed, Refused
from ...packing import Packer
from ...wire import Located
from ..curve import Keys
from ..hosts import pool_of
from .channel import Channel
from .link import Link

__all__ = ["MAX_IDLE", "MAX_IDLE_LANES", "Channels"]

#: Channels kept open between calls, for all hosts together (the least recently used is
#: closed past it): a client that reaches a thousand hosts holds this many connections, not
#: a thousand, and never meets ZeroMQ's limit on sockets (1,023 by default). A relayed
#: channel is a lane of the client's one link to the broker (`link`), no socket of its own:
#: as many are kept as the broker keeps exchanges for one client.
MAX_IDLE, MAX_IDLE_LANES = 32, 1024


class Channels:
    """The channels of one broker handle kept between calls, by host, and what the channels
    to one host share: its packer and the artifacts its worker holds. ``ended`` (a
    ``threading.Event``, the handle's) is set once the handle is closed: no channel is lent
    from then on, and one given back is closed. ``still_there(host, timeout)``: whether the
    broker still has a worker serving ``host`` (asked by a relayed channel as it waits)."""

    def __init__(
        self,
        url: str,
        patience: float,
        keys: Keys | None,
        ended: threading.Event,
        still_there: Callable[[str, float], bool],
        *,
        host_keys: dict[str, Keys],
        send: dict[str, tuple],
        views: frozenset[str],
    ) -> None:
        self.url = url
        self.patience = patience
        self.keys = keys
        self._ended = ended
        self._still_there = still_there
        self._host_keys = host_keys  # keys declared for a host (`Worker(keys=)`)
        self._send_by_host = send  # the modules pickled by value for a network-mode host (or pool)
        self._views = views  # hosts whose mounted answers come back as views
        self._lock = threading.Lock()
        self.idle: dict[str, list[Channel]] = {}
        self._idle_order: OrderedDict[int, Channel] = OrderedDict()  # id -> channel, least recently used first
        self._idle_lanes: OrderedDict[int, Channel] = OrderedDict()  # the same, for relayed channels
        self._link: Link | None = None  # the one connection every relayed channel is a lane of
        self.packers: dict[str | tuple[str, str], Packer] = {}  # by host; a pool's by (pool, mode) (`packer`)
        self._provisioned: dict[str, set[str]] = {}  # by host: the artifacts its worker holds

    def packer(self, host: str, mode: str) -> Packer:
        member = pool_of(host)
        # a pool's members pack alike: one packer per pool and mode, kept under a tuple,
        # which no host's own name (a str) can be
        key: str | tuple[str, str] = host if member is None else (member[0], mode)
        with self._lock:
            packer = self.packers.get(key)
            if packer is None:
                send = self._send_by_host.get(host) or (self._send_by_host.get(member[0], ()) if member else ())
                packer = self.packers[key] = Packer(mode, send)
            return packer

    def borrow(self, located: Located, deadline: Deadline | None = None) -> Channel:
        with self._lock:
            if self._ended.is_set():
                raise Closed("this broker was closed; make a new one")
            idle = self.idle.get(located.host)
            while idle:
                channel = idle.pop()
                self._order(channel).pop(id(channel), None)
                if not channel.dropped_while_idle():
                    return channel
                channel.close()  # its peer went away between calls: a fresh one says Hello
            provisioned = self._provisioned.setdefault(located.host, set())
        # a relayed host is reached through the very broker this client talks to, as a lane
        # of the one link every relayed channel shares
        relayed = located.path == "relayed"
        address = self.url if relayed else located.address
        keys, server_key = self._keys_for(located)
        channel = Channel(
            located,
            address,
            self.packer(located.host, located.mode),
            provisioned,
            self.patience,
            keys=keys,
            server_key=server_key,
            still_there=(lambda timeout: self._still_there(located.host, timeout)) if relayed else None,
            deadline=deadline,
            lane=self._relay_link().lane(located.host) if relayed else None,
            views=located.host in self._views,
            ended=self._ended,
        )
        return channel

    def _relay_link(self) -> Link:
        """The link relayed channels are lanes of: made at the first, made anew once the broker
        refused its handshake (its keys may have been fixed since) or the link ended."""
        with self._lock:
            if self._ended.is_set():
                raise Closed("this broker was closed; make a new one")
            stale = (
                self._link if self._link is not None and (self._link.refused is not None or self._link.closed) else None
            )
            if self._link is None or stale is not None:
                self._link = Link(self.url, self.patience, self.keys)
        if stale is not None:
            stale.close()
        return self._link

    def _order(self, channel: Channel) -> OrderedDict[int, Channel]:
        return self._idle_lanes if channel.lane is not None else self._idle_order

    def _keys_for(self, located: Located) -> tuple[Keys | None, bytes | None]:
        if located.path == "relayed":
            return self.keys, None  # the broker's key, as for the control socket
        declared = self._host_keys.get(located.host)
        if declared is not None:
            return declared, declared.server_key
        if located.key:
            if self.keys is None:
                raise Refused(
                    f"the worker for `{located.host}` listens with CURVE keys and this client has "
                    f'none: pass `keys=Keys.client("me.key_secret", server=...)` to `Broker.at`'
                )
            return self.keys, located.key.encode()
        return None, None

    def give_back(self, channel: Channel) -> None:
        channel.given_back()
        closing = []
        with self._lock:
            if self._ended.is_set():
                closing.append(channel)
            else:
                self.idle.setdefault(channel.host, []).append(channel)
                order, most = (
                    (self._idle_lanes, MAX_IDLE_LANES) if channel.lane is not None else (self._idle_order, MAX_IDLE)
                )
                order[id(channel)] = channel
                while len(order) > most:
                    _, oldest = order.popitem(last=False)
                    idle = self.idle[oldest.host]
                    idle.remove(oldest)
                    if not idle:
                        del self.idle[oldest.host]
                    closing.append(oldest)
        for old in closing:
            old.close()

    def forget(self, host: str) -> None:
        """What the channels to ``host`` held, let go: its idle channels closed, and the
        artifacts its worker held (a worker started afresh holds none)."""
        with self._lock:
            self._provisioned.pop(host, None)
            for channel in self.idle.pop(host, []):
                self._order(channel).pop(id(channel), None)
                channel.close()

    def close(self) -> None:
        """Every idle channel closed, and the link to the broker (``ended`` is set by then:
        a channel given back later is closed as it comes back)."""
        with self._lock:
            channels = [c for idle in self.idle.values() for c in idle]
            self.idle.clear()
            self._idle_order.clear()
            self._idle_lanes.clear()
            link, self._link = self._link, None
        for channel in channels:  # a lane's worker hears of its end from the broker, as the link ends
            channel.close(quiet=link is not None and channel.lane is not None)
        if link is not None:
            link.close()
