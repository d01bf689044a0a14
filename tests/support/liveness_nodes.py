"""Nodes the liveness tests send by name to project-mode workers (``env_with_tests`` puts
this folder on their path)."""

from __future__ import annotations

import time
from pathlib import Path

from somatize import Node


class Marked(Node):
    """Writes ``started`` as it begins, then sleeps ``seconds`` (or, ``spin``, keeps the
    interpreter busy for that long: a piece that never sleeps)."""

    def __init__(self, started: str, seconds: float, spin: bool = False) -> None:
        self.started = started
        self.seconds = seconds
        self.spin = spin

    def forward(self, x):
        Path(self.started).write_text("running")
        until = time.monotonic() + self.seconds
        if not self.spin:
            time.sleep(self.seconds)
        while time.monotonic() < until:
            sum(range(1000))
        return x


class Big(Node):
    """Sleeps ``seconds``, then answers ``nbytes`` bytes: an answer that streams back."""

    def __init__(self, seconds: float, nbytes: int) -> None:
        self.seconds = seconds
        self.nbytes = nbytes

    def forward(self, x):
        time.sleep(self.seconds)
        return bytes([x % 256]) * self.nbytes
