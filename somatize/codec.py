"""Values written down and read back: the codec layer.

A value becomes a *descriptor* (a small tree of MessagePack-able scalars and lists) and a
list of *frames* (raw buffers the descriptor points to by index), and back. The wire puts
the descriptor in its header and sends the frames after it; the store and the content keys
use the single-bytes *written form* of ``dumps`` / ``written_parts``. This module knows
nothing of transport or store, and it never pickles: a value nobody said how to write down
is refused with a sentence naming its type and the ``codec(...)`` call that would fix it.

Who writes a value, asked in this order: plain data; NumPy arrays and scalars; Arrow
``RecordBatch`` / ``Table`` (IPC stream); the registry that ``codec(...)`` fills. Plain data
means values whose type is *exactly* one of the builtins below: an ``IntEnum`` or a
``namedtuple`` goes to the registry and is refused without a codec, because writing it as
its base type would hand back something else. An ``Opaque`` crosses only through the
registry.

Descriptor layout. A scalar (None, bool, an int that fits 64 bits, float, str, bytes of at
most 64 KiB) stands for itself. A list is always a node whose first item is its tag:

    ["L", x, ...]              list                 ["T", x, ...]   tuple
    ["D", k, v, k, v, ...]     dict, keys scalar, in insertion order
    ["I", b"..."]              int beyond 64 bits (two's complement, big-endian)
    ["B", i]                   bytes over 64 KiB, held in frame i
    ["A", dtype, [n, ...], i]  NumPy array: ``dtype.str``, shape, C-order data in frame i
    ["N", dtype, b"..."]       NumPy scalar, its few bytes inline
    ["C", kind, i]             "arrow.RecordBatch" / "arrow.Table" (IPC stream), or a
                               registry kind whose ``dump`` wrote frame i
    ["O", kind, i]             an ``Opaque`` whose value a registry codec wrote to frame i

NumPy dtypes written: bool, int8..int64, uint8..uint64, float16/32/64, complex64/128, in
either byte order (kept). Strings, void, datetime and object dtypes are refused.

Written form: b"SMZ1", the length of the header (u32, little-endian), the header
(MessagePack ``[descriptor, [frame lengths]]``), then the frames, each starting on a
16-byte boundary of the written form (zero padding before it), so arrays read back aligned.
"""

from __future__ import annotations

import importlib
import importlib.util
import struct
import sys
import threading
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import msgpack
import numpy as np

from somatize.errors import BadCodec, CodecError, Unreadable, Unwritable

__all__ = [
    "MAX_DEPTH",
    "MAX_NDIM",
    "MAX_NODES",
    "Checked",
    "Opaque",
    "build",
    "check",
    "codec",
    "codecs_registered",
    "decode",
    "dumps",
    "encode",
    "forget",
    "kinds_in",
    "loads",
    "readable_kinds",
    "registry",
    "written_parts",
]

T = TypeVar("T")

# -- limits: a reader refuses anything beyond these before allocating -------------------

MAX_DEPTH = 64
"""Containers inside containers, at most (the outermost list, tuple or dict is level 1)."""

MAX_NODES = 1_000_000
"""Pieces in one descriptor (every scalar and every node), at most. Long runs of numbers
belong in a NumPy array, which is one piece however long it is."""

MAX_NDIM = 32
"""Dimensions of one array, at most."""

_INLINE_BYTES = 64 * 1024  # bytes longer than this travel as a frame, not in the header
_ALIGN = 16  # frames start on this boundary in the written form
_MAGIC = b"SMZ1"
_FIXED = struct.Struct("<4sI")
_ZEROS = bytes(_ALIGN)
_MAX_NBYTES = 2**63  # numpy's own ceiling for one array, checked with Python ints first

_INT_MIN = -(2**63)  # what MessagePack holds as a plain int
_INT_MAX = 2**64 - 1

_PLAIN = "plain"
_NDARRAY = "numpy.ndarray"
_NPSCALAR = "numpy.generic"
_ARROW_BATCH = "arrow.RecordBatch"
_ARROW_TABLE = "arrow.Table"
_ARROW_KINDS = frozenset({_ARROW_BATCH, _ARROW_TABLE})
# Asked before the registry on both ways, so nobody may register under these names.
_BUILTIN_KINDS = frozenset({_PLAIN, _NDARRAY, _NPSCALAR}) | _ARROW_KINDS

# The library's own codecs, imported by name when their bytes arrive first. Only these:
# somatize cannot guess which module of yours gives a kind of yours its meaning.
_OWN_KINDS = {"torch.Tensor": "somatize.torch"}

_SCALARS = (type(None), bool, int, float, str, bytes)
_KEY_TYPES = frozenset(_SCALARS)
_INLINE_TYPES = frozenset(_SCALARS)
# Builtins whose subclasses are refused rather than silently written as the base type.
_UNDERNEATH = (bool, int, float, str, bytes, bytearray, list, tuple, dict, np.ndarray)


