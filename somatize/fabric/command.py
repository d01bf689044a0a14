"""What ``python -m somatize.worker`` and ``python -m somatize.broker`` share: keys, the rule
about where they may listen, binding with a sentence on failure, stopping on a signal and
reloading the allow-list on SIGHUP."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Any

from ..errors import BadKeys
from . import sockets
from .curve import Keys


def prog(module: str) -> str:
    """How the command was called: its console script's name, or ``python -m module``."""
    called = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return called if called.startswith("somatize-") else f"python -m {module}"


def patience_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--patience", type=float, default=sockets.PATIENCE, metavar="SECONDS",
                        help=f"how long a silent peer is waited for before it counts as gone "
                             f"(default {sockets.PATIENCE:g})")


def key_options(parser: argparse.ArgumentParser, *, workers: bool = False) -> None:
    parser.add_argument("--key", metavar="FILE.key_secret", help="this side's CURVE key pair (from `python -m somatize keys`)")
    parser.add_argument("--allow", metavar="DIR", help="the folder of client public keys (.key) allowed in")
    if workers:
        parser.add_argument("--allow-workers", metavar="DIR",
                            help="the folder of worker public keys (.key) that may dial in and offer hosts; "
                                 "a key only in --allow may ask for hosts but never offer one")


def server_keys(args: argparse.Namespace, who: str) -> Keys | None | bool:
    """The keys to listen with, None for none, or False after saying why they cannot be used."""
    if args.key is None and args.allow is None:
        if getattr(args, "allow_workers", None) is not None:
            print(f"somatize {who}: --allow-workers needs --key and --allow", file=sys.stderr)
            return False
        return None
    if args.key is None or args.allow is None:
        print(f"somatize {who}: --key and --allow go together: a key pair to prove who this is, "
              f"and the folder of client keys it lets in", file=sys.stderr)
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
    print(f"somatize {who}: WARNING: listening on {url} with no keys (--insecure): {risk} is open "
          f"to anyone who can reach it", file=sys.stderr)
    return True


def bind(server: Any, url: str, *, who: str, keys: Keys | None = None) -> str | None:
    """Bind ``server`` on ``url``; on failure say why, close it, and return None."""
    try:
        return server.bind(url, keys=keys)
    except Exception as exc:
        print(f"somatize {who}: cannot listen on {url}: {exc}", file=sys.stderr)
        server.close()
        return None


def serve_until_signalled(server: Any) -> int:
    """Serve until SIGTERM or SIGINT, then close cleanly."""

    def stop(signum: int, frame: object) -> None:
        server.stopping.set()

    def reload(signum: int, frame: object) -> None:
        try:
            server.reload()
        except BadKeys as exc:  # a folder broken meanwhile: keep serving with the old list, loudly
            print(f"somatize: the allow-list was not reloaded, the old one stays: {exc}", file=sys.stderr, flush=True)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGHUP, reload)  # read the allow-list again
    server.serve()
    return 0
