"""Cargo bound to the exchange that lent it (issue 38): an allowed worker key reads none of
another user's cargo.

The attack, played for real: a keyed standalone broker; `w1`, an honest worker dialing in
with ``--mount`` on a folder in /dev/shm of this user's; `alice`, a client of this user's;
and `mallory`, an allowed worker key running as `nobody` (``setpriv``), which cannot even
list the folder. Mallory offers a host, `evil`, naming w1's folder and w1's mark (every
client sees both in the listing); when alice greets `evil`, mallory hands alice's Hello on to
w1, as a client of w1, and gives alice w1's answer; whatever segment names alice lends
`evil`, mallory names at w1 in a ``Mounted`` of its own, asking w1 to run a node that
returns its input as bytes. Before this issue alice lent `evil` the pooled segment that had
carried her secret to w1 (``mount.sees`` took a copied token for proof), and w1 mapped it
for mallory (it mapped any segment of its user that a message named): mallory got the
secret back. Now a worker proves in the exchange that it sees the folder, bound to who it is
(``somatize.fabric.proofs``); a request's names are sealed with the key of the session that
lends them; a segment is lent only ever to one worker.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq
from conftest import SETPRIV, WORKER, env_with_tests
from reliability_support import key_ring, wait_until

from brokers import keyed_broker
from somatize import Broker, Keys, Node
from somatize.fabric import leases, mount
from somatize.fabric.client import lending as client_pool
from somatize.fabric.curve import read_public, read_secret
from somatize.packing import Packer
from somatize.wire import WIRE_VERSION, Done, Hello, Mounted, Ready, Recipe, Refusal, Runtime, Work, decode, encode

SHM = Path("/dev/shm")
pytestmark = pytest.mark.skipif(not SHM.is_dir() or not leases.in_memory(SHM), reason="needs /dev/shm on tmpfs")
SECRET = b"alice's secret: the door code is 4711"
RT = Runtime.here(mode="project")


class Echo(Node):
    def forward(self, x):
        return x


class Reveal(Node):
    """What mallory asks w1 to run: its input, as bytes (written in the answer's header)."""

    def forward(self, x):
        return bytes(np.asarray(x, dtype=np.uint8))


@pytest.fixture
def folder(tmp_path):
    made = SHM / f"somatize-cargo-{os.getpid()}-{tmp_path.name}"
    yield made
    shutil.rmtree(made, ignore_errors=True)


@pytest.fixture(scope="module")
def nobody_site(python_for_nobody):
    """A folder `nobody` may read holding copies of pyzmq and msgpack (ours sit in a folder
    closed to it), for a script that speaks CURVE as `nobody`."""
    site = Path(tempfile.mkdtemp(prefix="somatize-nobody-site-"))
    for module in (zmq, msgpack):
        package = Path(module.__file__).parent
        shutil.copytree(package, site / package.name)
        libs = package.parent / f"py{package.name}.libs"
        if libs.is_dir():  # pyzmq's libzmq, found from zmq's extension by a relative path
            shutil.copytree(libs, site / libs.name)
    for path in (site, *site.rglob("*")):
        path.chmod(0o755 if path.is_dir() else 0o644)
    yield python_for_nobody, site
    shutil.rmtree(site, ignore_errors=True)


# -- mallory ---------------------------------------------------------------------------------

MALLORY = r'''
import json, sys, time
spec = json.loads(sys.stdin.readline())
sys.path.insert(0, spec["site"])
import msgpack, zmq

V = spec["wire"]
until = time.monotonic() + spec["seconds"]
said = {"learned": [], "relayed_hello": False, "cargo_on_socket": False, "answers": [], "user": __import__("os").geteuid()}

def socket():
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.linger = 0
    s.curve_publickey, s.curve_secretkey = spec["public"].encode(), spec["secret"].encode()
    s.curve_serverkey = spec["broker"].encode()
    s.connect(spec["endpoint"])
    return s

def header(frames):
    return msgpack.unpackb(frames[0], raw=False)

def relay(**fields):
    return msgpack.packb({"v": V, "t": "Relay", "host": "", "exchange": 0, "tenant": "", "lane": 0, **fields})

def receive(s, seconds=10.0):
    if not s.poll(int(1000 * max(0.0, min(seconds, until - time.monotonic())))):
        return None
    return s.recv_multipart()

def ask_w1(s, lane, inner):
    """As a client of w1: one message on `lane`, and w1's answer's frames."""
    s.send_multipart([relay(host="w1", lane=lane), *inner])
    while time.monotonic() < until:
        got = receive(s)
        if got is None:
            return None
        if header(got).get("t") == "Relay" and header(got).get("lane") == lane:
            return got[1:]
    return None

worker, client = socket(), socket()
worker.send_multipart([bytes.fromhex(f) for f in spec["offer"]])
assert header(receive(worker)).get("t") == "Ready", "the broker did not take the offer"
print("offered", flush=True)

lane = 1
done = False
while not done and time.monotonic() < until:
    got = receive(worker, 1.0)
    if got is None:
        continue
    h = header(got)
    if h.get("t") != "Relay":
        continue  # the broker's checks of a dialed worker: nothing to answer for this play
    exchange, inner = h["exchange"], got[1:]
    kind = header(inner).get("t")
    if kind == "Hello":
        # the relay: alice's Hello, proof and all, goes on to w1; w1's answer back to alice
        lane += 1
        answer = ask_w1(client, lane, inner)
        said["relayed_hello"] = answer is not None
        worker.send_multipart([relay(exchange=exchange), *(answer or [bytes.fromhex(spec["refusal"])])])
        continue
    ref = None
    if kind == "Mounted":
        m = header(inner)
        said["learned"] = list(m.get("files", [])) + list(m.get("spare", []))
        ref = header(inner[1:]).get("ref")
    else:  # the Work came on the socket: no segment's name in it
        said["cargo_on_socket"] = True
        ref = header(inner).get("ref") if kind == "Work" else None
    # a well-behaved answer, so that alice's segments go back to her pool to be used again
    answer = dict(header([bytes.fromhex(spec["done"])]), ref=ref) if ref is not None else None
    worker.send_multipart([relay(exchange=exchange),
                           msgpack.packb(answer) if answer is not None else bytes.fromhex(spec["refusal"])])
    done = True

print("served", flush=True)
sys.stdin.readline()  # alice has since sent her secret to w1

# every name learned, at w1, from a session of mallory's own: a fresh one, and the one that
# took alice's relayed Hello (w1 read alice's proof's file in it)
template = header([bytes.fromhex(spec["mounted"])])
for name in said["learned"]:
    for session in ("fresh", "relayed"):
        if session == "fresh":
            lane += 1
            use = lane
            if ask_w1(client, use, [bytes.fromhex(spec["hello"])]) is None:
                continue
        else:
            use = 2
        mounted = dict(template, files=[name])
        answer = ask_w1(client, use, [msgpack.packb(mounted), bytes.fromhex(spec["work"])])
        said["answers"].append([f.hex() for f in answer or []])
print(json.dumps(said), flush=True)
'''


def _mallory_spec(ring, hub, folder: Path, token: str) -> dict:
    public, secret = read_secret(ring["mallory_secret"])  # as mallory's own process would read its key
    spec = Packer("project").spec(Reveal().named("reveal").steps[0])
    work = encode(Work(1, Recipe((spec,), ("step", 0)), np.zeros(len(SECRET), np.uint8), watched=False))
    template = encode(Mounted((f"1-{'0' * 32}-0",), header=bytes(work[0]), spans=((0, 0, len(SECRET)),)))
    return {
        "endpoint": hub.endpoint,
        "public": public.decode(),
        "secret": secret.decode(),
        "broker": read_public(ring["broker"]).decode(),
        "wire": WIRE_VERSION,
        "seconds": 40,
        "offer": [bytes(f).hex() for f in encode(Hello(RT, offering="evil", mount=str(folder), seen=token))],
        "hello": bytes(encode(Hello(RT))[0]).hex(),
        "refusal": bytes(encode(Refusal("no"))[0]).hex(),
        "done": bytes(encode(Done(1, 0, {}, 1))[0]).hex(),
        "mounted": bytes(template[0]).hex(),
        "work": bytes(work[0]).hex(),
    }


def said_by_mallory(mallory: subprocess.Popen, word: str) -> None:
    """Wait for mallory's next line (its every receive is bounded: it ends within its seconds)."""
    line = mallory.stdout.readline()
    if not line.startswith(word):
        mallory.kill()
        mallory.wait(30)
        pytest.fail(f"mallory said {line!r}, not {word!r}: {mallory.stderr.read()}")


def test_an_allowed_worker_key_running_as_nobody_gets_none_of_another_users_cargo(
    processes, folder, tmp_path, nobody_site
):
    python, site = nobody_site
    ring = key_ring(tmp_path, clients=("alice",), workers=("w1", "mallory"))
    hub = keyed_broker(processes, ring)
    processes(
        [
            *WORKER,
            "--broker",
            hub.endpoint,
            "--offer",
            "w1",
            "--mode",
            "project",
            "--mount",
            str(folder),
            "--key",
            str(ring["w1_secret"]),
            "--broker-key",
            str(ring["broker"]),
        ],
        env=env_with_tests(),
        announce=None,
    )
    alice = Broker.at(hub.endpoint, keys=Keys.client(ring["alice_secret"], server=ring["broker"]))
    pool = client_pool.pool(folder)
    mallory = None
    try:
        wait_until(lambda: alice.knows("w1"), 30, "w1 dialing in")
        token = alice._rendezvous.dialed["w1"][1][1]  # w1's mark, as every client sees it in the listing
        secret = np.frombuffer(SECRET, np.uint8)
        echo = Echo().named("echo").at("w1")

        mallory = subprocess.Popen(
            [*SETPRIV, python, "-c", MALLORY],
            cwd="/",
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        mallory.stdin.write(json.dumps({**_mallory_spec(ring, hub, folder, token), "site": str(site)}) + "\n")
        mallory.stdin.flush()
        said_by_mallory(mallory, "offered")
        wait_until(lambda: alice.knows("evil"), 30, "mallory's host being listed")

        # alice sends mallory's host some cargo (mallory answers it well: her segments go back to her pool)...
        Echo().named("echo").at("evil").forward(np.ones(1 << 16), broker=alice)
        said_by_mallory(mallory, "served")
        # ...then her secret to w1, which the pool would put in the very segment mallory was lent
        np.testing.assert_array_equal(echo.forward(secret, broker=alice), secret)
        mallory.stdin.write("go\n")
        mallory.stdin.close()
        mallory.stdin = None  # said all it had to: `communicate` below only reads
        out, err = mallory.communicate(timeout=60)
        assert mallory.returncode == 0, err
        said = json.loads(out.splitlines()[-1])
        assert said["user"] == 65534 and said["relayed_hello"], said  # nobody, and it did hand alice's Hello on

        answers = b"".join(bytes.fromhex(f) for answer in said["answers"] for f in answer)
        assert SECRET not in answers, "mallory read alice's secret back from w1"
        assert said["learned"] == [], f"alice lent mallory's host segments of her folder: {said['learned']}"
        assert said["cargo_on_socket"], said  # the folder was not proved: the cargo went through the broker

        # the honest forward works, through the folder, and again after the attack
        assert pool.known and all(s.worker.startswith("offer w1@") for s in pool.known.values()), pool.known
        again = np.frombuffer(SECRET[::-1], np.uint8)
        np.testing.assert_array_equal(echo.forward(again, broker=alice), again)
    finally:
        if mallory is not None:
            if mallory.poll() is None:
                mallory.kill()
            mallory.wait(10)
            for stream in (mallory.stdout, mallory.stderr):
                stream.close()
        alice.close()
        pool.drain()


# -- a segment's name opens nothing in another session -----------------------------------------


class Raw:
    """A client speaking the wire by hand on one DEALER."""

    def __init__(self, endpoint: str, *, keys: tuple[bytes, bytes, bytes] | None = None) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.linger = 0
        if keys is not None:
            self.sock.curve_publickey, self.sock.curve_secretkey, self.sock.curve_serverkey = keys
        self.sock.connect(endpoint)

    def ask(self, frames, timeout: float = 20.0):
        self.sock.send_multipart([bytes(f) for f in frames])
        assert self.sock.poll(int(timeout * 1000)), "no answer"
        return decode(self.sock.recv_multipart())

    def close(self) -> None:
        self.sock.close(0)


def _work(x) -> list:
    spec = Packer("project").spec(Reveal().named("reveal").steps[0])
    return encode(Work(1, Recipe((spec,), ("step", 0)), x, watched=False))


def test_a_worker_maps_no_segment_that_was_not_lent_to_the_session_naming_it(processes, folder):
    """Attack: the names of segments alice lent a worker (how they leaked does not matter:
    here they are simply known), and even her sealed message itself, sent by another session
    of the same worker: one that proved no folder, and one that proved it under a key of its
    own. Each is refused before anything is mapped; alice's own session is served."""
    from cargo_support import proved, sealed

    w = processes([*WORKER, "--listen", "127.0.0.1:0", "--announce", "--mount", str(folder)], env=env_with_tests())
    pool = client_pool.pool(folder)
    alice, stranger, other = Raw(w.endpoint), Raw(w.endpoint), Raw(w.endpoint)
    try:
        key = proved(alice.ask, folder)
        lending = client_pool.Lending(pool)
        sent = lending.send(_work(np.frombuffer(SECRET, np.uint8)), key)
        answer = alice.ask(sent)
        assert isinstance(answer, Ready | Done | Mounted), answer
        done = decode(lending.receive(answer)) if isinstance(answer, Mounted) else answer
        assert isinstance(done, Done) and done.output == SECRET
        lending.end(answered=True)
        lent = decode(sent)

        assert isinstance(stranger.ask(encode(Hello(RT))), Ready)
        for attempt in (sent, encode(Mounted(lent.files, header=lent.header, spans=lent.spans))):
            refused = stranger.ask(attempt)
            assert isinstance(refused, Refusal) and "proved no folder" in refused.why, refused
        theirs = proved(other.ask, folder)  # the same user's second session: a key of its own
        for attempt in (
            sent,
            encode(sealed(Mounted(lent.files, header=lent.header, spans=lent.spans), os.urandom(32))),
        ):
            refused = other.ask(attempt)
            assert isinstance(refused, Refusal) and "did not lend" in refused.why, refused
        assert isinstance(other.ask(encode(sealed(lent, theirs))), Mounted | Done)  # its own seal: served

        # alice again, on her session: served
        lending = client_pool.Lending(pool)
        answer = alice.ask(lending.send(_work(np.frombuffer(SECRET, np.uint8)), key))
        done = decode(lending.receive(answer)) if isinstance(answer, Mounted) else answer
        assert isinstance(done, Done) and done.output == SECRET
        lending.end(answered=True)
        assert w.alive
    finally:
        for raw in (alice, stranger, other):
            raw.close()
        pool.drain()


# -- a segment lent to one worker is never lent to another ----------------------------------------


def test_a_segment_lent_to_one_worker_is_never_lent_to_another(folder):
    pool = client_pool.pool(folder)
    try:
        first = client_pool.Lending(pool, "offer w1@tcp://b")
        to_w1 = decode(first.send(_work(np.frombuffer(SECRET, np.uint8))))
        first.end(answered=True)
        assert set(to_w1.files) <= set(pool.free), "the segment did not come back to the pool"

        seen_by: dict[str, set[str]] = {}
        for worker, n in (("offer evil@tcp://b", 1 << 18), ("offer evil@tcp://b", 100), ("listen @ipc://x", 100)):
            lending = client_pool.Lending(pool, worker)
            sent = decode(lending.send(_work(np.ones(n))))
            names = {*sent.files, *sent.spare}
            assert not names & set(to_w1.files), f"{worker} was lent a segment w1 had: {names}"
            for name in names:
                assert SECRET not in bytes(pool.known[name].view), f"{worker} was lent alice's secret bytes"
                seen_by.setdefault(name, set()).add(worker)
            lending.end(answered=True)
        assert all(len(workers) == 1 for workers in seen_by.values()), seen_by

        again = client_pool.Lending(pool, "offer w1@tcp://b")  # w1's own segment comes back to w1
        assert decode(again.send(_work(np.ones(8)))).files == to_w1.files
        again.end(answered=True)
        assert len(pool.free) <= client_pool.IDLE_COUNT
    finally:
        pool.drain()
    assert not [n for n in os.listdir(folder) if not n.startswith("seen-")]


# -- the proof itself ----------------------------------------------------------------------------


def test_a_proof_is_bound_to_who_gives_it_and_reads_nothing_but_a_proofs_file(folder, tmp_path):
    from somatize.fabric import proofs

    mount.private(folder)
    made = proofs.challenge(str(folder), named_by_peer=True)
    assert made is not None and (folder / made.name).stat().st_mode & 0o777 == 0o600
    nonce = proofs.answer(str(folder), made.name)
    assert nonce == made.nonce
    assert made.proves(proofs.proof_of(nonce, "offer w1"), "offer w1")
    assert not made.proves(proofs.proof_of(nonce, "offer w1"), "offer evil")  # a relayed proof is w1's, not evil's
    assert not made.proves("", "offer w1") and not made.proves("0" * 32, "offer w1")
    assert proofs.seal_key(nonce) != bytes.fromhex(proofs.proof_of(nonce, "")) * 2  # the proof is not the key

    # a proof reads only a proof's file: never a segment (no oracle over cargo), a link, a second name,
    # another user's, a file of another size
    seg = client_pool.pool(folder).lease(100)
    try:
        assert proofs.answer(str(folder), seg.name) is None
        me = f"{os.getpid()}-{mount._tag()}"
        (folder / f"prove-{me}{'1' * 24}").symlink_to(folder / made.name)
        os.link(folder / made.name, folder / f"prove-{me}{'2' * 24}")
        (folder / f"prove-{me}{'3' * 24}").write_bytes(b"x" * 31)
        for name in (
            f"prove-{me}{'1' * 24}",
            f"prove-{me}{'2' * 24}",
            made.name,
            f"prove-{me}{'3' * 24}",
            f"prove-{me}{'4' * 24}",
            "../" + made.name,
        ):
            assert proofs.answer(str(folder), name) is None, name
        if os.geteuid() == 0:
            theirs = folder / f"prove-{me}{'5' * 24}"
            theirs.write_bytes(bytes(32))
            os.chown(theirs, 65534, 65534)
            assert proofs.answer(str(folder), theirs.name) is None
    finally:
        seg.lent = False
        client_pool.pool(folder).settle(seg)
        client_pool.pool(folder).drain()
        made.remove()
    # a folder a peer named that is not safe gets no proof's file
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o777)
    loose.chmod(0o777)
    assert proofs.challenge(str(loose), named_by_peer=True) is None and os.listdir(loose) == []
    assert proofs.challenge(str(tmp_path / "absent"), named_by_peer=True) is None


def test_the_wire_says_what_a_proof_and_a_seal_must_be():
    prove = f"prove-{os.getpid()}-{'a' * 32}"
    assert decode(encode(Hello(RT, prove=prove))).prove == prove
    assert decode(encode(Ready(RT, proof="b" * 32))).proof == "b" * 32
    sealed_one = Mounted((f"1-{'a' * 32}-0",), header=b"h", seal="c" * 32)
    assert decode(encode(sealed_one)).seal == "c" * 32
    for bad, says in (
        (Hello(RT, prove="seen-1-" + "a" * 32), "not a proof's file"),
        (Hello(RT, prove=f"1-{'a' * 32}-0"), "not a proof's file"),
        (Hello(RT, offering="w1", prove=prove), "proves nothing"),
        (Ready(RT, proof="x" * 32), "not 32 hex"),
        (Mounted((f"1-{'a' * 32}-0",), header=b"h", seal="c" * 31), "not 32 hex"),
    ):
        with pytest.raises(ValueError, match=says):
            encode(bad)


def test_a_relay_of_the_proof_to_another_worker_proves_nothing_to_the_client(processes, folder):
    """The relay, without a broker: a client asks worker B (listening with a key of its own
    in the client's eyes) to prove the folder; the proof's file is handed to worker A, which
    does see the folder and answers; A's proof is bound to A, and the client believes nothing."""
    from somatize.fabric import proofs

    a = processes([*WORKER, "--listen", "127.0.0.1:0", "--announce", "--mount", str(folder)], env=env_with_tests())
    raw = Raw(a.endpoint)
    try:
        made = proofs.challenge(str(folder), named_by_peer=False)
        answer = raw.ask(encode(Hello(RT, prove=made.name)))
        made.remove()
        assert isinstance(answer, Ready) and answer.proof
        assert made.proves(answer.proof, proofs.identity(None, None))  # A proves it is A
        for claimed in (proofs.identity("w1", None), proofs.identity(None, b"B" * 40)):
            assert not made.proves(answer.proof, claimed)  # and nobody else
        # a Hello naming a file the worker cannot read there gets no proof, and is served
        assert decode(encode(Ready(RT))).proof == ""
        answer = raw.ask(encode(Hello(RT, prove=f"prove-{os.getpid()}-{'9' * 32}")))
        assert isinstance(answer, Ready) and answer.proof == ""
    finally:
        raw.close()


def test_a_listening_worker_with_keys_proves_it_is_the_holder_of_its_key(processes, folder, tmp_path):
    """The proof of a worker that listens with CURVE keys is bound to its public key: what a
    client of a broker's spawned child (``Located.key``) expects of it."""
    from somatize.fabric import proofs

    ring = key_ring(tmp_path, clients=("alice",), workers=(), others=("worker",))
    w = processes(
        [
            *WORKER,
            "--listen",
            "127.0.0.1:0",
            "--announce",
            "--mount",
            str(folder),
            "--key",
            str(ring["worker_secret"]),
            "--allow",
            str(ring["allow"]),
        ],
        env=env_with_tests(),
    )
    public, secret = read_secret(ring["alice_secret"])
    raw = Raw(w.endpoint, keys=(public, secret, read_public(ring["worker"])))
    try:
        made = proofs.challenge(str(folder), named_by_peer=False)
        answer = raw.ask(encode(Hello(RT, prove=made.name)))
        made.remove()
        assert isinstance(answer, Ready)
        assert made.proves(answer.proof, proofs.identity(None, read_public(ring["worker"])))
        assert not made.proves(answer.proof, proofs.identity(None, None))
    finally:
        raw.close()


def test_many_threads_proving_at_once_each_get_their_own_session(folder):
    """Channels made at once (a map's) each prove on their own, and no proof's file is left."""
    from somatize import Worker

    spawned = Worker.spawn(WORKER, mode="network", send=[sys.modules[__name__]], mount=str(folder))
    with Broker.embedded({"w1": spawned}) as broker:
        wrong: list = []

        def calls(n: int) -> None:
            x = np.full(100_000, n, dtype=np.uint8)
            try:
                for _ in range(3):
                    if Echo().named("echo").at("w1").forward(x, broker=broker).tobytes() != x.tobytes():
                        wrong.append(n)
            except Exception as exc:  # noqa: BLE001 - said below, with the thread's number
                wrong.append((n, repr(exc)))

        threads = [threading.Thread(target=calls, args=(n,)) for n in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not wrong
        assert client_pool.pool(folder).made >= 1, "the cargo did not go through the folder"
    assert not [n for n in os.listdir(folder) if n.startswith("prove-")] if folder.exists() else True


def test_the_worker_s_conversation_takes_cargo_only_under_its_session_s_seal():
    """Sans IO: which ``Mounted`` a worker's sessions let through, and when a key is dropped."""
    from cargo_support import sealed

    from somatize.fabric import proofs
    from somatize.fabric.conversation import Unknown, Violation, WorkerSessions

    sessions = WorkerSessions(RT)
    lent = Mounted((f"1-{'a' * 32}-0",), header=b"h", spans=((0, 0, 1),), spare=(f"1-{'b' * 32}-0",))
    key = proofs.seal_key(os.urandom(32))
    with pytest.raises(Unknown):
        sessions.carries(b"alice", sealed(lent, key))
    sessions.receive(b"alice", Hello(RT), now=0.0)
    with pytest.raises(Violation, match="proved no folder"):
        sessions.carries(b"alice", sealed(lent, key))
    sessions.proven(b"alice", key)
    sessions.carries(b"alice", sealed(lent, key))  # its own seal: let through
    # no seal, another key's, and its own seal with a spare taken out (the seal covers every name)
    for wrong in (
        lent,
        sealed(lent, proofs.seal_key(os.urandom(32))),
        dataclasses.replace(sealed(lent, key), spare=()),
    ):
        with pytest.raises(Violation, match="did not lend"):
            sessions.carries(b"alice", wrong)
    sessions.receive(b"mallory", Hello(RT), now=0.0)
    with pytest.raises(Violation):
        sessions.carries(b"mallory", sealed(lent, key))  # another peer, alice's very seal: refused
    sessions.receive(b"alice", Hello(RT), now=0.0)  # a Hello renews the session: its key goes
    with pytest.raises(Violation, match="proved no folder"):
        sessions.carries(b"alice", sealed(lent, key))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-n", "0"]))
