"""Nodes and non-nodes for tests/test_packing.py, importable by name (project mode)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from somatize import Node


class Add(Node):
    def __init__(self, n, *, scale=1):
        self.n = n
        self.scale = scale

    def forward(self, x):
        return (x + self.n) * self.scale


class Slow(Node):
    """Counts how many times it was constructed; takes a moment to build, like a model."""

    built = 0
    _lock = threading.Lock()

    def __init__(self, tag):
        time.sleep(0.05)
        with Slow._lock:
            Slow.built += 1
        self.tag = tag

    def forward(self, x):
        return (self.tag, x)


class Outer:
    class Inner(Node):
        def forward(self, x):
            return -x


class Touch:
    """Not a Node: building it would create a file."""

    def __init__(self, path):
        Path(path).write_text("called")


def touch(path):
    """Not a Node: calling it would create a file."""
    Path(path).write_text("called")
