"""The broker's checks on the workers it spawns: they speak the child's language, and a
client's word (or a check that cannot see) never stops a worker others use.

A real standalone broker that listens for other machines with keys (``--listen
tcp://0.0.0.0:0``), spawning a keyed child from its host table; real clients holding
allowed keys; a piece that runs until the test lets it go (a file, never the clock).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest
import zmq
from checks_nodes import Until
from conftest import BROKER, env_with_tests
from fabric_nodes import Pid
from reliability_support import key_ring

from somatize import Broker, Overdue
from somatize.fabric.curve import Keys, read_public, read_secret
from somatize.wire import Located, Where, decode, encode

PATIENCE = 2.0
#: How long a piece, a check or a start may take on a loaded two-core machine (a liveness bound).
BOUND = 45.0


@pytest.fixture
def ring(tmp_path):
    return key_ring(tmp_path, clients=("alice", "bob"), workers=())


def start_broker(processes, ring, tmp_path, jobs=1):
    table = tmp_path / "hosts.toml"
    spawn = [sys.executable, "-m", "somatize.worker", "--jobs", str(jobs)]
    table.write_text('[hosts.s1]\nspawn = [{}]\nmode = "project"\n'.format(", ".join(f'"{a}"' for a in spawn)))
    hub = processes(
        [
            *BROKER,
            "--listen",
            "tcp://0.0.0.0:0",
            "--announce",
            "--key",
            str(ring["broker_secret"]),
            "--allow",
            str(ring["allow"]),
            "--hosts",
            str(table),
            "--patience",
            str(PATIENCE),
        ],
        env=env_with_tests(),
    )
    hub.endpoint = hub.endpoint.replace("0.0.0.0", "127.0.0.1")
    return hub


def client(ring, hub, who):
    return Broker.at(hub.endpoint, keys=Keys.client(ring[who + "_secret"], server=ring["broker"]), patience=PATIENCE)


def where_lost(ring, hub, who="bob") -> object:
    """``Where(s1, lost=True)``, sent by hand as any allowed client may; the broker's answer
    once its check is over."""
    public, secret = read_secret(ring[who + "_secret"])
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    sock.curve_publickey, sock.curve_secretkey = public, secret
    sock.curve_serverkey = read_public(ring["broker"])
    sock.connect(hub.endpoint)
    try:
        sock.send_multipart(encode(Where("s1", lost=True, waited_us=3_000_000)))
        assert sock.poll(int(BOUND * 1000)), "the broker never answered the Where(lost)"
        return decode(sock.recv_multipart())
    finally:
        sock.close(0)


def wait_for_file(path, what: str) -> None:
    until = time.monotonic() + BOUND
    while not path.exists():
        assert time.monotonic() < until, f"never: {what}"
        time.sleep(0.02)


def running(broker, node, box):
    def run():
        try:
            box["value"] = node.forward(7, broker=broker)
        except BaseException as exc:  # noqa: BLE001 - told to the test's thread
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_clients_where_lost_never_kills_a_keyed_child_running_anothers_piece(ring, processes, tmp_path):
    """Attack: one ``Where(s1, lost=True)`` from any allowed client (what every client sends
    after an ``Overdue``) made the broker probe its keyed child with a socket that had no
    CURVE keys; the handshake never completed, the child was declared stuck and killed, and
    the victim's piece ended ``Broken: ... killed by SIGKILL``."""
    hub = start_broker(processes, ring, tmp_path)
    started, go = tmp_path / "started", tmp_path / "go"
    with client(ring, hub, "alice") as alice:
        first = Pid().named("pid").at("s1").forward(0, broker=alice)
        box: dict = {}
        thread = running(alice, Until(str(started), str(go)).named("until").at("s1"), box)
        wait_for_file(started, "the victim's piece started")
        for _ in range(2):
            answer = where_lost(ring, hub)
            assert isinstance(answer, Located) and answer.ended is None, answer
        os.kill(first, 0)  # the child is alive after the check
        go.write_text("")
        thread.join(BOUND)
        assert not thread.is_alive(), "the victim's piece never answered"
        assert box.get("value") == [7, first], box
        assert Pid().named("pid").at("s1").forward(0, broker=alice) == first  # the same child serves on