def _allowed_dtypes() -> dict[str, np.dtype]:
    out = {}
    for code in ("b1", "i1", "u1"):
        d = np.dtype(code)
        out[d.str] = d
    for code in ("i2", "i4", "i8", "u2", "u4", "u8", "f2", "f4", "f8", "c8", "c16"):
        for order in "<>":
            d = np.dtype(order + code)
            out[d.str] = d
    return out


_DTYPES = _allowed_dtypes()
_DTYPE_WORDS = "bool, int8..int64, uint8..uint64, float16/32/64 and complex64/128"


# -- the registry ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Codec:
    kind: str
    type: type
    dump: Callable[[Any], bytes]
    load: Callable[[bytes], Any]


#: The library's own kinds whose `load` takes any buffer and copies what it keeps, so no
#: bytes are made for them first (a registered codec is promised bytes).
_TAKES_BUFFERS = frozenset({"torch.Tensor"})

_lock = threading.Lock()
# Replaced whole under the lock; readers take one dict lookup and never see half a change.
_by_kind: dict[str, _Codec] = {}
_by_type: dict[type, _Codec] = {}


def codec(
    kind: str, type_: type, *, dump: Callable[[T], bytes], load: Callable[[bytes], T]
) -> None:
    """Say how to write a ``type_`` down (``dump``) and read it back (``load``), under ``kind``.

    Call it in the module that defines the type, so that whoever can build one can also
    write one down. Name the kind after the type (``"myproject.Reading"``): it is written
    beside the bytes and kept as long as they are. Registering a kind again replaces it.
    """
    if not isinstance(kind, str) or not kind:
        raise BadCodec(
            f"a codec's kind has to be a non-empty str named after its type, like "
            f'"myproject.Reading"; it was given a `{type(kind).__name__}`'
            + (" that is empty" if isinstance(kind, str) else "")
        )
    if kind in _BUILTIN_KINDS:
        raise BadCodec(
            f"`{kind}` is one of somatize's built-in kinds, which are asked before the "
            f"registry: a codec under that name would change what bytes of that kind mean "
            f'rather than add a kind. Name yours after your type, like "myproject.Reading"'
        )
    if not isinstance(type_, type):
        raise BadCodec(
            f'codec("{kind}", ...) needs the class it writes down as its second argument; '
            f"it was given a `{type(type_).__name__}`"
        )
    if type_ is Opaque:
        raise BadCodec(
            f'codec("{kind}", Opaque, ...) would never be asked: an `Opaque` crosses through '
            f"the codec of the type it wraps, so register that type instead"
        )
    for name, fn in (("dump", dump), ("load", load)):
        if not callable(fn):
            raise BadCodec(
                f'codec("{kind}", {type_.__name__}, ...) needs `{name}` to be callable '
                f"(dump: one `{type_.__name__}` -> bytes, load: bytes -> one); "
                f"it was given a `{type(fn).__name__}`"
            )
    entry = _Codec(kind, type_, dump, load)
    global _by_kind, _by_type
    with _lock:
        by_kind = dict(_by_kind)
        by_type = {t: c for t, c in _by_type.items() if c.kind != kind}
        by_kind[kind] = entry
        by_type[type_] = entry
        _by_kind, _by_type = by_kind, by_type


def codecs_registered() -> list[str]:
    """The kinds registered with ``codec(...)`` in this process, sorted (built-ins aside)."""
    return sorted(_by_kind)


def registry() -> tuple[tuple[str, type, Callable[[Any], bytes], Callable[[bytes], Any]], ...]:
    """The registered codecs as ``(kind, type, dump, load)``, in registration order (for
    packing, which carries them to a network-mode worker, and which compares two of these
    item by item with ``is`` to tell whether the registry changed in between)."""
    return tuple((c.kind, c.type, c.dump, c.load) for c in _by_kind.values())


def forget(kind: str) -> None:
    """Drop a registered kind, so bytes of it are unreadable again (a test that registers
    its own kinds, a notebook that registered one by mistake). Unknown kinds are ignored."""
    global _by_kind, _by_type
    with _lock:
        _by_kind = {k: c for k, c in _by_kind.items() if k != kind}
        _by_type = {t: c for t, c in _by_type.items() if c.kind != kind}


def readable_kinds() -> list[str]:
    """Every kind this process can read: built-ins, the registry, and the library's own
    kinds it would import by name on arrival. Sorted."""
    kinds = {_PLAIN, _NDARRAY, _NPSCALAR}
    if importlib.util.find_spec("pyarrow") is not None:
        kinds |= _ARROW_KINDS
    kinds.update(_by_kind)
    kinds.update(_OWN_KINDS)
    return sorted(kinds)


def _codec_for_type(t: type) -> _Codec | None:
    by_type = _by_type
    entry = by_type.get(t)
    if entry is None and by_type:
        for base in t.__mro__[1:]:
            entry = by_type.get(base)
            if entry is not None:
                break
    return entry


