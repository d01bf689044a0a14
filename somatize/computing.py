"""Cached entries computed once: the claims forwards take on what they are about to compute.

When several forwards (threads, processes, machines sharing a store) miss the same cached
entry at once, one computes it and the others wait for it and read it back. A forward that
is about to compute a missing entry first claims it: it ``create``\\s ``computing/<key>`` in
the store, which exactly one creator gets, and writes that claim again every third of
``PATIENCE`` while it computes (its pulse). Another forward that finds the claim taken
waits: it looks for the entry, which it recalls as soon as it is kept, and it judges the
claim by the store's stamps, as a study judges a trial's attempt (a fresh entry of its own
against the claim's, never this machine's clock): a claim not written for ``PATIENCE`` is a
dead claimer's, deleted and taken over; a claim that goes away without the entry (its
forward failed) is taken again. A forward with a deadline waits at most half of what is
left of it, and at most ``MAX_WAIT`` in any case, then computes the entry itself.

Claims are taken in one order everywhere, the entries' depth in the graph (how many steps
feed them) and then their keys: a key names its whole upstream, so the order is the same in
every graph, and a forward that waits while holding claims can never wait in a circle.

Only a store with the claiming verbs (``create``, ``stamp``, ``delete``: ``FolderStore``)
takes claims; with any other, every forward that misses computes, as before. Nothing a
claim holds is trusted: it is only looked at to tell who computes.
"""

from __future__ import annotations

import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from .errors import Missing, SomatizeError

#: A claim not written again for this long (by the store's stamps) is a dead claimer's.
PATIENCE = 10.0
#: The longest a forward waits for another to compute an entry, whatever its deadline.
MAX_WAIT = 3600.0
_PREFIX = "computing/"


def claiming(store: Any) -> bool:
    return all(callable(getattr(store, verb, None)) for verb in ("create", "stamp", "delete", "put", "record"))


class Claims:
    """The claims one forward holds, their pulse, and its waits for others' claims."""

    def __init__(self, store: Any, *, patience: float | None = None) -> None:
        self.store = store
        self.patience = PATIENCE if patience is None else patience
        self.me = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        self.held: dict[str, str] = {}  # key -> the node it is for
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._pulse: threading.Thread | None = None

    # -- taking and giving back ----------------------------------------------------------
    def take(self, key: str, node: str) -> bool:
        """Claim ``key`` for this forward; False when another holds a claim on it."""
        try:
            made = self.store.create(_PREFIX + key, self._record(node))
        except (OSError, SomatizeError):
            return True  # a store that cannot take the claim: compute, as without claims
        if made:
            self._hold(key, node)
        return made

    def release(self, key: str) -> None:
        with self._lock:  # never between a beat's look and its write: it would write it again
            if self.held.pop(key, None) is None:
                return
            try:
                self.store.delete(_PREFIX + key)
            except (OSError, SomatizeError):
                pass  # a claim left behind is judged dead after PATIENCE, and taken over

    def release_all(self, keep: Iterable[str] = ()) -> None:
        """Give back every claim but those in ``keep``; with none left, the pulse stops."""
        kept = set(keep)
        for key in [k for k in list(self.held) if k not in kept]:
            self.release(key)
        if not self.held:
            self._stop.set()

    def _hold(self, key: str, node: str) -> None:
        with self._lock:
            self.held[key] = node
            if self._pulse is None:
                self._pulse = threading.Thread(target=self._beat, name="somatize-claims", daemon=True)
                self._pulse.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.patience / 3):
            with self._lock:
                for key, node in self.held.items():
                    try:
                        self.store.put(_PREFIX + key, self._record(node))
                    except (OSError, SomatizeError):
                        pass  # the next beat tries again; a claim not written is taken over, no worse

    def _record(self, node: str) -> dict[str, str]:
        return {"by": self.me, "node": node}

    # -- waiting for another's -----------------------------------------------------------
    def wait(self, key: str, node: str, found: Callable[[], bool], limit: float | None) -> str:
        """Wait while another computes ``key``: "found" once ``found()`` says the entry is
        there, "taken" once this forward holds the claim (the other's died or went away),
        "late" past ``limit`` seconds (then this forward computes it, unclaimed)."""
        started = time.monotonic()
        limit = MAX_WAIT if limit is None else min(limit, MAX_WAIT)
        pause, judged = 0.02, started
        try:
            self.store.record(_PREFIX + key)  # a claim is a store entry; anything else is nobody's
        except Missing:
            pass  # given back meanwhile: the loop takes it
        except (OSError, SomatizeError):
            return "late"  # not a claim (a FIFO, a damaged file): compute now, leave it alone
        while True:
            if found():
                return "found"
            if time.monotonic() - started >= limit:
                return "late"
            try:
                written = self.store.stamp(_PREFIX + key)
            except Missing:
                if found():  # kept, then given back, between the two looks
                    return "found"
                if self.take(key, node):
                    return "taken"
                continue  # another took it meanwhile: wait for that one
            except (OSError, SomatizeError):
                return "late"
            if time.monotonic() - judged >= self.patience / 3:
                judged = time.monotonic()
                if self._now() - written > self.patience * 1e9:
                    # its claimer stopped writing it: dead, or cut off. Take it over.
                    try:
                        self.store.delete(_PREFIX + key)
                    except (OSError, SomatizeError):
                        return "late"
                    if self.take(key, node):
                        return "taken"
                    continue
            time.sleep(pause)
            pause = min(pause * 2, 0.25)

    def _now(self) -> int:
        """This moment in the store's own clock: a fresh entry of ours, and its stamp."""
        name = f"{_PREFIX}judge/{self.me}"
        self.store.put(name, {"by": self.me})
        try:
            return self.store.stamp(name)
        finally:
            try:
                self.store.delete(name)
            except (OSError, SomatizeError):
                pass


def claim(
    claims: Claims,
    missed: dict[int, str],
    depth: dict[int, int],
    label: Callable[[int], str],
    fetch: Callable[[int, str], bool],
    limit: float | None,
    waited: dict[int, int],
) -> bool:
    """Claim each missed entry (step index -> key) in the one order, waiting where another
    forward computes one. True as soon as an entry was recalled after a wait: what the
    forward needs has changed, and the caller prunes its plan again and claims again."""
    for index, key in sorted(missed.items(), key=lambda item: (depth.get(item[0], 0), item[1])):
        if key in claims.held or claims.take(key, label(index)):
            continue
        started = time.monotonic_ns()
        if claims.wait(key, label(index), lambda i=index, k=key: fetch(i, k), limit) == "found":
            waited[index] = (time.monotonic_ns() - started) // 1000
            return True
    return False


def depths(shape: Any) -> dict[int, int]:
    """How many steps feed each step of a graph's shape (and the step itself): the first of
    the two things claims are ordered by. A key names all of its upstream, so an entry has
    the same depth in every graph that computes it."""
    out: dict[int, int] = {}

    def visit(part: Any, before: int) -> int:
        kind, body = part
        if kind == "step":
            out[body] = before + 1
            return before + 1
        if kind == "seq":
            for each in body:
                before = visit(each, before)
            return before
        return max((visit(branch, before) for branch in body), default=before)

    visit(shape, 0)
    return out
