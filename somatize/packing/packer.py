"""The client's side of packing: a node as a name and plain arguments (project mode), or
as a cloudpickle artifact (network mode). See :mod:`somatize.packing` for the two modes."""

from __future__ import annotations

import importlib
import sys
import threading
import weakref
from collections.abc import Sequence as Seq
from types import ModuleType
from typing import TYPE_CHECKING

import cloudpickle

from ..code_identity import code_digest
from ..codec import dumps, registry
from ..errors import CodecError, PlanError
from ..graph import Node, Step
from .artifact import ARTIFACT_FORMAT, check_mode, digest_of, is_main, lookup, short

if TYPE_CHECKING:  # pragma: no cover
    from ..wire import NodeSpec

__all__ = ["Packer"]

# cloudpickle's by-value registry is process-wide: one packer at a time changes it.
_BY_VALUE_LOCK = threading.Lock()
#: Specs a packer keeps for nodes packed again unchanged (all forgotten past it).
MEMO_SPECS = 4096
_PROJECT_SPECS: dict[tuple, tuple] = {}


class _Packed:
    __slots__ = ("digest", "ref", "registry")

    def __init__(self, ref: weakref.ref, registry: tuple, digest: str) -> None:
        self.ref = ref
        self.registry = registry
        self.digest = digest


