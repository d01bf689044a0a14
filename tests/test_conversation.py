"""The conversation layer, fed messages with no socket and no process: every legal
transition, the illegal ones that matter, and the one-look paths (a ``Done`` on either side,
a Work recalled by digest) against the general rules, fed the same messages in every state."""

from __future__ import annotations

import dataclasses

import pytest
from fabric_nodes import Add
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from somatize.fabric.broker.peers import IDLE_SILENCE
from somatize.fabric.conversation import (
    CLIENT,
    WORKER,
    BrokerView,
    ClientExchange,
    Stale,
    Violation,
    WorkerSessions,
)
from somatize.packing import Packer
from somatize.wire import (
    Bye,
    Done,
    Failed,
    Hello,
    Hosts,
    NodeSpec,
    Provision,
    Ready,
    Recipe,
    Refusal,
    Relay,
    Runtime,
    Saw,
    Send,
    Where,
    Work,
    decode,
    encode,
    recipe_digest,
)

RT = Runtime.here()
WORKER_RT = Runtime.here(mode="project")
EVERYONE = frozenset((CLIENT, WORKER))
CLIENTS = frozenset((CLIENT,))


def work(ref: int) -> Work:
    return Work(ref, Recipe((NodeSpec("a", False, "project", "fabric_nodes:Add"),), ("step", 0)), None)


def done(ref: int) -> Done:
    return Done(ref, 1, {}, 5)


# -- the client's side --------------------------------------------------------------------


def ready_client() -> ClientExchange:
    c = ClientExchange()
    c.hello_sent()
    c.receive(Ready(WORKER_RT))
    return c


@pytest.mark.pure
def test_a_client_exchange_runs_hello_work_saw_done():
    c = ClientExchange()
    assert c.state == "new"
    c.hello_sent()
    assert c.state == "greeting"
    assert c.receive(Ready(WORKER_RT)) is not None
    assert c.state == "ready"
    c.work_sent(7)
    assert c.state == "working"
    assert isinstance(c.receive(Saw(7, {"fact": "ran"})), Saw)
    assert c.state == "working"
    assert isinstance(c.receive(done(7)), Done)
    assert c.state == "ready"


@pytest.mark.parametrize("end", [done(3), Failed(3, "x", None, "E", ""), Refusal("no", ref=3), Refusal("no")])
@pytest.mark.pure
def test_every_terminal_answer_ends_the_work(end):
    c = ready_client()
    c.work_sent(3)
    assert c.receive(end) is end
    assert c.state == "ready"


@pytest.mark.pure
def test_send_returns_to_ready_for_provisioning_then_the_work_again():
    c = ready_client()
    c.work_sent(4)
    c.receive(Send(4, ("sha256:" + "0" * 64,)))
    assert c.state == "ready"
    c.provision_sent()
    assert c.state == "provisioning"
    c.receive(Ready(WORKER_RT))
    c.work_sent(4)
    assert c.receive(done(4)) is not None


@pytest.mark.parametrize("stale", [done(99), Saw(99, {"fact": "ran"}), Failed(99, "x", None, "E", ""), Send(99, ())])
@pytest.mark.pure
def test_an_answer_for_an_exchange_that_is_not_open_is_dropped_and_counted(stale):
    c = ready_client()
    c.work_sent(5)
    assert c.receive(stale) is None
    assert c.stale == 1
    assert c.state == "working"  # still waiting for its own answer
    assert c.receive(done(5)) is not None


@pytest.mark.parametrize("odd", [done(1), Saw(1, {}), Send(1, ()), Hello(RT), work(1)])
@pytest.mark.pure
def test_an_answer_nobody_asked_for_closes_the_channel(odd):
    c = ready_client()
    with pytest.raises(Violation):
        c.receive(odd)
    assert c.state == "closed"
    with pytest.raises(Violation):
        c.work_sent(1)


@pytest.mark.pure
def test_a_client_sends_nothing_out_of_turn():
    c = ClientExchange()
    with pytest.raises(Violation):
        c.work_sent(1)
    c.hello_sent()
    with pytest.raises(Violation):
        c.hello_sent()
    c.receive(Refusal("go away"))
    assert c.state == "closed"


@pytest.mark.pure
def test_a_work_sent_right_behind_the_hello_has_the_hellos_answer_first():
    c = ClientExchange()
    c.hello_sent()
    c.work_sent(8)
    assert c.state == "greeting+working"
    c.work_delivered()
    with pytest.raises(Violation, match="Done"):  # the worker answers the Hello first
        c.receive(done(8))
    c = ClientExchange()
    c.hello_sent()
    c.work_sent(8)
    c.work_delivered()
    assert isinstance(c.receive(Ready(WORKER_RT)), Ready) and c.state == "working" and c.sent
    assert c.receive(done(9)) is None and c.stale == 1  # another work's answer: dropped, as ever
    assert isinstance(c.receive(done(8)), Done) and c.state == "ready"
    c = ClientExchange()
    c.hello_sent()
    c.work_sent(8)
    c.receive(Refusal("busy: full"))  # the Hello refused: the worker refuses the Work behind it too
    assert c.state == "closed"
    with pytest.raises(Violation):
        c.work_sent(9)


