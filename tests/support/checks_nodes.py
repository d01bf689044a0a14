"""Nodes for the tests of the broker's checks on spawned workers (``test_checks_*``): a piece
that runs until the test says so, waiting on a file, never on the clock."""

from __future__ import annotations

import os
import time
from pathlib import Path

from somatize import Node


class Until(Node):
    """Writes ``started`` (its pid) as it begins, then runs until ``go`` exists (60 s at
    most, so a test that fails never leaves it running); returns its input and its pid."""

    def __init__(self, started: str, go: str) -> None:
        self.started, self.go = started, go

    def forward(self, x):
        Path(self.started).write_text(str(os.getpid()))
        until = time.monotonic() + 60.0
        while not os.path.exists(self.go) and time.monotonic() < until:
            time.sleep(0.02)
        return [x, os.getpid()]
