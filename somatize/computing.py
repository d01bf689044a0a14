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
forward failed) is taken again. Where its judge cannot be written (the name is blocked),
the waiter judges by the claim's own stamp alone: one that does not change for
``PATIENCE`` by this machine's monotonic clock is a dead claimer's. A waiter looks again
after a pause that grows from 20 ms to 250 ms and never less: it never spins.

One forward's waits share one end: half of what is left of its deadline when it starts
claiming (``MAX_WAIT`` without one), for every claim it waits on together, never a fresh
wait per entry. Past it, the forward computes what it still misses itself, unclaimed.

A claim name held by anything a store does not write (a link, a folder, a FIFO, a file
that is not a store entry: ``Blocked``, or a read that fails) is nobody's claim: the
forward computes that entry at once, unclaimed, as it would with no claims, and the name
is said once on stderr. Nothing planted among the claims makes a forward raise, wait past
its end, or spin.

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
from .folders import Blocked, tell_blocked, tell_once

#: A claim not written again for this long (by the store's stamps) is a dead claimer's.
PATIENCE = 10.0
#: The longest a forward waits for another to compute an entry, whatever its deadline.
MAX_WAIT = 3600.0
_PAUSE_FLOOR = 0.02  # a waiter's pause between looks: never less than this
_PAUSE_MOST = 0.25
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
        self._judge_blocked = False  # its judge's name is blocked: judge by stamps alone

    # -- taking and giving back ----------------------------------------------------------
    def take(self, key: str, node: str) -> bool:
        """Claim ``key`` for this forward; False when another holds a claim on it. True too
        when the claim cannot be taken (its name is blocked, the store refuses): then this
        forward computes, unclaimed, as without claims."""
        try:
            made = self.store.create(_PREFIX + key, self._record(node))
        except Blocked as exc:
            self._said_blocked(exc)
            return True
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
    def wait(self, key: str, node: str, found: Callable[[], bool], until: float | None) -> str:
        """Wait while another computes ``key``: "found" once ``found()`` says the entry is
        there, "taken" once this forward holds the claim (the other's died or went away) or
        may compute it unclaimed (the claim's name is blocked), "late" once the monotonic
        clock reaches ``until`` (``None``: ``MAX_WAIT`` from now), then this forward computes
        it, unclaimed. Every look is followed by a pause of at least 20 ms."""
        if until is None:
            until = time.monotonic() + MAX_WAIT
        pause, judged = _PAUSE_FLOOR, time.monotonic()
        try:
            self.store.record(_PREFIX + key)  # a claim is a store entry; anything else is nobody's
        except Missing:
            pass  # given back meanwhile (or blocked, and said): the loop takes it
        except (OSError, SomatizeError) as exc:  # not a claim (a damaged or foreign file)
            self._said_unusable(key, node, exc)
            return "late"  # compute now, and leave it alone
        seen: int | None = None  # the claim's stamp last seen, and when (for a judge-less look)
        seen_at = time.monotonic()
        while True:
            if found():
                return "found"
            if time.monotonic() >= until:
                return "late"
            try:
                written = self.store.stamp(_PREFIX + key)
            except Missing:
                if found():  # kept, then given back, between the two looks
                    return "found"
                if self.take(key, node):
                    return "taken"
                written = None  # another took it meanwhile: wait for that one, after a pause
            except (OSError, SomatizeError) as exc:
                self._said_unusable(key, node, exc)
                return "late"
            if written is not None and written != seen:
                seen, seen_at = written, time.monotonic()
            if written is not None and time.monotonic() - judged >= self.patience / 3:
                judged = time.monotonic()
                if self._dead(written, seen_at):
                    # its claimer stopped writing it: dead, or cut off. Take it over.
                    try:
                        self.store.delete(_PREFIX + key)
                    except (OSError, SomatizeError) as exc:
                        self._said_unusable(key, node, exc)
                        return "late"
                    if self.take(key, node):
                        return "taken"
            time.sleep(max(0.0, min(pause, until - time.monotonic())))
            pause = min(pause * 2, _PAUSE_MOST)

    def _dead(self, written: int, seen_at: float) -> bool:
        """Whether a claim last written at ``written`` (its stamp, first seen at ``seen_at``
        on this machine's monotonic clock) has gone unwritten for longer than ``patience``."""
        if not self._judge_blocked:
            try:
                return self._now() - written > self.patience * 1e9
            except Blocked as exc:
                self._said_blocked(exc)
            except (OSError, SomatizeError):
                pass
            self._judge_blocked = True  # judge by the stamp alone from now on
        return time.monotonic() - seen_at > self.patience

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

    def _said_unusable(self, key: str, node: str, exc: BaseException) -> None:
        """One line (once per name, rate-limited) for a claim that cannot be read or
        taken over: the forward computes ``node`` unclaimed and leaves the name alone."""
        root = getattr(self.store, "path", None)
        name = f"{root}/{_PREFIX}{key}" if root is not None else _PREFIX + key
        tell_once(
            name,
            f"somatize computing: the claim {name} cannot be used "
            f"({type(exc).__name__}: {exc}); `{node}` is computed here, unclaimed, and "
            "the name is left alone. Remove it if nobody is computing that entry.",
        )

    def _said_blocked(self, exc: Blocked) -> None:
        root = getattr(self.store, "path", None)
        if root is not None:
            tell_blocked(root, exc.where, exc.held)


def claim(
    claims: Claims,
    missed: dict[int, str],
    depth: dict[int, int],
    label: Callable[[int], str],
    fetch: Callable[[int, str], bool],
    until: float | None,
    waited: dict[int, int],
) -> bool:
    """Claim each missed entry (step index -> key) in the one order, waiting where another
    forward computes one, every wait ending by ``until`` (the monotonic clock's; one end
    for all of a forward's claims: `waits_end`). True as soon as an entry was recalled after
    a wait: what the forward needs has changed, and the caller prunes its plan again and
    claims again."""
    for index, key in sorted(missed.items(), key=lambda item: (depth.get(item[0], 0), item[1])):
        if key in claims.held or claims.take(key, label(index)):
            continue
        started = time.monotonic_ns()

        def found(i: int = index, k: str = key) -> bool:
            return fetch(i, k)

        if claims.wait(key, label(index), found, until) == "found":
            waited[index] = (time.monotonic_ns() - started) // 1000
            return True
    return False


def waits_end(left: float | None) -> float:
    """When a forward's waits for others' claims end, all of them together (the monotonic
    clock's): half of ``left``, what is left of its deadline, or ``MAX_WAIT`` without one."""
    return time.monotonic() + (MAX_WAIT if left is None else min(max(0.0, left / 2), MAX_WAIT))


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
