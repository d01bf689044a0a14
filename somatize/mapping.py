"""Many inputs through one graph: ``Graph.submit`` and ``Graph.map``.

``submit(x)`` is one forward on a thread of its own, as a ``concurrent.futures.Future``.
``map(inputs)`` runs the graph once per input with a bounded number in flight: by default
as many as the pools the graph names have members (``Worker.spawn(..., processes=4)``, or
workers that dialed in as ``gpu#0``, ``gpu#1``...), so each member has one piece and none
waits behind another. It takes ``inputs`` lazily (an endless generator is fine) and yields
outputs in input order (``ordered=False``: ``(index, output)`` as each finishes), with the
semantics of ``concurrent.futures.Executor.map``: a forward's exception is raised when its
turn comes (``errors="return"`` yields it in its place instead), and closing the iterator
early hands out nothing more and cancels what has not started.

An input whose worker was lost (``Broken``, ``Unreachable``) or turned away by someone
else's work (``Busy``) runs again, up to ``retries`` times (1 by default: a lost input may
have run in part, so ``retries=0`` is for work that must never run twice). A ``NodeFailed``
is the node's own answer, and an ``Overdue`` its deadline: neither is run again. A spawned
member that died is started again by the next forward sent to it. An input that cannot be
written down is ``Unwritable``, naming its index.

Each fact of a mapped forward carries ``item`` (its input's index, as text), so a watcher
tells interleaved forwards apart; a ``Recorder`` keeps one record per input's forward.

No coordinator: this process hands out the inputs and the client picks the member
(``fabric.client.handle``); nothing here knows of sockets.
"""

from __future__ import annotations

import collections
import concurrent.futures
import sys
import threading
from collections.abc import Iterable, Iterator
from typing import Any

from .errors import Broken, Busy, Unreachable, Unwritable

#: What a lost input is run again for: the work may not have run, or ran where its answer
#: was lost. Everything else (the node's exception, a deadline, a closed client) is final.
LOST = (Broken, Unreachable, Busy)
#: How many forwards ``submit`` runs at once, per process, before the next waits for a thread.
SUBMITTING = 64
#: The most forwards ``map`` keeps in flight unless told (``in_flight=``): a thread and a
#: channel each, so a pool of 1,000 dialed members is not 1,000 threads of this process.
IN_FLIGHT_MOST = 256
#: How long a map's runner thread waits for its next input before it ends (a map whose
#: consumer went away lets go of its threads; a busy one hands each runner the next at once).
IDLE = 0.5

_submitting: concurrent.futures.ThreadPoolExecutor | None = None
_submitting_lock = threading.Lock()


def submit(
    graph: Any,
    x: Any,
    *,
    broker: Any = None,
    store: Any = None,
    watching: Any = None,
    deadline: float | None = None,
    retries: int = 1,
) -> concurrent.futures.Future:
    """``graph.forward(x, ...)`` on a thread of its own; its ``Future``. A lost input runs
    again up to ``retries`` times, as in :func:`map`."""
    retries = _retries(retries)
    global _submitting
    with _submitting_lock:
        if _submitting is None:
            _submitting = concurrent.futures.ThreadPoolExecutor(SUBMITTING, thread_name_prefix="somatize-submit")
        pool = _submitting
    return pool.submit(_forward, graph, x, None, broker, store, watching, deadline, retries)


def map(
    graph: Any,
    inputs: Iterable[Any],
    *,
    broker: Any = None,
    store: Any = None,
    watching: Any = None,
    deadline: float | None = None,
    ordered: bool = True,
    errors: str = "raise",
    retries: int = 1,
    in_flight: int | None = None,
    progress: Any = False,
) -> Iterator[Any]:
    """The outputs of ``graph`` for each of ``inputs``; see the module. ``deadline`` is per
    input. ``in_flight`` bounds how many forwards run at once (by default: the members of
    the largest pool the graph names, at most :data:`IN_FLIGHT_MOST`; 1 without a pool);
    at most twice that many inputs are taken and not yet handed out.
    ``progress=True`` shows a tqdm bar (done, failed, rate); a tqdm bar may be passed instead."""
    if errors not in ("raise", "return"):
        raise ValueError(
            f"`errors=` is 'raise' (the first failure is raised in its turn) or 'return' "
            f"(each failure is yielded in its place); got {errors!r}"
        )
    retries = _retries(retries)
    width = _in_flight(graph, broker) if in_flight is None else _width(in_flight)
    if ordered is not True and ordered is not False:
        raise TypeError(f"`ordered=` is True or False; got {ordered!r}")
    return _Mapping(
        graph, iter(inputs), width, broker, store, watching, deadline, ordered, errors, retries, _bar(progress)
    )


