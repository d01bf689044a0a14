"""Where a worker's pieces run: a job's record, the guard around each node, the slot threads.

A :class:`Job` is one piece of work while it runs: which node runs now, since when, whose it
is, and whether it was abandoned (its peer's key revoked): an abandoned job runs no further
node (:class:`Guarded` checks between nodes) and its answer is never delivered. What is
not for here: sockets, sessions, answers (the serving loop's, :mod:`somatize.fabric.worker.loop`),
what runs now and where (the runner's, :mod:`somatize.fabric.worker.running`).
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
from typing import Any

from ...graph import Node

log = logging.getLogger("somatize.worker")


class NodeExit(Exception):
    """A node raised what is not an ``Exception`` (``SystemExit``, ``KeyboardInterrupt``,
    ``GeneratorExit``): carried as an ordinary error, so it fails the work, not the worker."""

    def __init__(self, raised: BaseException) -> None:
        super().__init__(f"{type(raised).__name__}: {raised}".rstrip(": "))
        self.raised = raised


class Abandoned(Exception):
    """The work's peer may no longer be answered (its key was revoked): the piece stops
    before its next node, and what it would have answered is dropped."""


class Job:
    """One piece of work in a slot: when it started, the node it is running now, the peer it
    answers, and whether it was abandoned."""

    __slots__ = ("abandoned", "held", "node", "peer", "started")

    def __init__(self, node: str, peer: bytes = b"") -> None:
        self.node = node
        self.peer = peer
        self.started = time.monotonic()
        self.abandoned = False
        self.held: Any = None  # a watched piece's facts not sent yet (`.held.Held`)


class Guarded(Node):
    """A node as a worker runs it: says which node runs now, stops the piece before this node
    when the job was abandoned, and turns what is not an ``Exception`` into one
    (:class:`NodeExit`), so the engine names the node that raised."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Guarded:
        return object.__new__(cls)  # made for one piece, never packed: none of `Node`'s bookkeeping

    def __init__(self, node: Node, label: str, job: Job) -> None:
        self.node = node
        self.label = label
        self.job = job

    def forward(self, x: Any) -> Any:
        if self.job.abandoned:
            raise Abandoned("the key of the client this work was for was revoked; the work was abandoned")
        self.job.node = self.label
        try:
            return self.node.forward(x)
        except Exception:
            raise
        except BaseException as exc:
            raise NodeExit(exc) from exc


class Slots:
    """``n`` daemon threads taking jobs in order. Daemons: a node that never returns must not
    keep the process from ending once the worker stops serving."""

    def __init__(self, n: int) -> None:
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._take, daemon=True, name=f"somatize-job-{i}") for i in range(n)]
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Any, *args: Any) -> None:
        self._tasks.put((fn, args))

    def close(self) -> None:
        for _ in self._threads:
            self._tasks.put(None)

    def _take(self) -> None:
        while True:
            task = self._tasks.get()
            if task is None:
                return
            fn, args = task
            try:
                fn(*args)
            except BaseException as exc:  # never lose the slot to a bug
                log.error("a job slot caught %s: %s", type(exc).__name__, exc)


def exit_now() -> None:
    """End the process at once, after saying what is buffered (a stuck thread never returns)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(0)
