"""The client's express way, attacked: a worker played by hand that answers wrongly, carelessly
or with hostility to a repeated small call, the one frame the way writes held to the bytes
``encode`` writes, and the codec registry a call is written with changed under it.

A call nobody watches, with no deadline, whose recipe the worker holds for the connection and
whose input is one scalar goes out the short way (``Channel._express``, its ``Work`` written by
``short.work_frames``); anything but its own ``Done`` is taken by the general way's loop
(``Channel._settle``). Whatever comes back has to be taken as the general way takes it: a stale
answer dropped, junk refused with the channel dropped, a worker that leaves noticed in seconds,
and the piece never sent a third time. Every wait is bounded (a call that could hang runs on a
thread joined with a timeout), every socket is closed, no test sleeps before it acts.

The codec registry is read as a token (``registered_now``): a Work's kinds are checked against
the registry it was written with, so another thread registering and forgetting codecs never
lets a kind the worker cannot read leave; a group's packed specs are kept under the token, so a
network-mode worker gets a codec registered after its node was packed, and refuses a kind
registered again in another format.
"""

from __future__ import annotations

import itertools
import struct
import threading
import time

import fabric_nodes
import msgpack
import numpy as np
import pytest
from conftest import WORKER, env_with_tests
from fabric_nodes import Add, Echo, Sleep
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from peers import HANG_UP, RT, within
from peers import FakeWorker as Played
from reliability_support import child_env

from somatize import (
    Broken,
    Broker,
    Busy,
    Node,
    NodeFailed,
    ProtocolError,
    Refused,
    SomatizeError,
    Unreachable,
    Worker,
    codec,
)
from somatize.codec import forget
from somatize.codec.layout import INLINE_BYTES, INT_MAX, INT_MIN
from somatize.codec.registered import registered_now
from somatize.fabric.client import channel as channel_module
from somatize.wire import (
    Begin,
    Chunk,
    Done,
    Failed,
    Mounted,
    Ready,
    Refusal,
    Runtime,
    Saw,
    Send,
    Work,
    decode,
    encode,
    limits,
    short,
)
from somatize.wire.writing import _written

PATIENCE = 2.0  # a worker played wrongly is noticed in seconds
WAIT = 20.0  # the most any one call here may take (a busy machine included)
ODD = 10  # the input the played worker answers wrongly: calls before it warm the channel
DIGEST = "sha256:" + "0123456789abcdef" * 4


def broker_for(fake: Played, mode: str = "project", **declared) -> Broker:
    return Broker.embedded({"w1": Worker.at(fake.endpoint, mode=mode, **declared)}, patience=PATIENCE)


def done(work, output=None, *, produced=None) -> Done:
    return Done(work.ref, work.input + 1 if output is None else output, produced or {}, 7)


def echo(work) -> Done:
    return Done(work.ref, work.input, {}, 7)


def by_digest(work) -> bool:
    return work.recipe is None and bool(work.recipe_digest)


def warmed(node, broker) -> None:
    """Two calls: the first sends the recipe in full behind the Hello, the second learns the
    worker reads every kind; from the third on, a scalar call goes the express way."""
    assert [node.forward(i, broker=broker) for i in (1, 2)] == [2, 3]


def header(t: str, **fields) -> list[bytes]:
    """A message's one frame written by hand (any field, of any type), as ``encode`` lays it out."""
    return [msgpack.packb({"v": limits.WIRE_VERSION, "t": t, **fields}, use_bin_type=True)]


def same_value(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if type(a) is float:
        return struct.pack("<d", a) == struct.pack("<d", b)  # NaN's bits, and -0.0, too
    return a == b


# -- the one frame: the bytes `encode` writes ------------------------------------------------

_FLOAT_BITS = st.binary(min_size=8, max_size=8).map(lambda b: struct.unpack("<d", b)[0])  # NaNs with payloads
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(INT_MIN - 3, INT_MAX + 3),
    st.sampled_from([INT_MIN, INT_MAX, INT_MIN - 1, INT_MAX + 1, 2**63 - 1, 2**63, -(2**31) - 1, 2**32 - 1]),
    st.floats(allow_nan=True),
    _FLOAT_BITS,
    st.text(max_size=80),
    st.text(alphabet=st.characters(max_codepoint=127), min_size=30, max_size=300),
    st.binary(max_size=300),
)
REFS = st.one_of(st.integers(0, limits.MAX_REF), st.sampled_from([0, 1, limits.MAX_REF, limits.MAX_REF - 1]))


def long_way(ref, value, watched, digest=DIGEST) -> list[bytes] | None:
    """The frames ``encode``'s long way writes for the Work (None: it refuses it)."""
    try:
        frames = _written(Work(ref, None, value, {}, {}, None, watched, digest), Work)
    except (TypeError, ValueError, SomatizeError):
        return None
    return [bytes(f) for f in frames]


