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

import pytest

import hostile
from hostile import KINDS, MALFORMED, ROLES, SAMPLE_REF, STATES, Played, Sides, bounded, expected, outcome
from somatize.wire import Refusal

#: Known faults, each a finding of this harness: (role, kind, state) -> why, one line.
FAULTS: dict[tuple[str, str, str], str] = {}


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
            got = played.answers(until=hostile.awaited(role, kind, state))
            assert outcome(got) in allowed, f"answered {got!r}; the conversation says {sorted(allowed)}"
            for answer in got:
                if kind == "Work" and isinstance(answer, Refusal) and ROLES[role]["side"] != "broker":
                    assert answer.ref == SAMPLE_REF, f"a refusal of a Work names its ref: {answer!r}"
            delivered = played.delivered()
            want = hostile.expected_delivered(role, kind, state)
            if want == {"passed on"}:
                assert [hostile.name_of(d) for d in delivered] == [kind], delivered
            else:
                assert outcome(delivered) in want, f"its client received {delivered!r}"
        finally:
            played.close()
