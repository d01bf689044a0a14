"""A recipe travels once per connection: after that, a Work names it by digest.

- A client's channel sends a group's recipe in full the first time, then only its digest
  (``wire.recipe_digest``); the messages on a real socket show it.
- The worker keeps each peer's recipes for that peer alone, under the digest it computed
  itself: a digest another peer (another tenant) sent, or one made up, is refused with
  ``recipe=True`` and runs nothing, and the worker keeps serving. A Work by digest the
  express way in would take (one scalar) is refused exactly as its general twin is.
- What the worker keeps is bounded (per peer, in count and bytes, least recently used first).
- Whatever forgot a recipe (a worker restarted, a broker restarted, a session or a recipe
  forgotten to make room, another client's fat Hellos included), the client greets again and
  sends it again in full, without the caller seeing it.
"""

from __future__ import annotations

import signal
import socket
import threading

import msgpack
import pytest
import zmq
from by_hand import WAIT, by_digest, final, full, project_worker, spec_of
from conftest import BROKER, WORKER
from fabric_nodes import Add, Sleep
from peers import RT, Raw
from reliability_support import Proc, child_env, relayed, wait_until

from somatize import Broker, Worker
from somatize.errors import ProtocolError
from somatize.fabric.conversation import Unheld, Unknown, WorkerSessions
from somatize.fabric.worker.loop import WorkerLoop
from somatize.packing import Packer
from somatize.wire import (
    Done,
    Hello,
    Ready,
    Recipe,
    Refusal,
    Runtime,
    Work,
    decode,
    encode,
    recipe_digest,
    short,
    variant_of,
)

MARGIN = 8.0  # added to every bound: the machine may be busy with others' tests


@pytest.fixture
def procs(tmp_path):
    """Start processes with ``procs(argv, ...)``; every one is stopped and reaped after."""
    started: list[Proc] = []

    def start(argv: list[str], **options) -> Proc:
        options.setdefault("env", child_env())
        process = Proc(argv, logs=tmp_path / "logs", **options)
        started.append(process)
        return process

    yield start
    for process in reversed(started):
        process.stop()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def chain(n: int = 4, start: int = 1):
    """A chain of ``n`` nodes on `w1`: one recipe of ``n`` nodes."""
    g = Add(start).named("n0").at("w1")
    for i in range(1, n):
        g = g >> Add(start).named(f"n{i}").at("w1")
    return g


def recipe_of(n: int) -> Recipe:
    spec = Packer("project").spec(Add(n).named(f"add{n}"))
    return Recipe((spec,), ("step", 0))


def unwatched(*args, **kwargs) -> Work:
    """A Work nobody watches: its answer is the only message that comes back."""
    return Work(*args, watched=False, **kwargs)


