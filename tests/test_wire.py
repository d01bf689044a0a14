"""The wire, without a socket: messages to frames and back, and everything malformed refused."""

from __future__ import annotations

import dataclasses
import importlib
import struct

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from somatize import Node, wire
from somatize.codec import Opaque, codec, readable_kinds
from somatize.errors import ProtocolError, Unwritable
from somatize.wire import (
    ANSWERS,
    CARRIERS,
    MAX_FACT,
    MAX_FACT_TEXT,
    MAX_FRAME,
    MAX_FRAMES,
    MAX_HEADER,
    MAX_NAME,
    MAX_PATH,
    MAX_SAW,
    MAX_SHAPE_DEPTH,
    MAX_TEXT,
    MAX_TOTAL,
    REQUESTS,
    TERMINAL,
    WIRE_VERSION,
    Begin,
    Bye,
    Chunk,
    Credit,
    Done,
    Failed,
    Hello,
    Hosts,
    Listed,
    Located,
    Mounted,
    NodeSpec,
    Provision,
    Ready,
    Recipe,
    Refusal,
    Relay,
    Runtime,
    Saw,
    Send,
    Where,
    Work,
    compatible,
    decode,
    encode,
    peek_kinds,
    variant_of,
)

codec_module = importlib.import_module("somatize.codec")

DIGEST = "sha256:" + "0123456789abcdef" * 4
OTHER = "sha256:" + "f" * 64
MIB = 1 << 20

# -- helpers -----------------------------------------------------------------------------


def same(a, b) -> bool:
    """Equal, and of the same types all the way down (arrays compared by value)."""
    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and all(same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    if isinstance(a, (bytes, memoryview)) and isinstance(b, (bytes, memoryview)):
        return bytes(a) == bytes(b)
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=False))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if type(a) is float:  # by their bits: a NaN is the same NaN, -0.0 is not 0.0
        return struct.pack("<d", a) == struct.pack("<d", b)
    return a == b


def runtime(**changes) -> Runtime:
    base = Runtime(
        wire=WIRE_VERSION,
        python="3.11",
        somatize="0.1.0",
        cloudpickle="3.1.1",
        kinds=("numpy.ndarray", "plain"),
        mode="",
    )
    return dataclasses.replace(base, **changes)


def recipe() -> Recipe:
    return Recipe(
        (
            NodeSpec("tokenize", False, "project", "myproject.nodes:Tokenize", (3, "x"), {"lower": True}),
            NodeSpec("embed", True, "network", DIGEST),
            NodeSpec("pool", True, "project", "myproject.nodes:Pool.Inner", (np.arange(4),)),
        ),
        ("seq", (("step", 0), ("par", (("step", 1), ("step", 2))))),
    )


def work(**changes) -> Work:
    base = Work(
        ref=7,
        recipe=recipe(),
        input={"text": "a b c", "weights": np.linspace(0, 1, 5)},
        keys={1: DIGEST, 2: OTHER},
        placement={1: "cuda:0"},
        memory="/shared/store",
    )
    return dataclasses.replace(base, **changes)


def messages() -> list:
    return [
        Hello(runtime()),
        Hello(runtime(mode="network"), offering="w1"),
        Provision(DIGEST, b"\x80\x05 an artifact"),
        work(),
        work(keys={}, placement={}, memory=None, input=None),
        Where("w1"),
        Where("w1", lost=True),
        Hosts(),
        Bye(),
        Ready(runtime(mode="project")),
        Send(7, (DIGEST, OTHER)),
        Refusal("this worker cannot read values of kind `x`"),
        Refusal("no", ref=7),
        Done(7, [1, 2.5, "three", b"four"], {1: np.ones((2, 3), np.float32), 2: "kept"}, 4120),
        Done(0, None, {}, 0),
        Done(7, 3, {}, 12, ({"fact": "ran", "node": "a", "took_us": "3"}, {"fact": "said", "kind": "busy"})),
        Done(7, np.ones(3), {0: "kept"}, 12, ({"fact": "ran", "node": "a", "took_us": "3"},)),
        Failed(7, "embed raised ValueError: bad", "embed", "ValueError", "Traceback (most recent call last):\n..."),
        Failed(7, "the worker ran out of memory", None, "MemoryError", ""),
        Saw(7, {"fact": "ran", "node": "embed", "took_us": "4120"}),
        Located("w1", "direct", address="tcp://10.0.0.4:7000", mode="project"),
        Located("w1", "mount", address="tcp://10.0.0.4:7000", mode="network", mount="/dev/shm/somatize"),
        Located("w1", "relayed", address="tcp://head:5555", mode="project", ended="killed by SIGKILL"),
        Located("w1", "inprocess"),
        Listed({"w1": "network", "here": "inprocess"}),
        Listed(
            {"w1": "project", "w2": "network", "here": "inprocess"},
            {"w1": [], "w2": ["/scratch/job7", "4242-" + "0123456789abcdef" * 2]},
        ),
        Ready(runtime(), busy_us=2_500_000),
    ]


MOUNT_FILE = "0123456789abcdef" * 2 + "-3"


def carriers() -> list:
    return [
        Relay(host="w1", inner=tuple(encode(work()))),
        Relay(exchange=12, tenant="k:Abc123", inner=(bytes(encode(Bye())[0]),)),
        Relay(inner=(b"anything at all", b"")),
        Begin(1, (120, 4 << 20, 0)),
        Begin(2**63 - 1, (10,)),
        Chunk(5, b"\x00" * 1000),
        Chunk(5, b""),
        Credit(5, 4 << 20),
        Mounted((MOUNT_FILE, "4242-" + MOUNT_FILE), b"\x84\xa1v\x01 an inner header"),
        Mounted((), b""),
    ]


def as_bytes(frames) -> list[bytes]:
    return [bytes(f) for f in frames]


def header_of(frames) -> dict:
    return msgpack.unpackb(bytes(frames[0]), raw=False)


def with_header(frames, **changes) -> list:
    header = header_of(frames)
    header.update(changes)
    return [msgpack.packb(header, use_bin_type=True), *frames[1:]]


def refused(frames, *words: str) -> str:
    with pytest.raises(ProtocolError) as info:
        decode(frames)
    why = info.value.why
    assert why == str(info.value)
    for word in words:
        assert word in why, why
    return why


# -- round trips ---------------------------------------------------------------------------


@pytest.mark.parametrize("msg", messages() + carriers(), ids=lambda m: type(m).__name__)
@pytest.mark.pure
def test_every_message_round_trips(msg):
    frames = encode(msg)
    assert isinstance(frames, list) and frames
    assert all(isinstance(f, (bytes, memoryview)) for f in frames)
    back = decode(frames)
    assert same(msg, back), (msg, back)
    assert same(msg, decode(as_bytes(frames)))


@pytest.mark.pure
def test_every_variant_is_a_request_or_an_answer():
    names = {type(m).__name__ for m in messages()}
    assert names == {cls.__name__ for cls in REQUESTS + ANSWERS}
    assert set(TERMINAL) <= set(ANSWERS)
    assert all(isinstance(m, wire.Request | wire.Answer) for m in messages())
    assert {type(m) for m in carriers()} == set(CARRIERS)
    assert all(isinstance(m, wire.Carrier) for m in carriers())
    assert not set(CARRIERS) & set(REQUESTS + ANSWERS)


@pytest.mark.pure
def test_a_header_is_a_map_with_the_version_the_variant_and_every_field():
    header = header_of(encode(Where("w1")))
    assert header == {"v": WIRE_VERSION, "t": "Where", "host": "w1", "lost": False, "waited_us": 0}
    header = header_of(encode(work()))
    assert set(header) == {
        "v",
        "t",
        "ref",
        "recipe",
        "input",
        "keys",
        "placement",
        "memory",
        "watched",
        "recipe_digest",
    }
    assert header["keys"] == [[1, DIGEST], [2, OTHER]]
    assert header["recipe"]["shape"] == ["seq", [["step", 0], ["par", [["step", 1], ["step", 2]]]]]


