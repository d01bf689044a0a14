"""The hot paths of the recent performance changes, attacked.

Each change took a general way and added a shorter one beside it for the common case; each
test here tries to make the short way give an answer the general way would not give: a
wrong value, a different failure, a hang, a leak, or something accepted that the general
way refuses. Wherever a message can be sent both ways, it is, and the two are compared.

- The worker's lone run (``engine.run_lone`` for a piece of one node, unwatched, keeping
  nothing) against the walk (the same node, watched), on one spawned worker.
- The client's channel taken back within ``BACK_AT_ONCE`` of its answer, not asked whether
  its link dropped, against workers killed and restarted.
- Turns taken and ended in place, under threads that the worker turns away as busy.
- The conversation's one-look paths (a ``Done`` on either side, a Work recalled by digest)
  against the general rules, fed the same messages (a ``Done`` of a subclass takes the
  general path: the fast one asks ``type(msg) is Done``).
- ``short.head_of``: headers read from a ``zmq.Frame``'s bytes at and past 64 KiB.
- ``sockets.readable``/``writable`` on closed sockets; a worker stopped under a waiting client.
- The codec registry as a token, changed from another thread while calls run.
- The engine's memos (``planned.trip_of``, ``plan.check``'s listing token) across brokers.

Real sockets and real processes throughout; every wait is bounded by a poll or a join with
a timeout, never a sleep before acting.

No short way was made to answer otherwise than its general way. Three older faults it
found: ``Channel._check_kinds`` looked at the registry after ``encode`` used it (a codec
forgotten in between let a kind the worker cannot read through), and a network-mode worker
kept the first codec it got for a kind (one registered again in another format gave a
wrong value): both mended, their tests pass. ``Transport._watch_link`` reads a peer that
hangs up during the handshake as keys refused: kept, ``xfail(strict=True)`` with the fault
named.
"""

from __future__ import annotations

import copy
import os
import pickle
import re
import signal
import socket
import threading
import time

import msgpack
import pytest
import zmq
from conftest import WORKER, Process
from fabric_nodes import Add, Count, Pid, Sleep
from peers import RT, FakeWorker, Raw, curve_router, socket_peer, within
from reliability_support import child_env

from somatize import (
    Broken,
    Broker,
    Busy,
    FolderStore,
    KeysRefused,
    Node,
    NodeFailed,
    Overdue,
    ProtocolError,
    Refused,
    SomatizeError,
    UnknownHost,
    Unreachable,
    Worker,
    codec,
)
from somatize.codec import forget
from somatize.codec.registered import registered_now
from somatize.engine import Piece, run_lone, run_piece
from somatize.fabric import sockets as fabric_sockets
from somatize.fabric.client import transport
from somatize.fabric.curve import speaks_curve
from somatize.fabric.pieces import piece_of
from somatize.fabric.worker.loop import WorkerLoop
from somatize.fabric.worker.prepared import Prepared
from somatize.fabric.worker.slots import Abandoned, Job
from somatize.graph import Step
from somatize.packing import Catalog, Packer
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
    Send,
    Work,
    encode,
    limits,
    recipe_digest,
    short,
)

MARGIN = 8.0  # added to every bound: the machine may be busy with others' tests
WAIT = 10.0 + MARGIN
PATIENCE = 2.0


# -- nodes the spawned workers build by name (this module is on their path) ----------------


class BadStr(Exception):
    """An exception that cannot say what it is: its ``str`` raises."""

    def __str__(self) -> str:
        raise RuntimeError("no words for it")


def _fail_here(how: str):
    """A frame of its own, named, that every traceback of these failures has to hold."""
    if how == "value":
        raise ValueError("lone trouble")
    if how == "exit":
        raise SystemExit(3)
    if how == "interrupt":
        raise KeyboardInterrupt("stop it")
    if how == "generator":
        raise GeneratorExit("closed")
    if how == "bad str":
        raise BadStr()
    if how == "unwritable":
        return object()
    if how == "too deep":  # nests past what any reader accepts: over the wire's limits
        nested: list = []
        for _ in range(80):
            nested = [nested]
        return nested
    if how == "over the header limit":  # many small values: all in the header
        return ["abcd"] * 20_000
    if how == "itself":
        looped: list = []
        looped.append(looped)
        return looped
    raise AssertionError(how)


class Raiser(Node):
    """Fails the way it is told (raises, or returns what cannot travel back)."""

    def __init__(self, how: str) -> None:
        self.how = how

    def forward(self, x):
        return _fail_here(self.how)


class Echo(Node):
    def forward(self, x):
        return x


class Wrap(Node):
    """Wraps what it is given in a list: tells how often, and in what order, it ran."""

    def forward(self, x):
        return [x]


class Reading:
    """A type of ours that crosses only through a codec registered for it."""

    def __init__(self, hz: float) -> None:
        self.hz = hz

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Reading) and other.hz == self.hz

    __hash__ = None  # type: ignore[assignment]


# -- helpers ---------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def spec_of(node, label: str = "n", cache: bool = False):
    step = node.named(label)
    if cache:
        step = step.cached()
    return Packer("project").spec(step.steps[0])


def full(ref: int, recipe: Recipe, value, *, watched: bool = False, **fields) -> list[bytes]:
    return encode(Work(ref, recipe, value, watched=watched, **fields))


def by_digest(ref: int, digest: str, value, *, watched: bool = False, **fields) -> list[bytes]:
    return encode(Work(ref, None, value, watched=watched, recipe_digest=digest, **fields))


def final(raw: Raw, ref: int, timeout: float = WAIT):
    """The answer that ends work ``ref`` on ``raw`` (its Saws skipped)."""
    while True:
        msg = raw.answer(timeout)
        assert msg is not None, f"no answer to work {ref}"
        if isinstance(msg, Saw):
            assert msg.ref == ref, msg  # what a watched work says is its own
            continue
        return msg


def greeted(endpoint: str) -> Raw:
    raw = Raw(endpoint)
    ready = raw.ask(Hello(Runtime.here(mode="project")))
    assert isinstance(ready, Ready), ready
    return raw


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """One listening project-mode worker (one job) for the tests that only talk to it."""
    worker = Process(
        [*WORKER, "--listen", "127.0.0.1:0", "--announce"], env=child_env(), logs=tmp_path_factory.mktemp("logs")
    )
    yield worker
    worker.stop()


@pytest.fixture
def raws():
    made: list[Raw] = []

    def make(endpoint: str, *, greet: bool = True) -> Raw:
        raw = greeted(endpoint) if greet else Raw(endpoint)
        made.append(raw)
        return raw

    yield make
    for raw in made:
        raw.close()


