"""Tensors as a built-in kind: the "X" node, written and read like a NumPy array.

A tensor is ``["X", dtype name, [sizes], i]``: torch's own name for the dtype
(``"bfloat16"``), the shape, and frame ``i`` holding the elements in C order, little-endian,
by their raw bits (so bfloat16 and float8, which NumPy lacks, cross as they are). Writing a
contiguous CPU tensor copies nothing: the frame is a view of the tensor's own memory. Any
other tensor (strided, on a GPU, conjugated) is copied once, into a contiguous CPU tensor.

Reading checks the node before anything exists (the dtype against the list below, the
shape against the limits, the frame's length against numel x itemsize, bool bytes being 0
or 1; :mod:`.reading` does it, without importing torch), never unpickles, and gives a CPU
tensor that is a leaf (``requires_grad`` False). A writable frame is used in place; a
read-only one (a ZeroMQ frame, ``bytes``) is copied once into a new tensor, unless the
caller asked for views (``decode(..., views=True)``), and then the tensor is a view of that
read-only memory: torch has no read-only flag, so **do not write to it**.

torch is imported only when a tensor value (which means torch is imported already) or an
"X" node turns up. Strides, device, ``requires_grad`` and tensor subclasses are not kept.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from somatize.errors import Unreadable, Unwritable

from .layout import MAX_NDIM, TENSOR

#: What is written, by torch's own names, and each one's size in bytes: known without torch,
#: so a node is checked before torch is imported. Any bit pattern is a valid value of each
#: (bool aside, which is checked), so reading one never produces something torch cannot
#: hold. Left out on purpose: complex32 (experimental in torch), the float8 "fnuz"/e8m0 and
#: float4 variants, bits*, and the quantized dtypes (refused with `.dequantize()`).
ITEMSIZE: dict[str, int] = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "complex64": 8,
    "complex128": 16,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}
WORDS = (
    "bool, (u)int8..(u)int64, float16, bfloat16, float32, float64, complex64, complex128 "
    "and float8_e4m3fn / float8_e5m2"
)


def torch_or_none() -> Any:
    """torch, when this process imported it already (no value can be a tensor otherwise)."""
    return sys.modules.get("torch")


def torch_module() -> Any:
    """torch, imported now if it has to be, or ``Unreadable`` saying how to get it."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return torch
    try:
        import torch
    except ImportError as exc:
        raise Unreadable(
            f"a tensor (kind `{TENSOR}`) arrived and torch is not installed here, so it "
            f"cannot be read: pip install somatize[torch]"
        ) from exc
    return torch


def dtypes(torch: Any) -> dict[str, Any]:
    """The dtypes of the list above that this torch has, by name."""
    return {name: getattr(torch, name) for name in ITEMSIZE if isinstance(getattr(torch, name, None), torch.dtype)}


def little_endian(what: str) -> None:
    if sys.byteorder != "little":
        raise (Unwritable if what == "written down" else Unreadable)(
            f"somatize writes tensors little-endian, and this machine is big-endian: tensors cannot be {what} here"
        )


# -- writing -------------------------------------------------------------------------------


def writable(t: Any) -> str:
    """The dtype's name, or the sentence that says why ``t`` cannot be written down."""
    torch = sys.modules["torch"]
    if t.is_nested:
        raise Unwritable(
            "a nested tensor cannot be written down: somatize writes dense tensors only. "
            "Send `t.unbind()` (a tuple of dense tensors) or `t.to_padded_tensor(0.0)` instead"
        )
    if t.is_quantized:
        raise Unwritable(
            f"a quantized tensor (dtype `{t.dtype}`) cannot be written down: somatize writes "
            f"dense, unquantized tensors only. Send `t.dequantize()`, or `t.int_repr()` "
            f"together with its scale and zero point"
        )
    if t.layout != torch.strided:
        raise Unwritable(
            f"a tensor with layout `{t.layout}` cannot be written down: somatize writes dense "
            f"(strided) tensors only. Send `t.to_dense()`, or its parts (indices and values) "
            f"as a tuple and rebuild it on the other side"
        )
    if t.is_meta:
        raise Unwritable(
            "a tensor on the `meta` device has a shape and no data, so there is nothing to "
            'write down. Materialise it first (`torch.zeros_like(t, device="cpu")`, or '
            "load its weights), or send its shape instead"
        )
    name = str(t.dtype).removeprefix("torch.")
    if name not in ITEMSIZE or getattr(torch, name, None) != t.dtype:
        raise Unwritable(
            f"a tensor of dtype `{t.dtype}` cannot be written down: somatize writes tensors "
            f"of {WORDS}. Convert it first, e.g. `t.to(torch.float32)`"
        )
    if t.dim() > MAX_NDIM:
        raise Unwritable(
            f"a tensor with {t.dim()} dimensions cannot be written down: readers accept at "
            f"most {MAX_NDIM}. Reshape it first"
        )
    return name


