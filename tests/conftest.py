"""Shared fixtures: real processes, started and always reaped."""

from __future__ import annotations

import contextlib
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
#: The helpers the tests share (played peers, harnesses, nodes workers import by name): on the
#: path of the tests and of every process they start (`env_with_tests`).
SUPPORT = TESTS / "support"
sys.path.insert(0, str(SUPPORT))
WORKER = [sys.executable, "-m", "somatize.worker"]
BROKER = [sys.executable, "-m", "somatize.broker"]
#: Run what follows as another local user, `nobody`, with no groups of ours.
SETPRIV = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]


class Process:
    """A child process; its first stdout line holding ``announce`` gives its endpoint.

    Its stderr goes to a file under ``logs``, never a pipe: a chatty child can never block
    on a pipe nobody reads. ``stop()`` resumes a stopped child before ending it, and reaps it.
    """

    def __init__(
        self,
        argv: list[str],
        *,
        logs: Path | None = None,
        env: dict | None = None,
        announce: str | None = "ready ",
        stdin: bool = False,
        deadline: float = 30.0,
    ) -> None:
        self.argv = argv
        logs = Path(logs) if logs is not None else Path(tempfile.mkdtemp(prefix="somatize-test-"))
        logs.mkdir(parents=True, exist_ok=True)
        self.log = logs / f"stderr-{time.monotonic_ns()}-{os.getpid()}.txt"
        self._err = open(self.log, "wb")  # noqa: SIM115 - the child writes to it until stop()
        self.popen = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self._err,
            env=env,
        )
        self.endpoint = ""
        if announce is not None:
            line = self.line(deadline)
            if announce not in line:
                self.stop()
                raise RuntimeError(f"{argv} did not announce itself: {line!r}\n{self.stderr()}")
            self.endpoint = line.split(announce, 1)[1].strip()

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def line(self, deadline: float = 30.0) -> str:
        """The next line on its stdout, or what came of it within ``deadline`` seconds."""
        assert self.popen.stdout is not None
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

    def tell(self, text: str) -> None:
        assert self.popen.stdin is not None
        self.popen.stdin.write(text.encode())
        self.popen.stdin.flush()

    def stderr(self) -> str:
        if not self._err.closed:
            self._err.flush()
        return self.log.read_text(errors="replace")

    def signal(self, signum: int) -> None:
        if self.alive:
            os.kill(self.pid, signum)

    def stop(self, grace: float = 5.0) -> int:
        """End it (SIGCONT, SIGTERM, then SIGKILL) and reap it; return its exit code."""
        if self.popen.poll() is None:
            try:
                os.kill(self.pid, signal.SIGCONT)  # a stopped child cannot act on SIGTERM
                self.popen.send_signal(signal.SIGTERM)
                self.popen.wait(grace)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(grace)
            except ProcessLookupError:
                pass
        for stream in (self.popen.stdin, self.popen.stdout):
            if stream is not None:
                try:
                    stream.close()
                except OSError:
                    pass
        self._err.close()
        return self.popen.returncode


@pytest.fixture
def processes(tmp_path):
    """Start processes with ``processes(argv, ...)``; every one is stopped and reaped after."""
    started: list[Process] = []

    def start(argv: list[str], **options) -> Process:
        process = Process(argv, logs=tmp_path / "logs", **options)
        started.append(process)
        return process

    yield start
    for process in reversed(started):
        process.stop()


@pytest.fixture(scope="module")
def python_for_nobody():
    """A Python interpreter `nobody` may run (ours may sit in root's 0700 home)."""
    if os.geteuid() != 0:
        pytest.skip("playing another local user needs root (to run a process as `nobody`)")
    if shutil.which("setpriv") is None:
        pytest.skip("playing another local user needs `setpriv` (util-linux)")
    for candidate in dict.fromkeys([sys.executable, shutil.which("python3"), "/usr/bin/python3"]):
        if (
            candidate
            and subprocess.run([*SETPRIV, candidate, "-c", "pass"], cwd="/", capture_output=True, timeout=30).returncode
            == 0
        ):
            return candidate
    pytest.skip("no Python interpreter that `nobody` may run (ours lies in a folder closed to it)")