@pytest.fixture
def serving():
    """``serving(**options)``: a WorkerLoop serving on a thread of this process (so a test may
    count what it calls); every one is stopped and joined after."""
    started: list[tuple[WorkerLoop, threading.Thread]] = []

    def start(**options) -> tuple[WorkerLoop, str, threading.Thread]:
        loop = WorkerLoop(mode="project", **options)
        endpoint = loop.bind("tcp://127.0.0.1:0")
        thread = threading.Thread(target=loop.serve, daemon=True)
        thread.start()
        started.append((loop, thread))
        return loop, endpoint, thread

    yield start
    for loop, thread in started:
        loop.stopping.set()
        thread.join(10)
        assert not thread.is_alive(), "a worker loop did not stop"


# == 1. the worker's lone run =================================================================

FAILURES = ["value", "exit", "interrupt", "generator", "bad str", "unwritable", "too deep", "itself"]


def _failure(call):
    try:
        call()
    except SomatizeError as exc:
        return exc
    raise AssertionError("the call did not fail")


@pytest.mark.parametrize("how", FAILURES)
def test_a_lone_node_fails_on_a_worker_exactly_as_the_walk_says_it_fails(spawned, how):
    """Attack: a node alone, unwatched (run by ``run_lone``), that raises an Exception,
    SystemExit, KeyboardInterrupt, GeneratorExit, an exception whose ``str`` raises, or that
    returns something unwritable or nested past the wire's limits. The same node, watched on
    the same worker, takes the walk: both answers have to be the same failure (type, first
    line, node, error, host), each traceback holding the node's own frame."""
    node = Raiser(how).named("raiser").at("w1")
    with Broker.embedded({"w1": Worker.at(spawned.endpoint, mode="project")}, patience=PATIENCE) as broker:
        alone = within(WAIT, lambda: _failure(lambda: node.forward(1, broker=broker)))
        walked = within(WAIT, lambda: _failure(lambda: node.forward(1, broker=broker, watching=lambda fact: None)))
        again = within(WAIT, lambda: _failure(lambda: node.forward(2, broker=broker)))  # its steps kept now
        assert Add(1).named("after").at("w1").forward(1, broker=broker) == 2  # the worker serves on
    for failure in (alone, walked, again):
        assert type(failure) is type(alone)
        assert str(failure).splitlines()[0] == str(alone).splitlines()[0]
        if isinstance(alone, NodeFailed):
            assert (failure.node, failure.error, failure.host) == (alone.node, alone.error, alone.host)
            assert bool(failure.remote_traceback) == bool(alone.remote_traceback)
            if how not in ("unwritable", "too deep", "itself"):  # a node that raised: its frame is there
                assert failure.remote_traceback and "_fail_here" in failure.remote_traceback
    if how in ("value", "exit", "interrupt", "generator"):
        expected = {
            "value": "ValueError",
            "exit": "SystemExit",
            "interrupt": "KeyboardInterrupt",
            "generator": "GeneratorExit",
        }[how]
        assert isinstance(alone, NodeFailed) and alone.error == expected and alone.node == "raiser"
        assert str(alone).startswith(f"node `raiser` on `w1` raised {expected}")


def test_the_worker_takes_the_lone_run_for_every_kind_of_failure_and_the_walk_when_watched(serving, monkeypatch):
    """Attack, counted: the comparison above is only worth something if the unwatched call
    really ran alone. On a loop in this process, ``run_lone`` is counted for each failure
    kind unwatched, and ``run_piece`` for each watched; the answers agree as above. Here the
    header limit is lowered, so an output over it is cheap to make."""
    import somatize.fabric.worker.running as worker_running

    walks, alone = [], []
    monkeypatch.setattr(
        worker_running, "run_piece", lambda piece, watch=None: walks.append(1) or run_piece(piece, watch)
    )
    monkeypatch.setattr(worker_running, "run_lone", lambda step, value: alone.append(1) or run_lone(step, value))
    # lowered on both sides (one process): a header of a few thousand short strings is over it
    monkeypatch.setattr(limits, "MAX_HEADER", 64 << 10)
    _, endpoint, _ = serving()
    with Broker.embedded({"w1": Worker.at(endpoint, mode="project")}, patience=PATIENCE) as broker:
        for how in ("exit", "interrupt", "generator", "too deep", "over the header limit"):
            node = Raiser(how).named("raiser").at("w1")
            before = (len(alone), len(walks))
            a = within(WAIT, lambda: _failure(lambda: node.forward(1, broker=broker)))
            assert (len(alone), len(walks)) == (before[0] + 1, before[1]), how
            w = within(WAIT, lambda: _failure(lambda: node.forward(1, broker=broker, watching=lambda f: None)))
            assert (len(alone), len(walks)) == (before[0] + 1, before[1] + 1), how
            # a watched Done carries what its work said: a header over the limit is that much longer
            first = [re.sub(r"[\d,]+ bytes", "N bytes", str(e).splitlines()[0]) for e in (a, w)]
            assert type(a) is type(w) and first[0] == first[1], first


SHAPES = [
    ("step", 0),
    ("seq", (("step", 0),)),
    ("seq", (("seq", (("step", 0),)),)),
    ("par", (("step", 0),)),
    ("seq", (("step", 0), ("step", 0))),
    ("par", (("step", 0), ("step", 0))),
    ("seq", (("par", (("step", 0), ("step", 0))), ("step", 0))),
]


@pytest.mark.parametrize("shape", SHAPES, ids=[repr(s)[:40] for s in SHAPES])
def test_a_one_node_recipe_of_any_shape_answers_what_the_walk_answers(spawned, raws, shape):
    """Attack from a raw client: a recipe of one node whose shape is not ``("step", 0)``
    (the node run twice in a row, in parallel, a tuple of one...). Only a shape that is that
    node from input to output may run alone; whatever runs, the output has to be what the
    walk (watched, on the same worker) and ``run_piece`` here give, sent in full or by digest."""
    recipe = Recipe((spec_of(Wrap(), "wrap"),), shape)
    digest = recipe_digest(recipe).digest
    expected = run_piece(Piece("", (Step(Wrap(), name="wrap"),), shape, 10, {})).output
    raw = raws(spawned.endpoint)
    raw.send_frames(full(1, recipe, 10))
    answers = [final(raw, 1)]
    raw.send_frames(full(2, recipe, 10, watched=True))
    answers.append(final(raw, 2))
    raw.send_frames(by_digest(3, digest, 10))  # the express way in: recalled, then run
    answers.append(final(raw, 3))
    raw.send_frames(by_digest(4, digest, 10, watched=True))
    answers.append(final(raw, 4))
    raw.send_frames(by_digest(5, digest, 10))  # its steps kept now
    answers.append(final(raw, 5))
    for answer in answers:
        assert type(answer) is Done and answer.output == expected and answer.produced == {}, (shape, answer)