@pytest.mark.pure
def test_arrays_travel_as_frames_and_never_inside_the_header():
    big = np.random.default_rng(0).integers(0, 255, MIB, dtype=np.uint8)
    frames = encode(work(input={"image": big}))
    assert len(frames[0]) < 2048
    assert big.tobytes()[1000:1064] not in bytes(frames[0])
    assert [memoryview(f).nbytes for f in frames[1:]] == [MIB, 4 * 8]  # the input, then pool's arg
    back = decode(frames)
    assert np.array_equal(back.input["image"], big)
    assert back.input["image"].flags.writeable

    done = Done(7, big, {1: big[::-1].copy(), 2: big[:10]}, 5)
    frames = encode(done)
    assert len(frames[0]) < 1024
    assert [memoryview(f).nbytes for f in frames[1:]] == [MIB, MIB, 10]
    back = decode(frames)
    assert same(done, back)


@pytest.mark.pure
def test_an_artifact_is_frame_one_as_it_is():
    artifact = bytes(range(256)) * 4096
    frames = encode(Provision(DIGEST, artifact))
    assert len(frames) == 2 and frames[1] is artifact
    assert len(frames[0]) < 200
    back = decode(frames)
    assert back.artifact is artifact  # not copied, not checked against the digest here
    assert "artifact" not in repr(back)


@pytest.mark.pure
def test_frames_may_be_memoryviews_bytearrays_or_frame_objects():
    class Frame:  # what pyzmq hands over with copy=False
        def __init__(self, data):
            self.buffer = memoryview(data)

    msg = work()
    frames = encode(msg)
    assert same(msg, decode([Frame(bytes(f)) for f in frames]))
    assert same(msg, decode([bytearray(f) for f in frames]))
    assert same(msg, decode(tuple(memoryview(bytes(f)) for f in frames)))
    with pytest.raises(TypeError):
        decode(b"".join(as_bytes(frames)))
    with pytest.raises(TypeError):
        decode([frames[0], 3])


@pytest.mark.pure
def test_a_shape_from_a_graph_round_trips():
    class A(Node):
        def forward(self, x):
            return x

    g = A().named("a") >> (A().named("b") & A().named("c")) >> A().named("d")
    nodes = tuple(NodeSpec(s.label, False, "project", "m:A") for s in g.steps)
    back = decode(encode(work(recipe=Recipe(nodes, g.shape), keys={}, placement={})))
    assert back.recipe.shape == g.shape


@pytest.mark.pure
def test_runtime_here_states_this_process():
    here = Runtime.here()
    assert here.wire == WIRE_VERSION
    assert here.python.count(".") == 1
    assert here.somatize and here.cloudpickle
    assert here.kinds == tuple(readable_kinds())
    assert Runtime.here(mode="network").mode == "network"
    with pytest.raises(ValueError):
        Runtime.here(mode="sideways")
    assert same(Hello(here), decode(encode(Hello(here))))


# -- carriers: a message around another one, or a piece of one --------------------------


@pytest.mark.pure
def test_a_relay_carries_its_inner_frames_untouched_and_unread():
    inner = as_bytes(encode(work(input=np.zeros(1000))))
    frames = encode(Relay(host="w1", inner=tuple(inner)))
    assert len(frames) == 1 + len(inner)
    assert all(a is b for a, b in zip(frames[1:], inner, strict=False))
    assert header_of(frames) == {"v": WIRE_VERSION, "t": "Relay", "host": "w1", "exchange": 0, "tenant": "", "lane": 0}
    back = decode(frames)
    assert type(back.inner) is tuple and all(a is b for a, b in zip(back.inner, inner, strict=False))
    assert same(decode(list(back.inner)), work(input=np.zeros(1000)))
    # never decoded: junk inside is the business of whoever opens the envelope
    junk = decode(encode(Relay(exchange=3, inner=(b"\xc1 not a header", b"x"))))
    assert junk.inner == (b"\xc1 not a header", b"x")
    assert "inner" not in repr(junk)  # a relayed payload never lands in a log line
    # a relaying side passes on the frames a socket gave it, zmq.Frame objects included
    zmq = pytest.importorskip("zmq")
    received = [zmq.Frame(bytes(f)) for f in inner]
    passed_on = encode(Relay(exchange=1, tenant="t", inner=tuple(received)))
    assert [bytes(f) for f in passed_on[1:]] == inner
    assert same(decode(list(decode(passed_on + []).inner)), work(input=np.zeros(1000)))
    refused(encode(Relay(inner=(b"x",)))[:1], "carries none")
    with pytest.raises(ValueError, match="Relay.inner"):
        encode(Relay(host="w1"))
    with pytest.raises(TypeError, match=r"Relay.inner\[1\]"):
        encode(Relay(inner=(b"x", "text")))


@pytest.mark.pure
def test_a_relay_header_is_checked():
    frames = as_bytes(encode(Relay(host="w1", inner=(b"x",))))
    refused(with_header(frames, host="h" * (MAX_NAME + 1)), "`Relay.host`", "over the limit")
    refused(with_header(frames, exchange=-1), "`Relay.exchange`")
    refused(with_header(frames, exchange=2**63), "`Relay.exchange`")
    refused(with_header(frames, tenant=7), "`Relay.tenant`")
    refused(with_header(frames, inner=[]), "no field 'inner'")


def _raw_map(pairs) -> bytes:
    """A MessagePack map written pair by pair: what ``packb`` of a dict cannot write (a key
    twice, a key that is not text)."""
    assert len(pairs) < 16
    return bytes([0x80 + len(pairs)]) + b"".join(msgpack.packb(k) + msgpack.packb(v) for k, v in pairs)


@pytest.mark.pure
def test_a_fact_with_a_key_twice_is_refused_the_short_way_as_the_long_way():
    """A `Done` of one scalar is read the short way; a fact in its `saw` holding a key twice
    (which `unpackb` would merge quietly, the last value winning) is refused there as the
    long way refuses it, word for word, never taken as the fact its last value makes."""
    twice = _raw_map([("fact", "ran"), ("fact", "finished")])
    pairs = [("v", WIRE_VERSION), ("t", "Done"), ("ref", 1), ("output", 2), ("produced", []), ("took_us", 3)]
    head = bytes([0x80 + len(pairs) + 1]) + b"".join(msgpack.packb(k) + msgpack.packb(v) for k, v in pairs)
    frames = [head + msgpack.packb("saw") + b"\x91" + twice]
    with pytest.raises(ProtocolError) as long_way:
        _long_way(frames)
    assert "twice" in long_way.value.why
    assert refused(frames, "twice") == long_way.value.why
    fine = [head + msgpack.packb("saw") + b"\x91" + _raw_map([("fact", "ran"), ("node", "a")])]
    assert decode(fine).saw == ({"fact": "ran", "node": "a"},) and same(decode(fine), _long_way(fine))


