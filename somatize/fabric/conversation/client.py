"""The client's side of one channel: `CLIENT_SENDS` and `CLIENT_TABLE`, kept by `ClientExchange`."""

from __future__ import annotations

import enum

from ...wire import (
    Done,
    Failed,
    Hello,
    Provision,
    Ready,
    Refusal,
    Saw,
    Send,
    Work,
)
from .violations import Violation, name_of

# -- the client's side of one channel ------------------------------------------------------


class ChannelState(enum.StrEnum):
    """Where a client's channel is in its conversation with one worker."""

    NEW = "new"
    GREETING = "greeting"
    GREETING_WORKING = "greeting+working"  # a Work sent right behind the Hello: its answer first
    READY = "ready"
    PROVISIONING = "provisioning"
    WORKING = "working"
    CLOSED = "closed"


class Take(enum.StrEnum):
    """What a channel does with what arrived (`CLIENT_TABLE`)."""

    ANSWER = "answer"
    STALE = "stale"
    UNPLACED = "unplaced"


#: What each `Take` means, in a sentence (``docs/conversation.md`` shows it).
TAKES = {
    Take.ANSWER: "taken: the answer (or a fact) it waits on",
    Take.STALE: "dropped and counted: an answer to work given up on is never taken for this one",
    Take.UNPLACED: "the channel ends with `Refused`: the work may have run, and nothing is sent again",
}


#: Two kinds of arrival the wire does not tell apart and the conversation does (`_arrival`).
#: An answer whose ref is not the open work's:
OTHER_REF = "an answer naming another work"
#: A refusal naming no work, once the open Work was wholly sent (its fate is not known):
NO_WORK_SENT = "`Refusal` naming no work, its Work wholly sent"

_C = ChannelState
#: What a channel may send: (state, message sent) -> its next state.
CLIENT_SENDS: dict[tuple[ChannelState, type], ChannelState] = {
    (_C.NEW, Hello): _C.GREETING,
    (_C.READY, Provision): _C.PROVISIONING,
    (_C.READY, Work): _C.WORKING,
    (_C.GREETING, Work): _C.GREETING_WORKING,
}
#: The client's side of a channel: (state, what arrives) -> (next state, what the channel
#: does). Anything else closes the channel (Rule 1: never guess the way back).
CLIENT_TABLE: dict[tuple[ChannelState, type | str], tuple[ChannelState, Take]] = {
    (_C.GREETING, Ready): (_C.READY, Take.ANSWER),
    (_C.GREETING, Refusal): (_C.CLOSED, Take.ANSWER),
    (_C.GREETING_WORKING, Ready): (_C.WORKING, Take.ANSWER),
    (_C.GREETING_WORKING, Refusal): (_C.CLOSED, Take.ANSWER),
    (_C.PROVISIONING, Ready): (_C.READY, Take.ANSWER),
    (_C.PROVISIONING, Refusal): (_C.CLOSED, Take.ANSWER),
    (_C.WORKING, Saw): (_C.WORKING, Take.ANSWER),
    (_C.WORKING, Send): (_C.READY, Take.ANSWER),
    (_C.WORKING, Done): (_C.READY, Take.ANSWER),
    (_C.WORKING, Failed): (_C.READY, Take.ANSWER),
    (_C.WORKING, Refusal): (_C.READY, Take.ANSWER),  # its own Work's, or of its stream still going out
    (_C.WORKING, OTHER_REF): (_C.WORKING, Take.STALE),
    (_C.WORKING, NO_WORK_SENT): (_C.CLOSED, Take.UNPLACED),
}
_ANSWERING = (Saw, Send, Done, Failed, Refusal)  # what names the work it answers


class ClientExchange:
    """A client channel's conversation with one worker (directly, or relayed by a broker):
    `CLIENT_SENDS` and `CLIENT_TABLE` are its rules, drawn in ``docs/conversation.md``.

    An answer carrying the ref of an exchange this channel gave up on is stale: dropped and
    counted in ``stale``, never taken for the answer to the work now open.

    A refusal names the work it ends. One that names no work, arriving once the Work has
    been wholly sent (``work_delivered``), is never taken for that work's answer: it ends
    the channel (state ``closed``, ``unplaced`` set), the work's fate unknown, and nothing
    is sent again on its word. Before then (a stream of the Work still going out) it
    refuses the carrier of the Work, which the worker never took: that is its answer.
    """

    def __init__(self) -> None:
        self.state = ChannelState.NEW
        self.ref: int | None = None
        self.stale = 0
        self.sent = False  # the open Work has been wholly sent
        self.unplaced: Refusal | None = None  # a refusal naming no work, after it was sent

    def _sending(self, kind: type) -> None:
        after = CLIENT_SENDS.get((self.state, kind))
        if after is None:
            raise Violation(f"this channel cannot send {kind.__name__} while {self.state}")
        self.state = after

    def hello_sent(self) -> None:
        self._sending(Hello)

    def provision_sent(self) -> None:
        self._sending(Provision)

    def work_sent(self, ref: int) -> None:
        """The Work goes out once the channel is ready, or right behind its Hello (whose
        answer then comes first: a worker that refuses the Hello refuses the Work too)."""
        self._sending(Work)
        self.ref, self.sent = ref, False

    def work_delivered(self) -> None:
        """The open Work has left whole (the last chunk of its stream, or the message
        itself): from now on a refusal that names no work is not its answer."""
        if self.state in (ChannelState.WORKING, ChannelState.GREETING_WORKING):
            self.sent = True

    def forgotten(self) -> None:
        """The worker said it does not know this channel (``Refusal(hello=True)``): the
        channel says Hello again, as if new."""
        if self.state is not ChannelState.READY:
            raise Violation(f"this channel cannot send Hello again while {self.state}")
        self.state = ChannelState.NEW

    def give_up(self) -> None:
        """The caller stopped waiting for the open work (a deadline): its answers are stale."""
        self.state, self.ref = ChannelState.CLOSED, None

    def _arrival(self, msg: object) -> type | str:
        """What ``msg`` is to this channel now: its type, or one of the two kinds of
        arrival told apart by the ref it names (`OTHER_REF`, `NO_WORK_SENT`)."""
        kind = type(msg)
        if self.state is ChannelState.WORKING and kind in _ANSWERING:
            ref = msg.ref  # type: ignore[attr-defined]  # every answering message names one
            if ref is None:
                return NO_WORK_SENT if kind is Refusal and self.sent else kind
            if ref != self.ref:
                return OTHER_REF
        return kind

    def receive(self, msg: object) -> object | None:
        """The answer, if it may arrive now; None for a stale one; raises ``Violation``."""
        step = CLIENT_TABLE.get((self.state, self._arrival(msg)))
        if step is None:
            was, self.state = self.state, ChannelState.CLOSED  # Rule 1: never guess the way back
            raise Violation(f"a worker may not answer a `{name_of(msg)}` to a channel that is {was}")
        self.state, take = step
        if take is Take.STALE:
            self.stale += 1
            return None
        if take is Take.UNPLACED:  # not the answer: the work may have run; nothing is resent
            self.unplaced = msg  # type: ignore[assignment]  # a Refusal (`NO_WORK_SENT`)
        elif self.state is ChannelState.READY:
            self.ref = None
        return msg
