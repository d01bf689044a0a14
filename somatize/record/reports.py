"""Machines speaking for themselves: what a worker says about its load, and where it is kept.

``report`` writes a machine's note under ``machine/<name>`` (one name per machine, rewritten
each time); ``latest`` reads every machine's last note with one scan; ``self_report`` builds
what a worker says (the same dict goes into the store and, as a ``said`` fact, down an open
connection). The name is the one ``--machine`` gives, so a ``said`` fact and the store's
note can be joined by it (see ``fleet``).

This module measures this process only; it knows nothing of runs or forwards.
"""

from __future__ import annotations

import math
import os
import socket
import sys
from collections.abc import Mapping

from ..errors import BadName
from ..store import Store, check_name
from .shapes import Malformed, left_out, number, small_record, whole

_MACHINES = "machine/"


def report(store: Store, machine: str, said: Mapping[str, str]) -> None:
    """Write what ``machine`` says about itself under ``machine/<machine>``, replacing the last.

    The record is ``said`` plus ``machine``; there is no blob. One put.
    """
    if not isinstance(machine, str) or "/" in machine:
        raise BadName(f"report(machine=...): a machine's name is one store name component; got {machine!r}.")
    name = f"{_MACHINES}{machine}"
    try:
        check_name(name)
    except BadName as exc:
        raise BadName(f"report(machine=...): {machine!r} cannot name a machine. {exc}") from None
    store.put(name, {**said, "machine": machine})


def latest(store: Store) -> dict[str, dict[str, str]]:
    """What each machine said about itself last, by machine. One scan. A note too big to be
    a worker's (:data:`.shapes.RECORD_MOST`) is left out with one line."""
    out = {}
    for name, record in store.scan(_MACHINES):
        rest = name[len(_MACHINES) :]
        if "/" not in rest:
            try:
                out[rest] = checked_report(small_record(record), rest)
            except Malformed as exc:
                left_out(store, name, exc)
    return out


_LOADS = ("load1", "load5", "load15")
_COUNTS = ("rss_bytes", "slices", "pid")


def checked_report(record: dict[str, str], machine: str) -> dict[str, str]:
    """``record`` if what :func:`self_report` says in it reads as it writes it: each load a
    finite number from 0, ``rss_bytes``, ``slices`` and ``pid`` whole numbers, ``machine``
    the name it is filed under. Anything else a machine said is text, and passes.
    ``Malformed`` otherwise: a page would show a load of ``nan`` or ``²`` as if a worker
    had said it."""
    for key in _LOADS:
        if key in record:
            load = number(record[key])
            if load is None or not math.isfinite(load) or load < 0:
                raise Malformed(f"its {key} {record[key][:40]!r} is not a load (a finite number from 0)")
    for key in _COUNTS:
        if key in record and whole(record[key]) is None:
            raise Malformed(f"its {key} {record[key][:40]!r} is not a whole number")
    if record.get("machine", machine) != machine:
        raise Malformed(f"it says it is machine {record['machine'][:40]!r}, but is filed under {machine!r}")
    return record


def self_report(served: int, machine: str | None = None) -> dict[str, str]:
    """What a worker says about itself: load, memory, slices served, pid and name, as text.

    ``kind`` is ``load``; ``load1``, ``load5`` and ``load15`` are the load averages (left
    out where the system has none); ``rss_bytes`` is the resident memory now (VmRSS), or
    the peak where /proc is missing; ``slices`` is ``served``; ``machine`` is ``machine``
    (the name ``--machine`` gives) or, without one, this computer's host name.
    """
    if isinstance(served, bool) or not isinstance(served, int) or served < 0:
        raise ValueError(f"`served=` takes a whole number from 0; got {served!r}.")
    if machine is not None and not (isinstance(machine, str) and machine):
        raise ValueError(f"`machine=` is the name a machine reports under, a non-empty str; got {machine!r}.")
    said = {"kind": "load"}
    try:
        load1, load5, load15 = os.getloadavg()
    except (OSError, AttributeError):
        pass
    else:
        said.update(load1=f"{load1:.2f}", load5=f"{load5:.2f}", load15=f"{load15:.2f}")
    rss = _rss_bytes()
    if rss is not None:
        said["rss_bytes"] = str(rss)
    # `machine`, not `host`: on a connection the client adds `host`, the graph's name for it
    said.update(slices=str(served), pid=str(os.getpid()), machine=machine or socket.gethostname())
    return said


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    amount, unit = line.split()[1:3]
                    return int(amount) * (1024 if unit.lower() == "kb" else 1)
    except (OSError, ValueError):
        pass
    try:
        import resource
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere
