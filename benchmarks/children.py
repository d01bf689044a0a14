"""Processes the benchmarks start: each announces its endpoint on stdout, each is reaped.

Use as a context manager. Stopping is SIGTERM, a moment's grace, then SIGKILL, and always a
``wait``: nothing started here outlives the run, whatever happened in it.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time

START_DEADLINE = 60.0  # a loaded 2-core machine takes a while to import numpy and zmq


class Child:
    """A child process; with ``announce``, its first stdout line ends with its endpoint."""

    def __init__(self, argv: list[str], *, announce: str | None = None) -> None:
        self.argv = argv
        self.endpoint = ""
        self.popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
        if announce is None:
            return
        line = self._first_line(START_DEADLINE)
        if announce not in line:
            self.stop()
            raise RuntimeError(f"{argv} did not announce itself within {START_DEADLINE:.0f} s (said {line!r})")
        self.endpoint = line.split(announce, 1)[1].strip()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _first_line(self, deadline: float) -> str:
        assert self.popen.stdout is not None
        selector = selectors.DefaultSelector()
        selector.register(self.popen.stdout, selectors.EVENT_READ)
        data = b""
        until = time.monotonic() + deadline
        try:
            while b"\n" not in data and time.monotonic() < until:
                if selector.select(max(0.0, until - time.monotonic())):
                    chunk = os.read(self.popen.stdout.fileno(), 1)  # leave the rest unread
                    if not chunk:
                        break
                    data += chunk
        finally:
            selector.close()
        return data.decode(errors="replace")

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(5)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        if self.popen.stdout is not None:
            self.popen.stdout.close()


#: A standalone broker on a port of its choosing, announcing itself; quiet but for warnings.
BROKER = [
    sys.executable,
    "-m",
    "somatize.broker",
    "--listen",
    "tcp://127.0.0.1:0",
    "--announce",
    "--log-level",
    "warning",
]
BROKER_READY = "somatize-broker ready "


def status(pid: int, field: str) -> int:
    """A field of ``/proc/PID/status`` in bytes (``VmRSS``, ``VmHWM``)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def cpu_seconds(pid: int) -> float:
    """The CPU time a process used so far (user and system)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
