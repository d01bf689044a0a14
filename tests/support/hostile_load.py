"""The hostile-peer harness under load (issue 38): floods, peers that never read, and real
processes stopped with SIGSTOP and resumed, played by the roles of :mod:`hostile` against
sides started for the one test (a side a flood grew must not be the next test's).

Every flood is bounded in count and in time and sends from this one thread, in batches:
between two batches the honest tenant forwards through the side (it must answer) and the
side's resident memory is read. Nothing waits on a sleep but the stop itself.
"""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass, field

import hostile
import numpy as np
import zmq
from holds_nodes import Big, Hold
from hostile import KINDS, RSS_MIB, Played, Sides, Watched, frames_of, sample
from peers import within
from reliability_support import rss_kib

from somatize import Broker
from somatize.fabric.curve import Keys
from somatize.packing import Packer
from somatize.wire import Done, Recipe, Work

#: A flood's bounds: at most this many messages, for at most this many seconds, from this
#: many connections (exchanges, for the played broker, which has one), in batches this big.
FLOOD_MESSAGES, FLOOD_SECONDS, FLOOD_CONNECTIONS, FLOOD_BATCH = 1_000_000, 6.0, 8, 4_000
#: The longest the honest tenant's forward may take beside a flood, or once a stopped side
#: is resumed: a liveness bound for a busy machine, not a speed.
ANSWERED_WITHIN = 15.0
#: How many big answers a peer that never reads asks for, and how big each is: together
#: six times what docs/conversation.md says the broker queues for one peer (64 MiB).
UNREAD_ANSWERS, UNREAD_SIZE = 24, 16 << 20
#: How long the side is watched beside that peer: the answers are made within a second.
UNREAD_SECONDS = 3.0
#: MiB a side may grow by beside a peer that never reads: what docs/conversation.md says is
#: queued for one peer (64 MiB), and per job an answer being made and one being sent.
UNREAD_MIB = 64 + 4 * 2 * (UNREAD_SIZE >> 20)
#: How soon a client must hear ``Broken`` of a dialed worker stopped under its work: two
#: patiences and the probe (docs/across-machines.md, issue 38), with room for a busy machine.
STOPPED_NOTICED = 2 * float(hostile.PATIENCE) + 6.0

#: The process whose memory each role's flood is watched on: the side it attacks.
WATCHED = {
    "client": ("broker",),
    "relayed client": ("broker", "w1"),
    "peer": ("lw",),
    "dialed worker, in an exchange": ("broker",),
    "broker, in an exchange": ("fb1",),
}


@dataclass
class Load:
    """What a flood or a never-reading peer did: messages sent, the honest tenant's slowest
    forward meanwhile (seconds), and each watched process's growth past its start (MiB)."""

    sent: int = 0
    slowest: float = 0.0
    grew: dict[str, int] = field(default_factory=dict)

    bound: int = RSS_MIB

    def within(self) -> str:
        over = [f"{name} grew by {mib} MiB (bound {self.bound})" for name, mib in self.grew.items() if mib > self.bound]
        return "; ".join(over)


def _honest(sides: Sides, side: str, load: Load) -> None:
    started = time.monotonic()
    assert within(ANSWERED_WITHIN, lambda: sides.honest.answers(side, busy=True)), (
        f"the honest forward through {side} was wrong"
    )
    load.slowest = max(load.slowest, time.monotonic() - started)


