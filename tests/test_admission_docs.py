"""The broker's bounds as the docs state them are the ones its code has (issue 38): the limits
table of docs/security.md and the bounds docs/conversation.md names, read from the pages
and compared with the constants. No process: a page that drifts from the code fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from somatize.fabric.broker import answers, children, floods, front, loop, outbox
from somatize.fabric.broker.peers import BrokerView
from somatize.wire import limits

DOCS = Path(__file__).resolve().parent.parent / "docs"
UNITS = {"": 1, "bytes": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
NUMBER = re.compile(r"(\d[\d,]*)(?:\s+(bytes|KiB|MiB|GiB)\b)?")

VIEW = BrokerView(max_offers=loop.MAX_HOSTS_PER_KEY)
#: Each row of security.md's limits table, by the start of its first column: the constants
#: its numbers are, in the order it says them.
ROWS = {
    "host names one worker key serves at once": (loop.MAX_HOSTS_PER_KEY,),
    "host names one worker key holds": (VIEW.max_bindings,),
    "characters in a host name": (limits.MAX_NAME,),
    "characters in the path of a worker's folder": (limits.MAX_PATH,),
    "hosts dialed in to one broker": (loop.MAX_DIALED,),
    "connections of one client key": (loop.MAX_CONNECTIONS,),
    "relayed exchanges of one tenant": (VIEW.max_exchanges, VIEW.max_open),
    "questions of one tenant waiting": (children.MAX_PENDING,),
    "answers waiting for one connection": (front.MAX_UNREAD,),
    "bytes of one message to or from the broker": (outbox.LARGEST,),
    "bytes of one `Listed` answer": (answers.LISTED_BYTES,),
    "messages in ZeroMQ's queue to one peer": (outbox.PIPED,),
    "bytes held for one peer": (outbox.PEER_BYTES,),
    "bytes waiting in the outbox": (outbox.ALL_BYTES,),
    "messages waiting for one tenant at one peer": (outbox.HELD,),
    "messages refused a second": (floods.REFUSED, floods.REFUSED_KEY),
    "questions a second": (floods.CHATTY, floods.CHATTY_KEY),
    "messages a second of any kind": (floods.BUSY, floods.BUSY_KEY, floods.BUSY_WORKER),
    "bytes a second": (floods.FLOW, floods.FLOW_KEY),
}


def numbers(text: str) -> list[int]:
    """Every number in ``text``, in bytes where a unit follows it ("4 MiB" is 4,194,304)."""
    return [int(n.replace(",", "")) * UNITS[unit or ""] for n, unit in NUMBER.findall(text)]


def limits_table() -> dict[str, str]:
    page = (DOCS / "security.md").read_text()
    section = page.split("\n## Limits", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0] not in ("limit", "---"):
            rows[cells[0]] = cells[1]
    return rows


@pytest.mark.pure
def test_security_states_each_limit_once_as_the_code_has_it():
    table = limits_table()
    for start, constants in ROWS.items():
        found = [bound for name, bound in table.items() if name.startswith(start)]
        assert len(found) == 1, f"security.md's limits: one row begins {start!r}, not {len(found)}"
        assert numbers(found[0])[: len(constants)] == list(constants), (
            f"security.md says {start}: {found[0]}; the code has {constants}"
        )
    assert len(table) == len(ROWS), f"rows no test reads: {sorted(set(table) - set(ROWS))}"


@pytest.mark.parametrize("page", ["security.md", "conversation.md"])
@pytest.mark.pure
def test_no_page_states_the_per_key_names_again(page):
    """The names a key may serve and hold are said once, in the limits table."""
    text = (DOCS / page).read_text()
    if page == "security.md":
        text = text.split("\n## Limits", 1)[0] + text.split("\n## Limits", 1)[1].split("\n## ", 1)[1]
    for said in re.findall(r"(\d[\d,]*) names at once|names \((\d[\d,]*) at once", text):
        raise AssertionError(f"{page} states the names a key serves at once again ({said}): link the limits")


@pytest.mark.pure
def test_conversation_states_the_brokers_bounds_as_the_code_has_them():
    page = " ".join((DOCS / "conversation.md").read_text().split())  # sentences across lines
    said = {
        r"(\d[\d,]*) messages per tenant at a peer": outbox.HELD,
        r"at a peer, (\d[\d,]*) MiB per peer": outbox.PEER_BYTES >> 20,
        r"MiB per peer, (\d[\d,]*) MiB in all": outbox.ALL_BYTES >> 20,
        r"The (\d[\d,]*) MiB count what ZeroMQ holds": outbox.PEER_BYTES >> 20,
        r"takes at most (\d[\d,]*) messages \(`SNDHWM`\)": outbox.PIPED,
        r"one over (\d[\d,]*) bytes is refused": outbox.LARGEST,
        r"past (\d[\d,]*) a second on a connection": floods.REFUSED,
        r"or (\d[\d,]*) on a key, the connection": floods.REFUSED_KEY,
        r"(\d[\d,]*) questions waiting for a start": children.MAX_PENDING,
        r"(\d[\d,]*) unread answers": front.MAX_UNREAD,
        r"(\d[\d,]*) connections per key": loop.MAX_CONNECTIONS,
        r"A `Listed` is at most (\d[\d,]*) MiB": answers.LISTED_BYTES >> 20,
        r"at most (\d[\d,]*) per tenant": VIEW.max_exchanges,
        r"per tenant, (\d[\d,]*) in all": VIEW.max_open,
    }
    for pattern, constant in said.items():
        found = re.findall(pattern, page)
        assert found, f"conversation.md no longer says {pattern!r}"
        assert all(int(n.replace(",", "")) == constant for n in found), (
            f"conversation.md says {pattern!r} = {found}; the code has {constant}"
        )
