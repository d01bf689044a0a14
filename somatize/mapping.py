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
import itertools
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

_submitting: concurrent.futures.ThreadPoolExecutor | None = None
_submitting_lock = threading.Lock()


def submit(graph: Any, x: Any, *, broker: Any = None, store: Any = None, watching: Any = None,
           deadline: float | None = None, retries: int = 1) -> concurrent.futures.Future:
    """``graph.forward(x, ...)`` on a thread of its own; its ``Future``. A lost input runs
    again up to ``retries`` times, as in :func:`map`."""
    retries = _retries(retries)
    global _submitting
    with _submitting_lock:
        if _submitting is None:
            _submitting = concurrent.futures.ThreadPoolExecutor(SUBMITTING, thread_name_prefix="somatize-submit")
        pool = _submitting
    return pool.submit(_forward, graph, x, None, broker, store, watching, deadline, retries)


def map(graph: Any, inputs: Iterable[Any], *, broker: Any = None, store: Any = None, watching: Any = None,
        deadline: float | None = None, ordered: bool = True, errors: str = "raise", retries: int = 1,
        in_flight: int | None = None, progress: Any = False) -> Iterator[Any]:
    """The outputs of ``graph`` for each of ``inputs``; see the module. ``deadline`` is per
    input. ``in_flight`` bounds how many forwards run at once (by default: the members of
    the largest pool the graph names, at most :data:`IN_FLIGHT_MOST`; 1 without a pool).
    ``progress=True`` shows a tqdm bar (done, failed, rate); a tqdm bar may be passed instead."""
    if errors not in ("raise", "return"):
        raise ValueError(f"`errors=` is 'raise' (the first failure is raised in its turn) or 'return' "
                         f"(each failure is yielded in its place); got {errors!r}")
    retries = _retries(retries)
    width = _in_flight(graph, broker) if in_flight is None else _width(in_flight)
    if ordered is not True and ordered is not False:
        raise TypeError(f"`ordered=` is True or False; got {ordered!r}")
    return _Mapping(graph, iter(inputs), width, broker, store, watching, deadline, ordered, errors, retries,
                    _bar(progress))


class _Mapping:
    """The iterator ``map`` returns: a window of ``width`` forwards, refilled as they end."""

    def __init__(self, graph: Any, inputs: Iterator[Any], width: int, broker: Any, store: Any, watching: Any,
                 deadline: float | None, ordered: bool, errors: str, retries: int, bar: Any) -> None:
        self._graph, self._inputs, self._width = graph, inputs, width
        self._args = (broker, store, watching, deadline, retries)
        self._ordered, self._errors, self._bar = ordered, errors, bar
        self._pool = concurrent.futures.ThreadPoolExecutor(width, thread_name_prefix="somatize-map")
        self._window: collections.deque[tuple[int, concurrent.futures.Future]] = collections.deque()
        self._pending: set[concurrent.futures.Future] = set()
        self._count = itertools.count()
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
            if self._ordered:
                if not self._window:
                    self._end()
                index, future = self._window.popleft()
                self._pending.discard(future)
                exc = future.exception()
                value = future.result() if exc is None else exc
            else:
                if not self._pending:
                    self._end()
                done, _ = concurrent.futures.wait(self._pending, return_when=concurrent.futures.FIRST_COMPLETED)
                future = min(done, key=lambda f: f.index)  # type: ignore[attr-defined]
                self._pending.discard(future)
                index = future.index  # type: ignore[attr-defined]
                exc = future.exception()
                value = future.result() if exc is None else exc
            self._tick(exc is not None)
            self._fill()
        except BaseException:
            self.close()
            raise
        if exc is not None and self._errors == "raise":
            self.close()
            raise exc
        return value if self._ordered else (index, value)

    def _end(self) -> None:
        """Every output is given: stop, or raise what the inputs raised while they were taken."""
        broke, self._broke = self._broke, None
        if broke is not None:
            raise broke
        raise StopIteration

    def close(self) -> None:
        """Hand out nothing more; what has not started is cancelled (what runs, runs out)."""
        if self._closed:
            return
        self._closed = True
        for future in self._pending:
            future.cancel()
        self._pending.clear()
        self._window.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._bar is not None:
            self._bar.close()

    def __del__(self) -> None:
        self.close()

    def _fill(self) -> None:
        while not self._exhausted and not self._closed and len(self._pending) < self._width:
            try:
                x = next(self._inputs)
            except StopIteration:
                self._exhausted = True
                return
            except Exception as exc:  # the inputs broke: what was handed out is answered first
                self._exhausted = True
                self._broke = exc
                return
            index = next(self._count)
            future = self._pool.submit(_forward, self._graph, x, index, *self._args)
            future.index = index  # type: ignore[attr-defined]
            self._pending.add(future)
            if self._ordered:
                self._window.append((index, future))

    def _tick(self, failed: bool) -> None:
        if self._bar is None:
            return
        self._failed += failed
        self._bar.update(1)
        self._bar.set_postfix(running=len(self._pending), failed=self._failed, refresh=False)


def _forward(graph: Any, x: Any, index: int | None, broker: Any, store: Any, watching: Any,
             deadline: float | None, retries: int) -> Any:
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
        raise TypeError(f"`in_flight=` takes how many forwards may run at once, a whole number from 1; got {in_flight!r}")
    return in_flight


def _retries(retries: object) -> int:
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise TypeError(f"`retries=` takes how many times a lost input may run again, a whole number from 0; "
                        f"got {retries!r}")
    return retries


def _bar(progress: Any) -> Any:
    if progress is False or progress is None:
        return None
    if progress is True:
        try:
            from tqdm import tqdm
        except ImportError:
            print("somatize map: progress=True needs tqdm (pip install tqdm); mapping without a bar",
                  file=sys.stderr)
            return None
        return tqdm(unit="input")
    if not all(hasattr(progress, name) for name in ("update", "set_postfix", "close")):
        raise TypeError("`progress=` is True (a tqdm bar) or a tqdm bar to update")
    return progress
