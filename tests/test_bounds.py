"""Memory bounded by what arrived: no message costs its reader more than a small multiple of
its size on the wire, plus a fixed overhead.

Each attack here once cost gigabytes (the figures are in each test). Each test plays it in
a child process, a real one, and reads that process's peak resident memory (``VmHWM``,
reset just before the decode) as the kernel counts it: no estimate of our own.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import msgpack
import numpy as np
import pytest

from somatize.errors import ProtocolError, Unreadable
from somatize.wire import (
    MAX_HEADER,
    MAX_ITEMS,
    MAX_KINDS,
    MAX_KINDS_TEXT,
    WIRE_VERSION,
    Done,
    Hello,
    Runtime,
    decode,
    encode,
)

codec_module = importlib.import_module("somatize.codec")
ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20

#: What one message may cost its reader beyond its own bytes: a small multiple of its size
#: on the wire, plus a fixed overhead (MAX_ITEMS items of some 50 bytes each, built twice at
#: most: once as the header, once as the values).
PER_WIRE_BYTE = 2
FIXED = 128 * MIB


def bound(wire_bytes: int) -> int:
    return PER_WIRE_BYTE * wire_bytes + FIXED


# The child: builds the frames (outside the measure), resets its peak, reads them, and says
# how its peak resident memory grew, how long reading took, and what came of it.
CHILD = textwrap.dedent(
    """
    import json, sys, time
    from somatize.errors import ProtocolError, Unreadable

    def peak():
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        raise AssertionError("no VmHWM")

    frames, read = build()
    wire = sum(memoryview(f).nbytes for f in frames)
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # the peak starts again from what is resident now
    before = peak()
    started = time.perf_counter()
    try:
        read(frames)
        outcome = "read"
    except (ProtocolError, Unreadable) as exc:
        outcome = "refused: " + str(exc)
    print(json.dumps({"grew": peak() - before, "took": time.perf_counter() - started,
                      "wire": wire, "outcome": outcome}))
    """
)


def measured(build: str) -> dict:
    """Run ``build`` (source defining ``build() -> (frames, read)``) and CHILD in a fresh
    process; what CHILD printed."""
    source = textwrap.dedent(build) + CHILD
    done = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def within_bound(result: dict) -> None:
    limit = bound(result["wire"])
    assert result["grew"] <= limit, (
        f"reading {result['wire']:,} bytes grew the peak resident memory by "
        f"{result['grew'] / MIB:.0f} MiB, over the bound of {limit / MIB:.0f} MiB ({result['outcome'][:200]})"
    )


# -- a header of empty arrays: 64 MiB of them grew RSS by 4.7 GB in 10-30 s ----------------
#
# Before (the tree at 4138f59): 4 MiB of empty arrays in `Done.output` grew the peak by
# 288 MiB in 2.3 s, 16 MiB by 1,171 MiB in 8.9 s (the 64 MiB: 4.7 GB). MessagePack
# built every item before anything was checked, and an empty array is one byte on the wire
# and some 72 in memory. After: 64 MiB of them grow it by 2 MiB, refused in under 0.3 s.


def empty_arrays(size: int, mark: int, nested: bool = False) -> str:
    """A `Done` whose output is ["L", x, x, ...], x the one-byte item `mark`, the header
    `size` bytes; `nested`: ["L", [x, ...], [x, ...], ...], in arrays of 60,000 each, so no
    one array declares much."""
    return f"""
    import struct, msgpack
    from somatize.wire import decode
    def build():
        start = msgpack.packb({{"v": {WIRE_VERSION}, "t": "Done", "ref": 1, "produced": [], "took_us": 0, "saw": []}})
        n = {size} - len(start) - 20
        item = bytes([{mark}])
        if {nested}:
            inner = b"\\xdc" + struct.pack(">H", 60_000) + item * 60_000
            count, body = n // len(inner), b""
            body = inner * count
        else:
            count, body = n, item * n
        head = (b"\\x87" + start[1:] + msgpack.packb("output") + b"\\xdd"
                + struct.pack(">I", count + 1) + msgpack.packb("L"))
        return [head + body], decode
    """


@pytest.mark.parametrize(
    "mark, nested",
    [(0x90, False), (0x90, True), (0x80, True), (0xEC, True)],
    ids=["empty arrays", "empty arrays, nested", "empty maps, nested", "small negative ints, nested"],
)
def test_a_header_of_tiny_items_costs_what_it_weighs(mark, nested):
    result = measured(empty_arrays(MAX_HEADER - 64, mark, nested))
    assert result["outcome"].startswith("refused: the header declares over"), result["outcome"]
    assert "items" in result["outcome"]
    within_bound(result)
    assert result["took"] < 5, f"refusing took {result['took']:.1f} s"


def test_just_under_the_item_limit_is_still_bounded():
    # the most items a header may declare, each the costliest kind: all built, then refused
    # by the value checks (an empty list is no descriptor)
    result = measured(empty_arrays(MAX_ITEMS - 64, 0x90))
    assert "descriptor" in result["outcome"] or "node" in result["outcome"], result["outcome"]
    within_bound(result)


def test_a_legitimate_header_of_many_small_values_is_read_within_the_bound():
    # a third of a million small lists (three items each), valid this time: the header and
    # the value are both built
    result = measured(
        f"""
        from somatize.wire import Done, decode, encode
        def build():
            return [bytes(f) for f in encode(Done(1, [[]] * ({MAX_ITEMS} // 3 - 100), {{}}, 0))], decode
        """
    )
    assert result["outcome"] == "read"
    within_bound(result)


def test_items_are_counted_only_for_long_headers_and_encode_refuses_what_decode_would():
    # a header shorter than MAX_ITEMS bytes cannot declare more, and is not walked
    small = encode(Done(1, list(range(1000)), {}, 0))
    assert decode(small).output == list(range(1000))
    # many small values are fine (thousands of tiny arrays too)
    arrays = [np.zeros(i % 3, np.float32) for i in range(5000)]
    back = decode(encode(Done(1, arrays, {}, 0)))
    assert len(back.output) == 5000 and all(np.array_equal(a, b) for a, b in zip(arrays, back.output, strict=False))
    # 800,000 pieces, under the codec's own limit, and 1.2 million items in a header
    with pytest.raises(ValueError, match=f"over {MAX_ITEMS:,} items"):
        encode(Done(1, [[None]] * 400_000, {}, 0))
    output = ["L", *[None] * MAX_ITEMS]
    header = {"v": WIRE_VERSION, "t": "Done", "ref": 1, "output": output, "produced": [], "took_us": 0}
    with pytest.raises(ProtocolError, match="items"):
        decode([msgpack.packb(header)])


# -- compressed Arrow IPC: 66 KB allocated 2 GB --------------------------------------------
#
# Before: 16 KB of ZSTD-compressed IPC (a RecordBatch of 512 MiB of zeros) grew the peak by
# 511 MiB when decoded. A compressed body names its own size once decompressed.

pa = pytest.importorskip("pyarrow")


def compressed_ipc(mib: int, compression: str = "zstd") -> bytes:
    ipc = pytest.importorskip("pyarrow.ipc")
    batch = pa.record_batch([pa.array(np.zeros((mib * MIB) // 8, np.int64))], names=["x"])
    sink = pa.BufferOutputStream()
    options = ipc.IpcWriteOptions(compression=compression)
    with ipc.new_stream(sink, batch.schema, options=options) as writer:
        writer.write(batch)
    return sink.getvalue().to_pybytes()


@pytest.mark.parametrize("compression", ["zstd", "lz4"])
@pytest.mark.pure
def test_compressed_arrow_ipc_is_refused_before_anything_is_decompressed(compression):
    data = compressed_ipc(8, compression)
    assert len(data) < 64 << 10
    with pytest.raises(Unreadable, match="compressed Arrow IPC"):
        codec_module.decode(["C", "arrow.RecordBatch", 0], [data])
    with pytest.raises(Unreadable, match="compressed Arrow IPC"):
        codec_module.decode(["C", "arrow.Table", 0], [data])
    # and through the wire, from a peer
    frames = encode(Done(1, pa.table({"x": [1, 2]}), {}, 0))
    with pytest.raises(ProtocolError, match="compressed Arrow IPC"):
        decode([frames[0], data])


@pytest.mark.pure
def test_a_compressed_dictionary_batch_is_refused_too():
    ipc = pytest.importorskip("pyarrow.ipc")
    column = pa.array(["a", "b"] * 1000).dictionary_encode()
    batch = pa.record_batch([column], names=["d"])
    sink = pa.BufferOutputStream()
    with ipc.new_stream(sink, batch.schema, options=ipc.IpcWriteOptions(compression="zstd")) as writer:
        writer.write(batch)
    with pytest.raises(Unreadable, match="compressed Arrow IPC"):
        codec_module.decode(["C", "arrow.RecordBatch", 0], [sink.getvalue().to_pybytes()])


def test_uncompressed_arrow_still_reads_and_the_attack_stays_bounded():
    table = pa.table({"x": np.arange(1000), "s": [str(i) for i in range(1000)]})
    assert decode(encode(Done(1, table, {}, 0))).output.equals(table)
    result = measured(
        """
        import numpy as np, pyarrow as pa, pyarrow.ipc as ipc
        from somatize.wire import Done, decode, encode
        def build():
            batch = pa.record_batch([pa.array(np.zeros((256 << 20) // 8, np.int64))], names=["x"])
            sink = pa.BufferOutputStream()
            with ipc.new_stream(sink, batch.schema, options=ipc.IpcWriteOptions(compression="zstd")) as w:
                w.write(batch)
            data = sink.getvalue().to_pybytes()
            head = encode(Done(1, pa.table({"x": [1]}), {}, 0))[0]
            del batch, sink
            return [head, data], decode
        """
    )
    assert "compressed Arrow IPC" in result["outcome"], result["outcome"]
    within_bound(result)


# -- kinds in a Hello: 40 Hellos listing 10,000 long kinds left 430 MiB ---------------------
#
# Before: a Hello's runtime could name 10,000 kinds of 1,000 characters (9.6 MiB); 40 of
# them decoded and kept (as a worker keeps each peer's runtime) held 403 MiB.


def hello_with(kinds: list[str]) -> list[bytes]:
    header = msgpack.unpackb(bytes(encode(Hello(Runtime.here()))[0]))
    header["runtime"]["kinds"] = kinds
    return [msgpack.packb(header)]


@pytest.mark.pure
def test_a_runtime_names_a_bounded_number_of_kinds():
    with pytest.raises(ProtocolError, match=f"over the limit of {MAX_KINDS:,}"):
        decode(hello_with([f"k{i}" for i in range(MAX_KINDS + 1)]))
    long = [f"{i:04d}" + "k" * 96 for i in range(MAX_KINDS)]  # 100,000 characters
    with pytest.raises(ProtocolError, match="characters in all"):
        decode(hello_with(long))
    with pytest.raises(ValueError, match="kinds"):
        encode(Hello(dataclasses.replace(Runtime.here(), kinds=tuple(long))))
    # what a real side states passes, with room to spare
    assert decode(encode(Hello(Runtime.here()))).runtime.kinds == Runtime.here().kinds
    fair = [f"myproject.Kind{i}" for i in range(MAX_KINDS)]
    assert len(decode(hello_with(fair)).runtime.kinds) == MAX_KINDS


def test_forty_hellos_of_the_most_kinds_allowed_keep_little():
    import tracemalloc

    most = [f"{i:04d}" + "k" * (MAX_KINDS_TEXT // MAX_KINDS - 4) for i in range(MAX_KINDS)]
    frames = hello_with(most)
    wire = len(frames[0])
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        kept = [decode(frames) for _ in range(40)]
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(kept) == 40
    assert held <= 40 * (4 * wire + 64 * 1024), f"40 Hellos keep {held / MIB:.1f} MiB"
    assert held < 8 * MIB  # the attack kept 403 MiB


# -- one check per descriptor ----------------------------------------------------------------
#
# Before: decode walked each value's descriptor twice, once in the wire (the kinds, the
# frames used) and once in the codec's decode.


@pytest.mark.pure
def test_decode_checks_each_descriptor_once():
    init = importlib.import_module("somatize.codec.reading").Checker.__init__.__code__
    walks = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code is init:
            walks.append(1)

    frames = encode(Done(1, [np.zeros(3), "x", {"a": 1}], {0: np.ones(2)}, 0))
    sys.setprofile(profile)
    try:
        back = decode(frames)
    finally:
        sys.setprofile(None)
    assert np.array_equal(back.produced[0], np.ones(2))
    assert len(walks) == 1
