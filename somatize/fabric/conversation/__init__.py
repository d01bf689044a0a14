"""Who may send what, when, and in answer to whom: every conversation of the fabric, sans IO.

Three views, each fed the messages that arrive (already decoded by :mod:`somatize.wire`)
and asked, before any socket class acts on one, "may this arrive now, from this peer?":

- :class:`ClientExchange` — a client channel's conversation with one worker;
- :class:`WorkerSessions` — a worker's view of each peer that talks to it;
- :class:`BrokerView` — a broker's view of each peer, each host offered to it, and each
  exchange it relays.

Each side has one table, and it decides: `CLIENT_TABLE` (a channel's state and what arrives ->
its next state and what the channel does with it), `WORKER_TABLE` (a peer's session and what it
sends -> its next session and what the worker does) and `BROKER_TABLE` (who sends it and what it
is -> what the broker does; from :mod:`somatize.fabric.broker.peers`). States are
enums; the loops look their step up and carry it out, and a fast path is the same lookup.

An illegal message raises :class:`Violation` (a :class:`~somatize.errors.ProtocolError`
whose ``why`` is the sentence to send back in ``Refusal``); the view is left as it was,
the refusal is counted, and nothing is delivered onward. Nothing here opens a socket,
reads a clock it is not handed, or guesses: like h11's ``_state.py``, the tables *are* the
protocol, and ``tests/test_conversation.py`` feeds them messages with no process started.
``docs/conversation.md`` shows them, drawn from the code by `markdown` and `diagram` (a test
checks that the page says what the tables say).
"""

from __future__ import annotations

from .broker import BROKER_TABLE, Side, Step
from .client import CLIENT_SENDS, CLIENT_TABLE, ChannelState, ClientExchange, Take
from .violations import BUSY, LEFT, Stale, Unheld, Unknown, Violation
from .worker import WORKER_TABLE, Act, Session, WorkerSessions

# BrokerView comes through this module's __getattr__ (below), from broker/peers.py
__all__ = [  # noqa: F822
    "BROKER_TABLE",
    "BUSY",
    "CLIENT_SENDS",
    "CLIENT_TABLE",
    "WORKER_TABLE",
    "KEEPALIVE",
    "LEFT",
    "Act",
    "BrokerView",
    "ChannelState",
    "ClientExchange",
    "Session",
    "Side",
    "Stale",
    "Step",
    "Take",
    "Unheld",
    "Unknown",
    "Violation",
    "WorkerSessions",
]
#: A dialed worker's keepalive, in its patiences: its connection's pings say it is there
#: every patience (the broker drops a connection silent past their time to live); the
#: keepalive is the net beneath, rare, so a fleet's keepalives do not keep waking its broker.
KEEPALIVE = 10


# -- the broker's view: in :mod:`somatize.fabric.broker.peers`, named here too -----------------------------

_BROKER_NAMES = frozenset(("CLIENT", "WORKER", "BrokerView", "Deliver", "Exchange", "Offer"))


def __getattr__(name: str) -> object:  # PEP 562: imported on first use, so either module may be imported first
    if name in _BROKER_NAMES:
        from ..broker import peers as broker_peers

        return getattr(broker_peers, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