@settings(max_examples=1500, deadline=None, suppress_health_check=list(HealthCheck))
@given(REFS, SCALARS, st.booleans())
def test_work_frames_writes_the_bytes_encode_writes_and_both_ways_read_them_back(ref, value, watched):
    fast = short.work_frames(ref, value, watched, DIGEST)
    slow = long_way(ref, value, watched)
    if fast is None:  # declined: the general way writes it (or says why not)
        return
    assert slow is not None, "the express way wrote a Work the long way refuses"
    assert fast == slow
    assert fast == [bytes(f) for f in encode(Work(ref, None, value, watched=watched, recipe_digest=DIGEST))]
    for read in (decode(fast), short.express(fast[0])):  # the worker's express way, and decode
        assert type(read) is Work and read.ref == ref and read.watched is watched
        assert read.recipe is None and read.recipe_digest == DIGEST and not read.keys and not read.placement
        assert same_value(read.input, value)


@settings(max_examples=800, deadline=None, suppress_health_check=list(HealthCheck))
@given(REFS, SCALARS, st.integers(0, limits.MAX_REF))
def test_a_done_written_the_short_way_is_the_bytes_of_the_long_way(ref, value, took):
    message = Done(ref, value, {}, took)
    fast = short.written_express(message)
    if fast is None:
        return
    assert fast == [bytes(f) for f in _written(message, Done)]
    read = decode(fast)
    assert type(read) is Done and read.ref == ref and read.took_us == took and same_value(read.output, value)


@pytest.mark.parametrize(
    "value, express",
    [
        (b"x" * INLINE_BYTES, True),  # the longest bytes the header holds
        (b"x" * (INLINE_BYTES + 1), False),  # in a frame of its own: the general way
        ("a" * INLINE_BYTES, True),
        ("a" * (INLINE_BYTES + 1), False),
        ("é", False),  # not ASCII: the general way writes it
        ("\x00\x7f", True),
        (INT_MAX, True),
        (INT_MIN, True),
        (INT_MAX + 1, False),  # a big int: ["I", bytes], the general way
        (INT_MIN - 1, False),
        (float("nan"), True),
        (-0.0, True),
        (float("-inf"), True),
        (True, True),
        (None, True),
        (bytearray(b"ab"), False),  # read back as bytes: not "itself"
    ],
    ids=[
        "bytes at the inline limit",
        "bytes over it",
        "ascii at the inline limit",
        "ascii over it",
        "not ascii",
        "control characters",
        "uint64 max",
        "int64 min",
        "over uint64",
        "under int64",
        "nan",
        "-0.0",
        "-inf",
        "True",
        "None",
        "a bytearray",
    ],
)
def test_values_at_the_limits_are_written_one_frame_or_left_to_the_general_way(value, express):
    fast = short.work_frames(3, value, False, DIGEST)
    assert (fast is not None) is express
    if fast is not None:
        assert fast == long_way(3, value, False)
        assert same_value(decode(fast).input, value)


@pytest.mark.parametrize(
    "ref, watched, digest",
    [
        (-1, False, DIGEST),
        (limits.MAX_REF + 1, False, DIGEST),
        (True, False, DIGEST),  # a bool is not a ref
        (1.0, False, DIGEST),
        (1, 1, DIGEST),  # watched: a bool, not a 1
        (1, None, DIGEST),
        (1, False, DIGEST.upper()),
        (1, False, DIGEST + "0"),
        (1, False, "sha256:"),
        (1, False, ""),
        (1, False, b"sha256:" + b"0" * 64),
    ],
)
def test_a_field_the_check_would_refuse_is_not_written_the_short_way(ref, watched, digest):
    assert short.work_frames(ref, 5, watched, digest) is None
    with pytest.raises((TypeError, ValueError)):  # and the long way says what is wrong
        encode(Work(ref, None, 5, watched=watched, recipe_digest=digest))


def test_a_lowered_limit_is_followed_by_the_short_way(monkeypatch):
    """A test lowers a limit: the short way follows it as the long way does (`limits.NAME`)."""
    assert short.work_frames(limits.MAX_REF, 5, False, DIGEST) is not None
    monkeypatch.setattr(limits, "MAX_REF", 1000)
    assert short.work_frames(1001, 5, False, DIGEST) is None
    assert short.work_frames(1000, 5, False, DIGEST) == long_way(1000, 5, False)
    monkeypatch.setattr(limits, "MAX_HEADER", 200)
    assert short.work_frames(1, b"x" * 300, False, DIGEST) is None


# -- the client, against a worker played by hand -------------------------------------------


