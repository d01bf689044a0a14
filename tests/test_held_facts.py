"""A watched piece's facts: inside its `Done` when it finishes at once, live when it runs long.

A piece that finishes within the stand-in's `STAND_IN_AFTER` carries what it said inside its
`Done` (one message back instead of one per fact); one that runs longer has what it said
sent at once as `Saw`s, and what it says afterwards as it says it, so a watcher sees a long
piece live. Order is kept either way, nothing is said twice and nothing is lost. Played
against real workers (one job, and slots), with a peer speaking the wire by hand.
"""

from __future__ import annotations

import os
import time

import pytest
from conftest import WORKER, env_with_tests
from fabric_nodes import Add, Boom, Sleep
from holds_nodes import Hold
from peers import FakeWorker, Raw

from somatize import Broker, ProtocolError, Worker
from somatize.packing import Packer
from somatize.wire import MAX_SAW, Done, Failed, Hello, Ready, Recipe, Runtime, Saw, Work


def spec(node, label: str):
    return Packer("project").spec(node.named(label).steps[0])


def chain(*specs) -> Recipe:
    return Recipe(tuple(specs), ("seq", tuple(("step", i) for i in range(len(specs)))))


def worker(processes, *extra: str):
    return processes([*WORKER, "--listen", "127.0.0.1:0", "--announce", *extra], env=env_with_tests())


def until_terminal(raw: Raw, ref: int) -> list:
    said = []
    while not said or isinstance(said[-1], Saw):
        answer = raw.answer(30)
        assert answer is not None, f"no answer to work {ref} within 30 s; so far {said}"
        assert getattr(answer, "ref", ref) == ref, answer
        said.append(answer)
    return said


def facts_of(said: list) -> list[tuple[str, str]]:
    """Every fact the answers carried, in order: the Saws', then the Done's own."""
    facts = [m.fact for m in said if isinstance(m, Saw)]
    if isinstance(said[-1], Done):
        facts += list(said[-1].saw)
    return [(f["fact"], f.get("node", "")) for f in facts]


def wait_for(path: str, seconds: float = 30.0) -> None:
    until = time.monotonic() + seconds
    while not os.path.exists(path):
        assert time.monotonic() < until, f"{path} did not appear within {seconds:g} s"
        time.sleep(0.005)


def test_a_piece_that_finishes_at_once_sends_its_facts_inside_its_done(processes):
    raw = Raw(worker(processes).endpoint)
    try:
        assert isinstance(raw.ask(Hello(Runtime.here(mode="project"))), Ready)
        raw.send(Work(1, chain(spec(Add(1), "a"), spec(Add(2), "b")), 1, watched=True))
        said = until_terminal(raw, 1)
        assert [type(m) for m in said] == [Done], said  # one message back, not three
        assert said[0].output == 4
        assert facts_of(said) == [("ran", "a"), ("ran", "b")]
    finally:
        raw.close()


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_a_piece_that_runs_long_sends_what_it_said_live_and_the_rest_as_said(processes, tmp_path, jobs):
    """The first node's `ran` arrives while the second still runs (with one job the stand-in
    releases it as it takes the socket; with slots the serving loop does), then the second's."""
    started, release, finished = (str(tmp_path / name) for name in ("started", "release", "finished"))
    raw = Raw(worker(processes, "--jobs", jobs).endpoint)
    try:
        assert isinstance(raw.ask(Hello(Runtime.here(mode="project"))), Ready)
        work = chain(spec(Add(1), "a"), spec(Hold(started, release, finished), "hold"), spec(Add(2), "c"))
        raw.send(Work(1, work, 1, watched=True))
        wait_for(started)
        early = raw.answer(30)  # while `hold` runs, and nothing released it: live
        assert isinstance(early, Saw) and (early.fact["fact"], early.fact["node"]) == ("ran", "a"), early
        assert not os.path.exists(finished)  # it came while `hold` still ran
        open(release, "w").close()
        said = [early, *until_terminal(raw, 1)]
        assert isinstance(said[-1], Done) and said[-1].output == 4
        assert facts_of(said) == [("ran", "a"), ("ran", "hold"), ("ran", "c")]
        assert said[-1].saw == ()  # once released, a piece's facts leave as it says them
        raw.send(Work(2, chain(spec(Add(1), "a")), 1, watched=True))  # the next piece is young again
        again = until_terminal(raw, 2)
        assert [type(m) for m in again] == [Done] and facts_of(again) == [("ran", "a")]
    finally:
        if not os.path.exists(release):
            open(release, "w").close()
        raw.close()


