"""The broker's side: `BROKER_TABLE`, what it does with each message, by who sends it.

Whether a peer may (its key's roles, the bindings, the exchange's worker), and what follows,
is the broker's view of its peers (:class:`~somatize.fabric.broker.peers.BrokerView`); the
loop (:mod:`somatize.fabric.broker.loop`) has one method per step.
"""

from __future__ import annotations

import enum

from ...wire import Bye, Hello, Hosts, Ready, Relay, Where


class Side(enum.StrEnum):
    """Who a route is to the broker: it serves hosts (it offered one and was let), or it asks."""

    ASKING = "asking"
    SERVING = "serving"


class Step(enum.StrEnum):
    """What the broker does with a message (`BROKER_TABLE`); the loop has one method per step."""

    GREET = "greet"
    LOCATE = "locate"
    LIST = "list"
    LEAVE = "leave"
    FORWARD = "forward"
    HEARD = "heard"


#: What each `Step` does, in a sentence (``docs/conversation.md`` shows it).
STEPS = {
    Step.GREET: "`Ready`; with `offering`, the host offered or kept alive, if the view lets it (`BrokerView.hello`)",
    Step.LOCATE: "`Located`, now or once a helper job started or checked a spawned worker",
    Step.LIST: "`Listed`",
    Step.LEAVE: "its offers and exchanges end; each worker of its exchanges hears a `Bye` in it",
    Step.FORWARD: "the inner frames to the other side of the exchange, if the view lets them (`BrokerView.relay`)",
    Step.HEARD: "heard: its answer to the broker's check of a host clients wait on",
}


#: The broker's conversation: (who sends it, what arrives) -> what the broker does. Anything
#: else is refused unopened (its header's variant is all that is read). Who may send each is
#: the view's to say (a key's roles, the bindings, the exchange's worker).
BROKER_TABLE: dict[tuple[Side, type], Step] = {
    **{(side, Hello): Step.GREET for side in Side},
    **{(side, Where): Step.LOCATE for side in Side},
    **{(side, Hosts): Step.LIST for side in Side},
    **{(side, Bye): Step.LEAVE for side in Side},
    **{(side, Relay): Step.FORWARD for side in Side},
    (Side.SERVING, Ready): Step.HEARD,
}