def _grew(watched: list[Watched], load: Load) -> None:
    for w in watched:
        if w.process.alive:
            load.grew[w.name] = max(load.grew.get(w.name, 0), rss_kib(w.process.pid, "VmHWM") // 1024 - w.rss)


def flood(sides: Sides, role: str, kinds: tuple[str, ...] = KINDS) -> Load:
    """``FLOOD_CONNECTIONS`` conversations of ``role``, each past its Hello, send ``kinds``
    (every kind of the wire) round and round, reading nothing, within the flood's bounds. Between batches
    the honest tenant forwards through the side (unless the side is the played broker's,
    whose one socket the flood holds) and the side's memory is read."""
    watched = [Watched(name, sides.processes[name]) for name in WATCHED[role]]
    played = [Played(sides, role, "after Hello") for _ in range(FLOOD_CONNECTIONS)]
    load = Load()
    try:
        mix = [p.outgoing(frames_of(sample(kind))) for p in played for kind in kinds if kind != "Bye"]
        if "Bye" in kinds:  # a Bye ends nothing open (after the first): it opens nothing, and costs a read
            mix += [p.outgoing(frames_of(sample("Bye"))) for p in played]
        until = time.monotonic() + FLOOD_SECONDS
        side = hostile.ROLES[role]["side"]
        at, sockets = 0, {sock for sock, _ in mix}
        while load.sent < FLOOD_MESSAGES and time.monotonic() < until:
            full: set = set()  # a connection with no room (the side reads no faster, or cut it): skipped a batch
            for _ in range(FLOOD_BATCH):
                sock, frames = mix[at % len(mix)]
                at += 1
                if sock in full:
                    continue
                try:
                    sock.send_multipart(frames, zmq.NOBLOCK)
                    load.sent += 1
                except zmq.Again:
                    full.add(sock)
            if len(full) == len(sockets):
                full.pop().poll(50, zmq.POLLOUT)  # none had room: a moment for one
            assert all(w.process.alive for w in watched), [w.within() for w in watched]
            _grew(watched, load)
            if side != "fb1":
                _honest(sides, side, load)
    finally:
        for p in played:
            p.close()
    _grew(watched, load)
    return load


def never_reading(sides: Sides, role: str) -> Load:
    """A peer of ``role`` that asks for ``UNREAD_ANSWERS`` answers of ``UNREAD_SIZE`` bytes
    and reads none: its socket takes one message and a few KiB at most. As the hostile
    dialed worker, it answers that much itself, into an exchange whose client never reads.
    The side's memory is read while the honest tenant forwards beside it."""
    watched = [Watched(name, sides.processes[name]) for name in WATCHED[role]]
    load = Load(bound=UNREAD_MIB)
    big = Recipe((Packer("project").spec(Big(UNREAD_SIZE).named("big").steps[0]),), ("step", 0))
    played = Played(sides, role, "exchange open" if role == "dialed worker, in an exchange" else "after Hello")
    reader = played.client if played.client is not None else played.raw
    try:
        if reader is not None:  # the one that never reads
            reader.sock.setsockopt(zmq.RCVHWM, 1)
        if role == "dialed worker, in an exchange":
            frames = frames_of(Done(hostile.OPEN_REF, np.ones(UNREAD_SIZE, dtype=np.uint8), {}, 1))
            sock, out = played.outgoing(frames)
            for _ in range(UNREAD_ANSWERS):
                sock.send_multipart(out, copy=False)
                load.sent += 1
        else:
            for ref in range(100, 100 + UNREAD_ANSWERS):
                played.send(frames_of(Work(ref, big, 0, watched=False)))
                load.sent += 1
        side = hostile.ROLES[role]["side"]
        until = time.monotonic() + UNREAD_SECONDS
        while time.monotonic() < until:  # the answers pile up where they pile up, meanwhile
            _grew(watched, load)
            if side != "fb1":
                _honest(sides, side, load)
            else:
                threading.Event().wait(0.2)
    finally:
        played.close()
    _grew(watched, load)
    return load


def stopped_under_work(sides: Sides, folder) -> float:
    """SIGSTOP ``w1`` while the honest tenant's piece runs there (a frozen VM, a GC pause):
    how long the forward took to end (``Broken``), in seconds. Fails past
    ``STOPPED_NOTICED``. ``w1`` is resumed after, and the piece let go."""
    w1 = sides.processes["w1"]
    started, release = folder / "started", folder / "release"
    piece = Hold(str(started), str(release), str(folder / "finished")).named("held").at("w1")
    box: dict = {}
    k = sides.keys  # a client new to w1: its Work goes right behind its Hello, as a first call does
    client = Broker.at(
        sides.processes["broker"].endpoint,
        patience=float(hostile.PATIENCE),
        keys=Keys.client(k["bob_secret"], server=k["broker"]),
    )

    def run() -> None:
        try:
            piece.forward(1, broker=client)
        except Exception as exc:  # noqa: BLE001 - what it raised is what is looked at
            box["raised"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    hostile.wait_until(started.exists, 20, "the piece running on w1")
    w1.signal(signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        thread.join(STOPPED_NOTICED)
        took = time.monotonic() - stopped
        assert not thread.is_alive(), f"the client still waited {took:.1f} s after its worker was stopped"
        assert type(box.get("raised")).__name__ == "Broken", box
        return took
    finally:
        release.write_text("go")
        w1.signal(signal.SIGCONT)
        client.close()


def stopped_a_while(sides: Sides, name: str, seconds: float = 1.0) -> float:
    """SIGSTOP ``name`` for ``seconds`` with the honest tenant's forward through it on its
    way, then SIGCONT: how long that forward took (it must answer, rightly)."""
    process = sides.processes[name]
    side = {"w1": "broker", "broker": "broker", "lw": "lw"}[name]
    process.signal(signal.SIGSTOP)
    started = time.monotonic()
    try:
        box: dict = {}
        thread = threading.Thread(target=lambda: box.setdefault("ok", sides.honest.answers(side)), daemon=True)
        thread.start()
        threading.Event().wait(seconds)  # the stop itself: what is played
    finally:
        process.signal(signal.SIGCONT)
    thread.join(ANSWERED_WITHIN)
    assert not thread.is_alive(), f"the forward through {name} still waited {ANSWERED_WITHIN:g} s after it resumed"
    assert box.get("ok"), f"the forward through {name} answered wrongly after it resumed"
    return time.monotonic() - started