@pytest.mark.pure
def test_hello_answered_with_done_is_a_violation():
    c = ClientExchange()
    c.hello_sent()
    with pytest.raises(Violation, match="Done"):
        c.receive(done(1))


# -- the worker's side --------------------------------------------------------------------


@pytest.mark.pure
def test_a_worker_wants_hello_first():
    w = WorkerSessions(WORKER_RT)
    with pytest.raises(Violation, match="say Hello first"):
        w.receive(b"a", work(1), now=0.0)
    with pytest.raises(Violation, match="say Hello first"):
        w.receive(b"a", Provision("sha256:" + "0" * 64, b"x"), now=0.0)
    assert w.refused == 2
    w.receive(b"a", Hello(RT), now=0.0)
    assert w.greeted(b"a")
    assert w.receive(b"a", work(1), now=0.0).ref == 1


@pytest.mark.pure
def test_recall_gives_what_receive_would_or_nothing_and_changes_nothing():
    """The express way in asks `recall` first: it gives the work with its recipe, opened,
    exactly when `receive` would, and otherwise None, leaving `receive` to say why."""
    w = WorkerSessions(WORKER_RT)
    full = work(1)
    digest = recipe_digest(full.recipe).digest
    named = Work(2, None, 5, recipe_digest=digest)
    assert w.recall(b"a", named, now=0.0) is None  # no Hello yet
    w.receive(b"a", Hello(RT), now=0.0)
    w.receive(b"b", Hello(RT), now=0.0)
    assert w.recall(b"a", named, now=0.0) is None  # no recipe sent yet
    w.receive(b"a", full, now=0.0)
    assert w.recall(b"b", named, now=0.0) is None  # a's recipe is not b's
    with pytest.raises(Violation, match="holds no recipe"):
        w.receive(b"b", named, now=0.0)
    unfit = Work(2, None, 5, keys={4: "sha256:" + "0" * 64}, recipe_digest=digest)
    assert w.recall(b"a", unfit, now=0.0) is None and not w.is_open(b"a", 2)
    recalled = w.recall(b"a", named, now=0.0)
    assert recalled.recipe is full.recipe and recalled.input == 5 and w.is_open(b"a", 2)
    assert w.recall(b"a", named, now=0.0) is None  # its ref is open now
    assert w.answering(b"a", done(2)) and not w.is_open(b"a", 2)
    assert w.refused == 1  # only what `receive` refused counts


@pytest.mark.pure
def test_a_worker_answers_only_open_work_of_that_peer():
    w = WorkerSessions(WORKER_RT)
    w.receive(b"a", Hello(RT), now=0.0)
    w.receive(b"b", Hello(RT), now=0.0)
    w.receive(b"a", work(1), now=0.0)
    assert w.running() == 1
    assert not w.answering(b"b", done(1))  # b never sent work 1
    assert w.answering(b"a", Saw(1, {}))
    assert w.answering(b"a", done(1))
    assert not w.answering(b"a", done(1))  # once only
    assert w.running() == 0


@pytest.mark.pure
def test_the_same_ref_twice_while_open_is_refused():
    w = WorkerSessions(WORKER_RT)
    w.receive(b"a", Hello(RT), now=0.0)
    w.receive(b"a", work(1), now=0.0)
    with pytest.raises(Violation, match="already running"):
        w.receive(b"a", work(1), now=0.0)


@pytest.mark.parametrize("odd", [Where("w1"), Hosts(), done(1), Ready(RT), Hello(RT, offering="w1")])
@pytest.mark.pure
def test_a_worker_refuses_what_is_not_for_a_worker(odd):
    w = WorkerSessions(WORKER_RT)
    w.receive(b"a", Hello(RT), now=0.0)
    with pytest.raises(Violation):
        w.receive(b"a", odd, now=0.0)


@pytest.mark.pure
def test_an_incompatible_hello_is_refused_with_the_fix():
    w = WorkerSessions(WORKER_RT)
    other = dataclasses.replace(RT, wire=RT.wire + 1)
    with pytest.raises(Violation, match="upgrade somatize"):
        w.receive(b"a", Hello(other), now=0.0)
    assert not w.greeted(b"a")


@pytest.mark.pure
def test_bye_forgets_the_peer():
    w = WorkerSessions(WORKER_RT)
    w.receive(b"a", Hello(RT), now=0.0)
    w.receive(b"a", Bye(), now=0.0)
    assert not w.greeted(b"a")


@pytest.mark.pure
def test_what_a_worker_keeps_per_peer_is_bounded_in_bytes():
    w = WorkerSessions(WORKER_RT, max_bytes=200_000)
    fat = dataclasses.replace(RT, kinds=tuple(f"kind.{i}.{'x' * 900}" for i in range(100)))
    for n in range(100):
        w.receive(b"p%d" % n, Hello(fat), now=0.0)
    assert w._bytes <= 200_000
    assert w.greeted(b"p99")  # the latest is kept; the oldest were forgotten
    assert not w.greeted(b"p0")