def fresh(shape: Any, dtype: Any, nbytes: int) -> Any:
    """A new CPU tensor, not zero-filled, in memory NumPy allocates: NumPy asks the kernel
    for huge pages for large arrays and torch's allocator does not, and filling fresh memory
    costs its page faults: with huge pages, less than half the time."""
    torch = sys.modules["torch"]
    if not nbytes:
        return torch.empty(shape, dtype=dtype)
    return torch.from_numpy(np.empty(nbytes, np.uint8)).view(dtype).reshape(shape)


def dense(t: Any) -> Any:
    """``t`` as a contiguous CPU tensor without autograd: ``t`` itself (detached) when it is
    one already, else one copy of it (from any device, any strides, conj/neg bits resolved)."""
    t = t.detach()
    if t.device.type == "cpu" and t.is_contiguous() and not t.is_conj() and not t.is_neg():
        return t
    out = fresh(t.shape, t.dtype, t.numel() * t.element_size())  # copy_ writes all of it
    out.copy_(t)  # the one copy: device transfer, strides and conj in one pass
    return out


def elements(t: Any) -> memoryview:
    """The bytes of a tensor that ``dense`` gave, as a flat view of its memory (no copy)."""
    torch = sys.modules["torch"]
    if t.numel() == 0:
        return memoryview(b"")
    # contiguous, so its elements are the next numel slots from its offset: one stride of 1
    # (reshape would keep an odd stride a size-1 dimension may carry, which `view` refuses)
    flat = t.as_strided((t.numel(),), (1,))
    if flat.dtype is not torch.uint8:
        flat = flat.view(torch.uint8)
    return memoryview(flat.numpy())  # holds the array, which holds the tensor


def write(t: Any) -> tuple[str, list[int], memoryview]:
    """``(dtype name, shape, elements)`` of a tensor: what an "X" node and its frame hold."""
    little_endian("written down")
    name = writable(t)
    flat = dense(t)
    return name, list(flat.shape), elements(flat)


# -- reading -------------------------------------------------------------------------------


class _Pinned:
    """What NumPy makes a writable array over: the address of a read-only buffer, and the
    buffer itself, so the memory lives as long as any tensor over it (torch keeps the
    array, the array keeps this)."""

    __slots__ = ("__array_interface__", "owner")
    __array_interface__: dict[str, Any]
    owner: memoryview


def _address(view: memoryview) -> int:
    return np.frombuffer(view, np.uint8).__array_interface__["data"][0]


def _over(view: memoryview, address: int) -> Any:
    """A writable uint8 NumPy array over the memory of ``view`` (at ``address``), read-only
    or not, kept alive by it. Only for the views a caller asked for (``views=True``)."""
    pinned = _Pinned()
    pinned.owner = view
    pinned.__array_interface__ = {
        "shape": (view.nbytes,),
        "typestr": "|u1",
        "data": (address, False),
        "version": 3,
    }
    return np.asarray(pinned)


def build(name: str, shape: list[int], view: memoryview, views: bool) -> Any:
    """The tensor an "X" node that the checker passed stands for (its frame's length and
    bool bytes are already checked)."""
    little_endian("read back")
    torch = torch_module()
    dtype = dtypes(torch).get(name)
    if dtype is None:
        raise Unreadable(
            f"a tensor of dtype {name} arrived and this torch ({torch.__version__}) has no "
            f"such dtype: upgrade torch here, or send it converted (`t.to(torch.float32)`)"
        )
    if not view.nbytes:
        return torch.empty(shape, dtype=dtype)
    address = _address(view)
    if address % ITEMSIZE[name]:  # torch's kernels may assume aligned elements: copy
        flat = torch.from_numpy(np.frombuffer(view, np.uint8).copy())
    elif not view.readonly:  # used in place: no copy
        flat = torch.frombuffer(view, dtype=torch.uint8)
    elif views:  # asked for: a view of read-only memory, documented as "do not write"
        flat = torch.from_numpy(_over(view, address))
    else:  # the one copy, into new memory
        flat = torch.from_numpy(np.frombuffer(view, np.uint8).copy())
    return flat.view(dtype).reshape(shape)
