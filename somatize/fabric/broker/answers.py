"""The answers a broker builds itself: ``Located`` for a ``Where``, and ``Listed`` for ``Hosts``,
bounded in bytes, whoever offers what.

A ``Listed`` names every host the broker knows and, for a dialed one, what its ``Where``
would add (its folder for cargo and the token of the file it made there). Worker keys choose
those names and folders (up to the per-key limits of docs/security.md), so the answer is cut
at `LISTED_BYTES`: the declared hosts first, then the dialed ones a key at a time, in turn,
so that no key's long names or folders crowd out another key's hosts. A host left out is
still found by a ``Where`` (``Broker.knows`` asks one for a host its listing lacks).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Mapping

from ...wire import Listed, Located, Refusal, Where
from .. import sockets

#: Bytes of one ``Listed`` answer, at most: 10,000 hosts of 60-character names, each with a
#: folder of 100 characters, fit.
LISTED_BYTES = 2 << 20
_ENTRY = 12  # what MessagePack adds to one entry's strings, at most (a str16 header is 3 bytes)


def listing(hosts: Mapping, offers: Mapping) -> dict[str, str]:
    """Every host's name -> its mode: the declared ones, then the dialed ones (unbounded:
    for the broker's own sentences, which name a few of them)."""
    listed = {name: ("inprocess" if w.how == "inprocess" else w.mode) for name, w in hosts.items()}
    listed.update({name: o.runtime.mode or "project" for name, o in offers.items()})
    return listed


def listed(hosts: Mapping, offers: Mapping, budget: int = LISTED_BYTES) -> Listed:
    """The answer to ``Hosts``, at most ``budget`` bytes of names, modes and folders."""
    names: dict[str, str] = {}
    for name, w in hosts.items():
        mode = "inprocess" if w.how == "inprocess" else w.mode
        budget -= len(name.encode()) + len(mode) + _ENTRY
        if budget < 0:
            return Listed(names, {})
        names[name] = mode
    dialed: dict[str, list[str]] = {}
    for offer in in_turn(offers.values()):
        mode = offer.runtime.mode or "project"
        seen = [offer.mount, offer.token] if offer.mount else []
        budget -= 2 * len(offer.host.encode()) + len(mode) + sum(len(p.encode()) for p in seen) + 3 * _ENTRY
        if budget < 0:
            break
        names[offer.host] = mode
        dialed[offer.host] = seen
    return Listed(names, dialed)


def in_turn(offers: Iterable) -> Iterator:
    """``offers`` one owner at a time, in turn (each owner's in the order offered)."""
    owners: dict[str, list] = {}
    for offer in offers:
        owners.setdefault(offer.owner, []).append(offer)
    for turn in itertools.zip_longest(*owners.values()):
        for offer in turn:
            if offer is not None:
                yield offer


def some(names: Iterable[str], most: int = 20) -> str:
    """A few of ``names``, for a sentence: the first ``most``, sorted, and how many more."""
    ordered = sorted(names)
    shown = ", ".join(f"`{n[:60]}`" for n in ordered[:most]) or "none"
    return shown + (f" and {len(ordered) - most} more" if len(ordered) > most else "")


def located(where: Where, hosts: Mapping, offers: Mapping, endpoint: str) -> Located | Refusal | None:
    """The answer to ``where`` the broker gives at once: where a declared host or a dialed one
    is, or a refusal naming the hosts it knows; None for a spawned host (a helper job starts
    or checks its worker, and answers then)."""
    host = where.host
    declared = hosts.get(host)
    if declared is None:
        offer = offers.get(host)
        if offer is None:
            return Refusal(f"this broker knows no host `{host}` (it knows: {some(listing(hosts, offers))})")
        return Located(
            host,
            "relayed",
            address=endpoint,
            mode=offer.runtime.mode or "project",
            mount=offer.mount,
            seen=offer.token,
        )
    if declared.how == "inprocess":
        return Located(host, "inprocess")
    path = "mount" if declared.mount else "direct"
    if declared.how == "at":
        return Located(
            host,
            path,
            address=sockets.tcp_url(declared.address),
            mode=declared.mode,
            mount=declared.mount,
            key=declared.server_key(),
        )
    return None
