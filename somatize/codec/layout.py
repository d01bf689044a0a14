"""The pieces every part of the codec shares: its limits, the NumPy dtypes it writes, the
tags and kinds a descriptor uses, and the few helpers that turn buffers into flat bytes.

Nothing here reads or writes a value; :mod:`.writing` and :mod:`.reading` do. The layout
itself is documented once, in the package's docstring (``somatize.codec``).
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from somatize.errors import Unreadable

# -- limits: a reader refuses anything beyond these before allocating -------------------

MAX_DEPTH = 64
"""Containers inside containers, at most (the outermost list, tuple or dict is level 1)."""

MAX_NODES = 1_000_000
"""Pieces in one descriptor (every scalar and every node), at most. Long runs of numbers
belong in a NumPy array, which is one piece however long it is."""

MAX_NDIM = 32
"""Dimensions of one array or tensor, at most."""

INLINE_BYTES = 64 * 1024  # bytes longer than this travel as a frame, not in the header
ALIGN = 16  # frames start on this boundary in the written form
MAGIC = b"SMZ1"
FIXED = struct.Struct("<4sI")
ZEROS = bytes(ALIGN)
MAX_NBYTES = 2**63  # numpy's (and torch's) ceiling for one array, checked with Python ints first

INT_MIN = -(2**63)  # what MessagePack holds as a plain int
INT_MAX = 2**64 - 1

# -- kinds -------------------------------------------------------------------------------

PLAIN = "plain"
NDARRAY = "numpy.ndarray"
NPSCALAR = "numpy.generic"
ARROW_BATCH = "arrow.RecordBatch"
ARROW_TABLE = "arrow.Table"
ARROW_KINDS = frozenset({ARROW_BATCH, ARROW_TABLE})
TENSOR = "torch.Tensor"
"""The kind of a tensor: what an "X" node says it holds, what a peer lists when it reads
tensors, and the registry kind under which ``somatize.torch`` reads the older SMZT form."""

# Asked before the registry on both ways, so nobody may register under these names. The
# tensor's kind is not among them: ``somatize.torch`` registers it, to read values written
# before tensors were built in (["C", "torch.Tensor", i] with SMZT bytes).
BUILTIN_KINDS = frozenset({PLAIN, NDARRAY, NPSCALAR}) | ARROW_KINDS

SCALARS = (type(None), bool, int, float, str, bytes)
KEY_TYPES = frozenset(SCALARS)
INLINE_TYPES = frozenset(SCALARS)
# Builtins whose subclasses are refused rather than silently written as the base type.
UNDERNEATH = (bool, int, float, str, bytes, bytearray, list, tuple, dict, np.ndarray)


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


DTYPES = _allowed_dtypes()
"""The NumPy dtypes written and read, by ``dtype.str``."""
DTYPE_WORDS = "bool, int8..int64, uint8..uint64, float16/32/64 and complex64/128"


# -- buffers -----------------------------------------------------------------------------


def byte_view(obj: Any) -> memoryview | bytes:
    """A flat unsigned-byte view of a buffer, without a copy when it is contiguous."""
    mv = memoryview(obj)
    if not mv.c_contiguous:
        return mv.tobytes()
    if mv.ndim != 1 or mv.format != "B":
        mv = mv.cast("B")
    return mv


def bytes_of(data: Any, what: str) -> memoryview:
    """``data`` as a flat, contiguous view of bytes, or ``Unreadable`` naming ``what``."""
    try:
        mv = memoryview(data)
    except TypeError:
        raise Unreadable(f"{what} is a `{type(data).__name__}`, not a buffer") from None
    if not mv.c_contiguous:
        raise Unreadable(f"{what} is not contiguous in memory")
    return mv if mv.ndim == 1 and mv.format == "B" else mv.cast("B")


def shape_text(shape: list[Any]) -> str:
    return "(" + ", ".join(str(n) for n in shape[:MAX_NDIM]) + ")"


def check_shape(shape: Any, itemsize: int, what: str) -> int:
    """The element count of ``shape`` (a list of sizes), or ``Unreadable`` when it is not
    one, has too many dimensions, or could not exist: checked with Python ints, before
    anything is allocated. ``what`` names the value ("an array", "a tensor")."""
    if type(shape) is not list or len(shape) > MAX_NDIM:
        raise Unreadable(f"{what}'s shape is a list of at most {MAX_NDIM} sizes")
    count, bound = 1, itemsize
    for n in shape:
        if type(n) is not int or n < 0:
            raise Unreadable(f"{what}'s shape holds something other than a size >= 0")
        count *= n
        bound *= max(n, 1)  # numpy and torch refuse when this passes their ceiling, zeros or not
        if bound >= MAX_NBYTES:
            raise Unreadable(f"{what} of shape {shape_text(shape)} is too big to exist")
    return count
