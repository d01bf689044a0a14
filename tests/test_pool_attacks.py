"""Attacks on pools (one host name, many workers) and on ``Graph.map`` / ``Graph.submit``.

Three kinds of attacker: an allowed worker key on a shared, keyed broker (it dials in, or
speaks the wire by hand), an allowed client, and a careless user of ``map``. Real spawned
processes and sockets throughout. An attack the code withstands is a plain test; one that
succeeds is marked ``xfail(strict=True)`` naming the code at fault.
"""

from __future__ import annotations

import importlib
import sys
import threading
import time
from pathlib import Path

import mapping_nodes
import pool_attack_nodes
import pytest
import zmq
from conftest import WORKER, env_with_tests
from reliability_support import key_ring

from brokers import keyed_broker
from somatize import Broker, Closed, NodeFailed, Worker
from somatize.fabric.curve import Keys, read_public, read_secret
from somatize.fabric.hosts import Pool, pool_of
from somatize.wire import Hello, Ready, Refusal, Relay, Runtime, decode, encode

RT = Runtime.here(mode="project")
RTN = Runtime.here(mode="network")  # what a client sending modules by value expects


# -- helpers ----------------------------------------------------------------------------------


def wait_for(fact, seconds: float = 20.0, what: str = "a fact") -> None:
    until = time.monotonic() + seconds
    while not fact():
        if time.monotonic() > until:
            raise AssertionError(f"waited {seconds} s for {what}, which never came")
        time.sleep(0.01)


def pool(processes: int = 2, **options) -> Pool:
    return Worker.spawn(WORKER, mode="network", send=[pool_attack_nodes], mount=False, processes=processes, **options)


def one(**options) -> Worker:
    return Worker.spawn(WORKER, mode="network", send=[pool_attack_nodes], mount=False, **options)


def map_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("somatize-map")]


@pytest.fixture
def ring(tmp_path):
    """A broker's pair; clients alice and bob; workers victim and evil."""
    return key_ring(tmp_path, clients=("alice", "bob"), workers=("victim", "evil"))


def dial(processes, ring, broker, host, who="victim"):
    return processes(
        [
            *WORKER,
            "--broker",
            broker.endpoint,
            "--offer",
            host,
            "--key",
            str(ring[who + "_secret"]),
            "--broker-key",
            str(ring["broker"]),
            "--patience",
            "2",
            "--mode",
            "network",
        ],
        env=env_with_tests(),
        announce=None,
    )


def client(ring, broker, who="alice") -> Broker:
    return Broker.at(
        broker.endpoint,
        keys=Keys.client(ring[who + "_secret"], server=ring["broker"]),
        patience=2.0,
        send={"cpu": [pool_attack_nodes]},
    )


class Raw:
    """An attacker with an allowed key, speaking the wire by hand."""

    def __init__(self, ring, broker, who):
        public, secret = read_secret(ring[who + "_secret"])
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.curve_publickey, self.sock.curve_secretkey = public, secret
        self.sock.curve_serverkey = read_public(ring["broker"])
        self.sock.connect(broker.endpoint)

    def send(self, message):
        self.sock.send_multipart(encode(message))

    def answer(self, timeout=5.0):
        if not self.sock.poll(int(timeout * 1000)):
            return None
        return decode(self.sock.recv_multipart())

    def ask(self, message, timeout=5.0):
        self.send(message)
        return self.answer(timeout)

    def relayed(self, timeout: float) -> list:
        """Every relayed message that reached this attacker within ``timeout``."""
        got, until = [], time.monotonic() + timeout
        while (left := until - time.monotonic()) > 0:
            message = self.answer(left)
            if message is None:
                break
            if isinstance(message, Relay):
                got.append(message)
        return got

    def close(self):
        self.sock.close(0)


# -- (1) an allowed worker key on a shared broker ---------------------------------------------