class Packer:
    """The client side of one worker declaration: turns steps into ``NodeSpec``s.

    ``mode`` is ``"project"`` or ``"network"``. ``send`` (network mode only) lists modules,
    as module objects or importable names, whose code travels inside the artifacts by value
    rather than by reference. ``pickles`` counts the artifacts made so far.

    In network mode the packer keeps each node's artifact while the node object lives (it
    holds the node weakly), so :meth:`artifact` can answer a worker's ``Send``; a node packed
    again because the codec registry changed replaces its previous artifact.
    """

    def __init__(self, mode: str, send: Seq[ModuleType | str] | ModuleType | str = ()) -> None:
        self.mode = check_mode(mode)
        if isinstance(send, (str, ModuleType)):
            send = (send,)
        modules = tuple(_module(m) for m in send)
        if modules and self.mode == "project":
            raise ValueError(
                "send= only means something in network mode (it makes modules travel inside "
                "an artifact); a project-mode worker imports everything by name. Drop send= "
                'or declare the worker with mode="network"'
            )
        self.send: tuple[ModuleType, ...] = modules
        self.pickles = 0
        self._lock = threading.Lock()
        self._packed: dict[int, _Packed] = {}  # id(node) -> its current artifact
        self._artifacts: dict[str, bytes] = {}
        self._users: dict[str, int] = {}  # digest -> how many live nodes have it
        self._dead: list[int] = []  # ids of packed nodes gone since; appended by weakref
        # (id(node), label, cache) -> (a weak ref to the node, what the spec was made from,
        # the spec): the same node packed again, unchanged, gets the very same spec (a graph
        # made anew for every call, `node.at(host).forward(x)`, packs nothing). A project-mode
        # spec is the node's name, arguments and code alone: one memo for every such packer
        self._specs: dict[tuple, tuple] = _PROJECT_SPECS if self.mode == "project" else {}

    def __repr__(self) -> str:
        sent = f", send={[m.__name__ for m in self.send]}" if self.send else ""
        return f"Packer({self.mode!r}{sent})"

    def spec(self, step: Step | Node) -> NodeSpec:
        """What travels for ``step``: a name, arguments and the digest of the class's code
        (project), or an artifact's digest (network).

        Raises ``PlanError`` with a sentence when the node cannot travel this way.
        """
        from ..wire import NodeSpec

        if isinstance(step, Node):
            step = Step(step)
        if not isinstance(step, Step):
            raise TypeError(f"Packer.spec takes a declared step or a `somatize.Node`; got a `{type(step).__name__}`")
        node = step.node
        if self.mode == "project":
            code = code_digest(type(node)) if step.cache else ""
            made_of = (getattr(node, "_somatize_args", None), code)
            kept = self._kept(node, step, made_of)
            if kept is not None and _importable_as(type(node)):
                return kept
            target, args, kwargs = _project_recipe(step)
            return self._keep(
                node,
                step,
                made_of,
                NodeSpec(
                    label=step.label,
                    cache=step.cache,
                    source="project",
                    target=target,
                    args=args,
                    kwargs=kwargs,
                    # a cached node's: the worker checks it runs the code its key was made from
                    # (whatever `.cached(version=...)` names: a version names a key, not code);
                    # an uncached node's output is kept nowhere, and its bases may differ by
                    # library version from machine to machine, as they always could
                    code=code,
                ),
            )
        digest = self._pack(node, step.label)
        kept = self._kept(node, step, (None, digest))
        if kept is not None:
            return kept
        return self._keep(
            node, step, (None, digest), NodeSpec(label=step.label, cache=step.cache, source="network", target=digest)
        )

    def _kept(self, node: Node, step: Step, made_of: tuple) -> NodeSpec | None:
        """The spec made for this very node and step, from the very same arguments (by
        identity) and code, or artifact; None when there is none."""
        held = self._specs.get((id(node), step.label, step.cache))
        if held is None or held[0]() is not node or held[1][0] is not made_of[0] or held[1][1] != made_of[1]:
            return None
        return held[2]

    def _keep(self, node: Node, step: Step, made_of: tuple, spec: NodeSpec) -> NodeSpec:
        try:
            ref = weakref.ref(node)
        except TypeError:  # a node that takes no weak reference is packed every time
            return spec
        if len(self._specs) >= MEMO_SPECS:
            self._specs.clear()
        self._specs[(id(node), step.label, step.cache)] = (ref, made_of, spec)
        return spec

    def artifact(self, digest: str) -> bytes:
        """The bytes of an artifact this packer made, for a ``Provision``.

        Raises ``KeyError`` when it has none by that name (never made here, or its node is
        gone).
        """
        with self._lock:
            self._sweep()
            found = self._artifacts.get(digest)
        if found is None:
            raise KeyError(
                f"no artifact `{short(digest)}…` was made by this packer, or the node it was made for is gone"
            )
        return found

    # -- network mode ------------------------------------------------------------------
    def _pack(self, node: Node, label: str) -> str:
        codecs = registry()
        key = id(node)
        with self._lock:
            self._sweep()
            held = self._packed.get(key)
            if held is not None and held.ref() is not node:
                held = None  # a dead node's id reused before the sweep saw it
            if held is not None and _same_registry(held.registry, codecs):
                return held.digest
            artifact = _make_artifact(node, label, codecs, self.send)
            digest = digest_of(artifact)
            self.pickles += 1
            self._artifacts.setdefault(digest, artifact)
            self._users[digest] = self._users.get(digest, 0) + 1
            if held is not None:
                self._release(held.digest)
                held.registry, held.digest = codecs, digest
            else:
                old = self._packed.pop(key, None)
                if old is not None:
                    self._release(old.digest)
                dead = self._dead

                def forget(_r: object, dead: list[int] = dead, key: int = key) -> None:
                    dead.append(key)

                ref = weakref.ref(node, forget)
                self._packed[key] = _Packed(ref, codecs, digest)
            return digest

    def _sweep(self) -> None:
        # Called with the lock held. Weakref callbacks only append (they may run inside any
        # allocation, even one made with the lock held); forgetting happens here.
        while self._dead:
            key = self._dead.pop()
            held = self._packed.get(key)
            if held is not None and held.ref() is None:
                del self._packed[key]
                self._release(held.digest)

    def _release(self, digest: str) -> None:
        left = self._users.get(digest, 0) - 1
        if left > 0:
            self._users[digest] = left
        else:
            self._users.pop(digest, None)
            self._artifacts.pop(digest, None)


def _module(m: ModuleType | str) -> ModuleType:
    if isinstance(m, ModuleType):
        if sys.modules.get(m.__name__) is not m:
            raise ValueError(
                f"send= lists the module `{m.__name__}`, which is not the one imported under "
                f"that name (it is not in sys.modules); import it before declaring the worker"
            )
        return m
    if isinstance(m, str) and m:
        try:
            return importlib.import_module(m)
        except Exception as exc:
            raise ValueError(
                f"send= names the module `{m}`, which cannot be imported here "
                f"({type(exc).__name__}: {exc}); a module travels by value only from a "
                f"process that has it"
            ) from exc
    raise TypeError(f"send= takes modules or their names (str); it was given a `{type(m).__name__}`")


