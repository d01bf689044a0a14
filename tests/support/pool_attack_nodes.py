"""Nodes the pool attack tests send to pool members (by value, ``send=[this module]``)."""

from __future__ import annotations

import os

from somatize import Node


class Add(Node):
    """``x + k``; each call noted in ``log`` (``x pid``) when given one."""

    def __init__(self, k: int = 1, log: str | None = None) -> None:
        self.k = k
        self.log = log

    def forward(self, x):
        if self.log is not None:
            with open(self.log, "a") as out:
                out.write(f"{x} {os.getpid()}\n")
        return x + self.k


class Pid(Node):
    """``(x, pid)``."""

    def forward(self, x):
        return (x, os.getpid())
