"""The shared pieces hold (issue 19, the broker's side): each attack on a standalone broker,
played for real, fails on the broker before the fix and passes after it.

Real processes: a broker started with ``python -m somatize.broker``, workers dialing in
with ``python -m somatize.worker --broker ... --offer ...``, clients as raw ZeroMQ sockets
or ``Broker.at``. Waits poll a fact with a deadline; every process is reaped by the
``processes`` fixture; every socket lingers 0. How fast another tenant is answered under a
flood is measured in ``benchmarks/flooding.py``, never asserted here.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
from conftest import BROKER, WORKER, env_with_tests
from fabric_nodes import Add, Sleep
from peers import Raw
from reliability_support import key_ring, rss_kib, wait_until

from brokers import keyed_broker
from somatize import Broker
from somatize.fabric.curve import read_public, read_secret
from somatize.packing import Packer
from somatize.wire import (
    Done,
    Hello,
    Hosts,
    Listed,
    Located,
    Ready,
    Recipe,
    Refusal,
    Relay,
    Runtime,
    Where,
    Work,
    decode,
    encode,
)

pytestmark = pytest.mark.slow  # `-m "not slow"` leaves this file out

RT = Runtime.here(mode="project")


def keyless_broker(processes, *extra):
    return processes(
        [*BROKER, "--listen", "tcp://127.0.0.1:0", "--announce", "--patience", "2", *extra], env=env_with_tests()
    )


def dial(processes, endpoint, host, ring=None, who="victim"):
    keys = [] if ring is None else ["--key", str(ring[who + "_secret"]), "--broker-key", str(ring["broker"])]
    return processes(
        [*WORKER, "--broker", endpoint, "--offer", host, "--patience", "2", *keys], env=env_with_tests(), announce=None
    )


def raw_keys(ring, who):
    public, secret = read_secret(ring[who + "_secret"])
    return public, secret, read_public(ring["broker"])


def test_a_client_that_never_reads_stalls_nobody_and_its_leaving_kills_nothing(processes):
    """Attacker: any client of a broker (here a keyless loopback one; a client key does the
    same on a keyed one). It sends tens of thousands of control requests and never reads the
    answers: the broker's blocking send stalled its one thread, and when the client left with
    its queue full, libzmq aborted the broker (``!_io_error``, stream_engine_base.cpp:310,
    exit -6); every undeliverable answer was a warning line of its own."""
    hub = keyless_broker(processes)
    flooder, other = Raw(hub.endpoint, hwm=0), Raw(hub.endpoint)
    try:
        ask = encode(Hosts())
        for _ in range(50_000):
            flooder.sock.send_multipart(ask)
        for _ in range(5):  # answered while the flood goes on, every time
            assert isinstance(other.ask(Hosts(), 10.0), Listed), hub.stderr()[-1500:]
        flooder.close()  # it leaves with its queues full
        flooder = None
        wait_until(lambda: not hub.alive or isinstance(other.ask(Hosts(), 1.0), Listed), 20, "an answer after it left")
        for _ in range(10):  # past the heartbeats that used to trip libzmq's assertion
            assert isinstance(other.ask(Hosts(), 5.0), Listed), (
                f"the broker died: {hub.popen.poll()}\n{hub.stderr()[-1500:]}"
            )
            threading.Event().wait(0.3)
        assert hub.alive
    finally:
        for raw in (flooder, other):
            if raw is not None:
                raw.close()
    said = hub.stderr().splitlines()
    assert len(said) < 40, f"{len(said)} lines logged for one flooder:\n" + "\n".join(said[-10:])


def test_a_key_that_floods_from_many_connections_is_cut_and_the_broker_stays_small(processes, tmp_path):
    """Attacker: an allowed client. From eight connections it sends control requests as fast
    as it can and reads nothing. Dropping them unanswered kept the broker serving, but what
    arrived faster than the loop read it piled up in ZeroMQ (a peer's input queue cannot be
    bounded: libzmq aborts when a peer whose queue is full leaves), and the broker grew past a
    gigabyte in ten seconds. Now, while the broker is behind, a key past its share of
    questions a second has each connection it asks on closed: what it queued goes with it,
    and it must dial again."""
    ring = key_ring(tmp_path, clients=("alice", "bob"), workers=("victim",))
    hub = keyed_broker(processes, ring)
    flooders = [Raw(hub.endpoint, raw_keys(ring, "alice"), hwm=0) for _ in range(8)]
    bob = Raw(hub.endpoint, raw_keys(ring, "bob"))
    try:
        assert isinstance(bob.ask(Hosts(), 20.0), Listed)
        before = rss_kib(hub.pid)
        ask = encode(Hosts())
        for _ in range(200):  # 1.6 million requests: without the cut, more than a gigabyte queued
            for raw in flooders:
                for _ in range(1000):
                    raw.sock.send_multipart(ask)
            assert hub.alive
        for _ in range(5):  # another key is answered meanwhile
            assert isinstance(bob.ask(Hosts(), 10.0), Listed), hub.stderr()[-1500:]
        peak = rss_kib(hub.pid, "VmHWM")
        assert peak - before < 256 * 1024, f"the broker grew by {(peak - before) // 1024} MiB"
        assert "its key asked more than" in hub.stderr()
        for raw in flooders:
            raw.close()
        flooders = [Raw(hub.endpoint, raw_keys(ring, "alice"))]
        # a cut is not a ban: once the flood stops, the key is heard again
        wait_until(lambda: isinstance(flooders[0].ask(Hosts(), 2.0), Listed), 20, "alice heard again")
        assert hub.alive
    finally:
        for raw in (*flooders, bob):
            raw.close()


def test_a_relayed_work_the_broker_refuses_is_named_in_the_refusal(processes):
    """A refusal that ends work names it: a Work relayed to a name nobody serves is refused by
    the broker itself, with the Work's ref, so the client ends that call and no other."""
    hub = keyless_broker(processes)
    client = Raw(hub.endpoint)
    try:
        spec = Packer("project").spec(Add(1).named("a").steps[0])
        answer = client.ask(Relay(host="nowhere", inner=tuple(encode(Work(7, Recipe((spec,), ("step", 0)), 41)))))
        assert isinstance(answer, Refusal) and "no worker serving `nowhere`" in answer.why and answer.ref == 7, answer
        answer = client.ask(Relay(host="nowhere", inner=tuple(encode(Hello(RT)))))
        assert isinstance(answer, Refusal) and answer.ref is None  # nothing to name: no work ended
        # a channel that is one lane of many over the connection hears it on its lane
        answer = client.ask(
            Relay(host="nowhere", lane=5, inner=tuple(encode(Work(8, Recipe((spec,), ("step", 0)), 1))))
        )
        assert isinstance(answer, Relay) and answer.lane == 5, answer
        inner = decode(list(answer.inner))
        assert isinstance(inner, Refusal) and inner.ref == 8 and "no worker serving" in inner.why, inner
    finally:
        client.close()


