"""Reading the record back: plain functions over a store, each with a known price.

``runs``, ``forwards`` and a summarised ``curve`` cost one scan; ``curve_costs`` tells the
price of a ``curve`` before it is paid; ``facts`` is one fetch; ``nodes`` and ``fleet`` a
fetch per forward they read (``fleet`` one more scan, of the machines' reports).

These functions add up what the facts say; they never judge it, and never write. Whoever
may write the store's folder may write what they read, so each blob and record is checked
against its shape first (:mod:`.shapes`): one that fails is left out with one line naming it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import Missing, StoreError
from ..facts import Fact
from ..store import FolderStore, Store, scanned_record
from .recorder import NUMBER, RUNS, check_run, end_name, entry_name, forward_numbers, records_of
from .reports import latest
from .shapes import Malformed, left_out, maybe_float, read_facts, small_record, whole
from .shapes import number as as_number


def runs(store: Store) -> list[str]:
    """The runs this store holds a record of, sorted. One scan."""
    found = set()
    for name, _ in store.scan(RUNS):
        parts = name.split("/")
        if len(parts) == 3 and NUMBER.fullmatch(parts[2]):
            found.add(parts[1])
    return sorted(found)


def forwards(store: Store, run: str) -> list[dict[str, Any]]:
    """Step by step, from the records alone: one scan, no fetch.

    Each entry has ``forward``, ``state``, ``took_us``, ``nodes`` and ``facts`` (whole
    numbers; ``took_us`` is ``None`` when the closing fact had none), ``error`` for a
    forward that broke, and every summarised ``<kind>.<field>``, as a float when it reads as
    one and as text otherwise.
    """
    check_run(run, "forwards(run=...)")
    return [forward_row(number, record) for number, record in records_of(store, run)]


def forward_row(number: int, record: Mapping[str, str]) -> dict[str, Any]:
    """One forward's entry in `forwards`, from its record."""
    row: dict[str, Any] = {
        "forward": number,
        "state": record.get("state", ""),
        "took_us": whole(record.get("took_us")),
        "nodes": whole(record.get("nodes")),
        "facts": whole(record.get("facts")),
    }
    if "error" in record:
        row["error"] = record["error"]
    for key, value in record.items():
        if "." in key:
            row[key] = maybe_float(value)
    return row


def run_end(store: Store, run: str) -> str | None:
    """How ``run`` said it ended (``"ok"`` or ``"broke"``, `Recorder.close`), or None when it
    did not. One read; an end that is not one a recorder writes is left out, with one line."""
    name = end_name(check_run(run, "run_end(run=...)"))
    try:
        record = scanned_record(store, name)
    except StoreError as exc:  # a file there that is not a whole entry
        left_out(store, name, exc)
        return None
    if record is None:
        return None
    how, forwards = record.get("how"), record.get("forwards")
    if (
        record.get("run") != run
        or how not in ("ok", "broke")
        or not (isinstance(forwards, str) and NUMBER.fullmatch(forwards) and len(forwards) < 16)
    ):
        left_out(store, name, "it is not the end a recorder writes (run, how ok or broke, forwards)")
        return None
    return how


def curve(store: Store, run: str, kind: str = "loss", field: str = "value") -> list[tuple[int, float]]:
    """The series somebody plots: ``(forward, value)`` for every forward that said ``kind``.

    From the records alone (one scan) for the forwards whose recorder summarised ``kind``;
    for any other forward, its blob is fetched and the last ``kind`` fact with ``field`` is
    used. :func:`curve_costs` tells which, before paying for it. A forward whose value is
    not a number (text, say) is left off, with one line naming it.
    """
    check_run(run, "curve(run=...)")
    key = f"{kind}.{field}"
    out = []
    for number, record in records_of(store, run):
        if _summarises(record, kind, key):
            value = record.get(key)
        else:
            value = None
            for f in _read(store, run, number):
                if f.get("fact") == kind and field in f:
                    value = f[field]
        found = None if value is None else _float(store, value, run, number, key)
        if found is not None:
            out.append((number, found))
    return out


