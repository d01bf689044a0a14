"""Spawned workers: started on first use, watched, described when they end, always reaped.

A child is started as ``argv + ["--listen", "ipc:///.../w.sock", "--announce", ...]`` and
prints one line with its endpoint, which is read with a deadline and must be the socket it
was given. Everything it prints afterwards is passed on, prefixed with the host's name.

Who may reach a child: only this user's processes, unless its broker listens for other
machines with keys (``reach``): then the child listens on the broker's address, on a port of
its own, with a key pair the broker made for it in that private directory, and allows the
keys the broker allows (``--allow``, copied into that directory and copied again when the
broker is reloaded) and one more: the key the broker checks on it with (``checker``, made
for that child, its secret never written down), so that the broker's probe speaks CURVE as
the child asks; a client checks it reached that child by its public key, which the broker
names in ``Located.key``.
Otherwise its socket lies in a fresh 0700 directory this process makes (``tempfile.mkdtemp`` under ``$XDG_RUNTIME_DIR``, else the
temporary folder), so the kernel refuses another user's ``connect`` before a byte is read;
no TCP port is opened for anyone to find in ``/proc/net/tcp``. (An ipc round trip costs no
more than a TCP one on loopback, and needs no keys to hand over.) The directory is removed
when the child is stopped or killed, also when it died on its own; one left by a parent
that was itself killed is removed by the next ``start`` that finds its socket dead.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import selectors
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import zmq

from ...errors import BadKeys, Refused
from ...wire import Located
from .. import mount as _mount
from ..curve import Keys, make_pair, read_allowed, read_public, write_public

ANNOUNCE = "somatize-worker ready "
START_DEADLINE = 30.0
STOP_GRACE = 1.5
#: The longest socket path used: the kernel's limit is 107 characters.
MAX_SOCKET_PATH = 100
_DIRECTORY = re.compile(r"somatize-(\d+)-[a-z0-9_]+")


class Child:
    """One spawned worker process for one host."""

    def __init__(
        self,
        host: str,
        argv: tuple[str, ...],
        *,
        mode: str,
        mount: str | None,
        own: bool = False,
        reach: Reach | None = None,
    ) -> None:
        self.host = host
        self.argv = argv
        self.mode = mode
        self.mount = mount
        self.reach = reach
        self.key = ""  # its public key (Z85), when it listens for other machines
        self.checker: Keys | None = None  # the keys the broker probes it with, when it has keys
        self.seen = ""  # the mark in its default folder, when clients elsewhere may not see it
        # no mount named: this user's default folder, looked at each start, since another
        # user may take its name in /dev/shm at any time (then: the socket, never a failure)
        self.own = own
        self.process: subprocess.Popen | None = None
        self.address = ""
        self.directory: str | None = None  # the private directory holding the child's socket
        self._warned = False

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> str:
        """Start the child (stopping one still running) and return its endpoint, or raise
        ``Refused`` saying why not."""
        self.stop()  # a child that died on its own leaves a directory to remove
        if self.own:
            self.mount = self._own_folder()
        if self.mount:
            _mount.private(self.mount)  # made 0700 or refused, before the child sees it
            _mount.sweep(self.mount)
            if self.own and self.reach is not None:
                # this machine's memory: only a client that finds our mark there uses it
                self.seen = _mount.mark(self.mount)
        self.directory = private_directory()
        url = f"ipc://{self.directory}/w.sock"
        keyed: list[str] = []
        if self.reach is not None:  # other machines reach it, with keys: a pair of its own
            public, secret = make_pair(self.directory, "worker")
            self.key = read_public(public).decode()
            mine, theirs = zmq.curve_keypair()  # the broker's checks: a pair for this child alone
            self.checker = Keys(mine, theirs, server_key=self.key.encode())
            url = f"tcp://{self.reach.interface}:0"
            try:
                allowing = self._allowing()
            except Refused:
                self.stop()
                raise
            keyed = ["--key", str(secret), "--allow", str(allowing)]
        command = [*self.argv, "--listen", url, "--announce", "--mode", self.mode, "--parent", str(os.getpid()), *keyed]
        if self.mode == "project":
            # the spawner's own folder is the project its nodes come from (a notebook's modules
            # beside it); a worker puts no other working directory on its import path
            command += ["--project", os.getcwd()]
        if self.mount:
            command += ["--mount", self.mount]
        try:
            process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, bufsize=0)
        except OSError as exc:
            self.stop()
            raise Refused(f"the worker for `{self.host}` could not be started from {list(self.argv)}: {exc}") from exc
        self.process = process
        line = _first_line(process, START_DEADLINE)
        if line is not None and self.reach is not None and _on_interface(line[len(ANNOUNCE) :], self.reach.interface):
            url = line[len(ANNOUNCE) :]  # the port it was given: the system's choice
        if line is None or line != ANNOUNCE + url:
            ended = self.ended() if process.poll() is not None else None
            self.stop()
            if line is not None and line.startswith(ANNOUNCE):
                raise Refused(
                    f"the worker for `{self.host}` listens on {line[len(ANNOUNCE) :]}, not on the private "
                    f"socket {url} it was given: {list(self.argv)} has to pass `--listen` on to "
                    f"`python -m somatize.worker`"
                )
            raise Refused(
                f"the worker for `{self.host}` did not start: {list(self.argv)} "
                + (f"{ended} (its stderr is above)" if ended else f"said nothing usable within {START_DEADLINE:.0f} s")
                + "; check that it runs `python -m somatize.worker`"
            )
        self.address = url if self.reach is None else self.reach.address(url)
        threading.Thread(
            target=_relay_output, args=(process, self.host), daemon=True, name=f"somatize-{self.host}-out"
        ).start()
        return self.address

    def _own_folder(self) -> str | None:
        """This user's default folder, made and checked now; None (the socket) where another
        user holds the name, said once per host."""
        folder = _mount.own_folder()
        if folder is not None:
            try:
                _mount.private(folder)
                return folder
            except Refused:
                pass  # taken between the look and the make: the socket, as below
        if not self._warned:
            self._warned = True
            print(
                f"somatize: {_mount.own_path()} is not this user's safe folder (another user may have made it): "
                f"cargo for `{self.host}` goes through its socket instead. Remove that folder, or give the "
                f"host `mount=` a folder of your own",
                file=sys.stderr,
                flush=True,
            )
        return None

    def _allowing(self) -> Path:
        """The child's allow folder, in its private directory: the keys of the broker's own
        (as they are now) and the checker's; ``Refused`` when the broker's cannot be read."""
        assert self.reach is not None and self.directory is not None and self.checker is not None
        try:
            keys = read_allowed(self.reach.allow)
        except BadKeys as exc:
            raise Refused(f"the worker for `{self.host}` was not given the keys it allows: {exc}") from exc
        keys.add(self.checker.public.decode())
        folder = Path(self.directory) / "allow"
        folder.mkdir(mode=0o700, exist_ok=True)
        wanted = {f"{hashlib.sha256(k.encode()).hexdigest()[:24]}.key": k for k in keys}
        for entry in os.scandir(folder):
            if entry.name not in wanted:
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
        for name, key in wanted.items():
            if not (folder / name).exists():
                write_public(folder / name, key.encode())
        return folder

    @property
    def stopped(self) -> bool:
        """Whether the child's process is stopped (SIGSTOP, or a debugger's), as the kernel
        says (``/proc``; False where it cannot say)."""
        process = self.process
        if process is None or process.poll() is not None:
            return False
        try:
            with open(f"/proc/{process.pid}/stat", "rb") as stat_file:
                state = stat_file.read().rpartition(b")")[2].split()[0]
        except (OSError, IndexError):
            return False
        return state in (b"T", b"t")

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

    def located(self, host: str, mode: str, ended: str | None = None) -> Located:
        """Where this child's host is: its socket, and the folder it was started with (chosen
        at each start when none was named), if any."""
        if self.seen:  # the default folder, for the clients that see it (`mount.sees`)
            return Located(
                host,
                "direct",
                address=self.address,
                mode=mode,
                mount=self.mount,
                seen=self.seen,
                ended=ended,
                key=self.key,
            )
        return Located(
            host,
            "mount" if self.mount else "direct",
            address=self.address,
            mode=mode,
            mount=self.mount,
            ended=ended,
            key=self.key,
        )

    def reload(self) -> None:
        """Its broker's allow folder was read again: its copy is made anew, and read again
        by the child (one that cannot be read now leaves the copy as it was, as the broker
        keeps its own lists)."""
        process = self.process
        if self.reach is not None and process is not None and process.poll() is None:
            try:
                self._allowing()
            except (Refused, OSError):
                return
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGHUP)

    def stop(self) -> None:
        """Terminate, wait a moment, then kill; always reaped; its socket's directory removed."""
        process = self.process
        if process is not None and process.poll() is None:
            try:
                process.terminate()
                os.kill(process.pid, signal.SIGCONT)  # a stopped child acts on SIGTERM only once resumed
                process.wait(STOP_GRACE)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(STOP_GRACE)
            except ProcessLookupError:
                pass
        if process is not None and process.stdout is not None:
            process.stdout.close()
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)  # also after a SIGKILL: the child removed nothing
            self.directory = None
        if self.seen and self.mount:
            _mount.unmark(self.mount, self.seen)
            self.seen = ""
        if process is not None and self.mount == _mount.own_path():
            # the default folder start() made goes with its last user, as a pool's does when
            # it drains (client.lending): a child whose cargo all went through its socket made no pool
            with contextlib.suppress(OSError):  # not empty: someone else still uses it
                os.rmdir(self.mount)