def test_only_a_worker_that_offered_may_answer_the_brokers_check(processes):
    """A dialed worker answers the broker's check (a Hello) with Ready, which the broker
    takes in silence. Attacker: a client sending Ready, as if it were such an answer: it is
    refused like any message a broker does not answer, and makes no host look alive."""
    hub = keyless_broker(processes)
    client = Raw(hub.endpoint)
    try:
        answer = client.ask(Ready(RT), 10.0)
        assert isinstance(answer, Refusal) and "does not answer a `Ready`" in answer.why, answer
        listed = client.ask(Hosts(), 10.0)
        assert isinstance(listed, Listed) and listed.hosts == {}, listed  # and the broker serves on
    finally:
        client.close()


def test_where_lost_from_many_connections_is_checked_once_per_host_off_the_serving_thread(processes, tmp_path):
    """Attacker: clients of a broker with a spawned host. Each `Where(lost)` held the loop
    for a settle and a probe (~0.2 s), with no limit: 450 of them over 30 connections took a
    minute and a half to answer, and everyone else waited behind them."""
    hosts = tmp_path / "hosts.toml"
    hosts.write_text(f'[hosts.s1]\nspawn = ["{WORKER[0]}", "-m", "somatize.worker"]\nmode = "project"\n')
    hub = keyless_broker(processes, "--hosts", str(hosts))
    crowd = [Raw(hub.endpoint) for _ in range(30)]
    other = Raw(hub.endpoint)
    try:
        first = other.ask(Where("s1"), 60)
        assert isinstance(first, Located), first
        for raw in crowd:
            for _ in range(15):
                raw.send(Where("s1", lost=True))
        assert isinstance(other.ask(Hosts(), 20.0), Listed)
        answers = []
        until = time.monotonic() + 30  # one check at a time, shared by all who asked meanwhile: seconds, not minutes
        for raw in crowd:
            for _ in range(15):
                answers.append(raw.answer(max(0.0, until - time.monotonic())))
                assert answers[-1] is not None, f"{len(answers) - 1} of 450 answered within 30 s"
        assert all(isinstance(a, (Located, Refusal)) for a in answers)
        assert all(a.ended is None for a in answers if isinstance(a, Located))  # well: never killed
        assert isinstance(other.ask(Where("s1"), 20.0), Located)
    finally:
        for raw in (*crowd, other):
            raw.close()