@pytest.mark.pure
def test_a_relay_is_read_in_one_step_and_refused_as_the_long_way_refuses_it():
    """The envelope every relayed hop passes on has a short way in: ``variant_of`` tells it by
    its first bytes, ``decode`` builds it in one step (and ``encode`` writes it so): the same
    message as the long way, and whatever begins as a Relay but is not one is refused with
    the long way's own sentence."""
    from somatize.wire.reading import _read
    from somatize.wire.short import told as _told

    frames = as_bytes(encode(Relay(host="w1", lane=4, inner=(b"x", b"y"))))
    assert _told(frames) is Relay and decode(frames) == _read(frames, values=True)[0]
    assert _told(as_bytes(encode(Bye()))) is Bye  # every variant is told so; only some are read so
    for other in ([b""], [], [b"\x86"], "Relay", [42]):
        assert _told(other) is None
    with pytest.raises(TypeError, match="Relay.host"):
        encode(Relay(host=7, inner=(b"x",)))
    head = [("v", WIRE_VERSION), ("t", "Relay"), ("host", "w1"), ("exchange", 0), ("tenant", ""), ("lane", 0)]
    odd = {
        "a key twice": [*head, ("host", "w2")],
        "a key that is bytes": [*head[:5], (b"lane", 0)],
        "a field it has not": [*head, ("inner", [])],
        "a field missing": head[:5],
        "a host that is a number": [*head[:2], ("host", 7), *head[3:]],
        "a lane out of range": [*head[:5], ("lane", -1)],
    }
    for what, pairs in odd.items():
        bad = [_raw_map(pairs), b"x"]
        assert (_told(bad) is Relay) == (len(pairs) >= 6), what  # fewer keys: never taken for one
        with pytest.raises(ProtocolError) as long_way:
            _read(bad, values=True)
        assert refused(bad) == long_way.value.why, what
    assert "carries none" in refused(frames[:1])
    assert "over the limit" in refused([_raw_map([*head[:2], ("host", "h" * (MAX_NAME + 1)), *head[3:]]), b"x"])


def _long_way(frames):
    """``decode`` without its short way in: every message read as any other."""
    from somatize.codec import build
    from somatize.wire import reading

    msg, checked = reading._read(frames, values=True)
    return msg if checked is None else reading._fill(msg, build(checked))


_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False),
    st.text(max_size=50),
    st.binary(max_size=300),
)
_DIGEST = "sha256:" + "ab" * 32


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    value=_SCALARS,
    ref=st.integers(0, 2**63 - 1),
    took=st.integers(0, 2**40),
    keyed=st.booleans(),
    placed=st.booleans(),
    watched=st.booleans(),
    saw=st.lists(st.dictionaries(st.text(min_size=1, max_size=8), st.text(max_size=20), max_size=3), max_size=3),
    change=st.sampled_from(
        [
            None,
            "drop",
            "add",
            "twice",
            "ref",
            "keys",
            "value",
            "saw",
            "version",
            "flag",
            "digest",
            "memory",
            "float",
            "bin",
        ]
    ),
)
def test_a_call_of_one_scalar_reads_the_same_the_short_way_and_the_long_way(
    value, ref, took, keyed, placed, watched, saw, change
):
    """A ``Work`` naming its recipe by digest and a ``Done``, each of one scalar value, are
    written as the codec would write them and read in one step: the same message as the long way gives, and for a header changed in
    any way (a field dropped, added, given twice, of the wrong type), what the long way makes
    of it: its own refusal, word for word, or the same message. Written the short way, the
    bytes are the long way's."""
    from somatize.wire import short
    from somatize.wire.writing import _written

    work = Work(ref, None, value, {0: _DIGEST} if keyed else {}, {0: "cpu"} if placed else {}, None, watched, _DIGEST)
    from somatize.codec import encode as written

    descriptor, its_frames = written(value)  # what the codec writes for it
    for msg in (work, Done(ref, value, {}, took, tuple(saw))):
        frames = as_bytes(encode(msg))  # a scalar the codec writes as itself is written so here
        assert frames == as_bytes(_written(msg, type(msg)))
        assert header_of(frames)["input" if msg is work else "output"] == descriptor
        assert len(frames) == 1 + len(its_frames)
        if change is None:
            assert same(decode(frames), msg) and same(decode(frames), _long_way(frames))
            plain = not (keyed or placed) if msg is work else not saw  # the call's own: msgspec reads it
            assert (short.express(frames[0]) is not None) == (plain and not its_frames and type(descriptor) is not list)
            continue
        pairs = list(header_of(frames).items())
        if change == "drop":
            pairs = pairs[:-1]
        elif change == "add":
            pairs.append(("extra", 1))
        elif change == "twice":
            pairs.append((pairs[2][0], pairs[2][1]))
        elif change == "ref":
            pairs[2] = ("ref", -1 - ref)
        elif change == "keys":
            pairs = [(k, [[0, 1]] if k in ("keys", "produced") else v) for k, v in pairs]
        elif change == "saw":
            pairs = [(k, [*v, "ran"] if k == "saw" else v) for k, v in pairs]
        elif change == "version":
            pairs[0] = ("v", WIRE_VERSION - 1)
        elif change == "flag":  # a bool where a number goes, a number where a bool goes
            pairs = [(k, 1 if k == "watched" else True if k == "took_us" else v) for k, v in pairs]
        elif change == "digest":  # a line end after it: `$` would take it, `fullmatch` does not
            pairs = [
                (k, v + "\n" if k == "recipe_digest" else [{"fact": "ran\n"}] if k == "saw" else v) for k, v in pairs
            ]
        elif change == "memory":
            pairs = [(k, "/dev/shm/x" if k == "memory" else [[0, "/x"]] if k == "produced" else v) for k, v in pairs]
        elif change == "float":
            pairs[2] = ("ref", float(ref))
        elif change == "bin":  # the variant's name as bytes, not text
            pairs[1] = ("t", pairs[1][1].encode())
        else:
            pairs = [(k, {"a": 1} if k in ("input", "output") else v) for k, v in pairs]
        changed = [_raw_map(pairs)]
        try:
            taken = _long_way(changed)
        except ProtocolError as exc:
            assert refused(changed) == exc.why
        else:  # a change that still makes a message (a Done that produced something)
            assert same(decode(changed), taken)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    which=st.sampled_from(["work", "done"]),
    value=_SCALARS,
    at=st.integers(0, 10_000),
    junk=st.binary(min_size=1, max_size=8),
    how=st.sampled_from(["put", "insert", "cut"]),
)
def test_a_header_changed_byte_by_byte_is_read_the_short_way_only_as_the_long_way_reads_it(which, value, at, junk, how):
    """A call's header with bytes overwritten, put in or cut off anywhere: the short way
    (msgspec's decoder) gives None, or the very message the long way gives, and ``decode``
    gives what the long way gives (its refusal word for word); never another exception."""
    from somatize.wire import short

    msg = Work(7, None, value, {}, {}, None, False, _DIGEST) if which == "work" else Done(7, value, {}, 5, ())
    head = bytearray(as_bytes(encode(msg))[0])
    at %= len(head)
    if how == "put":
        head[at : at + len(junk)] = junk
    elif how == "insert":
        head[at:at] = junk
    else:
        del head[at : at + len(junk)]
    changed = [bytes(head)]
    fast = short.express(changed[0])
    try:
        taken = _long_way(changed)
    except ProtocolError as exc:
        assert fast is None
        assert refused(changed) == exc.why
        return
    assert fast is None or same(fast, taken)
    assert same(decode(changed), taken)


@pytest.mark.pure
def test_a_value_nested_deeper_than_python_recurses_is_refused_not_raised():
    """A call's one value, nested thousands of arrays deep in a header that otherwise reads
    the short way: refused as the long way refuses it, never a ``RecursionError``."""
    from somatize.wire import short

    for depth in (100, 1_000, 60_000):
        before = [("v", WIRE_VERSION), ("t", "Work"), ("ref", 1)]
        after = [
            ("recipe", None),
            ("keys", []),
            ("placement", []),
            ("memory", None),
            ("watched", False),
            ("recipe_digest", _DIGEST),
        ]
        head = (
            bytes([0x80 + 10])
            + b"".join(msgpack.packb(k) + msgpack.packb(v) for k, v in before)
            + msgpack.packb("input")
            + b"\x91" * depth
            + b"\xc0"
            + b"".join(msgpack.packb(k) + msgpack.packb(v) for k, v in after)
        )
        assert short.express(head) is None
        refused([head], "could not be read" if depth <= 1_000 else "MessagePack header map")


