"""Nodes the worker-holds tests send to real workers, by name (project mode)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from somatize import Node


class Big(Node):
    """Returns ``size`` bytes of ones, whatever comes in: a big answer from a small request."""

    def __init__(self, size: int) -> None:
        self.size = size

    def forward(self, x):
        return np.ones(self.size, dtype=np.uint8)


class Hold(Node):
    """Writes ``started``, runs until ``release`` exists (a minute at most), writes
    ``finished``, and returns its input."""

    def __init__(self, started: str, release: str, finished: str) -> None:
        self.started, self.release, self.finished = started, release, finished

    def forward(self, x):
        Path(self.started).write_text(str(os.getpid()))
        until = time.monotonic() + 60
        while not os.path.exists(self.release) and time.monotonic() < until:
            time.sleep(0.01)
        Path(self.finished).write_text("done")
        return x


class Mark(Node):
    """Writes ``path`` when it runs (so a test can tell it never ran), and returns its input."""

    def __init__(self, path: str) -> None:
        self.path = path

    def forward(self, x):
        Path(self.path).write_text("ran")
        return x
