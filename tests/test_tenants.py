"""Tenants kept apart on a shared broker: what one allowed user can do to another.

A real standalone broker process with CURVE keys, real dialed-in workers, and attackers
holding keys the broker allows — a client key (may ask) and a worker key (may also offer)
— speaking the wire by hand on raw ZeroMQ sockets.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import zmq
from conftest import BROKER, WORKER, env_with_tests
from fabric_nodes import Add, Pid, Sleep
from reliability_support import key_ring

from brokers import keyed_broker
from somatize import Broker, Refused
from somatize.fabric.curve import Keys, make_pair, read_public, read_secret
from somatize.wire import Done, Hello, Located, Ready, Refusal, Relay, Runtime, Where, decode, encode

RT = Runtime.here(mode="project")


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
        ],
        env=env_with_tests(),
        announce=None,
    )


def client(ring, broker, who="alice") -> Broker:
    return Broker.at(broker.endpoint, keys=Keys.client(ring[who + "_secret"], server=ring["broker"]), patience=2.0)


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

    def close(self):
        self.sock.close(0)


def wait_for_host(broker: Broker, host: str, seconds: float = 20.0) -> None:
    until = time.monotonic() + seconds
    while not broker.knows(host):
        assert time.monotonic() < until, f"`{host}` never dialed in"


def test_another_worker_key_cannot_take_over_a_bound_host(ring, processes):
    """Attack: a second Hello(offering="node017") from another allowed key replaced the first,
    received the victim's inputs and answered for them."""
    broker = keyed_broker(processes, ring)
    dial(processes, ring, broker, "node017")
    with client(ring, broker) as alice:
        wait_for_host(alice, "node017")
        evil = Raw(ring, broker, "evil")
        try:
            answer = evil.ask(Hello(RT, offering="node017"))
            assert isinstance(answer, Refusal) and "another worker key" in answer.why
            assert Add(1).named("a").at("node017").forward(41, broker=alice) == 42
            assert evil.answer(timeout=0.2) is None  # it never saw the victim's input
        finally:
            evil.close()


def test_a_worker_cannot_inject_answers_into_another_clients_exchange(ring, processes):
    """Attack: a dialed-in peer relayed frames to any route id (sequential), injecting a Done
    into another client's exchange."""
    broker = keyed_broker(processes, ring)
    dial(processes, ring, broker, "node017")
    evil = Raw(ring, broker, "evil")
    try:
        assert isinstance(evil.ask(Hello(RT, offering="evilhost")), Ready)
        with client(ring, broker) as alice:
            wait_for_host(alice, "node017")
            outcome: list = []
            honest = threading.Thread(
                target=lambda: outcome.append(Sleep(1.0).named("s").at("node017").forward(7, broker=alice)),
                daemon=True,
            )
            honest.start()
            # forged answers for every exchange number near what a broker might have given
            # alice, while her work runs: each is dropped, none reaches her
            for number in range(1, 40):
                evil.send(Relay(exchange=number, inner=tuple(encode(Done(number, 666, {}, 1)))))
            honest.join(30)
            assert outcome == [7]
            assert evil.answer(timeout=0.2) is None  # dropped, not delivered anywhere
    finally:
        evil.close()


def test_one_worker_key_cannot_squat_every_name(ring, processes):
    """Attack: 1,000 squatted names locked real workers out. A key serves at most
    `--max-hosts-per-key` names at once (4,096 by default: a SLURM job's; 256 here)."""
    broker = keyed_broker(processes, ring, "--max-hosts-per-key", "256")
    evil = Raw(ring, broker, "evil")
    try:
        answers = [evil.ask(Hello(RT, offering=f"node{n:04d}")) for n in range(300)]
        refused = [a for a in answers if isinstance(a, Refusal)]
        assert len(refused) == 300 - 256 and "as many as one key may" in refused[0].why
        dial(processes, ring, broker, "node0299")  # a name the squatter was refused
        with client(ring, broker) as alice:
            wait_for_host(alice, "node0299")
            assert Add(1).named("a").at("node0299").forward(1, broker=alice) == 2
    finally:
        evil.close()


def test_a_client_key_may_ask_but_never_offer(ring, processes):
    broker = keyed_broker(processes, ring)
    bob = Raw(ring, broker, "bob")
    try:
        answer = bob.ask(Hello(RT, offering="gpu9"))
        assert isinstance(answer, Refusal) and "--allow-workers" in answer.why
    finally:
        bob.close()


def test_one_client_cannot_stop_a_spawned_worker_another_uses(ring, processes, tmp_path):
    """Attack: Where(lost=True) from any client killed a spawned worker others were using."""
    hosts = tmp_path / "hosts.toml"
    hosts.write_text(f'[hosts.s1]\nspawn = ["{WORKER[0]}", "-m", "somatize.worker"]\nmode = "project"\n')
    broker = keyed_broker(processes, ring, hosts=hosts)
    with client(ring, broker) as alice:
        first = Pid().named("pid").at("s1").forward(0, broker=alice)
        bob = Raw(ring, broker, "bob")
        try:
            for _ in range(3):
                answer = bob.ask(Where("s1", lost=True))
                assert isinstance(answer, Located) and answer.ended is None
        finally:
            bob.close()
        assert Pid().named("pid").at("s1").forward(0, broker=alice) == first
        os.kill(first, 0)  # still there


