"""What the walk does with a node's value besides running the node: count the items of a
batch, move tensors onto the device a node was placed on, and carry torch's grad mode to
the thread a branch runs on. Nothing here imports a library a value might belong to: its
types are looked for only when it is already loaded (a value of its kind would have loaded it).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any


def items_of(output: Any) -> int | None:
    """How many items a node handled, when its output is a batch: a list's or a tuple's
    length, an array's or a tensor's first dimension, an Arrow table's or record batch's
    rows; ``None`` for anything else. Imports nothing: a library's types are looked for
    only when it is already loaded (an output of its kind would have loaded it)."""
    if isinstance(output, list) or type(output) is tuple:
        return len(output)
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(output, numpy.ndarray):
        return output.shape[0] if output.ndim else None
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(output, torch.Tensor):
        return output.shape[0] if output.dim() else None
    arrow = sys.modules.get("pyarrow")
    if arrow is not None and isinstance(output, (arrow.RecordBatch, arrow.Table)):
        return output.num_rows
    return None


def carried() -> Any:
    """What a branch on a pool thread must share with the caller's thread: torch's grad
    mode is per thread, and `with torch.no_grad(): g.forward(x)` means every branch."""
    torch = sys.modules.get("torch")
    return None if torch is None else torch.is_grad_enabled()


def within(carried: Any) -> Any:
    if carried is None:
        return contextlib.nullcontext()
    return sys.modules["torch"].set_grad_enabled(carried)


def place(value: Any, device: str) -> Any:
    """Move the tensors in ``value`` onto ``device`` (what ``.on(device)`` promises a node).

    Only torch has devices; without torch imported nothing here can be a tensor.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return value
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple):
        if type(value) is tuple:
            return tuple(place(v, device) for v in value)
        kin: Any = value  # a subclass of tuple, which may have more than a tuple's attributes
        if callable(getattr(type(kin), "to", None)):  # PackedSequence moves itself
            return kin.to(device)
        if hasattr(kin, "_fields"):  # a namedtuple stays one
            return type(kin)._make(place(v, device) for v in kin)
        return tuple(place(v, device) for v in value)
    if isinstance(value, list):
        return [place(v, device) for v in value]
    if isinstance(value, dict):
        return {k: place(v, device) for k, v in value.items()}
    return value
