"""What the broker does when it falls behind: the share of questions each peer may ask.

A broker reads every message a peer sends: its incoming queue has no bound in messages
(with one, libzmq 4.3.5 aborts the process when a peer whose queue is full leaves and a
heartbeat, or a PING it sent, is then handled; see the loop's ``bind``). So a peer that asks
faster than the loop reads would pile up in the broker's memory. What stands in for the
bound is a cut: while the loop has not caught up with what arrives for `BEHIND` seconds,
a connection asking more than `CHATTY` questions a second, or a key asking more than
`CHATTY_KEY` over all its connections, has the connection it asks on closed, and what it
queued goes with it. A question is anything but a relayed message (a relayed one counts
when it is refused). A client waits for each answer, so it asks far fewer while the loop is
behind; a dialed worker is never cut; and while the loop keeps up, nobody is.
"""

from __future__ import annotations

from collections import OrderedDict

CHATTY, CHATTY_KEY, BEHIND = 250, 1000, 0.25
#: Counters, and routes cut, kept at most (the oldest are let go first).
REMEMBERED = 4000


class Gate:
    """Counts the questions of each connection and key while the loop is behind."""

    def __init__(self) -> None:
        self._asked: dict[str | bytes, list] = {}  # key or route -> [second it began, questions since]
        self._severed: OrderedDict[bytes, None] = OrderedDict()
        self._behind_since = 0.0  # when the loop last fell behind what arrives (0: caught up)

    def caught_up(self) -> None:
        self._behind_since = 0.0

    def fell_behind(self, now: float) -> None:
        if not self._behind_since:
            self._behind_since = now

    def over(self, route: bytes, key: str | None, now: float) -> str:
        """Count a question from ``route`` (of ``key``, on a keyed broker): why its connection
        is to be cut, or "" while it keeps to its share (always, while the loop keeps up)."""
        if not self._behind_since or now - self._behind_since < BEHIND:
            return ""
        if key is not None and self._count(key, now) > CHATTY_KEY:
            return f"its key asked more than {CHATTY_KEY} questions in a second while the broker was behind"
        if self._count(route, now) > CHATTY:
            return f"it asked more than {CHATTY} questions in a second while the broker was behind"
        return ""

    def sever(self, route: bytes) -> None:
        """``route``'s connection is cut: what it queued before is dropped unread, and it is
        never cut twice (its descriptor may be another connection's by then)."""
        self._severed[route] = None
        while len(self._severed) > REMEMBERED:
            self._severed.popitem(last=False)

    def severed(self, route: bytes) -> bool:
        return route in self._severed

    def _count(self, tenant: str | bytes, now: float) -> int:
        asked = self._asked.get(tenant)
        if asked is None or now - asked[0] >= 1.0:
            if len(self._asked) >= REMEMBERED:
                self._asked = {t: a for t, a in self._asked.items() if now - a[0] < 1.0}
            self._asked[tenant] = asked = [now, 0]
        asked[1] += 1
        return asked[1]
