"""What crosses from the engine to a broker and back: a remote group as a :class:`Piece`,
what it gave back as an :class:`Outcome`, and the :class:`Deadline` both run under.

The engine (:mod:`somatize.engine`) makes pieces and runs them (:func:`~somatize.engine.run_piece`);
the fabric carries them (:mod:`somatize.fabric.pieces` turns them into ``Work`` and ``Done``).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from .graph import Shape, Step


@dataclasses.dataclass(frozen=True)
class Deadline:
    """When something has to be done by: ``seconds`` as given, ``until`` on the clock of
    ``time.monotonic()``, and ``whose`` it is, for messages ("the forward's")."""

    seconds: float
    until: float
    whose: str = "the forward's"

    @classmethod
    def after(cls, seconds: float, whose: str = "the forward's") -> Deadline:
        return cls(seconds, time.monotonic() + seconds, whose)

    def left(self) -> float:
        """Seconds left; negative once it has passed."""
        return self.until - time.monotonic()

    def sooner(self, other: Deadline | None) -> Deadline:
        return self if other is None or self.until <= other.until else other

    def __str__(self) -> str:
        return f"{self.whose} deadline of {self.seconds:g} s"


@dataclasses.dataclass(frozen=True)
class Piece:
    """A remote group, self-contained: its steps (numbered from 0), how they are wired,
    the value entering it, and the cache keys of its cached steps' outputs."""

    host: str
    steps: tuple[Step, ...]
    shape: Shape
    value: Any
    keys: dict[int, str]
    deadline: Deadline | None = None
    """The forward's deadline; the broker may make it sooner with the host's own."""
    memo: dict | None = dataclasses.field(default=None, compare=False, repr=False)
    """Where whoever carries the piece may keep what it works out for this group of this
    graph and that stays the same from forward to forward (the packed specs of its steps,
    :func:`somatize.fabric.pieces.specs_of`); it lives as long as the graph's plan."""


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What a piece gave back: its output, and what its cached steps produced (by step
    number), so the client can keep those under their keys."""

    output: Any
    produced: dict[int, Any]
    took_us: int | None = None
    """What the side that ran the piece measured, from taking it to having its answer."""
    member: str | None = None
    """The member of a pool that ran it (``gpu#2``), where the piece named the pool."""


def piece(
    host: str,
    steps: tuple[Step, ...],
    shape: Shape,
    value: Any,
    keys: dict[int, str],
    deadline: Deadline | None = None,
    memo: dict | None = None,
) -> Piece:
    """``Piece(...)`` without the frozen dataclass's ``__init__``, which sets each field
    through ``object.__setattr__`` (most of what making one costs, on every forward to a
    host): equal to it, and indistinguishable."""
    made = object.__new__(Piece)
    object.__setattr__(
        made,
        "__dict__",
        {
            "host": host,
            "steps": steps,
            "shape": shape,
            "value": value,
            "keys": keys,
            "deadline": deadline,
            "memo": memo,
        },
    )
    return made


def outcome(output: Any, produced: dict[int, Any], took_us: int | None = None) -> Outcome:
    """``Outcome(...)`` without the frozen dataclass's ``__init__`` (see :func:`piece`)."""
    made = object.__new__(Outcome)
    object.__setattr__(made, "__dict__", {"output": output, "produced": produced, "took_us": took_us})
    return made


def changed(made: Any, **fields: Any) -> Any:
    """``dataclasses.replace(made, **fields)`` for a :class:`Piece` or an :class:`Outcome`,
    without the frozen dataclass's ``__init__`` (see :func:`piece`): a pool's piece is sent
    to its member as a copy naming the member, on every forward."""
    new = object.__new__(type(made))
    object.__setattr__(new, "__dict__", {**made.__dict__, **fields})
    return new
