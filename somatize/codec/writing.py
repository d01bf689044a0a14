"""Writing: a value becomes a descriptor and frames (``encode``), or its written form
(``written_parts``, ``dumps``). The layout is documented in the package's docstring.

Nothing is copied that does not have to be: a contiguous NumPy array or CPU tensor goes out
as a view of its own memory; a strided one is copied once. Nothing is pickled: a value no
built-in kind and no registered codec writes is refused with the ``codec(...)`` call that
would fix it.
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

from somatize.errors import BadCodec, CodecError, Unwritable

from . import arrow, tensors
from .layout import (
    ALIGN,
    ARROW_BATCH,
    ARROW_TABLE,
    DTYPE_WORDS,
    DTYPES,
    FIXED,
    INLINE_BYTES,
    INT_MAX,
    INT_MIN,
    KEY_TYPES,
    MAGIC,
    MAX_DEPTH,
    MAX_NDIM,
    MAX_NODES,
    TENSOR,
    UNDERNEATH,
    ZEROS,
    byte_view,
)
from .registered import Entry, Opaque, for_type


def no_codec(t: type, holder: str = "") -> Unwritable:
    name = t.__name__
    text = (
        f"{holder or 'a'} `{name}` cannot leave this process: nothing says how to write one "
        f'down. Register it with `codec("a name", {name}, dump=..., load=...)` in the module '
        f"that defines `{name}`, so that every process that can build one can write one down"
    )
    for base in UNDERNEATH:
        if issubclass(t, base):
            text += (
                f". It is a `{base.__name__}` underneath, but written down as one it would "
                f"come back as a plain `{base.__name__}`"
            )
            break
    return Unwritable(text)


class Writer:
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
            if INT_MIN <= v <= INT_MAX:
                return v
            return ["I", v.to_bytes((v.bit_length() + 8) // 8, "big", signed=True)]
        if t is float or t is bool or v is None:
            return v
        if t is list or t is tuple:
            if depth >= MAX_DEPTH:
                raise too_deep()
            out: list[Any] = ["L" if t is list else "T"]
            for x in v:
                out.append(self.value(x, depth + 1))
            return out
        if t is dict:
            if depth >= MAX_DEPTH:
                raise too_deep()
            out = ["D"]
            for k, x in v.items():
                if type(k) not in KEY_TYPES:
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
            return v if len(v) <= INLINE_BYTES else ["B", self.frame(v)]
        if t is bytearray or t is memoryview:
            data = byte_view(v)
            return bytes(data) if len(data) <= INLINE_BYTES else ["B", self.frame(data)]
        if t is np.ndarray:
            return self.array(v)
        return self.other(v, t)

    def array(self, a: np.ndarray) -> list[Any]:
        key = a.dtype.str
        if key not in DTYPES:
            raise Unwritable(
                f"a NumPy array of dtype `{a.dtype}` cannot be written down: somatize writes "
                f"arrays of {DTYPE_WORDS} (an object array would need pickle, which it never "
                f"uses). Convert it, or wrap it in a type of yours and register a codec for that"
            )
        if a.ndim > MAX_NDIM:
            raise Unwritable(
                f"a NumPy array with {a.ndim} dimensions cannot be written down: readers accept at most {MAX_NDIM}"
            )
        if not a.flags.c_contiguous:
            a = a.copy(order="C")  # the one copy; a contiguous array is sent as it is
        data = a.reshape(-1).view(np.uint8).data
        return ["A", key, list(a.shape), self.frame(data)]

    def other(self, v: Any, t: type) -> list[Any]:
        if isinstance(v, np.generic) and t.__module__ == "numpy":
            key = v.dtype.str
            if key not in DTYPES:
                raise Unwritable(
                    f"a NumPy scalar of dtype `{v.dtype}` cannot be written down: somatize "
                    f"writes NumPy scalars of {DTYPE_WORDS}"
                )
            return ["N", key, v.tobytes()]
        if t.__module__.startswith("pyarrow"):
            pa, _ = arrow.pyarrow_modules()
            if t is pa.RecordBatch or t is pa.Table:
                kind = ARROW_BATCH if t is pa.RecordBatch else ARROW_TABLE
                return ["C", kind, self.frame(arrow.dump(v))]
        torch = tensors.torch_or_none()
        if torch is not None and isinstance(v, torch.Tensor):
            entry = for_type(t)  # a codec of yours for a subclass of yours comes first
            if entry is None or entry.kind == TENSOR:
                name, shape, data = tensors.write(v)
                return ["X", name, shape, self.frame(data)]
        if t is Opaque:
            inner = type(v.value)
            entry = for_type(inner)
            if entry is None:
                raise no_codec(inner, holder="an `Opaque` holding a")
            return ["O", entry.kind, self.frame(dump_with(entry, v.value))]
        entry = for_type(t)
        if entry is None:
            raise no_codec(t)
        return ["C", entry.kind, self.frame(dump_with(entry, v))]


def too_deep() -> Unwritable:
    return Unwritable(
        f"this value nests containers more than {MAX_DEPTH} deep, deeper than any reader "
        f"accepts (or it contains itself)"
    )


def dump_with(entry: Entry, v: Any) -> memoryview | bytes:
    try:
        raw = entry.dump(v)
    except CodecError:
        raise  # the codec's own sentence (a sparse tensor: "call .to_dense()") says it best
    except Exception as exc:
        raise Unwritable(
            f"the codec for `{entry.kind}` raised {type(exc).__name__} while writing a `{type(v).__name__}` down"
        ) from exc
    if type(raw) is bytes:
        return raw
    if isinstance(raw, (bytes, bytearray, memoryview)):
        return byte_view(raw)
    raise BadCodec(f"the codec for `{entry.kind}` has to return bytes, and it returned a `{type(raw).__name__}`")


def encode(value: Any) -> tuple[Any, list[memoryview | bytes]]:
    """``value`` as ``(descriptor, frames)``: a tree of plain scalars and lists, and the raw
    buffers it points to by index. Contiguous arrays and CPU tensors are not copied: their
    frames are views, so change the array after encoding and the frames change too.

    Raises ``Unwritable`` when nothing can write part of it down, ``BadCodec`` when a
    registered ``dump`` returns something other than bytes.
    """
    writer = Writer()
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
    first = FIXED.pack(MAGIC, len(header)) + header
    pos = len(first)
    parts: list[memoryview | bytes] = []
    for f in frames:
        pad = -pos % ALIGN
        if pad:
            if parts:
                parts.append(ZEROS[:pad])
            else:
                first += ZEROS[:pad]
        if not parts:
            parts.append(first)
        parts.append(f)
        pos += pad + len(f)
    return parts or [first]


def dumps(value: Any) -> bytes:
    """``value`` in its written form: one bytes object, what a store keeps and a key hashes."""
    return b"".join(written_parts(value))