def curve_costs(store: Store, run: str, kind: str = "loss", field: str = "value") -> dict[str, Any]:
    """What :func:`curve` would cost, found with one scan and no fetch.

    ``{"scans": 1, "fetches": 0, "summarised": True, "forwards": N}`` when every record
    carries ``kind``; otherwise ``fetches`` counts the blobs it would read.
    """
    check_run(run, "curve_costs(run=...)")
    key = f"{kind}.{field}"
    records = records_of(store, run)
    fetches = sum(1 for _, record in records if not _summarises(record, kind, key))
    return {"scans": 1, "fetches": fetches, "summarised": fetches == 0, "forwards": len(records)}


def facts(store: Store, run: str, forward: int) -> list[Fact]:
    """Everything one forward did, in the order it arrived. One fetch.

    ``Missing`` when the run has no such forward. A line of its blob that is not a fact, or
    a blob too long to be a recorder's (:data:`.shapes.BLOB_MOST`), is left out with one line."""
    check_run(run, "facts(run=...)")
    return read_facts(store, entry_name(run, _index(forward, "forward")))


def nodes(store: Store, run: str, last: int | None = None) -> list[dict[str, Any]]:
    """Who spent the time, added up over the last ``last`` forwards (all when ``None``).

    One entry per node name: ``node``, ``ran`` (times), ``took_us`` (their sum),
    ``recalled`` and ``failed`` (times), and ``host`` when it ran elsewhere (several hosts
    are joined with ','). A node whose output was a batch also has ``items`` (how many it
    handled, added up over the runs that said so) and ``items_per_s`` (those items over the
    time of those runs; ``None`` when they took no measurable time). Sorted by ``took_us``,
    most first. One scan and a fetch per forward.
    """
    check_run(run, "nodes(run=...)")
    totals: dict[str, dict[str, Any]] = {}
    hosts: dict[str, set[str]] = {}
    batches: dict[str, list[int]] = {}  # node -> [items, microseconds of the runs that said them]
    for number, _ in _chosen(store, run, last):
        for f in _read(store, run, number):
            kind = f.get("fact")
            if kind not in ("ran", "recalled", "failed") or "node" not in f:
                continue
            name = f["node"]
            row = totals.setdefault(name, {"node": name, "ran": 0, "took_us": 0, "recalled": 0, "failed": 0})
            row[kind] += 1
            if kind == "ran":
                took = whole(f.get("took_us")) or 0
                row["took_us"] += took
                items = whole(f.get("items"))
                if items is not None:
                    batch = batches.setdefault(name, [0, 0])
                    batch[0] += items
                    batch[1] += took
            if "host" in f and kind != "recalled":
                hosts.setdefault(name, set()).add(f["host"])
    for name, where in hosts.items():
        totals[name]["host"] = ",".join(sorted(where))
    for name, (items, took) in batches.items():
        totals[name]["items"] = items
        totals[name]["items_per_s"] = _rate(items, took)
    return sorted(totals.values(), key=lambda row: (-row["took_us"], row["node"]))


