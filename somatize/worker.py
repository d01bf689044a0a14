"""``python -m somatize.worker``: serve work for a broker's clients.

    python -m somatize.worker --listen 7000                 # 127.0.0.1:7000, Direct
    python -m somatize.worker --listen 0.0.0.0:7000 --insecure
    python -m somatize.worker --broker tcp://head:5555 --offer w1   # dial in: Relayed
    python -m somatize.worker --listen 7000 --mount /dev/shm/somatize   # Mount
    python -m somatize.worker --listen 7000 --project ~/src/myproject   # import from there

The worker holds no state you care about and knows nothing of your graph. Its working
directory is not on its import path (a module someone leaves there is never imported);
``--project DIR`` puts a folder of your code there.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import zmq

from .errors import BadKeys, SomatizeError
from .fabric import command, sockets
from .fabric.broker.spawn import ANNOUNCE
from .fabric.curve import Keys
from .fabric.worker.loop import WorkerLoop
from .packing import kinds


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=command.prog("somatize.worker"), description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--listen", metavar="[HOST:]PORT", help="listen here (host defaults to 127.0.0.1)")
    where.add_argument("--broker", metavar="URL", help="dial in to this broker instead (needs --offer)")
    parser.add_argument("--offer", metavar="NAME", help="the host name to serve when dialing in to a broker")
    parser.add_argument(
        "--mode",
        choices=("project", "network"),
        default="project",
        help="project: nodes arrive by import name (default); network: also accept code by value",
    )
    parser.add_argument("--mount", metavar="DIR", help="a directory shared with the clients, for cargo")
    parser.add_argument(
        "--jobs",
        type=command.count,
        default=1,
        metavar="N",
        help="pieces of work run at once (default 1: on the serving thread, the "
        "fastest; N > 1: on N threads); work past them is answered `busy` at "
        "once, never queued",
    )
    parser.add_argument("--store", metavar="DIR", help="a store to report to (with --reporting)")
    parser.add_argument(
        "--reporting",
        type=command.seconds,
        metavar="SECONDS",
        help="say what this worker does (load, memory, slices) on this clock: "
        "into --store under machine/NAME, and down open connections as `said`",
    )
    parser.add_argument("--machine", metavar="NAME", help="the name to report under (default: this machine's)")
    command.key_options(parser)
    command.patience_option(parser)
    command.log_option(parser)
    parser.add_argument("--broker-key", metavar="FILE.key", help="the broker's public key, when dialing in with --key")
    parser.add_argument(
        "--project",
        metavar="DIR",
        action="append",
        default=[],
        help="a folder to import nodes from (may repeat); the working directory is not on the import path otherwise",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="allow listening on, or dialing, an address other machines can reach, with no keys",
    )
    parser.add_argument("--announce", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--parent", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    # a spawned worker (--announce) shares its parent's stderr: it says only what went wrong
    log = command.configure_log(args.log_level or ("warning" if args.announce else "info")).getChild("worker")
    if not _import_path(args.project):
        return 2

    if args.broker and not args.offer:
        parser.error("--broker needs --offer NAME: the host name this worker serves")
    if args.broker:
        keys = None
        if args.key or args.broker_key:
            try:
                keys = Keys.client(args.key, server=args.broker_key) if args.key and args.broker_key else None
            except BadKeys as exc:
                print(f"somatize worker: {exc}", file=sys.stderr)
                return 2
            if keys is None:
                print(
                    "somatize worker: dialing in with keys needs --key (this worker's pair) and "
                    "--broker-key (the broker's public key)",
                    file=sys.stderr,
                )
                return 2
        url = sockets.tcp_url(args.broker)
        if keys is None and not _may_dial(url, insecure=args.insecure, mode=args.mode):
            return 2
        server = _loop(args)
        if server is None:
            return 2
        try:
            server.dial(url, args.offer, keys=keys)
        except zmq.ZMQError as exc:
            print(
                f"somatize worker: cannot dial {args.broker}: {exc}; give --broker as tcp://HOST:PORT", file=sys.stderr
            )
            server.close()
            return 2
        where_text = f"dialed {args.broker} offering `{args.offer}`"
    else:
        url = sockets.tcp_url(args.listen or "127.0.0.1:7000")
        served = command.server_keys(args, "worker")
        if served is False:
            return 2
        keys = served
        risk = "send work here" + (" and run code by value" if args.mode == "network" else "")
        if not command.may_listen(url, insecure=args.insecure, who="worker", risk=risk, keyed=keys is not None):
            return 2
        server = _loop(args)
        if server is None:
            return 2
        bound = command.bind(server, url, who="worker", keys=keys)
        if bound is None:
            return 2
        endpoint = bound  # a str, for `ready` (which announces it only here, with no --broker)
        where_text = f"listening on {endpoint}"

    def ready() -> None:
        log.info(
            "%s mode, %s, with %s%s",
            args.mode,
            where_text,
            "no keys" if keys is None else server.described(),
            f"; cargo through {args.mount}" if args.mount else "",
        )
        if args.announce and not args.broker:
            print(ANNOUNCE + endpoint, flush=True)

    code = command.serve_until_signalled(server, log, ready)
    if server.running():
        # a node that never returns holds its thread: end now, without waiting on it
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _loop(args: argparse.Namespace) -> WorkerLoop | None:
    """The serving loop for these arguments; None after saying why it cannot be made (a
    store folder that cannot be created, say)."""
    kinds.always()  # a worker's tenants share its codec registry: no import of one changes another's formats
    try:
        return WorkerLoop(
            mode=args.mode,
            mount=args.mount,
            jobs=args.jobs,
            parent=args.parent,
            patience=args.patience,
            store=args.store,
            reporting=args.reporting,
            machine=args.machine,
            exit_when_stuck=True,
        )
    except (SomatizeError, OSError, ValueError) as exc:
        print(f"somatize worker: cannot start: {exc}", file=sys.stderr)
        return None


def _import_path(projects: list[str]) -> bool:
    """Take the working directory off the import path (``python -m`` puts it first), and put
    the ``--project`` folders there instead; False after saying why one cannot be used."""
    here = os.getcwd()
    if sys.path and not sys.flags.safe_path and sys.path[0] in ("", ".", here):
        del sys.path[0]
    folders = []
    for project in projects:
        folder = os.path.abspath(os.path.expanduser(project))
        if not os.path.isdir(folder):
            print(
                f"somatize worker: --project {project}: no such folder; give the folder your "
                f"nodes' modules are imported from",
                file=sys.stderr,
            )
            return False
        folders.append(folder)
    sys.path[:0] = folders
    return True


def _may_dial(url: str, *, insecure: bool, mode: str) -> bool:
    """Dialing a broker on another machine with no keys needs ``--insecure``, like listening."""
    if sockets.is_loopback(url):
        return True
    risk = "send work to this worker" + (" and run code by value on it" if mode == "network" else "")
    if not insecure:
        print(
            f"somatize worker: refusing to dial {url} with no keys: the connection would be neither "
            f"encrypted nor authenticated, so anyone who can reach it or sit in between could {risk}. "
            f"Give it keys (--key FILE.key_secret for this worker and --broker-key BROKER.key for "
            f"the broker's public key; make them with `python -m somatize keys DIR`), reach the "
            f"broker through an SSH tunnel to 127.0.0.1, or pass --insecure on a network you trust.",
            file=sys.stderr,
        )
        return False
    print(
        f"somatize worker: WARNING: dialing {url} with no keys (--insecure): anyone who can reach "
        f"the connection could {risk}",
        file=sys.stderr,
    )
    return True


if __name__ == "__main__":
    sys.exit(main())