def test_a_flood_at_a_dialed_workers_name_neither_drops_it_nor_its_work(processes):
    """Attacker: a client of a broker. It floods a dialed worker's name with small relayed
    Hellos and reads nothing: the worker's queue filled, the broker took the full queue on
    its probe for a dead peer and the worker's keepalives for silence, said `node017` left,
    and a victim's forward ended `Broken`."""
    hub = keyless_broker(processes)
    dial(processes, hub.endpoint, "node017")
    flooder = Raw(hub.endpoint, hwm=0)
    with Broker.at(hub.endpoint, patience=2.0) as victim:
        wait_until(lambda: victim.knows("node017"), 20, "node017 dialing in")
        assert Add(1).named("a").at("node017").forward(1, broker=victim) == 2
        box: list = []
        thread = threading.Thread(target=lambda: box.append(_forward(victim)), daemon=True)
        thread.start()
        try:
            hello = encode(Relay(host="node017", inner=tuple(encode(Hello(RT)))))
            for n in range(100_000):
                flooder.sock.send_multipart(hello)
                if n % 5_000 == 0:  # connections come and go meanwhile: each drop makes the broker look
                    passer = Raw(hub.endpoint)
                    passer.ask(Hosts(), 5.0)
                    passer.close()
            thread.join(60)
        finally:
            flooder.close()
        assert box == [7], box
    assert "`node017` left" not in hub.stderr(), hub.stderr()[-1500:]


def _forward(broker):
    try:
        return Sleep(8.0).named("s").at("node017").forward(7, broker=broker)
    except Exception as exc:  # noqa: BLE001 - the test shows what it was
        return f"{type(exc).__name__}: {exc}"


def sleep_on_node017(client: Raw, asker: Raw | None = None) -> None:
    """Once `node017` has dialed in (``asker`` asks where it is: a socket of its own keeps a
    late answer out of ``client``'s), ``client`` starts a 4 s piece there, relayed."""
    asker = asker or client
    wait_until(lambda: isinstance(asker.ask(Where("node017"), 2.0), Located), 20, "node017 dialing in")
    assert isinstance(client.ask(Relay(host="node017", inner=tuple(encode(Hello(RT))))), Ready)
    spec = Packer("project").spec(Sleep(4.0).named("s").steps[0])
    client.send(Relay(host="node017", inner=tuple(encode(Work(5, Recipe((spec,), ("step", 0)), 41, watched=True)))))


