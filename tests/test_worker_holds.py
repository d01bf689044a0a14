"""Issue 19, the worker's and the client's side: the shared pieces hold.

Each attack below succeeded against the worker and the client before this issue: a real
``python -m somatize.worker``, and clients as real sockets (a raw DEALER, a fake broker or a
fake worker on a real ROUTER) or the real client (``Broker.embedded`` / ``Broker.at``). Each
docstring says who attacks and what it achieved. Waits poll a fact with a deadline; every
receive has a timeout; sockets linger 0; every process is reaped by the ``processes``
fixture. The pure parts (the conversation) are checked with no process at the end.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import tempfile
import threading
import time

import pytest
import zmq
from conftest import BROKER, WORKER, env_with_tests
from fabric_nodes import Add
from holds_nodes import Big, Hold, Mark
from peers import FakeWorker, Raw
from reliability_support import wait_until

from somatize import Broker, Refused, Worker
from somatize.fabric import streams
from somatize.fabric.conversation import ClientExchange, Violation, WorkerSessions
from somatize.fabric.curve import Keys, make_pair
from somatize.packing import Packer
from somatize.wire import (
    Begin,
    Chunk,
    Credit,
    Done,
    Hello,
    Located,
    NodeSpec,
    Ready,
    Recipe,
    Refusal,
    Relay,
    Runtime,
    Saw,
    Where,
    Work,
    decode,
    encode,
    variant_of,
)

pytestmark = pytest.mark.slow  # `-m "not slow"` leaves this file out

RT = Runtime.here(mode="project")


def spec_of(node) -> NodeSpec:
    return Packer("project").spec(node.steps[0])


def socket_of(kind: int, **options) -> zmq.Socket:
    sock = zmq.Context.instance().socket(kind)
    sock.linger = 0
    for name, value in options.items():
        sock.setsockopt(getattr(zmq, name), value)
    return sock


@contextlib.contextmanager
def broker_played(processes, patience: str, **options):  # noqa: ANN001, ANN201
    """A real dialed worker (``--patience``), and a ROUTER (with ``options``) playing its
    broker, which took its offer: yields the ROUTER and the worker's route."""
    folder = tempfile.mkdtemp(prefix="somatize-holds-")
    url = f"ipc://{folder}/broker.sock"
    hub = socket_of(zmq.ROUTER, **options)
    hub.bind(url)
    try:
        processes(
            [*WORKER, "--broker", url, "--offer", "w1", "--patience", patience], announce=None, env=env_with_tests()
        )
        assert hub.poll(30_000), "the worker never dialed in"
        route, *frames = hub.recv_multipart()
        assert isinstance(decode(frames), Hello)
        hub.send_multipart([route, *encode(Ready(RT))])  # taken
        yield hub, route
    finally:
        hub.close(0)
        shutil.rmtree(folder, ignore_errors=True)  # the socket file ZeroMQ may leave


def relay(message) -> Relay:
    return Relay(host="w1", inner=tuple(encode(message)))


# -- 2: liveness apart from bulk ------------------------------------------------------------


def test_a_dialed_workers_keepalive_goes_out_on_time_while_a_flood_fills_its_queue(processes):
    """Attacker: clients of a broker flood a dialed worker's name with small relayed Hellos,
    faster than the broker (busy with them) reads the worker's answers.

    What it achieved: the worker's queue to the broker is always full of `Ready`s, so its
    keepalive `Hello`, sent on the same socket, was dropped (EAGAIN) nearly every time: one
    keepalive in 8 s with a patience of 1 s, and the broker declared the honest worker gone
    ("silent for 3 patiences"). Here the broker is played by a ROUTER that reads 400
    messages a second; the keepalives must keep arriving about every patience."""
    with broker_played(processes, "1", RCVHWM=100, SNDHWM=100_000) as (hub, route):
        flood = [[route, *encode(Relay(exchange=n, tenant="t", inner=tuple(encode(Hello(RT)))))] for n in range(1, 200)]
        started = time.monotonic()
        keepalives = [started]
        answered = sent = 0
        while time.monotonic() - started < 8.0:
            for _ in range(1000):
                try:
                    hub.send_multipart(flood[sent % len(flood)], zmq.NOBLOCK)
                except zmq.Again:
                    break
                sent += 1
            turn = time.monotonic()
            for _ in range(40):  # the busy broker: 40 messages per 100 ms
                if not hub.poll(5):
                    break
                _, *frames = hub.recv_multipart()
                if variant_of(frames) is Hello:
                    keepalives.append(time.monotonic())
                else:
                    answered += 1
            time.sleep(max(0.0, 0.1 - (time.monotonic() - turn)))
        ended = time.monotonic()
    gaps = [b - a for a, b in zip(keepalives, [*keepalives[1:], ended], strict=False)]
    assert answered > 1000, f"the flood was not answered ({answered} answers): nothing was tested"
    assert len(keepalives) - 1 >= 4, f"{len(keepalives) - 1} keepalives in 8 s with a patience of 1 s"
    assert max(gaps) < 4.5, f"the broker heard no keepalive for {max(gaps):.1f} s (gaps {[round(g, 1) for g in gaps]})"


