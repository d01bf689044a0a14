"""Cargo streamed through a broker in chunks, never more than a window in flight.

On the Relayed path a big message would otherwise sit whole in the broker's memory. So a
message over ``CHUNK`` bytes is sent as a stream: a ``begin`` stating every frame's size,
then chunks of the frames laid end to end. The receiver grants ``credit`` as it consumes
chunks, and the sender stops whenever ``WINDOW`` bytes are unacknowledged: the broker
holds at most a window of this stream, however large the cargo.

The sizes in a ``begin`` are checked against the wire's limits, and a frame's memory is
taken only once all its chunks have arrived (they are held as received until then):
announcing costs a sender nothing it has not sent. Pure data and counting: the sockets
belong to the caller.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Iterator, Sequence

import msgpack
import numpy as np

from ..errors import ProtocolError
from ..wire import MAX_FRAME, MAX_FRAMES, MAX_TOTAL

MARK = b"\x00somatize-stream"
BEGIN, CHUNK_KIND, CREDIT = b"begin", b"chunk", b"credit"
#: Bytes per chunk.
CHUNK = 4 << 20
#: Bytes a sender may have unacknowledged at once (what a broker holds at most).
WINDOW = 16 << 20

_ids = itertools.count(1)


def worth_streaming(frames: Sequence) -> bool:
    return sum(memoryview(f).nbytes for f in frames) > CHUNK


def new_id() -> bytes:
    return f"{os.getpid()}-{next(_ids)}".encode()


class Outgoing:
    """The sender's side of one stream."""

    def __init__(self, sid: bytes, frames: Sequence) -> None:
        self.sid = sid
        self.views = [memoryview(f).cast("B") for f in frames]
        self.credit = WINDOW
        self._chunks = self._cut()
        self._next: memoryview | None = None
        self.finished = False
        self.touched = time.monotonic()

    def begin(self) -> list:
        sizes = [v.nbytes for v in self.views]
        return [MARK, BEGIN, self.sid, msgpack.packb(sizes)]

    def _cut(self) -> Iterator[memoryview]:
        for view in self.views:
            for start in range(0, view.nbytes, CHUNK):
                yield view[start : start + CHUNK]

    def chunks(self) -> Iterator[list]:
        """Every chunk message the credit allows now."""
        while not self.finished:
            if self._next is None:
                self._next = next(self._chunks, None)
                if self._next is None:
                    self.finished = True
                    return
            if self._next.nbytes > self.credit:
                return
            chunk, self._next = self._next, None
            self.credit -= chunk.nbytes
            yield [MARK, CHUNK_KIND, self.sid, chunk]

    def grant(self, amount: int) -> None:
        self.credit += amount
        self.touched = time.monotonic()


class Incoming:
    """The receiver's side of one stream: frames filled in place as chunks arrive."""

    def __init__(self, sid: bytes, sizes_frame: bytes) -> None:
        try:
            sizes = msgpack.unpackb(sizes_frame, max_array_len=MAX_FRAMES + 1)
        except Exception as exc:
            raise ProtocolError("a stream's begin does not list its frame sizes") from exc
        if (
            not isinstance(sizes, list)
            or not 1 <= len(sizes) <= MAX_FRAMES + 1
            or not all(isinstance(s, int) and 0 <= s <= MAX_FRAME for s in sizes)
            or sum(sizes) > MAX_TOTAL
        ):
            raise ProtocolError("a stream's begin states frame sizes beyond what this side accepts")
        self.sid = sid
        self.sizes = sizes
        self.frames: list = []  # completed frames, in order
        self._chunks: list[memoryview] = []  # of the frame being received
        self._frame = 0
        self._offset = 0
        self.touched = time.monotonic()
        self._skip_empty()

    @property
    def complete(self) -> bool:
        return self._frame >= len(self.sizes)

    def add(self, data: memoryview) -> int:
        """Place one chunk; return how many bytes to grant back."""
        data = memoryview(data).cast("B")
        if self.complete or self._offset + data.nbytes > self.sizes[self._frame]:
            raise ProtocolError("a stream sent a chunk that does not fit the sizes it announced")
        self._chunks.append(data)
        self._offset += data.nbytes
        self.touched = time.monotonic()
        if self._offset == self.sizes[self._frame]:
            self.frames.append(_joined(self._chunks, self._offset))
            self._chunks = []
            self._frame += 1
            self._offset = 0
            self._skip_empty()
        return data.nbytes

    def _skip_empty(self) -> None:
        while self._frame < len(self.sizes) and self.sizes[self._frame] == 0:
            self.frames.append(bytearray())
            self._frame += 1


def _joined(chunks: list[memoryview], size: int) -> memoryview:
    if len(chunks) == 1:
        return chunks[0]  # the received frame itself: no copy
    whole = np.empty(size, np.uint8)  # every byte is written below: no zero-fill first
    at = 0
    for chunk in chunks:
        whole[at : at + chunk.nbytes] = np.frombuffer(chunk, np.uint8)
        at += chunk.nbytes
    return memoryview(whole)


def credit(sid: bytes, amount: int) -> list:
    return [MARK, CREDIT, sid, amount.to_bytes(8, "little")]


def parse(parts: Sequence) -> tuple[bytes, bytes, object]:
    """``(kind, sid, payload)`` of a stream message (``parts`` starts at the mark)."""
    if len(parts) != 4:
        raise ProtocolError("a stream message has four frames")
    kind, sid = _bytes(parts[1]), _bytes(parts[2])
    if kind not in (BEGIN, CHUNK_KIND, CREDIT) or not 0 < len(sid) <= 64:
        raise ProtocolError("a stream message of an unknown kind")
    payload = parts[3]
    if kind == CREDIT:
        raw = _bytes(payload)
        if len(raw) != 8:
            raise ProtocolError("a stream credit is eight bytes")
        return kind, sid, int.from_bytes(raw, "little")
    if kind == BEGIN:
        return kind, sid, _bytes(payload)
    return kind, sid, payload.buffer if hasattr(payload, "buffer") else memoryview(payload)


def _bytes(part: object) -> bytes:
    return part.bytes if hasattr(part, "bytes") else bytes(part)  # type: ignore[union-attr]