def _header(frames: list[bytes]) -> dict:
    return msgpack.unpackb(frames[0], strict_map_key=False)


@pytest.mark.parametrize(
    "shape, extra",
    [
        (["step", 1], False),
        (["step", -1], False),
        (["seq", [["step", 0], ["step", 1]]], False),
        (["par", []], False),
        (["step", True], False),
        (["loop", 0], False),
        (["step", 0], True),
        (["step", 1], True),
    ],
    ids=[
        "step 1",
        "step -1",
        "seq naming 1",
        "empty par",
        "step True",
        "unknown",
        "a second node never used",
        "the first node never used",
    ],
)
def test_a_recipe_whose_shape_does_not_fit_its_nodes_is_refused_alike_watched_or_not(spawned, raws, shape, extra):
    """Attack from a raw client: a header written by hand, a recipe whose shape names a step
    it does not have, or of two nodes whose shape runs one alone (the lone run's shape, with
    a node to spare). Refused (naming the work) the same way unwatched (which would run
    alone) and watched, nothing run, and the worker serves on."""
    recipe = Recipe((spec_of(Add(1), "inc"),), ("step", 0))
    spare = msgpack.unpackb(full(9, Recipe((spec_of(Add(100), "spare"),), ("step", 0)), 0)[0], strict_map_key=False)[
        "recipe"
    ]["nodes"][0]
    raw = raws(spawned.endpoint)
    refusals = []
    for ref, watched in ((1, False), (2, True)):
        header = _header(full(ref, recipe, 10, watched=watched))
        header["recipe"]["shape"] = shape
        if extra:
            header["recipe"]["nodes"].append(spare)
        raw.send_frames([msgpack.packb(header)])
        refused = final(raw, ref)
        assert isinstance(refused, Refusal) and refused.ref == ref, refused
        refusals.append(refused.why)
    assert refusals[0] == refusals[1]
    raw.send_frames(full(3, recipe, 10))
    assert final(raw, 3).output == 11


@pytest.mark.parametrize("cache", [False, True], ids=["not cached", "cached"])
def test_keys_naming_the_one_step_take_the_walk_and_keep_what_the_walk_keeps(spawned, raws, cache):
    """Attack: a one-node recipe with ``keys`` naming step 0 (something to keep): it may not run
    alone. Unwatched and watched answer the same output, and the same ``produced`` (the
    output under step 0 when the step is cached, nothing when it is not)."""
    recipe = Recipe((spec_of(Add(1), "inc", cache=cache),), ("step", 0))
    key = "sha256:" + "1" * 64
    raw = raws(spawned.endpoint)
    answers = []
    for ref, watched in ((1, False), (2, True)):
        raw.send_frames(full(ref, recipe, 10, watched=watched, keys={0: key}))
        answers.append(final(raw, ref))
    for answer in answers:
        assert type(answer) is Done and answer.output == 11, answer
        assert answer.produced == ({0: 11} if cache else {}), answer


@pytest.mark.pure
def test_an_abandoned_job_stops_its_lone_node_before_it_runs(tmp_path):
    """Attack: revocation. A recipe's kept steps are guarded; once the job they report to is
    abandoned (its peer's key revoked), the lone run must refuse to run the node, as the walk
    does, and the node must not run at all."""
    counted = tmp_path / "count.txt"
    node = Count(str(counted))
    recipe = Recipe((Packer("project").spec(node.named("count").steps[0]),), ("step", 0))
    prepared = Prepared(Catalog("project"))
    work = Work(1, recipe, 0, watched=False)
    first = Job("count")
    steps, lone = prepared.prepare(work, [node], first)
    assert lone is steps[0]
    assert list(run_lone(lone, 0)) == [0, 1, 2] and counted.read_text() == "x\n"
    second = Job("count")
    again, lone_again = prepared.prepare(work, [node], second)  # kept: the guard swaps its job
    assert lone_again is lone
    second.abandoned = True
    with pytest.raises(NodeFailed) as alone:
        run_lone(lone_again, 0)
    with pytest.raises(NodeFailed) as walked:
        run_piece(piece_of(work, again))
    for failed in (alone.value, walked.value):
        assert isinstance(failed.__cause__, Abandoned) and failed.node == "count"
    assert str(alone.value) == str(walked.value)
    assert counted.read_text() == "x\n"  # ran once, before it was abandoned


def test_a_worker_with_more_than_one_job_never_runs_a_node_alone(serving, monkeypatch):
    """Attack: with ``jobs=2`` pieces run in slots, each made for itself: the lone run (which
    needs steps kept across calls) must never be taken, express calls included."""
    import somatize.fabric.worker.running as worker_running

    alone, walks = [], []
    monkeypatch.setattr(worker_running, "run_lone", lambda step, value: alone.append(1) or run_lone(step, value))
    monkeypatch.setattr(
        worker_running, "run_piece", lambda piece, watch=None: walks.append(1) or run_piece(piece, watch)
    )
    _, endpoint, _ = serving(jobs=2)
    node = Add(1).named("inc").at("w1")
    with Broker.embedded({"w1": Worker.at(endpoint, mode="project")}, patience=PATIENCE) as broker:
        assert [node.forward(i, broker=broker) for i in range(10)] == list(range(1, 11))
        with pytest.raises(NodeFailed, match="raised SystemExit"):
            Raiser("exit").named("raiser").at("w1").forward(1, broker=broker)
    assert alone == [] and len(walks) == 11


def test_works_queued_back_to_back_are_each_answered_in_order_and_a_bye_between_is_honoured(spawned, raws):
    """Attack on the loop's return to its poll after each lone run: forty Works by digest
    sent back to back (no wait between), a Bye after the twentieth, then twenty more. Each of
    the first twenty is answered once, in order, with its own value; a Bye ends the session,
    so each after it is refused as from a stranger (naming its ref, in order). Then a Hello
    brings the peer back."""
    recipe = Recipe((spec_of(Add(1), "inc"),), ("step", 0))
    digest = recipe_digest(recipe).digest
    raw = raws(spawned.endpoint)
    raw.send_frames(full(1, recipe, 0))
    assert final(raw, 1).output == 1
    for ref in range(2, 22):
        raw.send_frames(by_digest(ref, digest, ref * 10))
    raw.send(Bye())
    for ref in range(22, 42):
        raw.send_frames(by_digest(ref, digest, ref * 10))
    got = [raw.answer(WAIT) for _ in range(40)]
    assert [(type(m), m.ref) for m in got[:20]] == [(Done, ref) for ref in range(2, 22)], got[:20]
    assert [m.output for m in got[:20]] == [ref * 10 + 1 for ref in range(2, 22)]
    assert all(isinstance(m, Refusal) and m.hello for m in got[20:]), got[20:]
    assert [m.ref for m in got[20:]] == list(range(22, 42))
    assert raw.answer(0.2) is None  # nothing more: no work answered twice
    assert isinstance(raw.ask(Hello(Runtime.here(mode="project"))), Ready)
    raw.send_frames(full(50, recipe, 5))
    assert final(raw, 50).output == 6


