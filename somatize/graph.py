"""Nodes, their declarations, and how they compose.

A :class:`Node` is a user's class with a ``forward(self, x)``. The suffixes ``.named()``,
``.at()``, ``.on()``, ``.cached()`` and ``.frozen()`` return a :class:`Step`: a declaration
*about* the node that changes no forward and never copies it (the step holds the very
same object, weights and all). ``a >> b`` chains, ``a & b`` feeds one input to both and
yields the tuple ``(a(x), b(x))``. Every composition is a :class:`Graph` and can be run
with :meth:`Graph.forward`; a lone declared node runs as a one-node graph.

This module only describes; :mod:`somatize.plan` checks and orders, and
:mod:`somatize.engine` runs.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, cast

from .code_identity import code_digest, noted

if TYPE_CHECKING:  # pragma: no cover
    from .facts import Watcher
    from .store import Store

# The shape of a graph, with steps replaced by their position in ``Graph.steps``:
#   ("step", i) | ("seq", (shape, ...)) | ("par", (shape, ...))
Shape = tuple


class Node:
    """Subclass this and define ``forward(self, x)``.

    The arguments a node was constructed with are remembered (they are part of its
    identity for the cache, and they are how a project-mode worker rebuilds it). So are
    the lines of the file its class was written in, as they were when the class was made
    (its code is part of its identity too: see :attr:`Step.identity`).
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        noted(cls)

    def __new__(cls, *args: Any, **kwargs: Any):
        self = super().__new__(cls)
        # object.__setattr__: works even when a subclass (torch.nn.Module) guards setattr
        object.__setattr__(self, "_somatize_args", (args, kwargs))
        return self

    def forward(self, x: Any) -> Any:
        raise NotImplementedError(f"`{type(self).__name__}` has no `forward(self, x)`: define one in the subclass")

    # -- suffixes: each returns a declaration about this very node -------------------
    def named(self, name: str) -> Step:
        return Step(self).named(name)

    def at(self, host: str) -> Step:
        return Step(self).at(host)

    def on(self, device: str) -> Step:
        return Step(self).on(device)

    def cached(self, *, version: str | None = None) -> Step:
        return Step(self).cached(version=version)

    def frozen(self) -> Step:
        return Step(self).frozen()

    def __rshift__(self, other: Composable) -> Sequence:
        return Step(self) >> other

    def __rrshift__(self, other: Composable) -> Sequence:
        return as_graph(other) >> Step(self)

    def __and__(self, other: Composable) -> Parallel:
        return Step(self) & other

    def __rand__(self, other: Composable) -> Parallel:
        return as_graph(other) & Step(self)


