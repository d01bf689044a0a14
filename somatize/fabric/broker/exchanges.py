"""What the broker keeps of each host offered and each exchange it relays, and what its view
hands the loop to do (`Deliver`, `Forget`), with the words said when an exchange ends
without its client's: sans IO, like the view (:mod:`somatize.fabric.broker.peers`) that uses them.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...wire import Bye, Refusal, Runtime, encode
from ...wire.writing import passed_on


@dataclass
class Offer:
    """A host a worker that dialed in serves."""

    host: str
    route: bytes
    owner: str  # the key (Z85) that offered it, or "route:<hex>" where there are no keys
    runtime: Runtime
    seen: float
    mount: str | None = None  # its folder for cargo, as its Hello named it
    token: str = ""  # the file it made there (`Hello.seen`)


@dataclass
class Exchange:
    """One client's conversation with one relayed host, as the broker carries it."""

    number: int
    client: bytes  # the client's route
    tenant: str  # who the client is (key short id, or route)
    host: str
    worker: bytes  # the route of the worker it was sent to
    touched: float
    key: str = ""  # the client's key (Z85), so that revoking it ends the exchange
    lane: int = 0  # the client's number for its channel, when it carries many over one connection
    waiting: bool = False  # its client said something the worker has not answered yet
    work_open: bool = False  # its client sent a Work the worker has not ended yet

    @property
    def held(self) -> bool:
        """Its host is held to the working limit: work open there, or a word unanswered."""
        return self.waiting or self.work_open


@dataclass(frozen=True)
class Deliver:
    """Send ``frames`` to ``route``, queued as ``tenant``'s (`outbox`): what the loop does with a
    relayed message, and with what the view says to a peer of an exchange that ended."""

    route: bytes
    frames: list
    tenant: str = ""


@dataclass(frozen=True)
class Forget:
    """Drop what waits to be sent to ``route`` (only ``tenant``'s, if given): the answers of an
    exchange that ended, before its client is told."""

    route: bytes
    tenant: str | None = None


_BYE = tuple(encode(Bye()))


def bye(exchange: Exchange) -> Deliver:
    """The worker of ``exchange`` hears a Bye in it: that session is over."""
    return Deliver(exchange.worker, passed_on(_BYE, exchange=exchange.number, tenant=exchange.tenant), exchange.tenant)


def tell_client(exchange: Exchange, why: str) -> list[Deliver | Forget]:
    """``exchange``'s client hears ``why`` in a refusal naming no work (on the lane it came
    from, among its many), its answers of that exchange still queued dropped first."""
    refusal = tuple(encode(Refusal(why)))
    frames = passed_on(refusal, lane=exchange.lane) if exchange.lane else list(refusal)
    return [Forget(exchange.client, str(exchange.number)), Deliver(exchange.client, frames)]
