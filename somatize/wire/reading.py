"""Reading: the frames of one ZeroMQ multipart message become a message, or are refused.

Everything is checked before anything is built, in this order: the frame count and sizes,
the header's items (counted without building them, ``counting.count_items``), the header map
(MessagePack, no extension types, text keys, each once), the version and the variant, every
field (``checks.check``, the same checks ``encode`` runs), the values' descriptors against
their frames (once, by the codec's ``check``), and that every frame after the header is
used exactly once. Only then are values built (``codec.build``).

Whose fault: anything wrong with the bytes is the peer's, raised as
:class:`~somatize.errors.ProtocolError` and nothing else; its ``why`` is the sentence to
send back in a ``Refusal``. ``variant_of`` reads a header's ``v`` and ``t`` alone, so a pump
can refuse a message by its kind before reading the rest. Writing is
:mod:`somatize.wire.writing`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import msgpack

from ..codec import Checked
from ..codec import build as build_values
from ..codec import check as check_values
from ..errors import ProtocolError, Unreadable
from . import limits, short
from .checks import Bad, Pieces, Slot, check, fitted, shown
from .counting import count_items
from .items import index_pairs, msgpack_type, text_map
from .messages import (
    FIELDS,
    IN_FRAMES,
    VARIANTS,
    Answer,
    Begin,
    Carrier,
    Done,
    Hello,
    Listed,
    Mounted,
    NodeSpec,
    Ready,
    Recipe,
    Relay,
    Request,
    Runtime,
    Saw,
    Send,
    Work,
    header_fields,
)


def decode(frames: Sequence[Any], *, views: bool = False) -> Request | Answer | Carrier:
    """The message that ``frames`` (one whole multipart message) hold.

    ``views=True``: arrays and tensors are views of their frames even when a frame is
    read-only (``codec.build(views=True)``); the Mount path's client uses it for answers
    in shared memory it has lent.

    Frames are bytes-like, or objects with a ``.buffer`` (a ``zmq.Frame``). Everything is
    checked before any value is built: the limits, the header, every field, and that the
    frames after the header are exactly the ones its values use. Arrays decoded from
    read-only frames are copies; from writable frames, views. ``Provision.artifact`` is
    frame 1 itself (the same ``bytes``, or a ``memoryview``).

    Raises :class:`~somatize.errors.ProtocolError` and nothing else for anything malformed,
    including a value of a kind this process cannot read; ``TypeError`` when ``frames`` is
    not a sequence of buffers at all (a bug here, not the peer's doing).
    """
    if type(frames) is list and len(frames) == 1:  # a call's own Work or Done: its header, read by msgspec
        first = frames[0]
        fast: Request | Answer | Carrier | None = short.express(short.head_of(first))
        if fast is not None:
            return fast
    cls = short.told(frames)  # a Relay, a Work or Done of one scalar, a greeting: read in one step
    if cls in short.READ:
        fast = short.read(cls, _buffers(frames))
        if fast is not None:
            return fast
    msg, checked = _read(frames, values=True)
    if checked is None:
        if cls in short.GREETINGS:
            short.remember(_buffers(frames), msg)
        return msg
    try:
        # checked once, in _read: built here, not checked again
        values = build_values(checked, views=True) if views else build_values(checked)
    except Unreadable as exc:
        raise ProtocolError(f"the values of a `{type(msg).__name__}` could not be read: {exc}") from exc
    return _fill(msg, values)


def with_recipe(work: Work, recipe: Recipe) -> Work:
    """``work``, decoded with its recipe named by digest (``recipe`` None), with ``recipe``
    in its place: a recipe the receiver kept from an earlier Work of the same peer (checked
    when it came in full). Its keys and placement are checked against that recipe's nodes
    first; :class:`~somatize.errors.ProtocolError` names what does not fit."""
    try:
        return fitted(work, recipe)
    except Bad as exc:
        raise ProtocolError(exc.why) from None


def peek_kinds(frames: Sequence[Any]) -> set[str]:
    """The codec kinds the values of a message use, read from its header alone.

    Checks everything ``decode`` checks except the values' frames (the sizes of arrays),
    and builds nothing, so a side can refuse a ``Work`` it cannot read before it tries::

        missing = peek_kinds(frames) - set(readable_kinds())
        if missing: ...  # Refusal("this worker cannot read values of kind `x`: ...")

    (``decode`` would refuse such a message too, with a ``ProtocolError`` naming the kind.)
    Raises ``ProtocolError`` for anything malformed.
    """
    checked = _read(frames, values=False)[1]
    return set() if checked is None else set(checked.kinds)


def variant_of(frames: Sequence[Any]) -> type:
    """The variant (``Work``, ``Relay``...) that frame 0's header names, read from its ``v``
    and ``t`` alone: no other field is parsed and no value is built, so a pump can refuse
    a ``Work`` from a peer that has not said ``Hello`` before spending anything on it.

    ``v`` and ``t`` have to be among the first 16 keys of the header map
    (``encode`` writes them first). Raises :class:`~somatize.errors.ProtocolError` for a
    frame 0 that is not such a header; the rest of the message is not looked at.
    """
    if isinstance(frames, (str, bytes, bytearray, memoryview)) or not isinstance(frames, Sequence):
        raise TypeError(
            f"variant_of takes the frames of one message as a list of buffers; it was given a `{type(frames).__name__}`"
        )
    if not frames:
        raise ProtocolError("a message has at least one frame, its header; this one has none")
    told = short.told(frames)  # a header that begins as `encode` writes one: its first bytes say
    if told is not None:
        return told
    first = _buffers(frames[:1])[0]
    try:
        return _variant(_version_and_variant(first))
    except Bad as exc:
        raise ProtocolError(exc.why) from None


def ref_of(frames: Sequence[Any]) -> int | None:
    """The ``ref`` a ``Work``'s header names (a ``Mounted`` one's too: its frame 1 is the
    Work's header), read like ``variant_of`` without building anything else; None for any
    other message, or a header that does not name one. A refusal of a Work that was not
    opened (its sender unknown, say) names it this way."""
    try:
        variant = variant_of(frames)
        if variant is Mounted and len(frames) > 1:
            frames, variant = frames[1:2], variant_of(frames[1:2])
        if variant is not Work:
            return None
        ref = _version_and_variant(_buffers(frames[:1])[0], also="ref").get("ref")
    except (Bad, ProtocolError, TypeError):
        return None
    return ref if isinstance(ref, int) and not isinstance(ref, bool) and 0 <= ref < 2**63 else None


_PEEKED_KEYS = 16
_INT_MARKS = frozenset(range(0x00, 0x80)) | frozenset(range(0xE0, 0x100)) | frozenset(range(0xCC, 0xD4))
_STR_MARKS = frozenset(range(0xA0, 0xC0)) | {0xD9, 0xDA, 0xDB}


def _version_and_variant(frame: Any, *, also: str = "") -> dict[str, Any]:
    """``{"v": ..., "t": ...}`` from a header map, skipping (never building) other values;
    with ``also``, that field's too when it is an integer among the first keys."""
    view = memoryview(frame)
    unpacker = msgpack.Unpacker(
        Pieces(view), raw=False, max_buffer_size=max(view.nbytes, 1), max_str_len=limits.MAX_NAME
    )
    found: dict[str, Any] = {}
    try:
        pairs = unpacker.read_map_header()
        for _ in range(min(pairs, _PEEKED_KEYS)):
            if view[unpacker.tell()] not in _STR_MARKS:
                raise Bad("a map in the header has a key that is not text; the wire's maps are keyed by text")
            key = unpacker.unpack()
            if also and key == also:
                found[key] = unpacker.unpack() if view[unpacker.tell()] in _INT_MARKS else unpacker.skip()
                if len(found) == 3:
                    break
            elif key in ("v", "t"):
                if key in found:
                    raise Bad(f"a map in the header holds the key {shown(key)} twice")
                marks = _INT_MARKS if key == "v" else _STR_MARKS
                if view[unpacker.tell()] in marks:
                    found[key] = unpacker.unpack()
                else:
                    found[key] = None
                    unpacker.skip()
                if len(found) == (3 if also else 2):
                    break
            else:
                unpacker.skip()
    except Bad:
        raise
    except Exception as exc:
        raise Bad(
            f"a message must start with a MessagePack header map; frame 0 is {len(view):,} "
            f"bytes that are not one ({type(exc).__name__}: {str(exc)[:200]})"
        ) from None
    if ("v" not in found or "t" not in found) and pairs > _PEEKED_KEYS:
        raise Bad(
            f"the header names its wire version `v` and its kind of message `t` among its "
            f"first {_PEEKED_KEYS} keys, as the wire writes them; this one does not"
        )
    return found


def _read(frames: Sequence[Any], *, values: bool) -> tuple[Request | Answer | Carrier, Checked | None]:
    """Check a message's frames, header and fields, and its values' descriptors (against
    their frames too, when ``values``); return the message (values still ``Slot``s) and
    what the codec's check found (None when it has no values)."""
    buffers = _buffers(frames)
    after = len(buffers) - 1
    try:
        header = _header(buffers[0])
        cls = _variant(header)
        descriptors: list[Any] = []
        msg = _PARSERS.get(cls, _parse_flat)(cls, header, descriptors)
        if cls in IN_FRAMES:
            msg = _with_frames(msg, buffers)
        check(msg)
    except Bad as exc:
        raise ProtocolError(exc.why) from None
    name = cls.__name__
    if cls in IN_FRAMES:
        return msg, None
    if not descriptors:
        if after:
            raise ProtocolError(f"a `{name}` is one frame, its header; this one has {after} more, which nothing uses")
        return msg, None
    try:
        checked = check_values(["T", *descriptors], buffers[1:] if values else None)
    except Unreadable as exc:
        # the codec counts frames from the first after the header
        counted = " (frames counted from the first after the header)" if "frame" in str(exc) else ""
        raise ProtocolError(f"the values of a `{name}` could not be read{counted}: {exc}") from None
    used = checked.used
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
    return msg, checked


def _with_frames(msg: Any, buffers: list[Any]) -> Any:
    """A carrier or a ``Provision`` with the frames after its header put in their field."""
    cls = type(msg)
    after = len(buffers) - 1
    if cls is Relay:
        if after < 1:
            raise Bad("a `Relay` is its header and then the frames of the message it carries; this one carries none")
        return dataclasses.replace(msg, inner=tuple(buffers[1:]))
    what = IN_FRAMES[cls]
    if after != 1:
        raise Bad(f"a `{cls.__name__}` is two frames, the header and the {what}; this one has {after + 1}")
    if cls is Mounted and len(buffers[1]) > limits.MAX_HEADER:
        raise Bad(
            f"the header a `Mounted` carries (frame 1) is {len(buffers[1]):,} bytes, over the "
            f"{limits.MAX_HEADER:,} this side accepts"
        )
    return dataclasses.replace(msg, **{what: buffers[1]})


def _buffers(frames: Sequence[Any]) -> list[Any]:
    if isinstance(frames, (str, bytes, bytearray, memoryview)) or not isinstance(frames, Sequence):
        raise TypeError(
            f"decode takes the frames of one message as a list of buffers; it was given a `{type(frames).__name__}`"
        )
    n = len(frames)
    if n == 0:
        raise ProtocolError("a message has at least one frame, its header; this one has none")
    if n > limits.MAX_FRAMES:
        raise ProtocolError(f"a message has at most {limits.MAX_FRAMES:,} frames, and this one has {n:,}")
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
                    f"frame {i} is a `{type(f).__name__}`, not a buffer (bytes, a memoryview, a zmq.Frame)"
                ) from None
            if raw.ndim != 1 or raw.format != "B":
                if not raw.c_contiguous:
                    raise TypeError(f"frame {i} is not contiguous in memory")
                raw = raw.cast("B")
            size = raw.nbytes
        limit = limits.MAX_HEADER if i == 0 else limits.MAX_FRAME
        if size > limit:
            what = "the header (frame 0)" if i == 0 else f"frame {i}"
            raise ProtocolError(f"{what} is {size:,} bytes, over the {limit:,} this side accepts")
        total += size
        if total > limits.MAX_TOTAL:
            raise ProtocolError(f"this message is over {limits.MAX_TOTAL:,} bytes in all, more than this side accepts")
        out.append(raw)
    return out


