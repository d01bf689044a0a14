"""The hostile-peer harness (issue 38): one helper that plays every role of the fabric
against the real sides, with real ZeroMQ sockets and the CURVE keys the real side asks for.

What it plays, against which real process (``ROLES``):

- ``client`` — an allowed client key speaking to a real broker, bare messages;
- ``relayed client`` — the same key, its message in ``Relay(host=w1)``: through the real
  broker to a real worker that dialed in;
- ``peer`` — an allowed client key speaking to a real listening worker;
- ``dialed worker`` — a key in the broker's ``--allow-workers``, bare messages to the broker;
- ``dialed worker, in an exchange`` — the same, its message in ``Relay(exchange=n)``, where
  ``n`` is an exchange a client of the harness opened to it (or one it made up);
- ``broker`` — a broker played by hand that a real worker dials (``--broker-key`` is its
  key), bare messages to the worker;
- ``broker, in an exchange`` — the same, its message in ``Relay(exchange=n, tenant)``.

Every message kind of the wire is in ``KINDS``, read from ``wire.messages.VARIANTS``; its
one message is made by ``sample`` from the dataclass's own fields (a new kind is covered by
being added to the wire; one whose fields ``sample`` cannot fill fails
``test_the_harness_makes_every_message_of_the_wire``, naming what to add to ``FIELDS``).
``malformed`` makes each kind's frames truncated, declaring more than they hold, or with
fields of the wrong type. Every conversation is driven to one of ``STATES`` first.

Nothing here waits on a sleep: after the message under test, each role sends a probe its
side always answers (``Where`` of a made-up host to a broker, whose refusal names it; a
``Work`` with a ref of its own to a worker), and what arrived before the probe's answer is
the side's answer to the message. Every receive has a timeout, every socket lingers 0.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import typing
from pathlib import Path

import msgpack
import zmq
from conftest import BROKER, WORKER, Process, env_with_tests
from fabric_nodes import Add
from holds_nodes import Hold
from peers import Raw
from reliability_support import key_ring, rss_kib, wait_until

from somatize import Broker, Worker
from somatize.errors import Busy, ProtocolError
from somatize.fabric.curve import Keys, make_pair, read_public, read_secret
from somatize.fabric.worker.pacing import WAITING_BYTES
from somatize.packing import Packer
from somatize.wire import Hello, Recipe, Refusal, Relay, Runtime, Where, Work, decode, encode, messages

RT = Runtime.here(mode="project")

# -- every message of the wire -------------------------------------------------------------

#: Every message kind of the wire, by the name its header's ``t`` gives it.
KINDS: tuple[str, ...] = tuple(messages.VARIANTS)
#: The conversation's states a message is sent in (docs/conversation.md): nothing said yet;
#: Hello answered; a Work of the harness running; that Work answered and the exchange ended
#: with ``Bye``.
STATES = ("before Hello", "after Hello", "exchange open", "after it ended")
#: The ref of every sampled Work, and the first of the probes' (never the same).
SAMPLE_REF, OPEN_REF = 1, 7
_probes = itertools.count(1 << 40)
_cases = itertools.count(1)


def add_recipe() -> Recipe:
    return Recipe((Packer("project").spec(Add(1).named("a").steps[0]),), ("step", 0))


def hold_recipe(folder: Path) -> Recipe:
    node = Hold(str(folder / "started"), str(folder / "release"), str(folder / "finished")).named("hold")
    return Recipe((Packer("project").spec(node.steps[0]),), ("step", 0))


#: Field values ``sample`` cannot tell from a field's type: a pattern the wire holds it to,
#: or a carrier's cargo. Keyed by field name, or by (kind, field) where one kind differs.
FIELDS: dict = {
    "host": "w1",
    "digest": "sha256:" + "ab" * 32,
    "digests": ("sha256:" + "ab" * 32,),
    "sizes": (16,),
    "files": ("0123456789abcdef0123456789abcdef-0",),
    ("Located", "path"): "relayed",
    ("Relay", "inner"): lambda: tuple(encode(Hello(RT))),
    ("Mounted", "header"): lambda: bytes(encode(Work(SAMPLE_REF, add_recipe(), 1))[0]),
    ("Work", "recipe"): add_recipe,
    ("Work", "input"): 1,
    ("Saw", "fact"): {"fact": "ran", "node": "a"},
}


def _of_type(hint, where: str):
    """A value of the type ``hint``: the simplest the wire takes."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is int:
        return SAMPLE_REF
    if hint is str:
        return "h1"
    if hint is bool:
        return False
    if hint is typing.Any:
        return 1
    if hint is Runtime:
        return RT
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        if type(None) in args:
            return None
        return _of_type(args[0], where)  # bytes | memoryview: bytes
    if hint is bytes:
        return b"sixteen bytes!!!"
    if origin in (tuple, dict, list):
        return origin()
    raise LookupError(f"hostile.sample cannot make `{where}` ({hint}): add it to hostile.FIELDS")