@dataclass(frozen=True)
class Reach:
    """How a broker's children are reached from other machines: on ``interface`` (the
    address the broker listens on), allowing the keys in ``allow`` (the broker's)."""

    interface: str
    allow: Path

    def address(self, bound: str) -> str:
        """What clients are told: a wildcard listens everywhere, and is reached by name."""
        if self.interface in ("*", "0.0.0.0", "[::]"):
            return f"tcp://{socket.gethostname()}:{bound.rsplit(':', 1)[1]}"
        return bound


def _on_interface(endpoint: str, interface: str) -> bool:
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    same = host == interface or (interface == "*" and host in ("0.0.0.0", "[::]"))
    return endpoint.startswith("tcp://") and same and port.isdigit()


def private_directory() -> str:
    """A new directory only this user may enter, for one child's socket; stale ones of
    dead parents are removed on the way."""
    bases = [os.environ.get("XDG_RUNTIME_DIR", ""), tempfile.gettempdir(), "/tmp"]
    for base in bases:
        if not base or not os.path.isdir(base) or len(base) + 40 > MAX_SOCKET_PATH:
            continue
        if base == bases[0] and not _own_private(base):
            continue  # an $XDG_RUNTIME_DIR inherited from another user (after `su`)
        _sweep_directories(base)
        return tempfile.mkdtemp(prefix=f"somatize-{os.getpid()}-", dir=base)  # 0700, a name nobody chose
    raise Refused(
        "no folder for a spawned worker's socket: $XDG_RUNTIME_DIR, $TMPDIR and /tmp are missing or have "
        f"paths too long for a socket (over {MAX_SOCKET_PATH - 40} characters); set TMPDIR to a short one"
    )


def _own_private(path: str) -> bool:
    try:
        info = os.stat(path)
    except OSError:
        return False
    return info.st_uid == os.geteuid() and not info.st_mode & 0o077


def _sweep_directories(base: str) -> None:
    """Remove this user's socket directories whose parent is dead and whose socket is too."""
    me = os.geteuid()
    try:
        entries = os.scandir(base)
    except OSError:
        return
    with entries:
        for entry in entries:
            match = _DIRECTORY.fullmatch(entry.name)
            if match is None or int(match.group(1)) == os.getpid():
                continue
            with contextlib.suppress(OSError):
                info = entry.stat(follow_symlinks=False)
                if not stat.S_ISDIR(info.st_mode) or info.st_uid != me or _alive(int(match.group(1))):
                    continue
                if _answers(os.path.join(entry.path, "w.sock")):
                    continue  # a worker still listens: a parent of another pid namespace, say
                shutil.rmtree(entry.path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _answers(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(0.5)
        try:
            probe.connect(path)
        except OSError:
            return False
    return True


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