def test_member_lookalike_names_are_hosts_of_their_own_and_join_no_pool(ring, processes):
    """Attack: an allowed worker key offers names that a sloppy parser would read as members
    of the victim's pool `cpu` (`cpu#00`, `cpu#01`, Arabic-Indic and full-width digits, a
    seven-digit index, `cpu##1`, `cpu#1 `, `cpu#+1`): each would take a share of every input
    mapped over `cpu`. Each is a host of its own (or of another pool), and no input reaches it."""
    broker = keyed_broker(processes, ring)
    dial(processes, ring, broker, "cpu#0")
    lookalikes = [
        "cpu#00",
        "cpu#01",
        "cpu#\u0661",
        "cpu#\uff11",
        "cpu#1234567",
        "cpu##1",
        "cpu#1 ",
        "cpu#+1",
        "cpu#-1",
        " cpu#1",
        "CPU#1",
        "cpu#0x1",
        "cpu#1_0",
    ]
    for name in lookalikes:
        found = pool_of(name)
        assert found is None or found[0] != "cpu", name
    with client(ring, broker) as alice:
        wait_for(lambda: alice.members("cpu", refresh=True) == ("cpu#0",), what="cpu#0 to dial in")
        evil = Raw(ring, broker, "evil")
        try:
            for name in lookalikes:
                answer = evil.ask(Hello(RT, offering=name))
                assert isinstance(answer, (Ready, Refusal)), (name, answer)
            assert alice.members("cpu", refresh=True) == ("cpu#0",)
            graph = pool_attack_nodes.Add(1).named("a").at("cpu")
            assert list(graph.map(range(8), broker=alice, in_flight=4, deadline=15)) == list(range(1, 9))
            assert evil.relayed(0.3) == []  # never saw an input
        finally:
            evil.close()


def test_another_key_cannot_shadow_a_pool_by_offering_its_bare_name(ring, processes):
    """Attack: the victim's key serves the pool `cpu` (`cpu#0`); the attacker's key offers the
    plain host `cpu`. A client's `.at("cpu")` means "any member of the pool": it must not be
    handed to a stranger's worker."""
    broker = keyed_broker(processes, ring)
    dial(processes, ring, broker, "cpu#0")
    with client(ring, broker, "bob") as bob:
        wait_for(lambda: bob.members("cpu", refresh=True) == ("cpu#0",), what="cpu#0 to dial in")
    evil = Raw(ring, broker, "evil")
    try:
        answer = evil.ask(Hello(RTN, offering="cpu"))
        with client(ring, broker) as alice:  # a client that lists the hosts after the attack
            members = alice.members("cpu", refresh=True)
            graph = pool_attack_nodes.Add(1).named("a").at("cpu")
            out = list(graph.map(range(3), broker=alice, deadline=4, errors="return", retries=0))
        reached = evil.relayed(0.3)
        assert (isinstance(answer, Refusal), members, out, reached) == (True, ("cpu#0",), [1, 2, 3], [])
    finally:
        evil.close()


def test_a_worker_key_cannot_shadow_a_declared_pool_by_offering_its_bare_name(ring, processes, tmp_path):
    """Attack: the operator's table declares the pool `cpu`; an allowed worker key dials in as
    `cpu`, so that clients mapping over the operator's pool send their inputs to it."""
    table = tmp_path / "hosts.toml"
    table.write_text(f'[hosts.cpu]\nspawn = {WORKER!r}\nprocesses = 2\nmode = "network"\n'.replace("'", '"'))
    broker = keyed_broker(processes, ring, hosts=table)
    evil = Raw(ring, broker, "evil")
    try:
        answer = evil.ask(Hello(RT, offering="cpu"))
        with client(ring, broker) as alice:
            members = alice.members("cpu", refresh=True)
        reached = evil.relayed(0.2)
        assert (isinstance(answer, Refusal), members, reached) == (True, ("cpu#0", "cpu#1"), [])
    finally:
        evil.close()


def test_a_keyed_member_name_of_another_pool_with_hashes_is_its_own(ring, processes):
    """Attack: pool names may hold '#': the attacker offers `cpu#0#1` (member 1 of the pool
    `cpu#0`), hoping to be read as part of `cpu` or to take over the victim's member `cpu#0`."""
    broker = keyed_broker(processes, ring)
    dial(processes, ring, broker, "cpu#0")
    with client(ring, broker) as alice:
        wait_for(lambda: alice.members("cpu", refresh=True) == ("cpu#0",), what="cpu#0 to dial in")
        evil = Raw(ring, broker, "evil")
        try:
            assert isinstance(evil.ask(Hello(RT, offering="cpu#0#1")), Ready)
            refused = evil.ask(Hello(RT, offering="cpu#0"))
            assert isinstance(refused, Refusal)
            assert alice.members("cpu", refresh=True) == ("cpu#0",)
            assert alice.members("cpu#0") == ("cpu#0",)  # the victim's member stays a host of its own
            graph = pool_attack_nodes.Add(1).named("a").at("cpu#0")
            assert graph.forward(1, broker=alice, deadline=15) == 2
            assert list(pool_attack_nodes.Add(1).named("a").at("cpu").map([5, 6], broker=alice, deadline=15)) == [6, 7]
            assert evil.relayed(0.3) == []
        finally:
            evil.close()


# -- (2)/(3) a client and a careless user ---------------------------------------------------------


