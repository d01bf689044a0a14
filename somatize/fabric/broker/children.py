"""The hosts a broker spawns from its table: started on the first question, checked when a
client says it lost one, and stopped with the broker.

Starting and checking take time (a process to start, a worker to ask), so they run as jobs
of the broker's helper thread (:mod:`somatize.fabric.broker.checks`), never on its serving
thread: one start and one check of a host at a time, whoever asked meanwhile waiting for
the same answer, and at most `MAX_PENDING` questions of one tenant waiting at once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from ...errors import Refused
from ...wire import Located, Refusal, Runtime, Where
from ..hosts import Worker
from .checks import Helper, check
from .spawn import Child, Reach

#: Questions one tenant may have waiting for a start or a check.
MAX_PENDING = 8


class Spawned:
    """The children of a broker, and the questions waiting for them. ``answer(route,
    message)`` sends an answer from the serving thread (a helper job's result is delivered
    there)."""

    def __init__(
        self, helper: Helper, answer: Callable[[bytes, Any], None], *, runtime: Runtime, patience: float, private: bool
    ) -> None:
        self.children: dict[str, Child] = {}
        self._helper = helper
        self._answer = answer
        self.runtime = runtime
        self.patience = patience
        self.private = private  # embedded: its one client is the process its children serve
        self.reach: Reach | None = None  # how other machines reach the children, if they may
        self._lock = threading.Lock()  # the children, also seen from the thread that closes
        self._waiting: dict[tuple[str, str], list] = {}  # (host, "start"|"check") -> [(route, tenant)]
        self._pending: dict[str, int] = {}  # tenant -> questions waiting for a helper job

    def where(self, host: str, declared: Worker, where: Where, route: bytes, tenant: str) -> Located | Refusal | None:
        """The answer now, or None when a helper job will give it (the host to start, or to
        check)."""
        with self._lock:
            child = self.children.get(host)
            if child is None:
                child = self.children[host] = Child(
                    host,
                    declared.argv,
                    mode=declared.mode,
                    mount=declared.mount,
                    own=declared.own_mount,
                    reach=self.reach,
                )
        kind = "check" if where.lost else "start"
        if kind == "start" and child.running and not self._helper.busy(host):
            return child.located(host, declared.mode)
        waiting = self._waiting.get((host, kind))
        if waiting is not None:  # one start, one check of a host at a time: join it
            waiting.append((route, tenant))
            self._pending[tenant] = self._pending.get(tenant, 0) + 1
            return None
        if self._pending.get(tenant, 0) >= MAX_PENDING:
            return Refusal(
                f"you already have {MAX_PENDING} questions waiting at this broker; ask again when they are answered"
            )
        self._waiting[(host, kind)] = [(route, tenant)]
        self._pending[tenant] = self._pending.get(tenant, 0) + 1
        if where.lost:
            # a client's word is not enough to stop a worker others may use: look first
            limit = getattr(declared, "deadline", None)
            if self.private and where.waited_us:
                # the one client of an embedded broker gave up on work after waited_us;
                # a child still busy with work at least half that old is stuck in it
                # (half: the client's wait includes the work's way there)
                waited = where.waited_us / 2e6
                limit = waited if limit is None else min(limit, waited)
            job = lambda: check(child, limit, self.runtime, self.patience)  # noqa: E731
        else:
            job = lambda: None if child.running else child.start()  # noqa: E731

        def done(result: Any) -> None:
            for asker, who in self._waiting.pop((host, kind), []):
                self._pending[who] = self._pending.get(who, 1) - 1
                if self._pending[who] <= 0:
                    del self._pending[who]
                if isinstance(result, Refused):
                    self._answer(asker, Refusal(str(result)))
                elif isinstance(result, Exception):
                    self._answer(
                        asker, Refusal(f"the broker could not start `{host}`: {type(result).__name__}: {result}")
                    )
                else:
                    ended = result if kind == "check" else None
                    self._answer(asker, child.located(host, declared.mode, ended))

        self._helper.submit(host, job, done)
        return None

    def reload(self) -> None:
        with self._lock:
            children = list(self.children.values())
        for child in children:
            child.reload()

    def close(self) -> None:
        with self._lock:
            children, self.children = list(self.children.values()), {}
        for child in children:
            child.stop()