def dealer(endpoint: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def ask(sock: zmq.Socket, frames: list, timeout: float = 10.0 + MARGIN):
    sock.send_multipart(frames)
    assert sock.poll(int(timeout * 1000)), "no answer"
    return decode(sock.recv_multipart())


def greeted(endpoint: str, wrap=lambda frames: frames) -> zmq.Socket:
    sock = dealer(endpoint)
    assert isinstance(ask(sock, wrap(encode(Hello(Runtime.here(mode="project"))))), Ready)
    return sock


class Tap:
    """A forwarder between clients and one worker, on real sockets, that keeps the header of
    every message a client sends (a ROUTER in front, a DEALER per client behind)."""

    def __init__(self, worker: str) -> None:
        self.worker = worker
        self.headers: list[bytes] = []
        self._front = zmq.Context.instance().socket(zmq.ROUTER)
        self._front.setsockopt(zmq.LINGER, 0)
        self._front.bind("tcp://127.0.0.1:0")
        self.endpoint = self._front.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        behind: dict[bytes, zmq.Socket] = {}
        poller = zmq.Poller()
        poller.register(self._front, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                for sock, _ in poller.poll(50):
                    if sock is self._front:
                        route, *frames = self._front.recv_multipart()
                        self.headers.append(frames[0])
                        if route not in behind:
                            behind[route] = dealer(self.worker)
                            poller.register(behind[route], zmq.POLLIN)
                        behind[route].send_multipart(frames)
                    else:
                        route = next(r for r, s in behind.items() if s is sock)
                        self._front.send_multipart([route, *sock.recv_multipart()])
        finally:
            for sock in behind.values():
                sock.close(linger=0)
            self._front.close(linger=0)

    def works(self) -> list[Work]:
        return [decode([h]) for h in self.headers if variant_of([h]) is Work]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


# -- the recipe goes once ----------------------------------------------------------------


def test_repeated_calls_send_the_recipe_once_then_its_digest(procs):
    worker = procs([*WORKER, "--listen", "127.0.0.1:0", "--announce"])
    tap = Tap(worker.endpoint)
    try:
        g = chain(6)
        with Broker.embedded({"w1": Worker.at(tap.endpoint, mode="project")}) as broker:
            assert [g.forward(i, broker=broker) for i in range(5)] == [i + 6 for i in range(5)]
        works = tap.works()
        sizes = [len(h) for h in tap.headers if variant_of([h]) is Work]
    finally:
        tap.close()
    assert len(works) == 5
    assert works[0].recipe is not None and works[0].recipe_digest == ""
    digest = recipe_digest(works[0].recipe).digest
    assert all(w.recipe is None and w.recipe_digest == digest for w in works[1:]), works
    assert max(sizes[1:]) < sizes[0] // 2, sizes


def test_a_graph_made_anew_for_every_call_still_names_its_recipe_by_digest(procs):
    """``node.at(host).forward(x)`` in a loop makes a new graph each time; the packer gives
    the same node the very same spec while it is unchanged, so after the first call the
    recipe travels by its digest, as for a graph kept between calls."""
    worker = procs([*WORKER, "--listen", "127.0.0.1:0", "--announce"])
    tap = Tap(worker.endpoint)
    try:
        node = Add(1)
        with Broker.embedded({"w1": Worker.at(tap.endpoint, mode="project")}) as broker:
            assert [node.named("a").at("w1").forward(i, broker=broker) for i in range(4)] == [1, 2, 3, 4]
            specs = {id(broker._channels.packers["w1"].spec(node.named("a"))) for _ in range(3)}
        works = tap.works()
    finally:
        tap.close()
    assert len(specs) == 1 and works[0].recipe is not None
    assert all(w.recipe is None and w.recipe_digest for w in works[1:]), works


def test_a_recipe_with_values_in_frames_always_travels_in_full():
    big = Recipe((Packer("project").spec(Add(b"x" * (100 << 10)).named("big")),), ("step", 0))
    assert recipe_digest(big) is None
    assert recipe_digest(recipe_of(1)) == recipe_digest(decode(encode(unwatched(1, recipe_of(1), 0))).recipe)
    assert recipe_digest(recipe_of(1)) != recipe_digest(recipe_of(2))


def test_a_work_carries_its_recipe_or_names_it_never_both_nor_neither():
    digest = recipe_digest(recipe_of(1)).digest
    named = unwatched(1, None, 5, keys={0: "sha256:" + "0" * 64}, recipe_digest=digest)
    assert decode(encode(named)) == named
    header = msgpack.unpackb(encode(named)[0])
    assert header["recipe"] is None and header["recipe_digest"] == digest
    with pytest.raises(ValueError, match="carries its recipe in full, or names by digest"):
        encode(unwatched(1, None, 5))
    with pytest.raises(ValueError, match="give one or the other"):
        encode(unwatched(1, recipe_of(1), 5, recipe_digest=digest))
    with pytest.raises(ValueError, match="64 lowercase hex"):
        encode(unwatched(1, None, 5, recipe_digest="sha256:short"))
    # what arrives is held to the same: both, or a digest that is not one, is refused
    frames = encode(unwatched(1, recipe_of(1), 5))
    both = msgpack.unpackb(frames[0])
    both["recipe_digest"] = digest
    with pytest.raises(ProtocolError, match="give one or the other"):
        decode([msgpack.packb(both), *frames[1:]])
    assert decode(encode(Refusal("again", recipe=True))).recipe is True


# -- whose recipe it is -------------------------------------------------------------------


@pytest.mark.parametrize("path", ["direct", "relayed"])
def test_a_digest_another_tenant_sent_is_refused_and_runs_nothing(procs, path):
    if path == "direct":
        worker = procs([*WORKER, "--listen", "127.0.0.1:0", "--announce"])
        endpoint, wrap = worker.endpoint, (lambda frames: frames)
    else:
        hub = procs([*BROKER, "--listen", "tcp://127.0.0.1:0", "--announce"])
        worker = procs([*WORKER, "--broker", hub.endpoint, "--offer", "w1"], announce=None)
        with Broker.at(hub.endpoint) as probe:
            wait_until(lambda: probe.knows("w1"), 20.0 + MARGIN, "w1 dialing in")
        endpoint, wrap = hub.endpoint, (lambda frames: relayed("w1", frames))
    mine, theirs = greeted(endpoint, wrap), greeted(endpoint, wrap)
    try:
        recipe = recipe_of(10)
        digest = recipe_digest(recipe).digest
        done = ask(mine, wrap(encode(unwatched(1, recipe, 5))))
        assert isinstance(done, Done) and done.output == 15, done
        # another connection (another tenant, without keys) names it: refused, not run
        refused = ask(theirs, wrap(encode(unwatched(2, None, 7, recipe_digest=digest))))
        assert isinstance(refused, Refusal) and refused.recipe and not refused.hello, refused
        assert "send the Work again with its recipe" in refused.why
        # a made-up digest: refused the same way, and the worker keeps serving
        bogus = ask(mine, wrap(encode(unwatched(3, None, 7, recipe_digest="sha256:" + "ab" * 32))))
        assert isinstance(bogus, Refusal) and bogus.recipe, bogus
        # its own connection names it: it runs
        again = ask(mine, wrap(encode(unwatched(4, None, 7, recipe_digest=digest))))
        assert isinstance(again, Done) and again.output == 17, again
        # and the other sends it in full: then it is its own too
        assert ask(theirs, wrap(encode(unwatched(5, recipe, 1)))).output == 11
        assert ask(theirs, wrap(encode(unwatched(6, None, 2, recipe_digest=digest)))).output == 12
    finally:
        mine.close(linger=0)
        theirs.close(linger=0)


def test_a_work_by_digest_still_has_its_keys_and_placement_checked(procs):
    worker = procs([*WORKER, "--listen", "127.0.0.1:0", "--announce"])
    sock = greeted(worker.endpoint)
    try:
        recipe = recipe_of(1)
        digest = recipe_digest(recipe).digest
        assert isinstance(ask(sock, encode(unwatched(1, recipe, 1))), Done)
        wrong = ask(sock, encode(unwatched(2, None, 1, keys={3: "sha256:" + "0" * 64}, recipe_digest=digest)))
        assert isinstance(wrong, Refusal) and "`Work.keys` names node 3" in wrong.why, wrong
        assert ask(sock, encode(unwatched(3, None, 1, recipe_digest=digest))).output == 2
    finally:
        sock.close(linger=0)


# -- bounded -------------------------------------------------------------------------------


def test_what_a_worker_keeps_per_peer_is_bounded():
    sessions = WorkerSessions(Runtime.here(mode="project"), max_recipes=8, max_recipe_bytes=64 << 10)
    sessions.receive(b"a", Hello(Runtime.here()), now=0.0)
    before = sessions._bytes
    for n in range(500):
        sessions.receive(b"a", Work(n, recipe_of(n), 0), now=0.0)
        assert sessions.recipes(b"a") <= 8
    assert sessions._bytes - before <= 64 << 10
    # the newest is held, the oldest forgotten
    newest, oldest = recipe_digest(recipe_of(499)).digest, recipe_digest(recipe_of(0)).digest
    assert sessions.receive(b"a", Work(1000, None, 0, recipe_digest=newest), now=0.0).recipe == recipe_of(499)
    with pytest.raises(Unheld):
        sessions.receive(b"a", Work(1001, None, 0, recipe_digest=oldest), now=0.0)
    # a recipe bigger than a peer may keep is not kept, and a Hello starts afresh
    sessions.receive(b"a", Hello(Runtime.here()), now=0.0)
    assert sessions.recipes(b"a") == 0 and sessions._bytes == before
    big = Recipe(
        tuple(Packer("project").spec(Add(n).named("x" * 900 + str(n))) for n in range(100)),
        ("seq", tuple(("step", i) for i in range(100))),
    )
    sessions.receive(b"a", Work(2000, big, 0), now=0.0)
    assert sessions.recipes(b"a") == 0


def test_sessions_forgotten_to_make_room_take_their_recipes_with_them():
    sessions = WorkerSessions(Runtime.here(mode="project"), max_peers=2)
    for peer in (b"a", b"b", b"c"):
        sessions.receive(peer, Hello(Runtime.here()), now=0.0)
        sessions.receive(peer, Work(1, recipe_of(1), 0), now=0.0)
        sessions.answering(peer, Done(1, 0, {}, 0))
    digest = recipe_digest(recipe_of(1)).digest
    with pytest.raises(Unknown):  # `a` was forgotten: it says Hello, then sends in full
        sessions.receive(b"a", Work(2, None, 0, recipe_digest=digest), now=0.0)
    assert sessions.receive(b"c", Work(2, None, 0, recipe_digest=digest), now=0.0).recipe == recipe_of(1)


def test_many_distinct_recipes_keep_a_live_worker_serving(procs):
    worker = procs([*WORKER, "--listen", "127.0.0.1:0", "--announce"])
    sock = greeted(worker.endpoint)
    try:
        for n in range(200):
            assert ask(sock, encode(unwatched(n, recipe_of(n), 0))).output == n
        # the first was forgotten to make room for the others; the last is held
        first, last = recipe_digest(recipe_of(0)).digest, recipe_digest(recipe_of(199)).digest
        assert ask(sock, encode(unwatched(1000, None, 1, recipe_digest=first))).recipe is True
        assert ask(sock, encode(unwatched(1001, None, 1, recipe_digest=last))).output == 200
    finally:
        sock.close(linger=0)
    # and a client cycling through as many recipes on one channel gets every answer right
    with Broker.embedded({"w1": Worker.at(worker.endpoint, mode="project")}) as broker:
        graphs = [Add(n).named(f"a{n}").at("w1") for n in range(100)]
        for _ in range(2):
            assert [g.forward(1, broker=broker) for g in graphs] == [n + 1 for n in range(100)]


# -- whatever forgot it, the client sends it again ----------------------------------------


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM])
def test_a_worker_restart_is_recovered_without_the_caller_seeing_it(procs, signum):
    port = free_port()
    argv = [*WORKER, "--listen", f"127.0.0.1:{port}", "--announce"]
    worker = procs(argv)
    g = chain(3)
    with Broker.embedded({"w1": Worker.at(f"tcp://127.0.0.1:{port}", mode="project")}) as broker:
        assert [g.forward(i, broker=broker) for i in range(3)] == [3, 4, 5]
        worker.signal(signum)
        worker.popen.wait(10 + MARGIN)
        procs(argv)  # a new worker on the same port: it holds no recipe of anyone's
        assert [g.forward(i, broker=broker) for i in range(3)] == [3, 4, 5]


