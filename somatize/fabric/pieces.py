"""The one place the engine's words become the wire's, and back.

The engine hands a broker a :class:`~somatize.engine.Piece` and takes back an
:class:`~somatize.engine.Outcome`; the wire carries ``Work`` and ``Done``. The client turns
a piece into work (:func:`work_of`) and a ``Done`` into an outcome (:func:`outcome_of`);
the worker turns work back into a piece (:func:`piece_of`) and an outcome into a ``Done``
(:func:`done_of`). Nothing else builds one from the other.

What does not cross: the piece's host (the worker is the host) and its deadline (a time on
the client's clock; the client bounds its own waits).

What the client works out for a group and that does not change between forwards (the
packed specs of its steps) is kept in the piece's memo (:func:`specs_of`), so a repeated
call packs nothing.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

from ..code_identity import code_digest
from ..codec.registered import registered_now
from ..engine import Outcome, Piece
from ..graph import Step
from ..packing import Packer
from ..wire import Done, NodeSpec, Recipe, Work
from ..wire.messages import built

#: How many packers (brokers, hosts) one group keeps the specs of.
MEMO_PACKERS = 8


def specs_of(piece: Piece, packer: Packer) -> tuple[NodeSpec, ...]:
    """The specs of ``piece``'s steps as ``packer`` packs them, in order.

    Packed once per group and packer, and kept in the piece's memo, for as long as what the
    specs hold stays as it was: in network mode the codec registry (a codec registered, or
    registered again, since changes what an artifact carries), in project mode the code of
    each step's class (a spec carries its digest, which changes when a class is replaced in
    place, as IPython's autoreload does). The steps are then packed again. The memo holds the
    packer weakly: a closed broker's packer is not kept alive by a graph.
    """
    memo = piece.memo
    if memo is None:
        return tuple(packer.spec(step) for step in piece.steps)
    network = packer.mode == "network"
    now = registered_now() if network else tuple(code_digest(type(s.node)) if s.cache else "" for s in piece.steps)
    kept = memo.get(id(packer))
    if kept is not None and kept[0]() is packer and (kept[1] is now if network else kept[1] == now):
        return kept[2]
    specs = tuple(packer.spec(step) for step in piece.steps)
    if len(memo) >= MEMO_PACKERS:
        memo.clear()
    memo[id(packer)] = (weakref.ref(packer), now, specs)
    return specs


def work_of(piece: Piece, ref: int, specs: Sequence[NodeSpec], *, watched: bool, named: str = "") -> Work:
    """The ``Work`` for ``piece``, its steps packed as ``specs`` (in the same order); with
    ``named`` (a recipe digest the worker holds for this channel), its recipe by that name."""
    placement = {i: s.device for i, s in enumerate(piece.steps) if s.device is not None}
    recipe = None if named else Recipe(tuple(specs), piece.shape)
    # built without the frozen dataclass's __init__: `encode` checks every field as it writes
    return built(
        Work,
        {
            "ref": ref,
            "recipe": recipe,
            "input": piece.value,
            "keys": dict(piece.keys),
            "placement": placement,
            "memory": None,
            "watched": watched,
            "recipe_digest": named,
        },
    )


def outcome_of(done: Done) -> Outcome:
    # built without the frozen dataclass's __init__: a decoded Done's fields were checked
    return built(Outcome, {"output": done.output, "produced": dict(done.produced), "took_us": done.took_us})


def steps_of(work: Work, nodes: Sequence[object]) -> tuple[Step, ...]:
    """The steps a worker runs for ``work``, with ``nodes`` built from its recipe's specs."""
    recipe = work.recipe
    assert recipe is not None  # a Work that named its recipe by digest has it back before it runs
    return tuple(
        Step(node, name=spec.label, cache=spec.cache, device=work.placement.get(index))  # type: ignore[arg-type]
        for index, (node, spec) in enumerate(zip(nodes, recipe.nodes, strict=True))
    )


def piece_of(work: Work, steps: tuple[Step, ...]) -> Piece:
    """The piece a worker runs for ``work``, its steps made by :func:`steps_of` (or kept
    from an earlier call of the same recipe)."""
    recipe = work.recipe
    assert recipe is not None  # a Work that named its recipe by digest has it back before it runs
    # built without the frozen dataclass's __init__: every field is the checked work's
    return built(
        Piece,
        {
            "host": "",
            "steps": steps,
            "shape": recipe.shape,
            "value": work.input,
            "keys": dict(work.keys),
            "deadline": None,
            "memo": None,
        },
    )


def done_of(ref: int, outcome: Outcome, took_us: int, saw: tuple[dict[str, str], ...] = ()) -> Done:
    # every answer: built without the frozen dataclass's __init__ (`encode` checks each field)
    return built(
        Done, {"ref": ref, "output": outcome.output, "produced": outcome.produced, "took_us": took_us, "saw": saw}
    )


def done(ref: int, output: object, took_us: int) -> Done:
    """The ``Done`` of a piece that produced ``output`` alone: nothing kept, nothing said
    (``encode`` checks each field as it writes it)."""
    return built(Done, {"ref": ref, "output": output, "produced": {}, "took_us": took_us, "saw": ()})
