"""``python -m somatize``: the demo, and the small tools that come with the library."""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence

from . import demo


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m somatize", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run_demo = commands.add_parser("demo", help="run an example graph, printing what happens live")
    run_demo.add_argument(
        "--store",
        metavar="DIR",
        help="where to keep cached values (default: a temporary folder, removed afterwards)",
    )

    args = parser.parse_args(argv)
    if args.command == "demo":
        if args.store:
            return demo.main(args.store)
        with tempfile.TemporaryDirectory(prefix="somatize-demo-") as folder:
            return demo.main(folder)
    parser.error(f"unknown command {args.command!r}")  # pragma: no cover
    return 2


if __name__ == "__main__":
    sys.exit(main())