def test_a_stop_between_queued_works_is_honoured_and_what_was_answered_is_a_prefix(serving, raws):
    """Attack: twenty slow Works queued back to back on a loop that runs each alone; the loop
    is stopped once the first answer is out. It has to stop within a bound (not run the
    queue out), and the answers it gave are the first ones, in order, each once."""
    loop, endpoint, thread = serving()
    # shorter than the stand-in's wait (`STAND_IN_AFTER`): each runs where it arrived
    recipe = Recipe((spec_of(Sleep(0.004), "nap"),), ("step", 0))
    digest = recipe_digest(recipe).digest
    raw = raws(endpoint)
    raw.send_frames(full(1, recipe, 1))
    assert final(raw, 1).output == 1
    n = 400
    for ref in range(2, 2 + n):
        raw.send_frames(by_digest(ref, digest, ref))
    first = raw.answer(WAIT)
    assert isinstance(first, (Done, Refusal)) and first.ref == 2, first
    stopped = time.monotonic()
    loop.stopping.set()
    thread.join(WAIT)
    assert not thread.is_alive()
    assert time.monotonic() - stopped < 1.0, "the stop waited for the queue (1.6 s of it)"
    got = [first]
    while (msg := raw.answer(0.2)) is not None:
        got.append(msg)
    # a piece that ran long (a busy machine) has its neighbours refused as busy: still one
    # answer each, in the order sent
    assert all(isinstance(m, Done) or (isinstance(m, Refusal) and m.why.startswith("busy:")) for m in got), got
    refs = [m.ref for m in got]
    assert refs == list(range(2, 2 + len(refs))), refs
    assert all(m.output == m.ref for m in got if isinstance(m, Done))
    assert len(refs) < n, "the stop was not honoured: the whole queue ran"


# == 2. a channel taken back at once is not asked about its link ==============================


@pytest.fixture
def procs(tmp_path):
    """Start processes with ``procs(argv)`` (this tree importable); each is stopped and reaped after."""
    started: list[Process] = []

    def start(argv: list[str]) -> Process:
        process = Process(argv, logs=tmp_path / "logs", env=child_env())
        started.append(process)
        return process

    yield start
    for process in reversed(started):
        process.stop()


def _listening(port: int) -> list[str]:
    return [*WORKER, "--listen", f"127.0.0.1:{port}", "--announce"]


def _idle_channel(broker: Broker, host: str = "w1"):
    (channel,) = broker._channels.idle[host]
    return channel


TYPED = (Broken, Unreachable, Overdue, Busy)


def test_a_worker_killed_and_restarted_between_two_calls_is_recovered_as_before(procs):
    """Attack: SIGKILL, then a new worker on the same port, between two calls. The second call
    comes long after the first's answer (the restart takes far more than ``BACK_AT_ONCE``), so
    the channel is asked whether its link dropped, and a fresh one serves it: the caller sees
    nothing, as before the change."""
    port = free_port()
    worker = procs(_listening(port))
    node = Add(1).named("inc").at("w1")
    with Broker.embedded({"w1": Worker.at(f"tcp://127.0.0.1:{port}", mode="project")}, patience=PATIENCE) as broker:
        for round_ in range(1):
            assert [node.forward(i, broker=broker) for i in range(3)] == [1, 2, 3]
            worker.signal(signal.SIGKILL)
            worker.popen.wait(WAIT)
            worker = procs(_listening(port))
            assert within(WAIT, lambda: [node.forward(i, broker=broker) for i in range(3)]) == [1, 2, 3], round_


def test_a_worker_killed_right_after_answering_fails_the_next_call_typed_or_serves_it(procs, monkeypatch):
    """Attack: the worker is SIGKILLed the instant it has answered, and the next call follows
    at once, on the same thread, within ``BACK_AT_ONCE`` of the answer as a rule: its channel
    is taken back unasked and its Work goes down a link that is dying or dead. The last round
    makes sure of the window (the channel marked given back just now, right after the kill,
    the worker still dying). Each such call has to end within a patience or so with a typed
    error (or its answer, if the kill lost the race), never a hang or a wrong value; once a
    worker is back on the port, calls are served again. How soon after its give-back each
    channel was taken again is recorded."""
    taken_after: list[float] = []
    real = transport.Transport.dropped_while_idle

    def timed(self):
        taken_after.append(time.monotonic() - self.idle_since)
        return real(self)

    monkeypatch.setattr(transport.Transport, "dropped_while_idle", timed)
    port = free_port()
    worker = procs(_listening(port))
    node = Add(1).named("inc").at("w1")
    outcomes, post_kill = [], []
    # a link that hangs up during its handshake is read as keys refused: the pre-existing
    # misreading pinned by `test_a_peer_that_hangs_up_during_the_handshake_...` below
    tolerated = (*TYPED, KeysRefused)
    with Broker.embedded({"w1": Worker.at(f"tcp://127.0.0.1:{port}", mode="project")}, patience=PATIENCE) as broker:
        for round_ in range(2):
            assert [node.forward(i, broker=broker) for i in range(3)] == [1, 2, 3]
            os.kill(worker.pid, signal.SIGKILL)
            if round_ == 1:  # the window, for certain: its give-back stamped ahead, so no
                # scheduling delay on a busy machine can carry the borrow past it
                _idle_channel(broker).transport.idle_since = time.monotonic() + 3600
            looked = len(taken_after)
            started = time.monotonic()
            try:  # on this thread: a thread of its own would start the call too late
                outcomes.append(node.forward(41, broker=broker))
            except tolerated as exc:
                outcomes.append(type(exc))
            assert time.monotonic() - started < PATIENCE * 4 + MARGIN
            post_kill.extend(taken_after[looked : looked + 1])
            worker.popen.wait(WAIT)
            worker = procs(_listening(port))
            served = None
            for _ in range(3):  # back: the first call or the next serves
                try:
                    served = within(WAIT, lambda: node.forward(9, broker=broker))
                    break
                except tolerated:
                    continue
            assert served == 10, round_
    assert all(o == 42 or o in tolerated for o in outcomes), outcomes
    assert post_kill[-1] < transport.BACK_AT_ONCE, post_kill


