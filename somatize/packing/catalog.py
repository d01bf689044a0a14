"""The worker's side of packing: turning what arrived back into nodes, never unpickling in
project mode, and keeping what a client made it build within bounds. See
:mod:`somatize.packing` for the two modes."""

from __future__ import annotations

import hashlib
import importlib
import pickle
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING, cast

from ..code_identity import code_digest
from ..codec import dumps
from ..errors import CodecError, NodeFailed, Refused
from ..graph import Node
from .artifact import ARTIFACT_FORMAT, check_mode, digest_of, is_main, lookup, short
from .kinds import Clash, carry, judged, still

if TYPE_CHECKING:  # pragma: no cover
    from ..wire import NodeSpec

__all__ = ["MAX_BUILT", "MAX_BUILT_BYTES", "MAX_HELD", "MAX_HELD_BYTES", "Catalog"]

MAX_HELD = 256
"""Artifacts one network-mode catalog keeps, at most (least recently used dropped first)."""
MAX_BUILT = 256
"""Project-mode instances one catalog keeps, at most (least recently used dropped first)."""
MAX_HELD_BYTES = 1 << 30
"""Bytes of artifacts one network-mode catalog keeps, at most (the newest is always kept)."""
MAX_BUILT_BYTES = 256 << 20
"""Bytes of constructor arguments behind the instances one catalog keeps, at most (the
newest is always kept): a client sending many big arguments cannot make a worker hoard them."""

_DIGEST = re.compile(r"sha256:[0-9a-f]{64}\Z")
_NO_CODE = (
    "this worker runs in project mode and does not accept code by value: it imports nodes "
    "by name from its own installation and never unpickles. Declare the worker with "
    '`mode="network"` to send nodes as artifacts, or install your code on it and use '
    "project mode on both sides"
)
#: Specs whose key a catalog remembers (the specs of recipes named by digest come back
#: as the same objects), and the most bytes of written arguments one of them may hold.
_MEMO_SPECS, _MEMO_ARGS = 1024, 4096


class _Slot:
    __slots__ = ("cls", "lock", "node", "size")

    def __init__(self, size: int) -> None:
        self.lock = threading.Lock()
        self.node: Node | None = None
        self.cls: type[Node] | None = None  # the class the name led to: its code is checked
        self.size = size