def test_an_idle_dialed_worker_keeps_quiet_and_answers_the_brokers_check_at_once(processes):
    """A thousand idle dialed workers each said Hello every patience, and each Hello woke
    the broker's loop: a fleet that did nothing kept its broker busy. Now an idle worker's
    connection pings say it is there (in ZeroMQ's I/O thread, not the broker's loop), its
    keepalive is the net beneath (every KEEPALIVE patiences), and when the broker checks a
    host clients wait on (a Hello) it answers Ready at once."""
    with broker_played(processes, "0.5") as (hub, route):
        while hub.poll(500):  # its greeting may be said twice: as it dials, and once connected
            hub.recv_multipart()
        heard: list = []
        quiet_until = time.monotonic() + 3.0  # six patiences
        while time.monotonic() < quiet_until:
            if hub.poll(100):
                heard.append(variant_of(hub.recv_multipart()[1:]).__name__)
        assert heard == [], f"an idle worker said {heard} in six patiences"
        asked = time.monotonic()
        hub.send_multipart([route, *encode(Hello(RT))])  # the broker checking on a host clients wait on
        assert hub.poll(5_000), "the check was never answered"
        assert variant_of(hub.recv_multipart()[1:]) is Ready
        assert time.monotonic() - asked < 2.0


# -- 3: refusals that say what they end ----------------------------------------------------


def test_an_answer_streaming_back_keeps_its_session_while_another_tenant_crowds_the_worker(processes):
    """Attacker: another client of a (keyless, loopback) broker, with 140 connections.

    What it achieved: while the victim's 20 MiB answer streamed back through the broker,
    140 Hellos of the most kinds allowed (~125 KB each, counted) filled the worker's 16 MiB
    of sessions, and the victim's session (its work done, its answer not yet all credited)
    was forgotten to make room. The victim's next `Credit` was answered `Refusal(hello=True)`
    naming no work, and the rest of its answer never came: the piece ran, its result was
    lost (and the client took that refusal for its answer, greeted again and ran the piece
    again)."""
    hub = processes([*BROKER, "--listen", "tcp://127.0.0.1:0", "--announce"], env=env_with_tests())
    processes(
        [*WORKER, "--broker", hub.endpoint, "--offer", "w1", "--patience", "2"], announce=None, env=env_with_tests()
    )
    size = 20 << 20
    victim = Raw(hub.endpoint)
    crowd: list[Raw] = []
    try:
        wait_until(lambda: isinstance(victim.ask(relay(Hello(RT)), 2.0), Ready), 30, "w1 dialing in")
        victim.send(relay(Work(1, Recipe((spec_of(Big(size).named("big")),), ("step", 0)), 0, watched=False)))
        begin = victim.answer(30)
        assert isinstance(begin, Begin), begin
        inbound = streams.Inbound(per_tenant=1, total=1)
        inbound.begin(b"", "", begin)
        got = 0
        while got + streams.CHUNK <= streams.WINDOW:  # the first window, uncredited: the rest waits
            chunk = victim.answer(30)
            assert isinstance(chunk, Chunk), chunk
            got += inbound.chunk(b"", chunk)[0]

        fat = Runtime(
            RT.wire,
            RT.python,
            RT.somatize,
            RT.cloudpickle,
            tuple(f"k{i:03d}" + "x" * 61 for i in range(1000)),
            "project",
        )
        for _ in range(140):
            raw = Raw(hub.endpoint)
            crowd.append(raw)
            raw.send(relay(Hello(fat)))
        assert all(isinstance(raw.answer(30), Ready) for raw in crowd)

        victim.send(relay(Credit(begin.sid, got)))
        frames = None
        while frames is None:
            message = victim.answer(30)
            assert isinstance(message, Chunk), f"the rest of the answer did not come: {message!r}"
            granted, frames = inbound.chunk(b"", message)
            victim.send(relay(Credit(begin.sid, granted)))
        done = decode(frames)
        assert isinstance(done, Done) and done.ref == 1 and done.output.nbytes == size
    finally:
        for raw in (victim, *crowd):
            raw.close()