@pytest.mark.parametrize("restarted", [False, True], ids=["dead", "restarted on the port"])
def test_a_channel_taken_back_unasked_after_its_worker_died_ends_typed_and_recovers(procs, restarted):
    """Attack, made certain: the worker is killed and reaped (its link's drop already told),
    optionally replaced on the same port, and its idle channel is then taken back as if just
    given back (``idle_since`` stamped ahead: the check is skipped for certain). The call must end in
    bounded time with a typed error or its right answer; the calls after it are served once
    a worker is there."""
    port = free_port()
    worker = procs(_listening(port))
    node = Add(1).named("inc").at("w1")
    with Broker.embedded({"w1": Worker.at(f"tcp://127.0.0.1:{port}", mode="project")}, patience=PATIENCE) as broker:
        assert [node.forward(i, broker=broker) for i in range(3)] == [1, 2, 3]
        worker.signal(signal.SIGKILL)
        worker.popen.wait(WAIT)
        if restarted:
            worker = procs(_listening(port))
        _idle_channel(broker).transport.idle_since = time.monotonic() + 3600  # stamped ahead: never asked
        started = time.monotonic()
        try:
            outcome = within(PATIENCE * 4 + MARGIN, lambda: node.forward(41, broker=broker))
        except TYPED as exc:
            outcome = exc
        assert outcome == 42 or isinstance(outcome, TYPED), outcome
        assert time.monotonic() - started < PATIENCE * 3 + MARGIN
        if not restarted:
            with pytest.raises(TYPED):  # nobody there: said within a patience or so
                within(PATIENCE * 4 + MARGIN, lambda: node.forward(1, broker=broker))
            worker = procs(_listening(port))
        assert within(WAIT, lambda: [node.forward(i, broker=broker) for i in range(3)]) == [1, 2, 3]
        assert broker._turns._hosts == {}


def _hang_up(conn, stop) -> None:
    """A peer that accepts a connection and hangs up at once (``socket_peer`` closes it)."""


def test_a_peer_that_hangs_up_during_the_handshake_is_not_told_as_keys_refused():
    """Attack (seen when a worker is killed right after answering, on a busy machine: the
    next call's link reached the port while the dying process still held it): a port that
    accepts each connection and hangs up at once. Neither side has keys; the call has to
    end with a typed error about reaching the worker, not one saying it listens with keys."""
    with socket_peer(_hang_up) as (port, _):
        with Broker.embedded({"w1": Worker.at(f"tcp://127.0.0.1:{port}", mode="project")}, patience=PATIENCE) as broker:
            try:
                within(WAIT, lambda: Add(1).named("inc").at("w1").forward(1, broker=broker))
                outcome = None
            except SomatizeError as exc:
                outcome = exc
    assert isinstance(outcome, SomatizeError), outcome
    assert not isinstance(outcome, KeysRefused), str(outcome)


def test_a_broker_address_that_hangs_up_is_unreachable_not_keys_refused():
    """The same hang-up where a client looks for its broker (the control socket's handshake,
    ``Rendezvous.ask``): nobody there that speaks, so ``Unreachable``, with no word of keys."""
    with socket_peer(_hang_up) as (port, _):
        broker = Broker.at(f"tcp://127.0.0.1:{port}", patience=PATIENCE)
        try:
            with pytest.raises(Unreachable) as caught:
                within(WAIT, broker.hosts)
        finally:
            broker.close()
    assert "key" not in str(caught.value).lower(), caught.value


def test_the_greeting_probe_tells_curve_from_null_from_nobody(tmp_path):
    """``curve.speaks_curve``, what tells keys refused from a hang-up, against real ZeroMQ
    servers: one with CURVE (tcp and ipc), one without, a port that hangs up, one where
    nobody listens, and an address of another transport."""
    servers = []
    try:
        for curve, where in (
            (True, "tcp://127.0.0.1:*"),
            (False, "tcp://127.0.0.1:*"),
            (True, f"ipc://{tmp_path}/curve.sock"),
        ):
            server = curve_router() if curve else zmq.Context.instance().socket(zmq.ROUTER)
            server.linger = 0
            server.bind(where)
            servers.append((curve, server.getsockopt_string(zmq.LAST_ENDPOINT), server))
        for curve, address, _ in servers:
            assert speaks_curve(address, 2.0) is curve, address
        with socket_peer(_hang_up) as (port, _):
            assert speaks_curve(f"tcp://127.0.0.1:{port}", 2.0) is None
        nobody = socket.socket()
        nobody.bind(("127.0.0.1", 0))
        free = nobody.getsockname()[1]
        nobody.close()
        assert speaks_curve(f"tcp://127.0.0.1:{free}", 2.0) is None
        assert speaks_curve("inproc://somewhere", 2.0) is None
        assert speaks_curve("tcp://not-an-address", 2.0) is None
    finally:
        for _, _, server in servers:
            server.close(0)


# == 3. turns taken and ended in place ========================================================


def _hammer(broker: Broker, node, threads: int, calls: int) -> tuple[list, list, list]:
    """``threads`` threads, ``calls`` forwards each: (wrong answers, errors, each call's seconds)."""
    wrong, errors, took = [], [], []
    lock = threading.Lock()
    go = threading.Barrier(threads)

    def run(base: int) -> None:
        go.wait(WAIT)
        for i in range(calls):
            started = time.monotonic()
            try:
                out = node.forward(base + i, broker=broker)
            except BaseException as exc:  # noqa: BLE001 - said on the test's thread
                out = exc
            with lock:
                took.append(time.monotonic() - started)
                if isinstance(out, BaseException):
                    errors.append(out)
                elif out != base + i:
                    wrong.append((base + i, out))

    running = [threading.Thread(target=run, args=(k * 1000,), daemon=True) for k in range(threads)]
    for thread in running:
        thread.start()
    for thread in running:
        thread.join(WAIT * 3)
    assert not any(thread.is_alive() for thread in running), "a thread still waits"
    return wrong, errors, took


def test_many_threads_on_one_job_take_turns_without_busy_without_a_missed_wake_up(spawned, monkeypatch):
    """Attack on the turn taken and ended in place: eight threads, eight calls each, to one
    worker with one job, so the worker turns most of them away as busy (counted: it did). No
    call may hear Busy (only this client's work fills the worker), none may wait for the
    ``LOOK_AGAIN`` second that only a missed hand-on costs, and nothing is left in the turns."""
    from somatize.fabric.client.turns import LOOK_AGAIN, Turns

    refused = []
    real = Turns._turned_away

    def counted(self, *args, **kwargs):
        refused.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Turns, "_turned_away", counted)
    # longer than the worker's stand-in waits (`STAND_IN_AFTER`): the rest are refused as busy
    node = Sleep(0.025).named("nap").at("w1")
    with Broker.embedded({"w1": Worker.at(spawned.endpoint, mode="project")}, patience=PATIENCE) as broker:
        wrong, errors, took = _hammer(broker, node, threads=8, calls=8)
        assert broker._turns._hosts == {}
    assert not wrong and not errors, (wrong, errors[:3])
    assert len(took) == 64
    assert refused, "the worker never turned a call away: the turns were not attacked"
    assert max(took) < 0.9 * LOOK_AGAIN, f"a call waited {max(took):.2f} s: a hand-on was missed"