def test_revoking_a_key_refuses_its_open_connections(ring, processes):
    """Attack: revoking a key (SIGHUP) left its open connections served."""
    broker = keyed_broker(processes, ring)
    dial(processes, ring, broker, "node017")
    alice = client(ring, broker)
    try:
        wait_for_host(alice, "node017")
        assert Add(1).named("a").at("node017").forward(1, broker=alice) == 2
        (ring["allow"] / "alice.key").unlink()
        broker.signal(signal.SIGHUP)
        until = time.monotonic() + 15
        while True:  # the reload happens when the broker's signal handler runs: wait for it
            try:
                alice._rendezvous.hosts(refresh=True)
            except Refused as exc:
                assert "no longer allowed" in str(exc)
                break
            assert time.monotonic() < until, "the revoked key was still served"
        with pytest.raises(Refused):
            Add(1).named("a").at("node017").forward(1, broker=alice)
    finally:
        alice.close()


def test_an_allow_folder_others_can_write_to_is_refused(ring, processes):
    os.chmod(ring["allow"], 0o777)
    broker = processes(
        [*BROKER, "--listen", "tcp://127.0.0.1:0", "--key", str(ring["broker_secret"]), "--allow", str(ring["allow"])],
        announce=None,
    )
    assert broker.popen.wait(30) == 2
    assert "can be written by others" in broker.stderr() and "chmod go-w" in broker.stderr()


def test_a_folder_called_star_is_a_folder_not_any_key(ring, processes):
    star = ring["dir"] / "*"
    star.mkdir(mode=0o755)
    (star / "alice.key").write_bytes(ring["alice"].read_bytes())
    broker = processes(
        [
            *BROKER,
            "--listen",
            "tcp://127.0.0.1:0",
            "--announce",
            "--key",
            str(ring["broker_secret"]),
            "--allow",
            str(star),
        ],
    )
    with client(ring, broker, "alice") as alice:
        assert alice.hosts() == []
    bob = Raw(ring, broker, "bob")
    try:
        assert bob.ask(Hello(RT), timeout=2.0) is None  # its handshake fails: no answer ever
    finally:
        bob.close()


def test_a_client_the_broker_does_not_allow_is_told_so_not_that_nobody_is_there(ring, processes, tmp_path):
    """A key not in the allow folder, or no keys at all, fails the CURVE handshake: the
    client says that, at once, instead of waiting to ask whether a broker is running."""
    broker = keyed_broker(processes, ring)
    stranger_public, stranger_secret = make_pair(tmp_path / "strangers", "stranger")
    started = time.monotonic()
    with Broker.at(broker.endpoint, keys=Keys.client(stranger_secret, server=ring["broker"]), patience=2.0) as b:
        with pytest.raises(Refused, match="refused this client's CURVE handshake.*allow folder"):
            b.hosts()
    with Broker.at(broker.endpoint, patience=2.0) as b:
        with pytest.raises(Refused, match="This client has no keys"):
            b.hosts()
    assert time.monotonic() - started < 8.0  # each within one wait of 2 patiences, not more


def test_another_worker_key_cannot_join_a_pool_another_key_serves(ring, processes):
    """Attack: a pool's name means any member, so an allowed worker key offering a new
    member's name (`cpu#7`) would receive a share of every input mapped over another key's
    pool. The members of a pool are one key's: the offer is refused, and none of the inputs
    reach it."""
    broker = keyed_broker(processes, ring)
    dial(processes, ring, broker, "cpu#0")
    with client(ring, broker) as alice:
        wait_for_host(alice, "cpu#0")
        evil = Raw(ring, broker, "evil")
        try:
            answer = evil.ask(Hello(RT, offering="cpu#7"))
            assert isinstance(answer, Refusal) and "pool `cpu` is served by another worker key" in answer.why
            assert alice.members("cpu", refresh=True) == ("cpu#0",)
            assert list(Add(1).named("a").at("cpu").map(range(6), broker=alice)) == [1, 2, 3, 4, 5, 6]
            assert evil.answer(timeout=0.2) is None  # it never saw an input
            # a name of a pool of its own is its to offer
            assert isinstance(evil.ask(Hello(RT, offering="evilpool#0")), Ready)
        finally:
            evil.close()


def test_no_worker_dials_in_to_a_pool_the_broker_declares(ring, processes, tmp_path):
    """Attack: the host table declares the pool `cpu` (spawned members `cpu#0`, `cpu#1`); an
    allowed worker key offering `cpu#2` would be handed a share of its inputs."""
    table = tmp_path / "hosts.toml"
    table.write_text('[hosts.cpu]\nspawn = ["python", "-m", "somatize.worker"]\nprocesses = 2\n')
    broker = keyed_broker(processes, ring, hosts=table)
    evil = Raw(ring, broker, "evil")
    try:
        answer = evil.ask(Hello(RT, offering="cpu#2"))
        assert isinstance(answer, Refusal) and "the pool `cpu` declared on this broker's table" in answer.why
    finally:
        evil.close()
