"""The wire: every message a client, a broker and a worker exchange, as plain data.

What it is for: turning a message into the frames of one ZeroMQ multipart message
(``encode``) and frames back into a message (``decode``), checking everything on the way
in. What it is not for: sockets, threads, retries, deciding what to answer. Nothing here
opens a connection (like h11), so the whole protocol is tested by feeding it frames.

Layout of one message::

    frame 0     the header: a MessagePack map
                  {"v": WIRE_VERSION, "t": "<variant>", <field>: <value>, ...}
    frame 1..n  raw buffers (array data, long bytes, codec output, an artifact)

Every field of the variant is present, under its dataclass name, and nothing else is.
Nested parts are maps too (``runtime``, ``recipe``, each of ``recipe.nodes``). A dict keyed
by node index (``Work.keys``, ``Work.placement``, ``Done.produced``) is a list of
``[index, value]`` pairs, because a header map has text keys only. A shape is nested lists:
``["step", i]``, ``["seq", [...]]``, ``["par", [...]]``.

Values (``Work.input``, each node's ``args`` / ``kwargs``, ``Done.output``, the values of
``Done.produced``) are written by :mod:`somatize.codec` together, as one tuple, and each
field holds its own part of that one descriptor; a descriptor's frame index ``i`` is frame
``i + 1`` of the message. So large arrays never enter the header, and every frame after the
header is used by exactly one value. ``Provision.artifact`` is frame 1 as it is.

Whose fault: ``decode`` raises :class:`~somatize.errors.ProtocolError` and nothing else for
bytes that are not a valid message (the peer's fault; its ``why`` is the sentence to send
back in a ``Refused``). ``encode`` raises ``TypeError`` / ``ValueError`` for a message built
wrongly here, and the codec's own ``Unwritable`` / ``BadCodec`` for a value it cannot write
down (both the caller's fault). Every size is bounded by a constant below, checked before
anything is built.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

from .codec import _Checker, readable_kinds
from .codec import decode as _decode_values
from .codec import encode as _encode_values
from .errors import ProtocolError, Unreadable

__all__ = [
    "ANSWERS",
    "MAX_FACT",
    "MAX_FACT_TEXT",
    "MAX_FRAME",
    "MAX_FRAMES",
    "MAX_HEADER",
    "MAX_HOSTS",
    "MAX_NAME",
    "MAX_NODES",
    "MAX_PATH",
    "MAX_SHAPE",
    "MAX_SHAPE_DEPTH",
    "MAX_TEXT",
    "MAX_TOTAL",
    "REQUESTS",
    "TERMINAL",
    "WIRE_VERSION",
    "Answer",
    "Bye",
    "Done",
    "Failed",
    "Hello",
    "Hosts",
    "Listed",
    "Located",
    "NodeSpec",
    "Provision",
    "Ready",
    "Recipe",
    "Refused",
    "Request",
    "Runtime",
    "Saw",
    "Send",
    "Where",
    "Work",
    "compatible",
    "decode",
    "encode",
    "peek_kinds",
]

WIRE_VERSION = 1
"""The version of this layout. Two sides talk only when it is the same on both."""

# -- limits: decode refuses anything beyond these, before building anything -------------

MAX_FRAMES = 100_000
"""Frames in one message, the header included."""
MAX_HEADER = 64 << 20
"""Bytes in the header frame (64 MiB): bulk data belongs in frames, not here."""
MAX_FRAME = 16 << 30
"""Bytes in one frame after the header (16 GiB)."""
MAX_TOTAL = 32 << 30
"""Bytes in one message, all frames together (32 GiB)."""
MAX_NAME = 1000
"""Characters in a name: a label, a target, a host, an address, a kind, an error type."""
MAX_PATH = 4096
"""Characters in a filesystem path (``Work.memory``, ``Located.mount``)."""
MAX_TEXT = 1 << 20
"""Characters in a sentence or a traceback (``why``, ``traceback``)."""
MAX_NODES = 10_000
"""Nodes in one recipe; also entries in ``Done.produced`` and digests in ``Send``."""
MAX_SHAPE = 100_000
"""Pieces (steps and groups) in one shape."""
MAX_SHAPE_DEPTH = 64
"""Groups inside groups in one shape."""
MAX_FACT = 256
"""Entries in one fact."""
MAX_FACT_TEXT = 64 << 10
"""Characters in one value of a fact (its field names are names: ``MAX_NAME``)."""
MAX_HOSTS = 10_000
"""Hosts in a ``Listed``, and codec kinds in a ``Runtime``."""

_MAX_REF = 2**63 - 1  # refs and durations are non-negative 64-bit integers
_MAX_VERSION = 100  # characters in a version string
_MAX_DEVICE = 100  # characters in a device string ("cuda:0")

_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_PYTHON = re.compile(r"[0-9]{1,4}\.[0-9]{1,4}")
_MODES = ("", "project", "network")
_SOURCES = ("project", "network")
_PATHS = ("inprocess", "direct", "relayed", "mount")
_LISTED = ("inprocess", "project", "network")


# -- the messages ------------------------------------------------------------------------


@dataclass(frozen=True)
class Runtime:
    """What a side states about itself in ``Hello`` and ``Ready``."""

    wire: int
    """The wire version it speaks (``WIRE_VERSION``)."""
    python: str
    """Python's major.minor version, like ``"3.11"``."""
    somatize: str
    """somatize's version."""
    cloudpickle: str
    """cloudpickle's version, or ``""`` where it cannot be imported."""
    kinds: tuple[str, ...]
    """The codec kinds this side can read (``codec.readable_kinds()``)."""
    mode: str = ""
    """A worker's packing mode, ``"project"`` or ``"network"``; ``""`` when it has none."""

    @classmethod
    def here(cls, mode: str = "") -> Runtime:
        """This process's runtime; ``mode`` is the packing mode it works in, if any."""
        if mode not in _MODES:
            raise ValueError(
                f'a runtime\'s mode is "project", "network" or "" (none); it was given {_shown(mode)}'
            )
        return cls(
            wire=WIRE_VERSION,
            python=f"{sys.version_info.major}.{sys.version_info.minor}",
            somatize=_somatize_version(),
            cloudpickle=_cloudpickle_version(),
            kinds=tuple(readable_kinds()),
            mode=mode,
        )


