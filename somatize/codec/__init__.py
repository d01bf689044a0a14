"""Values written down and read back: the codec layer.

A value becomes a *descriptor* (a small tree of MessagePack-able scalars and lists) and a
list of *frames* (raw buffers the descriptor points to by index), and back. The wire puts
the descriptor in its header and sends the frames after it; the store and the content keys
use the single-bytes *written form* of ``dumps`` / ``written_parts``. This package knows
nothing of transport or store, and it never pickles: a value nobody said how to write down
is refused with a sentence naming its type and the ``codec(...)`` call that would fix it.

Who writes a value, asked in this order: plain data; NumPy arrays and scalars; Arrow
``RecordBatch`` / ``Table`` (IPC stream); torch tensors; the registry that ``codec(...)``
fills. Plain data means values whose type is *exactly* one of the builtins below: an
``IntEnum`` or a ``namedtuple`` goes to the registry and is refused without a codec, because
writing it as its base type would hand back something else. An ``Opaque`` crosses only
through the registry.

Descriptor layout. A scalar (None, bool, an int that fits 64 bits, float, str, bytes of at
most 64 KiB) stands for itself. A list is always a node whose first item is its tag:

    ["L", x, ...]              list                 ["T", x, ...]   tuple
    ["D", k, v, k, v, ...]     dict, keys scalar, in insertion order
    ["I", b"..."]              int beyond 64 bits (two's complement, big-endian)
    ["B", i]                   bytes over 64 KiB, held in frame i
    ["A", dtype, [n, ...], i]  NumPy array: ``dtype.str``, shape, C-order data in frame i
    ["N", dtype, b"..."]       NumPy scalar, its few bytes inline
    ["X", dtype, [n, ...], i]  torch tensor: torch's dtype name ("bfloat16"), shape, the
                               elements' raw bits in C order, little-endian, in frame i
    ["C", kind, i]             "arrow.RecordBatch" / "arrow.Table" (IPC stream), or a
                               registry kind whose ``dump`` wrote frame i
    ["O", kind, i]             an ``Opaque`` whose value a registry codec wrote to frame i

NumPy dtypes written: bool, int8..int64, uint8..uint64, float16/32/64, complex64/128, in
either byte order (kept). Strings, void, datetime and object dtypes are refused. Tensor
dtypes written: bool, (u)int8..(u)int64, float16, bfloat16, float32/64, complex64/128,
float8_e4m3fn / float8_e5m2 (:mod:`.tensors`). Tensors written before they were built in
are ``["C", "torch.Tensor", i]`` with the SMZT bytes of ``somatize.torch``; those still read.

Written form: b"SMZ1", the length of the header (u32, little-endian), the header
(MessagePack ``[descriptor, [frame lengths]]``), then the frames, each starting on a
16-byte boundary of the written form (zero padding before it), so arrays read back aligned.

The modules: :mod:`.registered` (``codec(...)``, the registry, ``Opaque``), :mod:`.layout`
(limits and dtypes), :mod:`.writing` and :mod:`.reading` (descriptors and frames, the
written form), :mod:`.arrow`, :mod:`.tensors`. Import from ``somatize.codec``: the modules
are its implementation.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from .layout import MAX_DEPTH, MAX_NDIM, MAX_NODES
from .reading import START_BYTES, Checked, build, check, check_start, decode, kinds_in, loads
from .registered import Opaque, codec, codecs_registered, forget, readable_kinds, registry
from .writing import dumps, encode, written_parts

__all__ = [
    "MAX_DEPTH",
    "MAX_NDIM",
    "MAX_NODES",
    "START_BYTES",
    "Checked",
    "Opaque",
    "build",
    "check",
    "check_start",
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

Opaque.__module__ = __name__  # where users import it from


class _Module(types.ModuleType):
    """``somatize.codec`` is this package, and calling it registers a codec: the package
    exports the module, so ``import somatize.codec`` never finds a function in its place,
    and ``from somatize import codec; codec("kind", T, dump=..., load=...)`` still reads
    as the one call it is."""

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return codec(*args, **kwargs)

    __call__.__doc__ = codec.__doc__


sys.modules[__name__].__class__ = _Module
