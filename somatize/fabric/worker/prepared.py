"""A recipe's steps, kept between calls, for the pieces that run where they arrived.

A worker runs a piece as :class:`~somatize.engine.Step`\\ s, each node in a
:class:`~somatize.fabric.worker.slots.Guarded` that reports to the piece's job. What that
takes depends on the recipe, on the nodes the catalog built for it (built, and so checked,
at every call) and on the job. With ``jobs=1`` one piece runs at a time on this loop (new
work is refused as busy while one runs), so the steps of a recipe are kept and only their
job is swapped: a repeated call builds none of them again, and the engine finds its plan
compiled for those very steps. A piece in a slot may run beside another of the same recipe,
so each builds its own; so does a piece with a placement (its devices are per call).

Kept per recipe object (the one a session keeps for its peer, so one peer's steps are never
another's), at most ``MAX_KEPT``, the least recently used let go first; nodes the catalog
now builds differently (provisioned anew, its class replaced) make the steps anew. Steps
hold their nodes, so when the catalog lets any node go to make room (``Catalog.dropped``),
every kept step is let go too: a node the catalog dropped never stays alive here.

With the steps is kept whether the recipe is one step alone, from its input to its output
(``engine.lone_step``): the runner then runs that step directly (``engine.run_lone``) for a
piece nobody watches that keeps nothing, with no walk built around it.
"""

from __future__ import annotations

import operator
from collections import OrderedDict
from collections.abc import Sequence

from ...engine import lone_step
from ...graph import Node, Step
from ...packing import Catalog
from ...wire import Recipe, Work
from ..pieces import steps_of
from .slots import Guarded, Job

#: How many recipes' steps a loop keeps.
MAX_KEPT = 64


def guarded(work: Work, nodes: Sequence[Node], job: Job) -> list[Guarded]:
    """``nodes`` (built for ``work``'s specs, in order), each in a guard reporting to ``job``:
    one guard per node and name, however often it appears."""
    guards: dict[tuple[int, str], Guarded] = {}
    out: list[Guarded] = []
    recipe = work.recipe
    assert recipe is not None  # a Work the conversation gave back: its recipe in full, or recalled
    for node, spec in zip(nodes, recipe.nodes, strict=True):
        guard = guards.get((id(node), spec.label))
        if guard is None:
            guard = guards[(id(node), spec.label)] = Guarded(node, spec.label, job)
        out.append(guard)
    return out


class Prepared:
    """The steps of the recipes a loop ran where they arrived, by recipe."""

    def __init__(self, catalog: Catalog, most: int = MAX_KEPT) -> None:
        self.catalog = catalog
        self.most = most
        self._dropped = catalog.dropped
        self._kept: OrderedDict[
            int, tuple[Recipe, tuple[Node, ...], tuple[Step, ...], tuple[Guarded, ...], Step | None]
        ] = OrderedDict()

    def __len__(self) -> int:
        return len(self._kept)

    def steps(self, work: Work, nodes: Sequence[Node], job: Job, *, keep: bool = True) -> tuple[Step, ...]:
        """The steps of ``work`` with ``nodes`` (built for it, checked), reporting to ``job``:
        the kept ones when its recipe ran here before with the very same nodes and no
        placement. ``keep=False`` (a piece in a slot): made for this piece alone."""
        return self.prepare(work, nodes, job, keep=keep)[0]

    def prepare(
        self, work: Work, nodes: Sequence[Node], job: Job, *, keep: bool = True
    ) -> tuple[tuple[Step, ...], Step | None]:
        """``steps``, and the one step the recipe is (``engine.lone_step``) when its steps are
        kept here (None otherwise: a piece in a slot or with a placement takes the walk)."""
        recipe = work.recipe
        if work.placement or not keep:
            return steps_of(work, guarded(work, nodes, job)), None
        if self.catalog.dropped != self._dropped:  # the catalog let nodes go: so does this
            self._dropped = self.catalog.dropped
            self._kept.clear()
        kept = self._kept.get(id(recipe))
        if kept is not None and kept[0] is recipe and all(map(operator.is_, kept[1], nodes)):
            self._kept.move_to_end(id(recipe))
            for guard in kept[3]:
                guard.job = job
            return kept[2], kept[4]
        guards = guarded(work, nodes, job)
        steps = steps_of(work, guards)
        assert recipe is not None  # `guarded` just read its nodes
        lone = lone_step(steps, recipe.shape)
        self._kept[id(recipe)] = (recipe, tuple(nodes), steps, tuple({id(g): g for g in guards}.values()), lone)
        self._kept.move_to_end(id(recipe))
        while len(self._kept) > self.most:
            self._kept.popitem(last=False)
        return steps, lone