@pytest.mark.pure
def test_running_work_is_never_forgotten_to_make_room():
    w = WorkerSessions(WORKER_RT, max_peers=2)
    w.receive(b"busy", Hello(RT), now=0.0)
    w.receive(b"busy", work(1), now=0.0)
    for n in range(5):
        w.receive(b"p%d" % n, Hello(RT), now=0.0)
    assert w.greeted(b"busy")
    assert w.answering(b"busy", done(1))


@pytest.mark.pure
def test_busy_us_is_the_age_of_the_oldest_running_work():
    w = WorkerSessions(WORKER_RT)
    assert w.busy_us(now=5.0) == 0
    w.receive(b"a", Hello(RT), now=5.0)
    w.receive(b"a", work(1), now=7.0)  # the clock is the caller's: the worker's loop hands it in
    assert w.busy_us(now=9.5) == 2_500_000


# -- the broker's view ----------------------------------------------------------------------


def offering(host: str) -> Hello:
    return Hello(WORKER_RT, offering=host)


@pytest.mark.pure
def test_a_host_is_bound_to_the_key_that_offered_it_first():
    b = BrokerView()
    assert b.hello(b"r1", "KEY-A", EVERYONE, offering("node017"), 0.0) == "offered"
    with pytest.raises(Violation, match="another worker key"):
        b.hello(b"r2", "KEY-B", EVERYONE, offering("node017"), 1.0)
    assert b.offers["node017"].route == b"r1"
    # the owner leaving does not free the name for another key
    b.leave(b"r1")
    with pytest.raises(Violation, match="another worker key"):
        b.hello(b"r2", "KEY-B", EVERYONE, offering("node017"), 2.0)
    # the owner comes back from a new connection: served again there
    assert b.hello(b"r3", "KEY-A", EVERYONE, offering("node017"), 3.0) == "offered"
    assert b.offers["node017"].route == b"r3"


@pytest.mark.pure
def test_without_keys_a_name_is_bound_to_its_connection_while_it_stays():
    b = BrokerView()
    b.hello(b"r1", "", EVERYONE, offering("w"), 0.0)
    with pytest.raises(Violation, match="another connection") as refused:  # no key is named where none is used
        b.hello(b"r2", "", EVERYONE, offering("w"), 0.0)
    assert "key" not in refused.value.why.replace("without keys", "")
    b.leave(b"r1")
    assert b.hello(b"r2", "", EVERYONE, offering("w"), 0.0) == "offered"


@pytest.mark.pure
def test_a_second_hello_from_the_same_route_is_a_keepalive():
    b = BrokerView()
    b.hello(b"r1", "K", EVERYONE, offering("w"), 0.0)
    assert b.hello(b"r1", "K", EVERYONE, offering("w"), 5.0) == "keepalive"
    assert b.offers["w"].seen == 5.0


@pytest.mark.pure
def test_a_client_key_may_ask_but_not_offer():
    b = BrokerView()
    assert b.hello(b"r1", "C", CLIENTS, Hello(RT), 0.0) == "client"
    with pytest.raises(Violation, match="--allow-workers"):
        b.hello(b"r1", "C", CLIENTS, offering("w"), 0.0)


@pytest.mark.pure
def test_one_key_cannot_squat_every_name():
    b = BrokerView(max_offers=16)
    for n in range(16):
        b.hello(b"r%d" % n, "SQUAT", EVERYONE, offering(f"node{n:03d}"), 0.0)
    with pytest.raises(Violation, match="as many as one key may"):
        b.hello(b"rx", "SQUAT", EVERYONE, offering("node999"), 0.0)
    assert b.hello(b"real", "REAL", EVERYONE, offering("node999"), 0.0) == "offered"


@pytest.mark.pure
def test_a_declared_host_cannot_be_offered():
    b = BrokerView({"gpu1"})
    with pytest.raises(Violation, match="declared"):
        b.hello(b"r", "K", EVERYONE, offering("gpu1"), 0.0)


def relay_from_client(b: BrokerView, client: bytes, key: str, host: str, payload: bytes = b"x", now: float = 0.0):
    return b.relay(client, key, Relay(host=host, inner=(payload,)), now)


@pytest.mark.pure
def test_a_relayed_answer_reaches_only_the_client_that_sent_that_work():
    b = BrokerView()
    b.hello(b"worker", "W", EVERYONE, offering("w1"), 0.0)
    to_worker = relay_from_client(b, b"alice", "A", "w1")
    assert to_worker.route == b"worker"
    envelope = decode(to_worker.frames)
    assert isinstance(envelope, Relay) and envelope.exchange > 0 and envelope.tenant == "A"
    back = b.relay(b"worker", "W", Relay(exchange=envelope.exchange, inner=(b"answer",)), 0.0)
    assert back.route == b"alice" and [bytes(f) for f in back.frames] == [b"answer"]