@pytest.mark.pure
def test_a_stream_begins_with_sizes_inside_the_limits():
    frames = as_bytes(encode(Begin(9, (100, 200))))
    refused(with_header(frames, sid=0), "`Begin.sid`", "from 1")
    refused(with_header(frames, sid=2**63), "`Begin.sid`")
    refused(with_header(frames, sid=True), "`Begin.sid`", "whole number")
    refused(with_header(frames, sizes=[]), "`Begin.sizes`", "1 to")
    refused(with_header(frames, sizes=[1] * (MAX_FRAMES + 1)), "`Begin.sizes`", f"{MAX_FRAMES:,}")
    refused(with_header(frames, sizes=[10, -1]), "`Begin.sizes[1]`")
    refused(with_header(frames, sizes=[10, MAX_FRAME + 1]), "`Begin.sizes[1]`")
    refused(with_header(frames, sizes=[MAX_HEADER + 1, 10]), "`Begin.sizes[0]`")
    refused(with_header(frames, sizes=[10] + [MAX_FRAME] * 3), "add up", f"{MAX_TOTAL:,}")
    refused(with_header(frames, sizes=10), "`Begin.sizes`", "tuple")
    refused(frames + [b"x"], "one frame")
    with pytest.raises(ValueError, match="Begin.sid"):
        encode(Begin(0, (1,)))


@pytest.mark.pure
def test_a_chunk_is_its_header_and_one_frame_of_data():
    data = bytes(range(256)) * 100
    frames = encode(Chunk(7, data))
    assert len(frames) == 2 and frames[1] is data
    assert decode(frames).data is data
    assert "data" not in repr(decode(frames))
    refused(frames[:1], "two frames")
    refused(frames + [b"more"], "two frames")
    refused(with_header(as_bytes(frames), sid=-7), "`Chunk.sid`")
    view = decode([frames[0], memoryview(bytearray(data))]).data
    assert isinstance(view, memoryview) and bytes(view) == data


@pytest.mark.pure
def test_credit_is_a_stream_and_a_size():
    frames = as_bytes(encode(Credit(7, 1 << 20)))
    refused(with_header(frames, amount=-1), "`Credit.amount`")
    refused(with_header(frames, amount=MAX_TOTAL + 1), "`Credit.amount`")
    refused(with_header(frames, amount=1.5), "`Credit.amount`", "whole number")
    refused(with_header(frames, sid=0), "`Credit.sid`")


@pytest.mark.pure
def test_mounted_names_only_files_the_mount_makes():
    frames = as_bytes(encode(Mounted((MOUNT_FILE,), b"inner header")))
    assert decode(frames).header == b"inner header"
    for bad in [
        "../../etc/passwd",
        "/etc/passwd",
        MOUNT_FILE + "/x",
        "." + MOUNT_FILE,
        MOUNT_FILE.upper(),
        "x" * 65,
        "",
    ]:
        refused(with_header(frames, files=[bad]), "Mounted.files[0]")
    refused(with_header(frames, files=[MOUNT_FILE] * MAX_FRAMES), "`Mounted.files`", "over the limit")
    refused(with_header(frames, files=MOUNT_FILE), "`Mounted.files`", "tuple")
    refused(frames[:1], "two frames")
    refused(frames + [b""], "two frames")
    with pytest.raises(ValueError, match="Mounted.files"):
        encode(Mounted(("passwd",), b""))


@pytest.mark.pure
def test_mounted_carries_a_header_no_bigger_than_a_header(monkeypatch):
    frames = as_bytes(encode(Mounted((MOUNT_FILE,), b"h" * 101)))
    monkeypatch.setattr(wire.limits, "MAX_HEADER", 100)
    refused(frames, "frame 1", "101 bytes")


@pytest.mark.pure
def test_ready_says_how_long_the_oldest_work_has_run():
    assert Ready(runtime()).busy_us == 0
    frames = as_bytes(encode(Ready(runtime(), busy_us=7)))
    assert header_of(frames)["busy_us"] == 7
    refused(with_header(frames, busy_us=-1), "`Ready.busy_us`")
    refused(with_header(frames, busy_us="7"), "`Ready.busy_us`", "whole number")
    refused(with_header(frames, busy_us=None), "`Ready.busy_us`")
    with pytest.raises(TypeError, match="Ready.busy_us"):
        encode(Ready(runtime(), busy_us=False))


# -- variant_of: which message, from its header's `v` and `t` alone --------------------------


@pytest.mark.parametrize("msg", messages() + carriers(), ids=lambda m: type(m).__name__)
@pytest.mark.pure
def test_variant_of_names_every_message(msg):
    assert variant_of(encode(msg)) is type(msg)
    assert variant_of(encode(msg)[:1]) is type(msg)  # frame 0 alone


@pytest.mark.pure
def test_variant_of_reads_no_value_and_no_other_field():
    frames = as_bytes(encode(work()))
    lying = with_header(frames, input=["A", "<f8", [10**9], 0], ref=-1, recipe="not one")
    assert variant_of(lying) is Work
    with pytest.raises(ProtocolError):
        decode(lying)
    # a header whose other fields would take gigabytes to build costs nothing here
    huge = msgpack.packb({"v": WIRE_VERSION, "t": "Work", "input": [[]] * 1_000_000})
    assert variant_of([huge]) is Work


@pytest.mark.pure
def test_variant_of_refuses_what_is_not_a_header():
    def no(frames, *words):
        with pytest.raises(ProtocolError) as info:
            variant_of(frames)
        for word in words:
            assert word in info.value.why, info.value.why

    no([], "at least one frame")
    no([b""], "MessagePack header map")
    no([b"\xc1"], "MessagePack header map")
    no([msgpack.packb([1, "Work"])], "MessagePack header map")
    no([msgpack.packb({"t": "Work"})], "wire version")
    no([msgpack.packb({"v": WIRE_VERSION + 1, "t": "Work"})], "upgrade somatize")
    no([msgpack.packb({"v": "1", "t": "Work"})], "wire version")
    no([msgpack.packb({"v": WIRE_VERSION, "t": "Steal"})], "'Steal'")
    no([msgpack.packb({"v": WIRE_VERSION, "t": ["Work"]})], "`t`")
    no([msgpack.packb({"v": WIRE_VERSION})], "`t`")
    no([msgpack.packb({1: 1, "v": WIRE_VERSION, "t": "Work"})], "keyed by text")
    no([b"\x83\xa1v\x01\xa1v\x01\xa1t\xa3Bye"], "twice")
    no([msgpack.packb({"v": WIRE_VERSION, "t": "Work"})[:-2]], "MessagePack header map")
    no([b"\x00" * (MAX_HEADER + 1)], "the header (frame 0)")
    many = {f"k{i}": 0 for i in range(100)}
    no([msgpack.packb({**many, "v": WIRE_VERSION, "t": "Work"})], "first 16 keys")
    with pytest.raises(TypeError):
        variant_of(b"frames")


# -- frames missing, extra, out of order -------------------------------------------------


@pytest.mark.pure
def test_frames_fed_piecemeal_are_refused_until_the_message_is_whole():
    msg = work(input=np.zeros(1000), recipe=recipe())
    frames = as_bytes(encode(msg))
    assert len(frames) == 3
    refused([], "at least one frame")
    for k in range(1, len(frames)):
        refused(frames[:k], "missing")
    for f in frames[1:]:
        refused([f])
    assert same(msg, decode(frames))


@pytest.mark.pure
def test_an_extra_frame_is_refused():
    frames = as_bytes(encode(work()))
    refused(frames + [b"stray"], "belongs to no value")
    refused(encode(Bye()) + [b""], "one frame")
    refused(as_bytes(encode(Provision(DIGEST, b"a"))) + [b"b"], "two frames")
    refused(encode(Provision(DIGEST, b"a"))[:1], "two frames")


@pytest.mark.pure
def test_frames_out_of_order_are_refused():
    frames = as_bytes(encode(work(input=np.zeros(1000))))
    refused([frames[0], frames[2], frames[1]], "needs")
    refused(frames[1:] + frames[:1])


@pytest.mark.pure
def test_a_frame_no_value_uses_is_refused_even_when_the_count_is_right():
    frames = as_bytes(encode(Done(1, np.zeros(3), {}, 0)))
    header = header_of(frames)
    header["output"] = 5  # a plain scalar: the array frame is now unused
    refused([msgpack.packb(header), frames[1]], "belongs to no value")