def test_revoking_a_client_key_ends_its_open_exchanges(processes, tmp_path):
    """Attacker: a client whose key was taken out of the allow-list and the broker reloaded.
    Its piece already running on a dialed worker went on streaming `Saw` and delivered its
    `Done` seconds later, relayed: `BrokerView.revoke` said it ended the key's exchanges,
    and did not."""
    ring = key_ring(tmp_path, clients=("alice",), workers=("victim",))
    hub = keyed_broker(processes, ring)
    dial(processes, hub.endpoint, "node017", ring)
    alice = Raw(hub.endpoint, raw_keys(ring, "alice"))
    try:
        sleep_on_node017(alice)
        (ring["allow"] / "alice.key").unlink()
        hub.signal(signal.SIGHUP)
        wait_until(lambda: "reloaded the allow-list" in hub.stderr(), 10, "the reload")
        got = []
        while True:  # until the worker is done with it, and a moment more for its answer to travel
            answer = alice.answer(7.0)
            if answer is None:
                break
            got.append(answer)
        assert not [a for a in got if isinstance(a, Done)], f"a revoked key got its Done: {got}"
    finally:
        alice.close()


def test_revoking_a_worker_key_tells_its_clients_their_work_ended(processes, tmp_path):
    """The other direction of a revocation: the key of the worker serving a piece is taken
    out of `--allow-workers` while the piece runs, and the broker reloaded. The client hears a
    refusal that says so at once, instead of waiting on a worker the broker no longer relays
    for, and nothing of that exchange reaches it afterwards."""
    ring = key_ring(tmp_path, clients=("alice",), workers=("victim",))
    hub = keyed_broker(processes, ring)
    dial(processes, hub.endpoint, "node017", ring)
    probe, alice = Raw(hub.endpoint, raw_keys(ring, "alice")), Raw(hub.endpoint, raw_keys(ring, "alice"))
    try:
        sleep_on_node017(alice, probe)
        (ring["workers"] / "victim.key").unlink()
        hub.signal(signal.SIGHUP)
        got = []
        while True:  # until the piece would have ended, and its answer travelled
            answer = alice.answer(7.0)
            if answer is None:
                break
            got.append(answer)
        told = [i for i, a in enumerate(got) if isinstance(a, Refusal) and "no longer allowed" in a.why]
        assert told, got
        assert not [a for a in got[told[0] :] if not isinstance(a, Refusal)], got  # nothing of it after
        assert not [a for a in got if isinstance(a, Done)], got
        assert isinstance(alice.ask(Where("node017"), 5.0), Refusal)  # and the name is no longer served
    finally:
        probe.close()
        alice.close()


def test_a_key_holds_at_most_its_share_of_connections(processes, tmp_path):
    """Attacker: an allowed client opening connections without end (each costs the broker a
    ZeroMQ pipe and a CURVE session). Past `MAX_CONNECTIONS` for one key, a new connection is
    refused with what to do; another key is not counted with it."""
    from somatize.fabric.broker.loop import MAX_CONNECTIONS

    ring = key_ring(tmp_path, clients=("alice", "bob"), workers=("victim",))
    hub = keyed_broker(processes, ring)
    mine = [Raw(hub.endpoint, raw_keys(ring, "alice")) for _ in range(MAX_CONNECTIONS + 1)]
    bob = Raw(hub.endpoint, raw_keys(ring, "bob"))
    try:
        answers = [raw.ask(Hosts(), 20.0) for raw in mine]
        assert all(isinstance(a, Listed) for a in answers[:MAX_CONNECTIONS]), answers
        assert isinstance(answers[-1], Refusal) and f"{MAX_CONNECTIONS} connections" in answers[-1].why
        assert isinstance(bob.ask(Hosts(), 20.0), Listed)
        assert isinstance(mine[0].ask(Hosts(), 20.0), Listed)  # those it holds go on being served
    finally:
        for raw in (*mine, bob):
            raw.close()