def env_with_tests() -> dict:
    """This environment, with the tests' helpers importable (for project-mode workers)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SUPPORT), str(TESTS), env.get("PYTHONPATH", "")]))
    return env


# -- nothing left behind ----------------------------------------------------------------------
SHM = Path("/dev/shm")


def _shm_entries() -> set[str]:
    """What is in /dev/shm, and inside this project's folders there."""
    try:
        names = set(os.listdir(SHM))
    except OSError:
        return set()
    found = set(names)
    for name in names:
        if name.startswith("somatize"):
            try:
                found.update(f"{name}/{inner}" for inner in os.listdir(SHM / name))
            except OSError:
                pass  # another user's, or gone meanwhile
    return found


def pytest_sessionstart(session):
    session.config._shm_before = _shm_entries()


# -- the benchmark's quick run, beside the rest -------------------------------------------------
QUICK_RUN = "tests/test_benchmarks.py::test_the_quick_run_measures_every_case"


@pytest.hookimpl(trylast=True)  # after `-k` and `-m` have deselected what they leave out
def pytest_collection_modifyitems(session, config, items):
    """The benchmark's quick run takes a minute and more, in a process of its own: it starts
    as the suite starts and runs beside the other tests, and its test, moved to the end,
    reads what it printed. Honest, since that test asserts what the run prints (a row for
    every case, PASS or MISS where there is a target), never a timing. Started only when its
    test is to run (not for ``--collect-only``, which runs nothing)."""
    if hasattr(config, "workerinput") or config.getoption("collectonly", False):
        return
    chosen = [item for item in items if item.nodeid == QUICK_RUN]
    if not chosen:
        return
    items.remove(chosen[0])
    items.append(chosen[0])
    out = tempfile.TemporaryFile("w+")
    err = tempfile.TemporaryFile("w+")
    root = TESTS.parent
    proc = subprocess.Popen(
        # Ray and Dask, where someone installed them (`.[bench]`), load both cores for minutes
        # beside the suite: their rows are checked to be there, saying they were left out
        [sys.executable, str(root / "benchmarks" / "run.py"), "--quick", "--markdown", "--without-others"],
        cwd=root,
        stdout=out,
        stderr=err,
        text=True,
        start_new_session=True,
    )
    config._quick_run = (proc, out, err)


def quick_run_result(config, timeout: float) -> subprocess.CompletedProcess:
    """What the quick run started at collection printed, once it has ended."""
    proc, out, err = config._quick_run
    proc.wait(timeout)
    out.seek(0)
    err.seek(0)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out.read(), err.read())


def _end_quick_run(config) -> None:
    started = getattr(config, "_quick_run", None)
    if started is None:
        return
    proc, out, err = started
    if proc.poll() is None:  # the suite stopped early: the run and what it started go too
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    out.close()
    err.close()


def pytest_sessionfinish(session, exitstatus):
    """The suite leaves nothing in /dev/shm: no segment, no folder, not even an empty one.
    Whatever appeared during the run and is still there fails the run, by name."""
    if hasattr(session.config, "workerinput"):
        return  # a pytest-xdist worker: the controller looks once everything has ended
    _end_quick_run(session.config)
    left = sorted(_shm_entries() - getattr(session.config, "_shm_before", set()))
    if left:
        session.config._shm_left = left
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    left = getattr(config, "_shm_left", None)
    if left:
        terminalreporter.write_line(
            f"FAILED: the suite left {len(left)} entries in /dev/shm: {', '.join(left[:20])}", red=True
        )


# -- pure tests: no process, no socket ------------------------------------------------------
def pytest_ignore_collect(collection_path, config):
    """With ``-m pure``, a test file with no pure test in it is not even imported: importing
    every file (torch, Optuna, Playwright) takes longer than running the pure tests."""
    if config.getoption("markexpr", "") != "pure" or collection_path.suffix != ".py":
        return None
    if not collection_path.name.startswith("test_"):
        return None
    return "mark.pure" not in collection_path.read_text() or None


class Impure(AssertionError):
    """A test marked ``pure`` started a process or opened a socket."""


