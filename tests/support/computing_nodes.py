"""Nodes the tests of computing once use: each computation leaves a line in a file."""

from __future__ import annotations

import os
import time

from somatize import Node


class Counted(Node):
    """Doubles its input after ``seconds`` (or as soon as the file ``gate`` exists, when one
    is named), writing a line to ``tally`` each time it runs."""

    def __init__(self, tally: str, seconds: float = 1.0, gate: str = "") -> None:
        self.tally = tally
        self.seconds = seconds
        self.gate = gate

    def forward(self, x):
        with open(self.tally, "a") as out:
            out.write(f"{os.getpid()}\n")
        until = time.monotonic() + self.seconds
        while time.monotonic() < until and not (self.gate and os.path.exists(self.gate)):
            time.sleep(0.01)
        return x * 2


class FailsFirst(Node):
    """Fails the first time (after ``seconds``), leaving ``flag``; returns ``x * 2`` after."""

    def __init__(self, flag: str, seconds: float = 0.5) -> None:
        self.flag = flag
        self.seconds = seconds

    def forward(self, x):
        if not os.path.exists(self.flag):
            open(self.flag, "w").close()
            time.sleep(self.seconds)
            raise RuntimeError("the first computation fails")
        return x * 2


class Plus(Node):
    def __init__(self, n: int) -> None:
        self.n = n

    def forward(self, x):
        return x + self.n
