"""What a worker says in its log about what peers did, and the texts it sends back: bounded.

Every line a peer can cause (a refusal, a message that could not be handled, a broker's odd
word, advice about stale imports) goes through one :class:`Limiter`: at most ``loud`` lines
per ``quiet`` seconds, the rest counted and the count said with the next line that goes
out. A flood of bad messages is a number in the log, never a flood of lines, and whatever a
peer wrote is escaped (:func:`printable`) before it is written. Texts that cross the wire
are cut to a bound (:func:`clip`).
"""

from __future__ import annotations

import logging
import threading
import time

from ...wire import Failed

#: Lines a peer can cause, per `QUIET` seconds at most; past it they are counted.
LOUD, QUIET = 20, 10.0


class Limiter:
    """At most ``loud`` lines per ``quiet`` seconds, whoever causes them and from whatever
    thread; the lines held back are counted, and the count said with the next one."""

    def __init__(self, logger: logging.Logger, *, loud: int = LOUD, quiet: float = QUIET) -> None:
        self.log = logger
        self.loud = loud
        self.quiet = quiet
        self.unsaid = 0  # lines held back since the last one said
        self.held = 0  # lines held back in all
        self._said: list[float] = []
        self._lock = threading.Lock()

    def say(self, level: int, text: str, *args: object) -> bool:
        """Log ``text % args`` at ``level`` unless over the budget; True when it was said."""
        now = time.monotonic()
        with self._lock:
            self._said = [t for t in self._said if now - t < self.quiet]
            if len(self._said) >= self.loud:
                self.unsaid += 1
                self.held += 1
                return False
            self._said.append(now)
            more, self.unsaid = self.unsaid, 0
        line = text % args if args else text
        if more:
            line += f" ({more} more such lines were not logged)"
        self.log.log(level, "%s", printable(line))
        return True


def printable(text: str) -> str:
    """Text for a log line: what is not printable (a route's NUL, say) escaped, never raw."""
    return text if text.isprintable() else text.encode("unicode_escape").decode("ascii")


def clip(text: str, limit: int) -> str:
    """Texts that cross the wire are bounded; a user's huge message is cut, not refused."""
    return text if len(text) <= limit else text[: limit - 20] + " ... (cut)"


def failed_answer(ref: int, exc: BaseException, *, why: str | None = None, traceback: str = "") -> Failed:
    """The worker's own trouble (no node to blame) as a ``Failed``, its texts cut to bounds."""
    return Failed(
        ref,
        why=clip(why or f"{type(exc).__name__}: {exc}", 64 << 10),
        node=None,
        error=type(exc).__name__,
        traceback=clip(traceback, 512 << 10),
    )