def test_a_broker_restart_is_recovered_without_the_caller_seeing_it(procs):
    port = free_port()
    argv = [*BROKER, "--listen", f"tcp://127.0.0.1:{port}", "--announce"]
    hub = procs(argv)
    procs([*WORKER, "--broker", hub.endpoint, "--offer", "w1"], announce=None)
    g = chain(3)
    with Broker.at(hub.endpoint, patience=2.0) as broker:
        wait_until(lambda: broker.knows("w1"), 20.0 + MARGIN, "w1 dialing in")
        assert [g.forward(i, broker=broker) for i in range(3)] == [3, 4, 5]
        hub.signal(signal.SIGKILL)
        hub.popen.wait(10 + MARGIN)
        procs(argv)  # the broker again, on the same port: new exchange numbers, no sessions
        with Broker.at(hub.endpoint) as probe:  # a new client: this one's listing is cached
            wait_until(lambda: probe.knows("w1"), 20.0 + MARGIN, "w1 dialing in again")
        assert [g.forward(i, broker=broker) for i in range(3)] == [3, 4, 5]


def test_sessions_and_recipes_forgotten_to_make_room_are_recovered():
    # the worker's own loop on a thread, keeping one peer and one recipe per peer at most
    loop = WorkerLoop(mode="project")
    loop.sessions = WorkerSessions(loop.runtime, max_peers=1, max_recipes=1)
    endpoint = loop.bind("tcp://127.0.0.1:0")
    serving = threading.Thread(target=loop.serve, daemon=True)
    serving.start()
    try:
        one, other = chain(2), chain(3)
        declared = {"w1": Worker.at(endpoint, mode="project")}
        with Broker.embedded(declared) as a, Broker.embedded(dict(declared)) as b:
            # two recipes on one channel: each makes the worker forget the other
            for i in range(3):
                assert one.forward(i, broker=a) == i + 2
                assert other.forward(i, broker=a) == i + 3
            assert loop.sessions.refused >= 4  # by digest, forgotten, sent again in full
            # two clients: each makes the worker forget the other's session
            for i in range(3):
                assert one.forward(i, broker=a) == i + 2
                assert one.forward(i, broker=b) == i + 2
    finally:
        loop.stopping.set()
        serving.join(5 + MARGIN)
    assert not serving.is_alive()