class _Mapping:
    """The iterator ``map`` returns. Up to ``width`` runner threads each take the next input
    this iterator took, run its forward and file the answer, until none is waiting; the
    iterator takes inputs (in the thread that iterates, as ``Executor.map`` does) while
    fewer than ``2 * width`` are taken and not handed out, so a runner finds the next input
    waiting when it ends one, and memory stays bounded whatever the consumer's pace. The
    iterating thread is woken only when the answer it waits for is filed; a map dropped
    unfinished runs out what it took, and its runners end :data:`IDLE` later."""

    def __init__(
        self,
        graph: Any,
        inputs: Iterator[Any],
        width: int,
        broker: Any,
        store: Any,
        watching: Any,
        deadline: float | None,
        ordered: bool,
        errors: str,
        retries: int,
        bar: Any,
    ) -> None:
        self._graph, self._inputs, self._width = graph, inputs, width
        self._args = (broker, store, watching, deadline, retries)
        self._ordered, self._errors, self._bar = ordered, errors, bar
        self._window = 2 * width  # inputs taken and not yet handed out, at most
        lock = threading.Lock()
        self._work = threading.Condition(lock)  # guards the state below
        self._filed = threading.Condition(lock)  # the iterating thread waits here for an answer
        self._todo: collections.deque[tuple[int, Any]] = collections.deque()
        self._answers: dict[int, tuple[BaseException | None, Any]] = {}  # index -> (error, value)
        self._finished: collections.deque[int] = collections.deque()  # indexes, as they finish
        self._runners = 0  # runner threads alive
        self._idle = 0  # of them, those waiting for an input
        self._running = 0
        self._taken = 0  # inputs taken from `inputs`
        self._given = 0  # answers handed out
        self._waiting = False  # the iterating thread waits on `_filed`
        self._exhausted = False
        self._closed = False
        self._failed = 0
        self._broke: BaseException | None = None  # what `inputs` raised: raised after what came before it
        self._fill()

    def __iter__(self) -> _Mapping:
        return self

    def __next__(self) -> Any:
        if self._closed:
            raise StopIteration
        try:
            index, exc, value = self._next_answer()
            self._tick(exc is not None)
            self._fill()
        except BaseException:
            self.close()
            raise
        if exc is not None:
            if self._errors == "raise":
                self.close()
                raise exc
            value = exc
        return value if self._ordered else (index, value)

    def _next_answer(self) -> tuple[int, BaseException | None, Any]:
        with self._filed:
            while True:
                if self._ordered:
                    index = self._given
                    if index in self._answers:
                        break
                elif self._finished:
                    index = self._finished.popleft()
                    break
                if self._given == self._taken:  # nothing out: every answer was given
                    self._end()
                self._waiting = True
                try:  # woken when its answer is filed; the timeout only bounds a wake-up missed
                    self._filed.wait(IDLE * 4)
                finally:
                    self._waiting = False
            exc, value = self._answers.pop(index)
            self._given += 1
            return index, exc, value

    def _end(self) -> None:
        """Every output is given: stop, or raise what the inputs raised while they were taken."""
        broke, self._broke = self._broke, None
        if broke is not None:
            raise broke
        raise StopIteration

    def close(self) -> None:
        """Hand out nothing more; what has not started is dropped (what runs, runs out)."""
        with self._work:
            if self._closed:
                return
            self._closed = True
            self._todo.clear()
            self._answers.clear()
            self._work.notify_all()
        if self._bar is not None:
            self._bar.close()

    def __del__(self) -> None:
        if hasattr(self, "_closed"):
            self.close()

    def _fill(self) -> None:
        """Take inputs (in this thread) while the window has room, and hand them to runners."""
        while not self._exhausted and not self._closed and self._taken - self._given < self._window:
            try:
                x = next(self._inputs)
            except StopIteration:
                self._dry()
                return
            except Exception as exc:  # the inputs broke: what was handed out is answered first
                self._broke = exc
                self._dry()
                return
            with self._work:
                if self._closed:
                    return
                self._todo.append((self._taken, x))
                self._taken += 1
                start = not self._idle and self._runners < self._width
                if start:
                    self._runners += 1
                elif self._idle:
                    self._work.notify()
            if start:  # a runner of its own for each input up to `width`; they end when none is left
                threading.Thread(target=self._run, daemon=True, name="somatize-map").start()

    def _dry(self) -> None:
        """No input is left: the runners waiting for one end now."""
        with self._work:
            self._exhausted = True
            self._work.notify_all()

    def _run(self) -> None:
        """A runner: the next input's forward, its answer filed, until the map closes or runs dry."""
        graph, args = self._graph, self._args
        while True:
            with self._work:
                if not self._todo and not self._closed and not self._exhausted:
                    self._idle += 1
                    self._work.wait(IDLE)
                    self._idle -= 1
                if self._closed or not self._todo:  # nothing came: this runner ends (`_fill` starts another)
                    self._runners -= 1
                    return
                index, x = self._todo.popleft()
                self._running += 1
            try:
                answer: tuple[BaseException | None, Any] = (None, _forward(graph, x, index, *args))
            except BaseException as exc:
                answer = (exc, None)
            with self._work:
                self._running -= 1
                if self._closed:
                    self._runners -= 1
                    return
                self._answers[index] = answer
                if not self._ordered:
                    self._finished.append(index)
                if self._waiting and (not self._ordered or index == self._given):
                    self._filed.notify()

    def _tick(self, failed: bool) -> None:
        if self._bar is None:
            return
        self._failed += failed
        self._bar.update(1)
        self._bar.set_postfix(running=self._running, failed=self._failed, refresh=False)