@pytest.mark.pure
def test_a_worker_cannot_answer_an_exchange_it_was_not_sent():
    b = BrokerView()
    b.hello(b"victim-worker", "V", EVERYONE, offering("w1"), 0.0)
    b.hello(b"evil-worker", "E", EVERYONE, offering("w2"), 0.0)
    sent = decode(relay_from_client(b, b"alice", "A", "w1").frames)
    for number in (sent.exchange, sent.exchange + 1, 0, 12345):
        with pytest.raises(Stale):
            b.relay(b"evil-worker", "E", Relay(exchange=number, inner=(b"forged",)), 0.0)


@pytest.mark.pure
def test_a_client_cannot_address_an_exchange_by_number():
    b = BrokerView()
    b.hello(b"worker", "W", EVERYONE, offering("w1"), 0.0)
    sent = decode(relay_from_client(b, b"alice", "A", "w1").frames)
    with pytest.raises(Violation, match="only a worker"):
        b.relay(b"mallory", "M", Relay(exchange=sent.exchange, inner=(b"x",)), 0.0)


@pytest.mark.pure
def test_each_client_gets_its_own_exchange_with_a_host():
    b = BrokerView()
    b.hello(b"worker", "W", EVERYONE, offering("w1"), 0.0)
    a = decode(relay_from_client(b, b"alice", "A", "w1").frames).exchange
    a_again = decode(relay_from_client(b, b"alice", "A", "w1").frames).exchange
    m = decode(relay_from_client(b, b"mallory", "M", "w1").frames).exchange
    assert a == a_again and a != m


@pytest.mark.pure
def test_exchanges_per_tenant_are_bounded():
    b = BrokerView(max_exchanges=4)
    b.hello(b"worker", "W", EVERYONE, offering("w1"), 0.0)
    for n in range(10):
        relay_from_client(b, b"c%d" % n, "SAME", "w1")
    assert sum(1 for e in b.exchanges.values() if e.tenant == "SAME") == 4


@pytest.mark.pure
def test_a_worker_that_left_has_its_exchanges_ended():
    b = BrokerView()
    b.hello(b"worker", "W", EVERYONE, offering("w1"), 0.0)
    sent = decode(relay_from_client(b, b"alice", "A", "w1").frames)
    b.leave(b"worker")
    assert sent.exchange not in b.exchanges
    with pytest.raises(Violation, match="no worker serving"):
        relay_from_client(b, b"alice", "A", "w1")


@pytest.mark.pure
def test_revoking_a_key_forgets_its_hosts():
    b = BrokerView()
    b.hello(b"r1", "GONE", EVERYONE, offering("w1"), 0.0)
    b.hello(b"r2", "STAYS", EVERYONE, offering("w2"), 0.0)
    assert b.revoke({"STAYS"}) == [b"r1"]
    assert set(b.offers) == {"w2"}
    assert "w1" not in b.bindings


@pytest.mark.pure
def test_an_idle_offer_expires_after_three_keepalives_of_silence():
    """Its connection's pings say an idle worker is there (ZeroMQ drops a connection silent
    past their time to live); its keepalive, every KEEPALIVE patiences, is the net beneath."""
    b = BrokerView(patience=1.0)
    b.hello(b"r1", "", EVERYONE, offering("w1"), 0.0)
    assert b.expire(IDLE_SILENCE - 0.5) == [] and b.checks == []
    assert b.expire(IDLE_SILENCE + 0.5) == ["w1"]


@pytest.mark.pure
def test_a_host_clients_wait_on_is_checked_after_a_patience_and_gone_after_one_and_a_half():
    """A stopped worker with work open is noticed in one and a half patiences, counted from
    when it was last heard or when its first exchange opened, whichever is later; silent for
    a patience it is asked (its route in ``checks``), and an answer keeps it."""
    b = BrokerView(patience=1.0)
    b.hello(b"worker", "W", EVERYONE, offering("w1"), 0.0)
    b.hello(b"idle", "W", EVERYONE, offering("w2"), 0.0)
    relay_from_client(b, b"alice", "A", "w1", now=20.0)  # long after its last keepalive
    assert b.expire(20.5) == [] and b.checks == []
    assert b.expire(21.2) == [] and b.checks == [b"worker"]  # silent a patience: asked
    b.heard(b"worker", 21.3)  # its Ready
    assert b.expire(22.0) == [] and b.checks == []
    assert b.expire(22.4) == [] and b.checks == [b"worker"]
    assert b.expire(22.9) == ["w1"] and b.stalled == {"w1"}  # one and a half: gone, its exchange too
    assert not b.exchanges and "w2" in b.offers  # the idle one is held to its keepalive


