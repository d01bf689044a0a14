"""Safe by default: keys, allow-lists, refusals that reach no handler, no code by value where
it is not allowed, a host's name kept by the worker key that offered it first (across broker
restarts), and keys refused told from a peer that hangs up (the greeting probe). Real worker
processes, real CURVE handshakes, real files."""

from __future__ import annotations

import os
import pickle
import signal
import socket
import subprocess
import sys
import time

import pytest
import zmq
from by_hand import PATIENCE, WAIT, free_port
from conftest import WORKER, env_with_tests
from fabric_nodes import Add, Count
from peers import RT, Raw, curve_router, socket_peer, within
from reliability_support import key_ring, wait_until

from brokers import keyed_broker
from somatize import BadKeys, Broker, KeysRefused, Refused, SomatizeError, Unreachable, Unwritable, Worker
from somatize.codec import dumps
from somatize.fabric import sockets
from somatize.fabric.curve import PROBE, Keys, hung_up, make_pair, speaks_curve
from somatize.wire import Hello, Provision, Ready, Refusal, Runtime, decode, encode


@pytest.fixture
def keyring(tmp_path):
    """A worker's pair, a good client's pair in the allow-list, and a stranger's pair."""
    folder = tmp_path / "keys"
    allow = tmp_path / "allow"
    allow.mkdir()
    worker_public, worker_secret = make_pair(folder, "w1")
    me_public, me_secret = make_pair(folder, "me")
    _, stranger_secret = make_pair(folder, "stranger")
    (allow / "me.key").write_bytes(me_public.read_bytes())
    return {
        "worker_public": worker_public,
        "worker_secret": worker_secret,
        "me_secret": me_secret,
        "stranger_secret": stranger_secret,
        "allow": allow,
    }


def keyed_worker(processes, keyring, *extra):
    return processes(
        [
            *WORKER,
            "--listen",
            "127.0.0.1:0",
            "--announce",
            "--key",
            str(keyring["worker_secret"]),
            "--allow",
            str(keyring["allow"]),
            *extra,
        ],
        env=env_with_tests(),
    )


def client(keyring, endpoint, secret="me_secret", *, patience=2.0):
    keys = Keys.client(keyring[secret], server=keyring["worker_public"])
    return Broker.embedded({"w1": Worker.at(endpoint, mode="project", keys=keys)}, patience=patience)


# -- keys ---------------------------------------------------------------------------------


def test_keys_command_writes_a_public_and_a_private_secret_key(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "somatize", "keys", str(tmp_path), "w1"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "w1.key").exists()
    assert (os.stat(tmp_path / "w1.key_secret").st_mode & 0o777) == 0o600
    Keys.server(tmp_path / "w1.key_secret", allow=tmp_path)  # loads


def test_a_secret_key_others_can_read_is_refused_with_the_fix(keyring):
    os.chmod(keyring["me_secret"], 0o644)
    with pytest.raises(BadKeys, match=r"can be read by others.*chmod 600"):
        Keys.client(keyring["me_secret"], server=keyring["worker_public"])


