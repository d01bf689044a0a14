"""The errors a client's channel raises for a refusal, and the sentences where the fix depends
on what it met: a refusal's prefix (`conversation.LEFT`, `conversation.BUSY`) read in one place,
a value of a kind the worker cannot read, a CURVE handshake refused.

A worker states at Hello the codec kinds it reads (``Runtime.kinds``); a channel checks each
value against them before a byte of it leaves (``Channel._check_kinds``), and refuses with
the kind, the host, and the fix for that kind. A handshake refused names whose keys were
offered to whom, and where the missing key goes.
"""

from __future__ import annotations

from collections.abc import Sequence

from ...errors import Busy, Refused
from ..conversation import BUSY, LEFT
from ..curve import Keys, handshake_refusal


class TurnedAway(Busy):
    """``Busy`` as the worker said it: it took nothing of the work (or of the channel), so
    the work may be sent again as it is (``turns.Turns`` does, for a client's own forwards)."""


class NobodyThere(Refused):
    """``Refused`` as a broker said it of a relayed host with no worker connected: nothing
    of the work reached a worker, so another member of a pool may be asked instead."""


def refusal(why: str, said: str, busy: str) -> Refused | TurnedAway:
    """The error for a refusal whose reason is ``why``: ``said`` (who refused what) for a
    refusal, ``busy`` (who is full, and what it did not take) for a worker that took nothing
    because it is full (`TurnedAway`: the same may be sent again)."""
    if why.startswith(BUSY):
        return TurnedAway(f"{busy}: {why[len(BUSY) :]}")
    if why.startswith(LEFT):
        return NobodyThere(f"{said}: {why[len(LEFT) :]}")
    return Refused(f"{said}: {why}")


def unreadable(missing: Sequence[str], host: str) -> Refused:
    """The refusal of a value of the kinds ``missing`` (sorted) for the worker of ``host``."""
    kind = missing[0]
    if kind.startswith("arrow."):
        fix = "install pyarrow where that worker runs, or send the table's columns as NumPy arrays"
    elif kind == "torch.Tensor":
        fix = "install torch where that worker runs (`pip install somatize[torch]`), or send `t.numpy()` instead"
    else:
        fix = (
            f"make a module the worker imports (the module of a node it runs) call "
            f'`codec("{kind}", ...)`, or declare `{host}` with mode="network" so '
            f"the codec travels with the nodes"
        )
    others = f" (and {', '.join(f'`{k}`' for k in missing[1:])})" if len(missing) > 1 else ""
    return Refused(
        f"the worker for `{host}` cannot read values of kind `{kind}`{others}, as it said "
        f"when this client said hello, so nothing was sent to it: {fix}"
    )


def handshake_failed(
    event: int, *, host: str, address: str, relayed: bool, keys: Keys | None, server_key: bytes | None, declared: bool
) -> str:
    """Why a channel's handshake failed (``event``), with the fix. ``relayed``: the channel
    is to the broker; ``declared``: the broker's table gave the worker's public key."""
    if relayed:
        return handshake_refusal(
            event,
            who=f"the broker at {address}",
            keys=keys,
            server_key=server_key,
            allow="the broker's allow folder (then `systemctl reload somatize-broker`)",
            server_key_from="the broker's `broker.key`, as `server=` of `Keys.client`",
        )
    if keys is None and not declared:
        return (
            f"the worker for `{host}` at {address} refused this client's CURVE "
            f"handshake: it listens with keys, and the broker's host table gives no `key =` "
            f'for `{host}`, so this client had none to offer. Add `key = "keys/{host}.key"` '
            f"(that worker's public key) to [hosts.{host}] in the broker's table and restart the broker"
        )
    return handshake_refusal(
        event,
        who=f"the worker for `{host}` at {address}",
        keys=keys,
        server_key=server_key,
        allow="that worker's allow folder (then `systemctl reload somatize-worker` there)",
        server_key_from=f"the `key =` of [hosts.{host}] in the broker's table",
    )