@pytest.mark.parametrize(
    "value, express",
    [
        (b"x" * INLINE_BYTES, True),
        (b"x" * (INLINE_BYTES + 1), False),
        (INT_MAX, True),
        (INT_MIN, True),
        (INT_MAX + 1, False),
        (float("nan"), True),
        (-0.0, True),
        ("é" * 3, False),
        ("plain", True),
        (None, True),
    ],
    ids=[
        "bytes at the inline limit",
        "bytes over it",
        "uint64 max",
        "int64 min",
        "a big int",
        "nan",
        "-0.0",
        "not ascii",
        "ascii",
        "None",
    ],
)
def test_a_value_at_the_limits_reaches_the_worker_whole_whichever_way_it_goes(played, ways, value, express):
    fake = played(echo)
    node = Sleep(0.0).named("id").at("w1")
    with broker_for(fake) as broker:
        assert [node.forward(i, broker=broker) for i in (1, 2)] == [1, 2]
        back = within(WAIT, lambda: node.forward(value, broker=broker))
    assert same_value(back, value)
    assert same_value(fake.works[-1].input, value)  # what the worker read is the value itself
    assert by_digest(fake.works[-1])  # named by digest either way: the worker holds it
    assert ways[-1] == ("express" if express else "general"), ways


def test_a_ref_at_the_limit_goes_the_express_way_and_its_done_is_taken(played, ways, monkeypatch):
    fake = played(done)
    monkeypatch.setattr(channel_module, "_refs", itertools.count(limits.MAX_REF - 2))
    node = Add(1).named("a").at("w1")
    with broker_for(fake) as broker:
        warmed(node, broker)
        assert node.forward(ODD, broker=broker) == ODD + 1
    assert [w.ref for w in fake.works] == [limits.MAX_REF - 2, limits.MAX_REF - 1, limits.MAX_REF]
    assert ways[-1] == "express"


WRONG_REFS = [
    ("Done", {"output": 1, "produced": [], "took_us": 7, "saw": []}, True),
    ("Done", {"output": 1, "produced": [], "took_us": 7, "saw": []}, 1.0),
    ("Done", {"output": 1, "produced": [], "took_us": 7, "saw": []}, "1"),
    ("Done", {"output": 1, "produced": [], "took_us": 7, "saw": []}, -1),
    ("Done", {"output": 1, "produced": [], "took_us": 7, "saw": []}, 2**63),
    ("Done", {"output": 1, "produced": [], "took_us": 7, "saw": []}, None),
    ("Failed", {"why": "x", "node": "a", "error": "E", "traceback": ""}, True),
    ("Refusal", {"why": "x", "hello": True, "recipe": False}, "1"),
    ("Send", {"digests": [DIGEST]}, -3),
    ("Saw", {"fact": {"event": "ran"}}, [1]),
]


@pytest.mark.parametrize(
    "variant, fields, ref", WRONG_REFS, ids=[f"{v}-ref-{type(r).__name__}-{r!r}"[:40] for v, _, r in WRONG_REFS]
)
def test_an_answer_whose_ref_is_not_a_ref_drops_the_channel_and_nothing_is_resent(played, ways, variant, fields, ref):
    decode(header(variant, ref=1, **fields))  # the same answer with a ref: read (so the ref is what is refused)
    fake = played(lambda work: header(variant, ref=ref, **fields) if work.input == ODD else done(work))
    node = Add(1).named("a").at("w1")
    with broker_for(fake) as broker:
        warmed(node, broker)
        with pytest.raises(ProtocolError, match="could not be taken"):
            within(WAIT, lambda: node.forward(ODD, broker=broker))
        assert node.forward(3, broker=broker) == 4  # a fresh channel: its recipe in full
    assert [by_digest(w) for w in fake.works] == [False, True, True, False]
    assert ways == ["general", "express, then settled"]  # the first call goes behind its Hello


def test_stale_answers_of_every_kind_before_its_own_done_are_dropped(played, ways):
    def answer(work):
        if work.input != ODD:
            return done(work)
        other = work.ref + 1000
        return (
            Saw(other, {"event": "ran"}),
            Send(other, (DIGEST,)),
            Failed(other, "no", "a", "E", ""),
            Refusal("who?", ref=other, hello=True),
            Refusal("which?", ref=other, recipe=True),
            Refusal("busy: full", ref=other),
            Done(other, -1, {}, 1),
            Saw(work.ref, {"event": "ran"}),
            done(work),
        )

    fake = played(answer)
    node = Add(1).named("a").at("w1")
    with broker_for(fake) as broker:
        warmed(node, broker)
        assert within(WAIT, lambda: node.forward(ODD, broker=broker)) == ODD + 1
        assert node.forward(3, broker=broker) == 4  # the same channel, the express way again
    assert len(fake.works) == 4 and len(fake.hellos) == 1  # nothing resent, nobody greeted again
    assert ways[-2:] == ["express", "express"]


def test_a_duplicated_done_is_dropped_as_stale_by_the_next_express_call(played, ways):
    fake = played(lambda work: (done(work), done(work, output=-5)) if work.input == ODD else done(work))
    node = Add(1).named("a").at("w1")
    with broker_for(fake) as broker:
        warmed(node, broker)
        assert node.forward(ODD, broker=broker) == ODD + 1
        assert [node.forward(i, broker=broker) for i in (3, 4)] == [4, 5]  # never -5
    assert len(fake.hellos) == 1 and ways[-3:] == ["express"] * 3


