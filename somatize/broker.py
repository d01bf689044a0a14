"""``python -m somatize.broker``: a standalone broker for a head node.

    python -m somatize.broker --listen tcp://0.0.0.0:5555 --hosts hosts.toml --insecure

The host table names each host and how to reach it:

    [hosts.w1]
    address = "10.0.0.4:7000"      # a worker listening there (Direct)
    mode = "project"

    [hosts.w2]
    spawn = ["python", "-m", "somatize.worker"]   # started here on first use
    mode = "network"

    [hosts.w3]
    address = "10.0.0.5:7000"
    mount = "/shared/somatize"     # both ends see this directory (Mount)
    key = "keys/w3.key"            # its CURVE public key, when it listens with --key/--allow
    deadline = 600                 # seconds one piece of work may run there (on a spawned
                                   # host, one stuck longer is stopped when a client reports it)

    [hosts.cpu]
    spawn = ["python", "-m", "somatize.worker"]
    processes = 4                  # a pool: four workers, the hosts cpu#0 .. cpu#3

Workers that dial in (``python -m somatize.worker --broker URL --offer NAME``) need no
entry: they are served Relayed under the name they offer; ``--offer gpu#17`` joins the
pool ``gpu`` (one member per worker, each name bound to the key that offered it).
"""

from __future__ import annotations

import argparse
import logging
import resource
import sys
import tomllib
from collections.abc import Sequence
from pathlib import Path

from .errors import BadKeys
from .fabric import Worker, command, sockets
from .fabric.broker.loop import MAX_DIALED, MAX_HOSTS_PER_KEY, BrokerLoop
from .fabric.curve import Keys, read_public
from .fabric.hosts import expand


def read_hosts(path: str | Path) -> dict[str, Worker]:
    """The host table in ``path`` (TOML), as worker declarations."""
    with open(path, "rb") as source:
        table = tomllib.load(source)
    hosts = table.get("hosts", {})
    if not isinstance(hosts, dict):
        raise ValueError(f"{path}: `hosts` must be a table of tables, like [hosts.w1]")
    out: dict[str, Worker] = {}
    for name, entry in hosts.items():
        if not isinstance(entry, dict):
            raise ValueError(f"{path}: [hosts.{name}] must be a table")
        unknown = set(entry) - {"address", "spawn", "mode", "mount", "key", "deadline", "processes"}
        if unknown:
            raise ValueError(
                f"{path}: [hosts.{name}] has unknown keys {sorted(unknown)}; use address, spawn, mode, mount, key, "
                f"deadline, processes"
            )
        if "processes" in entry and "spawn" not in entry:
            raise ValueError(
                f"{path}: [hosts.{name}] processes = N starts N workers from `spawn`; for workers "
                f"that listen, give `address` a list, one address per worker"
            )
        if ("address" in entry) == ("spawn" in entry):
            raise ValueError(f"{path}: [hosts.{name}] needs exactly one of `address` or `spawn`")
        if "address" in entry:
            keys = None
            if "key" in entry:  # the worker's public key: clients check they reached the right one
                if not isinstance(entry["key"], str) or not entry["key"]:
                    raise ValueError(
                        f"{path}: [hosts.{name}] key must be the path of the worker's `.key` file, "
                        f'like key = "keys/{name}.key"'
                    )
                where = Path(path).parent / entry["key"]
                if not where.exists():
                    raise ValueError(
                        f'{path}: [hosts.{name}] key = "{entry["key"]}", and there is no such file '
                        f"({where.resolve()}): make the worker's pair on that worker (`python -m somatize "
                        f"keys DIR {name}`) and copy its public `{name}.key` to {where.resolve()}, or take "
                        f"the line out if that worker listens without keys"
                    )
                try:
                    public = read_public(where)
                except BadKeys as exc:
                    raise ValueError(f"{path}: [hosts.{name}] key: {exc}") from exc
                keys = Keys(public=b"", secret=b"", server_key=public)
            address = entry["address"]
            if isinstance(address, list) and not all(isinstance(a, str) for a in address):
                raise ValueError(f'{path}: [hosts.{name}] address is one "host:port" or a list of them (a pool)')
            out[name] = Worker.at(
                address,
                mode=entry.get("mode", "project"),
                mount=entry.get("mount"),
                keys=keys,
                deadline=entry.get("deadline"),
            )
        else:
            try:
                out[name] = Worker.spawn(
                    entry["spawn"],
                    mode=entry.get("mode", "project"),
                    mount=entry.get("mount"),
                    deadline=entry.get("deadline"),
                    processes=entry.get("processes"),
                )
            except TypeError as exc:
                raise ValueError(f"{path}: [hosts.{name}]: {exc}") from None
    return expand(out)