@pytest.mark.pure
def test_only_a_host_a_client_waits_on_is_held_closer():
    """Clients that hold exchanges open with a fleet, between calls, cost the broker nothing
    per host: it holds a host closer (checked after a patience of silence, gone after one
    and a half) only while a client waits on it, from its Work (or Hello, or anything but
    Bye) until the worker answers. A fact is not an answer; a Bye ends the wait, and only
    its own client's."""
    b = BrokerView(patience=1.0)
    b.hello(b"worker", "W", EVERYONE, offering("w1"), 0.0)

    def from_client(message, now: float):
        return decode(b.relay(b"alice", "A", Relay(host="w1", inner=tuple(encode(message))), now).frames)

    def from_worker(message, now: float) -> None:
        b.relay(b"worker", "W", Relay(exchange=sent.exchange, inner=tuple(encode(message))), now)

    sent = from_client(work(1), 20.0)
    from_worker(done(1), 20.1)  # answered: nobody waits, the exchange stays open
    assert b.expire(21.5) == [] and b.checks == []
    assert b.expire(23.0) == [] and "w1" in b.offers and sent.exchange in b.exchanges
    from_client(work(2), 24.0)
    from_worker(Saw(2, {"fact": "ran"}), 24.1)  # a fact: still waited on
    assert b.expire(25.2) == [] and b.checks == [b"worker"]
    b.heard(b"worker", 25.3)  # its Ready to the check
    from_client(Bye(), 25.4)  # the client gave up: it waits no more
    assert b.expire(27.0) == [] and b.checks == [] and "w1" in b.offers
    from_client(work(3), 30.0)  # waited on again, and never answered
    # another client, another tenant, cannot end alice's wait: its Bye is its own exchange's
    with pytest.raises(Stale):  # it had no exchange there: its Bye ends nothing, and is refused
        b.relay(b"mallory", "M", Relay(host="w1", inner=tuple(encode(Bye()))), 30.5)
    assert b.expire(31.6) == ["w1"] and b.stalled == {"w1"}


@pytest.mark.pure
def test_exchanges_opened_again_and_again_never_keep_a_silent_host():
    """Each first exchange of a host starts its closer watch anew; a client that opens and
    ends them without end still cannot keep a silent host past the idle bound."""
    b = BrokerView(patience=1.0)
    b.hello(b"worker", "W", EVERYONE, offering("w1"), 0.0)
    now = 0.0
    while "w1" in b.offers and now < 2 * IDLE_SILENCE:
        now += 0.5
        relay_from_client(b, b"alice", "A", "w1", now=now)
        b.leave(b"alice")  # its channel closes: the exchange ends, the next one is a first again
        b.expire(now)
    assert "w1" not in b.offers and now <= IDLE_SILENCE + 1.0


@pytest.mark.pure
def test_an_envelope_round_trips_without_decoding_its_inner_frames():
    inner = encode(work(9))
    frames = encode(Relay(host="w1", inner=tuple(inner)))
    back = decode(frames)
    assert isinstance(back, Relay) and back.host == "w1"
    assert isinstance(decode(list(back.inner)), Work)


@pytest.mark.pure
def test_a_quiet_exchange_is_never_ended_for_being_quiet():
    b = BrokerView(patience=0.1)
    b.hello(b"worker", "W", EVERYONE, offering("w1"), 0.0)
    sent = decode(relay_from_client(b, b"alice", "A", "w1").frames)
    b.hello(b"worker", "W", EVERYONE, offering("w1"), 10_000.0)  # its keepalive
    b.expire(10_000.1)
    back = b.relay(b"worker", "W", Relay(exchange=sent.exchange, inner=(b"late but wanted",)), 10_000.1)
    assert back.route == b"alice"


@pytest.mark.pure
def test_exchanges_in_all_are_bounded():
    b = BrokerView(max_open=10)
    b.hello(b"worker", "W", EVERYONE, offering("w1"), 0.0)
    for n in range(50):
        relay_from_client(
            b,
            b"c%d" % n,
            "",
            "w1",
        )
    assert len(b.exchanges) == 10


@pytest.mark.pure
def test_a_key_whose_nodes_come_and_go_keeps_offering_new_names():
    """A batch job's key serves node001..node004 today and others tomorrow: it lets go of
    names it no longer serves, oldest first, never of one it serves."""
    b = BrokerView(max_offers=2, max_bindings=4)
    for day in range(5):
        for n in range(2):
            route = b"r%d-%d" % (day, n)
            assert b.hello(route, "SLURM", EVERYONE, offering(f"node{day}{n}"), float(day)) == "offered"
        for n in range(2):
            b.leave(b"r%d-%d" % (day, n))
    assert sorted(h for h, o in b.bindings.items() if o == "SLURM") == ["node30", "node31", "node40", "node41"]
    b.hello(b"now", "SLURM", EVERYONE, offering("node40"), 9.0)
    b.hello(b"now2", "SLURM", EVERYONE, offering("node41"), 9.0)
    with pytest.raises(Violation, match="as many as one key may at once"):
        b.hello(b"now3", "SLURM", EVERYONE, offering("node99"), 9.0)