def test_a_send_for_code_it_was_never_offered_is_refused_in_somatize_words(played, ways):
    fake = played(lambda work: Send(work.ref, ("sha256:" + "b" * 64,)) if work.input == ODD else done(work))
    node = Add(1).named("a").at("w1")
    with broker_for(fake) as broker:
        warmed(node, broker)
        try:
            with pytest.raises((ProtocolError, Refused)):
                within(WAIT, lambda: node.forward(ODD, broker=broker))
        finally:
            assert node.forward(3, broker=broker) == 4
    assert ways == ["general", "express, then settled"]


def test_a_send_answering_an_express_work_in_network_mode_is_met_and_the_work_sent_again_once(played, ways):
    asked: list[int] = []

    def answer(work):
        if work.input == ODD and not asked:
            asked.append(work.ref)
            return Send(work.ref, (fake.provisions[0],))  # the worker lost the code: asks again
        return done(work)

    fake = played(answer, runtime=Runtime.here(mode="network"))
    node = Add(1).named("a").at("w1")
    with broker_for(fake, mode="network", send=[fabric_nodes]) as broker:
        warmed(node, broker)
        assert len(fake.provisions) == 1
        assert within(WAIT, lambda: node.forward(ODD, broker=broker)) == ODD + 1
        assert node.forward(3, broker=broker) == 4
    assert len(fake.provisions) == 2  # provisioned again, once
    odd = [w for w in fake.works if w.input == ODD]
    assert [w.ref for w in odd] == asked * 2 and all(by_digest(w) for w in odd)  # the same Work, twice
    assert ways[-2:] == ["express, then settled", "express"]


def test_a_send_forever_is_refused_after_the_work_went_four_times_in_all(played, ways):
    fake = played(
        lambda work: Send(work.ref, (fake.provisions[0],)) if work.input == ODD else done(work),
        runtime=Runtime.here(mode="network"),
    )
    node = Add(1).named("a").at("w1")
    with broker_for(fake, mode="network", send=[fabric_nodes]) as broker:
        warmed(node, broker)
        with pytest.raises(Refused, match="kept asking"):
            within(WAIT, lambda: node.forward(ODD, broker=broker))
    assert sum(w.input == ODD for w in fake.works) == 4  # as the general way: four sends, no more


@pytest.mark.parametrize("after", ["junk", "a done", "a ready then junk"])
def test_a_refusal_hello_followed_by_something_else_drops_the_channel_and_sends_nothing_again(played, ways, after):
    """The worker asks to be greeted, then, before the Hello's answer would come, says something
    else: that is not a Ready, so the channel is dropped and the work is not sent again."""

    def answer(work):
        if work.input != ODD or not by_digest(work):
            return done(work)
        refusal = Refusal("who are you?", ref=work.ref, hello=True)
        if after == "junk":
            return refusal, [b"\xc1 not a message"]
        if after == "a done":
            return refusal, done(work, output=-1)
        return refusal, Ready(RT), [b"\x93\x01\x02"]

    fake = played(answer)
    node = Add(1).named("a").at("w1")
    with broker_for(fake) as broker:
        warmed(node, broker)
        with pytest.raises(ProtocolError, match="could not be taken"):
            within(WAIT, lambda: node.forward(ODD, broker=broker))
        assert node.forward(3, broker=broker) == 4
    sent = [(w.input, by_digest(w)) for w in fake.works]
    assert sent[:3] == [(1, False), (2, True), (ODD, True)] and sent[-1] == (3, False)
    if after == "a ready then junk":  # the Ready was taken for the Hello's: the work went again, in full, once
        assert sent[3:-1] in ([(ODD, False)], [])
    else:
        assert len(sent) == 4
    assert ways == ["general", "express, then settled"]


def test_a_refusal_hello_whose_hello_is_refused_ends_the_call_refused(played, ways):
    fake = played(
        lambda work: Refusal("who?", ref=work.ref, hello=True) if work.input == ODD else done(work),
        greet=lambda hello, n: Ready(RT) if n == 1 else Refusal("not you"),
    )
    node = Add(1).named("a").at("w1")
    with broker_for(fake) as broker:
        warmed(node, broker)
        with pytest.raises(Refused, match="not you"):
            within(WAIT, lambda: node.forward(ODD, broker=broker))
    assert sum(w.input == ODD for w in fake.works) == 1


def test_a_mounted_answer_on_a_channel_that_shares_no_folder_drops_it(played, ways):
    fake = played(lambda work: Mounted(("0" * 32 + "-1",), encode(done(work))[0]) if work.input == ODD else done(work))
    node = Add(1).named("a").at("w1")
    with broker_for(fake) as broker:
        warmed(node, broker)
        with pytest.raises(ProtocolError, match="shares no folder"):
            within(WAIT, lambda: node.forward(ODD, broker=broker))
        assert node.forward(3, broker=broker) == 4
    assert ways == ["general", "express, then settled"]


