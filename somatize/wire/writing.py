"""Writing: a message becomes the frames of one ZeroMQ multipart message.

``encode`` checks the message first (``checks.check``: a message built wrongly here is the
caller's bug, raised as ``TypeError`` / ``ValueError``), then writes the header map and puts
the buffers its values point to after it, uncopied. It refuses whatever a reader would: the
same checks, the same limits. Reading is :mod:`somatize.wire.reading`.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, NamedTuple

import msgpack

from ..codec import encode as encode_values
from ..codec.layout import INLINE_TYPES
from ..codec.writing import Writer
from . import limits, short
from .checks import Bad, check
from .counting import count_items
from .messages import FIELDS, IN_FRAMES, Answer, Carrier, Done, Recipe, Relay, Request, Work, header_fields


def encode(msg: Request | Answer | Carrier) -> list[bytes | memoryview]:
    """The frames of ``msg``: the header, then the buffers its values point to.

    Array data is not copied: its frames are views of the arrays, so leave them alone
    until the frames are sent. Raises ``TypeError`` / ``ValueError`` for a message built
    wrongly (a field of the wrong type, a negative ref, a label over ``MAX_NAME``), and the
    codec's ``Unwritable`` / ``BadCodec`` for a value that cannot be written down.
    """
    cls = type(msg)
    if cls is Work or cls is Done:  # a call's own, of one scalar: written in one step
        fast = short.written_express(msg)
        if fast is not None:
            return fast
    if cls in short.GREETINGS:  # every channel's first and last words: the same every time
        kept = short.written(msg)  # type: ignore[arg-type]  # `cls` is Hello, Ready or Bye
        if kept is not None:
            return kept
    return _written(msg, cls)


def _written(msg: Any, cls: type) -> list[bytes | memoryview]:
    """``encode``'s long way: every message is written so, and checked first."""
    try:
        check(msg)
    except Bad as exc:
        raise exc.kind(exc.why) from None
    if cls is Relay:  # the envelope on every relayed hop: its fields are plain already
        return _relay(msg)
    header: dict[str, Any] = {"v": limits.WIRE_VERSION, "t": cls.__name__}
    frames: list[bytes | memoryview] = []
    if cls is Work or cls is Done:
        one = _one_scalar(msg)
        if one is not _NONE:  # the call's one value is a scalar: it is its own descriptor
            parts = iter((one,))
        else:
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
    fitted = _fitted(cls.__name__, packed, frames)
    if cls in short.GREETINGS:
        short.keep_written(msg, fitted)
    return fitted


def _fitted(name: str, packed: bytes, frames: list[bytes | memoryview]) -> list[bytes | memoryview]:
    """``[packed, *frames]``, within the limits any reader accepts on frames and sizes."""
    if len(frames) + 1 > limits.MAX_FRAMES:
        raise ValueError(
            f"this `{name}` needs {len(frames) + 1:,} frames, over the {limits.MAX_FRAMES:,} any "
            f"reader accepts: gather many small arrays into fewer large ones"
        )
    total = len(packed)
    for f in frames:
        size = f.nbytes if type(f) is memoryview else len(f) if type(f) is bytes else memoryview(f).nbytes
        total += size
        if size > limits.MAX_FRAME:
            raise ValueError(
                f"this `{name}` holds a buffer of {size:,} bytes, over the {limits.MAX_FRAME:,} "
                f"one frame may hold: split it"
            )
    if total > limits.MAX_TOTAL:
        raise ValueError(
            f"this `{name}` is {total:,} bytes, over the {limits.MAX_TOTAL:,} one message may be: split the work"
        )
    return [packed, *frames]


def passed_on(
    inner: tuple[bytes | memoryview, ...], *, exchange: int = 0, tenant: str = "", lane: int = 0
) -> list[bytes | memoryview]:
    """The frames of a message checked already (decoded here, or encoded here) in an
    envelope naming what this side checked or made itself: the ``exchange`` a worker was
    given or a broker numbered, a broker's ``tenant``, a client's ``lane``. A broker's every
    relayed hop and a dialed worker's every answer, written without checking them again."""
    return _relay(Relay("", exchange, tenant, lane, inner))


