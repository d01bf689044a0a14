"""Cargo streamed through a broker in chunks, never more than a window in flight.

On the Relayed path a big message would otherwise sit whole in the broker's memory. So a
message over ``CHUNK`` bytes is sent as a stream of carriers (:mod:`somatize.wire`): a
``Begin`` stating every frame's size, then ``Chunk`` s of the frames laid end to end. The
receiver answers ``Credit`` as it consumes chunks, and the sender stops whenever ``WINDOW``
bytes are unacknowledged: the broker holds at most a window of this stream, however large
the cargo.

What a receiver holds is bounded by who sent it: each tenant (a client key, or one
connection where there are no keys) has at most ``per_tenant`` streams open, all tenants
together ``total``, and a stream that has not kept up ``MIN_RATE`` on average since
its first ``GRACE`` seconds (judged by what arrived, not by what it announced) is dropped:
a peer that keeps a slot with one-byte chunks, or with a huge announcement, loses it. The sizes in a
``Begin`` are checked against the wire's limits, and a frame's memory is taken only once
all its chunks have arrived (they are held as received until then): announcing costs a
sender nothing it has not sent. Pure data and counting: the sockets belong to the caller.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np

from ..wire import MAX_FRAME, MAX_FRAMES, MAX_TOTAL, Begin, Chunk, ref_of
from .conversation import Violation

#: Bytes per chunk.
CHUNK = 4 << 20
#: Bytes a sender may have unacknowledged at once (what a broker holds at most).
WINDOW = 16 << 20
#: The slowest a stream may arrive, on average, in bytes per second.
MIN_RATE = 1 << 20
#: Seconds every stream is given on top of its size at ``MIN_RATE``.
GRACE = 30.0

_sids = itertools.count(1)
_salt = (os.getpid() & 0xFFFF) << 40


def worth_streaming(frames: Sequence) -> bool:
    return sum(memoryview(f).nbytes for f in frames) > CHUNK


def new_sid() -> int:
    """A stream number, unique in this process (and unlikely to meet another's)."""
    return _salt + next(_sids)


class Outgoing:
    """The sender's side of one stream."""

    def __init__(self, sid: int, frames: Sequence) -> None:
        self.sid = sid
        self.views = [memoryview(f).cast("B") for f in frames]
        self.credit = WINDOW
        self._chunks = self._cut()
        self._next: memoryview | None = None
        self.finished = False
        self.begun = False  # its Begin has left (a worker's outbox sends it when there is room)
        self.touched = time.monotonic()

    def begin(self) -> Begin:
        return Begin(self.sid, tuple(v.nbytes for v in self.views))

    def _cut(self) -> Iterator[memoryview]:
        for view in self.views:
            for start in range(0, view.nbytes, CHUNK):
                yield view[start : start + CHUNK]

    def chunks(self) -> Iterator[Chunk]:
        """Every chunk the credit allows now."""
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
            yield Chunk(self.sid, chunk)

    def grant(self, amount: int) -> None:
        self.credit += amount
        self.touched = time.monotonic()


class _Receiving:
    """The receiver's side of one stream: frames filled in as chunks arrive."""

    def __init__(self, tenant: str, sizes: tuple[int, ...], now: float, reply: Any = None) -> None:
        if not 1 <= len(sizes) <= MAX_FRAMES or any(s > MAX_FRAME for s in sizes) or sum(sizes) > MAX_TOTAL:
            raise Violation("a stream's Begin states frame sizes beyond what this side accepts")
        self.tenant = tenant
        self.reply = reply  # where a refusal goes when the stream is dropped
        self.sizes = sizes
        self.frames: list = []  # completed frames, in order
        self._chunks: list[memoryview] = []  # of the frame being received
        self._frame = 0
        self._offset = 0
        self.started = now
        self.received = 0
        self._skip_empty()

    def outlived(self, now: float) -> bool:
        """Whether it came slower than ``MIN_RATE`` after its grace: judged by what arrived,
        never by what it announced (a huge announcement buys no time)."""
        return now > self.started + GRACE + self.received / MIN_RATE

    @property
    def complete(self) -> bool:
        return self._frame >= len(self.sizes)

    def add(self, data: bytes | memoryview) -> int:
        data = memoryview(data).cast("B")
        if self.complete or self._offset + data.nbytes > self.sizes[self._frame]:
            raise Violation("a stream sent a chunk that does not fit the sizes it announced")
        self._chunks.append(data)
        self._offset += data.nbytes
        self.received += data.nbytes
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


class Dropped(NamedTuple):
    """A stream dropped unfinished: its sender, its number, where to answer, the Work's ref."""

    peer: bytes
    sid: int
    reply: Any
    ref: int | None


class Inbound:
    """Every stream one side is receiving, keyed by the peer that sends it and its number."""

    def __init__(self, *, per_tenant: int = 2, total: int = 64) -> None:
        self.per_tenant = per_tenant
        self.total = total
        self._streams: dict[tuple[bytes, int], _Receiving] = {}

    def __len__(self) -> int:
        return len(self._streams)

    def begin(self, peer: bytes, tenant: str, msg: Begin, now: float | None = None, *, reply: Any = None) -> None:
        key = (peer, msg.sid)
        if key in self._streams:
            raise Violation(f"stream {msg.sid} began twice")
        held = sum(1 for s in self._streams.values() if s.tenant == tenant)
        if held >= self.per_tenant:
            raise Violation(
                f"you are already sending {held} big messages here, as many as one sender may at "
                f"once; send the next when one has finished"
            )
        if len(self._streams) >= self.total:
            raise Violation("this side is receiving as many big messages as it takes; try again shortly")
        self._streams[key] = _Receiving(tenant, msg.sizes, time.monotonic() if now is None else now, reply)

    def chunk(self, peer: bytes, msg: Chunk) -> tuple[int, list | None]:
        """Place one chunk: (bytes to grant back, the message's frames once complete)."""
        key = (peer, msg.sid)
        stream = self._streams.get(key)
        if stream is None:
            raise Violation("a stream chunk arrived for a stream that never began (or was dropped)")
        try:
            granted = stream.add(msg.data)
        except Violation:
            del self._streams[key]  # what came of it so far is dropped, never guessed at
            raise
        if not stream.complete:
            return granted, None
        del self._streams[key]
        return granted, stream.frames

    def expire(self, now: float | None = None) -> list[Dropped]:
        """Drop streams past their lifetime; return what the sender of each is to be told."""
        now = time.monotonic() if now is None else now
        gone = [key for key, s in self._streams.items() if s.outlived(now)]
        dropped = []
        for key in gone:
            stream = self._streams.pop(key)
            # the Work it carried, when its header arrived: the refusal names what it ends
            ref = ref_of(stream.frames[:1]) if stream.frames else None
            dropped.append(Dropped(key[0], key[1], stream.reply, ref))
        return dropped

    def drop(self, peer: bytes) -> None:
        for key in [k for k in self._streams if k[0] == peer]:
            del self._streams[key]


def _joined(chunks: list[memoryview], size: int) -> memoryview:
    if len(chunks) == 1:
        return chunks[0]  # the received frame itself: no copy
    whole = np.empty(size, np.uint8)  # every byte is written below: no zero-fill first
    at = 0
    for chunk in chunks:
        whole[at : at + chunk.nbytes] = np.frombuffer(chunk, np.uint8)
        at += chunk.nbytes
    return whole.data  # memoryview(whole)