def test_a_done_carried_by_a_stream_answers_an_express_work(played, ways):
    def streamed(work):
        frames = [bytes(f) for f in encode(done(work, output=b"y" * 200_000))]
        return (Begin(9, tuple(len(f) for f in frames)), *(Chunk(9, f) for f in frames))

    fake = played(lambda work: streamed(work) if work.input == ODD else done(work))
    node = Add(1).named("a").at("w1")
    with broker_for(fake) as broker:
        warmed(node, broker)
        assert within(WAIT, lambda: node.forward(ODD, broker=broker)) == b"y" * 200_000
        assert node.forward(3, broker=broker) == 4
    assert ways[-2:] == ["express", "express"]


def test_a_done_whose_header_is_over_the_limit_is_refused_and_one_at_it_is_taken(played, ways, monkeypatch):
    """Both sides read `limits.MAX_HEADER` as it is now: lowered to 1 MiB here, so that a header
    one byte over it is as "huge" as a 64 MiB one, for a fraction of the memory."""
    monkeypatch.setattr(limits, "MAX_HEADER", 1 << 20)

    def sized(work, size):
        base = len(header("Done", ref=work.ref, output="y" * 70_000, produced=[], took_us=7, saw=[])[0]) - 70_000
        return header("Done", ref=work.ref, output="y" * (size - base), produced=[], took_us=7, saw=[])

    fake = played(lambda work: sized(work, (1 << 20) + work.input - ODD) if work.input >= ODD else done(work))
    node = Add(1).named("a").at("w1")
    with broker_for(fake) as broker:
        warmed(node, broker)
        assert len(within(WAIT, lambda: node.forward(ODD, broker=broker))) > 1_000_000  # at the limit: taken
        with pytest.raises(ProtocolError, match="over the"):
            within(WAIT, lambda: node.forward(ODD + 1, broker=broker))  # a byte over: refused
        assert node.forward(3, broker=broker) == 4
    assert ways == ["general", "express", "express, then settled"]


def test_a_worker_that_hangs_up_mid_call_is_noticed_in_seconds(played, ways):
    fake = played(lambda work: HANG_UP if work.input == ODD else done(work))
    node = Add(1).named("a").at("w1")
    with broker_for(fake) as broker:
        warmed(node, broker)
        started = time.monotonic()
        with pytest.raises(Broken, match="went away"):
            within(WAIT, lambda: node.forward(ODD, broker=broker))
        assert time.monotonic() - started < PATIENCE * 3 + 5  # the drop is seen; no wait for a silence
        assert fake.hung_up.is_set()
        started = time.monotonic()
        with pytest.raises(Unreachable):  # nobody there now: said within a patience, not a hang
            within(WAIT, lambda: node.forward(3, broker=broker))
        assert time.monotonic() - started < PATIENCE * 3 + 5
    assert ways == ["general", "express, then settled"]


def test_a_worker_that_hangs_up_while_greeted_again_is_noticed_in_seconds(played, ways):
    fake = played(
        lambda work: Refusal("who?", ref=work.ref, hello=True) if work.input == ODD else done(work),
        greet=lambda hello, n: Ready(RT) if n == 1 else HANG_UP,
    )
    node = Add(1).named("a").at("w1")
    with broker_for(fake) as broker:
        warmed(node, broker)
        started = time.monotonic()
        with pytest.raises(Broken):
            within(WAIT, lambda: node.forward(ODD, broker=broker))
        assert time.monotonic() - started < PATIENCE * 3 + 5
    assert sum(w.input == ODD for w in fake.works) == 1


def test_a_busy_refusal_of_an_express_work_is_busy_and_the_channel_serves_on(played, ways):
    fake = played(lambda work: Refusal("busy: full up", ref=work.ref) if work.input == ODD else done(work))
    node = Add(1).named("a").at("w1")
    with broker_for(fake) as broker:
        warmed(node, broker)
        with pytest.raises(Busy, match="full up"):
            within(WAIT, lambda: node.forward(ODD, broker=broker))
        assert node.forward(3, broker=broker) == 4
    assert len(fake.hellos) == 1 and ways[-1] == "express"  # the same channel, still the short way


def test_a_failure_answering_an_express_work_names_its_node_and_host(played, ways):
    fake = played(
        lambda work: Failed(work.ref, "ValueError: no", None, "ValueError", "") if work.input == ODD else done(work)
    )
    node = Add(1).named("a").at("w1")
    with broker_for(fake) as broker:
        warmed(node, broker)
        with pytest.raises(NodeFailed) as failed:
            within(WAIT, lambda: node.forward(ODD, broker=broker))
        assert failed.value.host == "w1" and failed.value.node == "a"
        assert node.forward(3, broker=broker) == 4