def _header(frame: Any) -> dict[str, Any]:
    size = len(frame)
    try:
        count_items(frame)  # before anything is built: items cost memory, not bytes
    except Bad as exc:
        raise Bad(f"the header {exc.why}, more than this side reads") from None
    try:
        header = msgpack.unpackb(
            frame,
            raw=False,
            use_list=True,
            strict_map_key=True,
            ext_hook=_no_ext,
            object_pairs_hook=text_map,
        )
    except Bad:
        raise
    except Exception as exc:
        raise Bad(
            f"a message must start with a MessagePack header map; frame 0 is {size:,} bytes "
            f"that are not one ({type(exc).__name__}: {str(exc)[:200]})"
        ) from None
    if type(header) is not dict:
        raise Bad(
            f"a message must start with a MessagePack header map; frame 0 holds a `{msgpack_type(header)}` instead"
        )
    return header


def _no_ext(code: int, data: bytes) -> Any:
    raise Bad(f"the header holds a MessagePack extension (type {code}); the wire uses none")


def _variant(header: dict[str, Any]) -> type:
    v = header.get("v")
    if type(v) is not int:
        raise Bad("the header has no wire version `v` (a whole number): the sender does not speak somatize's wire")
    if v != limits.WIRE_VERSION:
        which = "this side" if v > limits.WIRE_VERSION else "the side that sent it"
        version = str(v) if abs(v) < 10**6 else "a far larger one"
        raise Bad(
            f"this side speaks wire version {limits.WIRE_VERSION} and the message is version "
            f"{version}: "
            f"upgrade somatize on the older side ({which})"
        )
    t = header.get("t")
    cls = VARIANTS.get(t) if type(t) is str else None
    if cls is None:
        raise Bad(
            f"the header's `t` names the kind of message, and {shown(t)} is not one wire "
            f"version {limits.WIRE_VERSION} has (it has {', '.join(sorted(VARIANTS))})"
        )
    return cls


