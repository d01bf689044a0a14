"""What a graph keeps for running it again, worked out once: whether it places anything on a
host or caches anything, its plans (one per set of hosts that run in this process), and for
each remote group of a plan the steps a piece numbers and the memo a carrier keeps there.

A graph does not change once declared, so all of it is kept on the graph itself (under
``_somatize_*`` names, which a pickle or a copy of the graph leaves out) and found again by
every forward: the engine (:mod:`somatize.engine`) asks here before it walks.
"""

from __future__ import annotations

from typing import Any, Literal

from .graph import Graph, Step
from .plan import Plan, Remote, compile, group

#: How many plans one graph keeps (one per set of in-process hosts it was run with).
PLANS_PER_GRAPH = 8
NOWHERE: frozenset[str] = frozenset()


def here(broker: Any, graph: Graph) -> frozenset[str]:
    """The hosts ``broker`` runs in this process (none without a broker, for a broker that
    does not say, or for a graph that places nothing on a host: then the broker is not
    asked at all, so a graph run wholly here never waits on one)."""
    if broker is None:
        return NOWHERE
    hosted = graph.__dict__.get("_somatize_hosted")
    if hosted is None:
        hosted = graph.__dict__["_somatize_hosted"] = any(step.host is not None for step in graph.steps)
    asked = getattr(broker, "here", None) if hosted else None
    return NOWHERE if asked is None else asked()


def caches(graph: Graph) -> bool:
    """Whether any step of ``graph`` is cached (with a store, a forward may recall or keep)."""
    cached = graph.__dict__.get("_somatize_caches")
    if cached is None:
        cached = graph.__dict__["_somatize_caches"] = any(step.cache for step in graph.steps)
    return cached


def plan_of(graph: Graph, here: frozenset[str]) -> Plan:
    """The plan of ``graph`` with nothing recalled, made once and kept on the graph (a
    graph does not change; its plan depends only on it and on which hosts run here)."""
    plans = graph.__dict__.get("_somatize_plans")
    if plans is None:
        plans = graph.__dict__["_somatize_plans"] = {}
    plan = plans.get(here)
    if plan is None:
        plan = compile(graph.steps, group(graph.shape, graph.steps), here=here)
        if len(plans) >= PLANS_PER_GRAPH:
            plans.clear()
        plans[here] = plan
    return plan


def one_trip(graph: Graph, here: frozenset[str], store: Any) -> tuple[Plan, Remote] | None:
    """The plan and its one operation when a forward of ``graph`` is a single trip to a host
    from its input to its output, with nothing to recall or keep (no store, or no cached
    step); otherwise None. Asked only of a forward nobody watches, with no deadline: that
    forward is then ``broker.run`` of one piece, exactly what the walk would do for it."""
    if store is not None and caches(graph):
        return None
    plan = plan_of(graph, here)
    ops = plan.ops
    if len(ops) != 1:
        return None
    op = ops[0]
    if type(op) is not Remote or op.source != 0 or op.target != plan.output:
        return None
    return plan, op


def trip_of(graph: Graph, here: frozenset[str], store: Any) -> tuple[str, tuple[Step, ...], Any, dict] | None:
    """What ``one_trip`` finds, as the piece of that trip needs it: its host, its steps (as
    ``steps_of`` numbers them), its shape and its memo; worked out once per set of hosts
    that run here, and kept on the graph beside its plans."""
    if store is not None and caches(graph):
        return None
    trips = graph.__dict__.get("_somatize_trips")
    if trips is None:
        trips = graph.__dict__["_somatize_trips"] = {}
    trip: tuple[str, tuple[Step, ...], Any, dict] | Literal[False] | None = trips.get(here)  # False: no one trip
    if trip is None:
        found = one_trip(graph, here, None)
        trip = False if found is None else (found[1].host, steps_of(*found), found[1].local_shape, memo_of(found[1]))
        if len(trips) >= PLANS_PER_GRAPH:
            trips.clear()
        trips[here] = trip
    return trip or None


def memo_of(op: Remote) -> dict:
    """A remote group's memo (see ``Piece.memo``): one per operation of a plan."""
    memo = op.__dict__.get("_memo")
    if memo is None:
        memo = op.__dict__["_memo"] = {}
    return memo


def steps_of(plan: Plan, op: Remote) -> tuple[Step, ...]:
    """The steps of a remote group, as a piece numbers them (once per plan and group)."""
    found = op.__dict__.get("_steps")
    if found is None or found[0] is not plan:
        found = (plan, tuple(plan.steps[i] for i in op.step_indices))
        op.__dict__["_steps"] = found
    return found[1]
