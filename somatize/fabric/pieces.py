"""The one place the engine's words become the wire's, and back.

The engine hands a broker a :class:`~somatize.engine.Piece` and takes back an
:class:`~somatize.engine.Outcome`; the wire carries ``Work`` and ``Done``. The client turns
a piece into work (:func:`work_of`) and a ``Done`` into an outcome (:func:`outcome_of`);
the worker turns work back into a piece (:func:`piece_of`) and an outcome into a ``Done``
(:func:`done_of`). Nothing else builds one from the other.

What does not cross: the piece's host (the worker is the host) and its deadline (a time on
the client's clock; the client bounds its own waits).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..engine import Outcome, Piece
from ..graph import Step
from ..wire import Done, NodeSpec, Recipe, Work


def work_of(piece: Piece, ref: int, specs: Sequence[NodeSpec], *, watched: bool) -> Work:
    """The ``Work`` for ``piece``, its steps packed as ``specs`` (in the same order)."""
    placement = {i: s.device for i, s in enumerate(piece.steps) if s.device is not None}
    return Work(ref, Recipe(tuple(specs), piece.shape), piece.value, dict(piece.keys), placement, watched=watched)


def outcome_of(done: Done) -> Outcome:
    return Outcome(done.output, dict(done.produced), done.took_us)


def piece_of(work: Work, nodes: Sequence[object]) -> Piece:
    """The piece a worker runs for ``work``, with ``nodes`` built from its recipe's specs."""
    steps = tuple(
        Step(node, name=spec.label, cache=spec.cache, device=work.placement.get(index))  # type: ignore[arg-type]
        for index, (node, spec) in enumerate(zip(nodes, work.recipe.nodes, strict=True))
    )
    return Piece("", steps, work.recipe.shape, work.input, dict(work.keys))


def done_of(ref: int, outcome: Outcome, took_us: int) -> Done:
    return Done(ref, outcome.output, outcome.produced, took_us)