def test_a_host_named_like_a_pools_packer_key_packs_with_its_own_modules(tmp_path):
    """Careless naming: the pool `gpu` and a host called `gpu#network` in one table, each
    sending modules of its own by value."""
    lonely = tmp_path / "lonely"
    lonely.mkdir()
    (lonely / "lonely_nodes.py").write_text(
        "from somatize import Node\n\nclass Triple(Node):\n    def forward(self, x):\n        return 3 * x\n"
    )
    sys.path.insert(0, str(lonely))
    try:
        lonely_nodes = importlib.import_module("lonely_nodes")
        tables = {"gpu": pool(2), "gpu#network": Worker.spawn(WORKER, mode="network", send=[lonely_nodes], mount=False)}
        with Broker.embedded(tables) as broker:
            assert broker.members("gpu#network") == ("gpu#network",)
            assert pool_attack_nodes.Add(1).named("a").at("gpu").forward(1, broker=broker, deadline=20) == 2
            assert lonely_nodes.Triple().named("t").at("gpu#network").forward(2, broker=broker, deadline=20) == 6
    finally:
        sys.path.remove(str(lonely))
        sys.modules.pop("lonely_nodes", None)


def test_an_input_generator_that_raises_loses_no_finished_output():
    """Careless user: the inputs come from a generator that fails part way. What ran before
    the failure is handed out, then the failure (as the builtin `map` does)."""

    def inputs():
        yield from (0, 1, 2)
        raise OSError("the input file went away")

    graph = pool_attack_nodes.Add(10).named("a").at("cpu")
    with Broker.embedded({"cpu": pool(2)}) as broker:
        got = []
        with pytest.raises(OSError, match="went away"):
            for value in graph.map(inputs(), broker=broker, in_flight=1, deadline=20):
                got.append(value)
        assert got == [10, 11, 12]


def test_an_input_generator_that_raises_ends_the_map_at_once_and_hangs_nothing():
    """Careless user: the generator fails at its first input, and (in another map) midway
    with several forwards in flight. The error comes out within a bound, the map ends, and
    no thread of the map is left once what ran has finished."""

    def bad_first():
        raise ValueError("no inputs today")
        yield  # pragma: no cover

    def bad_later():
        yield from range(5)
        raise ValueError("half way")

    graph = pool_attack_nodes.Add(1).named("a").at("cpu")
    with Broker.embedded({"cpu": pool(2)}) as broker:
        started = time.monotonic()
        with pytest.raises(ValueError, match="no inputs today"):
            list(graph.map(bad_first(), broker=broker))
        mapping = graph.map(bad_later(), broker=broker, in_flight=3, ordered=False, deadline=20)
        with pytest.raises(ValueError, match="half way"):
            for _ in range(10):
                next(mapping)
        with pytest.raises(StopIteration):
            next(mapping)
        assert time.monotonic() - started < 25
        wait_for(lambda: not map_threads(), 20, "the map's threads to end")


def test_a_watcher_that_raises_breaks_no_input_and_items_are_tagged():
    """Careless user: a watcher that raises on every fact, and one that edits the fact it is
    given. Every input comes out once, and the honest watcher sees each fact of each input
    tagged with that input and the member it ran on."""
    seen: list[dict] = []

    def raises(fact):
        raise RuntimeError("watcher bug")

    def edits(fact):
        fact["item"] = "999"
        fact["host"] = "elsewhere"

    graph = pool_attack_nodes.Pid().named("p").at("cpu")
    with Broker.embedded({"cpu": pool(3)}) as broker:
        out = list(graph.map(range(12), broker=broker, watching=[raises, edits, seen.append], deadline=20))
    assert [x for x, _ in out] == list(range(12))
    ran = [f for f in seen if f["fact"] == "ran"]
    assert sorted(int(f["item"]) for f in ran) == list(range(12))
    assert {f["host"] for f in ran} <= {"cpu#0", "cpu#1", "cpu#2"}
    by_pid = {}
    for f, (_x, pid) in zip(sorted(ran, key=lambda f: int(f["item"])), out, strict=False):
        by_pid.setdefault(pid, set()).add(f["host"])
    assert all(len(hosts) == 1 for hosts in by_pid.values())  # one member name per worker process


