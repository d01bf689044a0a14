"""Several hosts, for real: network namespaces joined by veth pairs, one process per host.

    client (c) --- 10.200.1.0/24 --- broker (b) --- 10.200.4.0/24 --- worker w2
        |
        +--------- 10.200.3.0/24 --- worker w1

The client reaches w1 directly and the broker; it has no route to w2, which reaches only the
broker (w2 routes 10.200.1.0/24 through b to reach the broker's address; b forwards
nothing). So w1 is served Direct, and w2 serves Relayed by dialing in to the broker
(``--broker URL --offer w2``); a Direct attempt at w2's own listening address fails with a
sentence naming it. Every address is inside namespaces made here; names carry this
process's pid, so parallel runs never collide; every process and namespace is removed after,
pass or fail. Needs root and ``ip``; skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import BROKER, WORKER
from reliability_support import Proc, child_env, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.skipif(sys.platform != "linux", reason="network namespaces are Linux's")]

CLIENT = """if True:
    import json, socket, sys, time
    import zmq
    from fabric_nodes import Add
    from somatize import Broker, Unreachable
    from somatize.wire import Where, decode, encode
    url, unreachable = sys.argv[1], sys.argv[2]
    out = {}
    host, port = unreachable.split("://")[1].rsplit(":", 1)
    probe = socket.socket()
    probe.settimeout(3)
    try:
        probe.connect((host, int(port)))
        out["w2_by_tcp"] = "connected"
    except OSError as exc:
        out["w2_by_tcp"] = f"{type(exc).__name__}: {exc}"
    finally:
        probe.close()
    ask = zmq.Context.instance().socket(zmq.DEALER)
    ask.linger = 0
    ask.connect(url)
    def where(name):
        ask.send_multipart(encode(Where(name)))
        assert ask.poll(10_000), "the broker did not answer"
        located = decode(ask.recv_multipart())
        return [located.path, located.address]
    with Broker.at(url, patience=2.0) as broker:
        until = time.monotonic() + 30
        while not broker.knows("w2"):
            assert time.monotonic() < until, "w2 never dialed in"
            time.sleep(0.1)
        out["w1"] = Add(1).named("a").at("w1").forward(1, broker=broker)
        out["w1_where"] = where("w1")
        out["w2"] = Add(2).named("b").at("w2").forward(1, broker=broker)
        out["w2_where"] = where("w2")
        started = time.monotonic()
        try:
            Add(3).named("c").at("w2-direct").forward(1, broker=broker)
            out["w2_direct"] = "it worked"
        except Exception as exc:
            out["w2_direct"] = f"{type(exc).__name__}: {exc}"
        out["w2_direct_s"] = time.monotonic() - started
    ask.close()
    print(json.dumps(out), flush=True)
