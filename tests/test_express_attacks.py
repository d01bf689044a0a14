"""The worker's express way in, attacked by hostile or careless peers on real sockets.

A ``Work`` naming its recipe by digest, of one scalar and nothing else, is read by msgspec
(``wire.short.express``) and asked of the conversation in one look (``WorkerSessions.recall``)
before the general way. Whatever the conversation would refuse must still be refused, with
the right sentence, and run nothing; whatever it takes must run exactly once. With
``jobs=1`` the worker also keeps each recipe's steps between calls (``Prepared``): what one
peer runs never shows in another's.

Every test waits on answers (a poll with a timeout), never on a sleep.
"""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest
import zmq
from conftest import WORKER
from fabric_nodes import Add, Count, Sleep
from reliability_support import child_env

from somatize.packing import Packer
from somatize.wire import (
    Bye,
    Done,
    Failed,
    Hello,
    Ready,
    Recipe,
    Refusal,
    Runtime,
    Saw,
    Work,
    decode,
    encode,
    recipe_digest,
    short,
)

MARGIN = 8.0  # added to every bound: the machine may be busy with others' tests
WAIT = 10.0 + MARGIN


@pytest.fixture
def worker(processes):
    """A listening worker, stopped and reaped after (conftest's ``processes``)."""
    return processes([*WORKER, "--listen", "127.0.0.1:0", "--announce"], env=child_env())


@pytest.fixture
def sockets():
    made: list[zmq.Socket] = []

    def dealer(endpoint: str) -> zmq.Socket:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        made.append(sock)
        return sock

    yield dealer
    for sock in made:
        sock.close(linger=0)


def recipe(node) -> Recipe:
    return Recipe((Packer("project").spec(node),), ("step", 0))


def digest_of(r: Recipe) -> str:
    return recipe_digest(r).digest


def by_digest(ref: int, digest: str, value, *, watched: bool = False) -> list[bytes]:
    """A Work naming its recipe by digest, of one scalar: the frame the express way reads."""
    frames = encode(Work(ref, None, value, watched=watched, recipe_digest=digest))
    assert len(frames) == 1 and type(short.express(frames[0])) is Work, "not express-shaped"
    return frames


def full(ref: int, r: Recipe, value, *, watched: bool = False) -> list[bytes]:
    return encode(Work(ref, r, value, watched=watched))


def hello() -> list[bytes]:
    return encode(Hello(Runtime.here(mode="project")))


def recv(sock: zmq.Socket, timeout: float = WAIT):
    assert sock.poll(int(timeout * 1000)), "no answer"
    return decode(sock.recv_multipart())


def ask(sock: zmq.Socket, frames: list, timeout: float = WAIT):
    sock.send_multipart(frames)
    return recv(sock, timeout)


def until(sock: zmq.Socket, last, timeout: float = WAIT) -> list:
    """Every message ``sock`` receives, up to and including the first for which ``last`` holds."""
    got = []
    while True:
        got.append(recv(sock, timeout))
        if last(got[-1]):
            return got


def greet(sock: zmq.Socket) -> Ready:
    ready = ask(sock, hello())
    assert isinstance(ready, Ready), ready
    return ready


def lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def is_done(ref: int):
    return lambda m: isinstance(m, (Done, Failed, Refusal)) and m.ref == ref


# -- a peer that never said Hello ---------------------------------------------------------


def test_a_stranger_naming_anothers_digest_the_express_way_is_told_to_say_hello_and_runs_nothing(
    worker, sockets, tmp_path
):
    counted = tmp_path / "count.txt"
    r = recipe(Count(str(counted)).named("count"))
    digest = digest_of(r)
    mine, stranger = sockets(worker.endpoint), sockets(worker.endpoint)
    greet(mine)
    done = ask(mine, full(1, r, 0))
    assert isinstance(done, Done) and list(done.output) == [0, 1, 2], done
    assert lines(counted) == 1
    # the stranger sends the very bytes the express way takes, naming a digest that is held
    # (for another peer): refused as unknown, naming its ref, and nothing runs
    for ref in (1, 2, 7):
        refused = ask(stranger, by_digest(ref, digest, 5))
        assert isinstance(refused, Refusal) and refused.hello and not refused.recipe, refused
        assert refused.ref == ref and "say Hello first" in refused.why, refused
    # the peer that sent it still runs it by digest (this also fences: FIFO answers)
    done = ask(mine, by_digest(2, digest, 10))
    assert isinstance(done, Done) and list(done.output) == [10, 11, 12], done
    assert lines(counted) == 2  # the stranger's Works ran nothing
    # once the stranger says Hello, the digest is still not its own
    greet(stranger)
    refused = ask(stranger, by_digest(3, digest, 5))
    assert isinstance(refused, Refusal) and refused.recipe and not refused.hello and refused.ref == 3, refused
    assert ask(mine, by_digest(3, digest, 1)).output.tolist() == [1, 2, 3]
    assert lines(counted) == 3
    assert not stranger.poll(0) and not mine.poll(0)


