"""The walk: runs a plan's operations as soon as their inputs are ready.

Operations whose inputs are ready at the same time run together on a shared thread pool
(a chain runs inline in the caller's thread, so a long chain pays no thread hops). Every
operation tells the watchers what it did (``ran``, ``failed``, ``recalled``, ``kept``,
``left``) and the forward ends with ``finished`` or ``broke``. A ``ran`` whose node
returned a batch says how many ``items`` it held.

Caching is an optimisation and never an error: a value that cannot be written down or a
store that refuses a write costs one line on stderr, and the answer is still right.

The engine never imports ZeroMQ. A remote group is handed to the broker as a
:class:`Piece` through one call, ``broker.run(piece, watch)``, which returns an
:class:`Outcome`; a worker runs the same piece with :func:`run_piece`. A group on a host
the broker runs in this process (``Worker.inprocess()``, named by ``broker.here()``) is
no piece at all: its steps are this walk's own, tagged with the host (see
:func:`somatize.plan.compile`), so it costs what the same steps cost with no host.

What does not change between forwards of one graph is worked out once: the plan of a
graph with nothing recalled is kept on the graph (per set of in-process hosts), and a
remote group's renumbered steps on its plan.

A forward may be given a deadline. Every wait for another process is bounded by it (the
broker raises ``Overdue``); a node running in this process cannot be interrupted (Python
has no safe way to stop a thread), so for local nodes the deadline is checked before each
one starts, and one that never returns holds its forward.

What crosses to a broker (a :class:`~somatize.pieces.Piece`, its
:class:`~somatize.pieces.Outcome`, a :class:`~somatize.pieces.Deadline`) is
:mod:`somatize.pieces`; how a plan's operations feed each other, and the plans of pieces
compiled once per shape, :mod:`somatize.wiring`. This module walks plans.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from . import keys as _keys
from .codec import check_start, loads, written_parts
from .computing import Claims, claim, claiming, depths, waits_end
from .errors import CodecError, Missing, NodeFailed, Overdue, SomatizeError
from .facts import Watchers, elsewhere, fact, microseconds
from .folders import Blocked
from .graph import Graph, Step, as_graph
from .pieces import Deadline, Outcome, Piece
from .pieces import outcome as _outcome
from .pieces import piece as _piece
from .plan import Closes, Join, Plan, Recall, Remote, Run, check, compile, group, keys_for, prune
from .planned import caches as _caches
from .planned import here as _here
from .planned import memo_of as _memo_of
from .planned import plan_of as _plan_of
from .planned import steps_of as _steps_of
from .planned import trip_of as _trip_of
from .store import FolderStore
from .values import carried as _carried
from .values import items_of as _items
from .values import place as _place
from .values import within as _within
from .wiring import inputs_of, piece_plan, wiring_of

# -- the pool ----------------------------------------------------------------------------

_pool_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def _shared_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(
                max_workers=max(32, (os.cpu_count() or 1) * 4),
                thread_name_prefix="somatize-wave",
            )
        return _pool


# -- entry points ------------------------------------------------------------------------


def forward(
    graph: Any, x: Any, *, broker: Any = None, store: Any = None, watching: Any = None, deadline: float | None = None
) -> Any:
    """Run ``graph`` on ``x``: check, plan, walk, and say ``finished`` or ``broke``.

    ``deadline`` (seconds, from this call) bounds every wait for a worker: past it the
    forward raises ``Overdue``. Nodes in this process are not interrupted; the deadline is
    checked before each starts.
    """
    graph = as_graph(graph)
    until = None if deadline is None else Deadline.after(_seconds(deadline))
    # a watcher that cannot be called is refused first; nobody watching is one shared nobody
    watch = _NOBODY if watching is None else Watchers(watching).for_forward()
    if until is not None and hasattr(broker, "asking_within"):
        with broker.asking_within(until):  # what the checks ask its broker waits no longer than the forward
            here = _here(broker, graph)
            check(graph, broker=broker, store=store, here=here)
    else:
        here = _here(broker, graph)
        check(graph, broker=broker, store=store, here=here)
    # (a graph whose hosts all run in this process, as `check` found, is walked here)
    if (
        until is None
        and (watch is _NOBODY or not watch)
        and broker is not None
        and not graph.__dict__["_somatize_hosts"] <= here
    ):
        trip = _trip_of(graph, here, store)
        if trip is not None:  # the whole forward is one trip to a host: the piece goes as it is
            host, steps, shape, memo = trip
            return broker.run(_piece(host, steps, shape, x, {}, None, memo), None).output
    started = time.perf_counter_ns()
    try:
        walk = _Walk.prepare(graph, x, broker=broker, store=store, watch=watch, deadline=until, here=here)
        try:
            output = walk.run(x)
        finally:
            if walk.claims is not None:  # what it claimed and did not keep: others compute it
                walk.claims.release_all()
    except BaseException as exc:
        if watch:
            watch(fact("broke", error=_describe(exc), took_us=microseconds(time.perf_counter_ns() - started)))
        raise
    if watch:  # nobody watching: no fact is even built
        watch(fact("finished", took_us=microseconds(time.perf_counter_ns() - started)))
    return output


def run_piece(piece: Piece, watch: Any = None) -> Outcome:
    """Run a remote group where it landed (a worker, or this process for InProcess).

    Says ``ran`` and ``failed`` as a local walk would, but neither ``finished`` nor
    ``broke``: the forward belongs to the client, which closes it. The piece's plan is
    compiled once per shape (see :func:`somatize.wiring.piece_plan`), so a repeated call does not plan again.
    """
    started = time.perf_counter_ns()
    plan = piece_plan(piece.steps, piece.shape)
    watchers = _NOBODY if watch is None else watch if isinstance(watch, Watchers) else Watchers(watch)
    produced: dict[int, Any] = {}
    walk = _Walk(plan, watchers, keys=piece.keys, produced=produced)
    output = walk.run(piece.value)
    return _outcome(output, produced, microseconds(time.perf_counter_ns() - started))


def lone_step(steps: tuple[Step, ...], shape: Any) -> Step | None:
    """The one step of a piece whose plan is that step alone, from its input to its output
    (most pieces a worker runs); None for any other. Its plan is compiled once per shape,
    as for :func:`run_piece`."""
    if len(steps) != 1:
        return None
    plan = piece_plan(steps, shape)
    ops = plan.ops
    if len(ops) != 1:
        return None
    op = ops[0]
    if type(op) is not Run or op.source != 0 or op.target != plan.output or op.opens or op.closes is not None:
        return None
    return plan.steps[op.step]


def run_lone(step: Step, value: Any) -> Any:
    """What :func:`run_piece` does for a piece of ``step`` alone (:func:`lone_step`), nobody
    watching and nothing to keep: its output, or ``NodeFailed`` naming it, as the walk
    raises it. No walk, no piece, no outcome is built."""
    try:
        if step.device is not None:
            value = _place(value, step.device)
        return step.node.forward(value)
    except Exception as exc:
        raise _node_failed(step, exc, None) from exc


def _node_failed(step: Step, exc: Exception, host: str | None) -> NodeFailed:
    """What a walk raises when ``step`` raised ``exc`` (on ``host``, run in this process)."""
    if host is None:
        return NodeFailed(
            f"node `{step.label}` raised {type(exc).__name__}: {exc}",
            node=step.label,
            error=type(exc).__name__,
            remote_traceback=None,
        )
    return NodeFailed(
        f"node `{step.label}` on `{host}` raised {type(exc).__name__}: {exc}",
        node=step.label,
        error=type(exc).__name__,
        host=host,
    )


# -- the walk ----------------------------------------------------------------------------


class _Walk:
    def __init__(
        self,
        plan: Plan,
        watch: Watchers,
        *,
        keys: dict[int, str],
        store: Any = None,
        broker: Any = None,
        recalled: dict[int, Any] | None = None,
        produced: dict[int, Any] | None = None,
        deadline: Deadline | None = None,
        claims: Claims | None = None,
        waited: dict[int, int] | None = None,
    ) -> None:
        self.plan = plan
        self.claims = claims  # the missing entries this forward computes, claimed (`computing`)
        self.waited = waited or {}  # recalled after waiting for another forward: how long (us)
        self.deadline = deadline
        self.watch = watch
        self.watching = watch is not _NOBODY and bool(watch)  # asked once: every node asks
        self.keys = keys
        self.store = store
        self.broker = broker
        self.recalled = recalled or {}
        # when set, cached outputs are collected here instead of kept in a store
        self.produced = produced
        # groups run in this process: when each started, and cached outputs held till it closes
        self._entered: dict[int, int] = {}
        self._held: dict[int, Any] = {}

    @classmethod
    def prepare(
        cls,
        graph: Graph,
        x: Any,
        *,
        broker: Any,
        store: Any,
        watch: Watchers,
        deadline: Deadline | None = None,
        here: frozenset[str] | None = None,
    ) -> _Walk:
        steps = graph.steps
        if here is None:
            here = _here(broker, graph)
        if store is None or not _caches(graph):
            # nothing can be recalled: the plan is the graph's, the same every forward
            return cls(_plan_of(graph, here), watch, keys={}, store=store, broker=broker, deadline=deadline)
        try:
            keys = keys_for(graph, _keys.value_key(x))
        except CodecError as exc:
            _say(
                f"the input of this forward cannot be written down, so nothing is "
                f"recalled or kept: {type(exc).__name__}: {exc}"
            )
            keys = {}
        recalled: dict[int, Any] = {}
        missed: dict[int, str] = {}

        def recall(index: int, key: str) -> bool:
            if index in recalled:
                return True
            found = _recall(store, key, steps[index])
            if found is _NOTHING:
                missed[index] = key
                return False
            recalled[index] = found
            return True

        if not keys:
            return cls(_plan_of(graph, here), watch, keys=keys, store=store, broker=broker, deadline=deadline)
        shape = prune(graph.shape, steps, keys, recall)
        waited: dict[int, int]
        claims, waited = None, {}
        if missed and claiming(store):
            # one forward computes a missing entry, the others wait for it (`computing`)
            claims = Claims(store)
            until = waits_end(None if deadline is None else deadline.left())  # one end for every wait
            order = depths(graph.shape)
            while claim(claims, missed, order, lambda i: steps[i].label, recall, until, waited):
                missed.clear()
                shape = prune(graph.shape, steps, keys, recall)
                claims.release_all(keep=missed.values())
        plan = compile(steps, group(shape, steps), recalled_keys=keys, here=here)
        return cls(
            plan,
            watch,
            keys=keys,
            store=store,
            broker=broker,
            recalled=recalled,
            deadline=deadline,
            claims=claims,
            waited=waited,
        )

    # -- scheduling --------------------------------------------------------------------
    def run(self, x: Any) -> Any:
        plan = self.plan
        ops = plan.ops
        output = plan.output
        if (
            len(ops) == 1
            and self.deadline is None
            and type(ops[0]) in (Run, Remote)
            and ops[0].source == 0  # type: ignore[union-attr]  # a Run or a Remote, as the line above says
            and ops[0].target == output
        ):
            # one node, or one trip to a host (most pieces, most calls): nothing to wire or wait for
            return self._remote(ops[0], x) if type(ops[0]) is Remote else self._run(ops[0], x)  # type: ignore[arg-type]  # else a Run
        wiring = wiring_of(plan)
        sources_of, consumers = wiring.sources, wiring.consumers
        values: dict[int, Any] = {0: x}
        waiting = list(wiring.waiting)
        uses = dict(wiring.uses)
        ready = list(wiring.ready)

        finished: queue.SimpleQueue | None = None
        in_flight = 0
        failure: BaseException | None = None

        def settle(index: int, result: Any) -> None:
            values[ops[index].target] = result
            for source in sources_of[index]:
                uses[source] -= 1
                if uses[source] == 0 and source != output:
                    values.pop(source, None)  # let big intermediates go as soon as they can
            for consumer in consumers.get(ops[index].target, ()):
                waiting[consumer] -= 1
                if waiting[consumer] == 0:
                    ready.append(consumer)

        while ready or in_flight:
            if failure is None and ready and self.deadline is not None and self.deadline.left() < 0:
                failure = self._overdue([ops[i] for i in ready])  # None: nothing local to start
            if failure is None and ready:
                if len(ready) == 1 and in_flight == 0:
                    index = ready.pop()
                    try:
                        result = self._do(ops[index], inputs_of(ops[index], values))
                    except BaseException as exc:
                        failure = exc
                    else:
                        settle(index, result)
                    continue
                pool = _shared_pool()
                carried = _carried()
                if finished is None:
                    finished = queue.SimpleQueue()
                while ready:
                    index = ready.pop(0)
                    pool.submit(self._async, finished, index, ops[index], inputs_of(ops[index], values), carried)
                    in_flight += 1
            if failure is not None:
                ready.clear()  # start nothing new; wait for what is running
                if not in_flight:
                    break
            assert finished is not None  # something is in flight: it was made
            index, ok, result = finished.get()
            in_flight -= 1
            if not ok:
                failure = failure or result
            elif failure is None:
                settle(index, result)
        if failure is not None:
            try:
                raise failure
            finally:  # its traceback holds this frame: held here too, a cycle would keep the inputs
                failure = result = None
        return values[output]

    def _overdue(self, ops: list[Any]) -> Overdue | None:
        """The deadline passed between operations: an ``Overdue`` naming the local nodes
        that would start next (remote ones are the broker's to refuse, naming their host)."""
        labels = [f"`{self.plan.steps[op.step].label}`" for op in ops if isinstance(op, Run)]
        deadline = self.deadline
        if not labels or deadline is None:
            return None
        late = deadline.seconds - deadline.left()
        return Overdue(
            f"this forward ran past {deadline} ({late:.1f} s had passed) before {', '.join(labels)} could "
            f"start in this process, so it stopped there; a node running in this process cannot "
            f"be interrupted, so the deadline is checked between them. Give it a longer deadline, "
            f"or put the slow node on a worker with .at(host), where a deadline bounds the wait"
        )

    def _async(self, finished: queue.SimpleQueue, index: int, op: Any, value: Any, carried: Any) -> None:
        try:
            with _within(carried):
                result = self._do(op, value)
            finished.put((index, True, result))
        except BaseException as exc:
            finished.put((index, False, exc))

    # -- the operations ----------------------------------------------------------------
    def _do(self, op: Any, value: Any) -> Any:
        if isinstance(op, Run):
            return self._run(op, value)
        if isinstance(op, Join):
            if op.closes is not None and (self.watching or self._held):
                self._close_group(op.closes)
            return value
        if isinstance(op, Recall):
            step = self.plan.steps[op.step]
            if op.step in self.waited:  # another forward computed it meanwhile; we waited for it
                self.watch(fact("recalled", node=step.label, key=op.key, waited_us=self.waited[op.step]))
            else:
                self.watch(fact("recalled", node=step.label, key=op.key))
            return self.recalled[op.step]
        return self._remote(op, value)

    def _run(self, op: Run, value: Any) -> Any:
        step = self.plan.steps[op.step]
        started = time.perf_counter_ns()
        if op.opens and self.watching:  # a group of a host run in this process starts: timed for `left`
            self._entered.setdefault(op.opens, started)
        try:
            if step.device is not None:
                value = _place(value, step.device)
            output = step.node.forward(value)
        except Exception as exc:
            failed = fact("failed", node=step.label, error=f"{type(exc).__name__}: {exc}")
            self.watch(failed if op.host is None else elsewhere(failed, op.host))
            raise _node_failed(step, exc, op.host) from exc
        took = microseconds(time.perf_counter_ns() - started)
        if self.watching:  # nobody watching: nothing is counted, nothing said
            ran = fact("ran", node=step.label, took_us=took, items=_items(output))
            self.watch(ran if op.host is None else elsewhere(ran, op.host))
        if step.cache and op.step in self.keys:
            if self.produced is not None:
                self.produced[op.step] = output
            elif op.host is not None:
                self._held[op.step] = output  # kept once the group closes, after `left`
            else:
                self._keep(step, self.keys[op.step], output)
        if op.closes is not None and (self.watching or self._held):  # nothing to say or keep: nothing to do
            self._close_group(op.closes)
        return output

    def _close_group(self, closes: Closes) -> None:
        """A group run in this process has given its output: say ``left`` as a trip to its
        host would, then keep what its cached steps produced."""
        entered = self._entered.pop(closes.group, None)
        if self.watching:
            took = 0 if entered is None else microseconds(time.perf_counter_ns() - entered)
            self.watch(fact("left", host=closes.host, took_us=took, worked_us=took))
        if self._held:
            for index in closes.steps:
                if index in self._held:
                    self._keep(self.plan.steps[index], self.keys[index], self._held.pop(index))

    def _remote(self, op: Remote, value: Any) -> Any:
        indices = op.step_indices
        steps = self.plan.steps
        piece = _piece(
            op.host,
            _steps_of(self.plan, op),
            op.local_shape,
            value,
            {new: self.keys[i] for new, i in enumerate(indices) if i in self.keys and steps[i].cache}
            if self.keys
            else {},
            self.deadline,
            _memo_of(op),
        )
        host = op.host
        started = time.perf_counter_ns()
        # with nobody watching, say so: a worker then sends no facts back at all
        watch = (lambda f: self.watch(elsewhere(f, host))) if self.watching else None
        outcome = self.broker.run(piece, watch)
        if watch is not None:
            self.watch(
                fact(
                    "left",
                    host=outcome.member or host,
                    took_us=microseconds(time.perf_counter_ns() - started),
                    worked_us=outcome.took_us,
                )
            )
        for number, produced in outcome.produced.items():
            if number in piece.keys:  # the carrier took only what was asked (`Piece.keys`)
                self._keep(piece.steps[number], piece.keys[number], produced)
        return outcome.output

    def _keep(self, step: Step, key: str, value: Any) -> None:
        if self.store is None:
            return
        try:
            parts = written_parts(value)
        except CodecError as exc:
            _say_once(
                (step.label, type(value)),
                f"what `{step.label}` produced could not be kept: {type(exc).__name__}: {exc}",
            )
            return
        try:
            self.store.put(_keys.cache_name(key), {"node": step.label, "type": type(value).__name__}, parts)
        except Blocked as exc:  # a name held by something no store writes: once, not every forward
            _say_once(("blocked", exc.where), f"what `{step.label}` produced could not be kept: {exc}")
            return
        except (OSError, SomatizeError) as exc:
            _say(f"what `{step.label}` produced could not be kept: the store refused it: {type(exc).__name__}: {exc}")
            return
        self.watch(fact("kept", node=step.label, key=key))
        if self.claims is not None:
            self.claims.release(key)  # kept: who waits for it reads it now


# -- helpers -----------------------------------------------------------------------------

_NOTHING = object()
# what the codec reads back for a type it writes as another (all bytes-likes as bytes)
_READ_BACK_AS = {"bytearray": "bytes", "memoryview": "bytes"}


def _recall(store: Any, key: str, step: Step) -> Any:
    """What was kept under ``key``, or ``_NOTHING``: a miss, a store that cannot read it,
    or an entry whose value is not of the kind its record says was kept (then one line on
    stderr), all of which make the node run."""
    name = _keys.cache_name(key)
    record: Any = None
    try:
        if isinstance(store, FolderStore):  # the codec looks at the blob's start before it is read
            record, blob = store.entry(name, admit=check_start)
        elif (entry := getattr(store, "entry", None)) is not None:  # record and blob from one read
            record, blob = entry(name)
        else:
            blob = store.fetch(name)
        if blob is not None:
            found = loads(blob)
    except Missing:
        return _NOTHING
    except CodecError as exc:
        _say(f"what was kept for `{step.label}` as {name} cannot be read back, so it runs: {type(exc).__name__}: {exc}")
        return _NOTHING
    except (OSError, SomatizeError) as exc:
        _say(f"`{step.label}` could not be recalled from {name}, so it runs: {type(exc).__name__}: {exc}")
        return _NOTHING
    if blob is None:
        return _NOTHING
    if record is not None:
        expected, kind = record.get("type"), type(found).__name__
        if _READ_BACK_AS.get(expected, expected) != kind:
            _say(
                f"what was kept for `{step.label}` as {name} is a `{kind}` and its record says "
                f"a `{expected}` was kept, so it is not used and `{step.label}` runs again"
            )
            return _NOTHING
    return found


def _seconds(deadline: Any) -> float:
    if isinstance(deadline, bool) or not isinstance(deadline, (int, float)):
        raise TypeError(
            f"`deadline=` takes seconds as a number, like `deadline=30`; it was given a `{type(deadline).__name__}`"
        )
    if not 0 < deadline < float("inf"):
        raise ValueError(f"`deadline=` takes a positive, finite number of seconds; it was given {deadline!r}")
    return float(deadline)


#: The watchers of a forward nobody watches (empty watchers hold no state that changes).
_NOBODY = Watchers()


def _describe(exc: BaseException) -> str:
    if isinstance(exc, NodeFailed):
        return str(exc.args[0]) if exc.args else type(exc).__name__
    return f"{type(exc).__name__}: {exc}"


def _say(line: str) -> None:
    print(f"somatize: {line}", file=sys.stderr, flush=True)


_said: set[Any] = set()
_said_lock = threading.Lock()


def _say_once(what: Any, line: str) -> None:
    with _said_lock:
        if what in _said:
            return
        _said.add(what)
    _say(line)


def format_exception(exc: BaseException) -> str:
    """Traceback text, the form remote failures travel in (never a pickled exception)."""
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