def _codec_for_kind(kind: str) -> _Codec:
    entry = _by_kind.get(kind)
    if entry is not None:
        return entry
    module = _OWN_KINDS.get(kind)
    if module is None:
        raise Unreadable(
            f"bytes of kind `{kind}` arrived and nothing in this process reads that kind: "
            f'import the module that calls `codec("{kind}", ...)` before reading it '
            f"(somatize only imports its own codecs by name)"
        )
    extra = module.rsplit(".", 1)[-1]
    try:
        importlib.import_module(module)
    except ImportError as exc:
        raise Unreadable(
            f"bytes of kind `{kind}` arrived, and reading them needs `{module}`, which could "
            f"not be imported here ({type(exc).__name__}: {exc}): pip install somatize[{extra}]"
        ) from exc
    except Exception as exc:
        raise Unreadable(
            f"bytes of kind `{kind}` arrived, and importing `{module}` to read them raised "
            f"{type(exc).__name__}"
        ) from exc
    entry = _by_kind.get(kind)
    if entry is None:
        raise Unreadable(
            f"bytes of kind `{kind}` arrived and importing `{module}` did not register a "
            f"codec for it; this somatize is broken or mismatched: reinstall somatize[{extra}]"
        )
    return entry


# -- Opaque ------------------------------------------------------------------------------


class Opaque:
    """Something that exists in this process only: a tensor with its graph, a tokenizer, a
    connection. It crosses (to a wire, to a store) only through a codec registered for the
    type of ``value``; reading it back gives an ``Opaque`` around what that codec loads."""

    __slots__ = ("value",)
    __hash__ = None  # type: ignore[assignment]

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:  # the type only: contents never appear in a repr or message
        return f"Opaque(<{type(self.value).__qualname__}>)"

    def __eq__(self, other: object) -> Any:
        if not isinstance(other, Opaque):
            return NotImplemented
        return self.value == other.value


# -- writing -----------------------------------------------------------------------------


def _byte_view(obj: Any) -> memoryview | bytes:
    """A flat unsigned-byte view of a buffer, without a copy when it is contiguous."""
    mv = memoryview(obj)
    if not mv.c_contiguous:
        return mv.tobytes()
    if mv.ndim != 1 or mv.format != "B":
        mv = mv.cast("B")
    return mv


def _no_codec(t: type, holder: str = "") -> Unwritable:
    name = t.__name__
    text = (
        f"{holder or 'a'} `{name}` cannot leave this process: nothing says how to write one "
        f'down. Register it with `codec("a name", {name}, dump=..., load=...)`, which is what '
        f"`somatize.torch` does for a tensor on being imported"
    )
    for base in _UNDERNEATH:
        if issubclass(t, base):
            text += (
                f". It is a `{base.__name__}` underneath, but written down as one it would "
                f"come back as a plain `{base.__name__}`"
            )
            break
    return Unwritable(text)


