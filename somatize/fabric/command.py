"""What ``python -m somatize.worker`` and ``python -m somatize.broker`` share: keys, the rule
about where they may listen, binding with a sentence on failure, stopping on a signal and
reloading the allow-list on SIGHUP, and the log an operator reads.

The log: one line per lifecycle event on stderr (journald keeps it), through Python's
``logging`` under ``somatize.broker`` / ``somatize.worker``. Only the commands attach a
handler (:func:`configure_log`); the library never does, and the engine and the client speak
only in facts and exceptions.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
from typing import Any, Literal

from ..errors import BadKeys
from . import sockets
from .curve import Keys


def prog(module: str) -> str:
    """How the command was called: its console script's name, or ``python -m module``."""
    called = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return called if called.startswith("somatize-") else f"python -m {module}"


LEVELS = ("debug", "info", "warning", "error")


class _Line(logging.Formatter):
    """``somatize broker: what happened``: the logger's name is who speaks; a warning or an
    error says so, so ``journalctl -p warning`` and a reader's eye both find it. One event,
    one line: what is not printable (a newline, an escape, a NUL a peer sent) is escaped."""

    def format(self, record: logging.LogRecord) -> str:
        who = record.name.replace(".", " ")
        level = "" if record.levelno < logging.WARNING else f"{record.levelname}: "
        said = record.getMessage()
        if not said.isprintable():  # a peer's name or reason: never a forged line or an escape code
            said = said.encode("unicode_escape").decode("ascii")
        return f"{who}: {level}{said}"


def log_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--log-level",
        choices=LEVELS,
        default=None,
        type=str.lower,
        help="how much to say on stderr: debug, info (the default: one line per "
        "start, stop, reload, host dialing in or leaving, refusal, redial), "
        "warning or error",
    )


def configure_log(level: str | None = "info") -> logging.Logger:
    """Give the ``somatize`` logger one handler on stderr at ``level`` (once per process);
    return it. Called by the commands only."""
    level = level or "info"
    root = logging.getLogger("somatize")
    root.setLevel(getattr(logging, level.upper()))
    if not any(getattr(h, "_somatize", False) for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(_Line())
        handler._somatize = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    root.propagate = False
    return root


def seconds(text: str) -> float:
    """An argument that is a number of seconds, more than 0 (argparse makes a refusal exit 2)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value < 10**7:  # also refuses nan and inf
        raise argparse.ArgumentTypeError(f"{text!r} seconds: give a number above 0, like 5")
    return value


def count(text: str) -> int:
    """An argument that is a whole number, 1 or more."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: give 1 or more")
    return value


def patience_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--patience",
        type=seconds,
        default=sockets.PATIENCE,
        metavar="SECONDS",
        help=f"how long a silent peer is waited for before it counts as gone (default {sockets.PATIENCE:g})",
    )


def key_options(parser: argparse.ArgumentParser, *, workers: bool = False) -> None:
    parser.add_argument(
        "--key", metavar="FILE.key_secret", help="this side's CURVE key pair (from `python -m somatize keys`)"
    )
    parser.add_argument("--allow", metavar="DIR", help="the folder of client public keys (.key) allowed in")
    if workers:
        parser.add_argument(
            "--allow-workers",
            metavar="DIR",
            help="the folder of worker public keys (.key) that may dial in and offer hosts; "
            "a key only in --allow may ask for hosts but never offer one",
        )


def server_keys(args: argparse.Namespace, who: str) -> Keys | Literal[False] | None:
    """The keys to listen with, None for none, or False after saying why they cannot be used."""
    if args.key is None and args.allow is None:
        if getattr(args, "allow_workers", None) is not None:
            print(f"somatize {who}: --allow-workers needs --key and --allow", file=sys.stderr)
            return False
        return None
    if args.key is None or args.allow is None:
        print(
            f"somatize {who}: --key and --allow go together: a key pair to prove who this is, "
            f"and the folder of client keys it lets in",
            file=sys.stderr,
        )
        return False
    try:
        return Keys.server(args.key, allow=args.allow, workers=getattr(args, "allow_workers", None))
    except BadKeys as exc:
        print(f"somatize {who}: {exc}", file=sys.stderr)
        return False