def _take(m: Any, cls: type, where: str) -> list[Any]:
    """The fields of ``cls`` from the map ``m``, all of them and nothing else (a message's
    own header also holds ``v`` and ``t``)."""
    if type(m) is not dict:
        raise Bad(f"`{where}` has to be a map, and it is a `{msgpack_type(m)}`")
    names = header_fields(cls)
    extra = set(m) - set(names) - ({"v", "t"} if where == cls.__name__ else set())
    if extra:
        raise Bad(
            f"`{where}` has no field {shown(min(extra))} in wire version {limits.WIRE_VERSION} "
            f"(its fields: {', '.join(names) or 'none'})"
        )
    for name in names:
        if name not in m:
            raise Bad(f"`{where}` needs the field `{name}`, and this one has none")
    return [m[name] for name in names]


def _parse_flat(cls: type, h: dict[str, Any], descriptors: list[Any]) -> Any:
    values = _take(h, cls, cls.__name__)
    kwargs = dict(zip(header_fields(cls), values, strict=False))
    if cls is Hello or cls is Ready:
        kwargs["runtime"] = _parse_runtime(kwargs["runtime"], f"{cls.__name__}.runtime")
    elif cls is Send:
        kwargs["digests"] = _tupled(kwargs["digests"])
    elif cls is Begin:
        kwargs["sizes"] = _tupled(kwargs["sizes"])
    elif cls is Mounted:
        kwargs["files"] = _tupled(kwargs["files"])
        kwargs["spare"] = _tupled(kwargs["spare"])
        kwargs["kept"] = _tupled(kwargs["kept"])
        spans = kwargs["spans"]  # each (file, offset, length) checked in checks.py
        kwargs["spans"] = tuple(_tupled(x) for x in spans) if type(spans) is list else spans
    if cls in IN_FRAMES:
        kwargs[IN_FRAMES[cls]] = b"" if cls is not Relay else ()  # put in place by _read
    return cls(**kwargs)