class _Writer:
    __slots__ = ("frames", "nodes")

    def __init__(self) -> None:
        self.frames: list[memoryview | bytes] = []
        self.nodes = 0

    def frame(self, data: memoryview | bytes) -> int:
        self.frames.append(data)
        return len(self.frames) - 1

    def value(self, v: Any, depth: int) -> Any:
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise Unwritable(
                f"this value has more than {MAX_NODES:,} pieces (scalars and containers), "
                f"more than any reader accepts; put long runs of numbers in a NumPy array, "
                f"which travels as one piece"
            )
        t = type(v)
        if t is str:
            if not v.isascii():
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError:
                    raise Unwritable(
                        "a `str` holding a lone surrogate cannot be written down: it is not "
                        "valid Unicode, and the written form keeps strings as UTF-8"
                    ) from None
            return v
        if t is int:
            if _INT_MIN <= v <= _INT_MAX:
                return v
            return ["I", v.to_bytes((v.bit_length() + 8) // 8, "big", signed=True)]
        if t is float or t is bool or v is None:
            return v
        if t is list or t is tuple:
            if depth >= MAX_DEPTH:
                raise _too_deep()
            out: list[Any] = ["L" if t is list else "T"]
            for x in v:
                out.append(self.value(x, depth + 1))
            return out
        if t is dict:
            if depth >= MAX_DEPTH:
                raise _too_deep()
            out = ["D"]
            for k, x in v.items():
                if type(k) not in _KEY_TYPES:
                    raise Unwritable(
                        f"a dict key of type `{type(k).__name__}` cannot be written down: keys "
                        f"have to be None, bool, int, float, str or bytes, so that they come "
                        f"back as the same keys"
                    )
                if type(k) is bytes:  # keys stay in the header, whatever their length
                    self.nodes += 1
                    out.append(k)
                else:
                    out.append(self.value(k, depth + 1))
                out.append(self.value(x, depth + 1))
            return out
        if t is bytes:
            return v if len(v) <= _INLINE_BYTES else ["B", self.frame(v)]
        if t is bytearray or t is memoryview:
            data = _byte_view(v)
            return bytes(data) if len(data) <= _INLINE_BYTES else ["B", self.frame(data)]
        if t is np.ndarray:
            return self.array(v)
        return self.other(v, t)

    def array(self, a: np.ndarray) -> list[Any]:
        key = a.dtype.str
        if key not in _DTYPES:
            raise Unwritable(
                f"a NumPy array of dtype `{a.dtype}` cannot be written down: somatize writes "
                f"arrays of {_DTYPE_WORDS} (an object array would need pickle, which it never "
                f"uses). Convert it, or wrap it in a type of yours and register a codec for that"
            )
        if a.ndim > MAX_NDIM:
            raise Unwritable(
                f"a NumPy array with {a.ndim} dimensions cannot be written down: readers accept "
                f"at most {MAX_NDIM}"
            )
        if not a.flags.c_contiguous:
            a = a.copy(order="C")  # the one copy; a contiguous array is sent as it is
        data = a.reshape(-1).view(np.uint8).data
        return ["A", key, list(a.shape), self.frame(data)]

    def other(self, v: Any, t: type) -> list[Any]:
        if isinstance(v, np.generic) and t.__module__ == "numpy":
            key = v.dtype.str
            if key not in _DTYPES:
                raise Unwritable(
                    f"a NumPy scalar of dtype `{v.dtype}` cannot be written down: somatize "
                    f"writes NumPy scalars of {_DTYPE_WORDS}"
                )
            return ["N", key, v.tobytes()]
        if t.__module__.startswith("pyarrow"):
            pa, _ = _pyarrow()
            if t is pa.RecordBatch or t is pa.Table:
                kind = _ARROW_BATCH if t is pa.RecordBatch else _ARROW_TABLE
                return ["C", kind, self.frame(_arrow_dump(v))]
        if t is Opaque:
            inner = type(v.value)
            entry = _codec_for_type(inner)
            if entry is None:
                raise _no_codec(inner, holder="an `Opaque` holding a")
            return ["O", entry.kind, self.frame(_dump(entry, v.value))]
        entry = _codec_for_type(t)
        if entry is None:
            raise _no_codec(t)
        return ["C", entry.kind, self.frame(_dump(entry, v))]


def _too_deep() -> Unwritable:
    return Unwritable(
        f"this value nests containers more than {MAX_DEPTH} deep, deeper than any reader "
        f"accepts (or it contains itself)"
    )


def _dump(entry: _Codec, v: Any) -> memoryview | bytes:
    try:
        raw = entry.dump(v)
    except CodecError:
        raise  # the codec's own sentence (a sparse tensor: "call .to_dense()") says it best
    except Exception as exc:
        raise Unwritable(
            f"the codec for `{entry.kind}` raised {type(exc).__name__} while writing a "
            f"`{type(v).__name__}` down"
        ) from exc
    if type(raw) is bytes:
        return raw
    if isinstance(raw, (bytes, bytearray, memoryview)):
        return _byte_view(raw)
    raise BadCodec(
        f"the codec for `{entry.kind}` has to return bytes, and it returned a "
        f"`{type(raw).__name__}`"
    )


def encode(value: Any) -> tuple[Any, list[memoryview | bytes]]:
    """``value`` as ``(descriptor, frames)``: a tree of plain scalars and lists, and the raw
    buffers it points to by index. Contiguous arrays are not copied: their frames are views,
    so change the array after encoding and the frames change too.

    Raises ``Unwritable`` when nothing can write part of it down, ``BadCodec`` when a
    registered ``dump`` returns something other than bytes.
    """
    writer = _Writer()
    descriptor = writer.value(value, 0)
    return descriptor, writer.frames


def written_parts(value: Any) -> list[memoryview | bytes]:
    """The written form of ``value`` (``dumps``) as parts to hash or write one by one, so a
    large array is never joined into one more copy of itself."""
    descriptor, frames = encode(value)
    header = msgpack.packb([descriptor, [len(f) for f in frames]], use_bin_type=True)
    if len(header) > 0xFFFFFFFF:
        raise Unwritable(
            "this value's header (its scalars, strings and small bytes) is over 4 GiB; put "
            "bulk data in arrays or bytes, which travel as frames"
        )
    first = _FIXED.pack(_MAGIC, len(header)) + header
    pos = len(first)
    parts: list[memoryview | bytes] = []
    for f in frames:
        pad = -pos % _ALIGN
        if pad:
            if parts:
                parts.append(_ZEROS[:pad])
            else:
                first += _ZEROS[:pad]
        if not parts:
            parts.append(first)
        parts.append(f)
        pos += pad + len(f)
    return parts or [first]


def dumps(value: Any) -> bytes:
    """``value`` in its written form: one bytes object, what a store keeps and a key hashes."""
    return b"".join(written_parts(value))


# -- reading -----------------------------------------------------------------------------


def _frame_views(frames: Sequence[bytes | bytearray | memoryview]) -> list[memoryview]:
    if isinstance(frames, (str, bytes, bytearray, memoryview)) or not isinstance(frames, Sequence):
        raise Unreadable(
            f"frames have to be a sequence of buffers; they were a `{type(frames).__name__}`"
        )
    return [_bytes_of(f, f"frame {i}") for i, f in enumerate(frames)]


def _bytes_of(data: Any, what: str) -> memoryview:
    """``data`` as a flat, contiguous view of bytes, or ``Unreadable`` naming ``what``."""
    try:
        mv = memoryview(data)
    except TypeError:
        raise Unreadable(f"{what} is a `{type(data).__name__}`, not a buffer") from None
    if not mv.c_contiguous:
        raise Unreadable(f"{what} is not contiguous in memory")
    return mv if mv.ndim == 1 and mv.format == "B" else mv.cast("B")


class _Checker:
    """Walks a descriptor once and refuses anything malformed or over a limit, before any
    value is built. ``views`` is None when there are no frames to hold it against; when
    there are, what each frame has to hold is noted on the walk and checked after it
    (``frames_hold``), so a descriptor's own faults are named before its frames'."""

    __slots__ = ("views", "kinds", "used", "nodes", "holds")

    def __init__(self, views: list[memoryview] | None) -> None:
        self.views = views
        self.kinds: set[str] = set()
        self.used: set[int] = set()
        self.nodes = 0
        self.holds: list[tuple[Any, ...]] = []

    def frames_hold(self) -> None:
        """Each frame holds what its node says: an array's size and bools, Arrow's streams."""
        views = self.views
        for hold in self.holds:
            if hold[0] == "A":
                _, dt, shape, count, i = hold
                have = views[i].nbytes
                need = count * dt.itemsize
                if need != have:
                    raise Unreadable(
                        f"an array of dtype `{dt}` and shape {_shape_text(shape)} needs {need} "
                        f"bytes, and frame {i} holds {have}"
                    )
                if dt.kind == "b" and have and np.frombuffer(views[i], np.uint8).max() > 1:
                    raise Unreadable("a NumPy bool array holds bytes other than 0 or 1")
            else:
                _, kind, i = hold
                _arrow_check(kind, views[i])

    def count(self) -> None:
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise Unreadable(f"the descriptor has more than {MAX_NODES:,} pieces")

    def node(self, d: Any, depth: int) -> None:
        self.count()
        t = type(d)
        if t is not list:
            if t not in _INLINE_TYPES:
                raise Unreadable(
                    f"a descriptor is built of None, bool, int, float, str, bytes and lists; "
                    f"it held a `{t.__name__}`"
                )
            self.kinds.add(_PLAIN)
            return
        if not d:
            raise Unreadable("a descriptor node is an empty list; every node starts with its tag")
        tag = d[0]
        if tag == "L" or tag == "T":
            if depth >= MAX_DEPTH:
                raise Unreadable(f"the descriptor nests containers more than {MAX_DEPTH} deep")
            self.kinds.add(_PLAIN)
            for i in range(1, len(d)):
                self.node(d[i], depth + 1)
        elif tag == "D":
            if depth >= MAX_DEPTH:
                raise Unreadable(f"the descriptor nests containers more than {MAX_DEPTH} deep")
            if len(d) % 2 != 1:
                raise Unreadable("a dict node holds a key without a value")
            self.kinds.add(_PLAIN)
            seen: set[Any] = set()
            for i in range(1, len(d), 2):
                key = self.key(d[i])
                if key in seen:
                    raise Unreadable("a dict node holds the same key twice")
                seen.add(key)
                self.node(d[i + 1], depth + 1)
        elif tag == "I":
            self.big_int(d)
            self.kinds.add(_PLAIN)
        elif tag == "B":
            self.arity(d, 2, "bytes")
            self.frame(d[1], "bytes")
            self.kinds.add(_PLAIN)
        elif tag == "A":
            self.array(d)
            self.kinds.add(_NDARRAY)
        elif tag == "N":
            self.arity(d, 3, "NumPy scalar")
            dt = self.dtype(d[1])
            raw = d[2]
            if type(raw) is not bytes or len(raw) != dt.itemsize:
                raise Unreadable(f"a NumPy scalar of dtype `{dt}` needs {dt.itemsize} bytes")
            if dt.kind == "b" and raw[0] > 1:
                raise Unreadable("a NumPy bool scalar holds a byte other than 0 or 1")
            self.kinds.add(_NPSCALAR)
        elif tag == "C" or tag == "O":
            what = "codec" if tag == "C" else "Opaque"
            self.arity(d, 3, what)
            kind = d[1]
            if type(kind) is not str or not kind:
                raise Unreadable(f"a {what} node names its kind with a non-empty str")
            if kind in _BUILTIN_KINDS and (tag == "O" or kind not in _ARROW_KINDS):
                raise Unreadable(f"a {what} node cannot name the built-in kind `{kind}`")
            i = self.frame(d[2], what)
            if kind in _ARROW_KINDS and self.views is not None:
                self.holds.append(("C", kind, i))
            self.kinds.add(kind)
        else:
            shown = repr(tag) if type(tag) is str and len(tag) <= 8 else f"a `{type(tag).__name__}`"
            raise Unreadable(f"a descriptor node has the unknown tag {shown}")

    def key(self, k: Any) -> Any:
        self.count()
        t = type(k)
        if t in _INLINE_TYPES:
            return k
        if t is list and k and k[0] == "I":
            return self.big_int(k)
        raise Unreadable("a dict key in the descriptor is not a scalar")

    def big_int(self, d: list[Any]) -> int:
        self.arity(d, 2, "big int")
        raw = d[1]
        if type(raw) is not bytes or not raw:
            raise Unreadable("a big int node holds its value as non-empty bytes")
        return int.from_bytes(raw, "big", signed=True)

    def arity(self, d: list[Any], n: int, what: str) -> None:
        if len(d) != n:
            raise Unreadable(f"a {what} node has {len(d)} items instead of {n}")

    def dtype(self, s: Any) -> np.dtype:
        dt = _DTYPES.get(s) if type(s) is str else None
        if dt is None:
            shown = repr(s) if type(s) is str and len(s) <= 16 else f"a `{type(s).__name__}`"
            raise Unreadable(
                f"the dtype {shown} is not one somatize reads: it reads {_DTYPE_WORDS}, "
                f"in either byte order"
            )
        return dt

    def frame(self, i: Any, what: str) -> int:
        if type(i) is not int or i < 0:
            raise Unreadable(f"a {what} node points to a frame with something other than an index")
        if self.views is not None and i >= len(self.views):
            raise Unreadable(
                f"a {what} node points to frame {i}, and there are only {len(self.views)}: "
                f"frames are missing"
            )
        if i in self.used:
            raise Unreadable(f"frame {i} is pointed to twice; each frame holds one value")
        self.used.add(i)
        return i

    def array(self, d: list[Any]) -> None:
        self.arity(d, 4, "array")
        dt = self.dtype(d[1])
        shape = d[2]
        if type(shape) is not list or len(shape) > MAX_NDIM:
            raise Unreadable(f"an array's shape is a list of at most {MAX_NDIM} sizes")
        count, bound = 1, dt.itemsize
        for n in shape:
            if type(n) is not int or n < 0:
                raise Unreadable("an array's shape holds something other than a size >= 0")
            count *= n
            bound *= max(n, 1)  # numpy refuses when this passes its ceiling, zeros or not
            if bound >= _MAX_NBYTES:
                raise Unreadable(f"an array of shape {_shape_text(shape)} is too big to exist")
        i = self.frame(d[3], "array")
        if self.views is not None:
            self.holds.append(("A", dt, shape, count, i))


def _shape_text(shape: list[Any]) -> str:
    return "(" + ", ".join(str(n) for n in shape[:MAX_NDIM]) + ")"


class _Reader:
    """Builds a value from a descriptor that ``_Checker`` has passed."""

    __slots__ = ("views", "frames", "codecs")

    def __init__(self, views: list[memoryview], frames: Sequence[Any], codecs: dict[str, _Codec]):
        self.views = views
        self.frames = frames
        self.codecs = codecs

    def value(self, d: Any) -> Any:
        if type(d) is not list:
            return d
        tag = d[0]
        if tag == "L":
            return [self.value(d[i]) for i in range(1, len(d))]
        if tag == "T":
            return tuple([self.value(d[i]) for i in range(1, len(d))])
        if tag == "D":
            return {self.value(d[i]): self.value(d[i + 1]) for i in range(1, len(d), 2)}
        if tag == "I":
            return int.from_bytes(d[1], "big", signed=True)
        if tag == "B":
            return self.views[d[1]].tobytes()
        if tag == "A":
            dt = _DTYPES[d[1]]
            mv = self.views[d[3]]
            flat = np.frombuffer(mv, dt)
            if mv.readonly:
                flat = flat.copy()  # the one copy: returned arrays are always writable
            return flat.reshape(d[2])
        if tag == "N":
            return np.frombuffer(d[2], _DTYPES[d[1]])[0]
        kind, i = d[1], d[2]
        if kind in _ARROW_KINDS:
            return _arrow_load(kind, self.views[i])
        entry = self.codecs[kind]
        raw = self.frames[i]
        if kind in _TAKES_BUFFERS:
            raw = self.views[i]  # the library's own loader copies once itself
        elif type(raw) is not bytes:  # `load` is promised bytes
            raw = self.views[i].tobytes()
        try:
            loaded = entry.load(raw)
        except Exception as exc:
            raise Unreadable(
                f"the codec for `{kind}` raised {type(exc).__name__} while reading its bytes"
            ) from exc
        return Opaque(loaded) if tag == "O" else loaded


class Checked:
    """A descriptor that :func:`check` has passed, with what it found: the kinds its values
    use and the frames they point to. :func:`build` takes one and checks nothing again."""

    __slots__ = ("descriptor", "frames", "views", "kinds", "used")

    def __init__(self, descriptor: Any, frames: Any, views: list[memoryview] | None, checker: _Checker):
        self.descriptor = descriptor
        self.frames = frames
        self.views = views
        self.kinds: frozenset[str] = frozenset(checker.kinds)
        """The kinds the values use (``"plain"``, ``"numpy.ndarray"``, a registered kind...)."""
        self.used: frozenset[int] = frozenset(checker.used)
        """The frames the values point to, by index."""

    def __repr__(self) -> str:
        return f"<Checked: kinds {sorted(self.kinds)}, {len(self.used)} frames>"


def check(descriptor: Any, frames: Sequence[bytes | bytearray | memoryview] | None) -> Checked:
    """Check a descriptor once, against its frames, building nothing: node shapes, limits,
    dtypes, frame indices (each frame used once), that every array's size matches its frame,
    and that Arrow bytes are an uncompressed IPC stream. Raises ``Unreadable``.

    With ``frames=None`` the descriptor alone is checked (what a receiver can know from a
    header before its frames matter), and the result cannot be built.
    """
    views = None if frames is None else _frame_views(frames)
    checker = _Checker(views)
    checker.node(descriptor, 0)
    checker.frames_hold()
    return Checked(descriptor, frames, views, checker)


def build(checked: Checked) -> Any:
    """The value that a descriptor :func:`check` passed with its frames stands for.

    Nothing is checked again; this is how a reader that checks first (the wire, before it
    answers anything) reads each value once. Raises ``Unreadable`` for a kind this process
    cannot read, or a registered codec's ``load`` that fails.
    """
    if type(checked) is not Checked or checked.views is None:
        raise TypeError("build takes what check(descriptor, frames) returned, with its frames")
    codecs = {}
    for kind in checked.kinds:
        if kind in _ARROW_KINDS:
            _pyarrow(kind)
        elif kind not in _BUILTIN_KINDS:
            codecs[kind] = _codec_for_kind(kind)
    try:
        return _Reader(checked.views, checked.frames, codecs).value(checked.descriptor)
    except Unreadable:
        raise
    except (ValueError, TypeError, MemoryError) as exc:  # checked above; a last guard
        raise Unreadable(f"the value could not be built: {type(exc).__name__}") from exc


def kinds_in(descriptor: Any) -> set[str]:
    """The kinds a descriptor uses, so a receiver can refuse what it cannot read before it
    reads anything. Raises ``Unreadable`` when the descriptor is malformed."""
    checker = _Checker(None)
    checker.node(descriptor, 0)
    return checker.kinds


def decode(descriptor: Any, frames: Sequence[bytes | bytearray | memoryview]) -> Any:
    """The value ``encode`` wrote as ``(descriptor, frames)``.

    The descriptor's nodes are lists (as MessagePack unpacks them with ``use_list=True``;
    tuples are refused). Everything is checked before anything is built: node shapes, frame
    indices (each frame used once), limits, dtypes, that every array's size matches its
    frame. Arrays are writable: views of writable frames, copies of read-only ones. Raises
    ``Unreadable`` and nothing else for anything malformed or of a kind this process cannot
    read.
    """
    if type(descriptor) in _INLINE_TYPES:  # the common small case: a bare scalar
        return descriptor
    return build(check(descriptor, frames))


def loads(data: bytes | bytearray | memoryview) -> Any:
    """The value whose written form ``data`` is. Frames are read in place: arrays are views
    of ``data`` when it is writable (a ``bytearray``), copies otherwise."""
    mv = _bytes_of(data, "what loads was given")
    total = mv.nbytes
    if total < _FIXED.size or mv[:4] != _MAGIC:
        raise Unreadable("these bytes are not somatize's written form: they do not start with SMZ1")
    header_len = _FIXED.unpack_from(mv)[1]
    end = _FIXED.size + header_len
    if end > total:
        raise Unreadable(
            f"the written form is cut short: its header needs {end} bytes and there are {total}"
        )
    try:
        header = msgpack.unpackb(
            mv[_FIXED.size : end],
            raw=False,
            use_list=True,
            strict_map_key=True,
            max_map_len=0,  # descriptors hold no maps
            ext_hook=_no_ext,
        )
    except Exception as exc:
        raise Unreadable(
            f"the written form's header is not valid MessagePack ({type(exc).__name__})"
        ) from exc
    if type(header) is not list or len(header) != 2 or type(header[1]) is not list:
        raise Unreadable("the written form's header is not [descriptor, [frame lengths]]")
    descriptor, lengths = header
    frames = []
    for i, n in enumerate(lengths):
        if type(n) is not int or n < 0:
            raise Unreadable(
                f"the written form's header gives frame {i} a length that is not a size"
            )
        start = end + (-end % _ALIGN)
        end = start + n
        if end > total:
            raise Unreadable(
                f"the written form is cut short: frame {i} ends at byte {end} and there are {total}"
            )
        frames.append(mv[start:end])
    if end != total:
        raise Unreadable(
            f"the written form holds {total - end} bytes more than its header accounts for"
        )
    return decode(descriptor, frames)


def _no_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"MessagePack extension type {code} is not part of a descriptor")


# -- Arrow, imported only when an Arrow value or Arrow bytes turn up ---------------------


def _pyarrow(kind: str = "") -> tuple[Any, Any]:
    try:
        import pyarrow
        import pyarrow.ipc
    except ImportError as exc:
        raise Unreadable(
            f"bytes of kind `{kind}` arrived and pyarrow is not installed here: "
            f"pip install somatize[arrow]"
        ) from exc
    return pyarrow, pyarrow.ipc


def _arrow_dump(v: Any) -> memoryview | bytes:
    pa, ipc = _pyarrow()
    sink = pa.BufferOutputStream()
    with ipc.new_stream(sink, v.schema) as writer:
        writer.write(v)
    return _byte_view(sink.getvalue())


def _arrow_check(kind: str, view: memoryview) -> None:
    """Refuse Arrow bytes that are not an uncompressed IPC stream, reading only each
    message's metadata. A compressed body states its own decompressed size, which is how
    66 KB could ask for gigabytes; this codec never writes compressed streams, so it reads
    none, and nothing is decompressed or allocated here."""
    pa, ipc = _pyarrow(kind)
    try:
        reader = ipc.MessageReader.open_stream(pa.py_buffer(view))
        while True:
            try:
                message = reader.read_next_message()
            except StopIteration:
                return
            what = _ipc_compressed(memoryview(message.metadata))
            if what:
                raise Unreadable(
                    f"bytes of kind `{kind}` are a {what}, which this side does not read: a "
                    f"compressed body names its own size once decompressed, so it is refused "
                    f"before anything is decompressed. Send the RecordBatch or Table itself: "
                    f"somatize writes it uncompressed"
                )
    except Unreadable:
        raise
    except Exception as exc:
        raise Unreadable(
            f"bytes of kind `{kind}` are not a valid Arrow IPC stream ({type(exc).__name__})"
        ) from exc


_SCHEMA, _DICTIONARY_BATCH, _RECORD_BATCH = 1, 2, 3  # Arrow's MessageHeader union


def _ipc_compressed(meta: memoryview) -> str:
    """What is wrong with an Arrow IPC message's metadata (a ``Message`` flatbuffer), or
    "" when nothing is: a compressed body, or a message that is no part of a stream of
    record batches. Field numbers are those of Arrow's ``Message.fbs``."""
    message = _fb_table(meta, _fb_u(meta, "<I", 0))
    at = _fb_field(meta, message, 1)  # header_type (the union's type byte)
    header_type = _fb_u(meta, "<B", message[0] + at) if at else 0
    if header_type == _SCHEMA:
        return ""
    if header_type not in (_DICTIONARY_BATCH, _RECORD_BATCH):
        return f"Arrow IPC message of type {header_type} (not a schema or a record batch)"
    header = _fb_child(meta, message, 2)
    if header_type == _DICTIONARY_BATCH:
        header = _fb_child(meta, header, 1)  # DictionaryBatch.data, a RecordBatch
    if _fb_field(meta, header, 3):  # RecordBatch.compression
        return "compressed Arrow IPC stream"
    return ""


def _fb_u(buf: memoryview, fmt: str, pos: int) -> int:
    size = struct.calcsize(fmt)
    if pos < 0 or pos + size > len(buf):
        raise ValueError("the IPC metadata points outside itself")
    return struct.unpack_from(fmt, buf, pos)[0]


def _fb_table(buf: memoryview, pos: int) -> tuple[int, int, int]:
    """A flatbuffer table at ``pos``: (its position, its vtable's, the vtable's length)."""
    vtable = pos - _fb_u(buf, "<i", pos)
    return pos, vtable, _fb_u(buf, "<H", vtable)


def _fb_field(buf: memoryview, table: tuple[int, int, int], n: int) -> int:
    """Where field ``n`` of a table sits, relative to the table; 0 when it is absent."""
    pos, vtable, length = table
    if 4 + 2 * n + 2 > length:
        return 0
    return _fb_u(buf, "<H", vtable + 4 + 2 * n)


def _fb_child(buf: memoryview, table: tuple[int, int, int], n: int) -> tuple[int, int, int]:
    """The table that field ``n`` (an offset) of ``table`` points to."""
    at = _fb_field(buf, table, n)
    if not at:
        raise ValueError("the IPC metadata lacks a table it needs")
    pos = table[0] + at
    return _fb_table(buf, pos + _fb_u(buf, "<I", pos))


def _arrow_load(kind: str, view: memoryview) -> Any:
    pa, ipc = _pyarrow(kind)
    try:
        reader = ipc.open_stream(pa.py_buffer(view))
        if kind == _ARROW_TABLE:
            out = reader.read_all()
        else:
            batches = list(reader)
            if len(batches) != 1:
                raise Unreadable(
                    f"bytes of kind `{kind}` hold {len(batches)} record batches instead of one"
                )
            out = batches[0]
        out.validate(full=True)  # do not trust the bytes: offsets, lengths, UTF-8
    except Unreadable:
        raise
    except Exception as exc:
        raise Unreadable(
            f"bytes of kind `{kind}` are not a valid Arrow IPC stream ({type(exc).__name__})"
        ) from exc
    return out


class _Module(types.ModuleType):
    """``somatize.codec`` is this module, and calling it registers a codec: the package
    exports the module, so ``import somatize.codec`` never finds a function in its place,
    and ``from somatize import codec; codec("kind", T, dump=..., load=...)`` still reads
    as the one call it is."""

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return codec(*args, **kwargs)

    __call__.__doc__ = codec.__doc__


sys.modules[__name__].__class__ = _Module