# -- the same ref twice ---------------------------------------------------------------------


def test_the_ref_of_a_running_work_sent_again_by_digest_is_refused_without_a_ref_and_answered_once(worker, sockets):
    r = recipe(Sleep(1.0).named("nap"))
    digest = digest_of(r)
    sock, probe = sockets(worker.endpoint), sockets(worker.endpoint)
    greet(sock)
    greet(probe)
    first = ask(sock, full(1, r, 1))
    assert isinstance(first, Done) and first.output == 1, first
    sock.send_multipart(by_digest(2, digest, 42))
    # a fact, not a sleep: the probe's Ready says work is running (the stand-in serves)
    ready = greet(probe)
    while ready.busy_us == 0:
        ready = greet(probe)
    sock.send_multipart(by_digest(2, digest, 99))  # the same ref, while it runs
    dup = recv(sock)
    assert isinstance(dup, Refusal) and dup.ref is None and not dup.hello and not dup.recipe, dup
    assert "already running" in dup.why, dup
    done = recv(sock)
    assert isinstance(done, Done) and done.ref == 2 and done.output == 42, done
    # a fence: the next call's answer comes next, so no second answer to ref 2 is on its way
    sock.send_multipart(full(3, recipe(Add(1).named("fence")), 7))
    got = until(sock, is_done(3))
    assert [type(m) for m in got] == [Done] and got[0].output == 8, got


# -- digests: never sent, malformed, renewed sessions --------------------------------------


def test_digests_a_peer_does_not_hold_are_refused_the_way_they_should_be(worker, sockets):
    r = recipe(Add(5).named("add5"))
    digest = digest_of(r)
    sock, other = sockets(worker.endpoint), sockets(worker.endpoint)
    greet(sock)
    greet(other)
    assert ask(sock, full(1, r, 1)).output == 6
    assert ask(other, full(1, r, 2)).output == 7
    # well formed, never sent: recipe=True, naming the ref
    never = ask(sock, by_digest(2, "sha256:" + "0" * 64, 1))
    assert isinstance(never, Refusal) and never.recipe and never.ref == 2, never
    # malformed (not express-shaped: the short way never takes it): refused, the worker serves
    bad = msgpack.unpackb(by_digest(3, digest, 1)[0])
    for wrong in ("sha256:" + "Z" * 64, "sha256:" + "0" * 63, "md5:" + "0" * 64, digest.upper(), digest + "0"):
        bad["recipe_digest"] = wrong
        frame = msgpack.packb(bad)
        assert short.express(frame) is None
        refused = ask(sock, [frame])
        assert isinstance(refused, Refusal) and not refused.hello, (wrong, refused)
        assert "recipe_digest" in refused.why, (wrong, refused)
    assert ask(sock, by_digest(4, digest, 10)).output == 15
    # another peer's Bye and Hello leave this peer's recipes as they were
    other.send_multipart(encode(Bye()))
    assert ask(sock, by_digest(5, digest, 20)).output == 25
    refused = ask(other, by_digest(2, digest, 1))
    assert isinstance(refused, Refusal) and refused.hello and refused.ref == 2, refused
    greet(other)
    refused = ask(other, by_digest(3, digest, 1))
    assert isinstance(refused, Refusal) and refused.recipe and refused.ref == 3, refused
    assert ask(sock, by_digest(6, digest, 30)).output == 35
    # this peer says Hello again: its session starts afresh, its digests are gone
    greet(sock)
    refused = ask(sock, by_digest(7, digest, 1))
    assert isinstance(refused, Refusal) and refused.recipe and not refused.hello and refused.ref == 7, refused
    assert ask(sock, full(8, r, 3)).output == 8
    assert ask(sock, by_digest(9, digest, 4)).output == 9
    assert not sock.poll(0) and not other.poll(0)


# -- interleaved: watched, unwatched, keys and placement --------------------------------------