def may_listen(url: str, *, insecure: bool, who: str, risk: str, keyed: bool = False) -> bool:
    """Loopback is always fine; anywhere else needs keys, or ``--insecure`` (which warns at
    every start)."""
    if sockets.is_loopback(url) or keyed:
        return True
    if not insecure:
        print(
            f"somatize {who}: refusing to listen on {url}: anyone who can reach it could {risk}. "
            f"Give it keys (--key FILE.key_secret --allow CLIENT_KEYS_DIR; make them with "
            f"`python -m somatize keys DIR`), listen on 127.0.0.1 (the default) and reach it "
            f"through an SSH tunnel, or pass --insecure on a network you trust.",
            file=sys.stderr,
        )
        return False
    print(
        f"somatize {who}: WARNING: listening on {url} with no keys (--insecure): {risk} is open "
        f"to anyone who can reach it",
        file=sys.stderr,
    )
    return True


def bind(server: Any, url: str, *, who: str, keys: Keys | None = None) -> str | None:
    """Bind ``server`` on ``url``; on failure say why, close it, and return None."""
    try:
        return server.bind(url, keys=keys)
    except Exception as exc:
        print(f"somatize {who}: cannot listen on {url}: {exc}", file=sys.stderr)
        server.close()
        return None


def serve_until_signalled(server: Any, log: logging.Logger | None = None, ready: Any = None) -> int:
    """Serve until SIGTERM or SIGINT, then close cleanly, saying why it stopped. ``ready()``
    is called once the signals are handled, before serving: whoever is told the server is
    ready may signal it at once."""
    log = log or logging.getLogger("somatize")
    why: list[str] = []

    def stop(signum: int, frame: object) -> None:
        if not why:
            why.append(signal.Signals(signum).name)
        server.stopping.set()

    def reload(signum: int, frame: object) -> None:
        try:
            server.reload()  # it logs what it took, or what it refused and why
        except BadKeys as exc:  # a folder broken meanwhile: keep serving with the old list, loudly
            log.error("the allow-list was not reloaded, the old one stays: %s", exc)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGHUP, reload)  # read the allow-list again
    undo = _heard_at_once(server, why)
    if ready is not None:
        ready()
    try:
        server.serve()
    except BaseException as exc:
        log.error("stopping: %s: %s", type(exc).__name__, exc)
        raise
    finally:
        undo()
    log.info("stopping: %s", f"told to by {why[0]}" if why else "its serving loop ended")
    return 0


_STOPS = {int(signal.SIGTERM): "SIGTERM", int(signal.SIGINT): "SIGINT"}


def _heard_at_once(server: Any, why: list[str]) -> Any:
    """Stop ``server`` as soon as SIGTERM or SIGINT arrives, whichever thread the kernel hands
    it to; return what undoes this.

    CPython runs a signal's handler on the main thread, between two bytecodes. The kernel may
    deliver the signal to any thread that does not block it (a stand-in, a slot, a node's own),
    and a main thread asleep in a long poll then hears of it only when the poll times out: up
    to a patience. Through a wakeup descriptor (``signal.set_wakeup_fd``, written by the C
    handler in whatever thread took the signal) a thread of its own hears every signal at
    once and sets ``server.stopping``, which wakes the poll. SIGHUP is left to its handler."""
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    try:
        before = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    except ValueError:  # not the main thread (a test serving on one of its own): the handlers alone
        reader.close()
        writer.close()
        return lambda: None
    done = threading.Event()

    def listen() -> None:
        while not done.is_set():
            try:
                heard = reader.recv(64)
            except OSError:
                return
            if not heard:
                return
            stops = [_STOPS[b] for b in heard if b in _STOPS]
            if stops:
                if not why:
                    why.append(stops[0])
                server.stopping.set()

    listener = threading.Thread(target=listen, daemon=True, name="somatize-signals")
    listener.start()

    def undo() -> None:
        signal.set_wakeup_fd(before)
        done.set()
        with contextlib.suppress(OSError):
            reader.shutdown(socket.SHUT_RDWR)  # wakes its recv
        listener.join(1.0)
        reader.close()
        writer.close()

    return undo