def test_someone_elses_long_work_makes_every_call_busy_at_once_and_then_each_is_served(spawned, raws):
    """Attack: another client's long piece fills the one job while eight threads of this
    client call: each call has to hear Busy (someone else's work), at once, never waiting in
    line for a second; once it returns, all are served and no turn is left behind."""
    other = raws(spawned.endpoint)
    probe = raws(spawned.endpoint)
    other.send_frames(full(1, Recipe((spec_of(Sleep(2.5), "long"),), ("step", 0)), "slept"))
    ready = probe.ask(Hello(Runtime.here(mode="project")))
    while ready.busy_us == 0:  # a fact: the long piece runs
        ready = probe.ask(Hello(Runtime.here(mode="project")))
    node = Add(0).named("zero").at("w1")
    with Broker.embedded({"w1": Worker.at(spawned.endpoint, mode="project")}, patience=PATIENCE) as broker:
        wrong, errors, took = _hammer(broker, node, threads=8, calls=2)
        assert broker._turns._hosts == {}
        assert not wrong
        assert errors and all(isinstance(e, Busy) and "long" in str(e) for e in errors), errors[:3]
        assert max(took) < 0.9, f"a call waited {max(took):.2f} s to hear Busy"
        done = final(other, 1)
        assert isinstance(done, Done) and done.output == "slept"
        wrong, errors, took = _hammer(broker, node, threads=8, calls=5)
        assert not wrong and not errors and broker._turns._hosts == {}


# == 4. the conversation's one-look paths ======================================================


_DIGEST_NEVER = "sha256:" + "0" * 64


ODD = 10  # the input the played worker answers wrongly; the calls before it warm the channel
WAYS = {"express": {}, "deadline": {"deadline": 60.0}, "watched": {"watching": lambda fact: None}}


def _answer_to(scenario: str):
    def answer(work):
        right = Done(work.ref, work.input + 1, {}, 7)
        if work.input != ODD:
            return right
        wrong = Done(work.ref, -1, {}, 7)
        if scenario == "another ref first":
            return Done(work.ref + 1000, -1, {}, 7), right
        if scenario == "answered twice":
            return right, wrong
        if scenario == "busy, then a done":
            return Refusal("busy: someone else's", ref=work.ref), wrong
        if scenario == "a failure, then a done":
            return Failed(work.ref, "ValueError: no", "a", "ValueError", ""), wrong
        if scenario == "a send for nothing, then a done":
            return Send(work.ref + 1000, ("sha256:" + "b" * 64,)), right
        raise AssertionError(scenario)

    return answer


def _ended(fake: FakeWorker, call) -> tuple:
    """How ``call`` ended: ("value", it), or the class and first line of what it raised (the
    played worker's endpoint, which differs from one to the next, left out)."""
    try:
        return ("value", within(WAIT, call))
    except SomatizeError as exc:
        return (type(exc).__name__, str(exc).splitlines()[0].replace(fake.endpoint, "<endpoint>"))


SCENARIOS = [
    "another ref first",
    "answered twice",
    "busy, then a done",
    "a failure, then a done",
    "a send for nothing, then a done",
]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_a_done_out_of_turn_is_taken_alike_by_the_express_call_and_the_general_ones(played, scenario):
    """Attack over a real socket on the client's one-look Done: a Done for another ref before
    its own, a second Done for a work already answered, a Done after the work was refused as
    busy or failed. The call (express, with a deadline, watched) ends the same way each time,
    and the stray Done is dropped as stale by the next call: never taken for its answer."""
    outcomes = {}
    for way, options in WAYS.items():
        fake = played(_answer_to(scenario))
        node = Add(1).named("a").at("w1")
        with Broker.embedded({"w1": Worker.at(fake.endpoint, mode="project")}, patience=PATIENCE) as broker:
            assert [node.forward(i, broker=broker, **options) for i in (1, 2)] == [2, 3]
            outcomes[way] = _ended(fake, lambda o=options: node.forward(ODD, broker=broker, **o))
            assert [node.forward(i, broker=broker, **options) for i in (3, 4)] == [4, 5], way  # never -1
            outcomes[way] += (len(fake.hellos), len(fake.works))  # greeted again, sent again: alike
    assert outcomes["express"] == outcomes["deadline"] == outcomes["watched"], outcomes


def test_a_done_arriving_while_greeting_is_refused_alike_whichever_way_the_call_went(played, monkeypatch):
    """Attack: the played worker answers the Hello with a Done (for the very Work that went
    right behind the Hello) before its Ready. The exchange is greeting, not working: the Done
    may not be taken, however the call was made, and the next call is served on a fresh
    channel."""
    import itertools

    from somatize.fabric.client import channel as channel_module

    outcomes = {}
    for way, options in WAYS.items():
        monkeypatch.setattr(channel_module, "_refs", itertools.count(5000))
        fake = played(
            lambda work: Done(work.ref, work.input + 1, {}, 7),
            greet=lambda hello, n: (Done(5000, -1, {}, 7), Ready(RT)) if n == 1 else Ready(RT),
        )
        node = Add(1).named("a").at("w1")
        with Broker.embedded({"w1": Worker.at(fake.endpoint, mode="project")}, patience=PATIENCE) as broker:
            outcomes[way] = _ended(fake, lambda o=options: node.forward(1, broker=broker, **o))
            assert within(WAIT, lambda o=options: node.forward(3, broker=broker, **o)) == 4
    assert outcomes["express"] == outcomes["deadline"] == outcomes["watched"], outcomes
    assert outcomes["express"][0] == "ProtocolError", outcomes


def _fields(refusal) -> tuple:
    assert isinstance(refusal, Refusal), refusal
    return (refusal.why, refusal.ref, refusal.hello, refusal.recipe)