@pytest.mark.parametrize("named", [False, True], ids=["naming-no-work", "naming-the-work"])
def test_a_work_is_sent_again_at_most_once_and_never_on_a_refusal_that_names_no_work(named):
    """Attacker: a worker (any host a client sends work to) answering every Work with
    `Refusal(hello=True)`.

    What it achieved: the client took a refusal naming no work for the answer to the work
    it had sent, greeted the worker again and sent the work again, up to 4 times for one
    forward (the docs say once): a piece the worker had run (its session forgotten while
    the answer was on its way) ran again. Now a refusal naming no work, once the work was
    sent, ends the forward with `Refused` and nothing is sent again; one naming the work is
    followed once."""
    fake = FakeWorker(lambda work: Refusal("say Hello first", ref=work.ref if named else None, hello=True))
    try:
        with Broker.embedded({"w1": Worker.at(fake.endpoint, mode="project")}, patience=2.0) as broker:
            with pytest.raises(Refused) as info:
                Add(1).named("a").at("w1").forward(1, broker=broker)
    finally:
        fake.close()
    assert len(fake.works) == (2 if named else 1), f"the work was sent {len(fake.works)} times"
    if not named:
        assert "not sent again" in str(info.value)


# -- 4: revocation ends what is open ------------------------------------------------------


@pytest.fixture
def keyring(tmp_path):
    """A worker's pair; clients alice (revoked in the test) and bob, both allowed."""
    folder, allow = tmp_path / "keys", tmp_path / "allow"
    allow.mkdir()
    ring = {"allow": allow}
    for name in ("w1", "alice", "bob"):
        ring[name], ring[name + "_secret"] = make_pair(folder, name)
    for name in ("alice", "bob"):
        (allow / f"{name}.key").write_bytes(ring[name].read_bytes())
    return ring


def test_revoking_a_key_ends_its_running_work_and_delivers_nothing_more_of_it(processes, keyring, tmp_path):
    """Attacker: a client whose key is taken out of a listening worker's allow folder, then
    the worker reloaded (SIGHUP), while its work runs.

    What it achieved: nothing of what it had open ended: its piece ran on to the end, went
    on to its next node, streamed its `Saw` facts and delivered its `Done` seconds after the
    reload. Now the reload ends it: the client hears `Refused` (no longer allowed) at once,
    the piece runs no further node, and no fact of it arrives after the reload."""
    worker = processes(
        [
            *WORKER,
            "--listen",
            "127.0.0.1:0",
            "--announce",
            "--key",
            str(keyring["w1_secret"]),
            "--allow",
            str(keyring["allow"]),
            "--log-level",
            "info",
        ],
        env=env_with_tests(),
    )
    started, release, finished, marked = (tmp_path / n for n in ("started", "release", "finished", "marked"))
    graph = Hold(str(started), str(release), str(finished)).named("hold").at("w1") >> Mark(str(marked)).named(
        "mark"
    ).at("w1")

    def keyed(who: str) -> Broker:
        keys = Keys.client(keyring[who + "_secret"], server=keyring["w1"])
        return Broker.embedded({"w1": Worker.at(worker.endpoint, mode="project", keys=keys)}, patience=2.0)

    facts: list[tuple[float, dict]] = []
    outcome: list = []
    alice = keyed("alice")
    try:

        def forward() -> None:
            try:
                outcome.append(graph.forward(1, broker=alice, watching=[lambda f: facts.append((time.monotonic(), f))]))
            except Exception as exc:  # noqa: BLE001 - what it raised is the subject
                outcome.append(exc)

        running = threading.Thread(target=forward, daemon=True)
        running.start()
        wait_until(started.exists, 30, "the piece starting")
        (keyring["allow"] / "alice.key").unlink()
        worker.signal(signal.SIGHUP)
        wait_until(lambda: "reloaded the allow-list" in worker.stderr(), 15, "the worker reloading")
        reloaded = time.monotonic()
        running.join(15)
        assert not running.is_alive(), "the revoked key's work went on: its client still waits for it"
        assert isinstance(outcome[0], Refused) and "no longer allowed" in str(outcome[0]), outcome
        release.write_text("go")
        wait_until(finished.exists, 30, "the held node returning")
        with keyed("bob") as bob:  # the worker is free again once the abandoned piece is over

            def bob_ran() -> bool:
                try:
                    return Add(1).named("a").at("w1").forward(1, broker=bob) == 2
                except Exception:  # noqa: BLE001 - Busy until the abandoned piece ends
                    return False

            wait_until(bob_ran, 30, "another client's work running")
        assert not marked.exists(), "the revoked key's piece went on to its next node"
        late = [f for at, f in facts if at > reloaded and f.get("host") == "w1"]  # the worker's own
        assert not late, f"facts of the revoked key's work arrived after the reload: {late}"
    finally:
        release.write_text("go")
        alice.close()


