"""How a worker runs the work it took in: slots, the piece on the receiving thread, the answer.

Where work runs. With ``jobs=1`` (the default) a piece runs on the thread that received it:
no hop to another thread and back, which would cost more than the rest of a small call.
That thread lets go of the socket while the piece runs, and a stand-in thread takes it
once the piece has run ``STAND_IN_AFTER`` seconds, serving (probes answered, new work
refused as busy) until the piece returns and the socket is handed back. With ``jobs=N``
every piece runs on one of N slot threads, and the serving thread never lets go. A piece
that is one node from its input to its output, that nobody watches and that keeps nothing
(most calls), runs that node directly (``engine.run_lone``: as the walk runs it, failures
named the same, with no walk, piece or outcome built); any other is walked
(``engine.run_piece``). After a piece ran, the loop polls again before it reads another
message: a stop, or answers waiting, are seen first.

A ``Work`` whose nodes the catalog lacks is answered ``Send`` (the client hands them over);
one that finds every slot taken is refused at once as busy (``Refusal`` starting with
``busy:``, and a ``said`` fact when watched), never queued. Whatever a piece raises becomes
an answer (``Failed``, ``Refusal``); an answer that cannot be written or does not fit the
wire becomes a ``Failed`` saying so; a mounted answer is written into the shared folder.

What is not for here: receiving (:mod:`somatize.fabric.worker.intake`), the socket loop
(:mod:`somatize.fabric.worker.loop`), sending (:mod:`somatize.fabric.worker.outbox`).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ...engine import format_exception, run_lone, run_piece
from ...errors import CodecError, NodeFailed, ProtocolError, Refused
from ...facts import fact, microseconds
from ...wire import Failed, Mounted, Ready, Refusal, Saw, Send, Work, encode
from .. import mount as _mount
from ..conversation import BUSY
from ..logs import clip
from ..pieces import done, done_of, piece_of
from .attachments import Taken
from .held import Held
from .outbox import To
from .prepared import Prepared
from .slots import Job, NodeExit, Slots
from .standin import STAND_IN_AFTER

if TYPE_CHECKING:
    from ...packing import Catalog
    from ...wire import Runtime
    from .heap import Heap
    from .outbox import Outbox
    from .standin import StandIn

__all__ = ["BUSY_SAID_EVERY", "Runner"]

BUSY_SAID_EVERY = 60.0  # seconds: a refusal as busy is logged at most this often
log = logging.getLogger("somatize.worker")


class Runner:
    """Runs the work a worker took in: where (one slot thread each, or the receiving thread),
    which runs now (by token, under a lock: slot threads and the serving thread both look),
    how much was served, and when a refusal as busy was last logged. Owns the slots and the
    steps kept for pieces run where they arrived; handed the catalog, the worker's runtime,
    heap and mount folder, the outbox its answers go into, the stand-in that serves while a
    piece runs where it arrived, and ``said`` (the worker's ``said`` fact, when one is due)."""

    def __init__(
        self,
        jobs: int,
        *,
        catalog: Catalog,
        runtime: Runtime,
        heap: Heap,
        mount: str | None,
        outbox: Outbox,
        standin: StandIn,
        said: Callable[[], dict[str, str] | None],
    ) -> None:
        self.jobs = jobs
        self.catalog = catalog
        self.runtime = runtime
        self.heap = heap
        self.mount = mount
        self.outbox = outbox
        self.standin = standin
        self.said = said
        self.served = 0
        # one job runs where it arrived (no hop); more run in slots
        self._slots = Slots(jobs) if jobs > 1 else None
        self._running: dict[int, Job] = {}  # what runs now, by token
        self._running_lock = threading.Lock()
        self._tokens = itertools.count(1)
        self._busy_said, self._busy_unsaid = -BUSY_SAID_EVERY, 0  # when a refusal as busy was last logged; since
        self._prepared = Prepared(catalog)  # a recipe's steps, for pieces run where they arrived

    @property
    def in_slots(self) -> bool:
        """Whether pieces run in slots (``jobs`` > 1), not on the thread that received them."""
        return self._slots is not None

    def running(self) -> int:
        """How many pieces of work run now."""
        return len(self._running)

    def abandon(self, peer: bytes) -> None:
        """``peer`` may no longer be answered (its key was revoked): its pieces run no further
        node (`slots.Guarded`)."""
        with self._running_lock:
            for job in self._running.values():
                if job.peer == peer:
                    job.abandoned = True

    def close(self) -> None:
        """The worker closes: the slot threads end once they are free (never waited for)."""
        if self._slots is not None:
            self._slots.close()

    def ready(self, proof: str = "") -> Ready:
        """Ready, saying how long the oldest running work has run (0: idle), and the proof
        that this worker sees its client's folder, when its Hello asked (``Intake.prove``)."""
        oldest = self._oldest()
        busy_us = 0 if oldest is None else max(1, int((time.monotonic() - oldest.started) * 1e6))
        return Ready(self.runtime, busy_us=busy_us, proof=proof)

    def _oldest(self) -> Job | None:
        with self._running_lock:
            return min(self._running.values(), key=lambda job: job.started, default=None)

    def start(self, to: To, work: Work, mounted: Mounted | Taken | None) -> None:
        """Run ``work`` (its nodes all in the catalog, a slot free), or answer why not: ``Send``
        for nodes the catalog lacks, a refusal as busy when every slot is taken."""
        recipe = work.recipe
        assert recipe is not None  # the conversation gives a Work back with its recipe (in full, or recalled)
        try:
            missing = self.catalog.missing(recipe.nodes)
        except Refused as exc:
            self.outbox.reply(to, Refusal(str(exc), ref=work.ref))
            return
        if missing:
            self.outbox.reply(to, Send(work.ref, tuple(missing)))
            return
        with self._running_lock:
            full = len(self._running) >= self.jobs
            if not full:
                token = next(self._tokens)
                job = self._running[token] = Job(recipe.nodes[0].label if recipe.nodes else "?", to.peer)
        if full:
            self._busy(to, work)
            return
        self.served += 1
        if self._slots is not None:
            self._slots.submit(self._run, token, job, to, work, mounted)
        else:
            self._run_here(token, job, to, work, mounted)

    def _run_here(self, token: int, job: Job, to: To, work: Work, mounted: Mounted | Taken | None) -> None:
        """Run a piece on this thread, letting go of the socket meanwhile (the stand-in
        takes it if the piece runs long, :meth:`StandIn.run`), and take it back once the
        piece has returned."""
        try:
            self.standin.run(job, self.outbox.wake, self._run, token, job, to, work, mounted)
        finally:
            with self._running_lock:
                self._running.pop(token, None)
        self.outbox.flush()

    def _busy(self, to: To, work: Work) -> None:
        """Every slot is taken: say so at once (the client makes it ``Busy``), never queue."""
        oldest = self._oldest()
        if oldest is None:  # it returned meanwhile: the client may simply send again
            node, seconds = "?", 0.0
        else:
            node, seconds = oldest.node, time.monotonic() - oldest.started
        slots = f"{self.jobs} piece{'s' if self.jobs > 1 else ''} of work at once"
        took = f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.2g} s"
        why = (
            f"{BUSY}running `{node}` for {took}; this worker runs {slots} and takes "
            f"new work once one returns (start it with --jobs N to run more at once)"
        )
        if work.watched:
            said = fact("said", kind="busy", node=node, running_us=int(seconds * 1e6), jobs=self.jobs)
            self.outbox.reply(to, Saw(work.ref, said))
        self.outbox.reply(to, Refusal(why, ref=work.ref))
        now = time.monotonic()
        if now - self._busy_said >= BUSY_SAID_EVERY:  # a client's own threads taking turns refuse often
            more = f" ({self._busy_unsaid} more refused as busy since the last such line)" if self._busy_unsaid else ""
            self._busy_said, self._busy_unsaid = now, 0
            log.warning("%s%s", why, more)
        else:
            self._busy_unsaid += 1

    def _held_young(self) -> list[tuple[float, Any]]:
        """The pieces in slots whose facts are still held (`.held`), each with when it will
        have run ``STAND_IN_AFTER``."""
        with self._running_lock:
            return [
                (job.started + STAND_IN_AFTER, job.held)
                for job in self._running.values()
                if job.held is not None and job.held.holding
            ]

    def young_until(self) -> float:
        """When the first piece in a slot whose facts are held will have run long."""
        if self._slots is None or not self._running:
            return float("inf")
        return min((due for due, _ in self._held_young()), default=float("inf"))

    def release_held(self, now: float) -> None:
        """Pieces in slots that have run ``STAND_IN_AFTER``: what they said leaves now, and
        what they say later as they say it (for a piece where it arrived, the stand-in does
        this as it takes the socket)."""
        if self._slots is None or not self._running:
            return
        for due, held in self._held_young():
            if due <= now:
                held.release()

    # -- a job, in a slot ----------------------------------------------------------------
    def _run(self, token: int, job: Job, to: To, work: Work, mounted: Mounted | Taken | None) -> None:
        ref = work.ref

        def sent(fact: dict[str, str]) -> None:  # one fact as a Saw of its own, into the outbox
            saw = Saw(ref, fact)
            self.outbox.post(to, saw, encode(saw))

        # what the piece says is held while it is young, to travel inside its Done (`.held`)
        held = job.held = Held(sent) if work.watched else None
        watch = held.told if held is not None else None  # nobody on the other side looks: no facts at all
        said = self.said()
        if said is not None and watch is not None:
            watch(said)
        started = time.perf_counter_ns()
        answer: Any
        built = False
        if isinstance(mounted, Taken):
            work = mounted.restore(work)  # its input, held here until the answer is written
        try:
            # each node built, and so checked, at every call; with one job its steps are kept
            recipe = work.recipe
            assert recipe is not None  # as in `start`: the conversation gave it back with its recipe
            nodes = [self.catalog.build(spec) for spec in recipe.nodes]
            steps, lone = self._prepared.prepare(work, nodes, job, keep=self._slots is None)
            built = True
            if lone is not None and watch is None and not work.keys:
                # one node from input to output, nobody watching, nothing to keep (most
                # calls): the node runs as the walk would run it, with no walk built
                answer = done(work.ref, run_lone(lone, work.input), microseconds(time.perf_counter_ns() - started))
            else:
                outcome = run_piece(piece_of(work, steps), watch)
                answer = done_of(
                    work.ref,
                    outcome,
                    microseconds(time.perf_counter_ns() - started),
                    held.take() if held is not None else (),
                )
        except NodeFailed as exc:
            cause: BaseException | None  # let go of below, once told
            cause = exc.__cause__ or exc
            if isinstance(cause, NodeExit):
                cause = cause.raised
            answer = Failed(
                work.ref,
                # a node raised: what it raised; an import or a build: what was being done
                why=clip(f"{type(cause).__name__}: {cause}" if built else str(exc), 64 << 10),
                node=exc.node,
                error=type(cause).__name__ if exc.__cause__ is not None else exc.error,
                traceback=clip(format_exception(cause), 512 << 10),
            )
            # its traceback holds this frame, and the frames below it the message as it
            # arrived: kept in a local, that cycle would hold the input until a collection
            cause = None
        except Refused as exc:
            answer = Refusal(str(exc), ref=work.ref)
        except BaseException as exc:  # the worker's own trouble: still an answer, never a hang
            answer = failed_answer(work.ref, exc, traceback=format_exception(exc))
        if isinstance(answer, (Failed, Refusal)):
            if held is not None:
                held.release()  # what the piece said leaves first, as Saws
            answer = self.outbox.stale(answer)  # here, before it is written into a segment
        try:
            frames = encode(answer)
        except (CodecError, ValueError) as exc:  # unwritable, or over a wire limit
            for early in getattr(answer, "saw", ()):  # what the piece said still leaves, first
                sent(early)
            answer = failed_answer(work.ref, exc, why=f"what this work produced cannot travel back: {exc}")
            frames = encode(answer)
        self.heap.moved(frames)
        if isinstance(mounted, Taken):
            # pooled: frames into a spare segment (a view of the input goes back as a span of
            # it), then everything of ours that points into the segments is let go of, and
            # an anchor still alive is a view a node kept: the answer names it in `kept`
            try:
                mounted.write(frames)
            except (OSError, Refused, ProtocolError) as exc:
                mounted.write(
                    encode(failed_answer(ref, exc, why=f"the answer could not be written to the shared folder: {exc}"))
                )
            if hasattr(answer, "produced"):  # a Done: the conversation needs only its kind and ref
                answer = dataclasses.replace(answer, output=None, produced={})
            # the input, the output: let go of here, so the locals are rebound to None on purpose
            work = frames = outcome = cause = None  # type: ignore[assignment]  # noqa: F841
            frames = mounted.sealed()
        elif mounted is not None and self.mount is not None and len(frames) > 1:
            try:  # named for the client, which removes them once read
                frames, _ = _mount.write(frames, self.mount, answering=mounted)
            except (OSError, Refused) as exc:
                answer = failed_answer(
                    work.ref, exc, why=f"the answer could not be written to the shared folder: {exc}"
                )
                frames = encode(answer)
        if self._slots is not None:
            with self._running_lock:
                # the slot is free before the answer leaves: a client that sends again at
                # once never finds this worker busy with the work it just got the answer of
                self._running.pop(token, None)
        else:
            self.standin.returned()  # a stand-in sends this answer, then takes nothing new
        self.outbox.post(to, answer, frames)


def failed_answer(ref: int, exc: BaseException, *, why: str | None = None, traceback: str = "") -> Failed:
    """The worker's own trouble (no node to blame) as a ``Failed``, its texts cut to bounds."""
    return Failed(
        ref,
        why=clip(why or f"{type(exc).__name__}: {exc}", 64 << 10),
        node=None,
        error=type(exc).__name__,
        traceback=clip(traceback, 512 << 10),
    )
