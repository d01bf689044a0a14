"""Facts: what happened, as flat dicts of text, and the watchers that are told.

A fact is a ``dict[str, str]`` with a ``"fact"`` entry naming its kind. The engine's
vocabulary is closed (``ENGINE``); any other kind (``loss``, ``updated``, ``said``) comes
from a level above and travels the same way. Durations are whole microseconds, written as
text. What a watcher is handed is exactly what a recorder keeps, so ``watching=print``
prints what you would later read back from the store.

This module does not decide what a fact means; it only builds, wraps and delivers them.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any

from .errors import NotAWatcher

Fact = dict[str, str]
Watcher = Callable[[Fact], Any]

#: The engine's own kinds: each belongs to the forward that is open. How many items a node
#: handled is a field of its ``ran`` (``items``), not a kind: it is the same event, timed
#: by the same ``took_us``, and a worker sends one message for it, not two.
ENGINE = frozenset({"ran", "failed", "recalled", "kept", "left", "finished", "broke"})
#: The kinds that close a forward.
CLOSING = frozenset({"finished", "broke"})


def fact(kind: str, /, **fields: object) -> Fact:
    """Build a fact of ``kind``; fields that are ``None`` are left out, the rest become text.

    >>> fact("ran", node="tokenize", took_us=4120)
    {'fact': 'ran', 'node': 'tokenize', 'took_us': '4120'}
    """
    out: Fact = {"fact": kind}
    for name, value in fields.items():
        if value is not None:
            out[name] = _text(value)
    return out


def _text(value: object) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)
    raise TypeError(f"a fact's fields are text, numbers or booleans; got a `{type(value).__name__}`")


def elsewhere(f: Fact, host: str) -> Fact:
    """Attribute a fact that arrived from ``host``.

    A worker never knows what the graph calls it, so the client adds the name. A fact
    that already crossed another machine keeps its route in order: ``"w1/w2"``.
    """
    out = dict(f)
    inner = out.get("host")
    if inner and inner.startswith("#"):  # from member `#2` of the pool `host`: "gpu#2" (see `Graph.map`)
        out["host"] = host + inner
    else:
        out["host"] = f"{host}/{inner}" if inner else host
    return out


def microseconds(nanoseconds: int) -> int:
    """Whole microseconds from a ``time.perf_counter_ns()`` difference."""
    return nanoseconds // 1000


class Watchers:
    """The watchers of one forward, told each fact in turn.

    Built from what ``watching=`` accepts: ``None``, one callable, or an iterable of
    callables. Anything else is refused up front with :class:`NotAWatcher`.

    A watcher is an observer: one that raises does not break the forward. Its first
    failure is reported on stderr, once, and it keeps being told.
    """

    __slots__ = ("_each", "_lock", "_reported")

    def __init__(self, watching: object = None) -> None:
        self._each: tuple[Watcher, ...] = _normalise(watching)
        self._lock = threading.Lock()
        self._reported: set[int] = set()

    def __bool__(self) -> bool:
        return bool(self._each)

    def __len__(self) -> int:
        return len(self._each)

    def __iter__(self):
        return iter(self._each)

    def for_forward(self) -> Watchers:
        """The watchers of one forward: a watcher that keeps per-forward state (a
        ``Recorder``) gives its own, through its ``for_forward()``."""
        each = tuple(w.for_forward() if hasattr(w, "for_forward") else w for w in self._each)
        if all(a is b for a, b in zip(each, self._each, strict=False)):
            return self
        fresh = Watchers()
        fresh._each = each
        return fresh

    def __call__(self, f: Fact) -> None:
        for position, watcher in enumerate(self._each):
            try:
                watcher(dict(f))  # each gets its own copy: one may not edit another's
            except Exception as exc:  # an observer must not break the work it observes
                self._report(position, watcher, exc)

    def _report(self, position: int, watcher: Watcher, exc: Exception) -> None:
        with self._lock:
            if position in self._reported:
                return
            self._reported.add(position)
        name = getattr(watcher, "__qualname__", type(watcher).__name__)
        print(
            f"somatize: watcher {name!s} raised {type(exc).__name__}: {exc}; "
            "the forward goes on and it keeps being told (reported once)",
            file=sys.stderr,
        )


def _normalise(watching: object) -> tuple[Watcher, ...]:
    if watching is None:
        return ()
    if isinstance(watching, Watchers):
        return watching._each
    if callable(watching):
        return (watching,)
    if isinstance(watching, (str, bytes)) or not isinstance(watching, Iterable):
        raise NotAWatcher(
            f"`watching=` takes a callable or a list of them, and got a "
            f"`{type(watching).__name__}`. Pass a function such as `print` or a "
            f"`Recorder(store)`, or a list of them."
        )
    each = tuple(watching)
    for position, watcher in enumerate(each):
        if not callable(watcher):
            raise NotAWatcher(
                f"entry {position} of `watching=` is a `{type(watcher).__name__}`, which "
                f"cannot be called with a fact. Every entry must be a callable taking one "
                f"dict, such as `print` or a `Recorder(store)`."
            )
    return each