def test_a_piece_saying_more_than_a_done_carries_sends_them_all_in_order(processes):
    n = MAX_SAW + 6
    raw = Raw(worker(processes).endpoint)
    try:
        assert isinstance(raw.ask(Hello(Runtime.here(mode="project"))), Ready)
        raw.send(Work(1, chain(*(spec(Add(1), f"n{i}") for i in range(n))), 0, watched=True))
        said = until_terminal(raw, 1)
        assert isinstance(said[-1], Done) and said[-1].output == n
        assert len(said[-1].saw) <= MAX_SAW
        assert facts_of(said) == [("ran", f"n{i}") for i in range(n)]  # each once, in order
    finally:
        raw.close()


def test_a_failing_piece_sends_what_it_said_before_its_failed(processes):
    raw = Raw(worker(processes).endpoint)
    try:
        assert isinstance(raw.ask(Hello(Runtime.here(mode="project"))), Ready)
        raw.send(Work(1, chain(spec(Add(1), "a"), spec(Boom(), "boom")), 1, watched=True))
        said = until_terminal(raw, 1)
        assert isinstance(said[-1], Failed) and said[-1].node == "boom"
        assert [(m.fact["fact"], m.fact["node"]) for m in said[:-1]] == [("ran", "a"), ("failed", "boom")]
    finally:
        raw.close()


def test_a_watcher_sees_the_same_facts_whether_they_came_inside_the_done_or_not(processes):
    """Through a graph: the client hands the facts a Done carried to the watcher, in order
    and named by host, as it hands those of Saws (a piece running past the stand-in's
    20 ms), before the piece's `left`; an unwatched forward is told nothing."""
    endpoint = worker(processes).endpoint
    quick: list[dict] = []
    slow: list[dict] = []
    with Broker.embedded({"w1": Worker.at(endpoint, mode="project")}) as broker:
        graph = Add(1).named("a").at("w1") >> Add(2).named("b").at("w1")
        assert graph.forward(1, broker=broker, watching=quick.append) == 4
        assert graph.forward(1, broker=broker) == 4  # unwatched: nothing held, nothing carried
        longer = Add(1).named("a").at("w1") >> Sleep(0.2).named("sleep").at("w1") >> Add(2).named("b").at("w1")
        assert longer.forward(1, broker=broker, watching=slow.append) == 4

    def said(seen: list[dict]) -> list[tuple]:
        return [(f["fact"], f.get("node"), f.get("host")) for f in seen if f["fact"] in ("ran", "left")]

    assert said(quick) == [("ran", "a", "w1"), ("ran", "b", "w1"), ("left", None, "w1")]
    assert said(slow) == [("ran", "a", "w1"), ("ran", "sleep", "w1"), ("ran", "b", "w1"), ("left", None, "w1")]
    assert quick[-1]["fact"] == slow[-1]["fact"] == "finished"


