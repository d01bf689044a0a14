"""The nodes the benchmarks run. Spawned workers get them by value (``send=[nodes]``)."""

from __future__ import annotations

from somatize import Node


class Echo(Node):
    """Gives back its input: a round trip measures the path, not the node."""

    def forward(self, x):
        return x


class Inc(Node):
    """``x + 1``: about the least a node can do."""

    def forward(self, x):
        return x + 1