def test_an_honest_clients_overdue_never_kills_a_keyed_child_another_uses(ring, processes, tmp_path):
    """The same by no attacker: alice's own forward passes its deadline, her client says
    ``Where(s1, lost=True)``, and the child, which runs bob's piece beside hers, stays."""
    hub = start_broker(processes, ring, tmp_path, jobs=2)
    started, go = tmp_path / "started", tmp_path / "go"
    hers, her_go = tmp_path / "hers", tmp_path / "her_go"
    with client(ring, hub, "bob") as bob, client(ring, hub, "alice") as alice:
        first = Pid().named("pid").at("s1").forward(0, broker=bob)
        box: dict = {}
        thread = running(bob, Until(str(started), str(go)).named("victim").at("s1"), box)
        wait_for_file(started, "the victim's piece started")
        try:
            with pytest.raises(Overdue):
                Until(str(hers), str(her_go)).named("late").at("s1").forward(0, broker=alice, deadline=1.0)
            checking = alice._rendezvous.checking.get("s1")
            if checking is not None:  # her client's Where(lost): its answer is the check's end
                checking.join(BOUND)
                assert not checking.is_alive()
            os.kill(first, 0)  # the child is alive after the check
        finally:
            her_go.write_text("")
            go.write_text("")
        thread.join(BOUND)
        assert not thread.is_alive(), "the victim's piece never answered"
        assert box.get("value") == [7, first], box


def test_a_keyed_child_that_is_stopped_is_still_found_stuck_and_started_afresh(ring, processes, tmp_path):
    """The broker's own evidence still stops a child: one whose process is stopped (SIGSTOP)
    is killed at the check, and the next forward starts a fresh one."""
    hub = start_broker(processes, ring, tmp_path)
    with client(ring, hub, "alice") as alice:
        first = Pid().named("pid").at("s1").forward(0, broker=alice)
        os.kill(first, signal.SIGSTOP)
        try:
            answer = where_lost(ring, hub)
        finally:
            try:
                os.kill(first, signal.SIGCONT)
            except ProcessLookupError:
                pass
        assert isinstance(answer, Located) and answer.ended and "stopped" in answer.ended, answer
        alice._forget("s1")
        assert Pid().named("pid").at("s1").forward(0, broker=alice) != first


def greets(address: str, server_key: str, secret_file) -> bool:
    """Whether a keyed child answers this key's Hello within a second."""
    from somatize.wire import Hello, Ready, Runtime

    public, secret = read_secret(secret_file)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = public, secret, server_key.encode()
    sock.connect(address)
    try:
        sock.send_multipart(encode(Hello(Runtime.here(mode="project"))))
        return bool(sock.poll(1000)) and isinstance(decode(sock.recv_multipart()), Ready)
    finally:
        sock.close(0)


def test_a_reloaded_brokers_child_allows_what_the_broker_allows_and_its_checks_still_reach_it(
    ring, processes, tmp_path
):
    """The child's allow folder is the broker's, copied with the checker's key: a key taken
    out of the broker's folder and the broker reloaded (SIGHUP) is refused by the child too,
    and the broker's checks, which no folder names, still reach the child."""
    hub = start_broker(processes, ring, tmp_path)
    with client(ring, hub, "alice") as alice:
        first = Pid().named("pid").at("s1").forward(0, broker=alice)
        located = alice._rendezvous.located["s1"]
        assert greets(located.address, located.key, ring["bob_secret"])
        (ring["allow"] / "bob.key").unlink()
        hub.signal(signal.SIGHUP)
        until = time.monotonic() + BOUND
        while greets(located.address, located.key, ring["bob_secret"]):
            assert time.monotonic() < until, "the child still let in the key taken out of the broker's folder"
        answer = where_lost(ring, hub, "alice")
        assert isinstance(answer, Located) and answer.ended is None, answer
        os.kill(first, 0)
        assert Pid().named("pid").at("s1").forward(0, broker=alice) == first


def test_a_check_that_cannot_reach_a_running_child_says_so_and_kills_nothing(ring, processes, tmp_path):
    """The child refuses every key (its allow folder emptied, the child reloaded): the
    broker's check cannot reach it, though its process runs. That is no evidence: the broker
    says so in its log and leaves the child running."""
    hub = start_broker(processes, ring, tmp_path)
    with client(ring, hub, "alice") as alice:
        first = Pid().named("pid").at("s1").forward(0, broker=alice)
        located = alice._rendezvous.located["s1"]
        argv = open(f"/proc/{first}/cmdline", "rb").read().split(b"\0")
        allow = argv[argv.index(b"--allow") + 1].decode()
        for name in os.listdir(allow):
            os.unlink(os.path.join(allow, name))
        os.kill(first, signal.SIGHUP)
        until = time.monotonic() + BOUND
        while greets(located.address, located.key, ring["alice_secret"]):
            assert time.monotonic() < until, "the child never read its emptied folder"
        answer = where_lost(ring, hub, "bob")
        assert isinstance(answer, Located) and answer.ended is None, answer
        os.kill(first, 0)  # still there
        until = time.monotonic() + BOUND
        while "could not check it" not in hub.stderr():
            assert time.monotonic() < until, f"the broker said nothing:\n{hub.stderr()[-2000:]}"
            time.sleep(0.05)
        assert "It is left running" in hub.stderr()