def _parse_runtime(m: Any, where: str) -> Runtime:
    values = dict(zip(FIELDS[Runtime], _take(m, Runtime, where), strict=False))
    values["kinds"] = _tupled(values["kinds"])
    return Runtime(**values)


def _parse_work(cls: type, h: dict[str, Any], descriptors: list[Any]) -> Work:
    ref, recipe, input_, keys, placement, memory, watched, named = _take(h, Work, "Work")
    input_slot = _slot(input_, descriptors)
    keyed, placed = index_pairs(keys, "Work.keys"), index_pairs(placement, "Work.placement")
    if recipe is None:  # named by its digest (checked in checks.py)
        return Work(ref, None, input_slot, keyed, placed, memory, watched, named)
    raw_nodes, shape = _take(recipe, Recipe, "Work.recipe")
    if type(raw_nodes) is not list:
        raise Bad(f"`Work.recipe.nodes` has to be an array, and it is a `{msgpack_type(raw_nodes)}`")
    if len(raw_nodes) > limits.MAX_NODES:
        raise Bad(f"`Work.recipe` has {len(raw_nodes):,} nodes, over the limit of {limits.MAX_NODES:,}")
    nodes = []
    for i, raw in enumerate(raw_nodes):
        where = f"Work.recipe.nodes[{i}]"
        label, cache, source, target, args, kwargs, code = _take(raw, NodeSpec, where)
        _tagged(args, "T", f"{where}.args", "a tuple")
        _tagged(kwargs, "D", f"{where}.kwargs", "a dict")
        for k in range(1, len(kwargs), 2):
            if type(kwargs[k]) is not str:
                raise Bad(f"`{where}.kwargs` has a key that is not a str")
        # args and kwargs stand as Slots (of their values) until `_fill` puts the values in
        nodes.append(NodeSpec(label, cache, source, target, _slot(args, descriptors), _slot(kwargs, descriptors), code))  # type: ignore[arg-type]
    return Work(
        ref,
        Recipe(tuple(nodes), _tupled(shape, depth=0, count=[0])),
        input_slot,
        keyed,
        placed,
        memory,
        watched,
        named,
    )


