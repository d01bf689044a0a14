"""A header's items, counted before anything is built: MessagePack states every array's
and map's length up front, so a header of a million tiny items is refused by walking its
bytes, before it costs memory as Python objects (``reading`` and ``writing`` both count)."""

from __future__ import annotations

import msgpack

from . import limits
from .checks import Bad, Pieces

_ARRAYS = frozenset(range(0x90, 0xA0)) | {0xDC, 0xDD}  # fixarray, array 16, array 32
_MAPS = frozenset(range(0x80, 0x90)) | {0xDE, 0xDF}  # fixmap, map 16, map 32


def count_items(frame: bytes | memoryview) -> None:
    """Refuse (``Bad``) a MessagePack header that declares over ``limits.MAX_ITEMS`` items:
    every array and map, and every entry of one (a map's key and value are two).

    The count walks the MessagePack in order, reading each container's length and skipping
    every scalar without building it, and stops as soon as the limit is passed, so refusing
    costs at most ``MAX_ITEMS`` steps and no memory. Every item is at least one byte, so a
    frame of at most ``MAX_ITEMS`` bytes is not walked at all. Bytes that are not
    MessagePack are left to the reader to refuse, with its own sentence: it stops where this
    walk stopped, before building more items than were counted.
    """
    limit = limits.MAX_ITEMS
    if len(frame) <= limit:  # bytes, or a flat view of bytes: its length is its size
        return
    view = memoryview(frame)
    unpacker = msgpack.Unpacker(Pieces(view), max_buffer_size=view.nbytes)
    items = 0
    todo = 1  # items still to read, at every level together: the order does not matter
    try:
        while todo:
            todo -= 1
            mark = view[unpacker.tell()]
            if mark in _ARRAYS:
                n = unpacker.read_array_header()
            elif mark in _MAPS:
                n = 2 * unpacker.read_map_header()
            else:
                unpacker.skip()
                continue
            items += 1 + n
            if items > limit:
                raise Bad(f"declares over {limit:,} items (arrays, maps and their entries)")
            todo += n
    except Bad:
        raise
    except Exception:
        return