def _relay(msg: Relay) -> list[bytes | memoryview]:
    """A checked ``Relay``'s frames: its header (a map of scalars, written as ``encode``
    writes any header) and the frames it carries, untouched."""
    packed = msgpack.packb(
        {
            "v": limits.WIRE_VERSION,
            "t": "Relay",
            "host": msg.host,
            "exchange": msg.exchange,
            "tenant": msg.tenant,
            "lane": msg.lane,
        },
        use_bin_type=True,
    )
    return _fitted("Relay", packed, [_byte_view(f) for f in msg.inner])


_NONE = object()


def _one_scalar(msg: Work | Done) -> Any:
    """The descriptor of the value of a Work naming its recipe by digest, or of a Done that
    produced nothing else, when it is a scalar the codec writes with no frame (written by
    the codec's ``Writer``, as ``codec.encode`` would, without its tuple around it);
    ``_NONE`` for anything else, which ``codec.encode`` writes."""
    if isinstance(msg, Work):  # `check` passed it: a Work or a Done, neither a subclass
        if msg.recipe is not None:
            return _NONE
        v = msg.input
    else:
        if msg.produced:
            return _NONE
        v = msg.output
    if type(v) not in INLINE_TYPES:
        return _NONE
    writer = Writer()  # the codec's own rules for a scalar (a big int, long bytes, a lone surrogate)
    descriptor = writer.value(v, 0)
    return _NONE if writer.frames else descriptor


def _values_of(msg: Work | Done) -> list[Any]:
    """The values of a message, in the order its header holds their descriptors."""
    if isinstance(msg, Work):
        out = [msg.input]
        for node in msg.recipe.nodes if msg.recipe is not None else ():
            out += [node.args, node.kwargs]
        return out
    return [msg.output, *msg.produced.values()]


def _work_header(msg: Work, parts: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {"ref": msg.ref}
    fields["input"] = next(parts)
    fields["recipe"] = None if msg.recipe is None else _recipe_map(msg.recipe, parts)
    fields["keys"] = [[i, k] for i, k in msg.keys.items()]
    fields["placement"] = [[i, d] for i, d in msg.placement.items()]
    fields["memory"] = msg.memory
    fields["watched"] = msg.watched
    fields["recipe_digest"] = msg.recipe_digest
    return fields


def _recipe_map(recipe: Recipe, parts: Any) -> dict[str, Any]:
    """A recipe as its header map; ``parts`` yields the descriptors of each node's
    ``args`` and ``kwargs``, in order."""
    nodes = [
        {
            "label": n.label,
            "cache": n.cache,
            "source": n.source,
            "target": n.target,
            "args": next(parts),
            "kwargs": next(parts),
            "code": n.code,
        }
        for n in recipe.nodes
    ]
    return {"nodes": nodes, "shape": _plain(recipe.shape)}


class Digested(NamedTuple):
    """A recipe's name, and the size of the form it was computed from."""

    digest: str
    """``"sha256:<64 hex>"`` of the recipe's canonical form."""
    size: int
    """Bytes of that form: what keeping the recipe costs, roughly."""


def recipe_digest(recipe: Recipe) -> Digested | None:
    """The digest of ``recipe``'s canonical form, or None when it has none.

    The form is the MessagePack of the recipe's header map, its nodes' ``args`` and
    ``kwargs`` written by the codec on their own; a value written to a frame (an array, long
    bytes, a registered kind) has no place in that form, so a recipe with one has no digest
    and always travels in full. A client names a recipe it sent before by this digest; a
    worker computes it itself from the recipe it received and checked, never trusting a
    digest it was handed. Raises what ``encode`` raises for a recipe built wrongly.
    """
    values: list[Any] = []
    for node in recipe.nodes:
        values += [node.args, node.kwargs]
    descriptor, frames = encode_values(tuple(values))
    if frames:
        return None
    form = msgpack.packb(_recipe_map(recipe, iter(descriptor[1:])), use_bin_type=True)
    return Digested("sha256:" + hashlib.sha256(form).hexdigest(), len(form))


def _done_header(msg: Done, parts: Any) -> dict[str, Any]:
    return {
        "ref": msg.ref,
        "output": next(parts),
        "produced": [[i, next(parts)] for i in msg.produced],
        "took_us": msg.took_us,
        "saw": msg.saw,
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