@pytest.mark.pure
def test_a_client_that_leaves_has_its_exchanges_ended():
    """A client's channel says Bye as it closes: what it had open ends now, not when 64 newer
    exchanges of its tenant crowd it out."""
    b = BrokerView()
    for host in ("w1", "w2", "w3"):
        b.hello(b"worker-" + host.encode(), "W", EVERYONE, offering(host), 0.0)
        relay_from_client(b, b"alice", "A", host)
    kept = decode(relay_from_client(b, b"bob", "B", "w1").frames).exchange
    b.leave(b"alice")
    assert [e.client for e in b.exchanges.values()] == [b"bob"] and kept in b.exchanges


@pytest.mark.pure
def test_one_route_serving_thousands_of_names_is_heard_at_the_cost_of_one():
    b = BrokerView(patience=1.0)
    names = [f"node{n:04d}" for n in range(2000)]
    for name in names:
        assert b.hello(b"one", "JOB", EVERYONE, offering(name), 0.0) == "offered"
    b.heard(b"one", IDLE_SILENCE - 0.1)  # any message from it, not a Hello per name
    assert b.expire(IDLE_SILENCE + 0.5) == []
    assert sorted(b.expire(2 * IDLE_SILENCE)) == names  # silent past three keepalives: all of them go


@pytest.mark.pure
def test_the_views_indexes_follow_every_change():
    """What the view keeps to answer in constant time (hosts per key, names per key,
    exchanges per route, host and tenant) always equals what a walk over everything finds."""
    import random

    rng = random.Random(7)
    b = BrokerView(patience=1.0, max_offers=5, max_bindings=7, max_exchanges=3, max_open=20)
    workers = [b"w%d" % n for n in range(6)]
    clients = [b"c%d" % n for n in range(5)]
    keys = ["K1", "K2", ""]
    now = 0.0
    for _ in range(3000):
        now += rng.random() * 0.3
        op = rng.random()
        try:
            if op < 0.35:
                b.hello(rng.choice(workers), rng.choice(keys), EVERYONE, offering(f"h{rng.randrange(12)}"), now)
            elif op < 0.7:
                relay_from_client(b, rng.choice(clients), rng.choice(["A", "B"]), f"h{rng.randrange(12)}")
            elif op < 0.8:
                b.leave(rng.choice(workers + clients))
            elif op < 0.9:
                b.heard(rng.choice(workers), now)
                b.expire(now)
            elif op < 0.93:
                b.revoke({"K1", "K2"} - {rng.choice(keys)})
        except Violation:
            pass
        serving: dict = {}
        for offer in b.offers.values():
            serving[offer.owner] = serving.get(offer.owner, 0) + 1
        assert b._serving == serving
        for owner in set(b.bindings.values()):
            assert sorted(b.bindings.held(owner)) == sorted(h for h, o in b.bindings.items() if o == owner)
        by_route: dict = {}
        by_host: dict = {}
        by_tenant: dict = {}
        for number, e in b.exchanges.items():
            by_route.setdefault(e.client, set()).add(number)
            by_route.setdefault(e.worker, set()).add(number)
            by_host.setdefault(e.host, set()).add(number)
            by_tenant.setdefault(e.tenant, set()).add(number)
        assert b._of_route == by_route and b._of_host == by_host
        assert {t: set(n) for t, n in b._of_tenant.items()} == by_tenant
        assert all(len(n) <= 3 for n in by_tenant.values()) and len(b.exchanges) <= 20
        assert set(b._heard) == set(b.offers_index)


# -- the tables, as the page shows them and as the loops carry them out ----------------------


@pytest.mark.pure
def test_the_page_shows_the_tables_the_code_runs():
    """docs/conversation.md's tables and diagram are drawn from the code's: a table changed
    without the page (or the page edited by hand) fails here, saying how to draw it again."""
    from pathlib import Path

    from somatize.fabric.conversation.drawn import blocks, drawn

    page = (Path(__file__).resolve().parents[1] / "docs" / "conversation.md").read_text()
    found = blocks(page)
    assert set(found) == {"diagram", "client sends", "client", "worker", "broker"}
    for what, body in found.items():
        assert body == drawn(what), (
            f"docs/conversation.md's `{what}` is not what the code runs: "
            f"python -m somatize.fabric.conversation.drawn docs/conversation.md"
        )


@pytest.mark.pure
def test_every_step_of_the_broker_table_is_carried_out_by_one_method_of_its_loop():
    """The broker's loop decides nothing: it has a method for each step the table can give
    (HEARD, a worker's answer to a check, is heard and nothing more), and no other."""
    from somatize.fabric.broker.loop import BrokerLoop
    from somatize.fabric.conversation import BROKER_TABLE, Step

    assert set(BrokerLoop.STEPS) == set(BROKER_TABLE.values()) - {Step.HEARD}
    assert all(callable(getattr(BrokerLoop, name)) for name in BrokerLoop.STEPS.values())
    assert set(Step) == set(BROKER_TABLE.values())  # no step the table never gives


