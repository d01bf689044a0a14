"""The short way in: the messages of every call, read in one step.

A header that begins as ``encode`` writes one (a small map, ``v`` and ``t`` first) is told
by its first bytes (``told``, which ``variant_of`` asks first). A ``Relay``, and a ``Work``
naming its recipe by digest or a ``Done``, each of one scalar value in the header (no
frames), are built from one ``unpackb`` with every check the long way makes (``read``).
Anything unusual (a key twice or not text, a field missing or extra, a header over 64 KiB,
values in frames) gives None here: :mod:`somatize.wire.reading` then reads it the long way,
and refuses it with its own sentence. Nothing here is trusted more than there.

The call's own two messages, a ``Work`` naming its recipe by digest and a ``Done``, each of
one scalar and nothing else (no keys, no placement, nothing produced, no facts), are read
and written by msgspec's MessagePack codec into and out of a typed map (``_WorkHead``,
``_DoneHead``): the same bytes, its C decoder checking every field the long way checks
(types, bounds, no field missing, none unknown, none twice: exactly as many entries as
fields). Whatever it does not take goes on to the ways above, unchanged.

Greetings: every channel opens with a ``Hello`` and its ``Ready`` and ends with a ``Bye``,
and the ones of one installation are the same bytes every time. A greeting read the long way is remembered by
its bytes (``remember``), and one written by its value (``keep_written``), a few dozen of
each: the same bytes read again, or the same message written again, is the same message.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

import msgpack
import msgspec

from ..codec.layout import INLINE_BYTES, INLINE_TYPES, INT_MAX, INT_MIN
from ..errors import ProtocolError
from . import limits
from .checks import Bad, check
from .items import index_pairs, text_map
from .messages import VARIANTS, Answer, Bye, Carrier, Done, Hello, Ready, Relay, Request, Work, built, header_fields

_HEAD = msgpack.packb({"v": limits.WIRE_VERSION, "t": ""})[1:-1]  # up to the name's length
_TOLD = {name.encode(): cls for name, cls in VARIANTS.items()}
READ = frozenset((Relay, Work, Done, Hello, Ready, Bye))  # the variants `read` may build
GREETINGS = (Hello, Ready, Bye)  # the first words of every channel, and its last
_KNOWN: dict[bytes, Hello | Ready | Bye] = {}  # a greeting's bytes, read and checked -> the message
_WRITTEN: dict[Hello | Ready | Bye, list[bytes]] = {}  # a greeting written -> its frames
_MAX_GREETINGS, _MAX_GREETING_BYTES = 64, 4096
_FIELDS_OF = {cls: frozenset(("v", "t", *header_fields(cls))) for cls in _TOLD.values()}
_SMALL = 64 << 10  # the largest header read the short way


# -- the call's two messages, by msgspec ---------------------------------------------------

_Ref = Annotated[int, msgspec.Meta(ge=0, le=limits.MAX_REF)]


class _WorkHead(msgspec.Struct, forbid_unknown_fields=True):
    """The header of a ``Work`` as ``encode`` writes it, fields in its order."""

    v: Literal[limits.WIRE_VERSION]  # type: ignore[valid-type]  # msgspec reads the constant at run time
    t: Literal["Work"]
    ref: _Ref
    input: Any
    recipe: None
    keys: list[Any]
    placement: list[Any]
    memory: str | None
    watched: bool
    recipe_digest: str


class _DoneHead(msgspec.Struct, forbid_unknown_fields=True):
    """The header of a ``Done`` as ``encode`` writes it, fields in its order."""

    v: Literal[limits.WIRE_VERSION]  # type: ignore[valid-type]  # msgspec reads the constant at run time
    t: Literal["Done"]
    ref: _Ref
    output: Any
    produced: list[Any]
    took_us: _Ref
    saw: list[Any]


# either head, as `cls` tells: what a decoder read is looked at as the variant it is
_EXPRESS: dict[type, msgspec.msgpack.Decoder[Any]] = {
    Work: msgspec.msgpack.Decoder(_WorkHead),
    Done: msgspec.msgpack.Decoder(_DoneHead),
}
_BY_ENTRIES = {0x80 + len(_WorkHead.__struct_fields__): Work, 0x80 + len(_DoneHead.__struct_fields__): Done}
_WRITE = msgspec.msgpack.Encoder().encode
_NOT_TAKEN = (msgspec.ValidationError, msgspec.DecodeError, RecursionError)  # nesting deeper than Python allows


def head_of(frame: Any) -> Any:
    """Frame 0 of a message as ``express`` reads it: bytes as they are; a ``zmq.Frame`` of
    a header small enough to be read so, as its bytes (a copy of a few hundred bytes costs
    less than the view of them, and msgspec reads bytes faster); anything else as its
    buffer (``express`` then says whether it reads it)."""
    if type(frame) is bytes:
        return frame
    try:
        small = len(frame) <= _SMALL
    except TypeError:  # a buffer with no length: read as its buffer, as the long way reads it
        small = False
    if small:
        data = getattr(frame, "bytes", None)
        if type(data) is bytes:
            return data
    return getattr(frame, "buffer", frame)


def express(head: Any) -> Work | Done | None:
    """The ``Work`` or ``Done`` that the header ``head`` (bytes or a memoryview) alone holds,
    when it is one of one scalar and nothing else; None for any other (the short or the
    long way reads it, and says what is wrong). Told apart by how many fields the header
    has: as many as the variant has, so none is missing, extra or there twice."""
    if type(head) is not bytes and (type(head) is not memoryview or head.ndim != 1 or not head.c_contiguous):
        return None  # a view of another shape, or strided: the long way casts it
    if not 0 < len(head) <= _SMALL or not _fits(len(head)):
        return None
    cls = _BY_ENTRIES.get(head[0])
    if cls is None:
        return None
    try:
        h = _EXPRESS[cls].decode(head)
    except _NOT_TAKEN:  # another variant of as many fields, or a field the long way looks at
        return None
    if h.ref > limits.MAX_REF:  # a limit a test lowered after `_Ref` was made
        return None
    if cls is Work:
        value = h.input
        if (
            type(value) not in INLINE_TYPES
            or h.keys
            or h.placement
            or h.memory is not None
            or not _digest(h.recipe_digest)
            or len(h.recipe_digest) > limits.MAX_NAME
        ):
            return None
        return built(
            Work,
            {
                "ref": h.ref,
                "recipe": None,
                "input": value,
                "keys": {},
                "placement": {},
                "memory": None,
                "watched": h.watched,
                "recipe_digest": h.recipe_digest,
            },
        )
    value = h.output
    if type(value) not in INLINE_TYPES or h.produced or h.saw or h.took_us > limits.MAX_REF:
        return None
    return built(Done, {"ref": h.ref, "output": value, "produced": {}, "took_us": h.took_us, "saw": ()})


def written_express(msg: Request | Answer | Carrier) -> list[bytes | memoryview] | None:
    """The one frame of ``msg`` when it is a ``Work`` naming its recipe by digest or a
    ``Done``, of one scalar the codec writes as itself and nothing else, every field as
    ``check`` would pass it; None for any other (``encode`` writes it, and refuses what is
    wrong). The bytes are the ones ``encode`` writes."""
    if type(msg) is Work:
        keys, placement = msg.keys, msg.placement
        if (
            msg.recipe is not None
            or type(keys) is not dict
            or keys
            or type(placement) is not dict
            or placement
            or msg.memory is not None
        ):
            return None
        return work_frames(msg.ref, msg.input, msg.watched, msg.recipe_digest)
    if type(msg) is not Done:
        return None
    produced, saw, ref, value, took = msg.produced, msg.saw, msg.ref, msg.output, msg.took_us
    if (
        type(produced) is not dict
        or produced
        or type(saw) is not tuple
        or saw
        or type(took) is not int
        or not 0 <= took <= limits.MAX_REF
        or type(ref) is not int
        or not 0 <= ref <= limits.MAX_REF
        or not _itself(value)
    ):
        return None
    written = _WRITE(_DoneHead(limits.WIRE_VERSION, "Done", ref, value, [], took, []))
    return [written] if _fits(len(written)) else None  # over a limit: `encode` says which


def work_frames(ref: int, value: Any, watched: bool, digest: str) -> list[bytes | memoryview] | None:
    """The one frame of a ``Work`` naming its recipe by ``digest``, of the one scalar
    ``value`` and nothing else (no keys, no placement), without building the ``Work``: the
    bytes ``encode`` writes for it. None when a field is not as ``check`` would pass it, or
    the value is not one the codec writes as itself (``encode`` writes it, or says why not)."""
    if (
        type(ref) is not int
        or not 0 <= ref <= limits.MAX_REF
        or type(watched) is not bool
        or type(digest) is not str
        or len(digest) > limits.MAX_NAME
        or not _digest(digest)
        or not _itself(value)
    ):
        return None
    written = _WRITE(_WorkHead(limits.WIRE_VERSION, "Work", ref, value, None, [], [], None, watched, digest))
    return [written] if _fits(len(written)) else None  # over a limit: `encode` says which


_DIGESTS: set[str] = set()  # recipe digests found well formed: a call names the same few every time
_MAX_DIGESTS = 256


def _digest(text: str) -> bool:
    """Whether ``text`` is a well-formed digest (``limits.DIGEST``); the answer for a text seen
    before is remembered (a few hundred), as matching it costs more than reading the header."""
    if text in _DIGESTS:
        return True
    if not limits.DIGEST.fullmatch(text):
        return False
    if len(_DIGESTS) >= _MAX_DIGESTS:
        _DIGESTS.clear()
    _DIGESTS.add(text)
    return True


def _fits(n: int) -> bool:
    """Whether a header of ``n`` bytes is within the limits the long way holds one to, as
    they are now (a test may lower one): its size, the message's, and its items (a header
    of no more bytes than ``MAX_ITEMS`` holds no more items)."""
    return n <= limits.MAX_HEADER and n <= limits.MAX_TOTAL and n <= limits.MAX_ITEMS


def _itself(v: Any) -> bool:
    """Whether the codec writes ``v`` as itself, in the header (``codec.Writer.value``)."""
    t = type(v)
    if t is float or t is bool or v is None:
        return True
    if t is int:
        n: int = v
        return INT_MIN <= n <= INT_MAX
    if t is str:
        return v.isascii() and len(v) <= INLINE_BYTES  # longer: `encode` says whether it fits
    return t is bytes and len(v) <= INLINE_BYTES


# -- the other messages of every call ----------------------------------------------------


def told(frames: Sequence[Any]) -> type | None:
    """The variant whose header frame 0 begins as (a map of a key for each of its fields at
    least, ``v`` and ``t`` first), from its first bytes alone; None says nothing (the long
    way reads it)."""
    try:
        first = frames[0]
        first = getattr(first, "buffer", first) if type(first) is not bytes else first
        n = len(_HEAD)
        if not (0x82 <= first[0] <= 0x8F and first[1 : 1 + n] == _HEAD):
            return None
        size = first[1 + n] - 0xA0
        cls = _TOLD.get(bytes(first[2 + n : 2 + n + size])) if 0 < size < 32 else None
        return cls if cls is not None and first[0] - 0x80 >= len(_FIELDS_OF[cls]) else None  # a key for each field
    except (IndexError, TypeError, KeyError, ValueError, NotImplementedError):  # a view of another shape
        return None


def _small_header(head: Any, cls: type) -> dict[str, Any] | None:
    """A small header map holding exactly the fields of ``cls`` (each once: as many keys as
    the map declares, all text), or None."""
    if len(head) > min(_SMALL, limits.MAX_ITEMS):  # no longer than `count_items` lets by unwalked
        return None
    try:
        header = msgpack.unpackb(head, raw=False, strict_map_key=True, ext_hook=_no_ext)
    except Exception:  # noqa: BLE001 - read the long way: it says what is wrong
        return None
    if type(header) is not dict or len(header) != head[0] - 0x80 or header.keys() != _FIELDS_OF[cls]:
        return None
    return header


def _inline(buffers: list[Any], cls: type) -> Work | Done | None:
    """A ``Done`` of one scalar output and nothing produced, or a ``Work`` naming its recipe
    by digest with one scalar input: no frames after the header, the value the header holds
    (a scalar needs no codec to build it), the fields checked as ``decode`` checks them.
    None for any other: the long way reads it."""
    if len(buffers) != 1:
        return None
    header = _small_header(buffers[0], cls)
    if header is None:
        return None
    try:
        if cls is Done:
            output, produced, saw = header["output"], header["produced"], header["saw"]
            if type(output) not in INLINE_TYPES or type(produced) is not list or produced or type(saw) is not list:
                return None
            if saw and (
                len(saw) > limits.MAX_SAW or any(type(f) is not dict for f in saw) or not _each_key_once(buffers[0])
            ):
                return None  # the long way says what is wrong with it
            msg: Work | Done = Done(header["ref"], output, {}, header["took_us"], tuple(saw))
        else:
            value = header["input"]
            if header["recipe"] is not None or type(value) not in INLINE_TYPES:
                return None
            keys = index_pairs(header["keys"], "Work.keys")
            placement = index_pairs(header["placement"], "Work.placement")
            msg = Work(
                header["ref"],
                None,
                value,
                keys,
                placement,
                header["memory"],
                header["watched"],
                header["recipe_digest"],
            )
        check(msg)
    except Bad:
        return None
    return msg


def _relay(buffers: list[Any]) -> Relay | None:
    """The ``Relay`` that ``frames`` hold (``told`` said it begins as one), built in one
    step and checked as ``decode`` checks one; None for anything unusual (a header over a
    few KiB, a key repeated or not text, a field missing or unknown): ``decode`` then reads
    it the long way, and refuses it with its own sentence."""
    header = _small_header(buffers[0], Relay)
    if header is None:
        return None
    if len(buffers) < 2:
        raise ProtocolError(
            "a `Relay` is its header and then the frames of the message it carries; this one carries none"
        )
    relay = Relay(header["host"], header["exchange"], header["tenant"], header["lane"], tuple(buffers[1:]))
    try:
        check(relay)
    except Bad as exc:
        raise ProtocolError(exc.why) from None
    return relay


def read(cls: type, buffers: list[Any]) -> Relay | Work | Done | Hello | Ready | Bye | None:
    """The message of variant ``cls`` (as ``told`` said) that ``buffers`` (checked for count
    and sizes) hold, built in one step; None when it is not one the short way reads."""
    if cls is Relay:
        return _relay(buffers)
    if cls in GREETINGS:
        return _KNOWN.get(bytes(buffers[0])) if len(buffers) == 1 and len(buffers[0]) <= _MAX_GREETING_BYTES else None
    return _inline(buffers, cls)


def remember(buffers: list[Any], msg: Any) -> None:
    """A greeting read the long way (so checked whole): the same bytes read again are it.
    A dialing worker's ``Hello`` names its host, and differs from worker to worker, and a
    proof (``Hello.prove``, ``Ready.proof``) is made once: neither is kept."""
    if type(msg) in GREETINGS and len(buffers) == 1 and len(buffers[0]) <= _MAX_GREETING_BYTES:
        if _once(msg):
            return
        if len(_KNOWN) >= _MAX_GREETINGS:  # many runtimes (or a peer sending many): start afresh
            _KNOWN.clear()
        _KNOWN[bytes(buffers[0])] = msg


def written(msg: Hello | Ready | Bye) -> list[bytes | memoryview] | None:
    """The frames of a greeting written before (a copy of the list), or None."""
    try:
        frames = _WRITTEN.get(msg)
    except TypeError:  # a field that is no value (a list where a tuple goes): `check` says so
        return None
    return None if frames is None else list(frames)


def keep_written(msg: Hello | Ready | Bye, frames: list[bytes | memoryview]) -> None:
    if len(frames) == 1 and len(frames[0]) <= _MAX_GREETING_BYTES and not _once(msg):
        if len(_WRITTEN) >= _MAX_GREETINGS:
            _WRITTEN.clear()
        _WRITTEN[msg] = [bytes(frames[0])]


def _once(msg: Any) -> bool:
    """A greeting that is never the same twice: not worth remembering."""
    return (
        getattr(msg, "offering", None) is not None or bool(getattr(msg, "prove", "")) or bool(getattr(msg, "proof", ""))
    )


def _each_key_once(head: Any) -> bool:
    """Whether every map in ``head`` holds each key once, and text keys only (its facts are
    maps: a key given twice would be merged quietly by ``unpackb``, where the long way
    refuses it), read as the long way reads them."""
    try:
        msgpack.unpackb(head, raw=False, strict_map_key=True, ext_hook=_no_ext, object_pairs_hook=text_map)
    except Exception:  # noqa: BLE001 - the long way says what is wrong
        return False
    return True


def _no_ext(code: int, data: bytes) -> Any:
    raise ValueError("an extension type: the long way says so")
