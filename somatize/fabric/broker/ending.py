"""What ends a broker's exchanges without their client's word, and who is told: a key taken
out of the allow-list at a reload (its hosts, bindings and exchanges end; the other side of
each exchange hears it), a client that left or whose older exchanges were crowded out (the
worker hears a ``Bye`` in the exchange, and forgets that session now rather than when newer
ones crowd it out). A part of :class:`~somatize.fabric.broker.loop.BrokerLoop`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ...errors import BadKeys
from ...wire import Bye, Refusal, Relay, encode
from ...wire.writing import passed_on
from ..curve import peer_name
from .peers import Exchange

if TYPE_CHECKING:
    from ..curve import Guard
    from .children import Spawned
    from .outbox import Outbox
    from .peers import BrokerView

_BYE = tuple(encode(Bye()))
log = logging.getLogger("somatize.broker")


class Ending:
    """The broker loop's ending of exchanges (a mixin: the loop's state is its own)."""

    # the loop's state read here: annotations alone, for the type checker (nothing is set here)
    view: BrokerView
    _guard: Guard | None
    _outbox: Outbox | None
    _spawned: Spawned

    if TYPE_CHECKING:  # the loop's methods called here (defined here, they would hide the loop's)

        def _deliver(self, route: bytes, frames: list, tenant: str = "") -> None: ...
        def _answer(self, route: Any, message: Any) -> None: ...
        def _left(self, hosts: list[str], offers: dict, why: str) -> None: ...
        def _prune(self) -> None: ...
        def _keep_bindings(self) -> None: ...

    def _reload(self) -> None:
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
        self._spawned.reload()  # children reached from other machines allow the same keys
        self._revoke()

    def _revoke(self) -> None:
        before = dict(self.view.offers)
        assert self._guard is not None  # asked by `_reload` alone, which returns where there are no keys
        self._free(lambda: self.view.revoke(self._guard.allowed(), self._guard.workers), "at a reload")
        self._left([h for h in before if h not in self.view.offers], before, "its key was taken out of the allow-list")
        self._prune()
        allowed = self._guard.allowed()
        for exchange in self.view.revoked:  # nothing more of it is delivered, and its other side is told
            assert self._outbox is not None  # set by `bind`: a reload is done by `serve`
            if exchange.key and exchange.key not in allowed:
                self._outbox.forget(exchange.client)
                self._outbox.forget(exchange.worker, exchange.tenant)
                self._bye(exchange)
            else:
                self._outbox.forget(exchange.client, str(exchange.number))
                self._tell_client(
                    exchange,
                    Refusal(
                        f"the worker serving `{exchange.host}` is no longer allowed on this broker (its key was "
                        f"taken out of the allow-list): the work sent to it there ended"
                    ),
                )
        self.view.revoked = []
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

    def _tell_ended(self) -> None:
        """Each worker whose exchange ended without its client's Bye (the client left, or newer
        exchanges crowded it out) hears one in it, and forgets that session now."""
        ending, self.view.ending = self.view.ending, []
        cut, self.view.cut = self.view.cut, []
        for exchange in ending:
            if exchange.worker in self.view.offers_index:
                self._bye(exchange)
        for exchange in cut:  # its client waits on an answer that will never come: it is told
            assert self._outbox is not None  # set by `bind`: exchanges are cut by what `serve` reads
            self._outbox.forget(exchange.client, str(exchange.number))
            self._tell_client(
                exchange,
                Refusal(
                    f"this broker ended the exchange with `{exchange.host}` while the work sent there was "
                    f"open: one client's connections hold at most {self.view.max_exchanges:,} exchanges (this "
                    f"broker {self.view.max_open:,} in all), the least recently used ended first; use fewer hosts "
                    f"at once, or more clients"
                ),
            )

    def _tell_client(self, exchange: Exchange, refusal: Refusal) -> None:
        if exchange.lane:  # to the channel it came from, among the client's many
            self._deliver(exchange.client, encode(Relay(lane=exchange.lane, inner=tuple(encode(refusal)))))
        else:
            self._answer(exchange.client, refusal)

    def _bye(self, exchange: Exchange) -> None:
        """The worker of ``exchange`` hears a Bye in it: that session is over."""
        self._deliver(
            exchange.worker, passed_on(_BYE, exchange=exchange.number, tenant=exchange.tenant), exchange.tenant
        )