def test_a_worker_with_a_readable_secret_key_does_not_start(keyring):
    os.chmod(keyring["worker_secret"], 0o640)
    done = subprocess.run(
        [*WORKER, "--listen", "127.0.0.1:0", "--key", str(keyring["worker_secret"]), "--allow", str(keyring["allow"])],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2 and "chmod 600" in done.stderr


def test_keys_are_never_shown():
    public, secret = zmq.curve_keypair()
    assert secret.decode() not in repr(Keys(public, secret))


# -- binding --------------------------------------------------------------------------


def test_listening_beyond_loopback_needs_keys_or_insecure(keyring, processes):
    refused = subprocess.run([*WORKER, "--listen", "0.0.0.0:0"], capture_output=True, text=True, timeout=30)
    assert refused.returncode == 2 and "--key" in refused.stderr and "--insecure" in refused.stderr
    keyed = processes(
        [
            *WORKER,
            "--listen",
            "0.0.0.0:0",
            "--announce",
            "--key",
            str(keyring["worker_secret"]),
            "--allow",
            str(keyring["allow"]),
        ]
    )
    assert keyed.endpoint.startswith("tcp://0.0.0.0:")
    loose = subprocess.Popen([*WORKER, "--listen", "0.0.0.0:0", "--insecure"], stderr=subprocess.PIPE, text=True)
    try:
        line = loose.stderr.readline()  # the warning comes first, at every start
    finally:
        loose.terminate()
        loose.communicate(timeout=10)
    assert "WARNING" in line and "--insecure" in line


def test_the_broker_follows_the_same_rule():
    done = subprocess.run(
        [sys.executable, "-m", "somatize.broker", "--listen", "tcp://0.0.0.0:0"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2 and "refusing to listen" in done.stderr


# -- who gets in ------------------------------------------------------------------------


def test_an_allowed_key_works(keyring, processes):
    worker = keyed_worker(processes, keyring)
    with client(keyring, worker.endpoint) as broker:
        assert (Add(1).named("a").at("w1") >> Add(2).named("b").at("w1")).forward(1, broker=broker) == 4


def test_an_unknown_key_is_refused_and_reaches_no_handler(keyring, processes, tmp_path):
    worker = keyed_worker(processes, keyring)
    sentinel = tmp_path / "ran"
    with client(keyring, worker.endpoint, "stranger_secret") as broker:
        with pytest.raises((Refused, Unreachable)) as info:
            Count(str(sentinel)).named("count").at("w1").forward(1, broker=broker)
    assert "credentials" in str(info.value) or "nobody answered" in str(info.value)
    assert not sentinel.exists()
    with client(keyring, worker.endpoint) as broker:  # the worker is still serving
        assert Add(1).named("a").at("w1").forward(1, broker=broker) == 2


def test_a_client_without_curve_is_refused_and_reaches_no_handler(keyring, processes, tmp_path):
    worker = keyed_worker(processes, keyring)
    sentinel = tmp_path / "ran"
    with Broker.embedded({"w1": Worker.at(worker.endpoint, mode="project")}, patience=1.5) as broker:
        with pytest.raises((Refused, Unreachable)):
            Count(str(sentinel)).named("count").at("w1").forward(1, broker=broker)
    assert not sentinel.exists()


def test_raw_zmtp_bytes_reach_no_handler(keyring, processes):
    worker = keyed_worker(processes, keyring)
    host, port = worker.endpoint.split("://")[1].rsplit(":", 1)
    hello = encode(Hello(Runtime.here(mode="network")))[0]
    hello = bytes(hello)
    for payload in (
        b"\x01\x00" + bytes([len(hello) + 1, 0]) + hello,  # ZMTP 1.0: empty identity, then a frame
        b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL" + b"\x00" * 16,  # a 3.0 greeting asking NULL
        os.urandom(512),
    ):
        with socket.create_connection((host, int(port)), timeout=5) as raw:
            raw.sendall(payload)
            raw.settimeout(1.0)
            try:
                answer = raw.recv(4096)
            except (TimeoutError, ConnectionResetError):
                answer = b""
            assert b"Ready" not in answer  # whatever it said, it was not the worker answering
    assert worker.popen.poll() is None
    with client(keyring, worker.endpoint) as broker:
        assert Add(1).named("a").at("w1").forward(1, broker=broker) == 2


def test_a_key_taken_out_of_the_allow_list_is_refused_after_a_reload(keyring, processes):
    """Attack: revoking a key (SIGHUP) left its open connections served."""
    worker = keyed_worker(processes, keyring)
    with client(keyring, worker.endpoint) as broker:
        assert Add(1).named("a").at("w1").forward(1, broker=broker) == 2
        (keyring["allow"] / "me.key").unlink()
        os.kill(worker.pid, signal.SIGHUP)
        until = time.monotonic() + 15
        while True:  # the same open connection: refused once the worker's handler has run
            try:
                Add(1).named("a").at("w1").forward(1, broker=broker)
            except Refused as exc:
                assert "no longer allowed" in str(exc)
                break
            assert time.monotonic() < until, "the revoked key's open connection was still served"
    with client(keyring, worker.endpoint, patience=1.5) as broker:
        with pytest.raises((Refused, Unreachable)):
            Add(1).named("a").at("w1").forward(1, broker=broker)


# -- code by value only where allowed ----------------------------------------------------


class Gadget:
    """A pickle that would create a file when loaded."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_project_mode_worker_never_unpickles_a_provision(processes, tmp_path):
    worker = processes([*WORKER, "--listen", "127.0.0.1:0", "--announce"], env=env_with_tests())
    sentinel = tmp_path / "pwned"
    artifact = pickle.dumps(Gadget(str(sentinel)))
    sock = sockets.dealer(2.0)
    try:
        sock.connect(worker.endpoint)
        sock.send_multipart(encode(Hello(Runtime.here(mode="network"))))
        assert sockets.poll(sock, 5)
        sock.recv_multipart()
        import hashlib

        sock.send_multipart(encode(Provision("sha256:" + hashlib.sha256(artifact).hexdigest(), artifact)))
        assert sockets.poll(sock, 5)
        answer = decode(sock.recv_multipart())
    finally:
        sockets.close(sock)
    assert isinstance(answer, Refusal) and "project mode" in answer.why
    assert not sentinel.exists()


# -- errors never carry the contents of values -----------------------------------------


def test_errors_name_types_never_contents():
    class Secretive:
        def __init__(self):
            self.password = "hunter2-very-secret"

        def __repr__(self):
            return f"Secretive({self.password})"

    with pytest.raises(Unwritable) as info:
        dumps({"config": Secretive()})
    assert "Secretive" in str(info.value) and "hunter2" not in str(info.value)
    from somatize import ProtocolError

    junk = [b"\x81\xa1v\xa8hunter2!"]
    with pytest.raises(ProtocolError) as bad:
        decode(junk)
    assert "hunter2" not in str(bad.value)


# -- torch: nothing in a store is ever unpickled --------------------------------------------

GADGET_SCRIPT = r'''
import pickle, struct, sys
import msgpack
import torch
import somatize.torch  # noqa: F401  (the tensor codec)
from somatize import FolderStore, Node, Unreadable
from somatize.codec import dumps, loads

sentinel, folder = sys.argv[1], sys.argv[2]

class Gadget:
    def __reduce__(self):
        return (open, (sentinel, "w"))

class Make(Node):
    def forward(self, x):
        return torch.zeros(3)

def with_frame(written, frame):
    """A written form whose one value is the registered `torch.Tensor` kind (the tensor path
    that still hands bytes to a loader: values stored before tensors became a frame kind),
    its bytes `frame`."""
    header = msgpack.packb([["C", "torch.Tensor", 0], [len(frame)]], use_bin_type=True)
    head = b"SMZ1" + struct.pack("<I", len(header)) + header
    return head + b"\0" * (-len(head) % 16) + frame

gadget = pickle.dumps(Gadget())
# the control: the same surgery with the tensor's own bytes reads back, so a refusal below
# is the tensor codec refusing the payload, not a mangled written form
from somatize.torch import dump_tensor
assert torch.equal(loads(with_frame(bytes(dumps(torch.zeros(3))), bytes(dump_tensor(torch.ones(3))))), torch.ones(3))
store = FolderStore(folder)
g = Make().named("make").cached().frozen()
g.forward(1, store=store)
(name, _), = store.scan("cache/")
for payload in (gadget, b"PK\x03\x04" + gadget):  # a bare pickle, and one dressed as torch.save's zip
    store.put(name, {"node": "make"}, with_frame(bytes(dumps(torch.zeros(3))), payload))
    try:
        loads(store.fetch(name))
    except Unreadable:
        pass
    else:
        raise SystemExit("a gadget was read back as a value")
    out = g.forward(1, store=store)  # cannot be recalled: computed again, never unpickled
    assert torch.equal(out, torch.zeros(3))
print("ok")
'''


def test_a_gadget_pickle_in_the_store_never_runs_even_with_weights_only_forced_off(tmp_path):
    pytest.importorskip("torch")
    script = tmp_path / "gadget.py"
    script.write_text(GADGET_SCRIPT)
    sentinel = tmp_path / "pwned"
    env = dict(os.environ, TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD="1")
    done = subprocess.run(
        [sys.executable, str(script), str(sentinel), str(tmp_path / "store")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
    assert not sentinel.exists()


# -- a host's name stays the worker key's that offered it first, across broker restarts ----


@pytest.fixture
def ring(tmp_path):
    """A broker's pair; client alice; worker keys victim and evil."""
    return key_ring(tmp_path, clients=("alice",), workers=("victim", "evil"))


def test_a_host_bound_to_one_worker_key_stays_its_own_when_the_broker_restarts(processes, ring, tmp_path):
    """Attacker: an allowed worker (a key in the broker's `--allow-workers`).

    What it achieves: it takes over `node017`, a host another worker key serves, and
    receives the clients' inputs for it (and may answer for it, answers a client caches).
    A name is bound to the key that offered it first only "while the broker runs": the
    bindings live in the broker's memory. The attacker keeps a Hello(offering="node017")
    queued on a socket that dials the broker's address; when the broker restarts (an
    upgrade, a crash, a reboot of the head node) its Hello is the first through, the name is
    its own for the broker's new life, and the real worker is refused.
    """
    from somatize.fabric.curve import Keys, read_public, read_secret

    url = f"tcp://127.0.0.1:{free_port()}"
    kept = ("--bindings", str(tmp_path / "bindings.json"))  # as brokers/somatize-broker.service runs it
    hub = keyed_broker(processes, ring, *kept, listen=url)
    victim = processes(
        [
            *WORKER,
            "--broker",
            url,
            "--offer",
            "node017",
            "--key",
            str(ring["victim_secret"]),
            "--broker-key",
            str(ring["broker"]),
            "--patience",
            "2",
        ],
        announce=None,
        env=env_with_tests(),
    )
    alice_keys = Keys.client(ring["alice_secret"], server=ring["broker"])
    with Broker.at(url, keys=alice_keys, patience=2.0) as alice:
        wait_until(lambda: alice.knows("node017"), 20, "node017 dialing in")
        assert Add(1).named("a").at("node017").forward(1, broker=alice) == 2

    assert hub.stop() == 0
    victim.stop()  # the real worker is slow to come back: the race is the attacker's to win
    public, secret = read_secret(ring["evil_secret"])
    # many sockets, each with the Hello queued: one of them is through first
    evils = [Raw(url, keys=(public, secret, read_public(ring["broker"]))) for _ in range(16)]
    try:
        for evil in evils:
            evil.send(Hello(RT, offering="node017"))  # queued: it leaves the moment the broker is back
        keyed_broker(processes, ring, *kept, listen=url)
        answers = [evil.answer(20) for evil in evils]
        taken = [a for a in answers if isinstance(a, Ready)]
        assert not taken, "another worker key took over `node017` after the broker restarted"
        assert all(isinstance(a, Refusal) and "another worker key" in a.why for a in answers), answers
    finally:
        for evil in evils:
            evil.close()


# -- keys refused, told from a hang-up: the greeting probe ---------------------------------------


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


GREETING_CURVE = b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"CURVE".ljust(20, b"\0") + b"\0" + b"\0" * 31


def _garbage(conn, stop):
    conn.sendall(os.urandom(64))
    stop.wait(3)


def _silent(conn, stop):
    stop.wait(5)  # reads nothing, says nothing, never hangs up


def _trickle(conn, stop):
    # a valid greeting claiming CURVE, one byte every 0.9 s
    for byte in GREETING_CURVE:
        if stop.wait(0.9):
            return
        conn.sendall(bytes([byte]))


def _fake_curve(conn, stop):
    conn.recv(64)
    conn.sendall(GREETING_CURVE)
    stop.wait(3)


def test_the_probe_reads_garbage_as_nobody_quickly():
    with socket_peer(_garbage) as (port, _):
        started = time.monotonic()
        assert within(5, lambda: speaks_curve(f"tcp://127.0.0.1:{port}", PROBE)) is None
        assert time.monotonic() - started < PROBE + 1.0  # bounded: a busy machine may add a little


def test_the_probe_of_a_port_that_never_answers_ends_within_its_timeout():
    with socket_peer(_silent) as (port, _):
        started = time.monotonic()
        assert within(5, lambda: speaks_curve(f"tcp://127.0.0.1:{port}", PROBE)) is None
        assert time.monotonic() - started < PROBE + 1.0  # bounded: a busy machine may add a little


def test_a_peer_trickling_its_greeting_cannot_hold_the_probe_past_its_timeout():
    with socket_peer(_trickle) as (port, _):
        started = time.monotonic()
        within(5, lambda: speaks_curve(f"tcp://127.0.0.1:{port}", PROBE))
        took = time.monotonic() - started
    # held by the trickle, a read given the whole timeout each time ended near 1.8 s
    assert took < PROBE + 0.6, f"the probe took {took:.2f} s for a timeout of {PROBE} s"


def test_the_probe_understands_ipv6_and_hostnames():
    server = curve_router()
    server.ipv6 = True
    try:
        server.bind("tcp://[::1]:*")
        port = server.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]
        assert speaks_curve(f"tcp://[::1]:{port}", 2.0) is True
        plain = zmq.Context.instance().socket(zmq.ROUTER)
        plain.linger = 0
        try:
            port4 = plain.bind_to_random_port("tcp://127.0.0.1")
            assert speaks_curve(f"tcp://localhost:{port4}", 2.0) is False
        finally:
            plain.close(0)
    finally:
        server.close(0)


def test_the_probe_of_an_ipc_path_that_does_not_exist_is_nobody(tmp_path):
    assert within(5, lambda: speaks_curve(f"ipc://{tmp_path}/no/such.sock", PROBE)) is None


def test_the_probe_reads_an_abstract_ipc_curve_server_as_curve():
    server = curve_router()
    name = f"ipc://@somatize-attack-{os.getpid()}-{time.monotonic_ns()}"
    try:
        server.bind(name)
        assert speaks_curve(name, 2.0) is True
    finally:
        server.close(0)


def test_a_client_with_keys_never_probes(tmp_path):
    """``hung_up`` with keys (or with another event) answers at once, opening no connection."""
    from somatize.fabric.curve import Keys

    public, secret = zmq.curve_keypair()
    keys = Keys(public, secret, server_key=public)
    with socket_peer(_fake_curve) as (port, accepted):
        address = f"tcp://127.0.0.1:{port}"
        assert hung_up(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, keys, address, PROBE) is False
        assert hung_up(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, None, address, PROBE) is False
        assert accepted == []
        # keyless and NO_DETAIL: asked, and a greeting that says CURVE is keys refused
        assert hung_up(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, None, address, PROBE) is False
        assert accepted == [1]


def test_a_keyless_client_against_a_curve_server_is_keys_refused_not_dropped():
    """End to end: a real ZeroMQ CURVE server where a keyless broker expects a worker: the call
    ends KeysRefused (the probe reads CURVE), within a bound."""
    server = curve_router()
    port = server.bind_to_random_port("tcp://127.0.0.1")
    try:
        with Broker.embedded({"w1": Worker.at(f"tcp://127.0.0.1:{port}", mode="project")}, patience=2.0) as broker:
            with pytest.raises(KeysRefused):
                within(20, lambda: Add(1).named("a").at("w1").forward(1, broker=broker))
    finally:
        server.close(0)


def test_a_keyless_client_against_an_abstract_ipc_curve_server_is_keys_refused():
    server = curve_router()
    name = f"ipc://@somatize-attack-{os.getpid()}-{time.monotonic_ns()}"
    server.bind(name)
    try:
        with Broker.embedded({"w1": Worker.at(name, mode="project")}, patience=2.0) as broker:
            with pytest.raises(KeysRefused):
                within(20, lambda: Add(1).named("a").at("w1").forward(1, broker=broker))
    finally:
        server.close(0)


def _slow_to_probes(conn, stop):
    """Hangs up on a ZeroMQ peer (it sends 10 bytes of signature, then waits) and keeps a
    probe (11 bytes: the signature and a version) for a long while, a byte at a time."""
    conn.settimeout(0.2)
    got = b""
    try:
        while len(got) < 11:
            part = conn.recv(11 - len(got))
            if not part:
                return
            got += part
    except OSError:
        return  # 10 bytes and silence: ZeroMQ's handshake; hung up on
    for byte in GREETING_CURVE:
        if stop.wait(0.5):
            return
        conn.sendall(bytes([byte]))


def test_a_peer_that_hangs_up_on_handshakes_and_holds_probes_cannot_hold_the_client_past_its_wait():
    """Attack on the probe where a client looks for its broker: a hostile address hangs up on
    every ZeroMQ handshake (ZeroMQ reconnects, a failed handshake each time) and holds each
    probe its whole timeout. Asked once per failure, the probes would fall behind the
    failures and the wait for the broker would never end; it ends Unreachable, within its
    own bound, and probes that address a few times at most."""
    from somatize import Unreachable

    with socket_peer(_slow_to_probes) as (port, accepted):
        client = Broker.at(f"tcp://127.0.0.1:{port}", patience=1.0)
        try:
            started = time.monotonic()
            with pytest.raises(Unreachable):
                within(30, client.hosts)
            assert time.monotonic() - started < 2 * 1.0 + 3 * PROBE + 2.0
        finally:
            client.close()