@pytest.fixture(autouse=True)
def _pure_guard(request):
    """A test marked ``pure`` (``python -m pytest -m pure``: the I/O-free set, in seconds)
    may start no process and open no socket, ZeroMQ's or the system's: each attempt fails
    it, even one the code under test catches. ``SOMATIZE_FIND_PURE=1`` guards every test,
    to find which could be marked."""
    if request.node.get_closest_marker("pure") is None and not os.environ.get("SOMATIZE_FIND_PURE"):
        yield
        return
    import socket

    import zmq

    monkeypatch = request.getfixturevalue("monkeypatch")  # only where guarded: not one per test
    tried: list[str] = []

    def refuse(what: str):
        def refused(*args, **kwargs):
            tried.append(what)
            raise Impure(f"a pure test {what}: mark it otherwise, or take the I/O out")

        return refused

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse("started a process"))
    monkeypatch.setattr(os, "fork", refuse("forked"))
    monkeypatch.setattr(os, "posix_spawn", refuse("started a process"))
    monkeypatch.setattr(socket.socket, "__init__", refuse("opened a socket"))
    monkeypatch.setattr(zmq.Context, "socket", refuse("opened a ZeroMQ socket"))
    yield
    if tried:
        raise Impure(f"a pure test {tried[0]} ({len(tried)} attempts)")


# -- the client's express way ------------------------------------------------------------
@pytest.fixture
def ways(monkeypatch):
    """Which way each call of ``Channel.run`` that asked ``_express`` went (a channel's first
    call, its Work right behind its Hello, does not ask): "express" (its Done taken the short way),
    "express, then settled" (sent the short way, answered otherwise, then concluded by
    ``_settle``, or raised), or "general" (``_express`` declined, having sent nothing)."""
    taken: list[str] = []
    from somatize.fabric.client.channel import Channel

    real = Channel._express
    real_settle = Channel._settle

    def express(self, piece):
        self._in_express, self._settled = True, False
        try:
            outcome = real(self, piece)
        except BaseException:
            taken.append("express, then settled")
            raise
        finally:
            self._in_express = False
        if outcome is None:
            taken.append("general")
        elif getattr(self, "_settled", False):
            taken.append("express, then settled")
        else:
            taken.append("express")
        return outcome

    def settle(self, *args, **kwargs):
        if getattr(self, "_in_express", False):
            self._settled = True
        return real_settle(self, *args, **kwargs)

    monkeypatch.setattr(Channel, "_express", express)
    monkeypatch.setattr(Channel, "_settle", settle)
    return taken


@pytest.fixture
def played():
    """``played(answer, **options)``: a worker played by hand (``peers.FakeWorker``); each
    is closed after the test, and none may have failed to write what the test asked of it."""
    from peers import FakeWorker

    fakes: list = []

    def start(answer, **options):
        fake = FakeWorker(answer, **options)
        fakes.append(fake)
        return fake

    yield start
    for fake in fakes:
        fake.close()
    assert not [e for fake in fakes for e in fake.errors], "the played worker could not write an answer"


# -- a real worker spoken to by hand (`by_hand`) -------------------------------------------------
@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """One listening project-mode worker (one job) for the tests that only talk to it."""
    from reliability_support import child_env

    worker = Process(
        [*WORKER, "--listen", "127.0.0.1:0", "--announce"], env=child_env(), logs=tmp_path_factory.mktemp("logs")
    )
    yield worker
    worker.stop()


@pytest.fixture
def raws():
    """``raws(endpoint, greet=True)``: a raw client (``peers.Raw``), greeted unless told not
    to; every one is closed after."""
    from by_hand import greeted
    from peers import Raw

    made: list[Raw] = []

    def make(endpoint: str, *, greet: bool = True) -> Raw:
        raw = greeted(endpoint) if greet else Raw(endpoint)
        made.append(raw)
        return raw

    yield make
    for raw in made:
        raw.close()


@pytest.fixture
def serving():
    """``serving(**options)``: a WorkerLoop serving on a thread of this process (so a test may
    count what it calls); every one is stopped and joined after."""
    import threading

    from somatize.fabric.worker.loop import WorkerLoop

    started: list[tuple[WorkerLoop, threading.Thread]] = []

    def start(**options) -> tuple[WorkerLoop, str, threading.Thread]:
        loop = WorkerLoop(mode="project", **options)
        endpoint = loop.bind("tcp://127.0.0.1:0")
        thread = threading.Thread(target=loop.serve, daemon=True)
        thread.start()
        started.append((loop, thread))
        return loop, endpoint, thread

    yield start
    for loop, thread in started:
        loop.stopping.set()
        thread.join(10)
        assert not thread.is_alive(), "a worker loop did not stop"
