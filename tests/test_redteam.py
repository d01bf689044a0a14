"""Red team for issue 11: attacks on what was built, each played for real.

Every test here is one attack that succeeded against the fix of issue 11: it fails now,
and passes once the hole is closed. Each docstring says who the attacker is and what it
achieves. Real processes, real sockets, loopback only; waits poll a fact with a deadline;
every process is reaped by the ``processes`` fixture.
"""

from __future__ import annotations

import numpy as np
from conftest import BROKER, WORKER, env_with_tests
from fabric_nodes import Add, Scale
from holds_nodes import Hold
from peers import Raw
from reliability_support import wait_until

from somatize import Broker
from somatize.packing import Packer
from somatize.wire import (
    Begin,
    Done,
    Hello,
    Located,
    NodeSpec,
    Ready,
    Recipe,
    Refusal,
    Relay,
    Runtime,
    Where,
    Work,
    encode,
)

RT = Runtime.here(mode="project")


def project_worker(processes, *extra: str):
    return processes([*WORKER, "--listen", "127.0.0.1:0", "--announce", *extra], env=env_with_tests())


def spec_of(node) -> NodeSpec:
    return Packer("project").spec(node.steps[0])


# -- an allowed client evicts another client's session ------------------------------------


# -- a client receives another client's answer after its broker restarts -------------------


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_after_a_broker_restarts_a_new_client_does_not_receive_the_answer_to_another_clients_work(processes, tmp_path):
    """Attacker: an allowed client of a broker (a keyless loopback broker here, which every
    local user reaches; the numbering is the same with keys, where it takes a client key).

    What it achieves: it receives another client's answer (the victim's output, here the
    secret it sent in). A broker numbers its relayed exchanges from 1 and a dialed worker
    names each relayed peer by that number alone (`relay:N`). When the broker restarts
    while the victim's work runs (an operator's restart, a crash, a deploy), the worker
    keeps its session `relay:1` with the victim's open ref; the first client of the new
    broker to talk to that host gets exchange 1, and the worker's late answer to the victim
    is relayed to it. (A Hello on it even keeps the victim's open refs: `_greet` carries
    them over.)
    """
    started, release, finished = tmp_path / "started", tmp_path / "release", tmp_path / "finished"
    url = f"tcp://127.0.0.1:{free_port()}"
    hub = processes([*BROKER, "--listen", url, "--announce"])
    processes([*WORKER, "--broker", url, "--offer", "w1", "--patience", "2"], announce=None, env=env_with_tests())
    probe = Raw(url)
    victim = Raw(url)
    attacker = None
    try:
        wait_until(lambda: isinstance(probe.ask(Where("w1"), 2.0), Located), 20, "w1 dialing in")
        victim.send(Relay(host="w1", inner=tuple(encode(Hello(RT)))))
        assert isinstance(victim.answer(), Ready)
        secret = "victim's secret output 4242"
        hold = spec_of(Hold(str(started), str(release), str(finished)).named("hold"))
        victim.send(Relay(host="w1", inner=tuple(encode(Work(7, Recipe((hold,), ("step", 0)), secret, watched=False)))))
        wait_until(started.exists, 30, "the victim's work starting")

        assert hub.stop() == 0  # the broker restarts while the victim's work runs
        probe.close()
        processes([*BROKER, "--listen", url, "--announce"])
        probe = Raw(url)
        wait_until(lambda: isinstance(probe.ask(Where("w1"), 2.0), Located), 30, "w1 dialing in again")

        attacker = Raw(url)  # the first client of the new broker to talk to w1: exchange 1
        assert isinstance(attacker.ask(Relay(host="w1", inner=tuple(encode(Hello(RT))))), Ready)
        release.write_text("go")
        wait_until(finished.exists, 30, "the victim's work returning")

        # the attacker's own work: everything relayed to it before its answer is looked at
        add = spec_of(Add(1).named("a"))
        attacker.send(Relay(host="w1", inner=tuple(encode(Work(99, Recipe((add,), ("step", 0)), 1, watched=False)))))
        got = []
        while not got or getattr(got[-1], "ref", None) != 99:
            answer = attacker.answer(20)
            assert answer is not None, got
            got.append(answer)
        leaked = [a for a in got if isinstance(a, Done) and a.ref == 7]
        assert not leaked, f"the attacker received the victim's answer: {leaked}"
        assert isinstance(got[-1], Done) and got[-1].output == 2
    finally:
        release.write_text("go")
        for raw in (probe, victim, attacker):
            if raw is not None:
                raw.close()


