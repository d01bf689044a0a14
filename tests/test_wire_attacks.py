"""Attacks on the call's fast path (``short.express`` / ``short.written_express`` / ``short.head_of``).

The invariant held here: whatever ``express`` takes, the long way (``reading._read`` and
``_fill``) takes too and makes the very same message (same types and bits all the way
down); whatever the long way refuses, ``decode`` refuses with a ``ProtocolError`` carrying
the long way's own sentence; ``decode`` raises nothing else for a buffer. ``encode`` writes
the very bytes the long way writes (``writing._written``), and refuses, with the long way's
exception and sentence, every message built wrongly. ``checks.fitted`` refuses whatever the
``_work_rest`` it used to run refused. A header that arrives as a ``zmq.Frame`` (read from its
bytes up to 64 KiB, from its buffer past it), or in any other buffer, reads as the long way
reads the same bytes.
"""

from __future__ import annotations

import dataclasses
import math
import struct

import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from somatize.codec import build
from somatize.errors import ProtocolError
from somatize.fabric import sockets as fabric_sockets
from somatize.wire import Done, NodeSpec, Recipe, Work, decode, encode, limits, reading, short, with_recipe
from somatize.wire.checks import Bad, _work_rest, fitted
from somatize.wire.writing import _written

DIGEST = "sha256:" + "ab" * 32
SMALL = 64 << 10  # the largest header express reads


# -- helpers ---------------------------------------------------------------------------------


def same(a, b) -> bool:
    """Equal, of the same types all the way down; floats compared by their bits (NaN
    payloads, -0.0)."""
    if type(a) is not type(b):
        return False
    if dataclasses.is_dataclass(a):
        return all(same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if type(a) is float:
        return struct.pack(">d", a) == struct.pack(">d", b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=False))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return a == b


def long_way(frames):
    """``decode`` without any short way."""
    msg, checked = reading._read(frames, values=True)
    return msg if checked is None else reading._fill(msg, build(checked))


def outcome(fn, *args):
    """("ok", result) / ("refused", why) / ("raised", type) of ``fn(*args)``."""
    try:
        return ("ok", fn(*args))
    except ProtocolError as exc:
        return ("refused", exc.why)
    except Exception as exc:  # noqa: BLE001 - what it was is what is compared
        return ("raised", type(exc), str(exc))


def assert_read_as_the_long_way(frames) -> None:
    """The invariant on reading, for one message's frames."""
    head = frames[0]
    fast = short.express(head) if type(head) in (bytes, memoryview) else None
    taken = outcome(long_way, frames)
    got = outcome(decode, frames)
    if taken[0] == "ok":
        assert fast is None or same(fast, taken[1]), (fast, taken[1])
        assert got[0] == "ok" and same(got[1], taken[1]), (got, taken)
    elif taken[0] == "refused":
        assert fast is None, (fast, taken)
        assert got == taken, (got, taken)
    else:  # the long way's TypeError: frames that are no buffers
        assert taken[1] is TypeError, taken
        assert got[0] == "raised" and got[1] is TypeError, got


def assert_written_as_the_long_way(msg) -> None:
    """The invariant on writing: the same bytes, or the same exception and sentence."""
    fast = outcome(encode, msg)
    slow = outcome(_written, msg, type(msg))
    if slow[0] == "ok":
        assert fast[0] == "ok", fast
        assert [bytes(f) for f in fast[1]] == [bytes(f) for f in slow[1]]
    else:
        assert fast == slow, (fast, slow)
        assert short.written_express(msg) is None


# -- raw MessagePack, in every form it may take ----------------------------------------------


class Raw(bytes):
    """Bytes put in a header as they are (an item ``packb`` would not write)."""


def int_forms(n: int) -> list[bytes]:
    out = []
    if 0 <= n <= 0x7F:
        out.append(bytes([n]))
    if -32 <= n < 0:
        out.append(bytes([n & 0xFF]))
    for mark, size in ((0xCC, 1), (0xCD, 2), (0xCE, 4), (0xCF, 8)):
        if 0 <= n < 1 << (8 * size):
            out.append(bytes([mark]) + n.to_bytes(size, "big"))
    for mark, size in ((0xD0, 1), (0xD1, 2), (0xD2, 4), (0xD3, 8)):
        if -(1 << (8 * size - 1)) <= n < 1 << (8 * size - 1):
            out.append(bytes([mark]) + n.to_bytes(size, "big", signed=True))
    return out


def sized_forms(data: bytes, fix: int | None, marks: tuple[int, int, int]) -> list[bytes]:
    n, out = len(data), []
    if fix is not None and n < 32:
        out.append(bytes([fix | n]) + data)
    for mark, size in zip(marks, (1, 2, 4), strict=False):
        if n < 1 << (8 * size):
            out.append(bytes([mark]) + n.to_bytes(size, "big") + data)
    return out


def str_forms(data: bytes) -> list[bytes]:
    return sized_forms(data, 0xA0, (0xD9, 0xDA, 0xDB))


def bin_forms(data: bytes) -> list[bytes]:
    return sized_forms(data, None, (0xC4, 0xC5, 0xC6))