def _same_registry(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(x is y for ea, eb in zip(a, b, strict=False) for x, y in zip(ea, eb, strict=True))


def _make_artifact(node: Node, label: str, registry: tuple, send: tuple[ModuleType, ...]) -> bytes:
    with _BY_VALUE_LOCK:
        already = cloudpickle.list_registry_pickle_by_value()
        added: list[ModuleType] = []
        try:
            for m in send:
                if m.__name__ not in already:
                    cloudpickle.register_pickle_by_value(m)
                    added.append(m)
            codecs = []
            for kind, type_, dump, load in registry:
                try:
                    codecs.append((kind, cloudpickle.dumps((type_, dump, load))))
                except Exception:
                    continue  # a codec that cannot travel stays here; the node may not need it
            payload = {"format": ARTIFACT_FORMAT, "node": node, "codecs": codecs}
            try:
                return cloudpickle.dumps(payload)
            except Exception as exc:
                raise PlanError(
                    f"`{label}` cannot be sent to a network-mode worker: cloudpickle could not "
                    f"pickle it ({type(exc).__name__}: {exc}). Something it holds (a lock, a "
                    f"socket, an open file) cannot leave this process: build that inside the "
                    f"node when it first runs, or use project mode"
                ) from exc
        finally:
            for m in added:
                cloudpickle.unregister_pickle_by_value(m)


# -- project mode, client side -----------------------------------------------------------


def _importable_as(cls: type) -> bool:
    """Whether ``cls`` is still what its module holds under its name (not reloaded or
    replaced since its spec was made). A class at a module's top level is read from the
    module's namespace (what a plain attribute of a module is; asked on every call that
    reuses a spec), any other walked without running descriptors (`lookup`)."""
    module = sys.modules.get(cls.__module__)
    qualname = cls.__qualname__
    if "." not in qualname and type(module) is ModuleType:
        return module.__dict__.get(qualname) is cls
    return lookup(module, qualname) is cls


def _project_recipe(step: Step) -> tuple[str, tuple, dict]:
    node = step.node
    cls = type(node)
    module, qualname = cls.__module__, cls.__qualname__
    where = f"in `{module}`" if is_main(module) else "inside a function"
    if is_main(module) or "<locals>" in qualname.split("."):
        raise PlanError(
            f"`{step.label}` is a `{cls.__name__}`, a class defined {where}, which a "
            f'project-mode worker cannot import. Use mode="network" for this worker so the '
            f"node travels as an artifact, or move the class into an importable module"
        )
    target = f"{module}:{qualname}"
    if lookup(sys.modules.get(module), qualname) is not cls:
        raise PlanError(
            f"`{step.label}` is a `{cls.__name__}`, but `{target}` does not lead back to that "
            f"class here (made with type(), replaced, or reloaded), so a project-mode worker "
            f'would build something else. Use mode="network", or define the class at the top '
            f"level of an importable module"
        )
    recipe = getattr(node, "_somatize_args", None)
    if not (
        type(recipe) is tuple and len(recipe) == 2 and isinstance(recipe[0], tuple) and isinstance(recipe[1], dict)
    ):
        raise PlanError(
            f"`{step.label}` does not remember its constructor arguments (`{cls.__name__}` "
            f"bypassed `Node.__new__`), so a project-mode worker cannot rebuild it: call "
            f'`super().__new__(cls, *args, **kwargs)`, or use mode="network"'
        )
    args, kwargs = recipe
    _check_writable(step.label, cls, args, kwargs)
    return target, tuple(args), dict(kwargs)


def _check_writable(label: str, cls: type, args: tuple, kwargs: dict) -> None:
    try:
        dumps([list(args), dict(kwargs)])
        return
    except CodecError as exc:
        first: CodecError = exc
    places = [(f"positional argument {i}", a) for i, a in enumerate(args)]
    places += [(f"keyword argument `{k}`", v) for k, v in kwargs.items()]
    where, culprit = "arguments", None
    for place, value in places:
        try:
            dumps(value)
        except CodecError as exc:
            where, culprit, first = place, value, exc
            break
    what = f" is a `{type(culprit).__name__}`, which" if culprit is not None else ""
    raise PlanError(
        f"`{label}` ({cls.__name__}) cannot travel to a project-mode worker: its {where}{what} "
        f"cannot be written down ({first}). A project-mode worker rebuilds a node from its "
        f'constructor arguments, so they have to be plain data or have a codec; use mode="network" '
        f"to send the node object itself"
    ) from first