def sample(kind: str, **given):
    """The message of ``kind`` the harness sends: each field ``given``, or in ``FIELDS``, or
    left at its default, or the simplest value of its type."""
    cls = messages.VARIANTS[kind]
    hints = typing.get_type_hints(cls, vars(messages))
    fields = {}
    for f in dataclasses.fields(cls):
        if f.name in given:
            fields[f.name] = given[f.name]
            continue
        made = FIELDS.get((kind, f.name), FIELDS.get(f.name, dataclasses.MISSING))
        if made is dataclasses.MISSING and (
            f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        ):
            continue
        if made is dataclasses.MISSING:
            made = _of_type(hints[f.name], f"{kind}.{f.name}")
        fields[f.name] = made() if callable(made) else made
    return cls(**fields)


def frames_of(message) -> list[bytes]:
    return [bytes(memoryview(f)) for f in encode(message)]


#: How each kind's frames are spoilt (the header is frame 0).
MALFORMED = ("truncated", "oversize", "wrong types")


def malformed(kind: str, how: str) -> list[bytes]:
    """``kind``'s frames spoilt ``how``: the header cut in half; a header declaring a map of
    2**32 - 1 entries and a frame of 4 GiB (more than it holds, more than any limit); or
    every field but ``v`` and ``t`` of the wrong type (a number where text is, text
    elsewhere; a field it has not, for a kind with none), so the kind is still told and
    the fields refused."""
    frames = frames_of(sample(kind))
    head = frames[0]
    if how == "truncated":
        return [head[: len(head) // 2], *frames[1:]]
    if how == "oversize":
        return [b"\xdf\xff\xff\xff\xff" + head[1:], b"\xc6\xff\xff\xff\xff" + b"\x00" * 8, *frames[1:]]
    header = msgpack.unpackb(head, raw=False, strict_map_key=False)
    spoilt = {k: (v if k in ("v", "t") else (7 if isinstance(v, str) else "seven")) for k, v in header.items()}
    if len(spoilt) == 2:  # a kind with no fields: one it has not, which the wire refuses as well
        spoilt["ref"] = "seven"
    return [msgpack.packb(spoilt, use_bin_type=True), *frames[1:]]


def read(frames) -> object:
    """A received message, decoded; frames that are none: ("undecodable", frames)."""
    try:
        return decode(frames)
    except ProtocolError:
        return ("undecodable", [bytes(memoryview(f)) for f in frames])


def name_of(answer) -> str:
    """An answer's kind; ``""`` for none. A bare message from a dialing worker (("bare", m))
    is named by its kind."""
    if answer is None:
        return ""
    if isinstance(answer, tuple):
        return type(answer[1]).__name__ if answer[0] == "bare" else "undecodable"
    return type(answer).__name__


# -- the real sides -------------------------------------------------------------------------

PATIENCE = "2"


class Sides:
    """The real processes, started once per module and always reaped: a keyed broker; ``w1``,
    a keyed worker dialed in to it; ``lw``, a keyed listening worker; ``fb1``, a keyed worker
    dialing a broker the harness plays (``fake``). Each runs 4 jobs, so a held Work leaves
    room. ``keys`` holds every key pair: alice (the attacker's client key), bob (the honest
    tenant's), evil (the attacker's worker key), good (the honest workers' key)."""

    def __init__(self, folder: Path, *, broker_args: tuple = (), worker_args: tuple = ()) -> None:
        self.folder = folder
        (folder / "ring").mkdir()
        self.keys = key_ring(folder / "ring", clients=("alice", "bob"), workers=("good", "evil"))
        self.keys["lw"], self.keys["lw_secret"] = make_pair(folder / "ring" / "keys", "lw")
        self.keys["fake"], self.keys["fake_secret"] = make_pair(folder / "ring" / "keys", "fake")
        self.logs = folder / "logs"
        self.processes: dict[str, Process] = {}
        self.fake = FakeBroker(self.keys)
        try:
            self._start(broker_args, worker_args)
        except BaseException:
            self.stop()
            raise

    def _start(self, broker_args: tuple, worker_args: tuple) -> None:
        k, env = self.keys, env_with_tests()
        self.processes["broker"] = broker = Process(
            [
                *BROKER,
                "--listen",
                "tcp://127.0.0.1:0",
                "--announce",
                "--key",
                str(k["broker_secret"]),
                "--allow",
                str(k["allow"]),
                "--allow-workers",
                str(k["workers"]),
                "--patience",
                PATIENCE,
                *broker_args,
            ],
            logs=self.logs,
            env=env,
        )
        dialed = ["--key", str(k["good_secret"]), "--patience", PATIENCE, "--jobs", "4", *worker_args]
        self.processes["w1"] = Process(
            [*WORKER, "--broker", broker.endpoint, "--offer", "w1", "--broker-key", str(k["broker"]), *dialed],
            logs=self.logs,
            env=env,
            announce=None,
        )
        self.processes["lw"] = Process(
            [
                *WORKER,
                "--listen",
                "127.0.0.1:0",
                "--announce",
                "--key",
                str(k["lw_secret"]),
                "--allow",
                str(k["allow"]),
                "--jobs",
                "4",
                *worker_args,
            ],
            logs=self.logs,
            env=env,
        )
        self.processes["fb1"] = Process(
            [*WORKER, "--broker", self.fake.endpoint, "--offer", "fb1", "--broker-key", str(k["fake"]), *dialed],
            logs=self.logs,
            env=env,
            announce=None,
        )
        self.fake.accept()
        self.honest = Honest(self)
        wait_until(lambda: self.honest.via_broker.knows("w1"), 30, "w1 dialing in to the broker")

    def client_keys(self, who: str, server: str = "broker") -> tuple[bytes, bytes, bytes]:
        public, secret = read_secret(self.keys[who + "_secret"])
        return public, secret, read_public(self.keys[server])

    def stop(self) -> None:
        honest = getattr(self, "honest", None)
        if honest is not None:
            honest.close()
        for process in reversed(list(self.processes.values())):
            process.stop()
        self.fake.close()


class FakeBroker:
    """A broker played by hand: a CURVE ROUTER with the ``fake`` key pair, which a real
    worker dials. ``route`` is that worker's, learnt from its first Hello; the worker's own
    Hellos (its keepalives) are answered Ready and never taken for an answer."""

    def __init__(self, keys: dict) -> None:
        public, secret = read_secret(keys["fake_secret"])
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.linger = 0
        self.sock.curve_server, self.sock.curve_secretkey, self.sock.curve_publickey = True, secret, public
        self.sock.bind("tcp://127.0.0.1:0")
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.route = b""
        self.offer = None  # the host the worker offers, learnt from its first Hello
        self.numbers = itertools.count(1000)

    def accept(self, timeout: float = 30.0) -> None:
        """Wait for the worker's offer, and take it."""
        assert self.sock.poll(int(timeout * 1000)), "the worker never dialed the played broker"
        self.route, *frames = self.sock.recv_multipart()
        hello = read(frames)
        assert isinstance(hello, Hello), hello
        self.offer = hello.offering
        self.send(frames_of(messages.Ready(RT)))

    def send(self, frames: list) -> None:
        self.sock.send_multipart([self.route, *frames])

    def relay(self, exchange: int, frames: list, tenant: str = "harness") -> None:
        self.send(frames_of(Relay(exchange=exchange, tenant=tenant, inner=tuple(frames))))

    def next(self, timeout: float = 15.0):
        """The worker's next message that is not its own Hello (answered Ready), or None."""
        while self.sock.poll(int(timeout * 1000)):
            route, *frames = self.sock.recv_multipart()
            message = read(frames)
            if isinstance(message, Hello):
                self.route = route
                self.send(frames_of(messages.Ready(RT)))
                continue
            if isinstance(message, Where) and message.host == self.offer:
                # the worker's pacing mark (fabric/worker/pacing.py): answered Located, as a
                # broker does once it read what came before it, never taken for an answer
                self.send(frames_of(messages.Located(message.host, "relayed", self.endpoint, "project")))
                continue
            return message
        return None

    def close(self) -> None:
        self.sock.close(0)


class Honest:
    """The honest tenant beside every attack, with a key of its own (bob): a small forward
    to each side, asked before and after each hostile case and during each flood."""

    def __init__(self, sides: Sides) -> None:
        self.sides = sides
        k = sides.keys
        self.via_broker = Broker.at(
            sides.processes["broker"].endpoint,
            patience=float(PATIENCE),
            keys=Keys.client(k["bob_secret"], server=k["broker"]),
        )
        lw_keys = Keys.client(k["bob_secret"], server=k["lw"])
        self.to_lw = Broker.embedded(
            {"lw": Worker.at(sides.processes["lw"].endpoint, mode="project", keys=lw_keys)}, patience=float(PATIENCE)
        )
        self.exchange = next(sides.fake.numbers)
        self.graph = Add(1).named("a")
        self.busy = 0  # the forwards answered Busy, where that counts as an answer

    def answers(self, side: str, x: int = 41, *, busy: bool = False) -> bool:
        """Whether the honest tenant's forward through ``side`` answers, rightly. ``busy``:
        ``Busy`` (every job of the worker taken, at once) counts as an answer: an allowed
        client may keep a worker's jobs busy (docs/security.md), as a flood of Works does."""
        try:
            return self._forward(side, x)
        except Busy:
            if not busy:
                raise
            self.busy += 1
            return True

    def _forward(self, side: str, x: int) -> bool:
        if side == "broker":  # through the broker to w1: the broker and the dialed worker
            return self.graph.at("w1").forward(x, broker=self.via_broker) == x + 1
        if side == "lw":
            return self.graph.at("lw").forward(x, broker=self.to_lw) == x + 1
        fake = self.sides.fake  # an exchange of its own through the played broker, to fb1
        fake.relay(self.exchange, frames_of(Hello(RT)), tenant="bob")
        fake.relay(self.exchange, frames_of(Work(next(_probes), add_recipe(), x)), tenant="bob")
        got = []
        while len(got) < 2:
            answer = fake.next(15.0)
            if answer is None:
                return False
            if isinstance(answer, Relay) and answer.exchange == self.exchange:
                got.append(read(list(answer.inner)))
        if type(got[1]) is Refusal and got[1].why.startswith("busy"):
            raise Busy(got[1].why)
        return type(got[0]).__name__ == "Ready" and getattr(got[1], "output", None) == x + 1

    def close(self) -> None:
        self.via_broker.close()
        self.to_lw.close()


# -- the roles ----------------------------------------------------------------------------


class Played:
    """One role in one case: the conversation driven to a state, a message sent, and what
    came back for it. ``answers`` are the side's to the role; ``delivered`` what reached the
    harness's client on the other side (the dialed-worker roles), when there is one."""

    def __init__(self, sides: Sides, role: str, state: str) -> None:
        self.sides, self.role, self.state = sides, role, state
        self.case = sides.folder / f"case-{next(_cases)}"
        self.case.mkdir()
        self.raw: Raw | None = None
        self.client: Raw | None = None  # the harness's client of a hostile worker's exchange
        self.exchange = 0
        spec = ROLES[role]
        self.side = spec["side"]
        getattr(self, "_" + spec["setup"])()

    # every setup drives its conversation to self.state
    def _broker_client(self) -> None:
        self.raw = Raw(self.sides.processes["broker"].endpoint, self.sides.client_keys("alice"))
        if self.state != "before Hello":
            assert name_of(self.raw.ask(Hello(RT))) == "Ready"
        if self.state in ("exchange open", "after it ended"):
            self._worker_states(lambda frames: self.raw.send_frames(relay_to("w1", frames)), self.raw.answer)

    def _relayed_client(self) -> None:
        self.raw = Raw(self.sides.processes["broker"].endpoint, self.sides.client_keys("alice"))
        self._worker_states(lambda frames: self.raw.send_frames(relay_to("w1", frames)), self.raw.answer)

    def _peer(self) -> None:
        self.raw = Raw(self.sides.processes["lw"].endpoint, self.sides.client_keys("alice", "lw"))
        self._worker_states(self.raw.send_frames, self.raw.answer)

    def _fake_broker(self) -> None:
        fake = self.sides.fake
        self.exchange = next(fake.numbers)

        def answer(timeout: float = 15.0):
            while True:
                got = fake.next(timeout)
                if got is None or (isinstance(got, Relay) and got.exchange == self.exchange):
                    return None if got is None else read(list(got.inner))

        self._worker_states(lambda frames: fake.relay(self.exchange, frames), answer)

    def _hostile_worker(self) -> None:
        broker = self.sides.processes["broker"].endpoint
        self.raw = Raw(broker, self.sides.client_keys("evil"))
        self.host = f"evil{next(_cases)}"
        self.exchange = 1 + (next(_probes) % 1000)  # a number it made up, until it is given one
        if self.state == "before Hello":
            return
        self.raw.send(Hello(RT, offering=self.host))
        self._until_probe(self.raw)  # taken: Ready, then the probe's answer
        if self.state == "after Hello":
            return
        self.client = Raw(broker, self.sides.client_keys("alice"))
        self.client.send_frames(relay_to(self.host, frames_of(Work(OPEN_REF, add_recipe(), 1))))
        got = self.raw.answer()
        assert isinstance(got, Relay) and got.exchange, got
        self.exchange = got.exchange
        if self.state == "after it ended":
            self.client.send_frames(relay_to(self.host, frames_of(messages.Bye())))
            got = self.raw.answer()
            assert isinstance(got, Relay) and name_of(read(list(got.inner))) == "Bye", got

    def _worker_states(self, send, answer) -> None:
        """Drive a worker's session (direct, relayed or in an exchange of the played broker)."""
        if self.state == "before Hello":
            return
        send(frames_of(Hello(RT)))
        assert name_of(answer()) == "Ready"
        if self.state == "exchange open":
            send(frames_of(Work(OPEN_REF, hold_recipe(self.case), 1, watched=False)))
            wait_until((self.case / "started").exists, 30, "the held work starting")
        elif self.state == "after it ended":
            send(frames_of(Work(OPEN_REF, add_recipe(), 1, watched=False)))
            assert name_of(answer()) == "Done"
            send(frames_of(messages.Bye()))

    # sending, and what came back
    def outgoing(self, frames: list) -> tuple[zmq.Socket, list]:
        """The socket this role sends on, and ``frames`` as it sends them there (in its
        envelope; with the route in front, from the played broker's ROUTER)."""
        how = ROLES[self.role]["send"]
        fake = self.sides.fake
        if how == "bare":
            return self.raw.sock, list(frames)
        if how == "relay to w1":
            return self.raw.sock, relay_to("w1", frames)
        if how == "in its exchange":
            return self.raw.sock, frames_of(Relay(exchange=self.exchange, inner=tuple(frames)))
        if how == "fake bare":
            return fake.sock, [fake.route, *frames]
        return fake.sock, [fake.route, *frames_of(Relay(exchange=self.exchange, tenant="harness", inner=tuple(frames)))]

    def send(self, frames: list) -> None:
        sock, out = self.outgoing(frames)
        sock.send_multipart(out)

    def answers(self, *, until=None, timeout: float = 15.0) -> list:
        """What came back for the message sent, up to the probe's answer; with ``until`` (a
        test of one answer), and on until an answer it holds for: one that comes back later
        than the probe's (a Work answered on a job thread, a worker's answer relayed by the
        broker while the broker answered the probe itself). Fails if the probe is never
        answered: the side stopped serving."""
        how = ROLES[self.role]["send"]
        if how in ("bare", "in its exchange") and self.side == "broker":
            got = self._until_probe(self.raw, timeout)
        elif how == "bare":  # a listening worker's peer
            got = self._until_work_probe(self.raw.send_frames, lambda t: _next(self.raw, t), timeout)
        elif how == "relay to w1":
            got = self._until_work_probe(
                lambda f: self.raw.send_frames(relay_to("w1", f)), lambda t: _next(self.raw, t), timeout
            )
        else:
            got = self._until_work_probe(lambda f: self.sides.fake.relay(self.exchange, f), self._from_fake, timeout)
        if until is not None and not any(until(a) for a in got):
            more = self._from_fake if how.startswith("fake") else (lambda t: _next(self.raw, t))
            while True:
                answer = more(timeout)
                assert answer is not None, f"nothing more came, and nothing of {got} was the answer awaited"
                got.append(answer)
                if until(answer):
                    break
        return got

    def _from_fake(self, timeout: float):
        """The next message of this case's exchange from the worker, or of bare ones, in
        the form it came (a bare one: ("bare", message))."""
        got = self.sides.fake.next(timeout)
        if isinstance(got, Relay):
            if got.exchange != self.exchange:
                return self._from_fake(timeout)
            return read(list(got.inner))
        return got if got is None else ("bare", got)

    def _until_work_probe(self, send, receive, timeout: float) -> list:
        ref = next(_probes)
        send(frames_of(Work(ref, add_recipe(), 0, watched=False)))
        got = []
        while True:
            answer = receive(timeout)
            assert answer is not None, f"the side stopped answering (its probe went unanswered): {got}"
            if getattr(answer, "ref", None) == ref:
                return got
            got.append(answer)

    @staticmethod
    def _until_probe(raw: Raw, timeout: float = 15.0) -> list:
        token = f"probe{next(_probes)}"
        raw.send(Where(token))
        got = []
        while True:
            answer = _next(raw, timeout)
            assert answer is not None, f"the broker stopped answering (its probe went unanswered): {got}"
            if isinstance(answer, Refusal) and f"`{token}`" in answer.why:
                return got
            got.append(answer)

    def delivered(self, timeout: float = 15.0) -> list:
        """What reached the harness's client of the hostile worker's exchange, up to its own probe."""
        return [] if self.client is None else self._until_probe(self.client, timeout)

    def close(self) -> None:
        (self.case / "release").write_text("go")
        for raw in (self.raw, self.client):
            if raw is not None:
                if self.side == "broker":  # closing, as a client does: its connection no longer counts
                    with contextlib.suppress(zmq.Again):  # (a flooded queue with no room: it goes without)
                        raw.sock.send_multipart(frames_of(messages.Bye()), zmq.NOBLOCK)
                raw.sock.close(200)  # a short linger: the Bye leaves


def _next(raw: Raw, timeout: float):
    """The next message on ``raw``, decoded (or ("undecodable", frames)), or None."""
    if not raw.sock.poll(int(timeout * 1000)):
        return None
    return read(raw.sock.recv_multipart())


def relay_to(host: str, frames: list) -> list[bytes]:
    """``frames`` in a client's Relay to ``host``, its cargo as it is (junk too: a Relay's
    cargo is never looked inside by ``encode``)."""
    return frames_of(Relay(host=host, inner=tuple(frames)))


#: Each role: the side it attacks (whose bounds and honest tenant are watched), how it gets
#: to a state, and how it sends the message under test.
ROLES: dict[str, dict[str, str]] = {
    "client": {"side": "broker", "setup": "broker_client", "send": "bare"},
    "relayed client": {"side": "broker", "setup": "relayed_client", "send": "relay to w1"},
    "peer": {"side": "lw", "setup": "peer", "send": "bare"},
    "dialed worker": {"side": "broker", "setup": "hostile_worker", "send": "bare"},
    "dialed worker, in an exchange": {"side": "broker", "setup": "hostile_worker", "send": "in its exchange"},
    "broker": {"side": "fb1", "setup": "fake_broker", "send": "fake bare"},
    "broker, in an exchange": {"side": "fb1", "setup": "fake_broker", "send": "fake exchange"},
}


# -- the bounds held around every hostile case -----------------------------------------------

#: MiB a side's resident memory may grow past what it had once it first served: its queues
#: for one peer (64 MiB, docs/conversation.md) and the interpreter's own arenas for what the
#: harness sends, which is never more than a few MiB a case. Anything past it is a leak or a
#: queue no bound holds.
RSS_MIB = 128
#: A dialed worker's own bound is larger: the answers it holds for a broker that does not
#: read, across a lost connection too, are bounded by all of them together (``WAITING_BYTES``,
#: docs/conversation.md), and what was freed of them need not go back to the system.
DIALED_RSS_MIB = (WAITING_BYTES >> 20) + 64
#: The sides that are dialed workers (the broker's own w1, the fake broker's fb1).
DIALED = frozenset({"w1", "fb1"})
#: Descriptors a side may hold past its start: one a connection the harness has open at once
#: (a case uses at most three), ZeroMQ's own (its I/O thread's pipes, the monitor socket),
#: and the ones of connections closed but not yet seen closed. A leak grows without end.
FDS = 32
#: Threads a side may run past its start: its jobs (4), a helper a check or a start runs
#: on, ZeroMQ's. A thread per peer or per message would pass it at once.
THREADS = 12


class Watched:
    """One real process's memory, descriptors and threads, read from /proc."""

    def __init__(self, name: str, process: Process, rss_mib: int = RSS_MIB) -> None:
        self.name, self.process, self.rss_mib = name, process, rss_mib
        self.rss, self.fds, self.threads = self.now()

    def now(self) -> tuple[int, int, int]:
        pid = self.process.pid
        return (rss_kib(pid) // 1024, len(os.listdir(f"/proc/{pid}/fd")), len(os.listdir(f"/proc/{pid}/task")))

    def within(self) -> str:
        """``""`` when alive and within bounds, else what is not."""
        if not self.process.alive:
            return f"{self.name} died (exit {self.process.popen.returncode}): {self.process.stderr()[-800:]}"
        rss, fds, threads = self.now()
        over = [
            f"{what} {now} (started with {was}, bound +{bound})"
            for what, now, was, bound in (
                ("RSS MiB", rss, self.rss, self.rss_mib),
                ("descriptors", fds, self.fds, FDS),
                ("threads", threads, self.threads, THREADS),
            )
            if now > was + bound
        ]
        return f"{self.name}: " + ", ".join(over) if over else ""


class Bounds:
    """What every hostile case must leave as it found it: each side alive, within its bounds,
    and the honest tenant's forward through each side answered."""

    def __init__(self, sides: Sides) -> None:
        self.sides = sides
        self.watched = [
            Watched(name, process, DIALED_RSS_MIB if name in DIALED else RSS_MIB)
            for name, process in sides.processes.items()
        ]

    def hold(self, seconds: float = 10.0) -> None:
        """Assert the bounds; a descriptor or a thread let go a moment late is waited for."""
        with contextlib.suppress(AssertionError):  # said below, with what is over
            wait_until(lambda: not any(w.within() for w in self.watched), seconds, "the sides within bounds")
        faults = [said for w in self.watched if (said := w.within())]
        assert not faults, "; ".join(faults)
        for side in ("broker", "lw", "fb1"):  # Busy: a job of the attack's, still ending: again
            wait_until(lambda: self._answered(side), 30, f"the honest tenant's forward through {side} answering")

    def _answered(self, side: str) -> bool:
        try:
            return self.sides.honest.answers(side)
        except Busy:
            return False


@contextlib.contextmanager
def bounded(sides: Sides):
    """Around one hostile case: the bounds hold before it and after it."""
    bounds = getattr(sides, "bounds", None)
    if bounds is None:
        bounds = sides.bounds = Bounds(sides)
    bounds.hold()
    yield bounds
    bounds.hold()
