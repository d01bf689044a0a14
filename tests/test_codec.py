"""The codec layer: values to (descriptor, frames) and the written form, and back."""

from __future__ import annotations

import enum
import importlib
import json
import math
import sys
import threading
import time
import uuid
from collections import namedtuple
from dataclasses import asdict, dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from somatize.codec import (
    MAX_DEPTH,
    MAX_NDIM,
    MAX_NODES,
    START_BYTES,
    Opaque,
    check_start,
    codec,
    codecs_registered,
    decode,
    dumps,
    encode,
    kinds_in,
    loads,
    readable_kinds,
    written_parts,
)
from somatize.errors import BadCodec, CodecError, Unreadable, Unwritable

# The package re-exports the function `codec`, which hides the module of the same name.
codec_module = importlib.import_module("somatize.codec")

# -- helpers -----------------------------------------------------------------------------


def same(a, b) -> bool:
    """Equal, and of the same types all the way down (NaN equals NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=False))
    if isinstance(a, dict):
        return len(a) == len(b) and all(
            same(ka, kb) and same(va, vb) for (ka, va), (kb, vb) in zip(a.items(), b.items(), strict=False)
        )
    if isinstance(a, np.ndarray):
        return (
            a.dtype.str == b.dtype.str and a.shape == b.shape and np.array_equal(a, b, equal_nan=a.dtype.kind in "fc")
        )
    if isinstance(a, np.generic):
        return a.dtype.str == b.dtype.str and a.tobytes() == b.tobytes()
    if isinstance(a, float):
        if math.isnan(a):
            return math.isnan(b)
        return a == b and math.copysign(1, a) == math.copysign(1, b)
    if isinstance(a, Opaque):
        return same(a.value, b.value)
    return a == b


def through_frames(value):
    descriptor, frames = encode(value)
    return decode(descriptor, frames)


def through_bytes(value):
    data = dumps(value)
    assert b"".join(written_parts(value)) == data
    return loads(data)


ROUND_TRIPS = [through_frames, through_bytes]


@pytest.fixture
def kind():
    """A fresh kind name, forgotten by the registry when the test ends."""
    made = []

    def make(stem: str = "test") -> str:
        name = f"{stem}.{uuid.uuid4().hex[:12]}"
        made.append(name)
        return name

    yield make
    for name in made:
        codec_module.forget(name)


# -- strategies --------------------------------------------------------------------------

scalars = (
    st.none()
    | st.booleans()
    | st.integers()  # unbounded: beyond 64 bits too
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
    | st.binary(max_size=20)
)
keys = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False)
    | st.text(max_size=10)
    | st.binary(max_size=10)
)
plain = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=5) | st.lists(inner, max_size=5).map(tuple) | st.dictionaries(keys, inner, max_size=5)
    ),
    max_leaves=25,
)

ALLOWED = sorted(importlib.import_module("somatize.codec.layout").DTYPES)
dtypes = st.sampled_from([np.dtype(s) for s in ALLOWED])
arrays = dtypes.flatmap(lambda dt: hnp.arrays(dt, hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5)))
views = st.sampled_from(
    [
        lambda a: a,
        lambda a: a.T,
        lambda a: a[::2] if a.ndim else a,
        lambda a: a[::-1] if a.ndim else a,
        lambda a: np.asfortranarray(a),
        lambda a: a[..., ::2] if a.ndim else a,
    ]
)

# -- plain data --------------------------------------------------------------------------


@pytest.mark.parametrize("trip", ROUND_TRIPS)
@settings(max_examples=150, deadline=None)
@given(value=plain)
def test_plain_data_comes_back_with_the_same_types(trip, value):
    assert same(trip(value), value)


@settings(max_examples=100, deadline=None)
@given(value=plain)
def test_plain_descriptors_hold_only_scalars_and_lists(value):
    descriptor, frames = encode(value)

    def walk(d):
        assert type(d) in (type(None), bool, int, float, str, bytes, list)
        if type(d) is list:
            assert type(d[0]) is str
            for x in d[1:]:
                walk(x)

    walk(descriptor)
    assert frames == []
    assert kinds_in(descriptor) == {"plain"}


@pytest.mark.parametrize("trip", ROUND_TRIPS)
@pytest.mark.parametrize(
    "value",
    [
        2**64,
        -(2**63) - 1,
        2**64 - 1,
        -(2**63),
        10**5000,  # past Python's int-to-decimal limit
        float("inf"),
        float("-inf"),
        -0.0,
        "",
        "snow ☃ and 😀",
        b"",
        b"\x00" * 200_000,  # travels as a frame
        {None: 1, True: 2, 3: 3, 1.5: 4, "s": 5, b"b": 6, 2**80: 7},
        {b"k" * 100_000: 1},
        ((), [], {}),
    ],
    ids=lambda v: type(v).__name__,
)
@pytest.mark.pure
def test_plain_edges(trip, value):
    assert same(trip(value), value)


@pytest.mark.pure
def test_bytearray_and_memoryview_come_back_as_bytes():
    assert same(through_bytes(bytearray(b"abc")), b"abc")
    assert same(through_bytes(memoryview(b"abcdef")[::2]), b"ace")
    big = bytearray(100_000)
    descriptor, frames = encode(big)
    assert descriptor == ["B", 0]
    assert same(decode(descriptor, frames), bytes(big))


@pytest.mark.pure
def test_big_bytes_go_to_a_frame_not_the_header():
    big = b"x" * 1_000_000
    descriptor, frames = encode(["a", big])
    assert descriptor == ["L", "a", ["B", 0]]
    assert frames[0] is big


@pytest.mark.pure
def test_a_str_with_a_lone_surrogate_is_unwritable():
    with pytest.raises(Unwritable, match="surrogate"):
        encode("\ud800")


@pytest.mark.pure
def test_nesting_up_to_the_limit_and_not_past_it():
    deep = 0
    for _ in range(MAX_DEPTH):
        deep = [deep]
    assert same(through_bytes(deep), deep)
    with pytest.raises(Unwritable, match="deep"):
        encode([deep])
    selfish: list = []
    selfish.append(selfish)
    with pytest.raises(Unwritable, match="contains itself"):
        encode(selfish)


@pytest.mark.pure
def test_too_many_pieces_is_unwritable():
    with pytest.raises(Unwritable, match="NumPy array"):
        encode([0] * MAX_NODES)


@pytest.mark.pure
def test_tuple_dict_keys_are_refused():
    with pytest.raises(Unwritable, match="`tuple`") as caught:
        encode({(1, 2): "secret"})
    assert "secret" not in str(caught.value)


class Color(enum.IntEnum):
    RED = 1


Point = namedtuple("Point", "x y")


class Name(str):
    pass


@pytest.mark.parametrize(("value", "base"), [(Color.RED, "int"), (Point(1, 2), "tuple"), (Name("secret"), "str")])
@pytest.mark.pure
def test_subclasses_of_builtins_are_not_silently_flattened(value, base):
    with pytest.raises(Unwritable) as caught:
        encode(value)
    text = str(caught.value)
    assert f"`{type(value).__name__}`" in text and "codec(" in text
    assert f"`{base}` underneath" in text
    assert "secret" not in text


@pytest.mark.pure
def test_a_subclass_of_a_builtin_crosses_with_its_own_codec(kind):
    name = kind("tests.Point")
    codec(
        name,
        Point,
        dump=lambda p: json.dumps(list(p)).encode(),
        load=lambda raw: Point(*json.loads(raw)),
    )
    back = through_bytes([Point(1, 2)])
    assert back == [Point(1, 2)] and type(back[0]) is Point


# -- NumPy -------------------------------------------------------------------------------


@pytest.mark.parametrize("trip", ROUND_TRIPS)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(array=arrays, view=views)
def test_arrays_come_back_exactly(trip, array, view):
    array = view(array)
    back = trip(array)
    assert type(back) is np.ndarray
    assert same(back, array)
    assert back.flags.writeable


@settings(max_examples=50, deadline=None)
@given(array=arrays)
@pytest.mark.pure
def test_arrays_inside_containers(array):
    value = {"a": [array, (array[()] if array.ndim == 0 else array[:1],)], 1: None}
    assert same(through_bytes(value), value)


@pytest.mark.pure
def test_every_allowed_dtype_in_both_byte_orders():
    assert {"|b1", "|i1", "|u1", ">i4", "<i4", ">f2", "<c16", ">c8", ">u8"} <= set(ALLOWED)
    for s in ALLOWED:
        a = np.arange(6).astype(s).reshape(2, 3)
        back = through_bytes(a)
        assert back.dtype.str == s and same(back, a)


@pytest.mark.pure
def test_contiguous_arrays_are_not_copied_when_encoded():
    a = np.arange(1000, dtype=np.float64)
    descriptor, frames = encode(a)
    assert descriptor == ["A", "<f8", [1000], 0]
    assert np.shares_memory(np.frombuffer(frames[0], np.uint8), a)


@pytest.mark.pure
def test_non_contiguous_arrays_are_made_contiguous_once():
    a = np.arange(20, dtype=np.int32).reshape(4, 5).T
    descriptor, frames = encode(a)
    assert descriptor[2] == [5, 4]
    assert not np.shares_memory(np.frombuffer(frames[0], np.uint8), a)
    assert same(decode(descriptor, frames), a)


@pytest.mark.pure
def test_arrays_from_read_only_frames_are_writable_copies():
    a = np.arange(10, dtype=np.int16)
    descriptor, frames = encode(a)
    raw = bytes(frames[0])
    back = decode(descriptor, [raw])
    assert back.flags.writeable
    back[0] = 99  # does not touch `raw`
    assert raw == a.tobytes()
    data = dumps(a)
    back = loads(data)
    assert back.flags.writeable and same(back, a)


@pytest.mark.pure
def test_arrays_from_writable_frames_are_views_of_them():
    a = np.arange(10, dtype=np.int16)
    descriptor, frames = encode(a)
    buffer = bytearray(frames[0])
    back = decode(descriptor, [buffer])
    assert back.flags.writeable
    assert np.shares_memory(back, np.frombuffer(buffer, np.uint8))
    data = bytearray(dumps([a, a + 1]))
    first, second = loads(data)
    whole = np.frombuffer(data, np.uint8)
    assert np.shares_memory(first, whole) and np.shares_memory(second, whole)
    assert first.ctypes.data % 16 == whole.ctypes.data % 16  # frames sit on 16-byte steps
    assert same(second, a + 1)


@pytest.mark.pure
def test_arrays_are_views_of_read_only_frames_when_asked_for_and_then_read_only():
    a = np.arange(10, dtype=np.int16)
    descriptor, frames = encode(a)
    raw = bytes(frames[0])
    back = decode(descriptor, [raw], views=True)
    assert not back.flags.writeable and np.shares_memory(back, np.frombuffer(raw, np.uint8))
    assert same(back, a)
    mine = bytearray(raw)
    assert decode(descriptor, [mine], views=True).flags.writeable  # a writable frame stays so
    data = dumps([a, "x"])
    first, _ = loads(data, views=True)
    assert not first.flags.writeable and np.shares_memory(first, np.frombuffer(data, np.uint8))
    assert decode(descriptor, [raw]).flags.writeable  # the default is unchanged: a copy


@pytest.mark.parametrize(
    "scalar",
    [
        np.float32(1.5),
        np.float64(-0.0),
        np.float16(2),
        np.int8(-3),
        np.uint64(2**64 - 1),
        np.int64(-(2**63)),
        np.bool_(True),
        np.complex64(1 + 2j),
        np.complex128(float("nan")),
    ],
)
@pytest.mark.parametrize("trip", ROUND_TRIPS)
@pytest.mark.pure
def test_numpy_scalars_come_back_as_the_same_scalar_type(trip, scalar):
    back = trip(scalar)
    assert type(back) is type(scalar)
    assert same(back, scalar)
    assert kinds_in(encode(scalar)[0]) == {"numpy.generic"}


@pytest.mark.parametrize(
    "array",
    [
        np.array([object()], dtype=object),
        np.array(["secret"]),
        np.array([b"secret"]),
        np.array(["2024-01-01"], dtype="datetime64[D]"),
        np.zeros(2, dtype=[("a", "<i4")]),
        np.zeros(2, dtype=np.longdouble),
        np.zeros(2, dtype="V4"),
    ],
)
@pytest.mark.pure
def test_unsupported_dtypes_are_unwritable(array):
    with pytest.raises(Unwritable, match="dtype") as caught:
        encode(array)
    assert "secret" not in str(caught.value)


@pytest.mark.pure
def test_unsupported_numpy_scalars_and_array_subclasses_are_unwritable():
    with pytest.raises(Unwritable):
        encode(np.datetime64("2024-01-01"))
    with pytest.raises(Unwritable, match="`ndarray` underneath"):
        encode(np.ma.masked_array([1, 2]))
    with pytest.raises(Unwritable, match="dimensions"):
        encode(np.zeros((1,) * (MAX_NDIM + 1)))


# -- the registry and Opaque -------------------------------------------------------------


@dataclass
class Reading:
    hz: float
    samples: list[float]


@pytest.fixture
def reading_codec():
    codec(
        "myproject.Reading",
        Reading,
        dump=lambda one: json.dumps(asdict(one)).encode(),
        load=lambda raw: Reading(**json.loads(raw)),
    )
    yield "myproject.Reading"
    codec_module.forget("myproject.Reading")


@pytest.mark.parametrize("trip", ROUND_TRIPS)
@pytest.mark.pure
def test_the_seed_reading_crosses_with_its_codec(trip, reading_codec):
    one = Reading(hz=50.0, samples=[1.0, 2.5])
    assert "myproject.Reading" in codecs_registered()
    assert "myproject.Reading" in readable_kinds()
    assert trip(one) == one
    assert trip([one, {"r": one}]) == [one, {"r": one}]
    descriptor, frames = encode(one)
    assert descriptor == ["C", "myproject.Reading", 0]
    assert kinds_in(descriptor) == {"myproject.Reading"}
    assert kinds_in(encode([one])[0]) == {"plain", "myproject.Reading"}


@pytest.mark.pure
def test_without_a_codec_a_value_is_unwritable_with_the_fix():
    with pytest.raises(Unwritable) as caught:
        encode(Reading(hz=12345.0, samples=[]))
    text = str(caught.value)
    assert "`Reading` cannot leave this process" in text
    assert 'codec("a name", Reading, dump=..., load=...)' in text
    assert "in the module that defines `Reading`" in text  # where the call belongs
    assert "12345" not in text
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, CodecError)


@pytest.mark.pure
def test_codecs_registered_is_sorted_and_lists_the_registry_only(kind):
    before = codecs_registered()
    assert before == sorted(before)
    assert "arrow.RecordBatch" not in before and "plain" not in before
    b, a = kind("zzz"), kind("aaa")
    codec(b, Reading, dump=bytes, load=bytes)
    codec(a, Point, dump=bytes, load=bytes)
    now = codecs_registered()
    assert now == sorted(now) and {a, b} <= set(now)


@pytest.mark.pure
def test_a_dump_that_does_not_return_bytes_is_a_bad_codec(kind):
    name = kind("bad")
    codec(name, Reading, dump=lambda one: "text", load=lambda raw: None)
    with pytest.raises(BadCodec) as caught:
        encode(Reading(1.0, []))
    expected = f"the codec for `{name}` has to return bytes, and it returned a `str`"
    assert str(caught.value) == expected
    assert isinstance(caught.value, TypeError)


@pytest.mark.pure
def test_a_dump_may_return_bytearray_or_memoryview(kind):
    codec(kind(), Reading, dump=lambda one: bytearray(b"12"), load=lambda raw: raw)
    assert through_bytes(Reading(1.0, [])) == b"12"
    view = memoryview(np.arange(3, dtype="<i4"))
    codec(kind(), Reading, dump=lambda one: view, load=lambda raw: raw)
    assert through_frames(Reading(1.0, [])) == np.arange(3, dtype="<i4").tobytes()


@pytest.mark.pure
def test_a_dump_or_load_that_raises_names_the_kind(kind):
    name = kind()

    def load(raw):
        raise KeyError("inside")

    codec(name, Reading, dump=lambda one: 1 / 0, load=load)
    with pytest.raises(Unwritable, match=f"`{name}` raised ZeroDivisionError") as caught:
        encode(Reading(1.0, []))
    assert isinstance(caught.value.__cause__, ZeroDivisionError)
    with pytest.raises(Unreadable, match=f"`{name}` raised KeyError") as caught:
        decode(["C", name, 0], [b"x"])
    assert isinstance(caught.value.__cause__, KeyError)


@pytest.mark.pure
def test_registering_again_replaces(kind):
    name = kind()
    codec(name, Reading, dump=lambda one: b"", load=lambda raw: 1)
    codec(name, Reading, dump=lambda one: b"", load=lambda raw: 2)
    assert codecs_registered().count(name) == 1
    assert through_bytes(Reading(1.0, [])) == 2


@pytest.mark.pure
def test_the_registry_walks_the_mro(kind):
    class Base:
        pass

    class Child(Base):
        pass

    codec(kind(), Base, dump=lambda one: type(one).__name__.encode(), load=lambda raw: raw.decode())
    assert through_bytes(Child()) == "Child"


@pytest.mark.parametrize("taken", ["arrow.RecordBatch", "arrow.Table", "plain", "numpy.ndarray", "numpy.generic"])
@pytest.mark.pure
def test_built_in_kinds_cannot_be_registered(taken):
    with pytest.raises(BadCodec, match="built-in"):
        codec(taken, Reading, dump=bytes, load=bytes)
    assert taken not in codecs_registered()


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("", Reading), "non-empty str"),
        ((3, Reading), "`int`"),
        (("k.x", "Reading"), "class it writes down"),
        (("k.x", Opaque), "type it wraps"),
    ],
)
@pytest.mark.pure
def test_codec_checks_its_arguments(args, words):
    with pytest.raises(BadCodec, match=words):
        codec(*args, dump=bytes, load=bytes)


@pytest.mark.pure
def test_codec_needs_callables():
    with pytest.raises(BadCodec, match="`dump` to be callable"):
        codec("k.x", Reading, dump=None, load=bytes)
    with pytest.raises(BadCodec, match="`load` to be callable"):
        codec("k.x", Reading, dump=bytes, load=b"no")
    assert "k.x" not in codecs_registered()


@pytest.mark.pure
def test_registering_from_many_threads(kind):
    names = [kind() for _ in range(32)]
    classes = [type(f"T{i}", (), {}) for i in range(32)]
    threads = [
        threading.Thread(target=codec, args=(n, c), kwargs={"dump": bytes, "load": bytes})
        for n, c in zip(names, classes, strict=False)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(names) <= set(codecs_registered())


class Connection:
    def __init__(self, address):
        self.address = address

    def __eq__(self, other):
        return isinstance(other, Connection) and other.address == self.address


@pytest.mark.pure
def test_opaque_crosses_through_a_codec(kind):
    name = kind("tests.Connection")
    codec(
        name,
        Connection,
        dump=lambda c: c.address.encode(),
        load=lambda raw: Connection(raw.decode()),
    )
    value = Opaque(Connection("tcp://secret:5555"))
    for trip in ROUND_TRIPS:
        back = trip(value)
        assert type(back) is Opaque and back == value
    descriptor, _ = encode(value)
    assert descriptor == ["O", name, 0]
    assert kinds_in(descriptor) == {name}


@pytest.mark.pure
def test_opaque_without_a_codec_is_unwritable():
    with pytest.raises(Unwritable) as caught:
        encode(Opaque(Connection("tcp://secret:5555")))
    text = str(caught.value)
    assert "`Opaque` holding a `Connection`" in text and "codec(" in text
    assert "secret" not in text


@pytest.mark.pure
def test_opaque_uses_only_the_registry():
    # Plain data and arrays have built-in writers, but an Opaque promises one-process-only.
    for inner in (3, "x", np.zeros(2)):
        with pytest.raises(Unwritable, match="Opaque"):
            encode(Opaque(inner))


@pytest.mark.pure
def test_opaque_repr_and_equality():
    one = Opaque(["the", "secret"])
    assert repr(one) == "Opaque(<list>)"
    assert one == Opaque(["the", "secret"]) and one != Opaque([]) and one != ["the", "secret"]
    with pytest.raises(TypeError):
        hash(one)


# -- the package -----------------------------------------------------------------------


@pytest.mark.pure
def test_the_codec_package_is_a_module_that_registers_when_called(kind):
    import types

    assert isinstance(codec_module, types.ModuleType) and callable(codec_module)
    assert importlib.import_module("somatize").codec is codec_module
    for name in codec_module.__all__:
        assert getattr(codec_module, name) is not None, name
    parts = ("registered", "layout", "writing", "reading", "arrow", "tensors")
    for part in parts:  # no part shadows a public name, and each says what it is for
        module = importlib.import_module(f"somatize.codec.{part}")
        assert part not in codec_module.__all__ and module.__doc__
    name = kind("called")
    codec_module(name, Reading, dump=lambda r: b"r", load=lambda raw: "read")
    assert name in codecs_registered() and decode(*encode(Reading(1.0, []))) == "read"


def test_checking_a_descriptor_with_a_tensor_in_it_does_not_import_torch(tmp_path):
    import os
    import subprocess
    from pathlib import Path

    import somatize

    script = (
        "import sys\n"
        "from somatize.codec import check, kinds_in\n"
        "check(['L', ['X', 'bfloat16', [2], 0], ['A', '<f4', [1], 1]], [bytes(4), bytes(4)])\n"
        "assert kinds_in(['X', 'int8', [0], 0]) == {'torch.Tensor'}\n"
        "print('torch' in sys.modules)\n"
    )
    root = str(Path(somatize.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": root}
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


# -- kinds ------------------------------------------------------------------------------


@pytest.mark.pure
def test_readable_kinds_lists_built_ins_registry_and_own_kinds(kind):
    name = kind()
    codec(name, Reading, dump=bytes, load=bytes)
    kinds = readable_kinds()
    assert kinds == sorted(kinds)
    assert {"plain", "numpy.ndarray", "numpy.generic", "torch.Tensor", name} <= set(kinds)


@pytest.mark.pure
def test_kinds_in_a_mixed_value(kind):
    name = kind()
    codec(name, Reading, dump=lambda one: b"r", load=bytes)
    descriptor, _ = encode([np.zeros(2), np.float32(1), Reading(1.0, []), 1])
    assert kinds_in(descriptor) == {"plain", "numpy.ndarray", "numpy.generic", name}
    assert kinds_in(encode(np.zeros(2))[0]) == {"numpy.ndarray"}


@pytest.mark.pure
def test_an_unknown_kind_is_unreadable_with_the_fix():
    # "torch.Tensor" would summon somatize.torch, which does not exist yet; a kind that is
    # not the library's own is never imported by guesswork.
    with pytest.raises(Unreadable) as caught:
        decode(["C", "myproject.Nowhere", 0], [b"raw"])
    text = str(caught.value)
    assert "`myproject.Nowhere`" in text
    assert 'codec("myproject.Nowhere", ...)' in text
    assert "only imports its own codecs" in text


@pytest.mark.pure
def test_the_library_s_own_kinds_are_summoned_by_name(tmp_path, monkeypatch, kind):
    name = kind("own")
    module = f"summoned_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text(
        "from somatize.codec import codec\n"
        "class Thing:\n"
        "    pass\n"
        f"codec({name!r}, Thing, dump=lambda t: b'', load=lambda raw: 'summoned ' + raw.decode())\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(importlib.import_module("somatize.codec.registered").OWN_KINDS, name, module)
    try:
        assert name not in codecs_registered()
        assert decode(["C", name, 0], [b"it"]) == "summoned it"
        assert name in codecs_registered()
    finally:
        sys.modules.pop(module, None)


@pytest.mark.pure
def test_an_own_kind_whose_module_is_missing_says_what_to_install(monkeypatch):
    monkeypatch.setitem(
        importlib.import_module("somatize.codec.registered").OWN_KINDS, "own.Missing", "somatize.nowhere_to_be_found"
    )
    with pytest.raises(Unreadable, match=r"pip install somatize\[nowhere_to_be_found\]"):
        decode(["C", "own.Missing", 0], [b""])


# -- malformed input ---------------------------------------------------------------------


@pytest.mark.pure
def test_a_huge_shape_with_a_tiny_frame_is_refused_without_allocating():
    start = time.perf_counter()
    for shape in ([2**62, 2**62], [2**31] * 3, [10**30], [0, 2**62]):
        with pytest.raises(Unreadable):
            decode(["A", "<f8", shape, 0], [b"12345678"])
        with pytest.raises(Unreadable):
            decode(["A", "<f8", shape, 0], [b""])
        with pytest.raises(Unreadable, match="too big"):
            kinds_in(["A", "<f8", shape, 0])
    assert time.perf_counter() - start < 0.5


@pytest.mark.parametrize(
    "descriptor",
    [
        ["A", "|O", [1], 0],
        ["A", "<U4", [1], 0],
        ["A", "<f16", [1], 0],
        ["A", 8, [1], 0],
        ["A", "<f8", [-1], 0],
        ["A", "<f8", [True], 0],
        ["A", "<f8", [1.0], 0],
        ["A", "<f8", 1, 0],
        ["A", "<f8", [1] * (MAX_NDIM + 1), 0],
        ["A", "<f8", [1], 1],
        ["A", "<f8", [1], -1],
        ["A", "<f8", [1], True],
        ["A", "<f8", [1], "0"],
        ["A", "<f8", [1]],
        ["A", "<f8", [2], 0],
        ["L", ["A", "<f8", [1], 0], ["A", "<f8", [1], 0]],  # one frame, pointed to twice
        ["A", "|b1", [8], 0],  # bool bytes other than 0 / 1
        ["N", "<f8", b"1234"],
        ["N", "|b1", b"\x07"],
        ["B", 5],
        ["I", 7],
        ["I", b""],
        ["D", 1],
        ["D", 1, "a", 1, "b"],
        ["D", 1, "a", True, "b"],
        ["D", ["L"], 1],
        ["C", "", 0],
        ["C", 3, 0],
        ["C", "plain", 0],
        ["O", "arrow.Table", 0],
        ["Z", 1],
        [5, 1],
        [None],
        [],
        {"a": 1},
        (1, 2),
        ["L", (1, 2)],
        ["L", {1: 2}],
        ["L", 1 + 2j],
        object(),
    ],
    ids=lambda d: "object()" if type(d) is object else repr(d),  # the same id in every process (pytest-xdist)
)
@pytest.mark.pure
def test_malformed_descriptors_are_unreadable(descriptor):
    with pytest.raises(Unreadable):
        decode(descriptor, [b"12345678"])


@pytest.mark.pure
def test_kinds_in_refuses_what_decode_refuses():
    for bad in (["Z"], ["A", "|O", [1], 0], ["A", "<f8", [-1], 0], {"a": 1}, ["O", "plain", 0]):
        with pytest.raises(Unreadable):
            kinds_in(bad)


@pytest.mark.pure
def test_too_deep_and_too_many_are_unreadable():
    deep: list = ["L", 0]
    for _ in range(MAX_DEPTH):
        deep = ["L", deep]
    with pytest.raises(Unreadable, match="deep"):
        decode(deep, [])
    with pytest.raises(Unreadable, match="pieces"):
        decode(["L"] + [0] * MAX_NODES, [])


@pytest.mark.pure
def test_frames_that_are_not_buffers_are_unreadable():
    with pytest.raises(Unreadable, match="frame 0"):
        decode(["B", 0], [12])
    with pytest.raises(Unreadable):
        decode(["B", 0], b"not a list of frames")


@pytest.mark.parametrize("value", [None, [1, "two", 3.0], np.arange(5), {"a": np.zeros((2, 2))}])
@pytest.mark.pure
def test_cut_or_padded_written_forms_are_unreadable(value):
    data = dumps(value)
    for n in range(len(data)):
        with pytest.raises(Unreadable):
            loads(data[:n])
    with pytest.raises(Unreadable, match="more than its header"):
        loads(data + b"\x00")


@pytest.mark.parametrize("value", [None, [1, "two", 3.0], np.arange(5), {"a": np.zeros((2, 2))}, b"x" * 100_000])
@pytest.mark.pure
def test_the_start_of_a_written_form_is_judged_against_its_length(value):
    """``check_start`` passes the first bytes of every good written form at its true length
    and refuses it at any other (a sparse file declaring more than it holds), and refuses
    zeros, so a store refuses a planted blob before making room for it."""
    data = dumps(value)
    start = data[:START_BYTES]
    check_start(start, len(data))
    for wrong in (len(data) - 1, len(data) + 1, len(data) + 384 * 2**20):
        with pytest.raises(Unreadable):
            check_start(start, wrong)
    with pytest.raises(Unreadable, match="SMZ1"):
        check_start(bytes(START_BYTES), 384 * 2**20)
    with pytest.raises(Unreadable, match="header needs"):
        check_start(b"SMZ1" + (2**31).to_bytes(4, "little"), 4096)


@pytest.mark.pure
def test_a_header_longer_than_the_start_is_left_to_loads():
    value = ["x" * 60_000, "y" * 60_000]  # inline strings: a header longer than START_BYTES
    data = dumps(value)
    check_start(data[:START_BYTES], len(data) + 1)  # cannot be judged from the start alone
    with pytest.raises(Unreadable):
        loads(data + b"\x00")
    assert loads(data) == value


@pytest.mark.pure
def test_loads_refuses_what_is_not_bytes():
    with pytest.raises(Unreadable, match="`str`"):
        loads("SMZ1")
    with pytest.raises(Unreadable, match="SMZ1"):
        loads(b"PK\x03\x04 nothing here")


def written_forms_with_extensions_or_maps():
    import msgpack

    def form(header):
        raw = msgpack.packb(header, use_bin_type=True)
        return b"SMZ1" + len(raw).to_bytes(4, "little") + raw

    return [
        form([{"a": 1}, []]),
        form([msgpack.ExtType(5, b"x"), []]),
        form([1, [], 3]),
        form([1, [-1]]),
        form([1, "no"]),
        form({"d": 1}),
    ]


@pytest.mark.parametrize("data", written_forms_with_extensions_or_maps())
@pytest.mark.pure
def test_odd_headers_are_unreadable(data):
    with pytest.raises(Unreadable):
        loads(data)


def read_or_refuse(data):
    try:
        loads(data)
    except Unreadable:
        pass


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=200) | st.binary(max_size=200).map(lambda b: b"SMZ1" + b))
@pytest.mark.pure
def test_loads_of_random_bytes_gives_a_value_or_unreadable(data):
    read_or_refuse(data)


SAMPLE = dumps(
    [
        1,
        -(2**70),
        "x",
        b"y",
        (None, True, 1.5),
        {"k": np.arange(6, dtype=">i4").reshape(2, 3)},
        np.float16(3),
        np.array([True, False]),
    ]
)


@settings(max_examples=300, deadline=None)
@given(edits=st.lists(st.tuples(st.integers(0, len(SAMPLE) - 1), st.integers(0, 255)), min_size=1, max_size=4))
def test_loads_of_damaged_bytes_gives_a_value_or_unreadable(edits):
    data = bytearray(SAMPLE)
    for at, byte in edits:
        data[at] = byte
    read_or_refuse(bytes(data))
    read_or_refuse(data)


pieces = (
    st.sampled_from(["L", "T", "D", "I", "B", "A", "N", "C", "O", "Z", "<f8", "|b1", ">i2", "x.y"])
    | st.integers(-3, 40)
    | st.binary(max_size=9)
    | st.none()
    | st.floats()
)
descriptors = st.recursive(pieces, lambda inner: st.lists(inner, max_size=5), max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(descriptor=descriptors, frames=st.lists(st.binary(max_size=24), max_size=3))
def test_decode_of_any_descriptor_gives_a_value_or_unreadable(descriptor, frames):
    try:
        decode(descriptor, frames)
    except Unreadable:
        pass
    try:
        kinds_in(descriptor)
    except Unreadable:
        pass


# -- Arrow -------------------------------------------------------------------------------


@pytest.mark.parametrize("trip", ROUND_TRIPS)
@pytest.mark.pure
def test_arrow_record_batches_and_tables_cross(trip):
    pa = pytest.importorskip("pyarrow")
    batch = pa.record_batch({"n": [1, 2, None], "s": ["a", "bé", None], "f": [0.5, 1.5, 2.5]})
    back = trip(batch)
    assert type(back) is pa.RecordBatch and back.equals(batch)
    table = pa.Table.from_batches([batch, batch])
    back = trip(table)
    assert type(back) is pa.Table and back.equals(table)
    empty = pa.table({"x": pa.array([], pa.int64())})
    assert trip(empty).equals(empty)
    both = trip({"batch": batch, "table": table})
    assert both["batch"].equals(batch) and both["table"].equals(table)
    assert kinds_in(encode(batch)[0]) == {"arrow.RecordBatch"}
    assert kinds_in(encode(table)[0]) == {"arrow.Table"}
    assert {"arrow.RecordBatch", "arrow.Table"} <= set(readable_kinds())


@pytest.mark.pure
def test_arrow_junk_is_unreadable():
    pa = pytest.importorskip("pyarrow")
    with pytest.raises(Unreadable, match="arrow.Table"):
        decode(["C", "arrow.Table", 0], [b"not arrow at all"])
    table = pa.Table.from_batches([pa.record_batch({"n": [1]})] * 2)
    _, frames = encode(table)
    with pytest.raises(Unreadable, match="2 record batches"):
        decode(["C", "arrow.RecordBatch", 0], frames)
    _, frames = encode(pa.record_batch({"s": ["hello", "world"]}))
    raw = bytearray(frames[0])
    raw[raw.find(b"world")] = 0xFF  # no longer UTF-8: caught by full validation
    with pytest.raises(Unreadable):
        decode(["C", "arrow.RecordBatch", 0], [bytes(raw)])


@pytest.mark.pure
def test_other_arrow_values_are_unwritable():
    pa = pytest.importorskip("pyarrow")
    with pytest.raises(Unwritable, match="`Int64Array`"):
        encode(pa.array([1, 2]))


@pytest.mark.pure
def test_arrow_metadata_that_points_outside_itself_is_unreadable():
    pa = pytest.importorskip("pyarrow")
    _, frames = encode(pa.record_batch({"n": [1, 2, 3]}))
    raw = bytes(frames[0])
    for cut in (4, 12, 40, len(raw) // 2, len(raw) - 9):  # the last 8: the optional end mark
        with pytest.raises(Unreadable):
            decode(["C", "arrow.RecordBatch", 0], [raw[:cut]])
    rng = np.random.default_rng(5)
    for _ in range(200):  # flipped bytes: read, or refused with Unreadable, nothing else
        junk = bytearray(raw)
        junk[rng.integers(0, len(junk))] ^= int(rng.integers(1, 256))
        try:
            decode(["C", "arrow.RecordBatch", 0], [bytes(junk)])
        except Unreadable:
            pass


# -- check, then build: a reader that checks first reads each value once -------------------


@pytest.mark.pure
def test_check_then_build_reads_a_value_once_checked():
    value = {"a": np.arange(6).reshape(2, 3), "b": [1, "two", b"x" * 70_000], "c": np.float32(1.5)}
    descriptor, frames = encode(value)
    checked = codec_module.check(descriptor, frames)
    assert checked.kinds == {"plain", "numpy.ndarray", "numpy.generic"}
    assert checked.used == {0, 1}
    assert same(codec_module.build(checked), decode(descriptor, frames))
    assert "numpy.ndarray" in repr(checked)
    # the descriptor alone: its kinds and frames are known, and it cannot be built
    alone = codec_module.check(descriptor, None)
    assert alone.kinds == checked.kinds and alone.used == checked.used
    with pytest.raises(TypeError, match="with its frames"):
        codec_module.build(alone)
    with pytest.raises(TypeError):
        codec_module.build((descriptor, frames))
    # frames are held to what the descriptor says at check time, not at build time
    with pytest.raises(Unreadable, match="needs 48 bytes"):
        codec_module.check(descriptor, [frames[0][:8], frames[1]])
    with pytest.raises(Unreadable, match="frames are missing"):
        codec_module.check(descriptor, frames[:1])