def fleet(store: Store, run: str, last: int | None = None) -> dict[str, dict[str, Any]]:
    """Per host, what was sent there and what it cost: ``slices``, ``took_us``, ``waiting_us``.

    ``slices`` counts the ``left`` facts of a host (one per trip). ``took_us`` is the time
    the worker measured for each trip (``worked_us`` on ``left``, from its ``Done``), so two
    branches that ran side by side there count once; a trip whose ``left`` does not say it
    counts what ran there instead, the sum of its nodes. ``waiting_us`` is each trip's round
    trip less that (the wire and the queue), never below zero for one trip. Hosts are keyed
    as facts name them, so a route is its own key (``w1/w2``).

    A host whose nodes' outputs were batches has ``items`` (per trip, the largest batch a
    node of it handled) and ``items_per_s``. A host whose worker said who it is (a ``said``
    fact: the name ``--machine`` gives) has ``machine`` and ``pid`` (its worker's process, so
    the members of a pool on one machine are told apart); and ``said``, that machine's latest
    report (:func:`report`, found under its name, or else under the host's), or else the
    last it said down the connection. One scan and a fetch per forward, and one more scan
    for the reports.
    """
    check_run(run, "fleet(run=...)")
    out: dict[str, dict[str, Any]] = {}
    batches: dict[str, list[int]] = {}  # host -> [items, microseconds of the trips that said them]
    machine_of: dict[str, str] = {}
    told: dict[str, dict[str, str]] = {}
    for number, _ in _chosen(store, run, last):
        ran_since: dict[str, int] = {}  # what ran on each host since its last trip ended
        items_since: dict[str, int] = {}
        for f in _read(store, run, number):
            kind = f.get("fact")
            host = f.get("host")
            if not host:
                continue
            if kind == "said" and f.get("machine"):
                machine_of[host] = f["machine"]
                told[host] = {k: v for k, v in f.items() if k not in ("fact", "host")}
                continue
            if kind not in ("ran", "left"):
                continue
            row = out.setdefault(host, {"slices": 0, "took_us": 0, "waiting_us": 0})
            took = whole(f.get("took_us")) or 0
            if kind == "ran":
                ran_since[host] = ran_since.get(host, 0) + took
                items = whole(f.get("items"))
                if items is not None:
                    items_since[host] = max(items, items_since.get(host, 0))
                continue
            worked = whole(f.get("worked_us"))
            ran = ran_since.pop(host, 0)
            spent = ran if worked is None else worked
            row["slices"] += 1
            row["took_us"] += spent
            row["waiting_us"] += max(0, took - spent)
            if host in items_since:
                batch = batches.setdefault(host, [0, 0])
                batch[0] += items_since.pop(host)
                batch[1] += spent
        for host, ran in ran_since.items():  # a trip that never came back: what ran still ran
            out[host]["took_us"] += ran
    for host, (items, took) in batches.items():
        out[host]["items"] = items
        out[host]["items_per_s"] = _rate(items, took)
    if out:
        reports = latest(store)
        for host, row in out.items():
            machine = machine_of.get(host)
            if machine is not None:
                row["machine"] = machine
            pid = whole(told.get(host, {}).get("pid"))
            if pid is not None:  # what this host's worker said down its connection: its own, not its machine's
                row["pid"] = pid
            said = reports.get(machine) if machine is not None else None
            said = said or reports.get(host) or told.get(host)
            if said:
                row["said"] = said
    return dict(sorted(out.items()))


# -- helpers ------------------------------------------------------------------------------


def _read(store: Store, run: str, number: int) -> list[Fact]:
    """The facts of one forward a reader adds up: none where it is gone since it was listed."""
    try:
        return read_facts(store, entry_name(run, number))
    except Missing:
        return []


def _chosen(store: Store, run: str, last: int | None) -> list[tuple[int, dict[str, str]]]:
    if last is None:
        return records_of(store, run)
    count = _index(last, "last")
    if not count:
        return []
    if isinstance(store, FolderStore):  # the last forwards from a listing, then their records alone
        chosen = []
        for number in forward_numbers(store, run)[-count:]:
            name = entry_name(run, number)
            try:
                chosen.append((number, small_record(store.record(name))))
            except Missing:
                continue  # removed since it was listed
            except (StoreError, Malformed) as exc:  # listed, but not an entry a recorder writes
                left_out(store, name, exc)
        return chosen
    records = records_of(store, run)
    return records[len(records) - count :]


def _summarises(record: Mapping[str, str], kind: str, key: str) -> bool:
    return key in record or kind in record.get("summarising", "").split()


def _rate(items: int, microseconds: int) -> float | None:
    return items * 1e6 / microseconds if microseconds > 0 else None


def _float(store: Store, value: str, run: str, at: int, key: str) -> float | None:
    """``value`` as a number, or ``None`` (said once, naming the forward) when it is none:
    that forward is left off the curve, the others are drawn."""
    found = as_number(value)
    if found is None:
        left_out(
            store,
            entry_name(run, at),
            f"its {key} {value[:80]!r} is not a number, so forward {at} is left off the curve "
            f"(read it with `facts(store, run={run!r}, forward={at})`)",
        )
    return found


def _index(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"`{what}=` takes a whole number from 0; got {value!r}.")
    return value