def _forward(
    graph: Any, x: Any, index: int | None, broker: Any, store: Any, watching: Any, deadline: float | None, retries: int
) -> Any:
    watchers = watching if index is None or watching is None else _tagged(watching, str(index))
    for attempt in range(retries + 1):
        try:
            return graph.forward(x, broker=broker, store=store, watching=watchers, deadline=deadline)
        except LOST:
            if attempt == retries:
                raise
        except Unwritable as exc:  # nothing left: the input (or what it became) cannot be sent
            if index is None:
                raise
            raise Unwritable(f"input {index} of the map: {exc}") from exc
    raise AssertionError("unreachable")  # pragma: no cover


class _Tagged:
    """A watcher told each fact with ``item`` added; a ``Recorder``'s per-forward watcher too."""

    __slots__ = ("_item", "_watcher")

    def __init__(self, watcher: Any, item: str) -> None:
        self._watcher, self._item = watcher, item

    def __call__(self, fact: Any) -> None:
        self._watcher({**fact, "item": self._item})

    def for_forward(self) -> _Tagged:
        inner = self._watcher.for_forward() if hasattr(self._watcher, "for_forward") else self._watcher
        return _Tagged(inner, self._item)


def _tagged(watching: Any, item: str) -> Any:
    from .facts import Watchers

    return [_Tagged(w, item) for w in Watchers(watching)]  # refuses what is no watcher, as forward does


def _in_flight(graph: Any, broker: Any) -> int:
    from .graph import as_graph

    hosts = {step.host for step in as_graph(graph).steps if step.host is not None}
    if broker is None or not hosts or not hasattr(broker, "members"):
        return 1
    return min(IN_FLIGHT_MOST, max([1, *(len(broker.members(host)) for host in hosts)]))


def _width(in_flight: object) -> int:
    if isinstance(in_flight, bool) or not isinstance(in_flight, int) or in_flight < 1:
        raise TypeError(
            f"`in_flight=` takes how many forwards may run at once, a whole number from 1; got {in_flight!r}"
        )
    return in_flight


def _retries(retries: object) -> int:
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise TypeError(
            f"`retries=` takes how many times a lost input may run again, a whole number from 0; got {retries!r}"
        )
    return retries


def _bar(progress: Any) -> Any:
    if progress is False or progress is None:
        return None
    if progress is True:
        try:
            from tqdm import tqdm
        except ImportError:
            print("somatize map: progress=True needs tqdm (pip install tqdm); mapping without a bar", file=sys.stderr)
            return None
        return tqdm(unit="input")
    if not all(hasattr(progress, name) for name in ("update", "set_postfix", "close")):
        raise TypeError("`progress=` is True (a tqdm bar) or a tqdm bar to update")
    return progress
