"""What a client keeps of a pool's members: which it lost lately, and how their facts are named.

A pool is one host name served by many workers (``gpu#0``, ``gpu#1``, ...); the client, not
the broker, chooses the member for each piece (:meth:`~somatize.fabric.client.handle.Broker.run`).
A member whose worker died, would not start, or left is passed over for two patiences while
another member is there, so an input that runs again goes elsewhere.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any


class LostMembers:
    """The members this client lost lately, forgotten two patiences after they were lost."""

    def __init__(self, patience: float) -> None:
        self.patience = patience
        self._when: dict[str, float] = {}  # member -> when its worker was last lost (monotonic)
        self._lock = threading.Lock()

    def lost(self, member: str) -> None:
        with self._lock:
            self._when[member] = time.monotonic()

    def found(self, member: str) -> None:
        """``member`` answered: it is passed over no longer."""
        if self._when:
            with self._lock:
                self._when.pop(member, None)

    def among(self, members: Sequence[str]) -> set[str]:
        """The members of ``members`` lost in the last two patiences."""
        if not self._when:  # most pieces: nothing was lost
            return set()
        now = time.monotonic()
        with self._lock:
            for member, when in list(self._when.items()):
                if now - when >= self.patience * 2:
                    del self._when[member]
            pool = set(members) if len(self._when) > 8 else members
            return {m for m in self._when if m in pool}


def said_by_member(watch: Callable[[Any], None] | None, suffix: str) -> Callable[[Any], None] | None:
    """``watch``, told each fact as from member ``suffix`` (``#2``) of the pool it was sent
    to; the engine's ``elsewhere`` makes that ``gpu#2``."""
    if watch is None:
        return None

    def said(f: Any) -> None:
        inner = f.get("host")
        watch({**f, "host": f"{suffix}/{inner}" if inner else suffix})

    return said
