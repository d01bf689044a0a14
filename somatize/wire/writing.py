"""Writing: a message becomes the frames of one ZeroMQ multipart message.

``encode`` checks the message first (``checks.check``: a message built wrongly here is the
caller's bug, raised as ``TypeError`` / ``ValueError``), then writes the header map and puts
the buffers its values point to after it, uncopied. It refuses whatever a reader would: the
same checks, the same limits. Reading is :mod:`somatize.wire.reading`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack

from ..codec import encode as encode_values
from . import limits
from .checks import Bad, check, count_items
from .messages import FIELDS, IN_FRAMES, Answer, Carrier, Done, Relay, Request, Work, header_fields


def encode(msg: Request | Answer | Carrier) -> list[bytes | memoryview]:
    """The frames of ``msg``: the header, then the buffers its values point to.

    Array data is not copied: its frames are views of the arrays, so leave them alone
    until the frames are sent. Raises ``TypeError`` / ``ValueError`` for a message built
    wrongly (a field of the wrong type, a negative ref, a label over ``MAX_NAME``), and the
    codec's ``Unwritable`` / ``BadCodec`` for a value that cannot be written down.
    """
    try:
        check(msg)
    except Bad as exc:
        raise exc.kind(exc.why) from None
    cls = type(msg)
    header: dict[str, Any] = {"v": limits.WIRE_VERSION, "t": cls.__name__}
    frames: list[bytes | memoryview] = []
    if cls is Work or cls is Done:
        descriptor, frames = encode_values(tuple(_values_of(msg)))
        parts = iter(descriptor[1:])  # ["T", one descriptor per value, in that order]
        header.update(_work_header(msg, parts) if cls is Work else _done_header(msg, parts))
    else:
        for name in header_fields(cls):
            header[name] = _plain(getattr(msg, name))
        if cls is Relay:
            frames = [_byte_view(f) for f in msg.inner]
        elif cls in IN_FRAMES:
            frames = [_byte_view(getattr(msg, IN_FRAMES[cls]))]
    packed = msgpack.packb(header, use_bin_type=True)
    if len(packed) > limits.MAX_HEADER:
        raise ValueError(
            f"this `{cls.__name__}` has a header of {len(packed):,} bytes, over the "
            f"{limits.MAX_HEADER:,} any reader accepts: put bulk data in NumPy arrays or bytes over "
            f"64 KiB, which travel as frames rather than in the header"
        )
    try:
        count_items(packed)
    except Bad as exc:
        raise ValueError(
            f"this `{cls.__name__}` has a header that {exc.why}, more than any reader accepts: "
            f"put long runs of numbers in NumPy arrays, and many small values in fewer larger ones"
        ) from None
    if len(frames) + 1 > limits.MAX_FRAMES:
        raise ValueError(
            f"this `{cls.__name__}` needs {len(frames) + 1:,} frames, over the {limits.MAX_FRAMES:,} any "
            f"reader accepts: gather many small arrays into fewer large ones"
        )
    total = len(packed)
    for f in frames:
        size = memoryview(f).nbytes
        total += size
        if size > limits.MAX_FRAME:
            raise ValueError(
                f"this `{cls.__name__}` holds a buffer of {size:,} bytes, over the {limits.MAX_FRAME:,} "
                f"one frame may hold: split it"
            )
    if total > limits.MAX_TOTAL:
        raise ValueError(
            f"this `{cls.__name__}` is {total:,} bytes, over the {limits.MAX_TOTAL:,} one message may be: "
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


def _plain(x: Any) -> Any:
    """A checked field as MessagePack takes it: dataclasses become maps, tuples lists."""
    if dataclasses.is_dataclass(x):
        return {name: _plain(getattr(x, name)) for name in FIELDS[type(x)]}
    if isinstance(x, (tuple, list)):
        return [_plain(v) for v in x]
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    return x


def _byte_view(data: Any) -> bytes | memoryview:
    if type(data) is bytes:
        return data
    mv = memoryview(getattr(data, "buffer", data))  # a zmq.Frame: its buffer
    if mv.ndim != 1 or mv.format != "B":
        mv = mv.cast("B")
    return mv