class Graph:
    """Something that can be run: a declared step, a sequence or a parallel."""

    def __rshift__(self, other: Composable) -> Sequence:
        return Sequence(_flatten(Sequence, (self, as_graph(other))))

    def __rrshift__(self, other: Composable) -> Sequence:
        return Sequence(_flatten(Sequence, (as_graph(other), self)))

    def __and__(self, other: Composable) -> Parallel:
        # only the left side is flattened: `a & b & c` yields a 3-tuple, while an
        # explicit `a & (b & c)` keeps its nesting and yields (a(x), (b(x), c(x)))
        left = self.parts if type(self) is Parallel else (self,)
        return Parallel((*left, as_graph(other)))

    def __rand__(self, other: Composable) -> Parallel:
        return as_graph(other) & self

    def forward(
        self,
        x: Any,
        *,
        broker: Any = None,
        store: Store | None = None,
        watching: Watcher | list[Watcher] | None = None,
        deadline: float | None = None,
    ) -> Any:
        """Run the graph on ``x`` and return its output.

        ``broker`` resolves the hosts named with ``.at()``; ``store`` keeps and recalls
        what ``.cached()`` nodes produce; ``watching`` is a callable (or a list of them)
        told every fact as it happens. Everything that can be checked is checked before
        any node runs.

        ``deadline`` is in seconds from this call: past it the forward raises ``Overdue``
        naming the nodes, the host and the time, and a spawned worker still stuck in them is
        started afresh on the next forward. It bounds every wait for a worker; a node
        running in this process cannot be interrupted (Python cannot stop a thread safely),
        so there it is checked before each node starts.
        """
        return _engine().forward(self, x, broker=broker, store=store, watching=watching, deadline=deadline)

    def submit(
        self,
        x: Any,
        *,
        broker: Any = None,
        store: Store | None = None,
        watching: Watcher | list[Watcher] | None = None,
        deadline: float | None = None,
        retries: int = 1,
    ) -> Any:
        """:meth:`forward` on a thread of its own: a ``concurrent.futures.Future`` of its
        output. An input whose worker was lost runs again up to ``retries`` times (see
        :meth:`map`)."""
        from . import mapping

        return mapping.submit(
            self, x, broker=broker, store=store, watching=watching, deadline=deadline, retries=retries
        )

    def map(
        self,
        inputs: Any,
        *,
        broker: Any = None,
        store: Store | None = None,
        watching: Watcher | list[Watcher] | None = None,
        deadline: float | None = None,
        ordered: bool = True,
        errors: str = "raise",
        retries: int = 1,
        in_flight: int | None = None,
        progress: Any = False,
    ) -> Any:
        """Run the graph once per input, over every member of the pools it names, and
        yield the outputs in input order (``ordered=False``: ``(index, output)`` as each
        finishes). ``inputs`` is taken lazily, with ``in_flight`` forwards running at once
        (by default, the members of the largest pool the graph names). As
        ``Executor.map``: a forward's exception is raised when its turn comes
        (``errors="return"``: yielded in its place), and closing the iterator cancels what
        has not started. An input whose worker is lost (``Broken``, ``Unreachable``) or
        turned away ``Busy`` runs again, up to ``retries`` times (a lost input may have run
        in part: ``retries=0`` for work that must never run twice); a ``NodeFailed`` is
        not retried. ``deadline`` is per input. Each fact carries ``item``, the input's
        index. ``progress=True``: a tqdm bar."""
        from . import mapping

        return mapping.map(
            self,
            inputs,
            broker=broker,
            store=store,
            watching=watching,
            deadline=deadline,
            ordered=ordered,
            errors=errors,
            retries=retries,
            in_flight=in_flight,
            progress=progress,
        )

    # -- what a running process keeps on a graph ---------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        """What a pickle or a copy of this graph holds: its declaration, without what this
        process worked out for running it (``_somatize_*``: its plans, what was checked,
        memos that hold a broker's packer weakly), which is no other process's business and
        is made again, once, wherever the graph runs next."""
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_somatize_")}

    # -- structure -------------------------------------------------------------------
    @functools.cached_property
    def _layout(self) -> tuple[tuple[Step, ...], Shape]:
        steps: list[Step] = []

        def shape(g: Graph) -> Shape:
            if isinstance(g, Step):
                steps.append(g)
                return ("step", len(steps) - 1)
            kind = "seq" if isinstance(g, Sequence) else "par"
            return (kind, tuple(shape(part) for part in cast(_Composite, g).parts))  # not a Step: a composite

        root = shape(self)
        return tuple(steps), root

    @property
    def steps(self) -> tuple[Step, ...]:
        """Every step, in the order they appear (a step used twice appears twice)."""
        return self._layout[0]

    @property
    def shape(self) -> Shape:
        return self._layout[1]

    def __iter__(self) -> Iterator[Step]:
        return iter(self.steps)


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class Step(Graph):
    """A node and what was declared about it. Immutable: every suffix returns a new one."""

    node: Node
    name: str | None = None
    host: str | None = None
    device: str | None = None
    cache: bool = False
    freeze: bool = False
    version: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.node, Node):
            raise TypeError(
                f"a step wraps a `somatize.Node`; got a `{type(self.node).__name__}`. "
                f"Subclass `Node` and define `forward(self, x)`."
            )

    def named(self, name: str) -> Step:
        return dataclasses.replace(self, name=_word("named", name))

    def at(self, host: str) -> Step:
        return dataclasses.replace(self, host=_word("at", host))

    def on(self, device: str) -> Step:
        return dataclasses.replace(self, device=_word("on", str(device)))

    def cached(self, *, version: str | None = None) -> Step:
        """Keep this node's output in the store, under a key that changes with its code.

        ``version`` names the code instead: the key then stays the same whatever the class's
        source says until ``version`` changes, for an edit that does not change results.
        """
        if version is not None and (not isinstance(version, str) or not version):
            raise TypeError(
                f'`.cached(version=...)` takes a non-empty string, such as "2" or '
                f'"2024-06-01"; got {type(version).__name__} {version!r}'
            )
        return dataclasses.replace(self, cache=True, version=version)

    def frozen(self) -> Step:
        return dataclasses.replace(self, freeze=True)

    @property
    def label(self) -> str:
        """What facts call this step: its name, or its class's name when it has none."""
        return self.name if self.name is not None else type(self.node).__name__

    @property
    def identity(self) -> str:
        """What the cache calls this node: its name, its class, its plain constructor
        arguments, and its code (:func:`~somatize.code_identity.code_digest`: the source of
        its class and of its bases outside somatize), or the ``version`` given to
        ``.cached()`` in place of the code.

        Arguments that cannot be written down (a model object, say) are left out, so
        changing them does not change the key: rename the node when they matter.
        """
        if self.version is not None:
            return f"{self._somatize_declared}|version:{self.version}"
        return f"{self._somatize_declared}|{code_digest(type(self.node))}"

    @functools.cached_property
    def _somatize_declared(self) -> str:
        # name, class and arguments, which cannot change under a step; the code can
        # (autoreload), so it is asked for on every forward, from a digest kept per class
        from .codec import dumps
        from .errors import CodecError

        args, kwargs = getattr(self.node, "_somatize_args", ((), {}))
        try:
            written = dumps([list(args), dict(sorted(kwargs.items()))])
            arguments = hashlib.sha256(written).hexdigest()[:32]
        except CodecError:
            arguments = "-"
        return f"{self.name}|{type(self.node).__module__}.{type(self.node).__qualname__}|{arguments}"

    def __repr__(self) -> str:
        parts = [f"{type(self.node).__name__}()"]
        if self.name is not None:
            parts.append(f".named({self.name!r})")
        if self.host is not None:
            parts.append(f".at({self.host!r})")
        if self.device is not None:
            parts.append(f".on({self.device!r})")
        if self.cache:
            parts.append(".cached()" if self.version is None else f".cached(version={self.version!r})")
        if self.freeze:
            parts.append(".frozen()")
        return "".join(parts)


class _Composite(Graph):
    _joiner = ""

    def __init__(self, parts: tuple[Graph, ...]) -> None:
        if len(parts) < 2:
            raise ValueError(f"a {type(self).__name__} needs at least two parts")
        self.parts = parts

    def at(self, host: str) -> _Composite:
        """Place every step in this part of the graph on ``host``."""
        return type(self)(tuple(_apply(p, "at", host) for p in self.parts))

    def on(self, device: str) -> _Composite:
        """Place every step in this part of the graph on ``device``."""
        return type(self)(tuple(_apply(p, "on", device) for p in self.parts))

    def frozen(self) -> _Composite:
        """Promise that no step in this part of the graph changes its parameters."""
        return type(self)(tuple(_apply(p, "frozen") for p in self.parts))

    def __repr__(self) -> str:
        return "(" + self._joiner.join(repr(p) for p in self.parts) + ")"


class Sequence(_Composite):
    """``a >> b >> c``: each part gets what the one before it made."""

    _joiner = " >> "


class Parallel(_Composite):
    """``a & b``: every branch gets the same input; the output is the tuple of theirs."""

    _joiner = " & "


Composable = Node | Graph


def _engine() -> Any:
    """The engine module (which imports this one): imported at the first forward, then kept."""
    global _ENGINE
    if _ENGINE is None:
        from . import engine

        _ENGINE = engine
    return _ENGINE


_ENGINE: Any = None


def as_graph(thing: Composable) -> Graph:
    if isinstance(thing, Graph):
        return thing
    if isinstance(thing, Node):
        return Step(thing)
    raise TypeError(
        f"only nodes and graphs compose with `>>` and `&`; got a `{type(thing).__name__}`. "
        f"Wrap the work in a `Node` subclass with a `forward(self, x)`."
    )


def _flatten(kind: type, parts: tuple[Graph, ...]) -> tuple[Graph, ...]:
    out: list[Graph] = []
    for part in parts:
        if type(part) is kind:
            out.extend(part.parts)  # type: ignore[attr-defined]
        else:
            out.append(part)
    return tuple(out)


def _apply(g: Graph, suffix: str, *args: str) -> Graph:
    return getattr(g, suffix)(*args)


def _word(suffix: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise TypeError(
            f"`.{suffix}()` takes a non-empty string; got {type(value).__name__} {value!r}"
            if isinstance(value, (str, int, float, type(None)))
            else f"`.{suffix}()` takes a non-empty string; got a `{type(value).__name__}`"
        )
    return value