# -- 8: logs no peer can flood or forge -----------------------------------------------------


def test_a_label_that_reads_like_a_stale_import_neither_forges_advice_nor_floods_the_log(processes):
    """Attacker: any client of a worker (here a keyless loopback one).

    What it achieved: a node labelled like pickle's "Can't get attribute 'Add' on <module
    'fabric_nodes'" made the worker answer, and log, "This worker imported `fabric_nodes`
    before ... holds an older import ... Restart the worker" for every Work, though no file
    had changed: an operator restarts workers on a client's word, and one log line per
    message is a log anyone can flood. Advice now comes from the worker's record of the
    files it imported, and every line a peer can cause goes through a limiter."""
    worker = processes([*WORKER, "--listen", "127.0.0.1:0", "--announce", "--log-level", "info"], env=env_with_tests())
    raw = Raw(worker.endpoint)
    label = "Can't get attribute 'Add' on <module 'fabric_nodes'"
    answers = []
    try:
        assert isinstance(raw.ask(Hello(RT)), Ready)
        assert isinstance(raw.ask(Work(1, Recipe((spec_of(Add(1).named("a")),), ("step", 0)), 1, watched=False)), Done)
        for ref in range(2, 122):
            target = "fabric_nodes:Nope" if ref % 2 else "fabric_nodes:Boom"
            answers.append(
                raw.ask(Work(ref, Recipe((NodeSpec(label, False, "project", target),), ("step", 0)), 1, watched=False))
            )
        assert isinstance(raw.ask(Hello(RT)), Ready)  # everything before it was handled
    finally:
        raw.close()
    assert all(a is not None and a.ref is not None for a in answers), answers
    forged = [a for a in answers if "older import" in a.why]
    assert not forged, f"{len(forged)} answers carried advice a client forged: {forged[0].why}"
    said = worker.stderr()
    assert "older import" not in said
    lines = [line for line in said.splitlines() if line.strip()]
    assert len(lines) <= 30, f"120 bad messages wrote {len(lines)} lines to the worker's log"


def test_busy_spells_one_after_another_write_one_line_to_the_workers_log(processes, tmp_path):
    """Attacker, or a client's own threads taking turns: work refused as busy again and
    again. A busy spell was logged once, and a new spell began with every piece accepted:
    turns taken by a client's threads (each one a spell) wrote a line each. Now a refusal
    as busy is logged at most once a minute, with how many were not."""
    worker = processes([*WORKER, "--listen", "127.0.0.1:0", "--announce"], env=env_with_tests())
    raw = Raw(worker.endpoint)
    refusals = []
    try:
        assert isinstance(raw.ask(Hello(RT)), Ready)
        with Broker.embedded({"w1": Worker.at(worker.endpoint, mode="project")}) as holder:
            for spell in range(3):
                started, release, finished = (
                    tmp_path / f"{what}{spell}" for what in ("started", "release", "finished")
                )
                hold = Hold(str(started), str(release), str(finished)).named("hold").at("w1")
                thread = threading.Thread(target=hold.forward, args=(spell,), kwargs={"broker": holder})
                thread.start()
                wait_until(started.exists, 30, "the held piece running")
                for n in range(2):
                    work = Work(
                        10 * spell + n + 1, Recipe((spec_of(Add(1).named("a")),), ("step", 0)), 1, watched=False
                    )
                    refusals.append(raw.ask(work))
                release.write_text("go")
                thread.join(30)
    finally:
        raw.close()
    assert all(isinstance(r, Refusal) and r.why.startswith("busy: running `hold` for ") for r in refusals), refusals
    said = [line for line in worker.stderr().splitlines() if "busy:" in line]
    assert len(said) == 1, f"6 refusals in 3 busy spells wrote {len(said)} lines: {said}"