def test_a_relayed_worker_restart_is_recovered_without_the_caller_seeing_it(procs):
    # the client's connection (to the broker) stays up: its next Work names the recipe by
    # digest, in an exchange the new worker has never heard of, which asks for a Hello
    hub = procs([*BROKER, "--listen", "tcp://127.0.0.1:0", "--announce"])
    dialing = [*WORKER, "--broker", hub.endpoint, "--offer", "w1"]
    worker = procs(dialing, announce=None)
    g = chain(3)
    with Broker.at(hub.endpoint, patience=2.0) as broker:
        wait_until(lambda: broker.knows("w1"), 20.0 + MARGIN, "w1 dialing in")
        assert [g.forward(i, broker=broker) for i in range(3)] == [3, 4, 5]
        worker.stop()  # SIGTERM: it says Bye to the broker
        with Broker.at(hub.endpoint) as probe:
            wait_until(lambda: not probe.knows("w1"), 10.0 + MARGIN, "w1 leaving")
            fresh = procs(dialing, announce=None)
            wait_until(lambda: probe.knows("w1"), 20.0 + MARGIN, "w1 dialing in again")
        assert [g.forward(i, broker=broker) for i in range(3)] == [3, 4, 5]
    assert "say Hello first" in fresh.stderr()  # the digest went to a worker that knew nothing


