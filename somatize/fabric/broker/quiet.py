"""What the broker logs about what peers do: bounded, so that nobody can flood its journal."""

from __future__ import annotations

import time

#: Lines of one kind logged per `QUIET` seconds at most; past it they are counted, and the count said.
LOUD, QUIET = 20, 10.0


class Quiet:
    """At most `LOUD` lines of one kind per `QUIET` seconds: past it lines are counted, and
    the count is said with the next line logged. Whoever sends can make a broker log; nobody
    can make it flood its journal."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.said: list[float] = []
        self.unsaid = 0

    def more(self) -> str | None:
        """The suffix for a line that may be logged now (``""`` or the count left out), or
        None when this one is to be counted, not logged."""
        now = time.monotonic()
        self.said = [t for t in self.said if now - t < QUIET]
        if len(self.said) >= LOUD:
            self.unsaid += 1
            return None
        self.said.append(now)
        more = f" ({self.unsaid} more {self.what} were not logged)" if self.unsaid else ""
        self.unsaid = 0
        return more
