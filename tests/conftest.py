"""Shared fixtures: real processes, started and always reaped."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
WORKER = [sys.executable, "-m", "somatize.worker"]
BROKER = [sys.executable, "-m", "somatize.broker"]


class Process:
    """A child process whose first stdout line announces its endpoint; reaped on stop()."""

    def __init__(self, argv: list[str], *, env: dict | None = None, announce: str | None = "ready ") -> None:
        self.argv = argv
        self.popen = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
        )
        self.endpoint = ""
        if announce is not None:
            line = self._line(20.0)
            if announce not in line:
                self.stop()
                raise RuntimeError(f"{argv} did not announce itself: {line!r} {self.stderr()}")
            self.endpoint = line.split(announce, 1)[1].strip()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def _line(self, deadline: float) -> str:
        selector = selectors.DefaultSelector()
        selector.register(self.popen.stdout, selectors.EVENT_READ)
        data = b""
        until = time.monotonic() + deadline
        try:
            while b"\n" not in data and time.monotonic() < until:
                if selector.select(max(0.0, until - time.monotonic())):
                    chunk = os.read(self.popen.stdout.fileno(), 1)
                    if not chunk:
                        break
                    data += chunk
        finally:
            selector.close()
        return data.decode(errors="replace")

    def stderr(self) -> str:
        if self.popen.poll() is None:
            return ""
        return self.popen.stderr.read().decode(errors="replace")

    def stop(self) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(5)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        for stream in (self.popen.stdout, self.popen.stderr):
            if stream is not None:
                stream.close()
        return self.popen.returncode


@pytest.fixture
def processes():
    """Start processes with ``processes(argv, ...)``; every one is stopped and reaped after."""
    started: list[Process] = []

    def start(argv: list[str], **options) -> Process:
        process = Process(argv, **options)
        started.append(process)
        return process

    yield start
    for process in reversed(started):
        process.stop()


def env_with_tests() -> dict:
    """This environment, with the tests folder importable (for project-mode workers)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH", "")]))
    return env