# -- a client makes a mount worker keep cargo nobody will ever remove ----------------------


# -- announcing a huge stream buys a slot for hours ----------------------------------------

#: A dialed worker whose streams get 2 s of grace instead of 30, so the test need not wait
#: half a minute; everything else is `python -m somatize.worker` as shipped.
QUICK_GRACE_WORKER = (
    "import sys; import somatize.fabric.streams as s; s.GRACE = 2.0; "
    "from somatize.worker import main; sys.exit(main(sys.argv[1:]))"
)


def test_a_stream_that_announces_a_huge_size_and_sends_nothing_does_not_hold_its_slot_for_hours(processes):
    """Attacker: clients of a keyless loopback broker (every local user is one; each
    connection is a tenant of its own there).

    What it achieves: every client's big cargo (over 4 MiB) to a dialed worker is refused
    for nine hours, for 96 small messages. A stream's lifetime is `GRACE + sizes / MIN_RATE`
    of the sizes its `Begin` *announces*: a Begin announcing 32 GiB buys 30 s + 32,768 s
    whatever arrives, so a slot held with no chunk at all (or one byte now and then) is
    never dropped, though docs/conversation.md says "a slot kept alive by one-byte chunks
    is dropped, and nobody can lock the others out". 32 connections fill the worker's 64
    slots. (The worker here runs with a grace of 2 s, so the test need not wait 30.)
    """
    hub = processes([*BROKER, "--listen", "tcp://127.0.0.1:0", "--announce"])
    worker_cmd = [WORKER[0], "-c", QUICK_GRACE_WORKER, "--broker", hub.endpoint, "--offer", "w1", "--patience", "2"]
    processes(worker_cmd, announce=None, env=env_with_tests())
    crowd: list[Raw] = []
    with Broker.at(hub.endpoint, patience=2.0) as broker:
        wait_until(lambda: broker.knows("w1"), 20, "w1 dialing in")
        assert Add(1).named("a").at("w1").forward(1, broker=broker) == 2
        try:
            huge = (1, 16 << 30, (16 << 30) - 1)
            for _ in range(32):
                raw = Raw(hub.endpoint)
                crowd.append(raw)
                assert isinstance(raw.ask(Relay(host="w1", inner=tuple(encode(Hello(RT))))), Ready)
                for sid in (1, 2):
                    raw.send(Relay(host="w1", inner=tuple(encode(Begin(sid, huge)))))
                # a Hello after them is answered once the worker has taken both Begins
                assert isinstance(raw.ask(Relay(host="w1", inner=tuple(encode(Hello(RT))))), Ready)
            late = Raw(hub.endpoint)
            crowd.append(late)
            late.ask(Relay(host="w1", inner=tuple(encode(Hello(RT)))))
            late.send(Relay(host="w1", inner=tuple(encode(Begin(1, (1, 1 << 20))))))
            refused = late.answer(10)
            assert isinstance(refused, Refusal) and "as many big messages" in refused.why  # locked out

            errors: list[str] = []

            def big_forward_goes_through() -> bool:
                try:
                    out = Scale(1.0).named("s").at("w1").forward(np.ones(1 << 20), broker=broker, deadline=15)
                except Exception as exc:
                    errors[:] = [f"{type(exc).__name__}: {exc}"]
                    return False
                return float(out.sum()) == float(1 << 20)

            # nothing more arrives on the 64 streams: past their grace they are gone
            try:
                wait_until(big_forward_goes_through, 25, "a client's big cargo getting through")
            except AssertionError as exc:
                raise AssertionError(f"{exc}; the last try: {errors[-1] if errors else '?'}") from None
        finally:
            for raw in crowd:
                raw.close()


# -- an allowed worker key takes over another key's host across a broker restart -----------
