"""Nodes the fabric tests send to workers (by value with send=[this module], or by name)."""

from __future__ import annotations

import os
import time

import numpy as np

from somatize import Node


class Add(Node):
    def __init__(self, n: int = 1) -> None:
        self.n = n

    def forward(self, x):
        return x + self.n


class Scale(Node):
    def __init__(self, factor: float = 2.0) -> None:
        self.factor = factor

    def forward(self, x):
        return np.asarray(x) * self.factor


class Sleep(Node):
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def forward(self, x):
        time.sleep(self.seconds)
        return x


class Boom(Node):
    def forward(self, x):
        raise ValueError("remote trouble")


class Pid(Node):
    def forward(self, x):
        return os.getpid()


class Count(Node):
    """Counts its calls in a file, so a test can tell whether it ran anywhere."""

    def __init__(self, path: str) -> None:
        self.path = path

    def forward(self, x):
        with open(self.path, "a") as out:
            out.write("x\n")
        return np.arange(3) + x


class FolderSeen(Node):
    """How big its input was, and how many cargo files were in ``folder`` as it ran (what
    the Mount path wrote there for it, seen from where it runs)."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def forward(self, x):
        from somatize.fabric.mount import NAME

        return [int(np.asarray(x).nbytes), sum(1 for n in os.listdir(self.folder) if NAME.fullmatch(n))]


class Echo(Node):
    def forward(self, x):
        return x


class Wrap(Node):
    """Wraps what it is given in a list: tells how often, and in what order, it ran."""

    def forward(self, x):
        return [x]


class BadStr(Exception):
    """An exception that cannot say what it is: its ``str`` raises."""

    def __str__(self) -> str:
        raise RuntimeError("no words for it")


def _fail_here(how: str):
    """A frame of its own, named, that every traceback of these failures has to hold."""
    if how == "value":
        raise ValueError("lone trouble")
    if how == "exit":
        raise SystemExit(3)
    if how == "interrupt":
        raise KeyboardInterrupt("stop it")
    if how == "generator":
        raise GeneratorExit("closed")
    if how == "bad str":
        raise BadStr()
    if how == "unwritable":
        return object()
    if how == "too deep":  # nests past what any reader accepts: over the wire's limits
        nested: list = []
        for _ in range(80):
            nested = [nested]
        return nested
    if how == "over the header limit":  # many small values: all in the header
        return ["abcd"] * 20_000
    if how == "itself":
        looped: list = []
        looped.append(looped)
        return looped
    raise AssertionError(how)


class Raiser(Node):
    """Fails the way it is told (raises, or returns what cannot travel back)."""

    def __init__(self, how: str) -> None:
        self.how = how

    def forward(self, x):
        return _fail_here(self.how)