# -- the conversation, with no process --------------------------------------------------------


def test_a_refusal_naming_no_work_is_not_the_answer_once_the_work_was_sent():
    c = ClientExchange()
    c.hello_sent()
    c.receive(Ready(RT))
    c.work_sent(5)
    refused = Refusal("say Hello first", hello=True)
    assert c.receive(refused) is refused and c.state == "ready"  # the stream of the Work was refused
    c.work_sent(6)
    c.work_delivered()
    assert c.receive(Refusal("another's", ref=99)) is None and c.stale == 1
    assert c.receive(refused) is refused and c.state == "closed" and c.unplaced is refused
    with pytest.raises(Violation):
        c.receive(Done(6, 1, {}, 5))  # the channel ended: a late answer is never read


def test_a_session_with_an_answer_in_flight_is_never_forgotten_the_newcomer_is_refused():
    w = WorkerSessions(RT, max_peers=2)
    w.receive(b"victim", Hello(RT), now=0.0)
    w.receive(b"victim", Work(1, Recipe((spec_of(Add(1).named("a")),), ("step", 0)), 1), now=0.0)
    assert w.answering(b"victim", Done(1, 1, {}, 5))  # done: its answer streams back now
    w.hold(b"victim", 77)
    w.receive(b"other", Hello(RT), now=0.0)
    w.receive(b"other", Work(2, Recipe((spec_of(Add(1).named("a")),), ("step", 0)), 1), now=0.0)
    with pytest.raises(Violation, match="busy"):
        w.receive(b"newcomer", Hello(RT), now=0.0)
    assert w.greeted(b"victim") and w.greeted(b"other") and not w.greeted(b"newcomer")
    w.release(b"victim", 77)
    w.receive(b"newcomer", Hello(RT), now=0.0)  # now the victim may go: it has nothing in flight
    assert not w.greeted(b"victim") and w.greeted(b"newcomer")
    # a refusal of a Work that never opened may name it; an answer to it may not leave
    assert w.answering(b"newcomer", Refusal("no", ref=9), refusing=True)
    assert not w.answering(b"newcomer", Saw(9, {}))


def test_a_big_message_dropped_for_being_slow_is_refused_naming_its_work(processes):
    """A stream the worker drops (it came slower than its rate after the grace) left its
    sender waiting until its own deadline, told nothing. Now the worker refuses it at once,
    naming the Work whose header had arrived, so the client ends that call and no other.
    (The worker runs with a grace of 2 s instead of 30, as in test_liveness.)"""
    quick = (
        "import sys; import somatize.fabric.streams as s; s.GRACE = 2.0; "
        "from somatize.worker import main; sys.exit(main(sys.argv[1:]))"
    )
    hub = processes([*BROKER, "--listen", "tcp://127.0.0.1:0", "--announce"])
    processes(
        [WORKER[0], "-c", quick, "--broker", hub.endpoint, "--offer", "w1", "--patience", "2"],
        announce=None,
        env=env_with_tests(),
    )
    client = Raw(hub.endpoint)
    try:
        wait_until(lambda: isinstance(client.ask(Where("w1"), 2.0), Located), 20, "w1 dialing in")
        assert isinstance(client.ask(Relay(host="w1", inner=tuple(encode(Hello(RT))))), Ready)
        spec = Packer("project").spec(Add(1).named("a").steps[0])
        header = encode(Work(9, Recipe((spec,), ("step", 0)), 41))[0]
        client.send(Relay(host="w1", inner=tuple(encode(Begin(5, (len(header), 1 << 20))))))
        client.send(Relay(host="w1", inner=tuple(encode(Chunk(5, header)))))  # the header, then nothing
        got = []
        while not any(isinstance(a, Refusal) for a in got):
            answer = client.answer(15.0)
            assert answer is not None, f"told nothing within 15 s: {got}"
            got.append(answer)
        refusal = next(a for a in got if isinstance(a, Refusal))
        assert refusal.ref == 9 and "dropped the big message" in refusal.why and "stream 5" in refusal.why, refusal
    finally:
        client.close()