@dataclass(frozen=True)
class NodeSpec:
    """How one node of a remote group travels.

    In project mode ``target`` is ``"package.module:Qualname"`` and the worker imports it
    and calls it with ``args`` / ``kwargs``; in network mode ``target`` is the digest of a
    cloudpickle artifact (``"sha256:<64 hex>"``) that holds the node, and there are no
    arguments.
    """

    label: str
    """What facts call the node."""
    cache: bool
    """Its output is to be returned in ``Done.produced``."""
    source: str
    """``"project"`` or ``"network"``."""
    target: str
    """``"package.module:Qualname"`` (project) or ``"sha256:<64 hex>"`` (network)."""
    args: tuple = ()
    """Constructor positional arguments, any values the codec writes (project only)."""
    kwargs: dict = field(default_factory=dict)
    """Constructor keyword arguments, keyed by str (project only)."""


@dataclass(frozen=True)
class Recipe:
    """A remote group: its nodes and how they are wired.

    ``shape`` is ``("step", i)``, ``("seq", (shape, ...))`` or ``("par", (shape, ...))``
    with ``i`` an index into ``nodes`` (as :mod:`somatize.graph` lays a graph out); every
    node is used at least once.
    """

    nodes: tuple[NodeSpec, ...]
    shape: tuple


# Requests ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hello:
    """The first message on a connection: who is speaking. Answered ``Ready`` or ``Refused``.

    A worker dialing in to a broker names the host it serves in ``offering``.
    """

    runtime: Runtime
    offering: str | None = None


@dataclass(frozen=True)
class Provision:
    """A network-mode artifact the worker asked for with ``Send``. Answered ``Ready``.

    The artifact travels as frame 1, untouched; ``decode`` does not check it against
    ``digest`` (the receiver does, before trusting it).
    """

    digest: str
    artifact: bytes | memoryview = field(repr=False)


@dataclass(frozen=True)
class Work:
    """Run a recipe on ``input``. Answered by any number of ``Saw``, then one of ``TERMINAL``
    (or ``Send``, when the worker lacks artifacts; the client provisions and sends again)."""

    ref: int
    """The caller's number for this exchange, echoed in every answer (0 <= ref < 2**63)."""
    recipe: Recipe
    input: Any
    """The value entering the group: anything the codec writes."""
    keys: dict[int, str] = field(default_factory=dict)
    """Node index -> the cache key (``"sha256:..."``) of that node's output."""
    placement: dict[int, str] = field(default_factory=dict)
    """Node index -> the device it runs on (``.on(...)``)."""
    memory: str | None = None
    """A store path the worker can also see, or None."""
    watched: bool = True
    """Whether anyone watches this work's facts; when nobody does, no ``Saw`` is sent."""


@dataclass(frozen=True)
class Where:
    """To a broker: where is ``host``? Answered ``Located`` or ``Refused``.

    ``lost=True``: the client just lost that host; the broker may say how it ended.
    """

    host: str
    lost: bool = False


@dataclass(frozen=True)
class Hosts:
    """To a broker: which hosts do you know? Answered ``Listed``."""


@dataclass(frozen=True)
class Bye:
    """A side says it is leaving (a dialed-in worker leaving its broker, a client closing)."""


# Answers -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ready:
    """``Hello`` or ``Provision`` accepted; the answering side states its runtime."""

    runtime: Runtime


@dataclass(frozen=True)
class Send:
    """The worker lacks these artifacts to run Work ``ref``: ``Provision`` them, then resend."""

    ref: int
    digests: tuple[str, ...]


@dataclass(frozen=True)
class Refused:
    """Not done, and why, as a sentence a person can act on. ``ref`` is the Work it ends,
    when it answers one."""

    why: str
    ref: int | None = None


@dataclass(frozen=True)
class Done:
    """Work ``ref`` finished: its output, what its cached nodes produced (node index ->
    value), and how long it ran, in whole microseconds."""

    ref: int
    output: Any
    produced: dict[int, Any]
    took_us: int


@dataclass(frozen=True)
class Failed:
    """Work ``ref`` broke. ``node`` is the label of the node that raised (None when the
    trouble was the worker's own), ``error`` the exception's type name, ``traceback`` its
    text. Never a pickled exception."""

    ref: int
    why: str
    node: str | None
    error: str
    traceback: str


@dataclass(frozen=True)
class Saw:
    """A fact from Work ``ref``, while it runs."""

    ref: int
    fact: dict[str, str]


@dataclass(frozen=True)
class Located:
    """Where a host is, as a broker sees it.

    ``path`` is ``"inprocess"``, ``"direct"``, ``"relayed"`` or ``"mount"``; ``address`` the
    worker's endpoint (direct, mount) or the broker's (relayed); ``mode`` its packing mode;
    ``mount`` the shared directory, for ``"mount"`` only; ``ended`` how a lost worker ended
    (``"killed by SIGKILL"``), when known; ``key`` the worker's CURVE public key (Z85, 40
    characters) when it listens with one, so the client can check whom it reached.
    """

    host: str
    path: str
    address: str = ""
    mode: str = ""
    mount: str | None = None
    ended: str | None = None
    key: str = ""


@dataclass(frozen=True)
class Listed:
    """The hosts a broker knows: name -> ``"inprocess"``, ``"project"`` or ``"network"``."""

    hosts: dict[str, str]


Request = Hello | Provision | Work | Where | Hosts | Bye
Answer = Ready | Send | Refused | Done | Failed | Saw | Located | Listed
REQUESTS = (Hello, Provision, Work, Where, Hosts, Bye)
ANSWERS = (Ready, Send, Refused, Done, Failed, Saw, Located, Listed)
TERMINAL = (Done, Failed, Refused)
"""What ends a Work exchange."""

_VARIANTS: dict[str, type] = {cls.__name__: cls for cls in REQUESTS + ANSWERS}
_FIELDS: dict[type, tuple[str, ...]] = {
    cls: tuple(f.name for f in dataclasses.fields(cls))
    for cls in (*REQUESTS, *ANSWERS, Runtime, NodeSpec, Recipe)
}


