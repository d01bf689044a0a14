"""What the conversation refuses (a message that may not arrive now, from this peer), and how
the refusals a client reads by their start begin."""

from __future__ import annotations

from ...errors import ProtocolError

#: How a broker's refusal starts when the relayed host has no worker connected (it left,
#: or never dialed in): the work reached nobody, so a pool's client may ask another member.
LEFT = "left: "
#: How a worker's refusal starts when it took nothing because it is full (every slot busy,
#: or as many sessions as it may hold, all with answers in flight): the same may be sent again.
BUSY = "busy: "


class Violation(ProtocolError):
    """A message that may not arrive now, from this peer: refused, counted, never delivered."""


class Unknown(Violation):
    """A message from a peer this side does not know: it never said Hello, or it was
    forgotten to make room. Refused with ``hello=True``: say Hello, then send it again."""


class Unheld(Violation):
    """A ``Work`` naming by digest a recipe this side does not hold for its peer (never sent
    in full on this connection, or forgotten to make room). Refused with ``recipe=True``:
    send the Work again with its recipe in full."""


class Stale(Violation):
    """An answer for an exchange that has ended (its client gave up, or went away): dropped
    and counted, and not answered — its sender did nothing wrong, and a refusal would read
    as a refusal of something it still holds."""


def name_of(msg: object) -> str:
    """The name of a message's type, for a sentence."""
    return type(msg).__name__