def test_the_same_wrong_answer_is_taken_alike_by_the_express_forward_and_the_walk(played, ways):
    """A `Done` saying it kept the output of a step nobody asked it to keep is refused, however
    the forward was called, and the next call is served on a fresh channel."""
    fake = played(lambda work: done(work, produced={5: 0}) if work.input == ODD else done(work))
    node = Add(1).named("a").at("w1")
    outcomes = []
    with broker_for(fake) as broker:
        for options in ({}, {"deadline": 30.0}, {"watching": lambda fact: None}):
            warmed(node, broker)
            try:
                outcomes.append(within(WAIT, lambda o=options: node.forward(ODD, broker=broker, **o)))
            except ProtocolError as exc:
                assert "did not ask it to keep" in str(exc)
                outcomes.append("refused")
        assert node.forward(3, broker=broker) == 4
    assert outcomes == ["refused"] * 3


def test_threads_calling_one_node_through_one_broker_each_get_their_own_answer(played, ways):
    fake = played(lambda work: Done(work.ref, work.input * 2, {}, 7))
    node = Add(1).named("a").at("w1")
    wrong: list = []
    failures: list = []
    threads = 4
    calls = 150

    def run(base: int) -> None:
        try:
            for i in range(calls):
                out = node.forward(base + i, broker=broker)
                if out != 2 * (base + i):
                    wrong.append((base + i, out))
        except BaseException as exc:  # noqa: BLE001 - said on the test's thread
            failures.append(exc)

    with broker_for(fake) as broker:
        running = [threading.Thread(target=run, args=(k * 1_000_000,), daemon=True) for k in range(threads)]
        for thread in running:
            thread.start()
        for thread in running:
            thread.join(WAIT * 3)
        assert not any(thread.is_alive() for thread in running), "a thread still waits for its answer"
    assert not failures and not wrong
    assert len(fake.works) == threads * calls
    assert len(fake.hellos) <= threads  # a channel per thread at most, each greeted once
    assert ways.count("express") >= threads * calls - 2 * threads  # all but each channel's two warming calls


# -- the client, against a real worker ------------------------------------------------------


@pytest.fixture
def worker(processes):
    return processes([*WORKER, "--listen", "127.0.0.1:0", "--announce"], env=child_env())


def test_values_at_the_limits_cross_a_real_worker_and_come_back_the_same(worker, ways):
    values = [
        b"x" * INLINE_BYTES,
        b"x" * (INLINE_BYTES + 1),
        INT_MAX,
        INT_MIN,
        INT_MAX + 1,
        INT_MIN - 1,
        float("nan"),
        -0.0,
        float("inf"),
        "é",
        "a" * INLINE_BYTES,
        "",
        b"",
        None,
        True,
        2.5,
    ]
    node = Sleep(0.0).named("id").at("w1")
    with Broker.embedded({"w1": Worker.at(worker.endpoint, mode="project")}, patience=PATIENCE) as broker:
        assert [node.forward(i, broker=broker) for i in (1, 2)] == [1, 2]
        for value in values:
            back = within(WAIT, lambda v=value: node.forward(v, broker=broker))
            assert same_value(back, value), (value, back)
    went = dict(zip(map(repr, values), ways[1:], strict=False))
    assert went[repr(b"x" * INLINE_BYTES)] == "express" and went[repr(INT_MAX)] == "express"
    assert went[repr(INT_MAX + 1)] == "general" and went[repr("é")] == "general"


def test_threads_through_one_broker_to_a_real_worker_each_get_their_own_answer(worker, ways):
    node = Add(1).named("a").at("w1")
    wrong: list = []
    failures: list = []

    def run(base: int) -> None:
        try:
            for i in range(100):
                out = node.forward(base + i, broker=broker)
                if out != base + i + 1:
                    wrong.append((base + i, out))
        except BaseException as exc:  # noqa: BLE001 - said on the test's thread
            failures.append(exc)

    with Broker.embedded({"w1": Worker.at(worker.endpoint, mode="project")}, patience=PATIENCE) as broker:
        running = [threading.Thread(target=run, args=(k * 1_000_000,), daemon=True) for k in range(3)]
        for thread in running:
            thread.start()
        for thread in running:
            thread.join(WAIT * 3)
        assert not any(thread.is_alive() for thread in running), "a thread still waits for its answer"
    assert not failures and not wrong
    assert "express" in ways


def test_a_worker_greeted_again_that_reads_fewer_kinds_is_asked_again_what_it_reads(played, ways):
    """What a worker reads is what its answer to the latest Hello says: one greeted again (it
    forgot the channel, or came back another build) that no longer reads NumPy arrays gets none,
    refused here before a byte of it moves, though the channel knew it read them before."""
    import dataclasses

    fewer = dataclasses.replace(RT, kinds=tuple(kind for kind in RT.kinds if kind != "numpy.ndarray"))

    def answer(work):
        if isinstance(work.input, np.ndarray):
            return echo(work)
        if work.input == ODD and by_digest(work):
            return Refusal("who are you?", ref=work.ref, hello=True)
        return done(work)

    fake = played(answer, greet=lambda hello, n: Ready(RT if n == 1 else fewer))
    node = Add(1).named("a").at("w1")
    with broker_for(fake) as broker:
        assert node.forward(np.arange(3), broker=broker).tolist() == [0, 1, 2]  # it reads arrays
        warmed(node, broker)
        assert within(WAIT, lambda: node.forward(ODD, broker=broker)) == ODD + 1  # greeted again
        sent = len(fake.works)
        with pytest.raises(Refused, match="numpy.ndarray"):
            node.forward(np.arange(3), broker=broker)
        assert len(fake.works) == sent  # nothing of it was sent
    assert len(fake.hellos) == 2