def test_watched_unwatched_and_general_works_by_digest_interleave(worker, sockets):
    r = recipe(Add(3).named("add3"))
    digest = digest_of(r)
    sock = sockets(worker.endpoint)
    greet(sock)
    assert ask(sock, full(1, r, 0)).output == 3
    ref = 2
    for round_ in range(5):
        watched = encode(Work(ref, None, round_, watched=True, recipe_digest=digest))
        assert type(short.express(watched[0])) is Work
        sock.send_multipart(watched)
        got = until(sock, is_done(ref))
        assert isinstance(got[-1], Done) and got[-1].output == round_ + 3, got
        assert all(isinstance(m, Saw) and m.ref == ref for m in got[:-1]), got
        ref += 1
        assert ask(sock, by_digest(ref, digest, round_)).output == round_ + 3
        ref += 1
        # by digest, with keys that do not fit its recipe: the general way, still checked
        keyed = encode(Work(ref, None, 1, keys={4: "sha256:" + "1" * 64}, watched=False, recipe_digest=digest))
        assert short.express(keyed[0]) is None
        refused = ask(sock, keyed)
        assert isinstance(refused, Refusal) and refused.ref == ref and "`Work.keys` names node 4" in refused.why, (
            refused
        )
        ref += 1
        placed = encode(Work(ref, None, 1, placement={2: "cpu"}, watched=False, recipe_digest=digest))
        assert short.express(placed[0]) is None
        refused = ask(sock, placed)
        assert isinstance(refused, Refusal) and refused.ref == ref and "Work.placement" in refused.why, refused
        ref += 1
        # a float, by digest: the express way too
        assert ask(sock, encode(Work(ref, None, 2.5, watched=False, recipe_digest=digest))).output == 5.5
        ref += 1
    assert not sock.poll(0)


# -- a flood while one long piece runs ----------------------------------------------------


def test_a_flood_by_digest_while_a_long_piece_runs_is_refused_as_busy_and_the_worker_serves(worker, sockets):
    long_ = recipe(Sleep(1.5).named("long"))
    quick = recipe(Add(1).named("quick"))
    quick_digest = digest_of(quick)
    runner, flooder, probe = (sockets(worker.endpoint) for _ in range(3))
    for sock in (runner, flooder, probe):
        greet(sock)
    assert ask(flooder, full(1, quick, 1)).output == 2
    runner.send_multipart(full(1, long_, "slept"))
    ready = greet(probe)
    while ready.busy_us == 0:  # a fact: the long piece runs, and the stand-in serves
        ready = greet(probe)
    n = 300
    for ref in range(2, 2 + n):
        flooder.send_multipart(by_digest(ref, quick_digest, ref))
    refs = []
    while len(refs) < n:
        msg = recv(flooder)
        assert isinstance(msg, Refusal) and msg.why.startswith("busy:") and "`long`" in msg.why, msg
        assert not msg.recipe and not msg.hello, msg
        refs.append(msg.ref)
        if len(refs) % 100 == 0:  # the worker still answers a probe, in the middle of the flood
            assert greet(probe).busy_us > 0
    assert sorted(refs) == list(range(2, 2 + n))
    done = recv(runner)
    assert isinstance(done, Done) and done.ref == 1 and done.output == "slept", done
    # the refs refused as busy are free again: the same ref by digest now runs
    assert ask(flooder, by_digest(2, quick_digest, 100)).output == 101
    assert greet(probe).busy_us == 0
    assert not runner.poll(0) and not flooder.poll(0)


# -- two peers, one recipe: kept steps never leak -----------------------------------------


def test_two_peers_with_the_same_recipe_each_run_their_own_and_the_kept_steps_follow(worker, sockets, tmp_path):
    counted = tmp_path / "count.txt"
    r = recipe(Count(str(counted)).named("count"))
    other_content = recipe(Count(str(tmp_path / "other.txt")).named("count"))
    digest = digest_of(r)
    a, b = sockets(worker.endpoint), sockets(worker.endpoint)
    greet(a)
    greet(b)
    assert ask(a, full(1, r, 0)).output.tolist() == [0, 1, 2]
    # b has not sent it yet: refused, and nothing ran
    refused = ask(b, by_digest(1, digest, 0))
    assert isinstance(refused, Refusal) and refused.recipe, refused
    assert lines(counted) == 1
    assert ask(b, full(2, r, 100)).output.tolist() == [100, 101, 102]
    runs = 2
    for i in range(10):
        assert ask(a, by_digest(10 + i, digest, i)).output.tolist() == [i, i + 1, i + 2]
        assert ask(b, by_digest(10 + i, digest, -i)).output.tolist() == [-i, 1 - i, 2 - i]
        runs += 2
    assert lines(counted) == runs
    # a recipe of the same label, other arguments: its own steps, its own node
    assert ask(a, full(30, other_content, 5)).output.tolist() == [5, 6, 7]
    assert lines(counted) == runs and lines(tmp_path / "other.txt") == 1
    assert ask(a, by_digest(31, digest, 1)).output.tolist() == [1, 2, 3]
    # a says Hello again: b's recipe is untouched, a's is gone
    greet(a)
    assert ask(b, by_digest(40, digest, 2)).output.tolist() == [2, 3, 4]
    refused = ask(a, by_digest(41, digest, 2))
    assert isinstance(refused, Refusal) and refused.recipe and refused.ref == 41, refused
    assert lines(counted) == runs + 2
