"""What a piece says while it is young: held, to travel inside its ``Done``.

A watched piece says facts as it runs (``ran`` after each node, ``said``, ``failed``). They
are held while it runs, so that a watched call costs no message more than an unwatched one:
a piece that finishes within ``STAND_IN_AFTER`` (most do) carries them inside its ``Done``
(``Done.saw``), in the order they were said. A piece that runs longer has them sent as
they were said from then on, so a watcher sees a long piece live: for a piece running where
it arrived, the stand-in releases them when it takes the socket; for a piece in a slot, the
serving loop does (``Runner.release_held``), once the piece has run ``STAND_IN_AFTER``. A
piece that says more than ``MAX_SAW`` facts or ``HELD_BYTES`` of them (a ``Done`` stays far
under the header's limit whatever a node says), or that fails, has them sent as ``Saw``s
before anything else of it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from ...wire import MAX_SAW
from ..logs import clip

#: The most text (field names and values) one piece's held facts may hold; past it they leave.
HELD_BYTES = 1 << 20


class Held:
    """The facts one piece said and that have not left yet; thread-safe (a piece's parallel
    branches say facts from several threads, and the serving thread releases them)."""

    __slots__ = ("_facts", "_lock", "_open", "_send", "_size")

    def __init__(self, send: Callable[[dict[str, str]], None]) -> None:
        self._send = send  # posts one fact as a `Saw` (into the outbox, in order)
        self._facts: list[dict[str, str]] = []
        self._size = 0  # characters held, names and values
        self._open = True
        self._lock = threading.Lock()

    @property
    def holding(self) -> bool:
        """Whether facts said now are still held (the piece is young)."""
        return self._open

    def told(self, fact: dict[str, str]) -> None:
        """What the piece's watcher is (from any thread of the piece): its texts cut to bounds."""
        self.say({k: clip(v, 16 << 10) for k, v in fact.items()})

    def say(self, fact: dict[str, str]) -> None:
        """A fact the piece said: held while the piece is young, else sent now."""
        size = sum(len(k) + len(v) for k, v in fact.items())
        with self._lock:
            if self._open and len(self._facts) < MAX_SAW and self._size + size <= HELD_BYTES:
                self._facts.append(fact)
                self._size += size
                return
            self._release()  # over what a Done carries: everything goes now, in order
            self._send(fact)

    def release(self) -> None:
        """The piece runs long (or failed): what it said goes now, and what it says later as
        it says it."""
        with self._lock:
            self._release()

    def take(self) -> tuple[dict[str, str], ...]:
        """The piece finished: what it said and is still held, for its ``Done``."""
        with self._lock:
            self._open = False
            facts, self._facts, self._size = self._facts, [], 0
        return tuple(facts)

    def _release(self) -> None:
        self._open = False
        facts, self._facts, self._size = self._facts, [], 0
        for fact in facts:  # under the lock: a fact said meanwhile leaves after these
            self._send(fact)
