"""Nodes the mapping tests send to pool members (by value, ``send=[this module]``)."""

from __future__ import annotations

import os
import time

from somatize import Node


class Who(Node):
    """``(x, the pid that ran it)``, after ``seconds``; each call noted in ``log`` (one
    line per run, ``x pid``), so a test can count where and how often an input ran."""

    def __init__(self, seconds: float = 0.0, log: str | None = None) -> None:
        self.seconds = seconds
        self.log = log

    def forward(self, x):
        if self.log is not None:
            with open(self.log, "a") as out:
                out.write(f"{x} {os.getpid()}\n")
        if self.seconds:
            time.sleep(self.seconds)
        return (x, os.getpid())


class FailsOn(Node):
    """Raises for the inputs in ``bad``; ``x * 10`` for the others."""

    def __init__(self, bad: tuple[int, ...]) -> None:
        self.bad = bad

    def forward(self, x):
        if x in self.bad:
            raise ValueError(f"no good: {x}")
        return x * 10


class Hold(Node):
    """Sleeps until the file ``until`` exists (at most 30 s), then answers ``x``; says it
    started by writing ``started``."""

    def __init__(self, started: str, until: str) -> None:
        self.started = started
        self.until = until

    def forward(self, x):
        with open(self.started, "w") as out:
            out.write(str(os.getpid()))
        deadline = time.monotonic() + 30
        while not os.path.exists(self.until) and time.monotonic() < deadline:
            time.sleep(0.01)
        return x
