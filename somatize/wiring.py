"""How a plan's operations feed each other, worked out once per plan, and the plans of
pieces, compiled once per shape: what the engine's walk (:mod:`somatize.engine`) reads on
every forward and must not work out again."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

from .graph import Shape, Step
from .plan import Join, Plan, Recall, Run, compile


@dataclasses.dataclass(frozen=True)
class Wiring:
    """How a plan's operations feed each other, worked out once per plan: each one's
    sources, who reads each value, how many read it, how many of each one's sources the
    forward's input leaves missing, and which are ready at the start."""

    sources: tuple[tuple[int, ...], ...]
    consumers: dict[int, tuple[int, ...]]
    uses: dict[int, int]
    waiting: tuple[int, ...]
    ready: tuple[int, ...]


#: How many shapes of pieces a process keeps compiled (a worker serving many recipes).
PIECE_PLANS = 256
_piece_plans: dict[Shape, tuple[Plan, Wiring, int]] = {}
_piece_plans_lock = threading.Lock()


def piece_plan(steps: tuple[Step, ...], shape: Shape) -> Plan:
    """The plan of a piece: compiled once per shape and kept (bounded), then given the
    piece's own steps.

    What is kept is a function of the shape alone, which the process computed itself from
    the (already checked) message: operations over numbered values, no node, no value, no
    key, nothing of the client who sent it. So one client's piece can never run on what
    another's left behind; the most a client can do with many shapes is push others' out
    of the cache, which costs them a compile (microseconds), nothing else.
    """
    try:
        kept = _piece_plans.get(shape)
    except TypeError:  # not hashable (a list where a tuple belongs): compile, keep nothing
        return compile(steps, shape)
    if kept is None:
        template = compile(steps, shape)
        needs = 1 + max((op.step for op in template.ops if isinstance(op, Run)), default=-1)
        kept = (template, wiring_of(template), needs)
        with _piece_plans_lock:
            if len(_piece_plans) >= PIECE_PLANS:
                _piece_plans.pop(next(iter(_piece_plans)))  # the oldest in
            _piece_plans[shape] = kept
    template, wiring, needs = kept
    if template.steps is steps:
        return template
    if len(steps) < needs:
        raise ValueError(f"a piece of {len(steps)} steps has a shape that uses {needs}")
    plan = Plan(steps, template.ops, template.output)
    plan.__dict__["_somatize_wiring"] = wiring  # the same operations, wired the same way
    return plan


def wiring_of(plan: Plan) -> Wiring:
    found = plan.__dict__.get("_somatize_wiring")
    if found is not None:
        return found
    sources = tuple(sources_of(op) for op in plan.ops)
    consumers: dict[int, list[int]] = {}
    uses: dict[int, int] = {}
    for index, mine in enumerate(sources):
        for source in mine:
            consumers.setdefault(source, []).append(index)
            uses[source] = uses.get(source, 0) + 1
    waiting = tuple(sum(1 for source in mine if source != 0) for mine in sources)  # value 0: the input
    wiring = Wiring(
        sources,
        {value: tuple(readers) for value, readers in consumers.items()},
        uses,
        waiting,
        tuple(index for index, count in enumerate(waiting) if count == 0),
    )
    plan.__dict__["_somatize_wiring"] = wiring  # a plan is frozen, and so is this
    return wiring


def sources_of(op: Any) -> tuple[int, ...]:
    if isinstance(op, Join):
        return op.sources
    if isinstance(op, Recall):
        return ()
    return (op.source,)


def inputs_of(op: Any, values: dict[int, Any]) -> Any:
    if isinstance(op, Join):
        return tuple(values[s] for s in op.sources)
    if isinstance(op, Recall):
        return None
    return values[op.source]