def test_works_the_express_way_in_would_take_are_refused_as_the_general_way_refuses_them(spawned, raws):
    """Attack with raw clients on a real worker: a Work that is express-shaped (by digest, one
    scalar) and its twin that is not (its input a list: the general way reads it), sent where
    they must be refused: from a peer that never said Hello, naming a digest never sent,
    naming another peer's digest, with the ref of a work still running, with keys or a
    placement that do not fit the recipe. Each pair is refused with the same sentence, flags
    and ref, and nothing of them runs."""
    recipe = Recipe((spec_of(Sleep(0.0), "id"),), ("step", 0))
    digest = recipe_digest(recipe).digest
    slow = Recipe((spec_of(Sleep(1.0), "nap"),), ("step", 0))
    mine, theirs, stranger, probe = (raws(spawned.endpoint, greet=g) for g in (True, True, False, True))
    theirs.send_frames(full(1, recipe, 0))
    assert final(theirs, 1).output == 0
    mine.send_frames(full(1, slow, 0))  # warms `mine` with another recipe
    assert final(mine, 1).output == 0

    def pair(raw: Raw, ref: int, name: str, **fields):
        express = by_digest(ref, name, 5, **fields)
        general = by_digest(ref + 1, name, [5], **fields)
        if not fields:
            assert type(short.express(express[0])) is Work and short.express(general[0]) is None
        raw.send_frames(express)
        a = _fields(final(raw, ref))
        raw.send_frames(general)
        b = _fields(final(raw, ref + 1))
        return a[:1] + a[2:], b[:1] + b[2:], (a[1], b[1])

    for raw, name in ((stranger, digest), (mine, _DIGEST_NEVER), (mine, digest)):
        a, b, refs = pair(raw, 10, name)
        assert a == b and refs == (10, 11), (a, b)
    a, b, _ = pair(mine, 20, digest, keys={4: "sha256:" + "1" * 64})
    assert a == b
    mine.send_frames(full(30, recipe, 0))
    assert final(mine, 30).output == 0
    for fields in ({"keys": {4: "sha256:" + "1" * 64}}, {"placement": {3: "cpu"}}):
        a, b, _ = pair(mine, 40, digest, **fields)
        assert a == b and "Work." in a[0], a
    # the ref of a work still running: the stand-in refuses it with no ref (it ends nothing)
    mine.send_frames(by_digest(50, recipe_digest(slow).digest, 0))
    ready = probe.ask(Hello(Runtime.here(mode="project")))
    while ready.busy_us == 0:
        ready = probe.ask(Hello(Runtime.here(mode="project")))
    mine.send_frames(by_digest(50, digest, 5))
    dup_express = _fields(mine.answer(WAIT))
    mine.send_frames(by_digest(50, digest, [5]))
    dup_general = _fields(mine.answer(WAIT))
    assert dup_express == dup_general and dup_express[1] is None and "already running" in dup_express[0]
    done = final(mine, 50)
    assert isinstance(done, Done) and done.ref == 50 and done.output == 0
    assert mine.answer(0.2) is None and theirs.answer(0) is None and stranger.answer(0) is None


# == 5. a header read from a zmq.Frame's bytes =================================================


# == 6. a poll of no time, and closed sockets ==================================================


def test_readable_and_writable_refuse_a_closed_socket_even_when_descriptor_0_is_readable(monkeypatch):
    """Attack: pyzmq's poll of a closed socket polls descriptor 0 in its place. With
    descriptor 0 made readable (a pipe holding a byte), a closed socket must still raise
    ``ZMQError`` (ENOTSOCK), never read as 'a message waits' or 'room to send'; an open one
    with nothing waiting reads as nothing waiting."""
    ctx = zmq.Context.instance()
    saved = os.dup(0)
    r, w = os.pipe()
    try:
        os.dup2(r, 0)
        os.write(w, b"x")
        for kind in (zmq.DEALER, zmq.PULL, zmq.PUSH, zmq.PAIR):
            sock = ctx.socket(kind)
            sock.linger = 0
            if kind != zmq.PUSH:
                assert fabric_sockets.readable(sock) is False  # fd 0 is readable; the socket is not
            sock.close()
            for look in (fabric_sockets.readable, fabric_sockets.writable):
                with pytest.raises(zmq.ZMQError) as refused:
                    look(sock)
                assert refused.value.errno == zmq.ENOTSOCK
    finally:
        os.dup2(saved, 0)
        for fd in (saved, r, w):
            os.close(fd)


@pytest.mark.parametrize("closed", ["the channel", "its socket alone"])
@pytest.mark.parametrize("when", ["at once", "after the window"])
def test_a_channel_closed_while_idle_then_taken_again_ends_typed_and_the_next_call_is_served(spawned, closed, when):
    """Attack: a channel sitting idle in the broker's pool has its sockets (or only its
    DEALER) closed under it, then is taken again, within ``BACK_AT_ONCE`` of its give-back
    (not asked about its link) or after it (asked: its monitor raises, so a fresh channel
    serves). Either way the call ends with its answer or a somatize error, never a bare
    ``zmq.ZMQError`` or a hang, and the call after it is served."""
    node = Add(1).named("inc").at("w1")
    with Broker.embedded({"w1": Worker.at(spawned.endpoint, mode="project")}, patience=PATIENCE) as broker:
        assert node.forward(1, broker=broker) == 2
        channel = _idle_channel(broker)
        if closed == "the channel":
            channel.close()
        else:
            channel.transport.sock.close(0)
        channel.transport.idle_since = time.monotonic() + (3600 if when == "at once" else -1.0)  # ahead: never asked
        try:
            outcome = within(WAIT, lambda: node.forward(2, broker=broker))
        except SomatizeError as exc:
            outcome = exc
        if when == "after the window" and closed == "the channel":
            assert outcome == 3  # its monitor was asked: a fresh channel, as before the change
        assert outcome == 3 or isinstance(outcome, SomatizeError), outcome
        assert within(WAIT, lambda: [node.forward(i, broker=broker) for i in range(3)]) == [1, 2, 3]


def test_a_worker_stopped_while_a_client_waits_tells_it_in_bounded_time_and_ends_cleanly(serving, monkeypatch):
    """Attack: a loop running a piece where it arrived is stopped while the client waits; the
    piece outlives the loop's patience, so the stand-in closes the sockets under it, and the
    serving thread comes back to closed sockets (its polls of no time, its answers). The
    client hears a typed error within a bound; the serving thread ends with nothing raised
    on any thread."""
    raised: list = []
    monkeypatch.setattr(threading, "excepthook", lambda args: raised.append(args))
    loop, endpoint, thread = serving(patience=0.5)
    node = Sleep(1.5).named("long").at("w1")
    probe = Raw(endpoint)
    try:
        with Broker.embedded({"w1": Worker.at(endpoint, mode="project")}, patience=PATIENCE) as broker:
            assert Add(1).named("warm").at("w1").forward(1, broker=broker) == 2
            box: dict = {}

            def call() -> None:
                try:
                    box["value"] = node.forward(1, broker=broker)
                except BaseException as exc:  # noqa: BLE001
                    box["error"] = exc

            caller = threading.Thread(target=call, daemon=True)
            caller.start()
            ready = probe.ask(Hello(Runtime.here(mode="project")))
            while ready is not None and ready.busy_us == 0:  # a fact: the long piece runs
                ready = probe.ask(Hello(Runtime.here(mode="project")))
            stopped = time.monotonic()
            loop.close()
            caller.join(WAIT)
            assert not caller.is_alive(), "the client still waits on a stopped worker"
            assert "value" in box or isinstance(box.get("error"), TYPED), box
            assert time.monotonic() - stopped < PATIENCE * 4 + MARGIN
        thread.join(WAIT)
        assert not thread.is_alive()
    finally:
        probe.close()
    assert not raised, [(a.exc_type, a.exc_value) for a in raised]