def test_empty_inputs_and_a_window_wider_than_the_inputs():
    graph = pool_attack_nodes.Add(1).named("a").at("cpu")
    with Broker.embedded({"cpu": pool(2)}) as broker:
        assert list(graph.map([], broker=broker)) == []
        assert list(graph.map(iter(()), broker=broker, ordered=False)) == []
        assert list(graph.map(range(3), broker=broker, in_flight=200, deadline=20)) == [1, 2, 3]
        assert sorted(graph.map(range(3), broker=broker, in_flight=200, ordered=False, deadline=20)) == [
            (0, 1),
            (1, 2),
            (2, 3),
        ]
        for bad in (0, -3, True, 2.0, "4"):
            with pytest.raises(TypeError, match="in_flight="):
                graph.map([1], broker=broker, in_flight=bad)
        with pytest.raises(TypeError, match="ordered="):
            graph.map([1], broker=broker, ordered=1)


def test_two_pools_and_a_plain_host_in_one_graph_each_fact_names_its_member(tmp_path):
    """A graph over the pools `a` (2) and `b` (3) and the plain host `p`: every input comes out
    once, in order; the default window is the larger pool's; each fact names the member (or
    host) it ran on, and the record's fleet has exactly those names."""
    from somatize import FolderStore
    from somatize.record import Recorder, fleet, forwards

    log_a, log_b = tmp_path / "a", tmp_path / "b"
    graph = (
        pool_attack_nodes.Add(1, str(log_a)).named("one").at("a")
        >> pool_attack_nodes.Add(10, str(log_b)).named("two").at("b")
        >> pool_attack_nodes.Add(100).named("three").at("p")
    )
    store = FolderStore(tmp_path / "store")
    facts: list[dict] = []
    with Broker.embedded({"a": pool(2), "b": pool(3), "p": one()}) as broker:
        mapping = graph.map(range(20), broker=broker, watching=[facts.append, Recorder(store, run="m")], deadline=30)
        assert mapping._width == 3
        out = list(mapping)
    assert out == [x + 111 for x in range(20)]
    ran = [f for f in facts if f["fact"] == "ran"]
    hosts = {f["node"]: set() for f in ran}
    for f in ran:
        hosts[f["node"]].add(f["host"])
    assert hosts["one"] <= {"a#0", "a#1"} and hosts["two"] <= {"b#0", "b#1", "b#2"} and hosts["three"] == {"p"}
    assert len([f for f in ran if f["node"] == "two"]) == 20
    for log in (log_a, log_b):
        assert sorted(int(line.split()[0]) for line in log.read_text().splitlines()) == sorted(
            x + (1 if log is log_b else 0) for x in range(20)
        )
    assert len(forwards(store, run="m")) == 20
    assert set(fleet(store, run="m")) <= {"a#0", "a#1", "b#0", "b#1", "b#2", "p"}
    assert "p" in fleet(store, run="m")


def test_closing_a_map_early_returns_at_once_and_the_broker_leaves_no_thread_or_process(tmp_path):
    """Careless user: breaks out of a map whose forwards are still running (the node waits on a
    file), then closes the broker. Closing returns at once, the forwards running end (Closed)
    within a bound once the broker closes, and no map thread nor worker process is left."""
    import os

    Hold = mapping_nodes.Hold

    started, until = tmp_path / "started", tmp_path / "until"
    graph = Hold(str(started), str(until)).named("hold").at("cpu")
    before = {t.ident for t in threading.enumerate()}
    broker = Broker.embedded(
        {"cpu": Worker.spawn(WORKER, mode="network", send=[mapping_nodes], mount=False, processes=2)}
    )
    pids = []
    try:
        mapping = graph.map(range(50), broker=broker, in_flight=2)
        wait_for(started.exists, what="a member to start running")
        pids.append(int(started.read_text()))
        t0 = time.monotonic()
        mapping.close()
        assert time.monotonic() - t0 < 1.0
        with pytest.raises(StopIteration):
            next(mapping)
    finally:
        t0 = time.monotonic()
        broker.close()
        closing = time.monotonic() - t0
        until.touch()
    assert closing < 15
    wait_for(lambda: not map_threads(), 15, "the map's threads to end")

    def gone(pid):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"

    wait_for(lambda: all(gone(p) for p in pids), 15, "the spawned workers to be stopped")
    left = [
        t for t in threading.enumerate() if t.ident not in before and t.name.startswith("somatize") and t.is_alive()
    ]
    wait_for(lambda: not [t for t in left if t.is_alive()], 15, f"somatize threads to end: {left}")