# -- the codec registry as a token, changed while calls run --------------------------------------


class Reading:
    """A type of ours that crosses only through a codec registered for it."""

    def __init__(self, hz: float) -> None:
        self.hz = hz

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Reading) and other.hz == self.hz

    __hash__ = None  # type: ignore[assignment]


KIND = "tests.client_express_attacks.Reading"


class Bump(Node):
    """A Reading one hertz up: what comes back tells which codec read it and wrote it."""

    def forward(self, x):
        return Reading(x.hz + 1)


def _register(scale: float = 1.0) -> None:
    """``Reading`` under ``KIND``, its hertz written times ``scale`` (another format, same kind)."""
    codec(KIND, Reading, dump=lambda r, s=scale: repr(r.hz * s).encode(), load=lambda b, s=scale: Reading(float(b) / s))


@pytest.fixture
def registry_restored():
    yield
    forget(KIND)


def _toggling(stop: threading.Event, seen: list) -> threading.Thread:
    """A thread registering and forgetting ``KIND`` as fast as it can until ``stop``."""

    def run() -> None:
        while not stop.is_set():
            _register()
            seen.append(registered_now())
            forget(KIND)
            seen.append(registered_now())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _reading_call(node, broker, i: int) -> str:
    """A Reading forwarded: "refused here" (its kind named before a byte left), "unwritable"
    (no codec at that moment), or "reached the worker" (sent, and refused there)."""
    try:
        node.forward(Reading(i), broker=broker)
    except Refused as exc:
        if "refused the work" in str(exc):  # the worker's own refusal: it got the bytes
            return "reached the worker"
        assert KIND in str(exc), exc
        return "refused here"
    except ProtocolError as exc:
        assert KIND in str(exc), exc
        return "reached the worker"
    except SomatizeError as exc:
        assert "cannot leave this process" in str(exc), exc
        return "unwritable"
    raise AssertionError("a Reading came back from a worker that reads no Reading")


def test_a_kind_the_worker_cannot_read_is_never_sent_while_another_thread_changes_the_registry(
    spawned, registry_restored
):
    """Attack: another thread registers and forgets a codec over and over while calls run
    against a real project-mode worker that reads none of it. A Reading has to be refused
    here (its kind named) or be unwritable (no codec at that moment): never sent. Scalars
    between are served, the express way among them, every answer right."""
    node = Echo().named("echo").at("w1")
    stop, seen = threading.Event(), []
    outcomes: dict[str, int] = {}
    with Broker.embedded({"w1": Worker.at(spawned.endpoint, mode="project")}, patience=PATIENCE) as broker:
        toggler = _toggling(stop, seen)
        try:
            for i in range(120):
                assert node.forward(i, broker=broker) == i
                way = _reading_call(node, broker, i)
                outcomes[way] = outcomes.get(way, 0) + 1
        finally:
            stop.set()
            toggler.join(WAIT)
    assert len(seen) > 10, "the registry did not change while the calls ran"
    assert "reached the worker" not in outcomes, outcomes


def test_frames_written_with_a_codec_forgotten_before_the_check_are_still_refused(spawned, registry_restored):
    """Attack, made certain: the codec's own ``dump`` forgets it, so the registry changes
    between the writing of the Work and the check of its kinds, in one thread. The worker
    reads no such kind: the call has to be refused here, before a byte of it leaves."""

    def dump(r):
        forget(KIND)  # gone by the time the channel checks what the worker reads
        return repr(r.hz).encode()

    node = Echo().named("echo").at("w1")
    with Broker.embedded({"w1": Worker.at(spawned.endpoint, mode="project")}, patience=PATIENCE) as broker:
        assert node.forward(1, broker=broker) == 1
        codec(KIND, Reading, dump=dump, load=lambda b: Reading(float(b)))
        assert _reading_call(node, broker, 1) == "refused here"


@pytest.fixture(scope="module")
def network_broker():
    """A broker with one spawned network-mode worker that is sent this module by value."""
    import sys

    import fabric_nodes

    with Broker.embedded(
        {"w1": Worker.spawn(WORKER, mode="network", send=[sys.modules[__name__], fabric_nodes])}, patience=PATIENCE
    ) as broker:
        yield broker