def forms(x) -> list[bytes]:
    """Every MessagePack encoding of ``x`` at its top (items inside as ``packb`` writes them)."""
    if isinstance(x, Raw):
        return [bytes(x)]
    if x is None:
        return [b"\xc0"]
    if x is True or x is False:
        return [b"\xc3" if x else b"\xc2"]
    if type(x) is int:  # one past MessagePack's ints: the codec's descriptor of it
        return int_forms(x) or forms(["I", x.to_bytes((x.bit_length() + 8) // 8, "big", signed=True)])
    if type(x) is float:
        out = [b"\xcb" + struct.pack(">d", x)]
        try:
            single = struct.pack(">f", x)
        except OverflowError:
            return out
        if math.isnan(x) or struct.unpack(">f", single)[0] == x:
            out.append(b"\xca" + single)
        return out
    if type(x) is str:
        return str_forms(x.encode("utf-8", "surrogatepass"))
    if type(x) is bytes:
        return bin_forms(x)
    if type(x) is list:
        body = b"".join(forms(v)[0] for v in x)
        return [
            *([bytes([0x90 | len(x)]) + body] if len(x) < 16 else []),
            b"\xdc" + len(x).to_bytes(2, "big") + body,
            b"\xdd" + len(x).to_bytes(4, "big") + body,
        ]
    if type(x) is dict:
        body = b"".join(forms(k)[0] + forms(v)[0] for k, v in x.items())
        return [
            *([bytes([0x80 | len(x)]) + body] if len(x) < 16 else []),
            b"\xde" + len(x).to_bytes(2, "big") + body,
            b"\xdf" + len(x).to_bytes(4, "big") + body,
        ]
    raise AssertionError(type(x))


def a_map(pairs, *, count: int | None = None, form: int = 0) -> bytes:
    """A map written pair by pair (keys and values as their first form, or Raw)."""
    n = len(pairs) if count is None else count
    heads = [*([bytes([0x80 | n])] if n < 16 else []), b"\xde" + n.to_bytes(2, "big"), b"\xdf" + n.to_bytes(4, "big")]
    return heads[form % len(heads)] + b"".join(forms(k)[0] + forms(v)[0] for k, v in pairs)


def work_pairs(value=5, **changes):
    p = {
        "v": limits.WIRE_VERSION,
        "t": "Work",
        "ref": 7,
        "input": value,
        "recipe": None,
        "keys": [],
        "placement": [],
        "memory": None,
        "watched": False,
        "recipe_digest": DIGEST,
    }
    p.update(changes)
    return list(p.items())


def done_pairs(value=5, **changes):
    p = {"v": limits.WIRE_VERSION, "t": "Done", "ref": 7, "output": value, "produced": [], "took_us": 3, "saw": []}
    p.update(changes)
    return list(p.items())


TS32 = Raw(b"\xd6\xff\x00\x00\x00\x05")  # a MessagePack timestamp (ext -1)
TS96_HUGE = Raw(b"\xc7\x0c\xff" + bytes(4) + (2**62).to_bytes(8, "big"))
EXT5 = Raw(b"\xd4\x05\x00")
BAD_UTF8 = Raw(b"\xa2\xff\xfe")
SURROGATE_UTF8 = Raw(b"\xa3\xed\xa0\x80")
OVERLONG_UTF8 = Raw(b"\xa2\xc0\x80")
DEEP = Raw(b"\x91" * 3000 + b"\xc0")
HUGE_ARRAY = Raw(b"\xdd\xff\xff\xff\xff")  # 4 G entries declared, none there
HUGE_MAP = Raw(b"\xdf\xff\xff\xff\xff")
HUGE_STR = Raw(b"\xdb\xff\xff\xff\xff")
HUGE_BIN = Raw(b"\xc6\xff\xff\xff\xff")
LIST_KEYED = Raw(b"\x81\x91\x01\x02")  # {[1]: 2}
FACT_TWICE = Raw(b"\x91\x82\xa1a\xa1b\xa1a\xa1c")  # [{"a": "b", "a": "c"}]

# -- reading: a table of hostile headers ------------------------------------------------------

_W = work_pairs
_D = done_pairs
HOSTILE_HEADERS = {
    # the variant's own fields, as other types
    "v True": a_map(_W(v=True)),
    "v 9.0": a_map(_W(v=9.0)),
    "v '9'": a_map(_W(v="9")),
    "v as uint64": a_map(_W(v=Raw(b"\xcf" + limits.WIRE_VERSION.to_bytes(8, "big")))),
    "v as int8": a_map(_W(v=Raw(b"\xd0" + bytes([limits.WIRE_VERSION])))),
    "v 8": a_map(_D(v=limits.WIRE_VERSION - 1)),
    "v 2**64-1": a_map(_D(v=2**64 - 1)),
    "t bytes": a_map(_W(t=b"Work")),
    "t lower": a_map(_W(t="work")),
    "t nul": a_map(_W(t="Work\x00")),
    "t Done with Work's fields": a_map(_W(t="Done")),
    "t Work with Done's fields": a_map(_D(t="Work")),
    "t str8": a_map(_W(t=Raw(b"\xd9\x04Work"))),
    # refs and durations
    "ref -1 as int64": a_map(_W(ref=Raw(b"\xd3" + (-1).to_bytes(8, "big", signed=True)))),
    "ref -1 fixint": a_map(_D(ref=-1)),
    "ref 2**63": a_map(_W(ref=2**63)),
    "ref 2**64-1": a_map(_D(ref=2**64 - 1)),
    "ref 2**63-1": a_map(_W(ref=2**63 - 1)),
    "ref as uint64 0": a_map(_W(ref=Raw(b"\xcf" + bytes(8)))),
    "ref True": a_map(_W(ref=True)),
    "ref 1.0": a_map(_D(ref=1.0)),
    "ref float32 1.0": a_map(_D(ref=Raw(b"\xca\x3f\x80\x00\x00"))),
    "took_us 2**63": a_map(_D(took_us=2**63)),
    "took_us 2**64-1": a_map(_D(took_us=2**64 - 1)),
    "took_us 2**63-1": a_map(_D(took_us=2**63 - 1)),
    "took_us True": a_map(_D(took_us=True)),
    "took_us nil": a_map(_D(took_us=None)),
    # the value
    "value float32": a_map(_W(Raw(b"\xca\x3f\x80\x00\x00"))),
    "value float32 sNaN": a_map(_D(Raw(b"\xca\x7f\x80\x00\x01"))),
    "value float64 NaN payload": a_map(_D(Raw(b"\xcb\x7f\xf0\x00\x00\x00\x00\x00\x01"))),
    "value -0.0": a_map(_W(-0.0)),
    "value -2**63": a_map(_W(-(2**63))),
    "value 2**64-1": a_map(_D(2**64 - 1)),
    "value -1 as int64": a_map(_D(Raw(b"\xd3" + (-1).to_bytes(8, "big", signed=True)))),
    "value timestamp": a_map(_W(TS32)),
    "value timestamp out of range": a_map(_D(TS96_HUGE)),
    "value ext 5": a_map(_W(EXT5)),
    "value invalid utf-8": a_map(_W(BAD_UTF8)),
    "value surrogate utf-8": a_map(_D(SURROGATE_UTF8)),
    "value overlong utf-8": a_map(_D(OVERLONG_UTF8)),
    "value str8 short": a_map(_W(Raw(b"\xd9\x01x"))),
    "value bin": a_map(_W(b"\x00\xff")),
    "value list": a_map(_W([1])),
    "value map": a_map(_D({"a": 1})),
    "value codec tuple": a_map(_W(["T", 1])),
    "value codec int": a_map(_D(["I", b"\x01"])),
    "value codec frame": a_map(_D(["B", 0])),
    "value empty list": a_map(_D([])),
    "value keyed by a list": a_map(_W(LIST_KEYED)),
    "value nested deep": a_map(_W(DEEP)),
    "value declares 4G entries": a_map(_W(HUGE_ARRAY)),
    "value declares 4G pairs": a_map(_D(HUGE_MAP)),
    "value declares a 4G str": a_map(_W(HUGE_STR)),
    "value declares a 4G bin": a_map(_D(HUGE_BIN)),
    # the other fields
    "recipe False": a_map(_W(recipe=False)),
    "recipe {}": a_map(_W(recipe={})),
    "recipe []": a_map(_W(recipe=[])),
    "keys {}": a_map(_W(keys={})),
    "keys nil": a_map(_W(keys=None)),
    "keys one": a_map(_W(keys=[[0, DIGEST]])),
    "keys bad pair": a_map(_W(keys=[[0]])),
    "keys deep": a_map(_W(keys=DEEP)),
    "keys timestamp": a_map(_W(keys=[TS32])),
    "placement one": a_map(_W(placement=[[0, "cpu"]])),
    "placement map": a_map(_W(placement={})),
    "memory path": a_map(_W(memory="/dev/shm/x")),
    "memory empty": a_map(_W(memory="")),
    "memory int": a_map(_W(memory=3)),
    "memory bin": a_map(_W(memory=b"/x")),
    "memory long": a_map(_W(memory="x" * (limits.MAX_PATH + 1))),
    "watched 1": a_map(_W(watched=1)),
    "watched nil": a_map(_W(watched=None)),
    "digest upper": a_map(_W(recipe_digest=DIGEST.upper())),
    "digest newline": a_map(_W(recipe_digest=DIGEST + "\n")),
    "digest short": a_map(_W(recipe_digest=DIGEST[:-1])),
    "digest long": a_map(_W(recipe_digest=DIGEST + "0" * 2000)),
    "digest empty": a_map(_W(recipe_digest="")),
    "digest bin": a_map(_W(recipe_digest=DIGEST.encode())),
    "digest nil": a_map(_W(recipe_digest=None)),
    "digest not hex": a_map(_W(recipe_digest="sha256:" + "g" * 64)),
    "produced one": a_map(_D(produced=[[0, 1]])),
    "produced map": a_map(_D(produced={})),
    "saw a fact": a_map(_D(saw=[{"fact": "ran"}])),
    "saw a fact with a key twice": a_map(_D(saw=FACT_TWICE)),
    "saw a fact of a number": a_map(_D(saw=[{"a": 1}])),
    "saw a map": a_map(_D(saw={})),
    "saw nil": a_map(_D(saw=None)),
    "saw deep": a_map(_D(saw=DEEP)),
    "saw 65 facts": a_map(_D(saw=[{}] * 65)),
    # the map itself
    "fields reversed": a_map(list(reversed(_W()))),
    "fields shuffled": a_map(_D()[3:] + _D()[:3]),
    "map16": a_map(_W(), form=1),
    "map32": a_map(_D(), form=2),
    "keys str8": b"\x8a" + b"".join(str_forms(k.encode())[1] + forms(v)[0] for k, v in _W()),
    "keys str32": b"\x87" + b"".join(str_forms(k.encode())[-1] + forms(v)[0] for k, v in _D()),
    "keys bin": b"\x8a" + b"".join(bin_forms(k.encode())[0] + forms(v)[0] for k, v in _W()),
    "one key bin": b"\x87"
    + b"".join((bin_forms(k.encode())[0] if k == "saw" else forms(k)[0]) + forms(v)[0] for k, v in _D()),
    "a key nil": b"\x8a" + b"".join(forms(None if k == "memory" else k)[0] + forms(v)[0] for k, v in _W()),
    "a key int": b"\x87" + b"".join(forms(1 if k == "produced" else k)[0] + forms(v)[0] for k, v in _D()),
    "ref twice, digest missing": a_map(_W()[:-1] + [("ref", 7)]),
    "memory twice, recipe missing": a_map([p for p in _W() if p[0] != "recipe"] + [("memory", None)]),
    "v twice, t missing": a_map([p for p in _D() if p[0] != "t"] + [("v", limits.WIRE_VERSION)]),
    "saw twice, produced missing": a_map([p for p in _D() if p[0] != "produced"] + [("saw", [])]),
    "an extra field, one missing": a_map(_D()[:-1] + [("extra", [])]),
    "an extra field": a_map(_D() + [("extra", 1)]),
    "a field missing": a_map(_W()[:-1]),
    "a key with a trailing space": a_map([(k + (" " if k == "ref" else ""), v) for k, v in _W()]),
    "count says one more": a_map(_D(), count=8),
    "count says one less": a_map(_D(), count=6),
    "trailing nil": a_map(_W()) + b"\xc0",
    "trailing junk": a_map(_D()) + b"\xff\xff",
    "cut short": a_map(_W())[:-3],
    "Work's count on Done's fields": a_map(_D() + [("a", 1), ("b", 2), ("c", 3)]),
    "empty": b"",
    "one byte": b"\x8a",
    "an array": b"\x9a" + a_map(_W())[1:],
}


@pytest.mark.parametrize("name", list(HOSTILE_HEADERS))
@pytest.mark.pure
def test_a_hostile_header_is_read_as_the_long_way_reads_it(name):
    """Every hostile call header: the short way takes only what the long way takes, as the
    very same message; anything else is refused with the long way's sentence."""
    head = HOSTILE_HEADERS[name]
    for frame in (head, memoryview(head), bytearray(head), zmq.Frame(head)):
        assert_read_as_the_long_way([frame])
    assert_read_as_the_long_way((head,))


def _one_twice_one_gone():
    for pairs in (work_pairs(), done_pairs()):
        for gone in range(len(pairs)):
            for twice in range(len(pairs)):
                if gone != twice:
                    kept = [p for i, p in enumerate(pairs) if i != gone]
                    yield pytest.param(
                        a_map(kept + [pairs[twice]]), id=f"{pairs[1][1]}-{pairs[gone][0]}-gone-{pairs[twice][0]}-twice"
                    )


@pytest.mark.parametrize("head", list(_one_twice_one_gone()))
@pytest.mark.pure
def test_a_header_with_as_many_entries_as_fields_but_one_twice_is_refused_as_the_long_way(head):
    """msgspec keeps the last of a key given twice: as many entries as fields, one of them
    twice, is refused only because another field is then missing (none may have a default)."""
    assert short.express(head) is None
    assert_read_as_the_long_way([head])


@pytest.mark.parametrize(
    "name",
    [
        "v as uint64",
        "v as int8",
        "t str8",
        "ref as uint64 0",
        "value float32",
        "value float32 sNaN",
        "value float64 NaN payload",
        "value -0.0",
        "value -1 as int64",
        "fields reversed",
        "fields shuffled",
        "keys str8",
        "keys str32",
        "took_us 2**63-1",
        "value str8 short",
    ],
)
@pytest.mark.pure
def test_the_odd_headers_the_short_way_takes_are_the_long_ways_messages(name):
    """The unusual forms that msgspec does take (so the table above exercised it): each
    one the very message, bit for bit, that the long way builds."""
    head = HOSTILE_HEADERS[name]
    fast = short.express(head)
    assert fast is not None, name
    assert same(fast, long_way([head]))


# -- reading: headers built field by field, at random -----------------------------------------

_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from(
        [0, 1, 127, 128, 255, 256, -1, -32, -33, -128, -129, 2**31, 2**32, 2**63 - 1, 2**63, 2**64 - 1, -(2**63)]
    ),
    st.integers(-(2**64), 2**65),
    st.floats(width=64),
    st.floats(width=32),
    st.sampled_from([float("nan"), -0.0, float("inf"), struct.unpack(">d", bytes.fromhex("7ff0000000000001"))[0]]),
    st.text(max_size=40),
    st.binary(max_size=80),
)
_HOSTILE_VALUES = [
    True,
    False,
    None,
    0,
    1,
    -1,
    9,
    2**63,
    2**64 - 1,
    -(2**63),
    1.0,
    float("nan"),
    "",
    "Work",
    "Done",
    "cpu",
    "/x",
    DIGEST,
    DIGEST + "\n",
    DIGEST.upper(),
    b"",
    b"Work",
    DIGEST.encode(),
    [],
    {},
    [[0, DIGEST]],
    [[0, "cpu"]],
    [[0, 1]],
    [[0]],
    [{}],
    [{"a": "b"}],
    [{"a": 1}],
    {"a": 1},
    ["T"],
    ["L", 1],
    ["B", 0],
    TS32,
    TS96_HUGE,
    EXT5,
    BAD_UTF8,
    SURROGATE_UTF8,
    OVERLONG_UTF8,
    DEEP,
    HUGE_ARRAY,
    HUGE_MAP,
    HUGE_STR,
    LIST_KEYED,
    FACT_TWICE,
]


@st.composite
def call_headers(draw) -> bytes:
    which = draw(st.sampled_from(["Work", "Done"]))
    value = draw(_SCALARS)
    fields = dict(
        work_pairs(value, watched=draw(st.booleans()))
        if which == "Work"
        else done_pairs(value, took_us=draw(st.sampled_from([0, 3, 2**63 - 1])))
    )
    fields["ref"] = draw(st.sampled_from([0, 7, 2**32, 2**63 - 1]))
    for name in draw(st.lists(st.sampled_from([*fields, "extra"]), max_size=2)):
        fields[name] = draw(st.sampled_from(_HOSTILE_VALUES))
    pairs = list(fields.items())
    layout = draw(st.sampled_from(["as is"] * 4 + ["shuffled", "one twice", "one twice, one gone", "one gone"]))
    if layout == "shuffled":
        pairs = draw(st.permutations(pairs))
    elif layout != "as is":
        at = draw(st.integers(0, len(pairs) - 1))
        if "twice" in layout:
            pairs.append(pairs[at])
        if "gone" in layout:
            del pairs[draw(st.integers(0, len(pairs) - 2))]
    out = []
    for key, value in pairs:
        key_forms = forms(key) + bin_forms(key.encode())  # a key as bin: the long way refuses it
        k = draw(st.integers(0, len(key_forms) - 1 if draw(st.integers(0, 9)) == 0 else len(key_forms) - 2))
        v_forms = forms(value)
        out.append(key_forms[k] + v_forms[draw(st.integers(0, len(v_forms) - 1))])
    n = len(pairs) + draw(st.sampled_from([0] * 8 + [-1, 1]))
    heads = [*([bytes([0x80 | n])] if n < 16 else []), b"\xde" + n.to_bytes(2, "big"), b"\xdf" + n.to_bytes(4, "big")]
    head = heads[draw(st.sampled_from([0] * 6 + [1, 2])) % len(heads)] + b"".join(out)
    return head + draw(st.sampled_from([b""] * 9 + [b"\xc0"]))


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(call_headers())
def test_random_call_headers_are_read_as_the_long_way_reads_them(head):
    assert_read_as_the_long_way([head])


# -- reading: sizes and frames ---------------------------------------------------------------


def _done_header_of(size: int) -> bytes:
    """A Done's header of exactly ``size`` bytes, its output bytes."""
    for n in range(size - 60, size):
        head = bytes(_written(Done(7, b"x" * n, {}, 3, ()), Done)[0])
        if len(head) == size:
            return head
    raise AssertionError(size)


@pytest.mark.parametrize("size", [SMALL - 1, SMALL, SMALL + 1, SMALL + 9])
@pytest.mark.pure
def test_a_header_near_64_kib_is_read_as_the_long_way_reads_it(size):
    head = _done_header_of(size)
    assert_read_as_the_long_way([head])
    assert (short.express(head) is not None) == (size <= SMALL)


@pytest.mark.parametrize(
    "kind",
    [
        "memoryview cast I",
        "memoryview cast b",
        "memoryview cast c",
        "bytearray",
        "numpy",
        "zmq.Frame",
        "tuple",
        "readonly memoryview",
        "bytes subclass",
    ],
)
@pytest.mark.pure
def test_a_call_in_any_buffer_is_read_as_the_long_way_reads_it(kind):
    for msg in (Work(7, None, 5, {}, {}, None, False, DIGEST), Done(7, "x", {}, 3, ())):
        head = bytes(encode(msg)[0])
        head += b"\xc0" * ((-len(head)) % 4)  # extra items after the map: both refuse them
        for h in (head, bytes(encode(msg)[0])):
            if kind.startswith("memoryview cast"):
                if len(h) % 4:
                    continue
                frames = [memoryview(h).cast(kind[-1])]
            elif kind == "bytearray":
                frames = [bytearray(h)]
            elif kind == "numpy":
                frames = [np.frombuffer(h, np.uint8)]
            elif kind == "zmq.Frame":
                frames = [zmq.Frame(h)]
            elif kind == "tuple":
                frames = (h,)
            elif kind == "readonly memoryview":
                frames = [memoryview(h)]
            else:
                frames = [type("B", (bytes,), {})(h)]
            assert_read_as_the_long_way(frames)


def _work_head() -> bytes:
    return bytes(encode(Work(7, None, 5, {}, {}, None, False, DIGEST))[0])


@pytest.mark.pure
def test_a_call_in_a_strided_memoryview_is_read_as_the_long_way_reads_it():
    """msgspec raises BufferError on a view that is not contiguous: the short way hands it on."""
    head = _work_head()
    strided = memoryview(bytes(b for c in head for b in (c, 0)))[::2]  # 1-D, format B, not contiguous
    assert_read_as_the_long_way([strided])


@pytest.mark.pure
def test_a_zero_dimensional_memoryview_is_refused_not_raised():
    """A 0-dim view has no length and no first byte: refused as the long way refuses it."""
    assert_read_as_the_long_way([memoryview(np.array(0x8A, np.uint8))])


@pytest.mark.pure
def test_a_call_in_a_two_dimensional_memoryview_is_read_as_the_long_way_reads_it():
    """Indexing a 2-D view raises NotImplementedError: neither short way looks at one."""
    head = _work_head()
    head += b"" if len(head) % 2 == 0 else b"\x00"
    frames = [memoryview(head).cast("B", shape=[len(head) // 2, 2])]
    assert_read_as_the_long_way(frames)


# -- reading and writing with a limit lowered (limits.py: "a test can lower one and see both
#    sides follow") -------------------------------------------------------------------------


_CALLS = (Work(7, None, 5, {}, {}, None, False, DIGEST), Done(7, 5, {}, 3, ()))
_LOWERED = {"MAX_HEADER": 100, "MAX_ITEMS": 5, "MAX_TOTAL": 100, "MAX_NAME": 10, "MAX_REF": 5}


@pytest.mark.parametrize("name", list(_LOWERED))
@pytest.mark.pure
def test_a_lower_limit_holds_for_a_calls_header_read(monkeypatch, name):
    """A limit lowered after import (as `limits` allows) holds on the short way in too."""
    for msg in _CALLS:
        frames = [bytes(f) for f in encode(msg)]
        monkeypatch.setattr(limits, name, _LOWERED[name])
        assert outcome(long_way, frames)[0] == "refused" or msg is _CALLS[1]  # a Done has no name, is small
        assert_read_as_the_long_way(frames)
        monkeypatch.undo()


@pytest.mark.parametrize("name", list(_LOWERED))
@pytest.mark.pure
def test_a_lower_limit_holds_for_a_call_written(monkeypatch, name):
    """...and on the short way out: a call over a lowered limit is refused as the long way refuses it."""
    monkeypatch.setattr(limits, name, _LOWERED[name])
    assert outcome(_written, _CALLS[0], Work)[0] == "raised"
    for msg in _CALLS:
        assert_written_as_the_long_way(msg)


# -- writing: messages built wrongly, and values at the edges ---------------------------------


class Str(str):
    pass


class Int(int):
    pass


class Float(float):
    pass


class Bytes(bytes):
    pass


class Dict(dict):
    pass


def _recipe() -> Recipe:
    return Recipe(
        (NodeSpec("a", False, "project", "m:A"), NodeSpec("b", True, "network", DIGEST)),
        ("seq", (("step", 0), ("step", 1))),
    )


def _wrong_works() -> list[Work]:
    w = Work(7, None, 5, {}, {}, None, False, DIGEST)
    r = dataclasses.replace
    return [
        r(w, ref=True),
        r(w, ref=Int(7)),
        r(w, ref=-1),
        r(w, ref=2**63),
        r(w, ref=7.0),
        r(w, ref=np.int64(7)),
        r(w, ref="7"),
        r(w, ref=None),
        r(w, input=Str("x")),
        r(w, input=Int(5)),
        r(w, input=Float(1.5)),
        r(w, input=Bytes(b"x")),
        r(w, input="\ud800"),
        r(w, input="x" * (70 << 10)),
        r(w, input="é" * 10),
        r(w, input=2**64),
        r(w, input=-(2**63) - 1),
        r(w, input=np.float64(1.0)),
        r(w, input=np.bool_(True)),
        r(w, input=b"x" * (64 << 10)),
        r(w, input=b"x" * ((64 << 10) + 1)),
        r(w, input=bytearray(b"x")),
        r(w, input=memoryview(b"x")),
        r(w, input=[1]),
        r(w, input=(1,)),
        r(w, input={}),
        r(w, input=object()),
        r(w, recipe=_recipe()),
        r(w, recipe=0),
        r(w, recipe=False),
        r(w, recipe_digest=DIGEST + "\n"),
        r(w, recipe_digest=DIGEST.upper()),
        r(w, recipe_digest=DIGEST.encode()),
        r(w, recipe_digest=Str(DIGEST)),
        r(w, recipe_digest=""),
        r(w, recipe_digest=None),
        r(w, recipe_digest=DIGEST + "0" * 2000),
        r(w, recipe_digest="sha256:" + "ab" * 31 + "a\ud800"),
        r(w, keys=[]),
        r(w, keys=None),
        r(w, keys=Dict()),
        r(w, keys={0: DIGEST}),
        r(w, keys={0: "bad"}),
        r(w, keys={True: DIGEST}),
        r(w, keys={-1: DIGEST}),
        r(w, placement=[]),
        r(w, placement=()),
        r(w, placement=Dict()),
        r(w, placement={0: "cpu"}),
        r(w, placement={0: "x" * 101}),
        r(w, memory=""),
        r(w, memory="/x"),
        r(w, memory=3),
        r(w, memory=b"/x"),
        r(w, memory="x" * 5000),
        r(w, memory="\ud800"),
        r(w, memory=Str("/x")),
        r(w, watched=1),
        r(w, watched=0),
        r(w, watched=None),
        r(w, watched=np.bool_(True)),
        r(w, watched="yes"),
    ]


def _wrong_dones() -> list[Done]:
    d = Done(7, 5, {}, 3, ())
    r = dataclasses.replace
    return [
        r(d, ref=True),
        r(d, ref=Int(7)),
        r(d, ref=-1),
        r(d, ref=2**63),
        r(d, ref=7.0),
        r(d, ref=None),
        r(d, output=Str("x")),
        r(d, output=Int(5)),
        r(d, output="\udfff"),
        r(d, output="x" * (1 << 20)),
        r(d, output="x" * (limits.MAX_HEADER + 1)),
        r(d, output=2**64),
        r(d, output=Bytes(b"x")),
        r(d, output=Float(2.0)),
        r(d, output=object()),
        r(d, took_us=True),
        r(d, took_us=False),
        r(d, took_us=-1),
        r(d, took_us=2**63),
        r(d, took_us=2**63 - 1),
        r(d, took_us=1.0),
        r(d, took_us=Int(3)),
        r(d, took_us=None),
        r(d, took_us=np.int64(3)),
        r(d, produced=[]),
        r(d, produced=None),
        r(d, produced=Dict()),
        r(d, produced={0: 1}),
        r(d, produced={-1: 1}),
        r(d, produced={True: 1}),
        r(d, saw=[]),
        r(d, saw=None),
        r(d, saw=({"fact": "ran"},)),
        r(d, saw=({"a": 1},)),
        r(d, saw=({1: "a"},)),
        r(d, saw=({"a": "\ud800"},)),
        r(d, saw=({},) * 65),
        r(d, saw=type("T", (tuple,), {})()),
    ]


@pytest.mark.parametrize("msg", _wrong_works() + _wrong_dones(), ids=lambda m: f"{type(m).__name__}")
@pytest.mark.pure
def test_a_call_built_wrongly_is_written_or_refused_as_the_long_way_does(msg):
    assert_written_as_the_long_way(msg)


_EDGE_SCALARS = [
    None,
    True,
    False,
    0,
    -1,
    -32,
    -33,
    127,
    128,
    255,
    256,
    65535,
    65536,
    2**32 - 1,
    2**32,
    2**63 - 1,
    2**63,
    2**64 - 1,
    -(2**31),
    -(2**31) - 1,
    -(2**63),
    0.0,
    -0.0,
    float("inf"),
    float("-inf"),
    float("nan"),
    struct.unpack(">d", bytes.fromhex("fff0000000000001"))[0],
    struct.unpack(">d", bytes.fromhex("7ff8dead00000000"))[0],
    5e-324,
    "",
    "a" * 31,
    "a" * 32,
    "a" * 255,
    "a" * 256,
    "a" * 65535,
    "a" * 65536,
    "a\x00b",
    b"",
    b"x" * 255,
    b"x" * 256,
    b"x" * 65535,
    b"x" * 65536,
]


@pytest.mark.parametrize("value", _EDGE_SCALARS, ids=lambda v: repr(v)[:20])
@pytest.mark.pure
def test_a_call_of_an_edge_scalar_is_written_as_the_long_way_and_read_back_bit_for_bit(value):
    for msg in (Work(2**63 - 1, None, value, {}, {}, None, True, DIGEST), Done(0, value, {}, 2**63 - 1, ())):
        assert short.written_express(msg) is not None
        assert_written_as_the_long_way(msg)
        frames = encode(msg)
        assert same(decode(frames), msg)
        assert_read_as_the_long_way([bytes(frames[0])])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    value=st.one_of(_SCALARS, st.text(alphabet=st.characters(), max_size=20)),
    ref=st.one_of(st.integers(-2, 2**64), st.sampled_from([True, False, 2**63 - 1, 2**63])),
    took=st.one_of(st.integers(-2, 2**64), st.sampled_from([True, 2**63 - 1, 2**63])),
    watched=st.sampled_from([True, False, 1, None]),
)
def test_random_calls_are_written_as_the_long_way_writes_them(value, ref, took, watched):
    assert_written_as_the_long_way(Work(ref, None, value, {}, {}, None, watched, DIGEST))
    assert_written_as_the_long_way(Done(ref, value, {}, took, ()))


# -- fitted: everything _work_rest refused before is refused still ----------------------------


def _fitted_before(m: Work, recipe: Recipe) -> Work:
    """``checks.fitted`` as it was (HEAD~3): ``_work_rest`` always, then a new Work."""
    _work_rest(m, len(recipe.nodes))
    return Work(m.ref, recipe, m.input, m.keys, m.placement, m.memory, m.watched)


@pytest.mark.parametrize(
    "msg",
    _wrong_works()[38:]
    + [
        Work(7, None, 5, {}, {}, None, False, DIGEST),
        Work(7, None, 5, {1: DIGEST}, {1: "cuda:0"}, "/m", True, DIGEST),
        Work(7, None, 5, {2: DIGEST}, {}, None, True, DIGEST),
        Work(7, None, 5, {}, {2: "cpu"}, None, True, DIGEST),
        Work(7, None, 5, Dict({5: DIGEST}), {}, None, True, DIGEST),
    ],
    ids=lambda m: "Work",
)
@pytest.mark.pure
def test_fitted_refuses_what_it_refused_before(msg):
    recipe = _recipe()
    before = outcome(_fitted_before, msg, recipe)
    now = outcome(fitted, msg, recipe)
    if before[0] == "ok":
        assert now[0] == "ok" and same(now[1], before[1]) and now[1] == before[1]
        assert same(with_recipe(msg, recipe), before[1])
    else:
        assert before[1] is Bad and now == before, (now, before)
        with pytest.raises(ProtocolError) as info:
            with_recipe(msg, recipe)
        assert info.value.why == before[2]


# -- reading: a header arriving as a zmq.Frame, at and past 64 KiB, and in every buffer ---------


_DIGEST = "sha256:" + "0123456789abcdef" * 4


def _read(frames):
    """What ``decode`` makes of ``frames``: the message's class and repr (a NaN, a -0.0 told
    apart), or that it was refused (ProtocolError), with its sentence."""
    try:
        msg = decode(frames)
    except ProtocolError as exc:
        return ("refused", str(exc))
    return (type(msg).__name__, repr(msg))


def _long_way(frames):
    """The same, read the long way: ``decode`` takes its one-look path only for a list of one."""
    return _read(tuple(frames))


@pytest.fixture
def pair():
    """Two connected PAIR sockets: frames sent on one arrive on the other as ``zmq.Frame``s."""
    ctx = zmq.Context.instance()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    url = fabric_sockets.unique_inproc("hot-path-attacks")  # a name never used before
    a.bind(url)
    b.connect(url)
    yield a, b
    a.close(0)
    b.close(0)


def _sized(kind: str, size: int) -> bytes:
    """A header of exactly ``size`` bytes: a Work by digest or a Done, of one bytes or str value."""

    def write(n: int) -> bytes:
        value = b"x" * n if kind.endswith("bytes") else "a" * n
        if kind.startswith("Work"):
            frames = encode(Work(7, None, value, watched=False, recipe_digest=_DIGEST))
        else:
            frames = encode(Done(7, value, {}, 3))
        assert len(frames) == 1, "the value went to a frame of its own"
        return bytes(frames[0])

    n = size - (len(write(60_000)) - 60_000)
    header = write(n)
    assert len(header) == size, (len(header), size)
    return header


SIZES = [(64 << 10) - 1, 64 << 10, (64 << 10) + 1]


@pytest.mark.parametrize("kind", ["Work bytes", "Work str", "Done bytes", "Done str"])
@pytest.mark.parametrize("size", SIZES, ids=["64 KiB - 1", "64 KiB", "64 KiB + 1"])
@pytest.mark.parametrize("limit", [None, 64 << 10], ids=["limits as they are", "MAX_HEADER lowered to 64 KiB"])
def test_a_header_at_and_past_64_kib_in_a_frame_reads_as_the_long_way_reads_it(pair, monkeypatch, kind, size, limit):
    """Attack on ``short.head_of``: a header of 64 KiB - 1, 64 KiB and 64 KiB + 1 bytes,
    arriving as a ``zmq.Frame`` over a real socket (read from its bytes up to 64 KiB, from
    its buffer past it), with the header limit as it is and lowered to exactly 64 KiB. What
    ``decode`` gives has to be what the long way gives, or both refuse; the worker's express
    way in gives the same message or declines."""
    header = _sized(kind, size)  # written first: the writer holds to the limit too
    if limit is not None:
        monkeypatch.setattr(limits, "MAX_HEADER", limit)
    a, b = pair
    a.send(header, copy=False)
    (frame,) = b.recv_multipart(copy=False)
    assert type(frame) is zmq.Frame and len(frame) == size
    fast, slow = _read([frame]), _long_way([header])
    assert fast == slow, (fast[0], slow[0])
    assert fast[0] == ("refused" if limit is not None and size > limit else kind.split()[0])
    head = short.head_of(frame)
    assert (type(head) is bytes) == (size <= 64 << 10)
    express = short.express(head)
    if express is not None:
        assert (type(express).__name__, repr(express)) == slow
    for other in (bytes(frame), memoryview(header), frame.buffer):  # the other forms of the same bytes
        assert _read([other]) == slow


def _forms(data: bytes):
    """``data`` as every buffer a frame may be: bytes, a zmq.Frame, a bytearray, views of one
    byte and of wider items, a 2-D view, a strided view (whose bytes are every other one)."""
    yield "bytes", data, data
    yield "frame", zmq.Frame(data), data
    yield "bytearray", bytearray(data), data
    yield "view", memoryview(data), data
    for fmt, width in (("H", 2), ("I", 4), ("Q", 8)):
        cut = data[: len(data) // width * width]
        if cut:
            yield f"view of {fmt}", memoryview(cut).cast(fmt), cut
    if len(data) >= 2:
        even = data[: len(data) // 2 * 2]
        yield "2-D view", memoryview(even).cast("B", (2, len(even) // 2)), even
        yield "strided view", memoryview(data)[::2], data[::2]


_HEADERS = [
    bytes(encode(Work(3, None, v, watched=w, recipe_digest=_DIGEST))[0])
    for v, w in ((5, False), (2.5, True), (b"xy", False), ("s", False), (None, False))
]


_HEADERS += [bytes(encode(Done(4, v, {}, 9))[0]) for v in (1, -0.0, float("nan"), b"", "t")]


@st.composite
def _mutated(draw):
    data = bytearray(draw(st.sampled_from(_HEADERS)))
    for _ in range(draw(st.integers(0, 3))):
        how = draw(st.sampled_from(["flip", "cut", "grow", "swap"]))
        if how == "flip" and data:
            i = draw(st.integers(0, len(data) - 1))
            data[i] = draw(st.integers(0, 255))
        elif how == "cut" and data:
            del data[draw(st.integers(0, len(data) - 1)) :]
        elif how == "grow":
            data += draw(st.binary(max_size=8))
        elif how == "swap" and len(data) > 2:
            i = draw(st.integers(0, len(data) - 2))
            data[i], data[i + 1] = data[i + 1], data[i]
    return bytes(data)


@settings(max_examples=400, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(_mutated())
def test_any_header_in_any_buffer_reads_as_the_long_way_reads_the_same_bytes(data):
    """Attack: headers of Works and Dones, mutated (bytes flipped, cut, grown, swapped), in
    every form a frame may take (a zmq.Frame, bytes, a bytearray, memoryviews of one byte,
    of 2, 4 and 8 byte items, 2-D, strided). ``decode`` of the one-frame list (the one-look
    path, through ``head_of``) has to give what the long way gives for the same object, and
    for a view of single bytes what it gives for its bytes: the same message or both a
    ProtocolError, never another message."""
    for name, form, content in _forms(data):
        fast = _read([form])
        assert fast == _long_way([form]), name
        if name in ("bytes", "frame", "bytearray", "view"):
            assert fast == _long_way([content]), name
        express = short.express(short.head_of(form))
        if express is not None:
            assert (type(express).__name__, repr(express)) == _long_way([content]), name


def test_a_message_of_many_frames_arriving_as_frames_reads_as_its_bytes(pair):
    """Attack: messages of several frames (a Work whose input is an array, a Done whose output
    is one) arrive as ``zmq.Frame``s: frame 0 is a header but the message is not one frame,
    so the one-look path must not take it; read as the bytes are."""
    a, b = pair
    for msg in (
        Work(1, None, np.arange(5000.0), watched=False, recipe_digest=_DIGEST),
        Done(2, np.ones((3, 70_000), dtype=np.uint8), {}, 5),
    ):
        frames = [bytes(f) for f in encode(msg)]
        assert len(frames) > 1
        a.send_multipart(frames, copy=False)
        got = b.recv_multipart(copy=False)
        read, expected = decode(got), decode(tuple(frames))
        assert type(read) is type(expected) and read.ref == expected.ref
        value = read.input if isinstance(read, Work) else read.output
        assert np.array_equal(value, msg.input if isinstance(msg, Work) else msg.output)
