"""``python -m somatize``: every command of the library in one place: the demo, keys, a study's
runner, the live view, and the broker and worker that serve a graph's hosts.

Each command's options are its own module's (``somatize.broker``, ``somatize.worker``,
``somatize.study.command``, ``somatize.view``); ``python -m somatize.broker`` and
``python -m somatize.worker`` are the same commands, as host tables and recipes name them.
"""

from __future__ import annotations

import argparse
import socket
import sys
import tempfile
from collections.abc import Sequence

from . import demo
from .study.command import add_arguments as study_arguments
from .study.command import command as study_command

#: The commands that serve, handed the rest of the command line as they are.
_SERVING = {
    "broker": "serve hosts to graphs: a rendezvous, a starter of spawned workers, a relay",
    "worker": "run the pieces of graphs sent to this machine: listen, or dial a broker",
}


def main(argv: Sequence[str] | None = None) -> int:
    given = list(sys.argv[1:] if argv is None else argv)
    if given and given[0] in _SERVING:
        from . import broker, worker

        return {"broker": broker.main, "worker": worker.main}[given[0]](given[1:])
    parser = argparse.ArgumentParser(
        prog="python -m somatize", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, what in _SERVING.items():  # listed in the help; their own parsers read their options
        commands.add_parser(name, help=what, add_help=False)

    run_demo = commands.add_parser("demo", help="run an example graph, printing what happens live")
    run_demo.add_argument(
        "--store",
        metavar="DIR",
        help="where to keep cached values (default: a temporary folder, removed afterwards)",
    )

    make_keys = commands.add_parser(
        "keys",
        help="make CURVE key pairs: NAME.key (public, to share) and NAME.key_secret (0600, to keep)",
    )
    make_keys.add_argument("folder", metavar="DIR", help="where to write them")
    make_keys.add_argument("names", metavar="NAME", nargs="*", help="one pair per name (default: this machine's name)")

    run_study = commands.add_parser(
        "study",
        help="run a study's trials here until all have finished (or --show them)",
        description="Run trials of a study defined in a shared folder, on this machine, "
        "until every trial has finished; any number of machines may run it at once.",
    )
    study_arguments(run_study)

    from . import view

    run_view = commands.add_parser(
        "view",
        help="show a store's record (runs, machines, studies) live in a browser",
        description="Serve a live view of a store's record to a browser; it only reads the store.",
    )
    view.add_arguments(run_view)

    args = parser.parse_args(given)
    if args.command == "study":
        return study_command(args)
    if args.command == "view":
        return view.command(args)
    if args.command == "keys":
        return _keys(args.folder, args.names or [socket.gethostname()])
    if args.command == "demo":
        if args.store:
            return demo.main(args.store)
        with tempfile.TemporaryDirectory(prefix="somatize-demo-") as folder:
            return demo.main(folder)
    parser.error(f"unknown command {args.command!r}")  # pragma: no cover
    return 2


def _keys(folder: str, names: list[str]) -> int:
    from .errors import BadKeys
    from .fabric.curve import make_pair

    for name in names:
        try:
            public, secret = make_pair(folder, name)
        except BadKeys as exc:
            print(f"somatize keys: {exc}", file=sys.stderr)
            return 2
        except OSError as exc:  # a folder this user may not create or write to
            print(
                f"somatize keys: cannot write key files into {folder}: {exc.strerror or exc}"
                f"{f' ({exc.filename})' if exc.filename and str(exc.filename) != folder else ''}; "
                f"create it first, owned by the user who keeps the keys (`sudo install -d -o USER -m 700 {folder}`), "
                f"or run this as that user",
                file=sys.stderr,
            )
            return 2
        print(f"{public}  (public: give it to whoever must recognise `{name}`)")
        print(f"{secret}  (secret, mode 0600: keep it on `{name}` only)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
