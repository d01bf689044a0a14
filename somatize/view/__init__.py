"""``python -m somatize view --store DIR`` (and ``somatize-view``): the record, live, in a browser.

A small web application over a store, a reader like the others: runs and their forwards,
curves and nodes; the machines and what each last said; studies and their trials. A page
reads again within a second of what it shows changing in the store, whoever wrote it, from
whichever machine. Nothing needs to keep running for the record to exist: the view only
reads it, and can be started and stopped at any time.

It listens on loopback (``127.0.0.1``) by default and needs its token, printed once in the
fragment of the address it gives (``#token=``, which a browser never sends): another user of
a shared machine can reach a loopback port, and must not read your record through it. The
page keeps the token for its own origin and sends it as a header; no cookie is set (a
browser sends cookies to every port of a host). Every request must name the view's own
address as its ``Host`` (no DNS rebinding), ``--insecure`` or not. ``--insecure`` drops the
token; listening beyond loopback needs a token (so never with ``--insecure``). Needs the
``view`` extra (``pip install '.[view]'`` from a clone): Starlette and uvicorn. Started
before the store's folder exists (before the first run), it listens and waits for the folder
to appear, creating nothing.
"""

from __future__ import annotations

import argparse
import secrets
import socket
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

__all__ = ["add_arguments", "command", "main"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--store", metavar="DIR", required=True, help="the store whose record to show")
    parser.add_argument(
        "--listen",
        metavar="HOST:PORT",
        default="127.0.0.1:8765",
        help="where to listen (default 127.0.0.1:8765; port 0 picks a free one)",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="no token: anyone who reaches the port may read the record (loopback only)",
    )
    parser.add_argument("--announce", action="store_true", help=argparse.SUPPRESS)


def command(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from .app import make_app
        from .guard import Guarded, host_check
    except ImportError as exc:
        print(
            f"somatize view: needs the view extra ({exc.name} is missing): "
            f"pip install '.[view]' from a clone of somatize",
            file=sys.stderr,
        )
        return 2
    from ..fabric.sockets import is_loopback
    from ..store import FolderStore

    folder = Path(args.store)
    if folder.exists() and not folder.is_dir():
        print(f"somatize view: {args.store} is not a folder; give the store to show", file=sys.stderr)
        return 2
    host, _, port_text = args.listen.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    if not port_text.isdigit() or int(port_text) > 65535:
        print(f"somatize view: --listen is HOST:PORT, such as 127.0.0.1:8765; got {args.listen!r}", file=sys.stderr)
        return 2
    if args.insecure and not is_loopback(f"tcp://{host}:0"):
        print(
            f"somatize view: listening on {host} without a token would show the record to anyone "
            f"who reaches this machine; drop --insecure (a token is printed) or listen on 127.0.0.1",
            file=sys.stderr,
        )
        return 2
    token = None if args.insecure else secrets.token_urlsafe(24)
    try:
        listener = socket.create_server(
            (host, int(port_text)), family=socket.AF_INET6 if ":" in host else socket.AF_INET
        )
    except OSError as exc:
        print(f"somatize view: cannot listen on {args.listen}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    bound = listener.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    address = f"http://{shown}:{bound}/" + (f"#token={token}" if token else "")

    def made() -> Guarded:
        return Guarded(
            make_app(FolderStore(args.store), token=token), host_check(host, bound), f"http://{shown}:{bound}/"
        )

    # made before the address is said, where the store is there: whoever reads it finds the
    # view settled (its first runs read: `Runs.warm`); else once the folder appears
    app = made() if folder.is_dir() else None
    if args.announce:  # for whoever started it: the address, on the first line
        print(f"somatize-view ready {address}", flush=True)
    print(f"somatize view of {args.store}: open {address}", flush=True)
    if app is None:
        if not _appeared(folder, listener):
            return 0
        app = made()
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=1))
    try:
        server.run(sockets=[listener])
    except KeyboardInterrupt:
        pass
    finally:
        listener.close()
    return 0


def _appeared(folder: Path, listener: socket.socket) -> bool:
    """Wait for ``folder`` to be made by whoever writes the store first (a run, a study): the
    view creates nothing. The address already works: a page opened meanwhile is answered once
    it appears. False when interrupted first."""
    if folder.is_dir():
        return True
    print(
        f"somatize view: waiting for {folder} to appear (the first run or study that writes there makes it)", flush=True
    )
    waiting = threading.Event()
    try:
        while not folder.exists():
            waiting.wait(0.25)  # a folder made on another machine of a shared mount is seen by looking
    except KeyboardInterrupt:
        listener.close()
        return False
    if not folder.is_dir():
        listener.close()
        print(f"somatize view: {folder} appeared, and is not a folder", file=sys.stderr)
        return False
    print(f"somatize view: {folder} appeared; showing it", flush=True)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="somatize-view", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return command(parser.parse_args(argv))