def _parse_done(cls: type, h: dict[str, Any], descriptors: list[Any]) -> Done:
    ref, output, produced, took_us, saw = _take(h, Done, "Done")
    output_slot = _slot(output, descriptors)
    if type(produced) is list and len(produced) > limits.MAX_NODES:
        raise Bad(f"`Done.produced` has {len(produced):,} entries, over the limit of {limits.MAX_NODES:,}")
    pairs = index_pairs(produced, "Done.produced")
    return Done(ref, output_slot, {i: _slot(d, descriptors) for i, d in pairs.items()}, took_us, _facts(saw))


def _facts(saw: Any) -> tuple[dict[str, str], ...]:
    """``Done.saw`` as it is held: a list of maps (each map's entries are `check`'s to look at)."""
    if type(saw) is not list:
        raise Bad(f"`Done.saw` has to be a list of facts, and it is a `{msgpack_type(saw)}`")
    if len(saw) > limits.MAX_SAW:
        raise Bad(f"`Done.saw` has {len(saw):,} facts, over the limit of {limits.MAX_SAW}")
    for fact in saw:
        if type(fact) is not dict:
            raise Bad(f"a fact of `Done.saw` has to be a map, and one is a `{msgpack_type(fact)}`")
    return tuple(saw)


def _parse_saw(cls: type, h: dict[str, Any], descriptors: list[Any]) -> Saw:
    ref, fact = _take(h, Saw, "Saw")
    if type(fact) is not dict:  # a map: _check looks at its entries
        raise Bad(f"`Saw.fact` has to be a map, and it is a `{msgpack_type(fact)}`")
    return Saw(ref, fact)


def _parse_listed(cls: type, h: dict[str, Any], descriptors: list[Any]) -> Listed:
    hosts, dialed = _take(h, Listed, "Listed")
    for name, value in (("hosts", hosts), ("dialed", dialed)):
        if type(value) is not dict:
            raise Bad(f"`Listed.{name}` has to be a map, and it is a `{msgpack_type(value)}`")
    return Listed(hosts, dialed)


_PARSERS: dict[type, Callable[[type, dict[str, Any], list[Any]], Any]] = {
    Work: _parse_work,
    Done: _parse_done,
    Saw: _parse_saw,
    Listed: _parse_listed,
}


def _slot(descriptor: Any, descriptors: list[Any]) -> Slot:
    descriptors.append(descriptor)
    return Slot(len(descriptors) - 1, descriptor)


def _tagged(d: Any, tag: str, where: str, what: str) -> None:
    if type(d) is not list or not d or d[0] != tag:
        raise Bad(f"`{where}` has to be {what}, and its descriptor is not one")


def _tupled(x: Any, depth: int = 0, count: list[int] | None = None) -> Any:
    """Arrays as tuples, all the way down (for a shape: bounded in depth and size)."""
    if type(x) is not list:
        return x
    if count is not None:
        count[0] += len(x)
        if depth > 2 * limits.MAX_SHAPE_DEPTH + 1 or count[0] > 2 * limits.MAX_SHAPE:
            raise Bad(
                f"`Work.recipe.shape` is over {limits.MAX_SHAPE_DEPTH} groups deep or over {limits.MAX_SHAPE:,} pieces"
            )
        return tuple(_tupled(v, depth + 1, count) for v in x)
    return tuple(x)


def _fill(msg: Any, values: tuple[Any, ...]) -> Work | Done:
    if isinstance(msg, Work):
        if msg.recipe is None:  # the repeated call's Work: built directly, not replaced
            return Work(
                msg.ref,
                None,
                values[msg.input.index],
                msg.keys,
                msg.placement,
                msg.memory,
                msg.watched,
                msg.recipe_digest,
            )
        held: tuple[Any, ...] = msg.recipe.nodes  # their args and kwargs are Slots still (`_parse_work`)
        nodes = tuple(dataclasses.replace(n, args=values[n.args.index], kwargs=values[n.kwargs.index]) for n in held)
        recipe = dataclasses.replace(msg.recipe, nodes=nodes)
        return dataclasses.replace(msg, recipe=recipe, input=values[msg.input.index])
    produced = {i: values[s.index] for i, s in msg.produced.items()}
    done: Done = dataclasses.replace(msg, output=values[msg.output.index], produced=produced)
    return done
