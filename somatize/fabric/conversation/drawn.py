"""The conversation's tables as a reader sees them: Markdown tables and a state diagram, drawn
from the tables the code runs (``docs/conversation.md`` holds them between markers, and a test
checks that the page says what the code does).

``python -m somatize.fabric.conversation.drawn docs/conversation.md`` draws them again into
the page, after a table changed.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from pathlib import Path

from .broker import BROKER_TABLE, STEPS, Side
from .client import CLIENT_SENDS, CLIENT_TABLE, TAKES
from .worker import ACTS, WORKER_TABLE, Refuse


def _kind(kind: type | str) -> str:
    return f"`{kind.__name__}`" if isinstance(kind, type) else kind


def markdown(side: str) -> str:
    """The table of ``side`` ("client", "client sends", "worker" or "broker") in Markdown."""
    rows: list[tuple[str, ...]]
    if side == "client":
        rows = [
            (str(state), _kind(kind), str(after), TAKES[take]) for (state, kind), (after, take) in CLIENT_TABLE.items()
        ]
        rows.append(("any", "anything else", "closed", "`Refused`: the channel never guesses its way back"))
        return _table(("state", "arrives", "then", "the channel"), rows)
    if side == "client sends":
        rows = [(str(state), _kind(kind), str(after)) for (state, kind), after in CLIENT_SENDS.items()]
        return _table(("state", "sends", "then"), rows)
    if side == "worker":
        rows = []
        for (session, kind), found in WORKER_TABLE.items():
            if isinstance(found, Refuse):
                rows.append((str(session), _kind(kind), str(session), f"refused: {found.why}"))
            else:
                rows.append((str(session), _kind(kind), str(found[0]), ACTS[found[1]]))
        rows.append(("unknown", "anything else", "unknown", "refused unopened, with `hello`: say Hello first"))
        rows.append(("greeted", "anything else", "greeted", "refused: a worker does not answer it"))
        return _table(("session", "arrives", "then", "the worker"), rows)
    if side == "broker":
        rows = []
        for kind in dict.fromkeys(kind for _, kind in BROKER_TABLE):
            steps = {side: BROKER_TABLE.get((side, kind)) for side in Side}
            sides = [side for side in Side if steps[side] is not None]
            who = "anyone" if len(sides) == len(Side) else ", ".join(f"a peer {side}" for side in sides)
            step = steps[sides[0]]
            assert step is not None and all(steps[side] is step for side in sides)  # one step per kind
            rows.append((_kind(kind), who, str(step), STEPS[step]))
        rows.append(("anything else", "anyone", "—", "`Refused`, and no value is decoded"))
        return _table(("arrives", "from", "step", "the broker"), rows)
    raise ValueError(f"no table for {side!r}: say client, client sends, worker or broker")


def diagram() -> str:
    """The client's channel as a Mermaid state diagram (what it sends, what arrives)."""
    lines = ["stateDiagram-v2", "    [*] --> new"]
    for (state, sent), after in CLIENT_SENDS.items():
        lines.append(f"    {_id(state)} --> {_id(after)}: sends {_plain(sent)}")
    for (state, arrived), (after, _) in CLIENT_TABLE.items():
        lines.append(f"    {_id(state)} --> {_id(after)}: {_plain(arrived)}")
    lines.append("    closed --> [*]")
    return "\n".join(lines)


def _id(state: str) -> str:
    return str(state).replace("+", "_")


def _plain(kind: type | str) -> str:
    return kind.__name__ if isinstance(kind, type) else str(kind).replace("`", "").replace(",", "")


def _table(header: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


_BLOCK = re.compile(r"(<!-- drawn: (?P<what>[a-z ]+) -->\n)(?P<body>.*?)(<!-- /drawn -->)", re.S)


def drawn(what: str) -> str:
    """What a block marked ``<!-- drawn: what -->`` holds: a table, or the diagram in a fence."""
    if what == "diagram":
        return "```mermaid\n" + diagram() + "\n```\n"
    return markdown(what) + "\n"


def blocks(page: str) -> dict[str, str]:
    """The blocks of ``page`` drawn from the tables, by what they draw, as the page has them."""
    return {m["what"]: m["body"] for m in _BLOCK.finditer(page)}


def redraw(page: str) -> str:
    """``page`` with each drawn block drawn again from the code's tables."""
    return _BLOCK.sub(lambda m: m[1] + drawn(m["what"]) + m[4], page)


if __name__ == "__main__":  # pragma: no cover - a maintainer's tool, checked by the test of the page
    for path in map(Path, sys.argv[1:]):
        path.write_text(redraw(path.read_text()))
        print(f"drew the conversation's tables into {path}")

__all__ = ["blocks", "diagram", "drawn", "markdown", "redraw"]
