"""How a node travels to a worker, and how the worker turns what arrived back into a node.

There are two ways to pack, chosen per worker declaration, and they are not interchangeable:

``project``
    The worker can import your code (a cluster where everyone has the repo). A node
    travels as its class's name, ``"package.module:Qualname"``, plus the arguments it was
    constructed with (``node._somatize_args``), which have to be plain data or have a
    codec. The worker imports the module, finds the class and calls it with those
    arguments. What changed in the node after it was constructed (trained weights, say)
    does not travel: the worker builds its own from the same recipe, once per worker for
    each class and arguments, and reuses it for every Work after. A class defined in
    ``__main__`` or inside a function cannot be imported over there, so the client refuses
    it before anything is sent.

``network``
    The worker cannot import your code (a node defined in a notebook cell, a generic
    worker). The node object itself travels as a cloudpickle *artifact*, named by its
    digest ``"sha256:<hex>"``. It is made once per node object (the first time that node is
    sent, as it is then; later changes to the object do not travel) and made again only
    when the codec registry changed since. cloudpickle writes anything from an importable
    module by reference, so modules the worker cannot import go in ``send=[...]``: they are
    pickled by value. The artifact also carries the client's registered codecs, so a
    ``codec(...)`` defined next to the node works on the worker too: provisioning registers
    every carried codec whose kind the worker does not already have (one it cannot load,
    because its type lives in a module the worker lacks, is skipped).

The security rule. Unpickling runs code, so only a network-mode worker ever unpickles, and
only bytes whose sha256 matches the digest it was told (an integrity check, not an
authentication: a network-mode worker runs whatever code its clients send, so only expose
one to people who may run code on it). A project-mode worker never unpickles anything: it
refuses a ``Provision`` before reading a byte. What it builds is named by a string a client
chose, so it checks, before calling anything, that the name leads to a class that
subclasses ``somatize.Node``; ``os:system`` or ``subprocess:Popen`` with arguments is refused
and nothing is called. Resolving a name imports its module, so a project-mode worker runs
the top-level code of modules installed on it, and nothing else. Names are looked up
without running descriptors or a module's ``__getattr__``.

Payload of an artifact (the pickled object; ``ARTIFACT_FORMAT`` names this layout)::

    {"format": "somatize.artifact/1",
     "node": <the Node object>,
     "codecs": [(kind, <cloudpickle bytes of (type, dump, load)>), ...]}

Each codec is pickled on its own, so one the worker cannot load does not stop the node from
arriving. cloudpickle gives a class written by value the same identity in every pickle made
by one process, so a ``Reading`` class carried by the node and the one carried by its codec
are one class on the worker.

Bounds: a worker's :class:`Catalog` holds at most ``MAX_HELD`` artifacts and ``MAX_BUILT``
project-mode instances, dropping the least recently used; a dropped artifact is asked for
again (the worker answers ``Send``), a dropped instance is built again.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import pickle
import re
import sys
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from types import ModuleType
from typing import TYPE_CHECKING, Any

import cloudpickle

from .codec import _entries, codec, codecs_registered, dumps
from .errors import CodecError, PlanError, Refused
from .graph import Node, Step

if TYPE_CHECKING:  # pragma: no cover
    from .wire import NodeSpec

__all__ = [
    "ARTIFACT_FORMAT",
    "MAX_BUILT",
    "MAX_HELD",
    "MODES",
    "Catalog",
    "Packer",
    "digest_of",
]

MODES = ("project", "network")
ARTIFACT_FORMAT = "somatize.artifact/1"
MAX_HELD = 256
"""Artifacts one network-mode catalog keeps, at most (least recently used dropped first)."""
MAX_BUILT = 256
"""Project-mode instances one catalog keeps, at most (least recently used dropped first)."""

_DIGEST = re.compile(r"sha256:[0-9a-f]{64}\Z")
_NO_CODE = (
    "this worker runs in project mode and does not accept code by value: it imports nodes "
    "by name from its own installation and never unpickles. Declare the worker with "
    '`mode="network"` to send nodes as artifacts, or install your code on it and use '
    'project mode on both sides'
)

# cloudpickle's by-value registry is process-wide: one packer at a time changes it.
_BY_VALUE_LOCK = threading.Lock()
# Checking for a kind and registering it happen together.
_CARRY_LOCK = threading.Lock()


def digest_of(artifact: bytes | bytearray | memoryview) -> str:
    """The name of an artifact: ``"sha256:"`` and the hex sha256 of its bytes."""
    return "sha256:" + hashlib.sha256(artifact).hexdigest()


def _check_mode(mode: object) -> str:
    if mode not in MODES:
        raise ValueError(
            f'mode has to be "project" (the worker imports your nodes by name) or "network" '
            f"(nodes travel as cloudpickle artifacts); it was given {mode!r}"
            if isinstance(mode, (str, type(None)))
            else f'mode has to be "project" or "network"; it was given a `{type(mode).__name__}`'
        )
    return mode  # type: ignore[return-value]


def _short(digest: str) -> str:
    return digest[:19] if isinstance(digest, str) else "?"


# -- client side -------------------------------------------------------------------------


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
        self.mode = _check_mode(mode)
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

    def __repr__(self) -> str:
        sent = f", send={[m.__name__ for m in self.send]}" if self.send else ""
        return f"Packer({self.mode!r}{sent})"

    def spec(self, step: Step | Node) -> NodeSpec:
        """What travels for ``step``: a name and arguments (project) or a digest (network).

        Raises ``PlanError`` with a sentence when the node cannot travel this way.
        """
        from .wire import NodeSpec

        if isinstance(step, Node):
            step = Step(step)
        if not isinstance(step, Step):
            raise TypeError(
                f"Packer.spec takes a declared step or a `somatize.Node`; "
                f"got a `{type(step).__name__}`"
            )
        if self.mode == "project":
            target, args, kwargs = _project_recipe(step)
            return NodeSpec(
                label=step.label,
                cache=step.cache,
                source="project",
                target=target,
                args=args,
                kwargs=kwargs,
            )
        digest = self._pack(step.node, step.label)
        return NodeSpec(label=step.label, cache=step.cache, source="network", target=digest)

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
                f"no artifact `{_short(digest)}…` was made by this packer, or the node it "
                f"was made for is gone"
            )
        return found

    # -- network mode ------------------------------------------------------------------
    def _pack(self, node: Node, label: str) -> str:
        registry = _entries()
        key = id(node)
        with self._lock:
            self._sweep()
            held = self._packed.get(key)
            if held is not None and held.ref() is not node:
                held = None  # a dead node's id reused before the sweep saw it
            if held is not None and _same_registry(held.registry, registry):
                return held.digest
            artifact = _make_artifact(node, label, registry, self.send)
            digest = digest_of(artifact)
            self.pickles += 1
            self._artifacts.setdefault(digest, artifact)
            self._users[digest] = self._users.get(digest, 0) + 1
            if held is not None:
                self._release(held.digest)
                held.registry, held.digest = registry, digest
            else:
                old = self._packed.pop(key, None)
                if old is not None:
                    self._release(old.digest)
                dead = self._dead
                ref = weakref.ref(node, lambda _r, dead=dead, key=key: dead.append(key))
                self._packed[key] = _Packed(ref, registry, digest)
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
    raise TypeError(
        f"send= takes modules or their names (str); it was given a `{type(m).__name__}`"
    )


def _same_registry(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(
        x is y for ea, eb in zip(a, b) for x, y in zip(ea, eb, strict=True)
    )


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


def _project_recipe(step: Step) -> tuple[str, tuple, dict]:
    node = step.node
    cls = type(node)
    module, qualname = cls.__module__, cls.__qualname__
    where = "in `__main__`" if module == "__main__" else "inside a function"
    if module == "__main__" or "<locals>" in qualname.split("."):
        raise PlanError(
            f"`{step.label}` is a `{cls.__name__}`, a class defined {where}, which a "
            f'project-mode worker cannot import. Use mode="network" for this worker so the '
            f"node travels as an artifact, or move the class into an importable module"
        )
    target = f"{module}:{qualname}"
    if _lookup(sys.modules.get(module), qualname) is not cls:
        raise PlanError(
            f"`{step.label}` is a `{cls.__name__}`, but `{target}` does not lead back to that "
            f"class here (made with type(), replaced, or reloaded), so a project-mode worker "
            f'would build something else. Use mode="network", or define the class at the top '
            f"level of an importable module"
        )
    recipe = getattr(node, "_somatize_args", None)
    if not (
        type(recipe) is tuple
        and len(recipe) == 2
        and isinstance(recipe[0], tuple)
        and isinstance(recipe[1], dict)
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


def _lookup(obj: Any, qualname: str) -> Any:
    """Walk a dotted qualname from ``obj`` without running descriptors or ``__getattr__``."""
    if obj is None:
        return None
    for part in qualname.split("."):
        try:
            obj = inspect.getattr_static(obj, part)
        except AttributeError:
            return None
    return obj


# -- worker side -------------------------------------------------------------------------


class _Slot:
    __slots__ = ("lock", "node")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.node: Node | None = None


class Catalog:
    """The worker side: turns ``NodeSpec``s back into nodes.

    ``Catalog("project")`` only builds nodes by name and refuses every artifact;
    ``Catalog("network")`` also keeps provisioned artifacts by digest. Every refusal is a
    ``Refused`` whose message is the sentence to send back. Safe to use from many threads.
    """

    def __init__(self, mode: str, *, held: int = MAX_HELD, built: int = MAX_BUILT) -> None:
        self.mode = _check_mode(mode)
        self._max_held = max(1, int(held))
        self._max_built = max(1, int(built))
        self._lock = threading.Lock()
        self._held: OrderedDict[str, Node] = OrderedDict()
        self._built: OrderedDict[tuple[str, str], _Slot] = OrderedDict()

    def __repr__(self) -> str:
        return f"Catalog({self.mode!r}, held={len(self._held)}, built={len(self._built)})"

    # -- artifacts -----------------------------------------------------------------------
    def provision(self, digest: str, artifact: bytes | bytearray | memoryview) -> None:
        """Keep the node in ``artifact`` under ``digest`` and register the codecs it carries.

        Refused in project mode (before the bytes are looked at), when the bytes do not hash
        to ``digest``, when they cannot be unpickled here (a module missing: list it in
        ``send=``), or when they are not a somatize artifact.
        """
        if self.mode == "project":
            raise Refused(_NO_CODE)
        _check_digest(digest)
        with self._lock:
            if digest in self._held:
                self._held.move_to_end(digest)
                return
        if not isinstance(artifact, (bytes, bytearray, memoryview)):
            raise Refused(
                f"the artifact `{_short(digest)}…` arrived as a `{type(artifact).__name__}`, "
                f"not bytes"
            )
        actual = digest_of(artifact)
        if actual != digest:
            raise Refused(
                f"the artifact sent as `{_short(digest)}…` hashes to `{_short(actual)}…`: it "
                f"was damaged or mislabelled on the way, so it was not opened. Send it again"
            )
        node, codecs = _open(digest, artifact)
        _register_carried(codecs)
        with self._lock:
            self._held.setdefault(digest, node)
            self._held.move_to_end(digest)
            while len(self._held) > self._max_held:
                self._held.popitem(last=False)

    def missing(self, specs: Iterable[NodeSpec]) -> tuple[str, ...]:
        """The digests of network-source specs this catalog does not hold, in order, once each.

        ``specs`` may also be anything with a ``nodes`` attribute holding them. A project-mode
        catalog refuses network-source specs at once rather than asking for artifacts it
        would refuse.
        """
        specs = getattr(specs, "nodes", specs)
        out: list[str] = []
        for spec in specs:
            if getattr(spec, "source", None) != "network":
                continue
            if self.mode == "project":
                raise Refused(_NO_CODE)
            digest = spec.target
            _check_digest(digest)
            with self._lock:
                held = digest in self._held
            if not held and digest not in out:
                out.append(digest)
        return tuple(out)

    # -- building ------------------------------------------------------------------------
    def build(self, spec: NodeSpec) -> Node:
        """The node ``spec`` stands for: built by name (project), or the one provisioned
        under its digest (network). Refused with a sentence on anything wrong."""
        source = getattr(spec, "source", None)
        label = getattr(spec, "label", "?")
        if source == "project":
            return self._build_project(spec)
        if source == "network":
            if self.mode == "project":
                raise Refused(_NO_CODE)
            digest = spec.target
            _check_digest(digest)
            with self._lock:
                node = self._held.get(digest)
                if node is not None:
                    self._held.move_to_end(digest)
            if node is None:
                raise Refused(
                    f"`{label}` is the artifact `{_short(digest)}…`, which this worker does not "
                    f"hold: provision it first (a worker keeps at most {self._max_held})"
                )
            return node
        raise Refused(
            f"`{label}` arrived with source {source!r}; a node travels as "
            f'"project" (a name and arguments) or "network" (an artifact digest)'
        )

    def _build_project(self, spec: NodeSpec) -> Node:
        label, target = getattr(spec, "label", "?"), getattr(spec, "target", None)
        module, qualname = _split_target(target, label)
        args, kwargs = getattr(spec, "args", ()), getattr(spec, "kwargs", {})
        if not isinstance(args, (tuple, list)) or not isinstance(kwargs, dict):
            raise Refused(
                f"`{label}` arrived with arguments of types `{type(args).__name__}` and "
                f"`{type(kwargs).__name__}`; they have to be a tuple and a dict"
            )
        if not all(type(k) is str and k.isidentifier() for k in kwargs):
            raise Refused(f"`{label}` arrived with keyword arguments whose names are not names")
        args = tuple(args)
        try:
            written = dumps([list(args), dict(sorted(kwargs.items()))])
        except CodecError as exc:
            raise Refused(f"`{label}` arrived with arguments that cannot be written down: {exc}")
        key = (target, hashlib.sha256(written).hexdigest())
        with self._lock:
            slot = self._built.get(key)
            if slot is None:
                slot = self._built[key] = _Slot()
                while len(self._built) > self._max_built:
                    self._built.popitem(last=False)
            else:
                self._built.move_to_end(key)
        if slot.node is not None:
            return slot.node
        with slot.lock:  # one build per class and arguments, however many Works ask at once
            if slot.node is None:
                cls = _node_class(module, qualname, target, label)
                try:
                    slot.node = cls(*args, **kwargs)
                except Exception as exc:
                    raise Refused(
                        f"building `{label}` as `{target}` raised {type(exc).__name__}: {exc}"
                    ) from exc
            return slot.node


def _check_digest(digest: object) -> None:
    if not isinstance(digest, str) or not _DIGEST.match(digest):
        raise Refused(
            'an artifact is named "sha256:" and 64 lowercase hex digits; this one was not'
        )


def _split_target(target: object, label: str) -> tuple[str, str]:
    if isinstance(target, str) and target.count(":") == 1:
        module, qualname = target.split(":")
        if all(p.isidentifier() for p in module.split(".")) and all(
            p.isidentifier() for p in qualname.split(".")
        ):
            return module, qualname
    raise Refused(
        f'`{label}` arrived naming its class as {target!r}; a project-mode name is "package.module:'
        f'Qualname"'
        if isinstance(target, str) and len(target) <= 200
        else f'`{label}` arrived without a "package.module:Qualname" naming its class'
    )


def _node_class(module: str, qualname: str, target: str, label: str) -> type[Node]:
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        raise Refused(
            f"`{label}` is `{target}`, and this worker cannot import `{module}` "
            f"({type(exc).__name__}: {exc}). A project-mode worker imports nodes from its own "
            f'installation: install your code there, or use mode="network"'
        ) from exc
    except Exception as exc:
        raise Refused(
            f"`{label}` is `{target}`, and importing `{module}` on this worker raised "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    obj = _lookup(mod, qualname)
    if obj is None:
        raise Refused(
            f"`{label}` is `{target}`, and `{module}` on this worker has no `{qualname}`: "
            f"is the worker's copy of the code older than the client's?"
        )
    # type(obj), not obj.__class__: the check must not ask the object itself.
    if not (issubclass(type(obj), type) and issubclass(obj, Node)):
        what = "class" if issubclass(type(obj), type) else f"`{type(obj).__name__}`"
        raise Refused(
            f"`{target}` is a {what}, not a subclass of `somatize.Node`, so this worker "
            f"refused to call it: a project-mode worker only builds nodes"
        )
    return obj


def _open(digest: str, artifact: bytes | bytearray | memoryview) -> tuple[Node, list]:
    short = _short(digest)
    try:
        payload = pickle.loads(artifact)
    except ModuleNotFoundError as exc:
        name = exc.name or str(exc)
        raise Refused(
            f"the artifact `{short}…` needs the module `{name}`, which this worker cannot "
            f"import: list it in `send=[...]` of the worker declaration so it travels inside "
            f"the artifact, or install it on the worker"
        ) from exc
    except Exception as exc:
        raise Refused(
            f"the artifact `{short}…` could not be unpickled here ({type(exc).__name__}: "
            f"{exc}); the worker needs the same Python and cloudpickle as the client, and the "
            f"same versions of the modules the node uses by reference"
        ) from exc
    if not (isinstance(payload, dict) and payload.get("format") == ARTIFACT_FORMAT):
        raise Refused(
            f"the artifact `{short}…` is not a somatize artifact ({ARTIFACT_FORMAT}); it "
            f"was made by something else or by an incompatible somatize"
        )
    node, codecs = payload.get("node"), payload.get("codecs")
    if not isinstance(node, Node):
        raise Refused(
            f"the artifact `{short}…` carries a `{type(node).__name__}` where a "
            f"`somatize.Node` belongs"
        )
    if not isinstance(codecs, list) or not all(
        isinstance(c, tuple)
        and len(c) == 2
        and isinstance(c[0], str)
        and isinstance(c[1], (bytes, bytearray))
        for c in codecs
    ):
        raise Refused(
            f"the artifact `{short}…` carries its codecs in a shape this worker does not read"
        )
    return node, codecs


def _register_carried(codecs: list[tuple[str, bytes]]) -> None:
    with _CARRY_LOCK:
        for kind, blob in codecs:
            if kind in codecs_registered():
                continue  # this worker's own (or an earlier arrival's) wins
            try:
                type_, dump, load = pickle.loads(blob)
            except Exception:
                continue  # its type lives where this worker cannot go; the node may not need it
            if kind in codecs_registered():
                continue  # loading it imported the module that registers it
            try:
                codec(kind, type_, dump=dump, load=load)
            except CodecError:
                continue