def _more_descriptors(log: logging.Logger) -> None:
    """A connection is a descriptor: raise the soft limit to the hard one (a login shell's
    1,024 stops a broker at about a thousand workers), and say so when that is still low."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    if soft != resource.RLIM_INFINITY and soft < MAX_DIALED:
        log.warning(
            "this broker may hold %d descriptors, one a connection: fewer than the %d workers it "
            "takes; raise the limit (`ulimit -n`, or LimitNOFILE in its unit)",
            soft,
            MAX_DIALED,
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=command.prog("somatize.broker"), description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--listen",
        metavar="URL",
        default="tcp://127.0.0.1:5555",
        help="where clients and dialing workers reach this broker (default tcp://127.0.0.1:5555)",
    )
    parser.add_argument("--hosts", metavar="FILE.toml", help="the host table")
    command.key_options(parser, workers=True)
    parser.add_argument(
        "--bindings",
        metavar="FILE.json",
        help="keep which worker key owns which dialed-in host name in this file, so a "
        "restarted broker gives each name back only to its key (written 0600, in a "
        "folder of this user's that others may not write in)",
    )
    command.patience_option(parser)
    command.log_option(parser)
    parser.add_argument(
        "--max-hosts-per-key",
        metavar="N",
        type=int,
        default=MAX_HOSTS_PER_KEY,
        help=f"hosts one worker key may serve at once (default {MAX_HOSTS_PER_KEY:,}: one SLURM job "
        f"of that many nodes on one key)",
    )
    parser.add_argument(
        "--insecure", action="store_true", help="allow listening on an address other machines can reach, with no keys"
    )
    parser.add_argument("--announce", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    log = command.configure_log(args.log_level).getChild("broker")
    if args.max_hosts_per_key < 1:
        print("somatize broker: --max-hosts-per-key must be at least 1", file=sys.stderr)
        return 2
    _more_descriptors(log)

    try:
        hosts = read_hosts(args.hosts) if args.hosts else {}
    except (OSError, ValueError, TypeError, tomllib.TOMLDecodeError) as exc:
        print(f"somatize broker: cannot use the host table: {exc}", file=sys.stderr)
        return 2
    url = sockets.tcp_url(args.listen)
    keys = command.server_keys(args, "broker")
    if keys is False:
        return 2
    if not command.may_listen(
        url, insecure=args.insecure, who="broker", risk="use its workers", keyed=keys is not None
    ):
        return 2
    try:
        server = BrokerLoop(
            hosts, patience=args.patience, bindings=args.bindings, max_hosts_per_key=args.max_hosts_per_key
        )
    except (OSError, ValueError) as exc:
        print(f"somatize broker: cannot use the bindings file: {exc}", file=sys.stderr)
        return 2
    endpoint = command.bind(server, url, who="broker", keys=keys)
    if endpoint is None:
        return 2

    def ready() -> None:
        log.info(
            "listening on %s with %s; hosts: %s", endpoint, server.described(), ", ".join(sorted(hosts)) or "none yet"
        )
        if args.announce:
            print(f"somatize-broker ready {endpoint}", flush=True)

    return command.serve_until_signalled(server, log, ready)


if __name__ == "__main__":
    sys.exit(main())
