"""Spawned workers: started on first use, watched, described when they end, always reaped.

A child is started as ``argv + ["--listen", "127.0.0.1:0", "--announce", ...]``; it binds a
port the kernel picks and prints one line with its endpoint, which is read with a
deadline. Everything it prints afterwards is passed on, prefixed with the host's name.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import threading
import time

from ..errors import Refused

ANNOUNCE = "somatize-worker ready "
START_DEADLINE = 30.0
STOP_GRACE = 1.5


class Child:
    """One spawned worker process for one host."""

    def __init__(self, host: str, argv: tuple[str, ...], *, mode: str, mount: str | None) -> None:
        self.host = host
        self.argv = argv
        self.mode = mode
        self.mount = mount
        self.process: subprocess.Popen | None = None
        self.address = ""

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> str:
        """Start the child and return its endpoint, or raise ``Refused`` saying why not."""
        command = [*self.argv, "--listen", "127.0.0.1:0", "--announce", "--mode", self.mode, "--parent", str(os.getpid())]
        if self.mount:
            command += ["--mount", self.mount]
        try:
            process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, bufsize=0)
        except OSError as exc:
            raise Refused(f"the worker for `{self.host}` could not be started from {list(self.argv)}: {exc}") from exc
        self.process = process
        line = _first_line(process, START_DEADLINE)
        if line is None or not line.startswith(ANNOUNCE):
            ended = self.ended() if process.poll() is not None else None
            self.stop()
            raise Refused(
                f"the worker for `{self.host}` did not start: {list(self.argv)} "
                + (f"{ended} (its stderr is above)" if ended else f"said nothing usable within {START_DEADLINE:.0f} s")
                + "; check that it runs `python -m somatize.worker`"
            )
        self.address = line[len(ANNOUNCE):].strip()
        threading.Thread(target=_relay_output, args=(process, self.host), daemon=True, name=f"somatize-{self.host}-out").start()
        return self.address

    def settle(self, seconds: float) -> None:
        """Give a child that is exiting a moment to finish, so ``ended`` can say how."""
        if self.process is not None:
            try:
                self.process.wait(seconds)
            except subprocess.TimeoutExpired:
                pass

    def ended(self) -> str:
        """How the child ended, as words: "killed by SIGKILL", "exited with code 3"."""
        if self.process is None:
            return "never started"
        code = self.process.poll()
        if code is None:
            return "still running"
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return f"killed by {name}"
        return f"exited with code {code}"

    def kill(self) -> None:
        """SIGKILL at once and reap (for a child that stopped answering: no grace to wait)."""
        process = self.process
        if process is not None and process.poll() is None:
            try:
                process.kill()
                process.wait(STOP_GRACE)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        self.stop()

    def stop(self) -> None:
        """Terminate, wait a moment, then kill; always reaped."""
        process = self.process
        if process is None:
            return
        if process.poll() is None:
            try:
                process.terminate()
                os.kill(process.pid, signal.SIGCONT)  # a stopped child acts on SIGTERM only once resumed
                process.wait(STOP_GRACE)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(STOP_GRACE)
            except ProcessLookupError:
                pass
        if process.stdout is not None:
            process.stdout.close()


def _first_line(process: subprocess.Popen, deadline: float) -> str | None:
    assert process.stdout is not None
    selector = selectors.DefaultSelector()
    selector.register(process.stdout, selectors.EVENT_READ)
    buffer = b""
    until = time.monotonic() + deadline
    try:
        while b"\n" not in buffer:
            left = until - time.monotonic()
            if left <= 0 or not selector.select(left):
                return None
            chunk = os.read(process.stdout.fileno(), 1)  # one byte at a time: leave the rest for the relay
            if not chunk:
                return None
            buffer += chunk
    finally:
        selector.close()
    return buffer.decode(errors="replace").strip()


def _relay_output(process: subprocess.Popen, host: str) -> None:
    stream = process.stdout
    if stream is None:
        return
    try:
        for raw in iter(stream.readline, b""):
            sys.stdout.write(f"[{host}] {raw.decode(errors='replace')}")
            sys.stdout.flush()
    except (OSError, ValueError):
        pass  # closed on stop