"""


def ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


class Hosts:
    """Four namespaces (c, b, w1, w2) wired as the module says; ``run`` starts a process in one."""

    LINKS = (  # (namespace, device, address) on each end of a veth pair
        (("c", "tob", "10.200.1.1/24"), ("b", "toc", "10.200.1.2/24")),
        (("c", "tow", "10.200.3.1/24"), ("w1", "toc", "10.200.3.2/24")),
        (("b", "tow", "10.200.4.1/24"), ("w2", "tob", "10.200.4.2/24")),
    )

    def __init__(self, logs) -> None:
        self.logs = logs
        self.names = {role: f"smz{os.getpid()}{role}" for role in ("c", "b", "w1", "w2")}
        self.made: list[str] = []
        self.procs: list[Proc] = []

    def build(self) -> None:
        for name in self.names.values():
            ip("netns", "add", name)
            self.made.append(name)
            ip("-n", name, "link", "set", "lo", "up")
        for (a, dev_a, addr_a), (b, dev_b, addr_b) in self.LINKS:
            ip("-n", self.names[a], "link", "add", dev_a, "type", "veth", "peer", "name", dev_b, "netns", self.names[b])
            for role, dev, addr in ((a, dev_a, addr_a), (b, dev_b, addr_b)):
                ip("-n", self.names[role], "addr", "add", addr, "dev", dev)
                ip("-n", self.names[role], "link", "set", dev, "up")
        ip("-n", self.names["w2"], "route", "add", "10.200.1.0/24", "via", "10.200.4.1")
        ip("netns", "exec", self.names["b"], "sysctl", "-qw", "net.ipv4.ip_forward=0")

    def run(self, role: str, argv: list[str], **options) -> Proc:
        options.setdefault("env", child_env())
        process = Proc(["ip", "netns", "exec", self.names[role], *argv], logs=self.logs, **options)
        self.procs.append(process)
        return process

    def remove(self) -> None:
        for process in reversed(self.procs):
            process.stop()
        for name in self.made:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30, check=False)


@pytest.fixture
def hosts(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("making network namespaces needs root")
    if shutil.which("ip") is None:
        pytest.skip("needs `ip` (iproute2) to make network namespaces")
    made = Hosts(tmp_path / "logs")
    try:
        made.build()
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        made.remove()
        pytest.skip(f"cannot make network namespaces here: {exc}")
    try:
        yield made
    finally:
        made.remove()


@pytest.mark.timeout(120)
def test_direct_where_a_route_exists_relayed_where_none_does(hosts, tmp_path):
    w1 = hosts.run("w1", [*WORKER, "--listen", "10.200.3.2:0", "--announce", "--insecure"])
    w2_listening = hosts.run("w2", [*WORKER, "--listen", "10.200.4.2:0", "--announce", "--insecure"])
    table = tmp_path / "hosts.toml"
    table.write_text(
        f'[hosts.w1]\naddress = "{w1.endpoint}"\nmode = "project"\n\n'
        f'[hosts.w2-direct]\naddress = "{w2_listening.endpoint}"\nmode = "project"\n'
    )
    hub = hosts.run("b", [*BROKER, "--listen", "tcp://10.200.1.2:0", "--announce", "--insecure", "--hosts", str(table)])
    hosts.run("w2", [*WORKER, "--broker", hub.endpoint, "--offer", "w2", "--insecure"], announce=None)
    client = hosts.run("c", [sys.executable, "-c", CLIENT, hub.endpoint, w2_listening.endpoint], announce=None)
    line = client.line(90.0)
    assert line, f"the client said nothing:\n{client.stderr()[-3000:]}"
    seen = json.loads(line)
    print(f"\n[netns] {seen}")

    assert "connected" not in seen["w2_by_tcp"]  # the topology: no route from c to w2
    assert seen["w1"] == 2 and seen["w1_where"] == ["direct", w1.endpoint]
    assert seen["w2"] == 3 and seen["w2_where"][0] == "relayed"
    assert seen["w2_direct"].startswith("Unreachable: ")
    assert w2_listening.endpoint in seen["w2_direct"]  # the sentence names the address
    for process in hosts.procs[:-1]:
        assert process.alive, process.stderr()[-2000:]


SPAWNED_CLIENT = """if True:
    import json, sys, time
    import zmq
    from fabric_nodes import Add
    from somatize import Broker, Keys
    from somatize.fabric.curve import read_public, read_secret
    from somatize.wire import Hello, Runtime, Where, decode, encode
    url, secret, broker_public, other_secret, phase = sys.argv[1:6]
    keys = Keys.client(secret, server=broker_public)
    out = {}

    def greet(address, server_key, pair):
        # a raw DEALER straight to the child: answered only when the child allows ``pair``
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.linger = 0
        if pair is not None:
            sock.curve_publickey, sock.curve_secretkey = pair
            sock.curve_serverkey = server_key
        sock.connect(address)
        sock.send_multipart(encode(Hello(Runtime.here(mode="project"))))
        answered = bool(sock.poll(5_000))
        sock.close()
        return answered

    with Broker.at(url, keys=keys) as broker:
        if phase == "serve":
            out["w3"] = Add(2).named("a").at("w3").forward(1, broker=broker)
        located = broker._rendezvous.locate("w3", None)
        out["where"] = [located.path, located.address, located.key]
    key = located.key.encode()
    out["with_my_key"] = greet(located.address, key, read_secret(secret))
    out["with_another_key"] = greet(located.address, key, read_secret(other_secret))
    out["with_no_key"] = greet(located.address, key, None)
    print(json.dumps(out), flush=True)