# -- compatibility -----------------------------------------------------------------------


def compatible(
    mine: Runtime,
    theirs: Runtime,
    *,
    needs_pickle: bool,
    me: str = "this side",
    them: str = "the other side",
) -> str | None:
    """None when two sides can talk, else a sentence saying which side must change what.

    The wire version has to be the same; a different somatize version alone is fine (the
    wire version is what changes when messages do). ``needs_pickle`` (network mode, where
    code travels as cloudpickle artifacts) also needs the same Python major.minor and the
    same cloudpickle version on both sides, because pickled code is bytecode. Codec kinds
    are not compared here: they are checked per value (``peek_kinds``). ``me`` and ``them``
    are how the sentence names the two sides (``"this worker"``, ``"the client"``).
    """
    if mine.wire != theirs.wire:
        older = me if mine.wire < theirs.wire else them
        return (
            f"{me} speaks wire version {mine.wire} (somatize {mine.somatize}) and {them} "
            f"speaks version {theirs.wire} (somatize {theirs.somatize}): upgrade somatize on "
            f"{older}, the older one"
        )
    if needs_pickle:
        lacking = [side for side, rt in ((me, mine), (them, theirs)) if not rt.cloudpickle]
        if lacking:
            return (
                f"network mode packs code with cloudpickle, and {' and '.join(lacking)} cannot "
                f'import it: pip install cloudpickle there, or use mode="project"'
            )
        if mine.python != theirs.python or mine.cloudpickle != theirs.cloudpickle:
            return (
                f"{me} runs Python {mine.python} and cloudpickle {mine.cloudpickle}, {them} "
                f"Python {theirs.python} and cloudpickle {theirs.cloudpickle}: network mode "
                f"unpickles code, which needs the same Python minor version and cloudpickle "
                f'version on both sides; install matching versions or use mode="project"'
            )
    return None


def _somatize_version() -> str:
    try:  # read at call time: by then the package has finished importing
        from . import __version__

        return str(__version__)
    except ImportError:
        from importlib import metadata

        try:
            return metadata.version("somatize")
        except metadata.PackageNotFoundError:
            return ""


def _cloudpickle_version() -> str:
    try:
        import cloudpickle
    except ImportError:
        return ""
    return str(getattr(cloudpickle, "__version__", ""))


# -- encode ------------------------------------------------------------------------------


def encode(msg: Request | Answer) -> list[bytes | memoryview]:
    """The frames of ``msg``: the header, then the buffers its values point to.

    Array data is not copied: its frames are views of the arrays, so leave them alone
    until the frames are sent. Raises ``TypeError`` / ``ValueError`` for a message built
    wrongly (a field of the wrong type, a negative ref, a label over ``MAX_NAME``), and the
    codec's ``Unwritable`` / ``BadCodec`` for a value that cannot be written down.
    """
    try:
        _check(msg)
    except _Bad as exc:
        raise exc.kind(exc.why) from None
    cls = type(msg)
    header: dict[str, Any] = {"v": WIRE_VERSION, "t": cls.__name__}
    frames: list[bytes | memoryview] = []
    if cls is Work or cls is Done:
        descriptor, frames = _encode_values(tuple(_values_of(msg)))
        parts = iter(descriptor[1:])  # ["T", one descriptor per value, in that order]
        header.update(_work_header(msg, parts) if cls is Work else _done_header(msg, parts))
    else:
        for name in _header_fields(cls):
            header[name] = _plain(getattr(msg, name))
        if cls is Provision:
            frames = [_byte_view(msg.artifact)]
    packed = msgpack.packb(header, use_bin_type=True)
    if len(packed) > MAX_HEADER:
        raise ValueError(
            f"this `{cls.__name__}` has a header of {len(packed):,} bytes, over the "
            f"{MAX_HEADER:,} any reader accepts: put bulk data in NumPy arrays or bytes over "
            f"64 KiB, which travel as frames rather than in the header"
        )
    if len(frames) + 1 > MAX_FRAMES:
        raise ValueError(
            f"this `{cls.__name__}` needs {len(frames) + 1:,} frames, over the {MAX_FRAMES:,} any "
            f"reader accepts: gather many small arrays into fewer large ones"
        )
    total = len(packed)
    for f in frames:
        size = memoryview(f).nbytes
        total += size
        if size > MAX_FRAME:
            raise ValueError(
                f"this `{cls.__name__}` holds a buffer of {size:,} bytes, over the {MAX_FRAME:,} "
                f"one frame may hold: split it"
            )
    if total > MAX_TOTAL:
        raise ValueError(
            f"this `{cls.__name__}` is {total:,} bytes, over the {MAX_TOTAL:,} one message may be: "
            f"split the work"
        )
    return [packed, *frames]


def _values_of(msg: Work | Done) -> list[Any]:
    """The values of a message, in the order its header holds their descriptors."""
    if isinstance(msg, Work):
        out = [msg.input]
        for node in msg.recipe.nodes:
            out += [node.args, node.kwargs]
        return out
    return [msg.output, *msg.produced.values()]


def _work_header(msg: Work, parts: Any) -> dict[str, Any]:
    fields = {"ref": msg.ref}
    recipe = msg.recipe
    fields["input"] = next(parts)
    nodes = []
    for n in recipe.nodes:
        nodes.append(
            {
                "label": n.label,
                "cache": n.cache,
                "source": n.source,
                "target": n.target,
                "args": next(parts),
                "kwargs": next(parts),
            }
        )
    fields["recipe"] = {"nodes": nodes, "shape": _plain(recipe.shape)}
    fields["keys"] = [[i, k] for i, k in msg.keys.items()]
    fields["placement"] = [[i, d] for i, d in msg.placement.items()]
    fields["memory"] = msg.memory
    fields["watched"] = msg.watched
    return fields


def _done_header(msg: Done, parts: Any) -> dict[str, Any]:
    return {
        "ref": msg.ref,
        "output": next(parts),
        "produced": [[i, next(parts)] for i in msg.produced],
        "took_us": msg.took_us,
    }