# -- the header ------------------------------------------------------------------------------


@pytest.mark.pure
def test_a_header_that_is_not_messagepack_is_refused():
    why = refused([b"\xc1\xc1\xc1"], "MessagePack header map", "3 bytes")
    assert why.startswith("a message must start")
    refused([b""], "0 bytes")
    refused([msgpack.packb([1, 2])], "array")
    refused([msgpack.packb({"v": 1, "t": "Bye"}) + b"\x00"], "MessagePack")


@pytest.mark.pure
def test_a_different_wire_version_says_who_upgrades():
    frames = encode(Bye())
    newer = WIRE_VERSION + 1
    why = refused(
        with_header(frames, v=newer), f"speaks wire version {WIRE_VERSION}", f"version {newer}", "upgrade somatize"
    )
    assert "(this side)" in why
    why = refused(with_header(frames, v=0), "version 0")
    assert "(the side that sent it)" in why
    refused([msgpack.packb({"t": "Bye"})], "wire version `v`")
    refused(with_header(frames, v="1"), "wire version `v`")


@pytest.mark.pure
def test_an_unknown_variant_is_refused():
    refused(with_header(encode(Bye()), t="Launch"), "'Launch'", "Bye")
    refused(with_header(encode(Bye()), t=3), "`t`")
    refused([msgpack.packb({"v": WIRE_VERSION})], "`t`")


@pytest.mark.pure
def test_missing_extra_and_mistyped_fields_are_refused():
    frames = encode(Where("w1"))
    header = header_of(frames)
    del header["lost"]
    refused([msgpack.packb(header)], "needs the field `lost`")
    refused(with_header(frames, colour="red"), "no field 'colour'")
    refused(with_header(frames, lost="yes"), "`Where.lost`", "True or False")
    refused(with_header(frames, host=None), "`Where.host`", "str")
    refused(with_header(frames, host=""), "empty")
    refused(with_header(encode(Refusal("x", 1)), ref=-1), "`Refusal.ref`")
    refused(with_header(encode(Refusal("x", 1)), ref=2**64 - 1), "`Refusal.ref`")
    refused(with_header(encode(Refusal("x", 1)), ref=1.0), "whole number")
    refused(with_header(encode(Refusal("x", 1)), ref=True), "whole number")


@pytest.mark.pure
def test_extension_types_are_refused():
    frames = encode(Where("w1"))
    packed = msgpack.packb(
        {"v": WIRE_VERSION, "t": "Where", "host": msgpack.ExtType(5, b"x"), "lost": False, "waited_us": 0}
    )
    refused([packed], "extension")
    stamp = msgpack.packb(
        {"v": WIRE_VERSION, "t": "Where", "host": msgpack.Timestamp(1, 0), "lost": False, "waited_us": 0}
    )
    refused([stamp], "`Where.host`")
    refused(with_header(encode(Saw(1, {"a": "b"})), fact={"a": msgpack.ExtType(1, b"")}), "extension")
    assert decode(frames) == Where("w1")


@pytest.mark.pure
def test_map_keys_that_are_not_text_are_refused():
    refused([msgpack.packb({b"v": 1, "t": "Bye"}, use_bin_type=True)], "keyed by text")
    refused([msgpack.packb({1: 1, "v": 1, "t": "Bye"})], "MessagePack")
    header = header_of(encode(Hello(runtime())))
    header["runtime"][b"extra"] = 1
    refused([msgpack.packb(header, use_bin_type=True)], "keyed by text")
    # {"v": 1, "v": 1, "t": "Bye"}, which no encoder of a dict can write
    twice = b"\x83\xa1v\x01\xa1v\x01\xa1t\xa3Bye"
    refused([twice], "twice")


@pytest.mark.pure
def test_fields_over_their_limits_are_refused():
    refused(with_header(encode(Where("w1")), host="h" * (MAX_NAME + 1)), "`Where.host`", "over the limit")
    refused(with_header(encode(Refusal("x")), why="w" * (MAX_TEXT + 1)), "`Refusal.why`")
    facts = {f"k{i}": "v" for i in range(MAX_FACT + 1)}
    refused(with_header(encode(Saw(1, {"a": "b"})), fact=facts), "`Saw.fact`", "entries")
    refused(with_header(encode(Saw(1, {"a": "b"})), fact={"a": "v" * (MAX_FACT_TEXT + 1)}), "Saw.fact['a']")
    refused(with_header(encode(Saw(1, {"a": "b"})), fact={"a": 1}), "Saw.fact['a']", "str")
    done = encode(Done(1, 2, {}, 3))
    refused(with_header(done, saw=[{"a": "b"}] * (MAX_SAW + 1)), "`Done.saw`", f"limit of {MAX_SAW}")
    refused(with_header(done, saw=[facts]), "a fact of `Done.saw`", "entries")
    refused(with_header(done, saw=[{"a": "b"}, "ran"]), "a fact of `Done.saw`", "map")
    refused(with_header(done, saw={"a": "b"}), "`Done.saw`", "list")
    refused(with_header(done, saw=[{"a": 1}]), "a fact of `Done.saw`['a']", "str")
    refused(with_header(done, saw=[{"a": "v" * (MAX_FACT_TEXT + 1)}]), "a fact of `Done.saw`['a']")
    refused(with_header(encode(Send(1, (DIGEST,))), digests=[]), "1 to")
    refused(with_header(encode(Send(1, (DIGEST,))), digests=[DIGEST.upper()]), "lowercase hex")
    refused(with_header(encode(Located("w1", "direct")), path="teleport"), "`Located.path`")
    refused(with_header(encode(Located("w1", "direct")), mode="fast"), "`Located.mode`")
    refused(
        with_header(encode(Located("w1", "inprocess")), mount="/x"),
        'only for the "mount", "relayed" and "direct" paths',
    )
    refused(with_header(encode(Located("w1", "direct", address="tcp://h:1")), mount="/x"), "`Located.seen`", "token")
    refused(with_header(encode(Listed({"a": "project"})), hosts={"a": "elsewhere"}), "Listed.hosts['a']")


@pytest.mark.pure
def test_a_listing_says_of_dialed_hosts_only_what_where_would():
    """``Listed.dialed`` lets a client skip ``Where`` for a dialed host: what it says is held
    to what a relayed ``Located`` may say, and names only hosts the listing has as a worker's."""
    listed = encode(Listed({"a": "project", "here": "inprocess"}, {"a": []}))
    refused(with_header(listed, dialed={"b": []}), "`Listed.dialed` names 'b'", "does not list")
    refused(with_header(listed, dialed={"here": []}), "`Listed.dialed` names 'here'")
    refused(with_header(listed, dialed={"a": ["/x"]}), "`Listed.dialed['a']`", "[mount, seen]")
    refused(with_header(listed, dialed={"a": "/x"}), "`Listed.dialed['a']`", "[mount, seen]")
    refused(with_header(listed, dialed={"a": ["/x", "nope"]}), "`Listed.dialed['a'].seen`", "token")
    refused(with_header(listed, dialed={"a": ["/x\n", "1-" + "0" * 32]}), "`Listed.dialed['a'].mount`")
    refused(with_header(listed, dialed={"a": ["/" + "x" * MAX_PATH, "1-" + "0" * 32]}), "`Listed.dialed['a'].mount`")
    refused(with_header(listed, dialed=["a"]), "`Listed.dialed`", "map")
    refused(with_header(listed, dialed={1: []}), "map key")
    without = header_of(listed)
    del without["dialed"]
    refused([msgpack.packb(without)], "`Listed` needs the field `dialed`")
    refused(with_header(encode(Hello(runtime())), offering=""), "`Hello.offering`")
    # a field said only with a folder: an empty list or map is no token either
    refused(with_header(encode(Hello(runtime())), seen=[]), "`Hello.seen` has to be a str")
    refused(with_header(encode(Located("w1", "relayed")), seen={}), "`Located.seen` has to be a str")