def test_an_allowed_client_cannot_make_another_clients_next_forward_fail_by_crowding_sessions(processes):
    """Attacker: an allowed client of a worker (here a keyless loopback worker, which every
    local user reaches; a key in `--allow` does the same on a keyed one).

    What it achieves: the victim's next forward fails with `Refused: say Hello first`.
    A worker keeps at most 16 MiB of remembered runtimes and forgets the least recently
    heard from peer first; a Hello may name 1,000 kinds of 64 Ki characters in all, which
    the worker counts as ~125 KB. So 140 Hellos from 140 connections (9 MB on the wire)
    push out every idle client's session. The victim's client keeps its channel open between
    forwards and never says Hello again on it, so its next Work is refused, and the refusal
    reaches the caller as an error. (docs/conversation.md promises "it says Hello again if
    it comes back"; the client does not.)
    """
    worker = project_worker(processes)
    with Broker.embedded({"w": Worker.at(worker.endpoint)}) as broker:
        assert Add(1).named("a").at("w").forward(1, broker=broker) == 2  # greeted; channel idle

        fat = Runtime(
            RT.wire, RT.python, RT.somatize, RT.cloudpickle, tuple(f"k{i:03d}" + "x" * 61 for i in range(1000)), ""
        )
        crowd = [Raw(worker.endpoint) for _ in range(140)]
        try:
            for raw in crowd:
                raw.send(Hello(fat))
            assert all(isinstance(raw.answer(), Ready) for raw in crowd)
        finally:
            for raw in crowd:
                raw.close()

        assert Add(1).named("a").at("w").forward(2, broker=broker) == 3


# -- a Work by digest the express way in would take is refused as the general way refuses it ------


_DIGEST_NEVER = "sha256:" + "0" * 64


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
