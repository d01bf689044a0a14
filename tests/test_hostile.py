"""The hostile-peer harness, run (issue 38): every role of the fabric (``hostile.ROLES``)
sends every message kind of the wire (``hostile.KINDS``) in every state of the conversation
(``hostile.STATES``), well formed and spoilt, against the real sides: a keyed broker, a
worker dialed in to it, a listening worker, a worker dialing a broker the harness plays.
Each case: the side answers as docs/conversation.md says (``Refusal``, or nothing), keeps
serving, and stays within ``hostile.RSS_MIB`` / ``FDS`` / ``THREADS`` while the honest
tenant's forward through every side still answers. The sides are started once for the
module; the floods, the peers that never read and SIGSTOP start their own.

A case that fails here is a finding: it stays, marked ``xfail(strict=True)`` with the
fault, so it flips when the fault is fixed.
"""

from __future__ import annotations

import hostile
import hostile_load
import pytest
from hostile import KINDS, MALFORMED, ROLES, SAMPLE_REF, STATES, Played, Sides, bounded, name_of

from somatize.wire import Refusal

#: Known faults, each a finding of this harness: (role, kind, state) -> why, one line.
FAULTS: dict[tuple[str, str, str], str] = {}
#: Known faults under a flood, by (role, "every kind" or "Bye"): none since issue 38's
#: admission step (a Relay that opens or ends nothing is refused and counted).
FLOODS: dict[tuple[str, str], str] = {}
#: Known faults with a peer that never reads, by role: none since the broker's ROUTER queue
#: is counted in bytes (issue 38).
UNREAD: dict[str, str] = {}


# -- what the conversation says each side answers (docs/conversation.md) ---------------------

_WORKER_ROLES = ("peer", "relayed client", "broker, in an exchange")


def expected(role: str, kind: str, state: str) -> frozenset[str]:
    """The kinds the side may answer a well-formed ``kind`` with, from ``role`` in ``state``
    (``""``: nothing at all), as docs/conversation.md's tables say."""
    if role in _WORKER_ROLES:  # a worker's sessions: the peer's, one per relayed exchange
        greeted = state in ("after Hello", "exchange open")
        if kind == "Hello":
            return frozenset({"Ready"})
        if kind == "Bye" or (kind in ("Chunk", "Credit") and not greeted):
            return frozenset({""})  # a piece of a stream nobody has: dropped, never answered
        if not greeted:
            return frozenset({"Refusal"})  # say Hello first
        if kind == "Work":
            return frozenset({"Done"})
        if kind in ("Begin", "Credit"):
            return frozenset({""})  # a stream begins (its chunks awaited); a credit for no stream
        if kind == "Chunk":  # of a stream that never began: the table says nothing more
            return frozenset({"", "Refusal"})
        return frozenset({"Refusal"})  # Provision (project mode), Where, Hosts, any answer, Relay, Mounted
    if role == "broker":  # a broker played to a worker that dialed it: it takes Hello and Ready
        return frozenset({"Ready"} if kind == "Hello" else {""})
    if role == "client":
        return frozenset(
            {
                {"Hello": "Ready", "Where": "Located", "Hosts": "Listed", "Bye": "", "Relay": "Ready"}.get(
                    kind, "Refusal"
                )
            }
        )  # Relay: w1's Ready to the Hello inside
    offered = state != "before Hello"
    if role == "dialed worker":
        if kind in ("Hello", "Where", "Hosts", "Bye"):
            return frozenset({{"Hello": "Ready", "Where": "Located", "Hosts": "Listed", "Bye": ""}[kind]})
        if kind == "Ready":
            return frozenset({"" if offered else "Refusal"})  # an offer's answer to a check
        if kind == "Relay":  # exchange 0: from a route that offers, an exchange nobody has
            return frozenset({"" if offered else "Ready"})
        return frozenset({"Refusal"})
    assert role == "dialed worker, in an exchange", role
    return frozenset({"" if offered else "Refusal"})  # dropped and counted; or: say Hello with `offering` first