@pytest.mark.pure
def test_the_worker_table_refuses_what_a_peer_that_never_said_hello_sends_unopened():
    """From a peer it has not heard, a worker opens a Hello and a Bye and nothing else: every
    other kind is refused (`hello`), or dropped unanswered (a stream's chunk or credit)."""
    from somatize.fabric.conversation import Act, Unknown, WorkerSessions
    from somatize.wire import Begin, Chunk, Credit, Mounted

    w = WorkerSessions(WORKER_RT)
    assert w.step(b"p", Hello) is Act.GREET and w.step(b"p", Bye) is Act.FORGET
    assert w.step(b"p", Chunk) is Act.DROP and w.step(b"p", Credit) is Act.DROP
    for kind in (Provision, Work, Begin, Mounted, Relay, Ready, Where, Done):
        with pytest.raises(Unknown):
            w.step(b"p", kind)
    assert w.refused == 8
    w.receive(b"p", Hello(WORKER_RT), now=0.0)
    assert [w.step(b"p", k) for k in (Provision, Work, Begin, Chunk, Credit, Mounted)] == [
        Act.PROVISION,
        Act.RUN,
        Act.CARRY,
        Act.CARRY,
        Act.CARRY,
        Act.OPEN,
    ]
    with pytest.raises(Violation, match="only from the broker it dialed"):
        w.step(b"p", Relay)


@pytest.mark.pure
def test_every_act_of_the_worker_table_is_carried_out_once():
    """The worker's loop carries out GREET, PROVISION and RUN, one method each; its intake
    carries out the rest (a Bye's FORGET, a stream's CARRY, a Mounted's OPEN, a DROP); no act
    is carried out twice or by nobody, and the table gives every act."""
    from somatize.fabric.conversation import WORKER_TABLE, Act
    from somatize.fabric.conversation.worker import Refuse
    from somatize.fabric.worker.loop import WorkerLoop

    by_intake = {Act.FORGET, Act.CARRY, Act.OPEN, Act.DROP}
    assert set(WorkerLoop.ACTS) | by_intake == set(Act) and not set(WorkerLoop.ACTS) & by_intake
    assert all(callable(getattr(WorkerLoop, name)) for name in WorkerLoop.ACTS.values())
    given = {found[1] for found in WORKER_TABLE.values() if not isinstance(found, Refuse)}
    assert given == set(Act)


# -- the one-look paths (a Done on either side, a Work recalled by digest) are the general rules --


class _SlowDone(Done):
    """A ``Done`` the one-look paths do not take (they ask ``type(msg) is Done``): the same
    message, through the general rules."""


def _slow(msg):
    if type(msg) is Done:
        return _SlowDone(msg.ref, msg.output, msg.produced, msg.took_us, msg.saw)
    return msg


def _outcome_of(call):
    """What a call of a conversation gave: its value (a Done of either class as one), or the
    class and sentence of what it raised."""
    try:
        got = call()
    except Violation as exc:
        return ("raised", type(exc).__name__, exc.why.replace("`_SlowDone`", "`Done`"))
    if isinstance(got, Done):
        return ("done", got.ref, got.output)
    return ("gave", got)


def _client_state(ex: ClientExchange):
    return (ex.state, ex.ref, ex.stale, ex.sent, ex.unplaced)


_REFS = st.sampled_from([1, 2, 3])


_ANSWERS = st.one_of(
    st.builds(lambda r: Done(r, r * 10, {}, 1), _REFS),
    st.builds(lambda r: Failed(r, "no", "a", "E", ""), _REFS),
    st.builds(
        lambda r, h, c: Refusal("no", ref=r, hello=h, recipe=c),
        st.one_of(st.none(), _REFS),
        st.booleans(),
        st.booleans(),
    ),
    st.builds(lambda r: Refusal("busy: full", ref=r), _REFS),
    st.just(Ready(RT)),
    st.builds(lambda r: Saw(r, {"event": "ran"}), _REFS),
    st.builds(lambda r: Send(r, ("sha256:" + "b" * 64,)), _REFS),
)


_CLIENT_STEPS = st.lists(
    st.one_of(
        st.tuples(st.just("hello")),
        st.tuples(st.just("work"), _REFS),
        st.tuples(st.just("delivered")),
        st.tuples(st.just("forgotten")),
        st.tuples(st.just("give up")),
        st.tuples(st.just("receive"), _ANSWERS),
        st.tuples(st.just("receive"), _ANSWERS),
        st.tuples(st.just("receive"), _ANSWERS),
    ),
    max_size=30,
)