def test_a_member_that_never_starts_leaks_no_turn_and_loses_no_input(tmp_path):
    """A pool with one member whose command exits at once: inputs sent there are lost and run
    again on the other member (each within `retries`); afterwards this client counts no work
    on either member (the `chosen` count of `Turns` went back to nothing), so a later map
    still spreads over both."""
    log = tmp_path / "runs"
    good = one()
    bad = Worker.spawn(
        [sys.executable, "-c", "raise SystemExit(3)"], mode="network", send=[pool_attack_nodes], mount=False
    )
    graph = pool_attack_nodes.Add(1, str(log)).named("a").at("cpu")
    with Broker.embedded({"cpu": Pool((bad, good))}, patience=1.0) as broker:
        started = time.monotonic()
        out = list(graph.map(range(10), broker=broker, in_flight=2, retries=1, errors="return", deadline=20))
        assert time.monotonic() - started < 25
        assert broker._turns._hosts == {}  # nothing of this client counted on any member (holds)
        assert out == list(range(1, 11)), out
    ran = [int(line.split()[0]) for line in log.read_text().splitlines()]
    assert sorted(ran) == list(range(10))  # each input once: the dead member ran none


def test_the_chosen_count_goes_back_after_failures_before_the_send():
    """A piece that chose a member and failed before being sent (the member's worker refused
    to be located, the client was closed) hands its place back: the member is chosen again."""
    from somatize.fabric.client.turns import Turns

    turns = Turns()
    members = ("g#0", "g#1")
    for _ in range(100):
        chosen = turns.choose(members)
        turns.unchoose(chosen)
    assert turns._hosts == {}
    a = turns.choose(members)
    b = turns.choose(members)
    assert {a, b} == set(members)  # least loaded first: one each
    turns.unchoose(a)
    assert turns.choose(members) == a  # the one given back is least loaded again
    turns.unchoose(a)
    turns.unchoose(a)  # once too often: no count below nothing
    turns.unchoose("g#9")
    assert turns.choose(members) == a
    assert turns.take(a, lambda: 7, RuntimeError, None, chosen=True) == 7
    assert turns.take(b, lambda: 8, RuntimeError, None, chosen=True) == 8
    assert turns._hosts == {}
    with pytest.raises(ValueError):
        turns.choose(members, besides=members)
    assert turns._hosts == {}


def test_submit_and_map_on_a_closed_broker_end_closed_and_hang_nothing():
    graph = pool_attack_nodes.Add(1).named("a").at("cpu")
    broker = Broker.embedded({"cpu": pool(2)})
    assert graph.submit(1, broker=broker).result(timeout=30) == 2
    broker.close()
    started = time.monotonic()
    future = graph.submit(1, broker=broker)
    with pytest.raises(Closed):
        future.result(timeout=15)
    out = list(graph.map(range(4), broker=broker, errors="return", in_flight=4))
    assert len(out) == 4 and all(isinstance(v, Closed) for v in out), out
    assert time.monotonic() - started < 15
    wait_for(lambda: not map_threads(), 15, "the map's threads to end")


def test_a_nodes_failure_on_a_member_is_never_run_again_nor_counted_twice(tmp_path):
    """`NodeFailed` is final: with `retries=5` an input whose node raises ran exactly once."""
    FailsOn = mapping_nodes.FailsOn

    graph = FailsOn((2, 5)).named("picky").at("cpu")
    facts: list[dict] = []
    with Broker.embedded(
        {"cpu": Worker.spawn(WORKER, mode="network", send=[mapping_nodes], mount=False, processes=3)}
    ) as broker:
        out = list(graph.map(range(8), broker=broker, retries=5, errors="return", watching=facts.append, deadline=20))
        assert broker._turns._hosts == {}
    assert [isinstance(v, NodeFailed) for v in out] == [i in (2, 5) for i in range(8)]
    failed = sorted(f["item"] for f in facts if f["fact"] == "failed")
    assert failed == ["2", "5"]


def test_a_worker_cannot_have_its_facts_read_as_from_a_pool_member():
    """An allowed worker serving the plain host `w1` says facts whose own `host` is `#7`:
    the client reads a leading `#` as a pool member's mark, so they would be filed as from
    `w1#7`, a member that does not exist (and in `fleet`, a machine of its own)."""
    from peers import FakeWorker

    from somatize.wire import Done, Saw

    fake = FakeWorker(
        lambda work: (
            Saw(work.ref, {"fact": "ran", "node": "a", "host": "#7", "took_us": "1"}),
            Done(work.ref, work.input + 1, {}, 7),
        )
    )
    try:
        seen: list[dict] = []
        with Broker.embedded({"w1": Worker.at(fake.endpoint, mode="project")}) as broker:
            assert (
                pool_attack_nodes.Add(1)
                .named("a")
                .at("w1")
                .forward(1, broker=broker, watching=seen.append, deadline=10)
                == 2
            )
        hosts = {f["host"] for f in seen if f["fact"] == "ran"}
        assert hosts and not any("#" in h for h in hosts), hosts
        assert hosts == {"w1/7"}
    finally:
        fake.close()
