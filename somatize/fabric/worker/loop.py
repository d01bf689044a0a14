"""The worker's serving loop: one socket, answering Hello, Provision and Work, never giving up.

A worker holds no state anyone cares about and knows nothing of graphs. It answers on a
ROUTER it listens on (Direct and Mount) or on a DEALER it dialed to a broker (Relayed).
Facts go back as ``Saw``s, then exactly one ``Done`` or ``Failed``; a piece that finishes
within ``STAND_IN_AFTER`` carries what it said inside its ``Done`` (:mod:`.held`).
Anything malformed or out of turn is answered ``Refusal`` and the loop goes on serving.

Who says what, when, is :class:`~somatize.fabric.conversation.WorkerSessions`'s: every
message is checked there before anything acts on it, and every answer before it leaves.
A peer is a client's route (Direct, Mount) or ``b"relay:%d" % exchange`` for an exchange a
broker relays. Only ``Hello`` and ``Bye`` are decoded from a peer that has not said
``Hello``: for anything else its header's variant is read (``wire.variant_of``) and the
message refused unopened. The carriers are opened on the way in: ``Relay`` (what a broker
passes on, by the link), ``Begin``/``Chunk``/``Credit`` (a big message streamed through a
broker, with per-tenant quotas and a lifetime, :mod:`somatize.fabric.streams`) and
``Mounted`` (cargo in a shared folder, :mod:`somatize.fabric.mount`), by the intake.

What it survives, and how:

- its nodes: a node that hangs leaves the worker answering: a ``Hello`` (a probe) gets
  ``Ready`` saying how long the oldest work has run (``busy_us``), new work past the
  ``jobs`` slots a ``Refusal`` that starts with ``busy:`` (and a ``said`` fact, when the work
  is watched). Whatever a node raises, ``SystemExit`` and ``KeyboardInterrupt`` included,
  becomes a ``Failed`` naming it.
- its broker: a dialed worker says ``Hello`` again whenever its connection comes back and,
  told ``Refusal`` (a restarted broker that does not know it or its late answer, a name
  bound to another key), again after a backoff capped at ``MAX_BACKOFF``. It exits only
  on a signal.
- its client, for a spawned worker (``parent``): a thread of its own checks the parent, so a
  node stuck forever does not keep an orphan alive; if the serving thread does not close
  within a short grace, the process ends with ``os._exit``.

The loop owns its pieces, each an object with its own state, handed what it needs:

- :class:`~.serving.Hold` (``hold``): the lock on the socket. Only the thread holding it
  touches the socket, the sessions and the streams: the serving thread, or the stand-in.
- :class:`~.intake.Intake` (``intake``): what comes in, opened and asked of the
  conversation; the streams coming in. What it allows, the loop acts on (``_take``).
- :class:`~.outbox.Outbox` (``outbox``): what goes out. Answers and facts, from whatever
  thread (a job, a parallel branch of a piece), go into one first-in-first-out queue; the
  holder sends them, woken through an inproc socket when it is polling, and whoever takes
  the socket sends what waits there first. The streams going out, what was dropped.
- :class:`~.running.Runner` (``runner``): where work runs and what runs now; slots and the
  guard around each node are :mod:`somatize.fabric.worker.slots`'.
- :class:`~.standin.StandIn` (``standin``): who serves while a piece runs long where it
  arrived (``jobs=1``), on a thread of its own.
- :class:`~.dialing.BrokerLink` (``link``): a dialed worker's link to its broker (offer,
  keepalive, the control that goes ahead of every answer, the window for answers).

What it logs about peers goes through one limiter (:mod:`somatize.fabric.logs`), handed to
each piece that logs.

Revocation (a listening worker with keys, reloaded): every session of a key no longer
allowed ends at once. Its open work is answered ``Refusal`` (naming the ref) and abandoned:
the piece runs no further node, and nothing it says afterwards (``Saw``, ``Done``) leaves.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import zmq

from ...errors import Refused, SomatizeError
from ...facts import fact
from ...packing import Catalog
from ...record import report, self_report
from ...store import FolderStore
from ...wire import Bye, Hello, Mounted, Provision, Refusal, Runtime, Work, compatible, ref_of
from .. import mount as _mount
from .. import proofs as _proofs
from .. import sockets
from ..conversation import Act, WorkerSessions
from ..curve import Guard, Keys, as_server, user_of
from ..logs import Limiter
from .attachments import Taken
from .dialing import MAX_BACKOFF, BrokerLink
from .heap import Heap
from .imported import Imports
from .intake import Intake
from .outbox import Outbox, To
from .running import Runner
from .serving import Hold
from .slots import NodeExit, exit_now
from .standin import StandIn

__all__ = ["MAX_BACKOFF", "NodeExit", "WorkerLoop"]

#: How often a spawned worker checks that whoever spawned it is still there (seconds).
PARENT_CHECK = 0.5
log = logging.getLogger("somatize.worker")


class WorkerLoop:
    """A worker's serving loop. ``bind()`` or ``dial()`` first, then ``serve()``.

    It owns its pieces, each with its own state: the hold on the socket (``hold``), what
    comes in (``intake``), what goes out (``outbox``), where work runs (``runner``), who
    serves while a piece runs where it arrived (``standin``) and, dialed, the link to its
    broker (``link``). Here: the socket and its poll, the turn that drives them, what
    is acted on once the conversation allowed it, revocation, closing, reports."""

    #: The method that carries out each act of the conversation's table the intake hands on
    #: (`conversation.WORKER_TABLE`; the intake carries out the others: forget, carry, open, drop).
    ACTS = {Act.GREET: "_greet", Act.PROVISION: "_provision", Act.RUN: "_run"}

    def __init__(
        self,
        *,
        mode: str = "project",
        mount: str | None = None,
        jobs: int = 1,
        patience: float = sockets.PATIENCE,
        parent: int | None = None,
        store: str | None = None,
        reporting: float | None = None,
        machine: str | None = None,
        exit_when_stuck: bool = False,
    ) -> None:
        self.catalog = Catalog(mode)
        self.mode = mode
        self.mount = mount
        self.patience = patience
        self.parent = parent
        self.runtime = Runtime.here(mode=mode)
        self._acts = {act: getattr(self, name) for act, name in self.ACTS.items()}  # bound once, not per message
        self._sessions = WorkerSessions(self.runtime)
        # what the worker says about itself: into a store on a clock (an idle worker's
        # connection is one nobody reads), and down an open connection as a `said` fact
        self.reporting = reporting
        self.store = FolderStore(store) if store is not None else None
        self.machine = machine or socket.gethostname()
        self._said_at = 0.0
        self.jobs = max(1, int(jobs))
        # the process may end itself when stopping finds a node stuck (the command's choice)
        self.exit_when_stuck = exit_when_stuck
        self.hold = Hold()  # whoever holds it serves: the socket is theirs
        self._last_check = self._last_report = 0.0
        self.imports = Imports()  # what was imported, to tell stale code from a plain failure
        self._lines = Limiter(log)  # every line a peer can cause goes through it
        # answers and facts from any thread, sent by whoever holds the socket
        self.outbox = Outbox(self._sessions, self.hold, self.imports, self._lines)
        self._front: zmq.Socket | None = None
        self._guard: Guard | None = None
        self.link: BrokerLink | None = None  # a dialed worker's link to its broker (`dial`)
        self._revoking = False  # the allow-list was reloaded: end what revoked keys have open
        self.intake = Intake(self._sessions, mount, self.outbox)  # what comes in, as the conversation allows
        self.stopping = sockets.Alarm()  # an Event that also wakes the serving poll
        self.standin = StandIn(self.hold, self.stopping)  # serves while a piece runs long where it arrived
        self._closed = threading.Event()
        self._serving = False  # a thread is in serve(): it closes its own sockets
        self._closing = threading.Lock()
        self.heap = Heap()  # cargo moved since the allocator last gave freed memory back
        # where work runs (slots, or where it arrived), and what runs now
        self.runner = Runner(
            self.jobs,
            catalog=self.catalog,
            runtime=self.runtime,
            heap=self.heap,
            mount=mount,
            outbox=self.outbox,
            standin=self.standin,
            said=self._said,
        )

    # -- the front socket --------------------------------------------------------------
    def bind(self, url: str, *, keys: Keys | None = None) -> str:
        """Listen on ``url``; return the real endpoint (a port 0 becomes the chosen one).
        With ``keys`` only clients whose public key is in ``keys.allow`` get through."""
        self._front = sockets.router()
        if keys is not None:
            self._guard = Guard(sockets.context(), keys, log=log)
            as_server(self._front, keys)
        self.intake.identity = _proofs.identity(None, keys.public if keys is not None else None)
        self._front.bind(url)
        self.outbox.attach(self._front)
        return sockets.bound_endpoint(self._front)

    def dial(self, broker: str, offer: str, *, keys: Keys | None = None) -> None:
        """Connect to a broker and offer to serve the host called ``offer`` (Relayed).
        With ``keys``, ``keys.server_key`` is the broker's public key."""
        link = self.link = BrokerLink(
            broker,
            offer,
            keys=keys,
            runtime=self.runtime,
            patience=self.patience,
            mount=self.mount,
            ready=self.runner.ready,
            lines=self._lines,
        )
        self._front = link.front
        self.intake.identity = _proofs.identity(offer, None)  # what its clients' proofs are bound to
        self.outbox.attach(link.front, link)
        link.announce(time.monotonic())

    @property
    def sessions(self) -> WorkerSessions:
        """Who says what, when (the conversation). Set anew (a test's, with other bounds), it
        is handed to every piece that asks it."""
        return self._sessions

    @sessions.setter
    def sessions(self, sessions: WorkerSessions) -> None:
        self._sessions = self.outbox.sessions = self.intake.sessions = sessions

    @property
    def served(self) -> int:
        """Pieces of work taken to run."""
        return self.runner.served

    @property
    def dropped(self) -> int:
        """Answers that could not be delivered."""
        return self.outbox.dropped

    @property
    def withheld(self) -> int:
        """Answers the conversation did not allow (to an exchange not open), and pieces of
        streams that arrived for nobody."""
        return self.outbox.withheld + self.intake.withheld

    # -- the loop ----------------------------------------------------------------------
    def serve(self) -> None:
        self.hold.owner = threading.get_ident()
        self.hold.take()
        if self.parent is not None:
            threading.Thread(target=self._watch_parent, daemon=True, name="somatize-parent").start()
        if not self.runner.in_slots:
            threading.Thread(target=self._stand_in, daemon=True, name="somatize-stand-in").start()
        poller = self._poller()
        poller.register(self.stopping, zmq.POLLIN)  # whoever stops us wakes the poll
        self._last_check = time.monotonic()
        self._serving = True
        try:
            while not self.stopping.is_set():
                self._turn(poller, self._until_due())
        finally:
            self.close()
            self._serving = False
            self.stopping.close()

    def _until_due(self) -> int:
        """Milliseconds until the loop has something to do on its own: the once-a-second
        look at open streams and a mount's segments, a dialed worker's keepalive, a report.
        Everything else wakes the poll (a message, an answer, a stop): an idle worker sleeps
        a patience at a time, so a thousand idle workers in one process cost little."""
        looks = self.intake.streaming() or self.outbox.streaming() or self.mount is not None
        due = self._last_check + (1.0 if looks else self.patience)
        if self.link is not None:  # the next keepalive, or a Hello after a refusal taken
            due = min(due, self.link.due(self._waited_on()))
        if self.store is not None and self.reporting:
            due = min(due, self._last_report + self.reporting)
        due = min(due, self.runner.young_until())  # a young piece's facts leave once it runs long
        # the window waits on a mark that may be lost
        due = min(due, self.outbox.window_due() or due)
        return max(0, int(1000 * (due - time.monotonic())) + 1)

    def _waited_on(self) -> bool:
        """Whether clients may wait on this worker now: work runs here, a stream goes out, or
        an answer found no room on the socket within the last patience (a dialed worker
        says Hello closer meanwhile, `BrokerLink.hello_due`)."""
        return bool(self.runner.running()) or self.outbox.waited_on(self.patience)

    def _poller(self) -> sockets.Poller:
        poller = sockets.Poller()
        poller.register(self._front, zmq.POLLIN)
        poller.register(self.outbox.answers, zmq.POLLIN)
        if self.link is not None:
            poller.register(self.link.events, zmq.POLLIN)
        return poller

    def _turn(self, poller: sockets.Poller, timeout_ms: int) -> None:
        """One round of serving, by whoever holds the socket. A dialed worker's keepalive
        comes first, before any answer or stream: bulk never starves it."""
        # wake when the socket has room again: for control (a keepalive), or a stream
        waiting = (self.link is not None and self.link.waiting()) or self.outbox.blocked
        if waiting != poller.waiting:  # registered anew only when it changes
            poller.register(self._front, sockets.POLLIN | sockets.POLLOUT if waiting else sockets.POLLIN)
            poller.waiting = waiting
        events = dict(poller.poll(timeout_ms))
        now = time.monotonic()
        link = self.link
        if link is not None:
            link.keep_offering(now, self._waited_on())
        if self._revoking:
            self._revoke()
        self.runner.release_held(now)  # a piece in a slot that runs long: its facts leave
        if self.outbox.answers in events:
            self.outbox.forward()
        # a stand-in whose piece has returned takes nothing new: the socket goes back first
        if self._front in events and not self.standin.giving_back():
            self._receive()
        # after what was read: a credit moves a stream, the broker's answer to a mark the window
        self.outbox.send_waiting(now)
        if link is not None and link.events in events:
            link.connection_events()
        if now - self._last_check >= 1.0:
            self._last_check = now
            # streams past their lifetime, or that nobody has moved for a while, are dropped
            self.intake.expire(now)
            self.outbox.expire(now, 3 * self.patience)
            if self.mount is not None:
                # a client killed with segments in the folder never gives them back: its
                # memory is freed here, not when some later client happens to start
                _mount.sweep(self.mount)
        if self.store is not None and self.reporting and now - self._last_report >= self.reporting:
            self._last_report = now
            self._report()

    def _stand_in(self) -> None:
        """On a thread of its own: serve while a piece runs long where it arrived (`.standin`)."""
        self.standin.serve(self._poller, self._turn, self.outbox.flush)
        self.standin.stop_stuck(self.patience, self.close, self.exit_when_stuck)

    def _watch_parent(self) -> None:
        """On a thread of its own: a node that never returns must not keep an orphan alive."""
        while not self.stopping.wait(PARENT_CHECK):
            if os.getppid() != self.parent:
                log.warning("stopping: the process that spawned this worker (%s) is gone", self.parent)
                self.stopping.set()
                if self.mount is not None:  # what it lent goes now, even if a node never returns
                    _mount.leave(self.mount)
                if not self._closed.wait(min(2.0, self.patience) + 1.0) and self.exit_when_stuck:
                    exit_now()  # the serving thread is stuck: nobody will ever ask again
                return

    def running(self) -> int:
        """How many pieces of work run now."""
        return self.runner.running()

    def _report(self) -> None:
        store = self.store
        assert store is not None  # `_turn` reports only where there is a store
        try:
            report(store, self.machine, self_report(self.runner.served, machine=self.machine))
        except (OSError, SomatizeError) as exc:  # a full disk must not stop the serving
            log.warning("could not report to the store: %s", exc)

    def _said(self) -> dict[str, str] | None:
        """A `said` fact for the connection, at most once per reporting period."""
        if not self.reporting:
            return None
        now = time.monotonic()
        if now - self._said_at < self.reporting:
            return None
        self._said_at = now
        return fact("said", **self_report(self.runner.served, machine=self.machine))

    def reload(self) -> None:
        """Read the allow-list of client keys again (a key removed is refused from now on).
        A folder that cannot be used raises ``BadKeys``; the old list stays."""
        if self._guard is None:
            log.info("reload asked for, but this worker listens without keys: nothing to reload")
            return
        self._guard.reload()
        self._revoking = True  # the serving loop ends what revoked keys have open, next turn
        log.info("reloaded the allow-list: %s", self._guard.described())

    def described(self) -> str:
        """Who may come in, for the start line."""
        if self._guard is not None:
            return f"CURVE keys: {self._guard.described()}"
        return "CURVE keys to the broker" if self.link is not None else "no keys"

    def close(self) -> None:
        """Stop serving; never waits for work still running (its threads are daemons). From
        another thread than the one serving, the serving thread is woken and closes its own
        sockets (ZeroMQ's are not to be closed under a poll: it fails "not a socket"); only
        one that does not within a second (a piece running on it) has them closed here."""
        self.stopping.set()
        self.standin.wake()  # the stand-in, asleep while idle, sees the stop
        if self._serving and threading.get_ident() != self.hold.owner and self._closed.wait(1.0):
            return
        with self._closing:
            if self._closed.is_set():
                return
            self._close()
            self._closed.set()

    def _close(self) -> None:
        if self._guard is not None:
            self._guard.close()
            self._guard = None
        link = self.link
        if link is not None:
            link.bye()
        self.runner.close()
        sockets.close(link.events if link is not None else None, self._front, *self.outbox.sockets())
        if self.mount is not None:
            if link is not None and link.seen:
                _mount.unmark(self.mount, link.seen)
            _mount.leave(self.mount)

    # -- receiving -----------------------------------------------------------------------
    def _receive(self) -> None:
        front = self._front
        assert front is not None  # `_turn` reads only the socket that `bind` or `dial` made, once it polled readable
        parts: list | None  # let go of once handled (below)
        for turn in range(64):  # bounded, so answers keep flowing under a flood; the poll said one waits
            # stopped meanwhile (a piece that ran here, while the stand-in closed): leave it
            if self.stopping.is_set() or turn and not sockets.readable(front):
                return
            try:
                parts = sockets.receive_frames(front, sockets.NOBLOCK)
            except zmq.Again:
                return
            self.heap.received(parts)
            ran = False
            try:
                if self.link is None:  # ROUTER: [identity, *frames]
                    if len(parts) >= 2:
                        route = parts[0].bytes
                        # where there are keys, a direct peer's tenant is its key (revocation ends its sessions)
                        key = user_of(parts[1]) if self._guard is not None else ""
                        if self._guard is not None and not self._guard.roles(key):
                            # its key was taken out of the allow folder since it connected
                            self.sessions.receive(route, Bye(), now=time.monotonic())
                            self.intake.drop(route)
                            refused = Refusal("this key is no longer allowed on this worker", ref=ref_of(parts[1:]))
                            self.outbox.reply(To(route, key, route=route), refused, refusing=True)
                            continue
                        to = To(route, key, route)
                        work = self.intake.expressed(to, parts[1]) if len(parts) == 2 else None
                        if work is not None:
                            self.runner.start(to, work, None)  # a repeated small call: straight to its run
                            ran = True
                        else:
                            self._take(to, parts[1:])
                else:
                    assert self.link is not None  # a DEALER socket is a dialed worker's
                    relayed = self.link.heard(parts)
                    if relayed is not None:
                        self._take(*relayed)
            except Exception as exc:  # one message's trouble is never the whole worker's
                self._lines.say(logging.WARNING, "a message could not be handled: %s: %s", type(exc).__name__, str(exc))
            if self.heap.due():  # handled, and let go of: what big cargo freed goes back (`.heap`)
                parts = None
                self.heap.trim()
            if ran:  # the next poll looks at everything (a stop, answers, the socket) after a run
                return

    # -- requests ----------------------------------------------------------------------
    def _take(self, to: To, frames: list) -> None:
        """One message from ``to``, acted on once the intake found it allowed (it answers
        what it refuses): a Hello is answered Ready, a Provision provisions, a Work runs."""
        allowed = self.intake.take(to, frames)
        if allowed is None:
            return
        act, message, mounted = allowed
        self._acts[act](to, message, mounted)

    def _greet(self, to: To, hello: Hello, mounted: None) -> None:
        """Act.GREET: Ready, with the proof the Hello asked for."""
        self.outbox.reply(to, self.runner.ready(proof=self.intake.prove(to.peer, hello)))

    def _run(self, to: To, work: Work, mounted: Mounted | Taken | None) -> None:
        """Act.RUN: the Work runs (where it arrived, or in a slot)."""
        self.runner.start(to, work, mounted)

    def _revoke(self) -> None:
        """On the thread holding the socket, after a reload: every session of a key no
        longer allowed ends. Its open work is refused (naming it) and abandoned: the piece
        runs no further node, and nothing it says afterwards leaves (its session is gone)."""
        self._revoking = False
        if self._guard is None:
            return
        allowed = self._guard.allowed()
        why = "this key is no longer allowed on this worker"
        for peer, tenant in self.sessions.peers():
            if not tenant or tenant in allowed:
                continue
            self.runner.abandon(peer)
            to = To(peer, tenant, route=peer)
            for ref in self.sessions.forget(peer):  # the last it hears of that work
                self.outbox.reply(to, Refusal(f"{why}; its work {ref} was abandoned", ref=ref), refusing=True)
            self.intake.drop(peer)
            self.outbox.forget(peer)

    def _provision(self, to: To, message: Provision, mounted: None = None) -> None:
        """Act.PROVISION: import what it names (network mode), then Ready."""
        if self.mode == "network":
            why = compatible(
                self.runtime, self.sessions.runtime(to.peer), needs_pickle=True, me="this worker", them="the client"
            )
            if why is not None:
                self.outbox.reply(to, Refusal(why))
                return
        try:
            self.catalog.provision(message.digest, message.artifact)
        except Refused as exc:
            self.outbox.reply(to, Refusal(str(exc)))
            return
        self.outbox.reply(to, self.runner.ready())
