"""The short way in: the messages of every call, read in one step.

A header that begins as ``encode`` writes one (a small map, ``v`` and ``t`` first) is told
by its first bytes (``told``, which ``variant_of`` asks first). A ``Relay``, and a ``Work``
naming its recipe by digest or a ``Done``, each of one scalar value in the header (no
frames), are built from one ``unpackb`` with every check the long way makes (``read``).
Anything unusual (a key twice or not text, a field missing or extra, a header over 64 KiB,
values in frames) gives None here: :mod:`somatize.wire.reading` then reads it the long way,
and refuses it with its own sentence. Nothing here is trusted more than there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgpack

from ..codec.layout import INLINE_TYPES
from ..errors import ProtocolError
from . import limits
from .checks import Bad, check, index_pairs
from .messages import VARIANTS, Done, Relay, Work, header_fields

_HEAD = msgpack.packb({"v": limits.WIRE_VERSION, "t": ""})[1:-1]  # up to the name's length
_TOLD = {name.encode(): cls for name, cls in VARIANTS.items() if cls in (Relay, Work, Done)}
_FIELDS_OF = {cls: frozenset(("v", "t", *header_fields(cls))) for cls in _TOLD.values()}
_SMALL = 64 << 10  # the largest header read the short way


def told(frames: Sequence[Any]) -> type | None:
    """``Relay``, ``Work`` or ``Done`` when frame 0 begins as that message's header does,
    from its first bytes alone; None says nothing (the long way reads it)."""
    try:
        first = frames[0]
        first = getattr(first, "buffer", first) if type(first) is not bytes else first
        n = len(_HEAD)
        if not (0x86 <= first[0] <= 0x8F and first[1:1 + n] == _HEAD):
            return None
        size = first[1 + n] - 0xA0
        return _TOLD.get(bytes(first[2 + n:2 + n + size])) if 0 < size < 32 else None
    except (IndexError, TypeError, KeyError, ValueError):
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


def _inline(buffers: list, cls: type) -> Work | Done | None:
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
            output, produced = header["output"], header["produced"]
            if type(output) not in INLINE_TYPES or type(produced) is not list or produced:
                return None
            msg: Any = Done(header["ref"], output, {}, header["took_us"])
        else:
            value = header["input"]
            if header["recipe"] is not None or type(value) not in INLINE_TYPES:
                return None
            keys = index_pairs(header["keys"], "Work.keys")
            placement = index_pairs(header["placement"], "Work.placement")
            msg = Work(header["ref"], None, value, keys, placement, header["memory"], header["watched"],
                       header["recipe_digest"])
        check(msg)
    except Bad:
        return None
    return msg


def _relay(buffers: list) -> Relay | None:
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


def read(cls: type, buffers: list) -> Relay | Work | Done | None:
    """The message of variant ``cls`` (as ``told`` said) that ``buffers`` (checked for count
    and sizes) hold, built in one step; None when it is not one the short way reads."""
    return _relay(buffers) if cls is Relay else _inline(buffers, cls)


def _no_ext(code: int, data: bytes) -> Any:
    raise ValueError("an extension type: the long way says so")
