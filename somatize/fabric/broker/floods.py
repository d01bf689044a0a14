"""The broker's one admission step: every message from every connection is counted here,
per connection and per key, before the broker does anything else with it.

Every message counts: a client's question or relayed message, a dialed worker's answer
(all but its keepalive, which says only that it is there), a chunk of a stream, junk. What
is bounded:

- Always, the size of one message (`outbox.LARGEST`, all its frames together: a bigger one
  travels as a stream) and the messages refused a second: a message the broker refuses, or
  one that opens or ends nothing (a relayed ``Bye`` for an exchange not open), counts as a
  refusal; past `REFUSED` a second on one connection, or `REFUSED_KEY` over all of a key's,
  the connection it came on is closed. A dialed worker's refusals (its late answers to
  exchanges that ended) count only while the loop is behind: they are not its fault.
- While the loop is behind (it has not caught up with what arrives for `BEHIND` seconds;
  only then are rates counted: while it keeps up, nobody's pace is another's wait), the
  rate: a connection sending more than `CHATTY` questions a second (anything but a
  relayed message), `BUSY` messages of any kind or `FLOW` bytes, or a key more than
  `CHATTY_KEY`, `BUSY_KEY` or `FLOW_KEY` over all its connections, has the connection it
  sends on closed. A dialed worker's connection carries many tenants' answers: it is held
  to `BUSY_WORKER` messages, and its key to no more than the connections it serves on.

Why a cut and not a queue: a broker reads every message a peer sends, and its incoming
queue has no bound in messages (with one, libzmq 4.3.5 aborts the process when a peer whose
queue is full leaves and a heartbeat, or a PING it sent, is then handled; see the loop's
``bind``). What arrives faster than the loop reads would pile up in its memory; a cut
connection is closed, and its peer must dial again (what it queued before is read and
dropped unopened; libzmq hands it over whatever happens, so a peer that dials back at once
and floods again costs the broker a read per message). A client waits for each answer, so
it sends far fewer while the loop is behind; while the loop keeps up, only refusals cut.
"""

from __future__ import annotations

from collections import OrderedDict

from .outbox import LARGEST

#: Per connection and per key, a second, while the loop is behind: questions (anything but
#: a relayed message), messages of any kind, bytes.
CHATTY, CHATTY_KEY = 250, 1000
BUSY, BUSY_KEY, BUSY_WORKER = 2000, 8000, 10_000
FLOW, FLOW_KEY = 1 << 30, 2 << 30
#: Refused messages a second, per connection and per key, whenever they come.
REFUSED, REFUSED_KEY = 1000, 4000
#: Seconds the loop is behind what arrives before rates are held to these shares.
BEHIND = 0.25
#: Counters, and routes cut, kept at most (the oldest are let go first).
REMEMBERED = 4000

_START, _MESSAGES, _QUESTIONS, _BYTES, _REFUSED = range(5)


class Admission:
    """Counts what each connection and key sends; says whose connection is to be cut."""

    def __init__(self) -> None:
        self._counts: dict[
            str | bytes, list
        ] = {}  # key or route -> [second it began, messages, questions, bytes, refused]
        self._severed: OrderedDict[bytes, None] = OrderedDict()
        self._behind_since = 0.0  # when the loop last fell behind what arrives (0: caught up)

    def caught_up(self) -> None:
        self._behind_since = 0.0

    def fell_behind(self, now: float) -> None:
        if not self._behind_since:
            self._behind_since = now

    def behind(self, now: float) -> bool:
        return bool(self._behind_since) and now - self._behind_since >= BEHIND

    def admit(self, route: bytes, key: str | None, size: int, question: bool, worker: bool, now: float) -> str:
        """Count one message of ``size`` bytes from ``route`` (of ``key``, on a keyed broker;
        ``worker``: a connection serving dialed hosts). Why its connection is to be cut, or
        "" while it keeps to its share; a message over `LARGEST` is to be refused."""
        if not self._behind_since or now - self._behind_since < BEHIND:
            return ""  # the shares hold only while the loop is behind: nothing to count
        mine = self._count(route, now)
        mine[_MESSAGES] += 1
        mine[_BYTES] += size
        if question:
            mine[_QUESTIONS] += 1
        theirs = None
        if key is not None and not worker:
            theirs = self._count(key, now)
            theirs[_MESSAGES] += 1
            theirs[_BYTES] += size
            if question:
                theirs[_QUESTIONS] += 1
        if theirs is not None:
            if theirs[_QUESTIONS] > CHATTY_KEY:
                return f"its key asked more than {CHATTY_KEY} questions in a second while the broker was behind"
            if theirs[_MESSAGES] > BUSY_KEY:
                return f"its key sent more than {BUSY_KEY} messages in a second while the broker was behind"
            if theirs[_BYTES] > FLOW_KEY:
                return f"its key sent more than {FLOW_KEY >> 20} MiB in a second while the broker was behind"
        if mine[_QUESTIONS] > CHATTY:
            return f"it asked more than {CHATTY} questions in a second while the broker was behind"
        if mine[_MESSAGES] > (BUSY_WORKER if worker else BUSY):
            return (
                f"it sent more than {BUSY_WORKER if worker else BUSY} messages in a second while the broker was behind"
            )
        if mine[_BYTES] > FLOW:
            return f"it sent more than {FLOW >> 20} MiB in a second while the broker was behind"
        return ""

    @staticmethod
    def too_big(size: int) -> str:
        """Why a message of ``size`` bytes is refused, or ""."""
        if size <= LARGEST:
            return ""
        return (
            f"a message of {size} bytes is more than the {LARGEST} a broker takes; "
            f"a bigger one travels as a stream (Begin, Chunk)"
        )

    def refused(self, route: bytes, key: str | None, worker: bool, now: float) -> str:
        """Count a refused message from ``route``, or one that opened or ended nothing: why
        its connection is to be cut, or ""."""
        if worker and not self.behind(now):
            return ""
        mine = self._count(route, now)
        mine[_REFUSED] += 1
        if key is not None and not worker:
            theirs = self._count(key, now)
            theirs[_REFUSED] += 1
            if theirs[_REFUSED] > REFUSED_KEY:
                return f"its key sent more than {REFUSED_KEY} messages a second that opened or ended nothing"
        if mine[_REFUSED] > REFUSED:
            return f"it sent more than {REFUSED} messages a second that opened or ended nothing"
        return ""

    def sever(self, route: bytes) -> None:
        """``route``'s connection is cut: what it queued before is dropped unread, and it is
        never cut twice (its descriptor may be another connection's by then)."""
        self._severed[route] = None
        while len(self._severed) > REMEMBERED:
            self._severed.popitem(last=False)

    def severed(self, route: bytes) -> bool:
        return route in self._severed

    def _count(self, tenant: str | bytes, now: float) -> list:
        counts = self._counts.get(tenant)
        if counts is None or now - counts[_START] >= 1.0:
            if counts is None and len(self._counts) >= REMEMBERED:
                self._counts = {t: c for t, c in self._counts.items() if now - c[_START] < 1.0}
            self._counts[tenant] = counts = [now, 0, 0, 0, 0]
        return counts
