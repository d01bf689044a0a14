"""What ``python -m somatize.worker`` and ``python -m somatize.broker`` share: the rule
about where they may listen, binding with a sentence on failure, and stopping on a signal."""

from __future__ import annotations

import signal
import sys
from typing import Any

from . import sockets


def may_listen(url: str, *, insecure: bool, who: str, risk: str) -> bool:
    """Loopback is always fine; anywhere else needs ``--insecure``, which warns every start."""
    if sockets.is_loopback(url):
        return True
    if not insecure:
        print(
            f"somatize {who}: refusing to listen on {url}: anyone who can reach it could {risk}, "
            f"and this version has no keys to tell clients apart. Listen on 127.0.0.1 (the "
            f"default) and reach it through an SSH tunnel, or pass --insecure on a network you trust.",
            file=sys.stderr,
        )
        return False
    print(f"somatize {who}: WARNING: listening on {url} with no keys (--insecure): {risk} is open "
          f"to anyone who can reach it", file=sys.stderr)
    return True


def bind(server: Any, url: str, *, who: str) -> str | None:
    """Bind ``server`` on ``url``; on failure say why, close it, and return None."""
    try:
        return server.bind(url)
    except Exception as exc:
        print(f"somatize {who}: cannot listen on {url}: {exc}", file=sys.stderr)
        server.close()
        return None


def serve_until_signalled(server: Any) -> int:
    """Serve until SIGTERM or SIGINT, then close cleanly."""

    def stop(signum: int, frame: object) -> None:
        server.stopping.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    server.serve()
    return 0