class Catalog:
    """The worker side: turns ``NodeSpec``s back into nodes.

    ``Catalog("project")`` only builds nodes by name and refuses every artifact;
    ``Catalog("network")`` also keeps provisioned artifacts by digest. Every refusal is a
    ``Refused`` whose message is the sentence to send back. Safe to use from many threads.
    """

    def __init__(
        self,
        mode: str,
        *,
        held: int = MAX_HELD,
        built: int = MAX_BUILT,
        held_bytes: int = MAX_HELD_BYTES,
        built_bytes: int = MAX_BUILT_BYTES,
    ) -> None:
        self.mode = check_mode(mode)
        self._max_held = max(1, int(held))
        self._max_built = max(1, int(built))
        self._max_held_bytes = max(0, int(held_bytes))
        self._max_built_bytes = max(0, int(built_bytes))
        self._lock = threading.Lock()
        self._held: OrderedDict[str, tuple[Node, int]] = OrderedDict()  # digest -> (node, bytes)
        # digest -> why it was refused for a kind's format (the last MAX_HELD): sent again while
        # the registry holds what it was judged against, it is refused without being unpickled
        self._clashed: OrderedDict[str, Clash] = OrderedDict()
        self._built: OrderedDict[tuple[str, str], _Slot] = OrderedDict()
        # id(spec) -> (spec, its key in `_built`, its module): a recipe a worker keeps for a
        # client comes back with the very same specs on every Work that names it by digest
        self._keys: dict[int, tuple[NodeSpec, tuple[str, str], str]] = {}
        self.held_bytes = 0
        self.built_bytes = 0
        # nodes let go of to make room, ever: whoever keeps a node it was given (a worker's
        # prepared steps) lets it go too when this moves, so its memory comes back
        self.dropped = 0

    def __repr__(self) -> str:
        return f"Catalog({self.mode!r}, held={len(self._held)}, built={len(self._built)})"

    # -- artifacts -----------------------------------------------------------------------
    def provision(self, digest: str, artifact: bytes | bytearray | memoryview) -> None:
        """Keep the node in ``artifact`` under ``digest`` and register the codecs it carries.

        Refused in project mode (before the bytes are looked at), when the bytes do not hash
        to ``digest``, when they cannot be unpickled here (a module missing: list it in
        ``send=``), when they are not a somatize artifact, and when a codec they carry, or
        one a module their unpickling imports registers, writes a kind in another format
        than the one this worker reads it in (:mod:`somatize.packing.kinds`; the registry is
        then as it was before, and the same bytes sent again are refused unopened).
        """
        if self.mode == "project":
            raise Refused(_NO_CODE)
        _check_digest(digest)
        with self._lock:
            if digest in self._held:
                self._held.move_to_end(digest)
                return
        if not isinstance(artifact, (bytes, bytearray, memoryview)):
            raise Refused(f"the artifact `{short(digest)}…` arrived as a `{type(artifact).__name__}`, not bytes")
        actual = digest_of(artifact)
        if actual != digest:
            raise Refused(
                f"the artifact sent as `{short(digest)}…` hashes to `{short(actual)}…`: it "
                f"was damaged or mislabelled on the way, so it was not opened. Send it again"
            )
        with self._lock:
            clash = self._clashed.get(digest)
        if clash is not None and still(clash):
            raise Refused(str(clash))  # refused before, against what is still there: not opened again
        # every codec registered while it opens (its imports', its own) is judged against
        # the format this worker reads the kind in; a refusal puts the registry back
        name = f"the artifact `{short(digest)}…`"
        try:
            with judged(name, f"a module imported to open {name}") as judging:
                node, codecs = _open(digest, artifact)
                carry(codecs, judging)
        except Clash as exc:
            with self._lock:  # the sentence and what it was judged against: no traceback, no bytes
                self._clashed[digest] = Clash(str(exc), exc.kind, exc.against)
                while len(self._clashed) > MAX_HELD:
                    self._clashed.popitem(last=False)
            raise
        size = memoryview(artifact).nbytes
        with self._lock:
            if digest not in self._held:
                self._held[digest] = (node, size)
                self.held_bytes += size
            self._held.move_to_end(digest)
            while len(self._held) > 1 and (len(self._held) > self._max_held or self.held_bytes > self._max_held_bytes):
                self.held_bytes -= self._held.popitem(last=False)[1][1]
                self.dropped += 1

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
            with self._lock:  # what is held was checked as it came; only what is not is checked here
                held = type(digest) is str and digest in self._held
            if not held:
                _check_digest(digest)
                if digest not in out:
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
            with self._lock:  # what is held was checked as it came
                entry = self._held.get(digest) if type(digest) is str else None
                if entry is not None:
                    self._held.move_to_end(digest)
            node = entry[0] if entry is not None else None
            if node is None:
                _check_digest(digest)
                raise Refused(
                    f"`{label}` is the artifact `{short(digest)}…`, which this worker does not "
                    f"hold: provision it first (a worker keeps at most {self._max_held})"
                )
            return node
        raise Refused(
            f"`{label}` arrived with source {source!r}; a node travels as "
            f'"project" (a name and arguments) or "network" (an artifact digest)'
        )

    def _build_project(self, spec: NodeSpec) -> Node:
        known = self._keys.get(id(spec))
        if known is not None and known[0] is spec:  # checked and written down before, unchanged
            key, module = known[1], known[2]
            with self._lock:
                slot = self._built.get(key)
                if slot is not None:
                    self._built.move_to_end(key)
            if slot is not None and slot.node is not None and slot.cls is not None:
                _same_code(spec, slot.cls, module)
                return slot.node
        label, target = getattr(spec, "label", "?"), getattr(spec, "target", None)
        module, qualname = _split_target(target, label)
        target = cast(str, target)  # `_split_target` refuses anything else
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
            raise Refused(f"`{label}` arrived with arguments that cannot be written down: {exc}") from exc
        key = (target, hashlib.sha256(written).hexdigest())
        if len(written) <= _MEMO_ARGS:  # what the memo holds stays small: 1,024 specs of small arguments
            if len(self._keys) >= _MEMO_SPECS:  # the specs of a few recipes in use: forgotten all at once
                self._keys.clear()
            self._keys[id(spec)] = (spec, key, module)
        with self._lock:
            slot = self._built.get(key)
            if slot is None:
                slot = self._built[key] = _Slot(len(written))
                self.built_bytes += slot.size
                while len(self._built) > 1 and (
                    len(self._built) > self._max_built or self.built_bytes > self._max_built_bytes
                ):
                    self.built_bytes -= self._built.popitem(last=False)[1].size
                    self.dropped += 1
            else:
                self._built.move_to_end(key)
        if slot.node is not None and slot.cls is not None:
            _same_code(spec, slot.cls, module)  # every Work: each client says its own code
            return slot.node
        with slot.lock:  # one build per class and arguments, however many Works ask at once
            if slot.node is None:
                # what importing it registers is judged: one node's package must not change
                # how another tenant's bytes of a kind are read
                with judged(f"importing `{module}` for `{label}`"):
                    cls = _node_class(module, qualname, target, label)
                _same_code(spec, cls, module)  # before its constructor runs
                try:
                    slot.node = cls(*args, **kwargs)
                except Exception as exc:
                    raise Refused(f"building `{label}` as `{target}` raised {type(exc).__name__}: {exc}") from exc
                except BaseException as exc:  # SystemExit and the like: the node's, not the worker's
                    raise _failed(label, f"building `{label}` as `{target}`", exc) from exc
                slot.cls = cls
            else:
                _same_code(spec, slot.cls, module)  # built meanwhile, for another Work
            return slot.node


