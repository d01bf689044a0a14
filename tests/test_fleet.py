"""One broker, a whole fleet (issue 20): thousands of dialed workers, a client that reaches
every host, costs that do not grow with the fleet.

Real processes: a standalone broker (``python -m somatize.broker``); workers as real dialed
worker loops, many to a process (``benchmarks/fleet.py``), or as raw DEALERs saying what a
dialing worker says, thousands on threads of this process. What it costs per worker, and how
many forwards a second four clients get, is measured by case (h) of ``benchmarks/``
(``benchmarks/fleet.py``), never asserted here.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest
import zmq
from conftest import BROKER, env_with_tests
from fabric_nodes import Add
from reliability_support import key_ring, wait_until

from brokers import keyed_broker
from somatize import Broker, Closed
from somatize.fabric.curve import read_public, read_secret
from somatize.wire import Bye, Hello, Hosts, Listed, Ready, Runtime, decode, encode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from fleet import Fleet  # noqa: E402

pytestmark = pytest.mark.slow

RT = Runtime.here(mode="project")


# Raw DEALERs never say a keepalive: a patience longer than the slowest machine takes to shake
# hands with 2,000 of them (CURVE, beside the rest of the suite), so none has expired when the
# listing is asked for. Expiry has tests of its own (test_reliability, test_broker_holds).
SILENT_FOR_THE_TEST = "120"


def broker(processes, *extra, patience: str = "5"):
    return processes(
        [*BROKER, "--listen", "tcp://127.0.0.1:0", "--announce", "--patience", patience, *extra], env=env_with_tests()
    )


class Dialers:
    """``count`` DEALERs in a context of their own (ZeroMQ's default allows 1,023 sockets),
    each saying what a dialing worker says: ``Hello(offering=name)``."""

    def __init__(self, endpoint: str, count: int, keys=None) -> None:
        self.ctx = zmq.Context()
        self.ctx.set(zmq.MAX_SOCKETS, 2 * count + 64)
        self.socks = []
        for _ in range(count):
            sock = self.ctx.socket(zmq.DEALER)
            sock.linger = 0
            if keys is not None:
                sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = keys
            sock.connect(endpoint)
            self.socks.append(sock)

    def offer(self, names) -> list:
        """Each socket offers its name; the answers, in order. One not answered within 30 s
        says Hello again, as a dialing worker does (two thousand connecting at once on two
        busy cores: once in a CI run, one of them heard nothing within 30 s)."""
        pairs = list(zip(self.socks, names, strict=True))
        for sock, name in pairs:
            sock.send_multipart(encode(Hello(RT, offering=name)))
        answers = []
        for sock, name in pairs:
            if not sock.poll(30_000):
                sock.send_multipart(encode(Hello(RT, offering=name)))
            answers.append(decode(sock.recv_multipart()) if sock.poll(30_000) else None)
        return answers

    def close(self) -> None:
        for sock in self.socks:
            sock.close(0)
        self.ctx.term()


def hosts_of(endpoint: str, keys=None) -> dict:
    asker = Dialers(endpoint, 1, keys)
    try:
        asker.socks[0].send_multipart(encode(Hosts()))
        assert asker.socks[0].poll(30_000)
        listed = decode(asker.socks[0].recv_multipart())
        assert isinstance(listed, Listed), listed
        return listed.hosts
    finally:
        asker.close()


def test_two_thousand_workers_dial_in_to_one_broker(processes):
    """A broker took 1,000 dialed workers at most; the 1,001st was refused."""
    hub = broker(processes, patience=SILENT_FOR_THE_TEST)
    names = [f"node{n:05d}" for n in range(2000)]
    fleet = Dialers(hub.endpoint, len(names))
    try:
        answers = fleet.offer(names)
        refused = [a for a in answers if not isinstance(a, Ready)]
        assert not refused, f"{len(refused)} refused, the first: {refused[0]}"
        assert set(names) <= set(hosts_of(hub.endpoint))
        for sock, name in zip(fleet.socks, names, strict=False):  # every worker's keepalive: not answered, and kept
            sock.send_multipart(encode(Hello(RT, offering=name)))
        assert set(names) <= set(hosts_of(hub.endpoint))
    finally:
        fleet.close()
    assert hub.alive


def test_one_worker_key_serves_two_thousand_names(processes, tmp_path):
    """A worker key served 256 hosts at most, from 64 connections at most: one SLURM job's
    key stopped at 64 nodes."""
    ring = key_ring(tmp_path, clients=("alice",), workers=("slurm",))
    hub = keyed_broker(processes, ring, patience=SILENT_FOR_THE_TEST)
    public, secret = read_secret(ring["slurm_secret"])
    keys = (public, secret, read_public(ring["broker"]))
    names = [f"job7-node{n:04d}" for n in range(2000)]
    fleet = Dialers(hub.endpoint, len(names), keys)  # a node each, one key for the whole job
    try:
        answers = fleet.offer(names)
        refused = [a for a in answers if not isinstance(a, Ready)]
        assert not refused, f"{len(refused)} refused, the first: {refused[0]}"
        alice = read_secret(ring["alice_secret"])
        assert set(names) <= set(hosts_of(hub.endpoint, (*alice, read_public(ring["broker"]))))
    finally:
        fleet.close()


def test_one_client_reaches_every_host_of_a_fleet_with_the_default_socket_limit(processes):
    """Each relayed host cost a client a DEALER, a monitor and a connection kept idle for the
    whole session: at ZeroMQ's default 1,023 sockets the 342nd host raised a raw
    ``ZMQError: Too many open files``, and the broker held clients x hosts connections."""
    hub = broker(processes)
    fleet = Fleet(hub.endpoint, 400, env=env_with_tests())
    client = Broker.at(hub.endpoint)
    try:
        wait_until(lambda: fleet.registered(client), 60, "the fleet dialing in")
        for n, host in enumerate(fleet.hosts):
            assert Add(1).named("a").at(host).forward(n, broker=client) == n + 1
        held = len(os.listdir(f"/proc/{hub.pid}/fd"))
        # a connection a worker, and the client's two (its questions, and every relayed channel's lane)
        assert held < len(fleet.hosts) + 20, f"the broker holds {held} descriptors for {len(fleet.hosts)} workers"
    finally:
        client.close()
        fleet.close()


def test_concurrent_relayed_calls_over_one_connection_each_get_their_own_answer(processes):
    """Every relayed channel of a client is a lane of its one connection to the broker: calls
    running at once, to one host and to several, never see each other's answers."""
    import threading

    hub = broker(processes)
    fleet = Fleet(hub.endpoint, 3, env=env_with_tests())
    client = Broker.at(hub.endpoint)
    try:
        wait_until(lambda: fleet.registered(client), 60, "the fleet dialing in")
        wrong: list = []

        def calls(k: int) -> None:
            for n in range(15):
                x = 1000 * k + n
                host = fleet.hosts[(k + n) % len(fleet.hosts)]
                got = Add(1).named("a").at(host).forward(x, broker=client)
                if got != x + 1:
                    wrong.append((host, x, got))

        threads = [threading.Thread(target=calls, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not [t for t in threads if t.is_alive()] and not wrong, wrong[:5]
    finally:
        client.close()
        fleet.close()


def test_a_worker_without_keys_never_blames_curve_for_a_failed_handshake(processes):
    """A dialed worker without keys whose handshake failed (here: something that is not a
    broker answers on the port; in the fleet, a broker too busy to finish handshakes) logged
    "the broker ... refused this worker's CURVE handshake", about keys nobody used."""
    import socket
    import threading

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    port = server.getsockname()[1]
    stop = threading.Event()

    def not_a_broker() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            with conn:
                conn.sendall(b"HTTP/1.0 400 Bad Request\r\n\r\n" * 8)

    threading.Thread(target=not_a_broker, daemon=True).start()
    try:
        worker = processes(
            [
                sys.executable,
                "-m",
                "somatize.worker",
                "--broker",
                f"tcp://127.0.0.1:{port}",
                "--offer",
                "w1",
                "--patience",
                "1",
            ],
            announce=None,
            env=env_with_tests(),
        )
        wait_until(lambda: "handshake with the broker" in worker.stderr(), 20, "the failed handshake logged")
        assert "CURVE" not in worker.stderr(), worker.stderr()
        assert worker.alive  # it dials on
    finally:
        stop.set()
        server.close()


@pytest.mark.parametrize("how", ["listening", "dialed"])
def test_an_idle_worker_sleeps_and_still_stops_at_once(processes, how):
    """An idle worker loop woke five times a second to look for a stop, whatever its
    patience: a process of a thousand dialed loops took a quarter of a core doing nothing.
    Now it sleeps until something is due (here a 30 s patience), and a stop wakes it."""
    from somatize.fabric.worker.loop import WorkerLoop

    loop = WorkerLoop(mode="project", patience=30.0)
    if how == "listening":
        loop.bind("tcp://127.0.0.1:0")
    else:
        hub = broker(processes, patience="30")
        loop.dial(hub.endpoint, "sleeper")
    turns, turn = [], loop._turn
    loop._turn = lambda *a: (turns.append(a[1]), turn(*a))  # counts the turns, does each
    serving = threading.Thread(target=loop.serve, daemon=True)
    serving.start()
    try:
        if how == "dialed":
            client = Broker.at(hub.endpoint)
            try:
                wait_until(lambda: client.knows("sleeper"), 30, "the worker dialing in")
            finally:
                client.close()
        wait_until(lambda: turns, 10, "a first turn")
        before = len(turns)
        stopped = threading.Event()
        threading.Timer(1.5, stopped.set).start()
        stopped.wait()  # a window of idleness: how often did it wake meanwhile?
        assert len(turns) - before <= 2, f"{len(turns) - before} turns in 1.5 s idle (timeouts {turns[-5:]} ms)"
        assert max(turns[before:] or [1_000_000]) >= 1_000
    finally:
        loop.close()
    serving.join(10)
    assert not serving.is_alive(), "a stop did not wake the sleeping loop"


def test_closing_a_client_ends_the_waits_of_its_threads_on_relayed_answers(processes, tmp_path):
    """A client's relayed channels share one connection and no thread of their own: the
    threads waiting for answers take turns holding it. Closed from another thread while two
    of them wait (one holding the connection, one waiting for its turn), the client ends both
    waits with an error and leaves no thread of its own behind."""
    from holds_nodes import Hold

    hub = broker(processes)
    fleet = Fleet(hub.endpoint, 2, env=env_with_tests())
    client = Broker.at(hub.endpoint)
    release = tmp_path / "release"
    outcomes: dict = {}
    try:
        wait_until(lambda: fleet.registered(client), 60, "the fleet dialing in")
        assert Add(1).named("a").at(fleet.hosts[0]).forward(1, broker=client) == 2

        def call(k: int) -> None:
            node = Hold(str(tmp_path / f"started{k}"), str(release), str(tmp_path / f"finished{k}"))
            try:
                outcomes[k] = node.named(f"hold{k}").at(fleet.hosts[k]).forward(k, broker=client)
            except Exception as exc:  # noqa: BLE001 - what the test looks at
                outcomes[k] = exc

        threads = [threading.Thread(target=call, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        wait_until(lambda: all((tmp_path / f"started{k}").exists() for k in range(2)), 60, "both pieces running")
        assert "somatize-link" not in {t.name for t in threading.enumerate()}
        client.close()
        for t in threads:
            t.join(30)
        assert not [t for t in threads if t.is_alive()], "a thread still waits on a closed client"
        for k in range(2):  # said as what happened: this client was closed, not the broker gone
            assert isinstance(outcomes[k], Closed) and "this client was closed" in str(outcomes[k]), outcomes
    finally:
        release.write_text("go")
        client.close()
        fleet.close()


def test_a_client_reaches_the_dialed_hosts_it_listed_without_asking_where_each_is():
    """A first forward to a dialed host asked the broker `Where` it was, though the listing the
    client had already fetched could say: a round trip through the broker for every host of a
    fleet, for every client. Now the listing says of each dialed host what `Where` would
    (its folder for cargo, if any), and a host that left since is refused by the broker
    in a sentence that says so, not blamed on a worker."""
    from somatize import Refused
    from somatize.fabric.broker.loop import BrokerLoop
    from somatize.fabric.worker.loop import WorkerLoop

    server = BrokerLoop({}, patience=5.0)
    url = server.bind("tcp://127.0.0.1:0")
    from somatize.fabric.conversation import Step

    asked: list[str] = []
    where = server._steps[Step.LOCATE]  # what the broker does with a `Where` (the table's step)
    server._steps[Step.LOCATE] = lambda *given: (asked.append(given[4].host), where(*given))[1]  # counts, answers
    serving = threading.Thread(target=server.serve, daemon=True)
    serving.start()
    loops = {f"h{n}": WorkerLoop(mode="project", patience=5.0) for n in range(3)}
    threads = []
    for host, loop in loops.items():
        loop.dial(url, host)
        threads.append(threading.Thread(target=loop.serve, daemon=True))
        threads[-1].start()
    client = Broker.at(url)
    try:
        wait_until(lambda: all(client.knows(h) for h in loops), 30, "the workers dialing in")
        for n, host in enumerate(("h0", "h1")):
            assert Add(1).named("a").at(host).forward(n, broker=client) == n + 1
        assert asked == [], f"the client asked Where of {asked}, which its listing said"
        loops["h2"].close()  # it says Bye: the broker forgets it, the client's listing still has it
        threads[2].join(10)
        wait_until(lambda: "h2" not in server.view.offers, 10, "the broker forgetting h2")
        with pytest.raises(Refused) as info:
            Add(1).named("a").at("h2").forward(5, broker=client)
        assert f"the broker at {url}" in str(info.value) and "no worker serving `h2`" in str(info.value), info.value
        assert "it left, or has not dialed in yet" in str(info.value)
        assert asked == [] and Add(1).named("a").at("h0").forward(7, broker=client) == 8
    finally:
        client.close()
        for loop in loops.values():
            loop.close()
        for t in threads:
            t.join(10)
        server.stopping.set()
        serving.join(10)
        server.close()


def _dialed(hosts):
    """An in-process broker and a dialed worker loop for each of ``hosts``, all serving."""
    from somatize.fabric.broker.loop import BrokerLoop
    from somatize.fabric.worker.loop import WorkerLoop

    server = BrokerLoop({}, patience=5.0)
    url = server.bind("tcp://127.0.0.1:0")
    loops = {host: WorkerLoop(mode="project", patience=5.0) for host in hosts}
    threads = [threading.Thread(target=server.serve, daemon=True)]
    for host, loop in loops.items():
        loop.dial(url, host)
        threads.append(threading.Thread(target=loop.serve, daemon=True))
    for thread in threads:
        thread.start()
    return server, url, loops, threads


def _stop(server, loops, threads) -> None:
    for loop in loops.values():
        loop.close()
    server.stopping.set()
    for thread in threads:
        thread.join(10)
    server.close()


def test_a_client_closing_says_bye_once_and_the_broker_tells_each_of_its_workers():
    """A client closing said Bye on each of its relayed channels, one message each way per
    host it had reached. Now it says Bye once, on its connection, and the broker, ending that
    connection's exchanges, tells each worker, which forgets that session at once."""
    server, url, loops, threads = _dialed(["h0", "h1", "h2"])
    byes = []
    relay = server.view.relay
    server.view.relay = lambda route, key, message, now: (  # counts the channels' own Byes, relays all
        byes.append(message.host) if decode(list(message.inner)) == Bye() else None,
        relay(route, key, message, now),
    )[1]
    try:
        client = Broker.at(url)
        wait_until(lambda: all(client.knows(h) for h in loops), 30, "the workers dialing in")
        for n, host in enumerate(loops):
            assert Add(1).named("a").at(host).forward(n, broker=client) == n + 1
        assert [len(loop.sessions) for loop in loops.values()] == [1, 1, 1]
        client.close()
        wait_until(
            lambda: all(len(loop.sessions) == 0 for loop in loops.values()), 10, "each worker forgetting the client"
        )
        assert byes == [] and server.view.exchanges == {}
    finally:
        _stop(server, loops, threads)


def test_an_exchange_crowded_out_at_the_broker_is_ended_at_its_worker_too():
    """A tenant's exchanges past `max_exchanges` end, the least recently used first: its
    worker kept the session until its own limit crowded it out (10,000 of them). Now the
    broker tells it, and it forgets that session then."""
    server, url, loops, threads = _dialed(["h0", "h1", "h2"])
    server.view.max_exchanges = 2
    try:
        with Broker.at(url) as client:
            wait_until(lambda: all(client.knows(h) for h in loops), 30, "the workers dialing in")
            for n, host in enumerate(loops):
                assert Add(1).named("a").at(host).forward(n, broker=client) == n + 1
            wait_until(lambda: len(loops["h0"].sessions) == 0, 10, "h0 forgetting the exchange crowded out")
            assert [len(loops[h].sessions) for h in ("h1", "h2")] == [1, 1]
            assert Add(1).named("a").at("h0").forward(5, broker=client) == 6  # it says Hello again
    finally:
        _stop(server, loops, threads)


def test_an_exchange_crowded_out_while_its_work_is_open_is_told_to_its_client():
    """Crowding out took the least recently used exchange even when its client waited on an
    answer there: the client heard nothing until its deadline (or ever, without one), while
    the worker went on. Now an exchange whose client waits on nothing goes first, and a
    client whose open work is crowded out is told at once that its fate is unknown."""
    from fabric_nodes import Sleep

    from somatize import Refused

    server, url, loops, threads = _dialed(["h0", "h1", "h2", "h3"])
    server.view.max_exchanges = 2
    answers: dict = {}

    def forward(host: str) -> None:
        try:
            answers[host] = Sleep(1.5).named("s").at(host).forward(host, broker=client, deadline=30)
        except Exception as exc:
            answers[host] = exc

    try:
        with Broker.at(url) as client:
            wait_until(lambda: all(client.knows(h) for h in loops), 30, "the workers dialing in")
            assert Add(1).named("a").at("h3").forward(1, broker=client) == 2  # its exchange waits on nothing
            running = [threading.Thread(target=forward, args=(host,)) for host in ("h0", "h1")]
            for thread in running:
                thread.start()
            wait_until(lambda: loops["h0"].running() and loops["h1"].running(), 10, "both running")
            # the second of their exchanges crowded out h3's, the one with nothing open, not the first's older one
            wait_until(lambda: len(loops["h3"].sessions) == 0, 10, "h3 forgetting its exchange")
            assert "h0" not in answers and "h1" not in answers
            assert Add(1).named("a").at("h2").forward(1, broker=client) == 2  # both open: the older goes
            wait_until(lambda: answers, 10, "the forward crowded out told")  # at once, not after its 1.5 s
            ((cut, refused),) = answers.items()
            assert isinstance(refused, Refused), answers
            assert f"this broker ended the exchange with `{cut}` while the work sent there was open" in str(refused)
            assert "whether it ran is not known" in str(refused)
            for thread in running:
                thread.join(30)
            other = "h1" if cut == "h0" else "h0"
            assert answers[other] == other  # the other went on, and answered
    finally:
        _stop(server, loops, threads)


def test_another_client_cannot_end_my_exchange_and_byes_for_exchanges_never_opened_open_none():
    """Attacker: another allowed client of the broker, speaking the wire by hand. A `Bye` in
    a relayed channel now ends its exchange at the broker and, when a client leaves, the
    broker tells its workers: neither may reach what is not the sender's. Byes naming a
    victim's host and lane, a host it never used, and its own connection's Bye end only the
    attacker's own (none), open nothing at the broker, and reach no worker."""
    from peers import Raw

    from somatize.wire import Relay

    server, url, loops, threads = _dialed(["h0", "h1"])
    attacker = None
    try:
        with Broker.at(url) as victim:
            wait_until(lambda: all(victim.knows(h) for h in loops), 30, "the workers dialing in")
            assert Add(1).named("a").at("h0").forward(1, broker=victim) == 2
            mine = dict(server.view.exchanges)
            (exchange,) = mine.values()
            attacker = Raw(url)
            assert isinstance(attacker.ask(Hello(RT)), Ready)
            bye = tuple(encode(Bye()))
            for _ in range(200):  # a flood of them, on the victim's host and lane, and on another host
                attacker.send(Relay(host="h0", lane=exchange.lane, inner=bye))
                attacker.send(Relay(host="h0", inner=bye))
                attacker.send(Relay(host="h1", lane=7, inner=bye))
            assert isinstance(attacker.ask(Hello(RT)), Ready)  # answered after them: all before it was handled
            assert server.view.exchanges == mine, "the attacker's Byes opened or ended an exchange"
            attacker.send(Bye())  # its own connection ends: its exchanges (none) end
            assert isinstance(attacker.ask(Hello(RT)), Ready)
            assert server.view.exchanges == mine
            assert [len(loop.sessions) for loop in loops.values()] == [1, 0]  # the victim's session stands
            assert Add(1).named("a").at("h0").forward(2, broker=victim) == 3
            assert server.view.exchanges == mine  # the same exchange served it: nothing was said again
    finally:
        if attacker is not None:
            attacker.close()
        _stop(server, loops, threads)
