"""``python -m somatize.worker``: serve work for a broker's clients.

    python -m somatize.worker --listen 7000                 # 127.0.0.1:7000, Direct
    python -m somatize.worker --listen 0.0.0.0:7000 --insecure
    python -m somatize.worker --broker tcp://head:5555 --offer w1   # dial in: Relayed
    python -m somatize.worker --listen 7000 --mount /dev/shm/somatize   # Mount

The worker holds no state you care about and knows nothing of your graph.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .errors import BadKeys
from .fabric import command, sockets
from .fabric.curve import Keys
from .fabric.serve import Server
from .fabric.spawn import ANNOUNCE


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=command.prog("somatize.worker"), description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--listen", metavar="[HOST:]PORT", help="listen here (host defaults to 127.0.0.1)")
    where.add_argument("--broker", metavar="URL", help="dial in to this broker instead (needs --offer)")
    parser.add_argument("--offer", metavar="NAME", help="the host name to serve when dialing in to a broker")
    parser.add_argument("--mode", choices=("project", "network"), default="project",
                        help="project: nodes arrive by import name (default); network: also accept code by value")
    parser.add_argument("--mount", metavar="DIR", help="a directory shared with the clients, for cargo")
    parser.add_argument("--jobs", type=int, default=1, metavar="N",
                        help="pieces of work run at once: 1 (the default) runs them one after the "
                             "other on the serving thread, the fastest; N > 1 runs them on N threads")
    parser.add_argument("--store", metavar="DIR", help="a store to report to (with --reporting)")
    parser.add_argument("--reporting", type=float, metavar="SECONDS",
                        help="say what this worker does (load, memory, slices) on this clock: "
                             "into --store under machine/NAME, and down open connections as `said`")
    parser.add_argument("--machine", metavar="NAME", help="the name to report under (default: this machine's)")
    command.key_options(parser)
    command.patience_option(parser)
    parser.add_argument("--broker-key", metavar="FILE.key", help="the broker's public key, when dialing in with --key")
    parser.add_argument("--insecure", action="store_true",
                        help="allow listening on an address other machines can reach, with no keys")
    parser.add_argument("--announce", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--parent", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

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
                print("somatize worker: dialing in with keys needs --key (this worker's pair) and "
                      "--broker-key (the broker's public key)", file=sys.stderr)
                return 2
        server = Server(mode=args.mode, mount=args.mount, jobs=max(1, args.jobs), parent=args.parent, patience=args.patience,
                        store=args.store, reporting=args.reporting, machine=args.machine)
        server.dial(sockets.tcp_url(args.broker), args.offer, keys=keys)
        where_text = f"dialed {args.broker} offering `{args.offer}`"
    else:
        url = sockets.tcp_url(args.listen or "127.0.0.1:7000")
        keys = command.server_keys(args, "worker")
        if keys is False:
            return 2
        risk = "send work here" + (" and run code by value" if args.mode == "network" else "")
        if not command.may_listen(url, insecure=args.insecure, who="worker", risk=risk, keyed=keys is not None):
            return 2
        server = Server(mode=args.mode, mount=args.mount, jobs=max(1, args.jobs), parent=args.parent, patience=args.patience,
                        store=args.store, reporting=args.reporting, machine=args.machine)
        endpoint = command.bind(server, url, who="worker", keys=keys)
        if endpoint is None:
            return 2
        where_text = f"listening on {endpoint}"
        if args.announce:
            print(ANNOUNCE + endpoint, flush=True)
    if not args.announce:
        print(f"somatize worker: {args.mode} mode, {where_text}", file=sys.stderr, flush=True)
    return command.serve_until_signalled(server)


if __name__ == "__main__":
    sys.exit(main())