@pytest.mark.pure
def test_a_runtime_is_checked_field_by_field():
    frames = encode(Hello(runtime()))
    header = header_of(frames)
    for name, bad, words in [
        ("python", "three", "major.minor"),
        ("kinds", "plain", "tuple"),
        ("kinds", [1], "kinds[0]"),
        ("mode", "turbo", "mode"),
        ("wire", -1, "wire"),
        ("somatize", None, "somatize"),
    ]:
        changed = {**header, "runtime": {**header["runtime"], name: bad}}
        refused([msgpack.packb(changed)], f"Hello.runtime.{name}" if name != "kinds" else "kinds", words)
    del header["runtime"]["mode"]
    refused([msgpack.packb(header)], "Hello.runtime", "`mode`")


@pytest.mark.pure
def test_too_many_frames_or_too_big_a_header_are_refused_before_reading(monkeypatch):
    refused([encode(Bye())[0]] + [b""] * MAX_FRAMES, f"at most {MAX_FRAMES:,} frames")
    monkeypatch.setattr(wire.limits, "MAX_HEADER", 100)
    refused([b"\x00" * 101], "the header (frame 0)", "101 bytes")
    eleven = as_bytes(encode(Provision(DIGEST, b"x" * 11)))
    monkeypatch.setattr(wire.limits, "MAX_FRAME", 10)
    refused(eleven, "frame 1 is 11 bytes")
    with pytest.raises(ValueError, match="11 bytes"):
        encode(Provision(DIGEST, b"x" * 11))
    monkeypatch.setattr(wire.limits, "MAX_TOTAL", 50)
    refused([b"\x00" * 40, b"\x00" * 10, b"\x00"], "in all")


# -- Work: the recipe, its shape, keys and placement --------------------------------------


def work_header_with(**recipe_changes) -> list:
    frames = as_bytes(encode(work()))
    header = header_of(frames)
    header["recipe"].update(recipe_changes)
    return [msgpack.packb(header, use_bin_type=True), *frames[1:]]


def deep_shape(depth: int) -> list:
    shape: list = ["step", 0]
    for _ in range(depth):
        shape = ["seq", [shape]]
    return shape


@pytest.mark.pure
def test_a_recipe_shape_is_checked_all_the_way_down():
    nodes = header_of(encode(work()))["recipe"]["nodes"]
    one = nodes[:1]
    frames = as_bytes(encode(work()))

    def shaped(shape, nodes=one):
        header = header_of(frames)
        header["recipe"] = {"nodes": nodes, "shape": shape}
        header["keys"], header["placement"] = [], []
        # the dropped nodes' args no longer point at frame 2: rebuild the frames to match
        return [msgpack.packb(header, use_bin_type=True), frames[1]]

    assert decode(shaped(["step", 0])).recipe.shape == ("step", 0)
    assert decode(shaped(deep_shape(MAX_SHAPE_DEPTH))).recipe.shape
    refused(shaped(deep_shape(MAX_SHAPE_DEPTH + 1)), "deep")
    refused(shaped(deep_shape(200)), "deep")
    refused(shaped(["step", 1]), "node index from 0 to 0")
    refused(shaped(["step", -1]), "node index")
    refused(shaped(["step", "0"]), "node index")
    refused(shaped(["loop", [["step", 0]]]), '("step", i)')
    refused(shaped(["seq", []]), "non-empty")
    refused(shaped(["seq", [["step", 0]], "extra"]), '("step", i)')
    refused(shaped("step"), '("step", i)')
    refused(shaped(["step", 0], nodes=one + one), "never uses node 1")
    refused(shaped(["step", 0], nodes=[]), "1 to")


@pytest.mark.pure
def test_a_recipe_node_is_checked():
    frames = as_bytes(encode(work()))

    def node_with(i, **changes):
        header = header_of(frames)
        header["recipe"]["nodes"][i].update(changes)
        return [msgpack.packb(header, use_bin_type=True), *frames[1:]]

    refused(node_with(0, source="cloud"), "`Work.recipe.nodes[0].source`")
    refused(node_with(0, target="not a name"), "package.module:Class")
    refused(node_with(0, target="pkg.mod:"), "package.module:Class")
    refused(node_with(0, target="pkg..mod:A"), "package.module:Class")
    refused(node_with(1, target="sha256:abc"), "`Work.recipe.nodes[1].target`", "64 lowercase hex")
    refused(node_with(0, label=""), "`Work.recipe.nodes[0].label`")
    refused(node_with(0, cache=1), "True or False")
    refused(node_with(0, args=5), "`Work.recipe.nodes[0].args`", "tuple")
    refused(node_with(0, kwargs=["L"]), "`Work.recipe.nodes[0].kwargs`", "dict")
    refused(node_with(0, kwargs=["D", 1, 2]), "not a str")
    refused(node_with(1, args=["T", 1]), "network", "arguments")
    header = header_of(frames)
    del header["recipe"]["nodes"][0]["kwargs"]
    refused([msgpack.packb(header, use_bin_type=True), *frames[1:]], "needs the field `kwargs`")


@pytest.mark.pure
def test_keys_placement_and_memory_are_checked():
    frames = as_bytes(encode(work()))
    refused(with_header(frames, keys=[[0, "md5:abc"]]), "`Work.keys[0]`", "sha256")
    refused(with_header(frames, keys=[[3, DIGEST]]), "names node 3")
    refused(with_header(frames, keys=[[0, DIGEST], [0, DIGEST]]), "twice")
    refused(with_header(frames, keys={"0": DIGEST}), "[index, value] pairs")
    refused(with_header(frames, keys=[["0", DIGEST]]), "[index, value] pairs")
    refused(with_header(frames, placement=[[0, "x" * 101]]), "`Work.placement[0]`")
    refused(with_header(frames, placement=[[0, 3]]), "`Work.placement[0]`")
    refused(with_header(frames, memory=""), "`Work.memory`")
    refused(with_header(frames, ref=-5), "`Work.ref`")


@pytest.mark.pure
def test_a_value_descriptor_that_lies_is_refused():
    frames = as_bytes(encode(work(input=np.zeros(10))))
    header = header_of(frames)
    refused(with_header(frames, input=["A", "<f8", [11], 0]), "needs 88 bytes")
    refused(with_header(frames, input=["A", "|O", [10], 0]), "dtype")
    refused(with_header(frames, input=["Z", 0]), "unknown tag")
    refused(with_header(frames, input={"a": 1}), "descriptor")
    refused(with_header(frames, input=["A", "<f8", [10], 1]), "pointed to twice")
    assert header["input"][-1] == 0


# -- peek_kinds: what a worker can refuse before reading -------------------------------------


class Reading:
    def __init__(self, value: int) -> None:
        self.value = value


@pytest.mark.pure
def test_peek_kinds_names_a_kind_this_process_cannot_read():
    kind = "test_wire.Reading"
    codec(
        kind, Reading, dump=lambda r: r.value.to_bytes(8, "little"), load=lambda b: Reading(int.from_bytes(b, "little"))
    )
    try:
        frames = as_bytes(encode(work(input={"r": Reading(5)})))
        assert decode(frames).input["r"].value == 5
        done = as_bytes(encode(Done(1, None, {0: Opaque(Reading(2))}, 3)))
    finally:
        codec_module.forget(kind)
    assert peek_kinds(frames) == {"plain", "numpy.ndarray", kind}
    assert peek_kinds(frames) - set(readable_kinds()) == {kind}
    refused(frames, f"`{kind}`", "import the module")
    assert kind in peek_kinds(done)
    refused(done, f"`{kind}`")
    assert peek_kinds(encode(Bye())) == set()
    assert peek_kinds(encode(Provision(DIGEST, b"x"))) == set()
    with pytest.raises(ProtocolError):
        peek_kinds(frames[:1])
    with pytest.raises(ProtocolError):
        peek_kinds(with_header(frames, ref=-1))