def _header_fields(cls: type) -> tuple[str, ...]:
    """The fields a variant's header holds: all of them, but the artifact (frame 1)."""
    return tuple(n for n in _FIELDS[cls] if n != "artifact") if cls is Provision else _FIELDS[cls]


def _plain(x: Any) -> Any:
    """A checked field as MessagePack takes it: dataclasses become maps, tuples lists."""
    if dataclasses.is_dataclass(x):
        return {name: _plain(getattr(x, name)) for name in _FIELDS[type(x)]}
    if isinstance(x, (tuple, list)):
        return [_plain(v) for v in x]
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    return x


def _byte_view(data: Any) -> bytes | memoryview:
    if type(data) is bytes:
        return data
    mv = memoryview(data)
    if mv.ndim != 1 or mv.format != "B":
        mv = mv.cast("B")
    return mv


# -- decode ------------------------------------------------------------------------------


def decode(frames: Sequence[Any]) -> Request | Answer:
    """The message that ``frames`` (one whole multipart message) hold.

    Frames are bytes-like, or objects with a ``.buffer`` (a ``zmq.Frame``). Everything is
    checked before any value is built: the limits, the header, every field, and that the
    frames after the header are exactly the ones its values use. Arrays decoded from
    read-only frames are copies; from writable frames, views. ``Provision.artifact`` is
    frame 1 itself (the same ``bytes``, or a ``memoryview``).

    Raises :class:`~somatize.errors.ProtocolError` and nothing else for anything malformed,
    including a value of a kind this process cannot read; ``TypeError`` when ``frames`` is
    not a sequence of buffers at all (a bug here, not the peer's doing).
    """
    msg, descriptors, buffers, _ = _read(frames)
    if not descriptors:
        return msg
    try:
        values = _decode_values(["T", *descriptors], buffers[1:])
    except Unreadable as exc:
        # the codec counts frames from the first after the header
        counted = " (frames counted from the first after the header)" if "frame" in str(exc) else ""
        raise ProtocolError(
            f"the values of a `{type(msg).__name__}` could not be read{counted}: {exc}"
        ) from exc
    return _fill(msg, values)


def peek_kinds(frames: Sequence[Any]) -> set[str]:
    """The codec kinds the values of a message use, read from its header alone.

    Checks everything ``decode`` checks except the values themselves, and builds nothing,
    so a worker can refuse a ``Work`` it cannot read before it tries::

        missing = peek_kinds(frames) - set(readable_kinds())
        if missing: ...  # Refused("this worker cannot read values of kind `x`: ...")

    (``decode`` would refuse such a message too, with a ``ProtocolError`` naming the kind.)
    Raises ``ProtocolError`` for anything malformed.
    """
    return _read(frames)[3]


class _Slot:
    """Where a value will go, while the header is being checked: its place among the
    message's values and its descriptor."""

    __slots__ = ("index", "descriptor")

    def __init__(self, index: int, descriptor: Any) -> None:
        self.index = index
        self.descriptor = descriptor

    def __repr__(self) -> str:
        return f"<value {self.index}>"


def _read(frames: Sequence[Any]) -> tuple[Any, list[Any], list[Any], set[str]]:
    """Check a message's frames, header and fields; return the message (values still
    ``_Slot``s), the descriptors of its values, its frames as buffers, and the codec kinds
    its values use."""
    buffers = _buffers(frames)
    try:
        header = _header(buffers[0])
        cls = _variant(header)
        descriptors: list[Any] = []
        msg = _PARSERS.get(cls, _parse_flat)(cls, header, descriptors)
        _check(msg)
    except _Bad as exc:
        raise ProtocolError(exc.why) from None
    after = len(buffers) - 1
    name = cls.__name__
    if cls is Provision:
        if after != 1:
            raise ProtocolError(
                f"a `Provision` is two frames, the header and the artifact; this one has {after + 1}"
            )
        return dataclasses.replace(msg, artifact=buffers[1]), descriptors, buffers, set()
    if not descriptors:
        if after:
            raise ProtocolError(
                f"a `{name}` is one frame, its header; this one has {after} more, which nothing uses"
            )
        return msg, descriptors, buffers, set()
    kinds, used = _kinds(descriptors)
    beyond = [i for i in used if i >= after]
    if beyond:
        raise ProtocolError(
            f"the values of this `{name}` use frame {min(beyond) + 1} and it has only {after + 1} "
            f"frames: frames are missing (send all the frames of a message, header first)"
        )
    if len(used) != after:
        unused = min(set(range(after)) - used) + 1
        raise ProtocolError(
            f"this `{name}` has {after} frames after its header and its values use {len(used)}: "
            f"frame {unused} belongs to no value (a frame from another message?)"
        )
    return msg, descriptors, buffers, kinds


def _buffers(frames: Sequence[Any]) -> list[Any]:
    if isinstance(frames, (str, bytes, bytearray, memoryview)) or not isinstance(frames, Sequence):
        raise TypeError(
            f"decode takes the frames of one message as a list of buffers; it was given a "
            f"`{type(frames).__name__}`"
        )
    n = len(frames)
    if n == 0:
        raise ProtocolError("a message has at least one frame, its header; this one has none")
    if n > MAX_FRAMES:
        raise ProtocolError(
            f"a message has at most {MAX_FRAMES:,} frames, and this one has {n:,}"
        )
    out: list[Any] = []
    total = 0
    for i, f in enumerate(frames):
        raw = getattr(f, "buffer", f) if not isinstance(f, (bytes, bytearray, memoryview)) else f
        if type(raw) is bytes:
            size = len(raw)
        else:
            try:
                raw = memoryview(raw)
            except TypeError:
                raise TypeError(
                    f"frame {i} is a `{type(f).__name__}`, not a buffer (bytes, a memoryview, "
                    f"a zmq.Frame)"
                ) from None
            if raw.ndim != 1 or raw.format != "B":
                if not raw.c_contiguous:
                    raise TypeError(f"frame {i} is not contiguous in memory")
                raw = raw.cast("B")
            size = raw.nbytes
        limit = MAX_HEADER if i == 0 else MAX_FRAME
        if size > limit:
            what = "the header (frame 0)" if i == 0 else f"frame {i}"
            raise ProtocolError(
                f"{what} is {size:,} bytes, over the {limit:,} this side accepts"
            )
        total += size
        if total > MAX_TOTAL:
            raise ProtocolError(
                f"this message is over {MAX_TOTAL:,} bytes in all, more than this side accepts"
            )
        out.append(raw)
    return out