def expected_malformed(role: str, kind: str, state: str) -> frozenset[str]:
    """A spoilt ``kind``: refused where the peer is owed an answer, or dropped where the
    well-formed one is (nothing of it is ever taken)."""
    quiet = "" in expected(role, kind, state) or role == "broker"
    owed = role != "broker" and not (role == "dialed worker, in an exchange" and state != "before Hello")
    return frozenset(({"Refusal"} if owed else set()) | ({""} if quiet or not owed else set()))


def expected_delivered(role: str, kind: str, state: str) -> frozenset[str]:
    """What the harness's client of a hostile worker's exchange may receive for it: the
    message itself, in the exchange open (passed on untouched); nothing otherwise."""
    if role == "dialed worker, in an exchange" and state == "exchange open":
        return frozenset({"passed on"})
    if role == "dialed worker" and kind == "Bye" and state == "exchange open":
        return frozenset({"", "Refusal"})  # its worker left; the table promises the client nothing more
    return frozenset({""})


def awaited(role: str, kind: str, state: str):
    """The answer that may come after the probe's, when one is expected: a Work's end (run
    on a job thread), or a worker's Ready relayed by the broker (which answers the probe
    itself, at once); None when every answer comes before the probe's."""
    allowed = expected(role, kind, state)
    if "Done" in allowed:
        return lambda a: type(a).__name__ in ("Done", "Failed", "Refusal") and getattr(a, "ref", None) == SAMPLE_REF
    if kind == "Relay" and ROLES[role]["side"] == "broker" and allowed == {"Ready"}:
        return lambda a: type(a).__name__ == "Ready"
    return None


def outcome(answers: list) -> str:
    """One answer's kind, ``""`` for none, or every kind joined when there were more."""
    return "+".join(name_of(a) for a in answers)


@pytest.fixture(scope="module")
def sides(tmp_path_factory):
    made = Sides(tmp_path_factory.mktemp("hostile"))
    yield made
    made.stop()


def _cases(malformed: bool = False):
    for role in ROLES:
        for kind in KINDS:
            for state in STATES:
                marks = []
                fault = FAULTS.get((role, kind, state) if not malformed else (role, kind, "malformed"))
                if fault:
                    marks.append(pytest.mark.xfail(strict=True, reason=fault))
                yield pytest.param(role, kind, state, marks=marks, id=f"{role}-{kind}-{state}".replace(" ", "_"))


def test_the_harness_makes_every_message_of_the_wire():
    """Every kind the wire knows has a message the harness sends, which the wire writes and
    reads back as it was: a kind added to the wire is in every case below."""
    from somatize.wire import decode, encode, messages

    assert set(KINDS) == set(messages.VARIANTS)
    for kind in KINDS:
        message = hostile.sample(kind)
        assert type(decode(encode(message))) is type(message), kind


@pytest.mark.parametrize(("role", "kind", "state"), list(_cases()))
def test_every_role_sends_every_message_in_every_state(sides, role, kind, state):
    with bounded(sides):
        played = Played(sides, role, state)
        try:
            played.send(hostile.frames_of(hostile.sample(kind)))
            allowed = expected(role, kind, state)
            got = played.answers(until=awaited(role, kind, state))
            assert outcome(got) in allowed, f"answered {got!r}; the conversation says {sorted(allowed)}"
            for answer in got:
                if kind == "Work" and isinstance(answer, Refusal) and ROLES[role]["side"] != "broker":
                    assert answer.ref == SAMPLE_REF, f"a refusal of a Work names its ref: {answer!r}"
            delivered = played.delivered()
            want = expected_delivered(role, kind, state)
            if want == {"passed on"}:
                assert [name_of(d) for d in delivered] == [kind], delivered
            else:
                assert outcome(delivered) in want, f"its client received {delivered!r}"
        finally:
            played.close()


def _spoilt_cases():
    for role in ROLES:
        for kind in KINDS:
            for how in MALFORMED:
                fault = FAULTS.get((role, kind, how))
                marks = [pytest.mark.xfail(strict=True, reason=fault)] if fault else []
                yield pytest.param(role, kind, how, marks=marks, id=f"{role}-{kind}-{how}".replace(" ", "_"))