# -- encode: a message built wrongly here is the caller's fault -----------------------------


@pytest.mark.pure
def test_encode_refuses_a_message_built_wrongly():
    with pytest.raises(ValueError, match="`Work.ref`"):
        encode(work(ref=-1))
    with pytest.raises(TypeError, match="`Work.ref`"):
        encode(work(ref="7"))
    with pytest.raises(TypeError, match="one of the wire's messages"):
        encode({"t": "Bye"})
    with pytest.raises(ValueError, match="never uses node 2"):
        encode(work(recipe=dataclasses.replace(recipe(), shape=("par", (("step", 0), ("step", 1))))))
    with pytest.raises(ValueError, match="arguments"):
        encode(
            work(recipe=Recipe((NodeSpec("n", False, "network", DIGEST, (1,)),), ("step", 0)), keys={}, placement={})
        )
    with pytest.raises(TypeError, match="args"):
        encode(work(recipe=Recipe((NodeSpec("n", False, "project", "m:N", [1]),), ("step", 0)), keys={}, placement={}))
    with pytest.raises(TypeError, match="kwargs"):
        encode(
            work(
                recipe=Recipe((NodeSpec("n", False, "project", "m:N", (), {1: 2}),), ("step", 0)), keys={}, placement={}
            )
        )
    with pytest.raises(ValueError, match="sha256"):
        encode(Provision("md5:x", b""))
    with pytest.raises(TypeError, match="artifact"):
        encode(Provision(DIGEST, "text"))
    with pytest.raises(ValueError, match="over the limit"):
        encode(Failed(1, "x", None, "E", "t" * (MAX_TEXT + 1)))
    with pytest.raises(ValueError, match="surrogate"):
        encode(Refusal("\ud800"))
    with pytest.raises(ValueError, match="mount"):
        encode(Located("w1", "mount"))


@pytest.mark.pure
def test_encode_lets_the_codecs_own_errors_through():
    class Unregistered:
        pass

    with pytest.raises(Unwritable, match="Unregistered"):
        encode(work(input=Unregistered()))
    with pytest.raises(Unwritable):
        encode(Done(1, None, {0: Unregistered()}, 0))


# -- compatible ------------------------------------------------------------------------------


@pytest.mark.pure
def test_compatible_sides_talk():
    assert compatible(runtime(), runtime(), needs_pickle=False) is None
    assert compatible(runtime(), runtime(), needs_pickle=True) is None
    # a different somatize alone is fine while the wire is the same
    assert compatible(runtime(), runtime(somatize="0.2.0"), needs_pickle=True) is None
    # without pickles, Python and cloudpickle may differ
    assert compatible(runtime(), runtime(python="3.12", cloudpickle="3.0.0"), needs_pickle=False) is None


@pytest.mark.pure
def test_a_wire_mismatch_says_which_side_upgrades():
    why = compatible(
        runtime(),
        runtime(wire=WIRE_VERSION + 1, somatize="0.3.0"),
        needs_pickle=False,
        me="this worker",
        them="the client",
    )
    assert why is not None
    assert f"this worker speaks wire version {WIRE_VERSION}" in why
    assert f"the client speaks version {WIRE_VERSION + 1} (somatize 0.3.0)" in why
    assert why.endswith("upgrade somatize on this worker, the older one")
    why = compatible(runtime(wire=WIRE_VERSION + 1), runtime(), needs_pickle=False)
    assert why.endswith("upgrade somatize on the other side, the older one")


@pytest.mark.pure
def test_network_mode_needs_the_same_python_and_cloudpickle():
    worker = runtime(python="3.12", cloudpickle="3.1.1")
    client = runtime(python="3.11", cloudpickle="3.0.0")
    why = compatible(worker, client, needs_pickle=True, me="this worker", them="the client")
    assert why == (
        "this worker runs Python 3.12 and cloudpickle 3.1.1, the client Python 3.11 and "
        "cloudpickle 3.0.0: network mode unpickles code, which needs the same Python minor "
        'version and cloudpickle version on both sides; install matching versions or use mode="project"'
    )
    assert compatible(runtime(), runtime(cloudpickle="3.0.0"), needs_pickle=True)
    assert compatible(runtime(), runtime(python="3.12"), needs_pickle=True)
    why = compatible(runtime(), runtime(cloudpickle=""), needs_pickle=True)
    assert "the other side cannot import it" in why and "pip install cloudpickle" in why


# -- properties: decode returns a message or raises ProtocolError, nothing else -----------


def decodes_or_refuses(frames) -> None:
    try:
        msg = decode(frames)
    except ProtocolError as exc:
        assert isinstance(exc.why, str) and exc.why
        return
    assert isinstance(msg, REQUESTS + ANSWERS + CARRIERS)
    encode(msg)  # whatever decode accepts is a message this side could have sent
    assert variant_of(frames) is type(msg)


def names_or_refuses(frames) -> None:
    try:
        cls = variant_of(frames)
    except ProtocolError as exc:
        assert isinstance(exc.why, str) and exc.why
        return
    assert cls in REQUESTS + ANSWERS + CARRIERS


FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(st.lists(st.binary(max_size=64), max_size=5))
@pytest.mark.pure
def test_random_frames_decode_or_are_refused(frames):
    decodes_or_refuses(frames)
    names_or_refuses(frames)


SAMPLES = [as_bytes(encode(m)) for m in messages() + carriers()] + [
    as_bytes(encode(work(input=np.arange(6, dtype=np.int16).reshape(2, 3)))),
    as_bytes(encode(Done(1, b"x" * 70_000, {0: np.zeros(3, bool)}, 1))),
]

edits = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 10), st.integers(0, 10**6), st.integers(1, 255)),
    st.tuples(st.just("cut"), st.integers(0, 10), st.integers(0, 10**6)),
    st.tuples(st.just("insert"), st.integers(0, 10), st.integers(0, 10**6), st.binary(min_size=1, max_size=8)),
    st.tuples(st.just("drop"), st.integers(0, 10)),
    st.tuples(st.just("dup"), st.integers(0, 10)),
    st.tuples(st.just("swap"), st.integers(0, 10), st.integers(0, 10)),
)


def apply(frames: list[bytes], edit) -> list[bytes]:
    frames = list(frames)
    if not frames:
        return frames
    op, i, *rest = edit
    i %= len(frames)
    f = frames[i]
    if op == "flip" and f:
        pos = rest[0] % len(f)
        frames[i] = f[:pos] + bytes([f[pos] ^ rest[1]]) + f[pos + 1 :]
    elif op == "cut":
        frames[i] = f[: rest[0] % (len(f) + 1)]
    elif op == "insert":
        pos = rest[0] % (len(f) + 1)
        frames[i] = f[:pos] + rest[1] + f[pos:]
    elif op == "drop":
        del frames[i]
    elif op == "dup":
        frames.insert(i, f)
    elif op == "swap":
        j = rest[0] % len(frames)
        frames[i], frames[j] = frames[j], frames[i]
    return frames


@FUZZ
@given(st.sampled_from(SAMPLES), st.lists(edits, min_size=1, max_size=4))
def test_mutated_messages_decode_or_are_refused(frames, changes):
    for change in changes:
        frames = apply(frames, change)
    decodes_or_refuses(frames)
    names_or_refuses(frames)


WORDS = sorted(
    {"v", "t", "step", "seq", "par", "T", "D", "A", "L", "<f8", "|u1"}
    | {cls.__name__ for cls in REQUESTS + ANSWERS + CARRIERS}
    | {f.name for cls in (*REQUESTS, *ANSWERS, *CARRIERS, Runtime, NodeSpec, Recipe) for f in dataclasses.fields(cls)}
)
scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=12)
    | st.sampled_from(WORDS)
    | st.sampled_from([DIGEST, "m:N", "project", "network", "mount", "3.11", MOUNT_FILE])
    | st.binary(max_size=12)
)
packable = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(WORDS) | st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=24,
)