def _same_code(spec: NodeSpec, cls: type[Node] | None, module: str) -> None:
    """Refuse to run ``cls`` when its code, as this worker imported it, is not the code the
    client digested (``spec.code``; ``""`` says nothing, and nothing is compared).

    The client computed the node's cache key from its own code; a worker that imported the
    module before an edit would run the old code and have its output kept under the new
    code's key, on every machine sharing the store. Comparing costs a few microseconds per
    node and Work (``code_digest`` is kept per class)."""
    theirs = getattr(spec, "code", "")
    if (isinstance(theirs, str) and not theirs) or cls is None:
        return
    ours = code_digest(cls)
    if ours == theirs:
        return
    theirs = theirs if isinstance(theirs, str) else type(theirs).__name__
    label, target = getattr(spec, "label", "?"), getattr(spec, "target", "?")
    # the worker adds, when its record says so, which file changed since it imported it
    raise Refused(
        f"`{label}` is `{target}`, and this worker's code for that class is not the client's "
        f"(`{ours[:13]}…` here, `{theirs[:13]}…` on the client), so it was not run: its output "
        f"would be kept under the key the client made from other code. Either this worker "
        f"imported `{module}` before its file was edited (restart the worker), or it has "
        f"another copy of it (install the client's code on the worker)"
    )


def _check_digest(digest: object) -> None:
    if not isinstance(digest, str) or not _DIGEST.match(digest):
        raise Refused('an artifact is named "sha256:" and 64 lowercase hex digits; this one was not')


def _failed(label: str, doing: str, exc: BaseException) -> NodeFailed:
    """What is not an ``Exception``, raised by a module's top level or a constructor."""
    return NodeFailed(
        f"{type(exc).__name__}: {exc}, while {doing} on the worker",
        node=label,
        error=type(exc).__name__,
    )


def _split_target(target: object, label: str) -> tuple[str, str]:
    if isinstance(target, str) and target.count(":") == 1:
        module, qualname = target.split(":")
        if all(p.isidentifier() for p in module.split(".")) and all(p.isidentifier() for p in qualname.split(".")):
            if is_main(module):
                raise Refused(
                    f"`{label}` is `{target}`, in a `__main__` module, which a project-mode "
                    f"worker does not import: importing one runs a program (its command line). "
                    f"Move the class into an importable module of your project"
                )
            return module, qualname
    raise Refused(
        f'`{label}` arrived naming its class as {target!r}; a project-mode name is "package.module:Qualname"'
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
            f"`{label}` is `{target}`, and importing `{module}` on this worker raised {type(exc).__name__}: {exc}"
        ) from exc
    except BaseException as exc:  # SystemExit at import: the module's, not the worker's
        raise _failed(label, f"importing `{module}` for `{label}` (`{target}`)", exc) from exc
    obj = lookup(mod, qualname)
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
    name_of = short(digest)
    try:
        payload = pickle.loads(artifact)
    except ModuleNotFoundError as exc:
        name = exc.name or str(exc)
        raise Refused(
            f"the artifact `{name_of}…` needs the module `{name}`, which this worker cannot "
            f"import: list it in `send=[...]` of the worker declaration so it travels inside "
            f"the artifact, or install it on the worker"
        ) from exc
    except BaseException as exc:  # a pickle can raise SystemExit too: never the worker's end
        raise Refused(
            f"the artifact `{name_of}…` could not be unpickled here ({type(exc).__name__}: "
            f"{exc}); the worker needs the same Python and cloudpickle as the client, and the "
            f"same versions of the modules the node uses by reference"
        ) from exc
    if not (isinstance(payload, dict) and payload.get("format") == ARTIFACT_FORMAT):
        raise Refused(
            f"the artifact `{name_of}…` is not a somatize artifact ({ARTIFACT_FORMAT}); it "
            f"was made by something else or by an incompatible somatize"
        )
    node, codecs = payload.get("node"), payload.get("codecs")
    if not isinstance(node, Node):
        raise Refused(f"the artifact `{name_of}…` carries a `{type(node).__name__}` where a `somatize.Node` belongs")
    if not isinstance(codecs, list) or not all(
        isinstance(c, tuple) and len(c) == 2 and isinstance(c[0], str) and isinstance(c[1], (bytes, bytearray))
        for c in codecs
    ):
        raise Refused(f"the artifact `{name_of}…` carries its codecs in a shape this worker does not read")
    return node, codecs