@pytest.mark.parametrize(("role", "kind", "how"), list(_spoilt_cases()))
def test_every_role_sends_every_message_spoilt(sides, role, kind, how):
    """Truncated, declaring more than it holds, fields of the wrong type: sent once Hello
    was answered (a spoilt message before Hello is refused by its first bytes, as the
    well-formed cases show). Refused where the peer is owed an answer, dropped where the
    well-formed one is; never taken, and the side serves on."""
    state = "after Hello" if role != "dialed worker, in an exchange" else "exchange open"
    with bounded(sides):
        played = Played(sides, role, state)
        try:
            frames = hostile.malformed(kind, how)
            played.send(frames)
            allowed = expected_malformed(role, kind, state)
            got = played.answers()
            assert outcome(got) in allowed, f"answered {got!r}; the conversation says {sorted(allowed)}"
            delivered = played.delivered()
            if role == "dialed worker, in an exchange":  # passed on untouched, as it came
                assert len(delivered) == 1, delivered
                assert (
                    delivered[0][1] if isinstance(delivered[0], tuple) else hostile.frames_of(delivered[0])
                ) == frames
        finally:
            played.close()


# -- floods, peers that never read, stopped processes: sides of their own ----------------------


@pytest.fixture
def fresh(tmp_path):
    """Sides for this one test: what a flood grew is never the next test's."""
    made = Sides(tmp_path)
    yield made
    made.stop()


def _floods():
    for role in hostile_load.WATCHED:
        for what in ("every kind", "Bye") if role == "relayed client" else ("every kind",):
            fault = FLOODS.get((role, what))
            marks = [pytest.mark.xfail(strict=True, reason=fault)] if fault else []
            yield pytest.param(role, what, marks=marks, id=f"{role}-{what}".replace(" ", "_"))


@pytest.mark.slow
@pytest.mark.parametrize(("role", "what"), list(_floods()))
def test_a_flood_leaves_the_side_bounded_and_the_honest_tenant_answered(fresh, role, what):
    """Eight conversations of one role send every kind of the wire round and round (or, to a
    relayed host, only ``Bye``, which opens nothing and, past the first, ends nothing: issue
    38's flood), reading nothing, for a
    bounded count and time; the honest tenant forwards between batches (``Busy`` counts:
    an allowed client may keep a worker's jobs busy)."""
    with bounded(fresh):
        load = hostile_load.flood(fresh, role, KINDS if what == "every kind" else ("Bye",))
        print(f"{role}, {what}: {load}")
        assert not load.within(), f"{load.within()} ({load.sent:,} messages sent)"


@pytest.mark.slow
@pytest.mark.parametrize(
    "role",
    [
        pytest.param(r, marks=[pytest.mark.xfail(strict=True, reason=UNREAD[r])] if r in UNREAD else [])
        for r in hostile_load.WATCHED
        if r != "client"
    ],
)
def test_a_peer_that_never_reads_leaves_the_side_bounded(fresh, role):
    """A peer asks for 24 answers of 16 MiB and reads none (as the hostile dialed worker, it
    answers that much into an exchange whose client reads none); the side queues what
    docs/conversation.md says and drops the rest."""
    with bounded(fresh):
        load = hostile_load.never_reading(fresh, role)
        print(f"{role}: {load}")
        assert not load.within(), load.within()


@pytest.mark.slow
def test_a_dialed_worker_stopped_under_work_is_broken_within_two_patiences(fresh, tmp_path):
    """A client new to w1 (its Work right behind its Hello) waits on a held piece; w1 is
    SIGSTOPped: ``Broken`` within two patiences and the probe (issue 38)."""
    took = hostile_load.stopped_under_work(fresh, tmp_path)
    print(f"Broken after {took:.1f} s")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["w1", "broker", "lw"])
def test_a_process_stopped_a_second_serves_again_once_resumed(fresh, name):
    """SIGSTOP, a second, SIGCONT, with the honest tenant's forward through it on its way:
    that forward answers, and the bounds hold after."""
    with bounded(fresh):
        took = hostile_load.stopped_a_while(fresh, name)
        print(f"{name}: answered {took:.1f} s after it was stopped")
