"""The channels a :class:`~somatize.fabric.client.handle.Broker` keeps between calls, and
how a call borrows one and gives it back.

A call borrows an idle channel to its host (one whose peer went away between calls is
closed, and a fresh one says Hello), or makes one: a DEALER to the worker, or, for a host
reached through the broker, a lane of the client's one link to it (:mod:`.link`). Given
back, it waits for the next call, the least recently used closed past ``MAX_IDLE``
(``MAX_IDLE_LANES`` for lanes). Keys: a declared key for the host first, then the key
the broker located it with (a client with none is refused, saying what to pass).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from ...engine import Deadline
from ...errors import Broken, Closed, Refused, Unreachable
from ...packing import Packer
from ...wire import Located, Where
from ..curve import Keys
from ..hosts import pool_of
from .channel import Channel
from .link import Link

__all__ = ["MAX_IDLE", "MAX_IDLE_LANES", "Pool"]

#: Channels kept open between calls, for all hosts together (the least recently used is
#: closed past it): a client that reaches a thousand hosts holds this many connections, not
#: a thousand, and never meets ZeroMQ's limit on sockets (1,023 by default). A relayed
#: channel is a lane of the client's one link to the broker (`link`), no socket of its own:
#: as many are kept as the broker keeps exchanges for one client.
MAX_IDLE, MAX_IDLE_LANES = 32, 1024


class Pool:
    """The channel-keeping side of :class:`~somatize.fabric.client.handle.Broker` (a mixin:
    the broker's attributes are its own)."""

    url: str
    patience: float
    keys: Keys | None
    _lock: Any
    _closed: bool
    _ended: Any
    _host_keys: dict[str, Keys]
    _send_by_host: dict[str, tuple]
    _views: frozenset[str]
    _idle: dict[str, list[Channel]]
    _idle_order: OrderedDict[int, Channel]
    _idle_lanes: OrderedDict[int, Channel]
    _link: Link | None
    _packers: dict[str | tuple[str, str], Packer]
    _provisioned: dict[str, set[str]]

    if TYPE_CHECKING:  # the broker's own (`Asking`): for the checker only, never in the way of the real one

        def _ask(self, message: Any, timeout: float, *, late: str | None = None) -> Any: ...

    def _packer(self, host: str, mode: str) -> Packer:
        member = pool_of(host)
        # a pool's members pack alike: one packer per pool and mode, kept under a tuple,
        # which no host's own name (a str) can be
        key: str | tuple[str, str] = host if member is None else (member[0], mode)
        with self._lock:
            packer = self._packers.get(key)
            if packer is None:
                send = self._send_by_host.get(host) or (self._send_by_host.get(member[0], ()) if member else ())
                packer = self._packers[key] = Packer(mode, send)
            return packer

    def _borrow(self, located: Located, deadline: Deadline | None = None) -> Channel:
        with self._lock:
            if self._closed:
                raise Closed("this broker was closed; make a new one")
            idle = self._idle.get(located.host)
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
            self._packer(located.host, located.mode),
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
            if self._closed:
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

    def _still_there(self, host: str, timeout: float) -> bool:
        """Whether the broker still has a worker serving ``host`` (relayed work is waited
        on through the broker, which is the one that sees a dialed-in worker go)."""
        try:
            return isinstance(self._ask(Where(host), timeout), Located)
        except (Unreachable, Broken, Closed):
            return False  # the broker itself is gone: so is the way to the worker

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

    def _give_back(self, channel: Channel) -> None:
        channel.given_back()
        closing = []
        with self._lock:
            if self._closed:
                closing.append(channel)
            else:
                self._idle.setdefault(channel.host, []).append(channel)
                order, most = (
                    (self._idle_lanes, MAX_IDLE_LANES) if channel.lane is not None else (self._idle_order, MAX_IDLE)
                )
                order[id(channel)] = channel
                while len(order) > most:
                    _, oldest = order.popitem(last=False)
                    idle = self._idle[oldest.host]
                    idle.remove(oldest)
                    if not idle:
                        del self._idle[oldest.host]
                    closing.append(oldest)
        for old in closing:
            old.close()