@FUZZ
@given(
    st.dictionaries(st.sampled_from(WORDS) | st.text(max_size=6), packable, max_size=8),
    st.none() | st.sampled_from(sorted(cls.__name__ for cls in REQUESTS + ANSWERS + CARRIERS)),
    st.lists(st.binary(max_size=16), max_size=2),
)
def test_random_header_maps_decode_or_are_refused(header, variant, after):
    if variant is not None:  # past the version and the variant, into the fields
        header.update(v=WIRE_VERSION, t=variant)
    frames = [msgpack.packb(header, use_bin_type=True), *after]
    decodes_or_refuses(frames)
    names_or_refuses(frames)


def paths(x, prefix=()):
    """Every place inside a header where a value sits."""
    yield prefix
    if isinstance(x, dict):
        for k, v in x.items():
            yield from paths(v, (*prefix, k))
    elif isinstance(x, list):
        for k, v in enumerate(x):
            yield from paths(v, (*prefix, k))


def replaced(x, path, value):
    if not path:
        return value
    x = dict(x) if isinstance(x, dict) else list(x)
    x[path[0]] = replaced(x[path[0]], path[1:], value)
    return x


@FUZZ
@given(st.sampled_from(SAMPLES), st.lists(st.tuples(st.integers(0, 10**6), packable), min_size=1, max_size=3))
def test_headers_with_fields_replaced_decode_or_are_refused(frames, changes):
    header = header_of(frames)
    for where, value in changes:
        places = [p for p in paths(header) if p[:1] not in ((), ("v",), ("t",))] or [("t",)]
        header = replaced(header, places[where % len(places)], value)
    decodes_or_refuses([msgpack.packb(header, use_bin_type=True), *frames[1:]])


# -- the package: one public surface, modules that import nothing private from each other ----


@pytest.mark.pure
def test_the_package_exports_every_public_name_from_one_place():
    import somatize.wire as package

    public = {name for name in dir(package) if not name.startswith("_")}
    modules = {
        "checks",
        "counting",
        "fields",
        "items",
        "limits",
        "messages",
        "reading",
        "short",
        "writing",
        "annotations",
    }
    assert set(package.__all__) == public - modules
    for name in package.__all__:
        obj = getattr(package, name)
        if isinstance(obj, type) or callable(obj) and hasattr(obj, "__module__"):
            assert obj.__module__ == "somatize.wire", name
    assert {"Relay", "Begin", "Chunk", "Credit", "Mounted", "CARRIERS", "variant_of"} <= set(package.__all__)


@pytest.mark.pure
def test_no_module_of_the_wire_imports_a_private_name():
    import ast
    from pathlib import Path

    import somatize.wire as package

    for path in [*Path(package.__file__).parent.glob("*.py"), Path(codec_module.__file__)]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("somatize")):
                private = [a.name for a in node.names if a.name.startswith("_") and a.name != "__version__"]
                assert not private, f"{path.name} imports {private} from {node.module}"


@pytest.mark.pure
def test_a_lower_limit_in_limits_holds_for_reading_and_writing(monkeypatch):
    monkeypatch.setattr(wire.limits, "MAX_NAME", 3)
    with pytest.raises(ValueError, match="over the limit of 3"):
        encode(Where("four"))
    monkeypatch.undo()
    frames = encode(Where("four"))
    monkeypatch.setattr(wire.limits, "MAX_NAME", 3)
    refused(frames, "`Where.host`", "over the limit of 3")


# -- items: what a header declares is counted before it is built ----------------------------


def items_in(x) -> int:
    if isinstance(x, list):
        return 1 + len(x) + sum(items_in(v) for v in x)
    if isinstance(x, dict):
        return 1 + 2 * len(x) + sum(items_in(k) + items_in(v) for k, v in x.items())
    return 0


@FUZZ
@given(packable, st.integers(1, 40))
def test_items_are_counted_exactly_and_only_in_long_headers(value, limit):
    from somatize.wire.checks import Bad
    from somatize.wire.counting import count_items

    frame = msgpack.packb(value, use_bin_type=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(wire.limits, "MAX_ITEMS", limit)
        try:
            count_items(frame)
            counted = "passed"
        except Bad as exc:
            counted = exc.why
    if len(frame) <= limit or items_in(value) <= limit:
        assert counted == "passed"
    else:
        assert counted == f"declares over {limit:,} items (arrays, maps and their entries)"


@FUZZ
@given(st.sampled_from(SAMPLES), st.lists(edits, max_size=3), st.integers(2, 64))
def test_with_few_items_allowed_decode_still_refuses_only_with_protocol_errors(frames, changes, limit):
    for change in changes:
        frames = apply(frames, change)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(wire.limits, "MAX_ITEMS", limit)
        decodes_or_refuses(frames)


@pytest.mark.pure
def test_greetings_are_remembered_by_their_bytes_and_only_so_many():
    """Every channel opens with a Hello and its Ready, the same bytes from one installation
    every time: read once the long way (checked whole), the same bytes are the same message
    after. A peer sending greetings that differ makes this side keep a few dozen at most,
    and one the long way refuses is never remembered."""
    from somatize.wire import short

    frames = encode(Hello(runtime()))
    assert decode(frames) == Hello(runtime()) and decode(list(frames)) is decode(frames)
    assert encode(Hello(runtime())) == frames and encode(Ready(runtime())) == encode(Ready(runtime()))
    bad = with_header(frames, seen=[])
    refused(bad, "`Hello.seen`")
    refused(bad, "`Hello.seen`")  # again: still the long way's sentence, never a memory of it
    for n in range(1000):  # kinds that differ: each a greeting of its own
        rt = runtime()
        decode(encode(Ready(Runtime(rt.wire, rt.python, rt.somatize, rt.cloudpickle, (f"k{n}",), rt.mode))))
    assert len(short._KNOWN) <= short._MAX_GREETINGS and len(short._WRITTEN) <= short._MAX_GREETINGS
    offered = encode(Hello(runtime(), offering="w1"))
    decode(offered)
    assert bytes(offered[0]) not in short._KNOWN  # a dialing worker's Hello names its host: not kept


@pytest.mark.pure
def test_every_variant_is_told_by_its_first_bytes_as_the_long_way_tells_it():
    from somatize.wire.messages import header_fields
    from somatize.wire.reading import _buffers, _variant, _version_and_variant
    from somatize.wire.short import told

    for msg in messages() + carriers():
        frames = encode(msg)
        long_way = _variant(_version_and_variant(_buffers(frames[:1])[0]))
        assert told(frames) is long_way is type(msg) and variant_of(frames) is type(msg), msg
        short_header = [msgpack.packb({"v": WIRE_VERSION, "t": type(msg).__name__})]  # fewer keys than fields
        assert told(short_header) is (type(msg) if not header_fields(type(msg)) else None), msg


def test_the_header_a_call_is_read_from_is_its_bytes_when_small_and_its_buffer_otherwise():
    import zmq

    from somatize.wire import short

    frames = wire.encode(wire.Done(3, 7, {}, 5))
    header = bytes(frames[0])
    assert short.head_of(header) is header
    small = zmq.Frame(header)
    assert type(short.head_of(small)) is bytes and short.head_of(small) == header
    assert wire.decode([small]) == wire.decode([header]) == wire.Done(3, 7, {}, 5)
    big = zmq.Frame(b"\x80" * (short._SMALL + 1))  # too big to be read the short way: not copied
    assert type(short.head_of(big)) is memoryview and short.express(short.head_of(big)) is None
    view = memoryview(header)
    assert short.head_of(view) is view  # no bytes of its own: read as it is
    assert short.express(short.head_of(view)) == wire.Done(3, 7, {}, 5)

    class NoLength:  # a buffer that does not say its length: its buffer, as before
        buffer = view

    assert short.head_of(NoLength()) is view