def test_a_name_bound_to_a_key_taken_out_of_the_worker_keys_is_free_again(processes, tmp_path):
    """Attacker (of a sort): an operator's retired worker key. A name stayed bound to a key
    taken out of `--allow-workers`, reloaded or restarted: its new key was refused "served by
    another worker key", and only editing the bindings file helped."""
    ring = key_ring(tmp_path, clients=("alice",), workers=("victim", "heir"))
    (tmp_path / "state").mkdir(mode=0o700)
    bindings = tmp_path / "state" / "bindings.json"
    hub = keyed_broker(processes, ring, "--bindings", str(bindings))
    old = dial(processes, hub.endpoint, "node017", ring, "victim")
    wait_until(lambda: bindings.exists() and "node017" in json.loads(bindings.read_text()), 20, "node017 bound")
    old.stop()
    (ring["workers"] / "victim.key").unlink()
    hub.signal(signal.SIGHUP)
    wait_until(lambda: "host `node017` is free again" in hub.stderr(), 10, "the name set free")
    heir = Raw(hub.endpoint, raw_keys(ring, "heir"))
    try:
        assert isinstance(heir.ask(Hello(RT, offering="node017")), Ready)
    finally:
        heir.close()
    hub.stop()
    # and at start: a file naming a key no longer allowed hands nothing to it
    bindings.write_text(json.dumps({"node018": read_public(ring["victim"]).decode()}))
    again = keyed_broker(processes, ring, "--bindings", str(bindings))
    heir = Raw(again.endpoint, raw_keys(ring, "heir"))
    try:
        assert isinstance(heir.ask(Hello(RT, offering="node018")), Ready)
        assert "host `node018` is free again at start" in again.stderr()
    finally:
        heir.close()


def test_the_bindings_file_is_never_written_through_a_planted_link(processes, tmp_path):
    """Attacker: whoever could plant a link where the broker writes its bindings. The file
    was written through a predictable temporary name (``.bindings.json.<pid>.tmp``) opened
    with ``O_CREAT|O_TRUNC``: a link planted there made the broker overwrite the file it
    pointed to, with the broker user's rights."""
    ring = key_ring(tmp_path, clients=("alice",), workers=("victim",))
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    precious = tmp_path / "precious.txt"
    precious.write_text("the broker user's own file\n")
    bindings = state / "bindings.json"
    hub = keyed_broker(processes, ring, "--bindings", str(bindings))
    os.symlink(precious, state / f".bindings.json.{hub.pid}.tmp")
    dial(processes, hub.endpoint, "node017", ring)
    wait_until(lambda: "node017" in hub.stderr(), 20, "node017 dialing in")
    wait_until(lambda: bindings.exists() and not bindings.is_symlink(), 10, "the bindings written")
    assert precious.read_text() == "the broker user's own file\n"
    assert json.loads(bindings.read_text())["node017"] == read_public(ring["victim"]).decode()


def test_a_bindings_folder_others_may_write_in_is_refused_with_the_fix(processes, tmp_path):
    ring = key_ring(tmp_path, clients=("alice",), workers=("victim",))
    state = tmp_path / "state"
    state.mkdir()
    os.chmod(state, 0o777)
    hub = processes(
        [
            *BROKER,
            "--listen",
            "tcp://127.0.0.1:0",
            "--key",
            str(ring["broker_secret"]),
            "--allow",
            str(ring["allow"]),
            "--allow-workers",
            str(ring["workers"]),
            "--bindings",
            str(state / "bindings.json"),
        ],
        announce=None,
    )
    assert hub.popen.wait(30) == 2
    assert "can be written by others" in hub.stderr() and f"chmod go-w {state}" in hub.stderr()


def test_a_worker_with_no_keys_dialing_a_broker_with_keys_is_told_how_to_start(processes, tmp_path):
    """A keyless worker dialing a broker that listens with CURVE: its handshake fails with
    nothing said, as a broker too busy to finish one would. The broker's greeting, asked
    again, says it wants keys, so the worker's line says which options it lacks rather than
    asking whether the broker is overloaded."""
    ring = key_ring(tmp_path, clients=("alice",), workers=("victim",))
    hub = keyed_broker(processes, ring)
    worker = dial(processes, hub.endpoint, "w1")  # no keys
    wait_until(lambda: "listens with CURVE keys" in worker.stderr(), 20, "the worker saying what it lacks")
    said = worker.stderr()
    assert "--key and --broker-key" in said and "overloaded" not in said, said[-1500:]
    assert hub.alive and worker.alive