@settings(max_examples=250, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(_CLIENT_STEPS)
def test_the_clients_one_look_at_a_done_is_the_general_rules_answer_in_every_state(steps):
    """Attack: a client exchange driven through any sequence of sends and answers (a Done
    for another ref, for a work already answered, while greeting, after a refusal, after a
    give-up...), twice: once as it is, once with every Done of a class the one-look path does
    not take. What each step gives or raises, and the exchange's state after it, are the
    same."""
    fast, slow = ClientExchange(), ClientExchange()
    for step in steps:
        kind = step[0]
        if kind == "receive":
            a = _outcome_of(lambda: fast.receive(step[1]))
            b = _outcome_of(lambda: slow.receive(_slow(step[1])))
        else:
            act = {
                "hello": "hello_sent",
                "work": "work_sent",
                "delivered": "work_delivered",
                "forgotten": "forgotten",
                "give up": "give_up",
            }[kind]
            a = _outcome_of(lambda ex=fast: getattr(ex, act)(*step[1:]))
            b = _outcome_of(lambda ex=slow: getattr(ex, act)(*step[1:]))
        assert a == b, (step, a, b)
        assert _client_state(fast) == _client_state(slow), step


_DIGEST_NEVER = "sha256:" + "0" * 64


def _recipes():
    made = []
    for n in (1, 2):
        specs = (Packer("project").spec(Add(n).named(f"add{n}").cached().steps[0]),)
        made.append(Recipe(specs, ("step", 0)))
    return made


_RECIPES = _recipes()


_DIGESTS = [recipe_digest(r).digest for r in _RECIPES] + [_DIGEST_NEVER]


_PEERS = st.sampled_from([b"p", b"q", b"r"])


_WORKER_STEPS = st.lists(
    st.one_of(
        st.tuples(st.just("hello"), _PEERS),
        st.tuples(st.just("bye"), _PEERS),
        st.tuples(st.just("full"), _PEERS, _REFS, st.sampled_from([0, 1])),
        st.tuples(
            st.just("digest"),
            _PEERS,
            _REFS,
            st.sampled_from([0, 1, 2]),
            st.sampled_from(["plain", "keys fit", "keys do not fit", "placed", "misplaced"]),
        ),
        st.tuples(st.just("digest"), _PEERS, _REFS, st.sampled_from([0, 1, 2]), st.just("plain")),
        st.tuples(
            st.just("answer"),
            _PEERS,
            _REFS,
            st.sampled_from(["done", "failed", "send", "refusal", "saw"]),
            st.booleans(),
        ),
        st.tuples(st.just("answer"), _PEERS, _REFS, st.just("done"), st.just(False)),
    ),
    max_size=40,
)


def _worker_state(sessions: WorkerSessions):
    return (
        sessions.refused,
        sessions._bytes,
        [
            (peer, s.tenant, s.cost, sorted(s.open), list(s.recipes), sorted(s.streams))
            for peer, s in sessions._sessions.items()
        ],
    )


@settings(max_examples=250, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(_WORKER_STEPS)
def test_the_workers_one_look_paths_are_the_general_rules_in_every_state(steps):
    """Attack: a worker's sessions driven through any sequence of Hellos, Byes, Works in full
    or by digest (a digest held, another peer's, never sent; keys and placement that fit or
    not; a ref still open), and answers (a Done for a work open, answered already, of a peer
    gone...), twice, on small bounds so that peers and recipes are forgotten to make room.
    One copy takes the express way in (``recall``, then ``receive`` when it declines, as the
    loop does) and its Dones the one-look path; the other only the general rules. What each
    step gives or raises and everything the sessions hold after it are the same."""
    bounds = {"max_peers": 2, "max_recipes": 1, "max_bytes": 1 << 20}
    fast, slow = WorkerSessions(RT, **bounds), WorkerSessions(RT, **bounds)
    for step in steps:
        kind, peer = step[0], step[1]
        if kind == "hello":
            msg = Hello(RT)
            a, b = (_outcome_of(lambda s=s: s.receive(peer, msg, now=0.0)) for s in (fast, slow))
        elif kind == "bye":
            a, b = (_outcome_of(lambda s=s: s.receive(peer, Bye(), now=0.0)) for s in (fast, slow))
        elif kind == "full":
            msg = Work(step[2], _RECIPES[step[3]], 0, watched=False)
            a, b = (_outcome_of(lambda s=s: s.receive(peer, msg, now=0.0)) for s in (fast, slow))
        elif kind == "digest":
            extra = {
                "plain": {},
                "keys fit": {"keys": {0: "sha256:" + "1" * 64}},
                "keys do not fit": {"keys": {4: "sha256:" + "1" * 64}},
                "placed": {"placement": {0: "cpu"}},
                "misplaced": {"placement": {3: "cpu"}},
            }[step[4]]
            msg = Work(step[2], None, 0, watched=False, recipe_digest=_DIGESTS[step[3]], **extra)

            def express(s=fast, msg=msg):
                opened = s.recall(peer, msg, now=0.0)
                return opened if opened is not None else s.receive(peer, msg, now=0.0)

            a, b = _outcome_of(express), _outcome_of(lambda: slow.receive(peer, msg, now=0.0))
        else:
            ref, what, refusing = step[2], step[3], step[4]
            answer = {
                "done": Done(ref, 1, {}, 1),
                "failed": Failed(ref, "no", "a", "E", ""),
                "send": Send(ref, ("sha256:" + "b" * 64,)),
                "refusal": Refusal("no", ref=ref),
                "saw": Saw(ref, {"event": "ran"}),
            }[what]
            a = ("gave", fast.answering(peer, answer, refusing=refusing))
            b = ("gave", slow.answering(peer, _slow(answer), refusing=refusing))
        assert a == b, (step, a, b)
        assert _worker_state(fast) == _worker_state(slow), step
