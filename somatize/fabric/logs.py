"""What a broker or a worker logs about what its peers do: bounded, and escaped.

Every line a peer can cause (a refusal, a message that could not be handled, a host dialing
in and leaving, a broker's odd word) goes through one :class:`Budget`: at most ``LOUD``
lines per ``QUIET`` seconds, the rest counted and the count said with the next line that
goes out. A flood of bad messages is a number in the log, never a flood of lines, and
whatever a peer wrote is escaped (:func:`printable`) before it is written. Texts that cross
the wire are cut to a bound (:func:`clip`).

Two ways to use a budget: a worker's :class:`Limiter` logs the line itself; a broker's
:class:`Quiet` says whether a line may go out now and what to append to it, since the
broker's lines are written where they are decided.
"""

from __future__ import annotations

import logging
import threading
import time

#: Lines of one kind a peer can cause, per `QUIET` seconds at most; past it they are counted.
LOUD, QUIET = 20, 10.0


class Budget:
    """At most ``loud`` lines per ``quiet`` seconds, from whatever thread."""

    def __init__(self, *, loud: int = LOUD, quiet: float = QUIET) -> None:
        self.loud = loud
        self.quiet = quiet
        self.unsaid = 0  # lines held back since the last one said
        self.held = 0  # lines held back in all
        self._said: list[float] = []
        self._lock = threading.Lock()

    def take(self) -> int | None:
        """How many lines were held back since the last one said, when this one may be said
        now (and the count starts again); None when it is to be held back, and counted."""
        now = time.monotonic()
        with self._lock:
            self._said = [t for t in self._said if now - t < self.quiet]
            if len(self._said) >= self.loud:
                self.unsaid += 1
                self.held += 1
                return None
            self._said.append(now)
            more, self.unsaid = self.unsaid, 0
            return more


class Limiter(Budget):
    """A budget that logs the lines it lets through, to ``logger``, escaped."""

    def __init__(self, logger: logging.Logger, *, loud: int = LOUD, quiet: float = QUIET) -> None:
        super().__init__(loud=loud, quiet=quiet)
        self.log = logger

    def say(self, level: int, text: str, *args: object) -> bool:
        """Log ``text % args`` at ``level`` unless over the budget; True when it was said."""
        more = self.take()
        if more is None:
            return False
        line = text % args if args else text
        if more:
            line += f" ({more} more such lines were not logged)"
        self.log.log(level, "%s", printable(line))
        return True


class Quiet(Budget):
    """A budget for lines of one kind (``what``: "refusals") that the caller logs."""

    def __init__(self, what: str, *, loud: int = LOUD, quiet: float = QUIET) -> None:
        super().__init__(loud=loud, quiet=quiet)
        self.what = what

    def more(self) -> str | None:
        """The suffix for a line that may be logged now (``""`` or the count left out), or
        None when this one is to be counted, not logged."""
        more = self.take()
        if more is None:
            return None
        return f" ({more} more {self.what} were not logged)" if more else ""


def printable(text: str) -> str:
    """Text for a log line: what is not printable (a route's NUL, say) escaped, never raw."""
    return text if text.isprintable() else text.encode("unicode_escape").decode("ascii")


def clip(text: str, limit: int) -> str:
    """Texts that cross the wire are bounded; a user's huge message is cut, not refused."""
    return text if len(text) <= limit else text[: limit - 20] + " ... (cut)"