"""


@pytest.mark.timeout(150)
def test_a_broker_s_spawned_hosts_are_reached_from_another_machine_with_keys(hosts, tmp_path, request):
    """A standalone broker's spawned workers listened on a socket file of the head node: a
    client on another machine was told an ``ipc://`` address it could never reach."""
    from reliability_support import key_ring

    ring = key_ring(tmp_path, clients=("alice",), workers=(), others=("mallory",))
    table = tmp_path / "hosts.toml"
    table.write_text(f'[hosts.w3]\nspawn = {json.dumps([sys.executable, "-m", "somatize.worker"])}\nmode = "project"\n')
    # the head node's socket files: where the client runs, that folder is another (a machine's own)
    sockets_here = Path(tempfile.mkdtemp(prefix="smz-run-"))  # short: a socket's path has a limit
    request.addfinalizer(lambda: shutil.rmtree(sockets_here, ignore_errors=True))
    hub = hosts.run(
        "b",
        [
            *BROKER,
            "--listen",
            "tcp://10.200.1.2:0",
            "--announce",
            "--key",
            str(ring["broker_secret"]),
            "--allow",
            str(ring["allow"]),
            "--hosts",
            str(table),
        ],
        env={**child_env(), "XDG_RUNTIME_DIR": str(sockets_here)},
    )

    def client(phase: str, me: str, other: str) -> dict:
        argv = [
            sys.executable,
            "-c",
            SPAWNED_CLIENT,
            hub.endpoint,
            str(ring[f"{me}_secret"]),
            str(ring["broker"]),
            str(ring[f"{other}_secret"]),
            phase,
        ]
        elsewhere = [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            f'mount -t tmpfs -o mode=0700 none "{sockets_here}" && exec "$@"',
            "sh",
        ]
        run = hosts.run("c", [*elsewhere, *argv], announce=None)
        line = run.line(90.0)
        assert line, f"the client said nothing:\n{run.stderr()[-3000:]}\n{hub.stderr()[-3000:]}"
        return json.loads(line)

    seen = client("serve", "alice", "mallory")
    print(f"\n[netns] {seen}")
    assert seen["w3"] == 3
    path, address, key = seen["where"]
    assert path == "direct" and address.startswith("tcp://10.200.1.2:") and len(key) == 40
    assert seen["with_my_key"] and not seen["with_another_key"] and not seen["with_no_key"]

    # the allow folder changed and the broker reloaded: its running child reads it again
    (ring["allow"] / "alice.key").unlink()
    (ring["allow"] / "mallory.key").write_bytes(ring["mallory"].read_bytes())
    reloads = hub.stderr().count("reloaded the allow-list")
    os.kill(hub.pid, signal.SIGHUP)
    # the broker's word that it read the folder again, before mallory knocks (CI once had her
    # knock first, and the broker, not yet reloaded, rightly refused her)
    wait_until(lambda: hub.stderr().count("reloaded the allow-list") > reloads, 20, "the broker's reload")
    later = client("look", "mallory", "alice")
    assert later["where"] == seen["where"]  # the same child, still running
    assert later["with_my_key"] and not later["with_another_key"]


POOL_CLIENT = """if True:
    import json, os, signal, sys, time
    import mapping_nodes
    from somatize import Broker
    from somatize.record import fleet
    url, pids = sys.argv[1], json.loads(sys.argv[2])
    out = {"facts": []}
    graph = mapping_nodes.Who(0.01).named("who").at("gpu")
    with Broker.at(url, patience=2.0) as broker:
        until = time.monotonic() + 30
        while broker.members("gpu", refresh=True) != ("gpu#0", "gpu#1"):
            assert time.monotonic() < until, "the two members never dialed in"
            time.sleep(0.1)
        answers = []
        for x, pid in graph.map(range(120), broker=broker, in_flight=4, deadline=30,
                                watching=lambda f: out["facts"].append(f)):
            answers.append([x, pid])
            if len(answers) == 40:  # the member in the far namespace is stopped mid-map
                os.kill(pids["gpu#1"], signal.SIGTERM)
    out["answers"] = answers
    out["left"] = sorted({f["host"] for f in out.pop("facts") if f["fact"] == "left"})
    print(json.dumps(out), flush=True)
"""


@pytest.mark.timeout(150)
def test_a_pool_across_two_namespaces_maps_and_survives_a_member_stopped(hosts):
    """One name, two machines: `gpu#0` on the head node and `gpu#1` on a machine the client
    cannot reach, both dialing in to the broker. The client's map spreads over both, through
    the broker; the far member is stopped a third of the way and every input is answered."""
    hub = hosts.run("b", [*BROKER, "--listen", "tcp://10.200.1.2:0", "--announce", "--insecure"])
    near = hosts.run("b", [*WORKER, "--broker", hub.endpoint, "--offer", "gpu#0", "--insecure"], announce=None)
    far = hosts.run("w2", [*WORKER, "--broker", hub.endpoint, "--offer", "gpu#1", "--insecure"], announce=None)
    # `ip netns exec` enters the namespace and execs the worker: its pid is the one that answers
    pids = {"gpu#0": near.pid, "gpu#1": far.pid}
    client = hosts.run("c", [sys.executable, "-c", POOL_CLIENT, hub.endpoint, json.dumps(pids)], announce=None)
    line = client.line(120.0)
    assert line, f"the client said nothing:\n{client.stderr()[-3000:]}\n{hub.stderr()[-2000:]}"
    seen = json.loads(line)
    print(
        f"\n[netns pool] answers by pid: { {p: sum(1 for _, q in seen['answers'] if q == p) for p in pids.values()} }"
    )
    answers = seen["answers"]
    assert [x for x, _ in answers] == list(range(120))  # every input answered, in order
    assert {pid for _, pid in answers[:40]} == set(pids.values())  # both machines worked
    assert {pid for _, pid in answers[-40:]} == {near.pid}  # the stopped one took no more
    assert seen["left"] == ["gpu#0", "gpu#1"]  # facts name the member
    wait_until(lambda: not far.alive, 20, "the far member to stop")
    assert hub.alive and near.alive, hub.stderr()[-2000:]