class _Bad(Exception):
    """A check failed: ``why`` is the sentence; ``kind`` what ``encode`` raises with it."""

    def __init__(self, why: str, kind: type[Exception] = ValueError) -> None:
        super().__init__(why)
        self.why = why
        self.kind = kind


def _header(frame: Any) -> dict[str, Any]:
    size = len(frame)
    try:
        header = msgpack.unpackb(
            frame,
            raw=False,
            use_list=True,
            strict_map_key=True,
            ext_hook=_no_ext,
            object_pairs_hook=_map,
        )
    except _Bad:
        raise
    except Exception as exc:
        raise _Bad(
            f"a message must start with a MessagePack header map; frame 0 is {size:,} bytes "
            f"that are not one ({type(exc).__name__}: {str(exc)[:200]})"
        ) from None
    if type(header) is not dict:
        raise _Bad(
            f"a message must start with a MessagePack header map; frame 0 holds a "
            f"`{_msgpack_type(header)}` instead"
        )
    return header


def _no_ext(code: int, data: bytes) -> Any:
    raise _Bad(
        f"the header holds a MessagePack extension (type {code}); the wire uses none"
    )


def _map(pairs: list[tuple[Any, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if type(key) is not str:
            raise _Bad(
                f"a map in the header has a key that is `{_msgpack_type(key)}`; the wire's maps "
                f"are keyed by text"
            )
        if key in out:
            raise _Bad(f"a map in the header holds the key {_shown(key)} twice")
        out[key] = value
    return out


def _msgpack_type(x: Any) -> str:
    return {bytes: "bin", list: "array", dict: "map", str: "str", type(None): "nil"}.get(
        type(x), type(x).__name__
    )


def _variant(header: dict[str, Any]) -> type:
    v = header.get("v")
    if type(v) is not int:
        raise _Bad(
            "the header has no wire version `v` (a whole number): the sender does not speak "
            "somatize's wire"
        )
    if v != WIRE_VERSION:
        which = "this side" if v > WIRE_VERSION else "the side that sent it"
        shown = str(v) if abs(v) < 10**6 else "a far larger one"
        raise _Bad(
            f"this side speaks wire version {WIRE_VERSION} and the message is version {shown}: "
            f"upgrade somatize on the older side ({which})"
        )
    t = header.get("t")
    cls = _VARIANTS.get(t) if type(t) is str else None
    if cls is None:
        raise _Bad(
            f"the header's `t` names the kind of message, and {_shown(t)} is not one wire "
            f"version {WIRE_VERSION} has (it has {', '.join(sorted(_VARIANTS))})"
        )
    return cls


def _take(m: Any, cls: type, where: str) -> list[Any]:
    """The fields of ``cls`` from the map ``m``, all of them and nothing else (a message's
    own header also holds ``v`` and ``t``)."""
    if type(m) is not dict:
        raise _Bad(f"`{where}` has to be a map, and it is a `{_msgpack_type(m)}`")
    names = _header_fields(cls)
    extra = set(m) - set(names) - ({"v", "t"} if where == cls.__name__ else set())
    if extra:
        raise _Bad(
            f"`{where}` has no field {_shown(min(extra))} in wire version {WIRE_VERSION} "
            f"(its fields: {', '.join(names) or 'none'})"
        )
    for name in names:
        if name not in m:
            raise _Bad(f"`{where}` needs the field `{name}`, and this one has none")
    return [m[name] for name in names]


def _parse_flat(cls: type, h: dict[str, Any], descriptors: list[Any]) -> Any:
    values = _take(h, cls, cls.__name__)
    kwargs = dict(zip(_header_fields(cls), values))
    if cls is Hello or cls is Ready:
        kwargs["runtime"] = _parse_runtime(kwargs["runtime"], f"{cls.__name__}.runtime")
    elif cls is Send:
        kwargs["digests"] = _tupled(kwargs["digests"])
    elif cls is Provision:
        kwargs["artifact"] = b""  # frame 1, put in place by _read
    return cls(**kwargs)


def _parse_runtime(m: Any, where: str) -> Runtime:
    values = dict(zip(_FIELDS[Runtime], _take(m, Runtime, where)))
    values["kinds"] = _tupled(values["kinds"])
    return Runtime(**values)


def _parse_work(cls: type, h: dict[str, Any], descriptors: list[Any]) -> Work:
    ref, recipe, input_, keys, placement, memory, watched = _take(h, Work, "Work")
    input_slot = _slot(input_, descriptors)
    raw_nodes, shape = _take(recipe, Recipe, "Work.recipe")
    if type(raw_nodes) is not list:
        raise _Bad(f"`Work.recipe.nodes` has to be an array, and it is a `{_msgpack_type(raw_nodes)}`")
    if len(raw_nodes) > MAX_NODES:
        raise _Bad(f"`Work.recipe` has {len(raw_nodes):,} nodes, over the limit of {MAX_NODES:,}")
    nodes = []
    for i, raw in enumerate(raw_nodes):
        where = f"Work.recipe.nodes[{i}]"
        label, cache, source, target, args, kwargs = _take(raw, NodeSpec, where)
        _tagged(args, "T", f"{where}.args", "a tuple")
        _tagged(kwargs, "D", f"{where}.kwargs", "a dict")
        for k in range(1, len(kwargs), 2):
            if type(kwargs[k]) is not str:
                raise _Bad(f"`{where}.kwargs` has a key that is not a str")
        nodes.append(
            NodeSpec(label, cache, source, target, _slot(args, descriptors), _slot(kwargs, descriptors))
        )
    return Work(
        ref,
        Recipe(tuple(nodes), _tupled(shape, depth=0, count=[0])),
        input_slot,
        _pairs(keys, "Work.keys"),
        _pairs(placement, "Work.placement"),
        memory,
        watched,
    )


def _parse_done(cls: type, h: dict[str, Any], descriptors: list[Any]) -> Done:
    ref, output, produced, took_us = _take(h, Done, "Done")
    output_slot = _slot(output, descriptors)
    if type(produced) is list and len(produced) > MAX_NODES:
        raise _Bad(f"`Done.produced` has {len(produced):,} entries, over the limit of {MAX_NODES:,}")
    pairs = _pairs(produced, "Done.produced")
    return Done(ref, output_slot, {i: _slot(d, descriptors) for i, d in pairs.items()}, took_us)


def _parse_saw(cls: type, h: dict[str, Any], descriptors: list[Any]) -> Saw:
    ref, fact = _take(h, Saw, "Saw")
    if type(fact) is not dict:  # a map: _check looks at its entries
        raise _Bad(f"`Saw.fact` has to be a map, and it is a `{_msgpack_type(fact)}`")
    return Saw(ref, fact)


def _parse_listed(cls: type, h: dict[str, Any], descriptors: list[Any]) -> Listed:
    (hosts,) = _take(h, Listed, "Listed")
    if type(hosts) is not dict:
        raise _Bad(f"`Listed.hosts` has to be a map, and it is a `{_msgpack_type(hosts)}`")
    return Listed(hosts)


_PARSERS = {Work: _parse_work, Done: _parse_done, Saw: _parse_saw, Listed: _parse_listed}


def _slot(descriptor: Any, descriptors: list[Any]) -> _Slot:
    descriptors.append(descriptor)
    return _Slot(len(descriptors) - 1, descriptor)


def _tagged(d: Any, tag: str, where: str, what: str) -> None:
    if type(d) is not list or not d or d[0] != tag:
        raise _Bad(f"`{where}` has to be {what}, and its descriptor is not one")


def _tupled(x: Any, depth: int = 0, count: list[int] | None = None) -> Any:
    """Arrays as tuples, all the way down (for a shape: bounded in depth and size)."""
    if type(x) is not list:
        return x
    if count is not None:
        count[0] += len(x)
        if depth > 2 * MAX_SHAPE_DEPTH + 1 or count[0] > 2 * MAX_SHAPE:
            raise _Bad(
                f"`Work.recipe.shape` is over {MAX_SHAPE_DEPTH} groups deep or over "
                f"{MAX_SHAPE:,} pieces"
            )
        return tuple(_tupled(v, depth + 1, count) for v in x)
    return tuple(x)


def _pairs(x: Any, where: str) -> dict[int, Any]:
    """``[[index, value], ...]`` as a dict, refusing anything else."""
    if type(x) is not list:
        raise _Bad(
            f"`{where}` has to be an array of [index, value] pairs, and it is a "
            f"`{_msgpack_type(x)}`"
        )
    out: dict[int, Any] = {}
    for pair in x:
        if type(pair) is not list or len(pair) != 2 or type(pair[0]) is not int:
            raise _Bad(f"`{where}` has to be an array of [index, value] pairs, and one entry is not")
        if pair[0] in out:
            raise _Bad(f"`{where}` gives node {pair[0]} twice")
        out[pair[0]] = pair[1]
    return out


def _kinds(descriptors: list[Any]) -> tuple[set[str], set[int]]:
    """The kinds the values use and the frames they point to (descriptor indices), checked
    by the codec's own descriptor checker, without building anything."""
    checker = _Checker(None)
    try:
        checker.node(["T", *descriptors], 0)
    except Unreadable as exc:
        raise ProtocolError(f"a value's descriptor in the header is malformed: {exc}") from exc
    return checker.kinds, checker.used


def _fill(msg: Any, values: tuple[Any, ...]) -> Any:
    if isinstance(msg, Work):
        nodes = tuple(
            dataclasses.replace(n, args=values[n.args.index], kwargs=values[n.kwargs.index])
            for n in msg.recipe.nodes
        )
        recipe = dataclasses.replace(msg.recipe, nodes=nodes)
        return dataclasses.replace(msg, recipe=recipe, input=values[msg.input.index])
    produced = {i: values[s.index] for i, s in msg.produced.items()}
    return dataclasses.replace(msg, output=values[msg.output.index], produced=produced)


# -- the checks, shared by encode (a message built here) and decode (one that arrived) ---


def _check(msg: Any) -> None:
    check = _CHECKS.get(type(msg))
    if check is None:
        raise _Bad(
            f"encode takes one of the wire's messages ({', '.join(sorted(_VARIANTS))}); it was "
            f"given a `{type(msg).__name__}`",
            TypeError,
        )
    check(msg)


def _check_hello(m: Hello) -> None:
    _runtime(m.runtime, "Hello.runtime")
    if m.offering is not None:
        _text(m.offering, "Hello.offering", MAX_NAME)


def _check_provision(m: Provision) -> None:
    _digest(m.digest, "Provision.digest")
    if not isinstance(m.artifact, (bytes, bytearray, memoryview)):
        raise _Bad(
            f"`Provision.artifact` has to be bytes or a memoryview, and it is {_a(m.artifact)}",
            TypeError,
        )


def _check_work(m: Work) -> None:
    _ref(m.ref, "Work.ref")
    recipe = m.recipe
    if not isinstance(recipe, Recipe):
        raise _Bad(f"`Work.recipe` has to be a `Recipe`, and it is {_a(recipe)}", TypeError)
    nodes = recipe.nodes
    if not isinstance(nodes, (tuple, list)):
        raise _Bad(f"`Work.recipe.nodes` has to be a tuple of `NodeSpec`, and it is {_a(nodes)}", TypeError)
    if not 1 <= len(nodes) <= MAX_NODES:
        raise _Bad(f"`Work.recipe` has {len(nodes):,} nodes; a recipe has 1 to {MAX_NODES:,}")
    for i, node in enumerate(nodes):
        _node(node, f"Work.recipe.nodes[{i}]")
    used: set[int] = set()
    _shape(recipe.shape, len(nodes), 0, used, [0])
    if len(used) != len(nodes):
        unused = min(set(range(len(nodes))) - used)
        raise _Bad(
            f"`Work.recipe.shape` never uses node {unused} ({_shown(nodes[unused].label)}); "
            f"a recipe holds only the nodes its shape runs"
        )
    _by_node(m.keys, "Work.keys", len(nodes), _digest)
    _by_node(m.placement, "Work.placement", len(nodes), lambda v, w: _text(v, w, _MAX_DEVICE))
    if m.memory is not None:
        _text(m.memory, "Work.memory", MAX_PATH)
    if type(m.watched) is not bool:
        raise _Bad(f"`Work.watched` has to be a bool, and it is {_a(m.watched)}", TypeError)


def _node(n: Any, where: str) -> None:
    if not isinstance(n, NodeSpec):
        raise _Bad(f"`{where}` has to be a `NodeSpec`, and it is {_a(n)}", TypeError)
    _text(n.label, f"{where}.label", MAX_NAME)
    _flag(n.cache, f"{where}.cache")
    _choice(n.source, f"{where}.source", _SOURCES)
    if n.source == "network":
        _digest(n.target, f"{where}.target")
        if not (_empty(n.args) and _empty(n.kwargs)):
            raise _Bad(
                f"`{where}` travels by network (an artifact) and has constructor arguments; "
                f"in network mode the node inside the artifact carries its own"
            )
    else:
        _qualname(n.target, f"{where}.target")
    if not isinstance(n.args, (_Slot, tuple)):
        raise _Bad(f"`{where}.args` has to be a tuple, and it is {_a(n.args)}", TypeError)
    if not isinstance(n.kwargs, _Slot):
        if not isinstance(n.kwargs, dict):
            raise _Bad(f"`{where}.kwargs` has to be a dict, and it is {_a(n.kwargs)}", TypeError)
        for k in n.kwargs:
            if not isinstance(k, str):
                raise _Bad(f"`{where}.kwargs` has a key that is {_a(k)}, not a str", TypeError)


def _empty(x: Any) -> bool:
    if isinstance(x, _Slot):
        return len(x.descriptor) == 1  # ["T"] or ["D"]
    return isinstance(x, (tuple, dict)) and not x


def _shape(s: Any, n: int, depth: int, used: set[int], count: list[int]) -> None:
    where = "Work.recipe.shape"
    count[0] += 1
    if count[0] > MAX_SHAPE:
        raise _Bad(f"`{where}` has over {MAX_SHAPE:,} pieces")
    if not isinstance(s, (tuple, list)) or len(s) != 2 or s[0] not in ("step", "seq", "par"):
        raise _Bad(
            f'`{where}` is built of ("step", i), ("seq", (...)) and ("par", (...)); it holds '
            f"something else"
        )
    kind, inner = s
    if kind == "step":
        if type(inner) is not int or not 0 <= inner < n:
            raise _Bad(f"`{where}` has a step that is not a node index from 0 to {n - 1}")
        used.add(inner)
        return
    if depth >= MAX_SHAPE_DEPTH:
        raise _Bad(f"`{where}` nests groups more than {MAX_SHAPE_DEPTH} deep")
    if not isinstance(inner, (tuple, list)) or not inner:
        raise _Bad(f'`{where}` has a "{kind}" that does not hold a non-empty tuple of shapes')
    for part in inner:
        _shape(part, n, depth + 1, used, count)


def _by_node(d: Any, where: str, n: int, check: Any) -> None:
    if not isinstance(d, dict):
        raise _Bad(f"`{where}` has to be a dict of node index -> str, and it is {_a(d)}", TypeError)
    for i, v in d.items():
        if type(i) is not int or not 0 <= i < n:
            raise _Bad(f"`{where}` names node {_shown(i)}, and the recipe's nodes are 0 to {n - 1}")
        check(v, f"{where}[{i}]")


def _check_where(m: Where) -> None:
    _text(m.host, "Where.host", MAX_NAME)
    _flag(m.lost, "Where.lost")


def _check_nothing(m: Any) -> None:
    pass


def _check_ready(m: Ready) -> None:
    _runtime(m.runtime, "Ready.runtime")


def _check_send(m: Send) -> None:
    _ref(m.ref, "Send.ref")
    if not isinstance(m.digests, (tuple, list)):
        raise _Bad(f"`Send.digests` has to be a tuple of digests, and it is {_a(m.digests)}", TypeError)
    if not 1 <= len(m.digests) <= MAX_NODES:
        raise _Bad(f"`Send.digests` holds {len(m.digests):,} digests; it holds 1 to {MAX_NODES:,}")
    for i, d in enumerate(m.digests):
        _digest(d, f"Send.digests[{i}]")


def _check_refused(m: Refused) -> None:
    _text(m.why, "Refused.why", MAX_TEXT, empty=True)
    if m.ref is not None:
        _ref(m.ref, "Refused.ref")


def _check_done(m: Done) -> None:
    _ref(m.ref, "Done.ref")
    if not isinstance(m.produced, dict):
        raise _Bad(
            f"`Done.produced` has to be a dict of node index -> value, and it is {_a(m.produced)}",
            TypeError,
        )
    if len(m.produced) > MAX_NODES:
        raise _Bad(f"`Done.produced` has {len(m.produced):,} entries, over the limit of {MAX_NODES:,}")
    for i in m.produced:
        if type(i) is not int or not 0 <= i < MAX_NODES:
            raise _Bad(
                f"`Done.produced` is keyed by node index (0 to {MAX_NODES - 1}), and one key "
                f"is {_shown(i)}"
            )
    _int(m.took_us, "Done.took_us", 0, _MAX_REF)


def _check_failed(m: Failed) -> None:
    _ref(m.ref, "Failed.ref")
    _text(m.why, "Failed.why", MAX_TEXT, empty=True)
    if m.node is not None:
        _text(m.node, "Failed.node", MAX_NAME)
    _text(m.error, "Failed.error", MAX_NAME)
    _text(m.traceback, "Failed.traceback", MAX_TEXT, empty=True)


def _check_saw(m: Saw) -> None:
    _ref(m.ref, "Saw.ref")
    if not isinstance(m.fact, dict):
        raise _Bad(f"`Saw.fact` has to be a dict of str -> str, and it is {_a(m.fact)}", TypeError)
    if len(m.fact) > MAX_FACT:
        raise _Bad(f"`Saw.fact` has {len(m.fact):,} entries, over the limit of {MAX_FACT}")
    for k, v in m.fact.items():
        _text(k, "a field name of `Saw.fact`", MAX_NAME)
        _text(v, f"Saw.fact[{_shown(k)}]", MAX_FACT_TEXT, empty=True)


_Z85 = set("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#")


def _check_located(m: Located) -> None:
    _text(m.host, "Located.host", MAX_NAME)
    _choice(m.path, "Located.path", _PATHS)
    _text(m.address, "Located.address", MAX_NAME, empty=True)
    _choice(m.mode, "Located.mode", _MODES)
    if m.path == "mount":
        if m.mount is None:
            raise _Bad('`Located.mount` names the shared directory, and a "mount" path has none')
        _text(m.mount, "Located.mount", MAX_PATH)
    elif m.mount is not None:
        raise _Bad(f'`Located.mount` is only for the "mount" path, and this path is "{m.path}"')
    if m.ended is not None:
        _text(m.ended, "Located.ended", MAX_NAME)
    _text(m.key, "Located.key", 40, empty=True)
    if m.key and (len(m.key) != 40 or not set(m.key) <= _Z85):
        raise _Bad("`Located.key` is a CURVE public key: 40 characters of Z85 text")


def _check_listed(m: Listed) -> None:
    if not isinstance(m.hosts, dict):
        raise _Bad(f"`Listed.hosts` has to be a dict of host -> how, and it is {_a(m.hosts)}", TypeError)
    if len(m.hosts) > MAX_HOSTS:
        raise _Bad(f"`Listed.hosts` has {len(m.hosts):,} entries, over the limit of {MAX_HOSTS:,}")
    for host, how in m.hosts.items():
        _text(host, "a host in `Listed.hosts`", MAX_NAME)
        _choice(how, f"Listed.hosts[{_shown(host)}]", _LISTED)


_CHECKS: dict[type, Any] = {
    Hello: _check_hello,
    Provision: _check_provision,
    Work: _check_work,
    Where: _check_where,
    Hosts: _check_nothing,
    Bye: _check_nothing,
    Ready: _check_ready,
    Send: _check_send,
    Refused: _check_refused,
    Done: _check_done,
    Failed: _check_failed,
    Saw: _check_saw,
    Located: _check_located,
    Listed: _check_listed,
}


def _runtime(r: Any, where: str) -> None:
    if not isinstance(r, Runtime):
        raise _Bad(f"`{where}` has to be a `Runtime`, and it is {_a(r)}", TypeError)
    _int(r.wire, f"{where}.wire", 0, 2**31 - 1)
    _text(r.python, f"{where}.python", _MAX_VERSION)
    if not _PYTHON.fullmatch(r.python):
        raise _Bad(f'`{where}.python` is a major.minor version like "3.11", and it is {_shown(r.python)}')
    _text(r.somatize, f"{where}.somatize", _MAX_VERSION, empty=True)
    _text(r.cloudpickle, f"{where}.cloudpickle", _MAX_VERSION, empty=True)
    if not isinstance(r.kinds, (tuple, list)):
        raise _Bad(f"`{where}.kinds` has to be a tuple of str, and it is {_a(r.kinds)}", TypeError)
    if len(r.kinds) > MAX_HOSTS:
        raise _Bad(f"`{where}.kinds` names {len(r.kinds):,} kinds, over the limit of {MAX_HOSTS:,}")
    for i, kind in enumerate(r.kinds):
        _text(kind, f"{where}.kinds[{i}]", MAX_NAME)
    _choice(r.mode, f"{where}.mode", _MODES)


# -- small checks ------------------------------------------------------------------------


def _a(x: Any) -> str:
    return f"a `{type(x).__name__}`"


def _shown(x: Any) -> str:
    """A short, safe picture of a header item for a sentence (never a long string)."""
    if isinstance(x, str):
        return repr(x) if len(x) <= 40 else f"a str of {len(x):,} characters"
    if type(x) is int:
        return str(x) if abs(x) < 10**12 else "a very large number"
    return _a(x)


def _int(x: Any, where: str, lo: int, hi: int) -> int:
    if not isinstance(x, int) or isinstance(x, bool):
        raise _Bad(f"`{where}` has to be a whole number, and it is {_a(x)}", TypeError)
    if not lo <= x <= hi:
        raise _Bad(f"`{where}` has to be from {lo} to {hi}, and it is {_shown(x)}")
    return x


def _ref(x: Any, where: str) -> None:
    _int(x, where, 0, _MAX_REF)


def _flag(x: Any, where: str) -> None:
    if not isinstance(x, bool):
        raise _Bad(f"`{where}` has to be True or False, and it is {_a(x)}", TypeError)


def _text(x: Any, where: str, limit: int, *, empty: bool = False) -> str:
    if not isinstance(x, str):
        raise _Bad(f"`{where}` has to be a str, and it is {_a(x)}", TypeError)
    if len(x) > limit:
        raise _Bad(f"`{where}` is {len(x):,} characters long, over the limit of {limit:,}")
    if not x and not empty:
        raise _Bad(f"`{where}` is empty, and it has to name something")
    if not x.isascii():
        try:
            x.encode("utf-8")
        except UnicodeEncodeError:
            raise _Bad(f"`{where}` holds a lone surrogate, which is not valid Unicode") from None
    return x


def _choice(x: Any, where: str, options: tuple[str, ...]) -> None:
    if not isinstance(x, str) or x not in options:
        words = ", ".join(f'"{o}"' for o in options)
        raise _Bad(f"`{where}` is one of {words}, and it is {_shown(x)}")


def _digest(x: Any, where: str) -> None:
    _text(x, where, MAX_NAME)
    if not _DIGEST.fullmatch(x):
        raise _Bad(
            f'`{where}` has to be "sha256:" and 64 lowercase hex digits, and it is {_shown(x)}'
        )


def _qualname(x: Any, where: str) -> None:
    _text(x, where, MAX_NAME)
    module, colon, qualname = x.partition(":")
    if not (
        colon
        and all(part.isidentifier() for part in module.split("."))
        and all(part.isidentifier() for part in qualname.split("."))
    ):
        raise _Bad(
            f'`{where}` names a class to import, like "package.module:Class", and it is '
            f"{_shown(x)}"
        )