def test_a_worker_whose_done_carries_facts_that_should_be_refused_breaks_the_channel_never_the_client():
    """Attacker: an allowed worker answering a watched Work with a `Done` whose facts are too
    many, not text, or a map holding a key twice (which a reader merging maps quietly would
    take as its last value). The client refuses each as a `ProtocolError` at once, its
    watcher told none of it, and serves the next forward; an unwatched forward is not told
    facts a worker carried anyway."""
    import msgpack

    from somatize.wire import WIRE_VERSION

    def done(ref: int, saw: bytes) -> list:
        pairs = [("v", WIRE_VERSION), ("t", "Done"), ("ref", ref), ("output", 2), ("produced", []), ("took_us", 1)]
        head = bytes([0x80 + len(pairs) + 1]) + b"".join(msgpack.packb(k) + msgpack.packb(v) for k, v in pairs)
        return [head + msgpack.packb("saw") + saw]

    ran = msgpack.packb({"fact": "ran", "node": "a"})
    hostile = {
        "too many": bytes([0xDC]) + (MAX_SAW + 1).to_bytes(2, "big") + ran * (MAX_SAW + 1),
        "not text": b"\x91" + msgpack.packb({"fact": 7}),
        "a key twice": b"\x91\x82"
        + msgpack.packb("fact")
        + msgpack.packb("ran")
        + msgpack.packb("fact")
        + msgpack.packb("finished"),
    }
    plan = iter([*hostile.values(), b"\x91" + ran, b"\x91" + ran])
    fake = FakeWorker(lambda work: done(work.ref, next(plan)))
    try:
        seen: list[dict] = []
        with Broker.embedded({"w1": Worker.at(fake.endpoint, mode="project")}) as broker:
            node = Add(1).named("a").at("w1")
            for _what in hostile:
                with pytest.raises(ProtocolError, match="could not be taken"):
                    node.forward(1, broker=broker, watching=seen.append, deadline=10)
            assert [f["fact"] for f in seen if f["fact"] == "ran"] == [], f"a hostile fact reached the watcher: {seen}"
            assert node.forward(1, broker=broker, watching=seen.append, deadline=10) == 2
            assert [(f["fact"], f["node"]) for f in seen if f["fact"] == "ran"] == [("ran", "a")]
            assert node.forward(1, broker=broker, deadline=10) == 2  # unwatched: the facts it carried are dropped
        assert len(fake.works) == len(hostile) + 2
    finally:
        fake.close()


@pytest.mark.pure
def test_what_one_done_carries_is_bounded_by_count_and_by_size_and_nothing_is_lost():
    """Held itself (pure Python, real threads): past MAX_SAW facts or HELD_BYTES of text,
    what is held goes out first, in order, then each fact as it is said; facts said from
    several threads while the serving thread releases them each leave exactly once."""
    import threading

    from somatize.fabric.worker.held import HELD_BYTES, Held

    sent: list[dict] = []
    held = Held(sent.append)
    big = "x" * (HELD_BYTES // 3)
    for i in range(3):
        held.say({"fact": "ran", "node": f"n{i}", "note": big})
    assert [f["node"] for f in sent] == ["n0", "n1", "n2"] and not held.holding  # the third did not fit
    held.say({"fact": "ran", "node": "n3"})
    assert [f["node"] for f in sent] == ["n0", "n1", "n2", "n3"] and held.take() == ()

    sent.clear()
    held = Held(sent.append)
    for i in range(MAX_SAW):
        held.say({"fact": "ran", "node": f"n{i}"})
    assert sent == [] and held.holding
    carried = held.take()
    assert [f["node"] for f in carried] == [f"n{i}" for i in range(MAX_SAW)] and not held.holding
    held.say({"fact": "ran", "node": "late"})  # said after the Done was built: sent, never lost
    assert sent == [{"fact": "ran", "node": "late"}]

    sent.clear()
    held = Held(sent.append)
    start = threading.Barrier(5)

    def say(t: int) -> None:
        start.wait()
        for i in range(200):
            held.say({"fact": "ran", "node": f"t{t}-{i}"})

    threads = [threading.Thread(target=say, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    start.wait()
    held.release()  # the piece ran long, mid-way through what its branches say
    for thread in threads:
        thread.join(30)
    said = [f["node"] for f in sent] + [f["node"] for f in held.take()]
    assert sorted(said) == sorted(f"t{t}-{i}" for t in range(4) for i in range(200))  # each once
    for t in range(4):  # and each thread's in the order it said them
        mine = [n for n in said if n.startswith(f"t{t}-")]
        assert mine == [f"t{t}-{i}" for i in range(200)]
