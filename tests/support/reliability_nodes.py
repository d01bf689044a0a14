"""Nodes the reliability tests send to project-mode workers, by import name."""

from __future__ import annotations

import hashlib
import os

from somatize import Node


def tag_of(x: str) -> str:
    return hashlib.sha256(x.encode()).hexdigest()[:16]


class Tag(Node):
    """Answers ``[x, tag_of(x)]``, so a caller can tell an answer derived from its own input,
    and appends ``x`` to a log, so a test can count how often each input ran."""

    def __init__(self, log: str) -> None:
        self.log = log
        self._fd: int | None = None

    def forward(self, x):
        if self._fd is None:
            self._fd = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.write(self._fd, (x + "\n").encode())  # one write under O_APPEND: lines never mix
        return [x, tag_of(x)]
