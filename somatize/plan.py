"""From a graph to a plan: up-front checks, cache keys, pruning, grouping by host.

Everything here happens before any node runs:

1. :func:`check` refuses what cannot work (``Unsettled``, ``Nameless``, ``UnknownHost``,
   ``NoStore``, ``DuplicateName``), each with a sentence that says what to do.
2. :func:`keys_for` names every value a cached node depends on (see :mod:`somatize.keys`).
3. :func:`prune` walks back from the output: a cached node whose key is in the store is
   recalled instead of run, and whatever fed only it is not needed at all.
4. :func:`group` folds consecutive nodes placed on one host into a single remote group,
   so a chain of five nodes on ``w1`` is one message, not five.
5. :func:`compile` turns the result into a flat list of operations over numbered values.
   A group on a host that runs in this process (``Worker.inprocess()``) is not a second
   plan handed to the broker: its steps become ordinary ``Run`` operations tagged with the
   host, the last of which closes the group (:class:`Closes`: the walk then says ``left``
   and keeps what the group's cached steps produced, as it would for a trip elsewhere).

The plan knows nothing of threads, sockets or stores: recalling is a function handed in.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, cast

from . import keys as _keys
from .errors import DuplicateName, Nameless, NoStore, UnknownHost, Unsettled
from .graph import Graph, Shape, Step

# -- operations over numbered values (value 0 is the forward's input) -------------------


@dataclasses.dataclass(frozen=True)
class Closes:
    """What ends a group run in this process: its host, its number in the plan (the walk
    times the group from the first of its steps to start), and its steps (whose cached
    outputs are kept once the group has closed, after ``left``, as for a trip elsewhere)."""

    host: str
    group: int
    steps: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Run:
    """Run step ``step`` on value ``source``, giving value ``target``.

    ``host`` is set for a step of a group on a host that runs in this process: its facts
    name the host, and a failure says where. ``opens`` (the group's number) is set on the
    steps that read the value entering the group: the walk times the group from the first
    of them to start. ``closes`` is set on the operation that gives the group's output."""

    step: int
    source: int
    target: int
    host: str | None = None
    opens: int = 0
    closes: Closes | None = None


@dataclasses.dataclass(frozen=True)
class Recall:
    """Value ``target`` is step ``step``'s output, already found in the store."""

    step: int
    key: str
    target: int


@dataclasses.dataclass(frozen=True)
class Join:
    """Value ``target`` is the tuple of ``sources`` (the end of a parallel); ``closes`` as
    for :class:`Run`, when the parallel ends a group run in this process."""

    sources: tuple[int, ...]
    target: int
    closes: Closes | None = None


@dataclasses.dataclass(frozen=True)
class Remote:
    """Run the part of the graph shaped ``shape`` on ``host``, as one piece of work."""

    host: str
    shape: Shape
    source: int
    target: int

    # computed once per plan, not per forward: a cached plan sends the same group again
    @functools.cached_property
    def step_indices(self) -> tuple[int, ...]:
        return tuple(_indices(self.shape))

    @functools.cached_property
    def local_shape(self) -> Shape:
        """``shape`` with its steps renumbered from 0, in ``step_indices`` order: the
        shape of the piece of work sent to ``host``."""
        return _renumber(self.shape, {old: new for new, old in enumerate(self.step_indices)})


Op = Run | Recall | Join | Remote


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one forward will do, in an order that respects every dependency."""

    steps: tuple[Step, ...]
    ops: tuple[Op, ...]
    output: int

    @property
    def remotes(self) -> tuple[Remote, ...]:
        return tuple(op for op in self.ops if isinstance(op, Remote))


def make(graph: Graph, *, here: frozenset[str] = frozenset()) -> Plan:
    """The plan of ``graph`` with nothing recalled: grouped and compiled, not checked.
    ``here``: the hosts that run in this process (their groups become local steps)."""
    return compile(graph.steps, group(graph.shape, graph.steps), here=here)


# -- 1. checks ---------------------------------------------------------------------------


def check(graph: Graph, *, broker: Any, store: Any, here: frozenset[str] | None = None) -> None:
    """Refuse, before anything runs, a graph that cannot run as declared. ``here``: the
    hosts ``broker`` runs in this process, when the caller has asked it already.

    What depends on the graph alone (names, what is cached and frozen, and whether a store
    was given) is checked once per graph and remembered on it when it passes; the hosts are
    asked every time (a worker may dial in or go), unless the broker says what it knows
    by an object that stays the same while its answers do (``listed()``: a ``Broker``'s
    listing of its hosts, made anew when it asks the broker again): a graph found
    runnable on one listing is runnable on it again."""
    steps = graph.steps
    passed = graph.__dict__.get("_somatize_checked")
    if passed is not None and (store is None) in passed:
        if here is not None and graph.__dict__["_somatize_hosts"] <= here:
            return  # no host, or only hosts the broker runs in this process: nothing to ask
        token = _listed(broker)
        if token is not None and graph.__dict__.get("_somatize_listed") is token:
            return  # its hosts known, and its steps packable, on this very listing
        _check_hosts(steps, broker, here)
        if token is not None:
            graph.__dict__["_somatize_listed"] = token
        return
    _check_names(steps)

    def visit(shape: Shape, upstream: tuple[int, ...]) -> tuple[int, ...]:
        kind, body = shape
        if kind == "step":
            with_self = upstream + (body,)
            if steps[body].cache:
                _check_cached(steps, body, with_self, store)
            return with_self
        if kind == "seq":
            for part in body:
                upstream = visit(part, upstream)
            return upstream
        seen: dict[int, None] = dict.fromkeys(upstream)
        for branch in body:
            seen.update(dict.fromkeys(visit(branch, upstream)))
        return tuple(seen)

    visit(graph.shape, ())
    token = _listed(broker)
    _check_hosts(steps, broker, here)
    if token is not None:
        graph.__dict__["_somatize_listed"] = token
    graph.__dict__["_somatize_hosts"] = frozenset(step.host for step in steps if step.host is not None)
    graph.__dict__.setdefault("_somatize_checked", set()).add(store is None)


def _listed(broker: Any) -> object | None:
    """What ``broker``'s knowledge of its hosts stands on (``Broker.listed``), or None."""
    listed = getattr(broker, "listed", None)
    return None if listed is None else listed()


def _check_names(steps: tuple[Step, ...]) -> None:
    owners: dict[str, Any] = {}
    for step in steps:
        if step.name is None:
            continue
        owner = owners.setdefault(step.name, step.node)
        if owner is not step.node:
            raise DuplicateName(
                f"two different nodes are named `{step.name}` "
                f"(a `{type(owner).__name__}` and a `{type(step.node).__name__}`); names are "
                f"what records and cache keys call a node, so give each its own `.named(...)`."
            )


def _check_cached(steps: tuple[Step, ...], at: int, prefix: tuple[int, ...], store: Any) -> None:
    cached = steps[at]
    for i in prefix:
        if steps[i].name is None:
            where = "it has no name" if i == at else f"a `{type(steps[i].node).__name__}` upstream of it has no name"
            raise Nameless(
                f"a cached `{type(cached.node).__name__}` cannot be keyed: {where}, and a "
                f"cache key is made of the names of everything that leads to it. Give it "
                f'one with `.named("...")`.'
            )
    for i in prefix:
        if not steps[i].freeze:
            who = "it is" if i == at else f"`{steps[i].label}` upstream of it is"
            raise Unsettled(
                f"`{cached.label}` is cached, but {who} not frozen, so what was kept could "
                f"go stale without anything noticing. Mark it `.frozen()` if its parameters "
                f"do not change, or drop `.cached()` from `{cached.label}`."
            )
    if store is None:
        raise NoStore(
            f"`{cached.label}` is cached, but this forward was given no store to keep it "
            f'in. Pass `store=FolderStore("./.somatize")`, or drop `.cached()`.'
        )


def _check_hosts(steps: tuple[Step, ...], broker: Any, here: frozenset[str] | None = None) -> None:
    for step in steps:
        if step.host is None:
            continue
        if here is None:  # asked only of a graph that places something on a host
            asked = getattr(broker, "here", None)
            here = frozenset() if asked is None else asked()
        if step.host in here:
            continue  # a host the broker runs in this process is known, and takes any node
        if broker is None:
            raise UnknownHost(
                f'`{step.label}` is placed on `{step.host}` with `.at("{step.host}")`, but '
                f"this forward was given no broker to find `{step.host}`. Pass "
                f'`broker=Broker.embedded({{"{step.host}": Worker.spawn(...)}})`, '
                f"or remove the `.at()`."
            )
        if not broker.knows(step.host):
            known = ", ".join(f"`{h}`" for h in sorted(broker.hosts())) or "none"
            raise UnknownHost(
                f"`{step.label}` is placed on `{step.host}`, and the broker does not know "
                f"`{step.host}` (it knows: {known}). Add `{step.host}` to the broker's "
                f"hosts, or place the node on one it knows."
            )
        check = getattr(broker, "check", None)
        if check is not None:
            check(step.host, step)  # can it be packed for that host? (project mode, say)


# -- 2. keys -----------------------------------------------------------------------------


def keys_for(graph: Graph, input_key: str) -> dict[int, str]:
    """The key of every step's output that can be named (its whole prefix is named)."""
    steps = graph.steps
    out: dict[int, str] = {}

    def visit(shape: Shape, key: str | None) -> str | None:
        kind, body = shape
        if kind == "step":
            step = steps[body]
            if key is None or step.name is None:
                return None
            out[body] = _keys.output_key(step.identity, key)
            return out[body]
        if kind == "seq":
            for part in body:
                key = visit(part, key)
            return key
        branch_keys = [visit(branch, key) for branch in body]
        if any(k is None for k in branch_keys):
            return None
        return _keys.tuple_key(branch_keys)  # type: ignore[arg-type]

    visit(graph.shape, input_key)
    return out


# -- 3. pruning --------------------------------------------------------------------------


def prune(
    shape: Shape,
    steps: tuple[Step, ...],
    keys: dict[int, str],
    recall: Callable[[int, str], bool],
) -> Shape:
    """Replace cached steps found in the store with ``("recall", i)``, and drop what fed
    only them.

    Walks each sequence from its end, so ``recall(i, key)`` is asked only for steps whose
    output is actually needed, and a hit upstream of another hit is never fetched.
    ``recall`` returns whether the value was found (and keeps it, for the walk).
    """

    def visit(shape: Shape) -> tuple[Shape, bool]:
        kind, body = shape
        if kind == "step":
            key = keys.get(body)
            if steps[body].cache and key is not None and recall(body, key):
                return ("recall", body), False
            return shape, True
        if kind == "seq":
            kept: list[Shape] = []
            for part in reversed(body):
                pruned, needs_input = visit(part)
                kept.append(pruned)
                if not needs_input:
                    return _seq(kept[::-1]), False
            return _seq(kept[::-1]), True
        visited = [visit(branch) for branch in body]
        return ("par", tuple(p for p, _ in visited)), any(n for _, n in visited)

    return visit(shape)[0]


def _seq(parts: list[Shape]) -> Shape:
    return parts[0] if len(parts) == 1 else ("seq", tuple(parts))


# -- 4. grouping -------------------------------------------------------------------------


def host_of(shape: Shape, steps: tuple[Step, ...]) -> str | None:
    """The host every step of ``shape`` is placed on, or ``None`` when local or mixed."""
    kind, body = shape
    if kind == "step":
        return steps[body].host
    if kind in ("recall", "remote"):
        return None
    hosts = {host_of(part, steps) for part in body}
    return hosts.pop() if len(hosts) == 1 else None


def group(shape: Shape, steps: tuple[Step, ...]) -> Shape:
    """Fold every maximal run of consecutive parts on one host into ``("remote", host, part)``."""
    whole = host_of(shape, steps)
    if whole is not None:
        return ("remote", (whole, shape))
    kind, body = shape
    if kind in ("step", "recall"):
        return shape
    if kind == "par":
        return ("par", tuple(group(branch, steps) for branch in body))
    out: list[Shape] = []
    run: list[Shape] = []
    run_host: str | None = None

    def close() -> None:
        if run:
            out.append(("remote", (run_host, _seq(run[:]))))
            run.clear()

    for part in body:
        host = host_of(part, steps)
        if host is not None and host == run_host:
            run.append(part)
            continue
        close()
        run_host = host
        if host is not None:
            run.append(part)
        else:
            out.append(group(part, steps))
    close()
    return _seq(out)


# -- 5. compiling ------------------------------------------------------------------------


def compile(
    steps: tuple[Step, ...],
    shape: Shape,
    *,
    recalled_keys: dict[int, str] | None = None,
    here: frozenset[str] | set[str] = frozenset(),
) -> Plan:
    """Number the values and list the operations, each after everything it reads.

    A remote group on a host in ``here`` (one that runs in this process) is compiled into
    the plan itself: ``Run`` operations tagged with the host, the last one closing it."""
    ops: list[Op] = []
    counter = [0]
    groups = [0]
    recalled_keys = recalled_keys or {}

    def fresh() -> int:
        counter[0] += 1
        return counter[0]

    def emit(shape: Shape, source: int, host: str | None = None) -> int:
        kind, body = shape
        if kind == "step":
            target = fresh()
            ops.append(Run(body, source, target, host))
            return target
        if kind == "recall":
            target = fresh()
            ops.append(Recall(body, recalled_keys.get(body, ""), target))
            return target
        if kind == "remote":
            where, inner = body
            if where in here:
                groups[0] += 1
                start = len(ops)
                target = emit(inner, source, where)
                for at in range(start, len(ops)):
                    op = ops[at]
                    if isinstance(op, Run) and op.source == source:
                        ops[at] = dataclasses.replace(op, opens=groups[0])
                # the operation giving a shape's value is always the last one emitted for it: a
                # group holds steps, sequences and parallels (`host_of`), so a Run or a Join
                last = cast("Run | Join", ops[-1])
                ops[-1] = dataclasses.replace(last, closes=Closes(where, groups[0], tuple(_indices(inner))))
                return target
            target = fresh()
            ops.append(Remote(where, inner, source, target))
            return target
        if kind == "seq":
            for part in body:
                source = emit(part, source, host)
            return source
        sources = tuple(emit(branch, source, host) for branch in body)
        target = fresh()
        ops.append(Join(sources, target))
        return target

    output = emit(shape, 0)
    return Plan(steps, tuple(ops), output)


def _renumber(shape: Shape, renumber: dict[int, int]) -> Shape:
    kind, body = shape
    if kind in ("step", "recall"):
        return (kind, renumber[body])
    return (kind, tuple(_renumber(part, renumber) for part in body))


def _indices(shape: Shape):
    kind, body = shape
    if kind in ("step", "recall"):
        yield body
    elif kind == "remote":
        yield from _indices(body[1])
    else:
        for part in body:
            yield from _indices(part)
