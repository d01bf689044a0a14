"""Arrow ``RecordBatch`` and ``Table`` as a codec kind: an uncompressed IPC stream in one
frame. pyarrow is imported only when an Arrow value or Arrow bytes turn up.

Arrow bytes are checked before anything is read into memory that they describe: a reader of
a compressed IPC stream would decompress to whatever size the stream names, so each
message's metadata (a flatbuffer) is read here, by hand, and a compressed body is refused.
The stream is then read and validated in full (offsets, lengths, UTF-8).
"""

from __future__ import annotations

import struct
from typing import Any

from somatize.errors import Unreadable

from .layout import ARROW_TABLE, byte_view


def pyarrow_modules(kind: str = "") -> tuple[Any, Any]:
    try:
        import pyarrow
        import pyarrow.ipc
    except ImportError as exc:
        raise Unreadable(
            f"bytes of kind `{kind}` arrived and pyarrow is not installed here: pip install somatize[arrow]"
        ) from exc
    return pyarrow, pyarrow.ipc


def dump(v: Any) -> memoryview | bytes:
    pa, ipc = pyarrow_modules()
    sink = pa.BufferOutputStream()
    with ipc.new_stream(sink, v.schema) as writer:
        writer.write(v)
    return byte_view(sink.getvalue())


def check(kind: str, view: memoryview) -> None:
    """Refuse Arrow bytes that are not an uncompressed IPC stream, reading only each
    message's metadata. A compressed body states its own decompressed size, which is how
    66 KB could ask for gigabytes; this codec never writes compressed streams, so it reads
    none, and nothing is decompressed or allocated here."""
    pa, ipc = pyarrow_modules(kind)
    try:
        reader = ipc.MessageReader.open_stream(pa.py_buffer(view))
        while True:
            try:
                message = reader.read_next_message()
            except StopIteration:
                return
            what = _ipc_compressed(memoryview(message.metadata))
            if what:
                raise Unreadable(
                    f"bytes of kind `{kind}` are a {what}, which this side does not read: a "
                    f"compressed body names its own size once decompressed, so it is refused "
                    f"before anything is decompressed. Send the RecordBatch or Table itself: "
                    f"somatize writes it uncompressed"
                )
    except Unreadable:
        raise
    except Exception as exc:
        raise Unreadable(f"bytes of kind `{kind}` are not a valid Arrow IPC stream ({type(exc).__name__})") from exc


_SCHEMA, _DICTIONARY_BATCH, _RECORD_BATCH = 1, 2, 3  # Arrow's MessageHeader union


def _ipc_compressed(meta: memoryview) -> str:
    """What is wrong with an Arrow IPC message's metadata (a ``Message`` flatbuffer), or
    "" when nothing is: a compressed body, or a message that is no part of a stream of
    record batches. Field numbers are those of Arrow's ``Message.fbs``."""
    message = _fb_table(meta, _fb_u(meta, "<I", 0))
    at = _fb_field(meta, message, 1)  # header_type (the union's type byte)
    header_type = _fb_u(meta, "<B", message[0] + at) if at else 0
    if header_type == _SCHEMA:
        return ""
    if header_type not in (_DICTIONARY_BATCH, _RECORD_BATCH):
        return f"Arrow IPC message of type {header_type} (not a schema or a record batch)"
    header = _fb_child(meta, message, 2)
    if header_type == _DICTIONARY_BATCH:
        header = _fb_child(meta, header, 1)  # DictionaryBatch.data, a RecordBatch
    if _fb_field(meta, header, 3):  # RecordBatch.compression
        return "compressed Arrow IPC stream"
    return ""


def _fb_u(buf: memoryview, fmt: str, pos: int) -> int:
    size = struct.calcsize(fmt)
    if pos < 0 or pos + size > len(buf):
        raise ValueError("the IPC metadata points outside itself")
    return struct.unpack_from(fmt, buf, pos)[0]


def _fb_table(buf: memoryview, pos: int) -> tuple[int, int, int]:
    """A flatbuffer table at ``pos``: (its position, its vtable's, the vtable's length)."""
    vtable = pos - _fb_u(buf, "<i", pos)
    return pos, vtable, _fb_u(buf, "<H", vtable)


def _fb_field(buf: memoryview, table: tuple[int, int, int], n: int) -> int:
    """Where field ``n`` of a table sits, relative to the table; 0 when it is absent."""
    pos, vtable, length = table
    if 4 + 2 * n + 2 > length:
        return 0
    return _fb_u(buf, "<H", vtable + 4 + 2 * n)


def _fb_child(buf: memoryview, table: tuple[int, int, int], n: int) -> tuple[int, int, int]:
    """The table that field ``n`` (an offset) of ``table`` points to."""
    at = _fb_field(buf, table, n)
    if not at:
        raise ValueError("the IPC metadata lacks a table it needs")
    pos = table[0] + at
    return _fb_table(buf, pos + _fb_u(buf, "<I", pos))


def load(kind: str, view: memoryview) -> Any:
    pa, ipc = pyarrow_modules(kind)
    try:
        reader = ipc.open_stream(pa.py_buffer(view))
        if kind == ARROW_TABLE:
            out = reader.read_all()
        else:
            batches = list(reader)
            if len(batches) != 1:
                raise Unreadable(f"bytes of kind `{kind}` hold {len(batches)} record batches instead of one")
            out = batches[0]
        out.validate(full=True)  # do not trust the bytes: offsets, lengths, UTF-8
    except Unreadable:
        raise
    except Exception as exc:
        raise Unreadable(f"bytes of kind `{kind}` are not a valid Arrow IPC stream ({type(exc).__name__})") from exc
    return out
