"""The SMZT form of a tensor: what ``somatize.torch`` registers under ``"torch.Tensor"``.

Tensors are a built-in kind of the codec (``somatize.codec``'s "X" node: dtype, shape and
the elements as one raw frame, no copy on the way out). This module keeps the form they had
before that, so that what stores hold from then still reads, and so that an ``Opaque``
around a tensor, which crosses only through the registry, has a codec. Importing it
registers that codec; bytes of kind ``"torch.Tensor"`` arriving in a process that never
imported it make the codec layer import ``somatize.torch`` by name.

The form is not a pickle, and reading one runs no code: a fixed header and the raw bytes of
its elements, all little-endian::

    offset 0   b"SMZT"                       magic
           4   u8  version (1)
           5   u8  ndim (at most codec.MAX_NDIM)
           6   u8  length of the dtype's name
           7   u8  0 (reserved)
           8   the dtype's name in ASCII, as torch spells it ("bfloat16")
               ndim x u64, the sizes
               zero bytes up to a multiple of 16
               the elements, in C order (numel x itemsize bytes, nothing after)

``load_tensor`` checks every field (magic, version, dtype against an allow-list, sizes, that
the data is exactly as long as the header says, zero padding, bool bytes being 0 or 1)
before it allocates anything, and gives back a CPU tensor that is a leaf. Strides, device,
``requires_grad`` and tensor subclasses are not kept. Sparse, quantized, nested and meta
tensors are refused with the call that fixes it (the same sentences as the built-in kind).
"""

from __future__ import annotations

import struct

import numpy as np
import torch

from somatize.codec import MAX_NDIM
from somatize.codec import codec as _register
from somatize.codec.tensors import WORDS, dtypes, little_endian, writable
from somatize.errors import Unreadable

__all__ = ["DTYPES", "FORMAT_VERSION", "KIND", "dump_tensor", "load_tensor"]

KIND = "torch.Tensor"
FORMAT_VERSION = 1

_MAGIC = b"SMZT"
_FIXED = struct.Struct("<4sBBBB")
_SIZE = struct.Struct("<Q")
_ALIGN = 16
_MAX_NAME = 32
_MAX_NBYTES = 2**63  # no tensor is bigger; checked with Python ints before torch is asked

DTYPES: dict[str, torch.dtype] = dtypes(torch)
"""The dtypes a tensor may have to be written down or read back, by name."""
_DTYPE_WORDS = WORDS


def dump_tensor(t: torch.Tensor) -> memoryview:
    """``t`` in the written form above. Copies the data once, straight into the result
    (from any device, from any strides), and never pickles."""
    little_endian("written down")
    name = writable(t)
    shape = tuple(t.shape)
    head = _header(name, shape)
    nbytes = t.numel() * t.element_size()
    out = torch.empty(len(head) + nbytes, dtype=torch.uint8)  # not zero-filled: all of it is written
    written = out.numpy()
    written[: len(head)] = np.frombuffer(head, np.uint8)
    if nbytes:
        # the tail of `out`, shaped like `t`: copy_ does the device transfer and the
        # strides in the one copy
        out[len(head) :].view(t.dtype).view(shape).copy_(t.detach())
    return written.data  # the array's memoryview, as memoryview(written) makes it


def load_tensor(raw: bytes | bytearray | memoryview) -> torch.Tensor:
    """The tensor whose written form ``raw`` is: a new CPU tensor, a leaf.

    Raises ``Unreadable`` for anything malformed, before allocating the tensor.
    """
    little_endian("read back")
    data = memoryview(raw).cast("B")
    name, shape, start = _read_header(data)
    dtype = DTYPES[name]
    elements = np.frombuffer(data, np.uint8, offset=start) if len(data) > start else None
    if dtype is torch.bool and elements is not None and elements.max() > 1:
        raise Unreadable("a bool tensor's bytes hold something other than 0 or 1")
    out = torch.empty(shape, dtype=dtype)  # requires_grad=False: a leaf
    if elements is not None:
        out.reshape(-1).view(torch.uint8).numpy()[:] = elements
    return out


def _header(name: str, shape: tuple[int, ...]) -> bytes:
    encoded = name.encode("ascii")
    head = _FIXED.pack(_MAGIC, FORMAT_VERSION, len(shape), len(encoded), 0) + encoded
    head += b"".join(_SIZE.pack(n) for n in shape)
    return head + bytes(-len(head) % _ALIGN)


def _read_header(data: memoryview) -> tuple[str, tuple[int, ...], int]:
    """``(dtype name, shape, where the elements start)``, every field checked."""
    total = len(data)
    if total < _FIXED.size or data[:4] != _MAGIC:
        raise Unreadable("these bytes are not a tensor somatize wrote: they do not start with SMZT")
    _, version, ndim, name_len, reserved = _FIXED.unpack_from(data)
    if version != FORMAT_VERSION:
        raise Unreadable(
            f"this tensor was written in version {version} of somatize's tensor format, and "
            f"this somatize reads version {FORMAT_VERSION}: read it with the somatize that "
            f"wrote it, or upgrade this one"
        )
    if reserved != 0:
        raise Unreadable("a tensor's header has a nonzero reserved byte")
    if ndim > MAX_NDIM:
        raise Unreadable(f"a tensor's header says {ndim} dimensions, more than {MAX_NDIM}")
    if not 0 < name_len <= _MAX_NAME:
        raise Unreadable(f"a tensor's header gives its dtype a name {name_len} bytes long")
    end = _FIXED.size + name_len + ndim * _SIZE.size
    if end > total:
        raise Unreadable(f"a tensor's header is cut short: it needs {end} bytes and there are {total}")
    raw_name = bytes(data[_FIXED.size : _FIXED.size + name_len])
    name = raw_name.decode("ascii", errors="replace")
    if name not in DTYPES:
        shown = repr(name) if raw_name.isascii() and name.isprintable() else "an unreadable name"
        raise Unreadable(f"the dtype {shown} is not one somatize reads: it reads {_DTYPE_WORDS}")
    itemsize = DTYPES[name].itemsize
    shape = []
    count, bound = 1, itemsize
    for i in range(ndim):
        (n,) = _SIZE.unpack_from(data, _FIXED.size + name_len + i * _SIZE.size)
        count *= n
        bound *= max(n, 1)  # torch refuses strides past this, even with a zero elsewhere
        if bound >= _MAX_NBYTES:
            raise Unreadable("a tensor's header gives it a shape too big to exist")
        shape.append(n)
    start = end + (-end % _ALIGN)
    if start > total or any(data[end:start]):
        raise Unreadable("a tensor's header is not followed by its zero padding")
    need = count * itemsize
    if total - start != need:
        raise Unreadable(
            f"a {name} tensor of shape ({', '.join(map(str, shape))}) needs {need} bytes of "
            f"data, and {total - start} follow its header"
        )
    return name, tuple(shape), start


_register(KIND, torch.Tensor, dump=dump_tensor, load=load_tensor)