def test_a_network_worker_gets_a_codec_registered_after_its_node_was_packed(network_broker, registry_restored):
    """Attack on the packed specs' memo (``specs_of``, keyed by the registry's token): a
    network-mode worker reads a kind only through the codecs its artifacts carry. A node
    packed before a codec was registered has to be packed anew once it is (the token
    changed), so the Reading crosses both ways; forgotten, a Reading cannot leave; and the
    scalars around are served all along."""
    node = Bump().named("bump").at("w1")
    plain = Add(1).named("inc").at("w1")
    broker = network_broker
    assert plain.forward(1, broker=broker) == 2
    with pytest.raises(SomatizeError, match="cannot leave this process"):
        node.forward(Reading(1.0), broker=broker)  # no codec yet
    packer = broker._channels.packers["w1"]
    packed = packer.pickles
    _register()
    assert within(WAIT, lambda: node.forward(Reading(1.0), broker=broker)) == Reading(2.0)
    assert packer.pickles > packed  # packed anew: the artifact carries the codec now
    assert within(WAIT, lambda: node.forward(Reading(5.0), broker=broker)) == Reading(6.0)
    again = packer.pickles
    assert within(WAIT, lambda: node.forward(Reading(7.0), broker=broker)) == Reading(8.0)
    assert packer.pickles == again  # the registry unchanged: not packed again
    forget(KIND)
    with pytest.raises(SomatizeError, match="cannot leave this process"):
        node.forward(Reading(1.0), broker=broker)
    assert plain.forward(5, broker=broker) == 6


def test_a_codec_registered_again_in_another_format_is_refused_by_the_network_worker(network_broker, registry_restored):
    """Attack: the same kind registered again with another format (``codec`` says registering
    a kind again replaces it). The client packs the node anew (the token changed) with the
    new codec inside; the worker reads one format per kind while it runs, so the Reading
    that comes back has to be one hertz up, or the call refused with the kind and the fix
    named: never a value read with one format and written with the other. Registered again
    in the first format (new functions, the same code), it is served again."""
    node = Bump().named("bump").at("w1")
    _register()
    assert within(WAIT, lambda: node.forward(Reading(1.0), broker=network_broker)) == Reading(2.0)
    _register(scale=4.0)  # the same kind, another format
    got = within(WAIT, lambda: _ended_plain(lambda: node.forward(Reading(1.0), broker=network_broker)))
    assert got[0] == "Refused", got
    assert f"`{KIND}`" in got[1] and "another format" in got[1] and "restart the worker" in got[1], got
    _register()  # the first format again, as a notebook cell run twice makes it
    assert within(WAIT, lambda: node.forward(Reading(3.0), broker=network_broker)) == Reading(4.0)


def _ended_plain(call) -> tuple:
    try:
        return ("value", call())
    except SomatizeError as exc:
        return (type(exc).__name__, str(exc).splitlines()[0])


class _Unread:
    def __init__(self, v: float) -> None:
        self.v = v


class _Other(_Unread):
    pass


def test_kinds_are_checked_against_the_registry_they_were_written_with_under_churn(processes):
    """Two threads register and forget codecs (one the worker cannot read, one unrelated) as
    fast as they can while calls run on a project-mode worker: a plain call is never refused
    (no false refusal), and a value of the unreadable kind is always refused here, by the
    client, before it is sent (the worker stays up and serves)."""
    from somatize.codec import codec, forget

    worker = processes([*WORKER, "--listen", "127.0.0.1:0", "--announce", "--mode", "project"], env=env_with_tests())
    stop = threading.Event()

    def churn(kind: str, type_: type) -> None:
        while not stop.is_set():
            codec(kind, type_, dump=lambda u: repr(u.v).encode(), load=lambda b: type_(float(b)))
            forget(kind)

    threads = [
        threading.Thread(target=churn, args=k, daemon=True)
        for k in (("atk.session.unread", _Unread), ("atk.session.other", _Other))
    ]
    refused_plain, sent_unread = [], []
    try:
        with Broker.embedded({"w1": Worker.at(worker.endpoint, mode="project")}, patience=5.0) as broker:
            for t in threads:
                t.start()
            until = time.monotonic() + 4
            while time.monotonic() < until:
                try:
                    assert Add(1).named("a").at("w1").forward(1, broker=broker) == 2
                except SomatizeError as exc:
                    refused_plain.append(str(exc))
                try:
                    Add(1).named("u").at("w1").forward(_Unread(1.0), broker=broker)
                    sent_unread.append("returned")
                except SomatizeError as exc:
                    text = str(exc)
                    told = "cannot read values of kind `atk.session.unread`"
                    if told in text and "nothing was sent" in text:
                        continue  # refused here, before a byte was sent
                    if "`atk.session.unread`" not in text and "_Unread" in text:
                        continue  # forgotten before it was written: nothing to send
                    sent_unread.append(text)
    finally:
        stop.set()
        for t in threads:
            t.join(5)
        forget("atk.session.unread")
        forget("atk.session.other")
    assert not refused_plain, refused_plain[:3]
    assert not sent_unread, sent_unread[:3]
    assert worker.alive