# == 7. the codec registry as a token ==========================================================

KIND = "tests.hot_path.Reading"


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


# == 8. the engine's memos ======================================================================


def test_one_graph_with_two_brokers_in_turn_is_refused_by_the_one_that_does_not_know_its_host(spawned):
    """Attack on ``plan.check``'s skip (a graph's hosts checked once per listing, remembered
    on the graph) and on the kept trip: one graph forwarded through a broker that knows its
    host and one that does not, in turn, the second's listing made anew in between, then
    both at once from threads. The one that does not know it refuses every time
    (UnknownHost); the other serves every time."""
    knows = Broker.embedded({"w1": Worker.at(spawned.endpoint, mode="project")}, patience=PATIENCE)
    blind = Broker.embedded({"w2": Worker.at(spawned.endpoint, mode="project")}, patience=PATIENCE)
    one = Add(1).named("inc").at("w1")
    two = Add(1).named("a").at("w2") >> Add(1).named("b").at("w1")
    try:
        for round_ in range(4):
            assert one.forward(round_, broker=knows) == round_ + 1
            with pytest.raises(UnknownHost, match="`w1`"):
                one.forward(round_, broker=blind)
            with pytest.raises(UnknownHost, match="`w1`"):
                two.forward(round_, broker=blind)
            with pytest.raises(UnknownHost, match="`w2`"):
                two.forward(round_, broker=knows)
            if round_ == 1:
                blind._rendezvous.hosts(refresh=True)
                knows._rendezvous.hosts(refresh=True)
        assert one.forward(10, broker=knows, watching=lambda fact: None) == 11  # the walk agrees
        with pytest.raises(UnknownHost):
            one.forward(10, broker=blind, watching=lambda fact: None)
        # both at once, from threads: the token the graph keeps is written by either in turn
        wrong: list = []

        def hammer(broker: Broker, known: bool) -> None:
            for i in range(40):
                try:
                    out = one.forward(i, broker=broker)
                    if not known or out != i + 1:
                        wrong.append((known, i, out))
                except UnknownHost:
                    if known:
                        wrong.append((known, i, "UnknownHost"))
                except BaseException as exc:  # noqa: BLE001 - said on the test's thread
                    wrong.append((known, i, exc))

        threads = [
            threading.Thread(target=hammer, args=(b, k), daemon=True)
            for b, k in ((knows, True), (blind, False), (knows, True), (blind, False))
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(WAIT)
        assert not any(thread.is_alive() for thread in threads)
        assert not wrong, wrong[:5]
    finally:
        knows.close()
        blind.close()


def test_one_graph_with_brokers_that_run_its_host_here_and_elsewhere_goes_where_each_says(spawned):
    """Attack on the trip kept per set of hosts run here (``planned.trip_of``): the same graph
    through a broker that runs its host in this process and one that sends it to a worker,
    in turn. Each forward runs where its own broker says: here, or in the worker's process."""
    here = Broker.embedded({"w1": Worker.inprocess()}, patience=PATIENCE)
    there = Broker.embedded({"w1": Worker.at(spawned.endpoint, mode="project")}, patience=PATIENCE)
    node = Pid().named("pid").at("w1")
    try:
        for _ in range(3):
            assert node.forward(0, broker=here) == os.getpid()
            assert node.forward(0, broker=there) == spawned.pid
        assert node.forward(0, broker=here, watching=lambda fact: None) == os.getpid()
    finally:
        here.close()
        there.close()


@pytest.mark.parametrize("copied", ["pickled", "deep copy", "shallow copy"])
def test_a_copy_of_a_graph_checked_on_one_broker_is_checked_again_on_another(spawned, copied):
    """Attack: what a graph keeps of a forward (its trip, the listing its hosts were checked
    on) must not travel with a copy of it: a copy forwarded through a broker that does not
    know its host is refused, and one through the broker that does is served."""
    knows = Broker.embedded({"w1": Worker.at(spawned.endpoint, mode="project")}, patience=PATIENCE)
    blind = Broker.embedded({"w2": Worker.at(spawned.endpoint, mode="project")}, patience=PATIENCE)
    node = Add(1).named("inc").at("w1")
    try:
        assert node.forward(1, broker=knows) == 2
        assert "_somatize_listed" in node.__dict__ and "_somatize_trips" in node.__dict__
        twin = {
            "pickled": lambda g: pickle.loads(pickle.dumps(g)),
            "deep copy": copy.deepcopy,
            "shallow copy": copy.copy,
        }[copied](node)
        assert not any(k.startswith("_somatize_") for k in twin.__dict__), sorted(twin.__dict__)
        with pytest.raises(UnknownHost):
            twin.forward(1, broker=blind)
        assert twin.forward(2, broker=knows) == 3
    finally:
        knows.close()
        blind.close()


def test_a_graph_with_a_cached_step_never_takes_the_kept_trip_and_each_store_is_its_own(spawned, tmp_path):
    """Attack on the trip kept on the graph: a graph whose step is cached (forwarded with a
    store) must take the walk every time, never a trip worked out for it, so each store keeps
    and recalls for itself: a second, empty store runs the node again; the first recalls it.
    Beside it, the same node uncached goes as one trip, its trip kept, store or not."""
    calls = tmp_path / "calls"
    first, second = FolderStore(tmp_path / "first"), FolderStore(tmp_path / "second")
    node = Count(str(calls)).named("count").at("w1").cached().frozen()
    plain = Count(str(tmp_path / "plain")).named("count").at("w1")
    with Broker.embedded({"w1": Worker.at(spawned.endpoint, mode="project")}, patience=PATIENCE) as broker:
        assert list(node.forward(1, broker=broker, store=first)) == [1, 2, 3]  # ran, and kept
        assert calls.read_text() == "x\n"
        facts: list = []
        assert list(node.forward(1, broker=broker, store=first, watching=facts.append)) == [1, 2, 3]
        assert [f["fact"] for f in facts] == ["recalled", "finished"]
        assert list(node.forward(1, broker=broker, store=first)) == [1, 2, 3]  # recalled again
        assert calls.read_text() == "x\n"
        assert list(node.forward(1, broker=broker, store=second)) == [1, 2, 3]  # another store: runs
        assert calls.read_text() == "x\nx\n"
        assert not node.__dict__.get("_somatize_trips")
        for store in (None, first, None):
            assert list(plain.forward(2, broker=broker, store=store)) == [2, 3, 4]
        assert (tmp_path / "plain").read_text() == "x\nx\nx\n"
        assert plain.__dict__["_somatize_trips"]
