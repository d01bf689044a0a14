"""Rows of the benchmark table, the statistics behind them, and how they are printed.

A row is text already: every case decides how its numbers read. This module only counts
(median, p99, interleaved blocks) and lays rows out, as aligned text or as Markdown.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

PASS, MISS = "PASS", "MISS"


@dataclasses.dataclass
class Row:
    case: str  # "a" .. "e"
    what: str  # what was measured, in a few words
    result: str  # the measurement, with its unit
    against: str = ""  # what it is compared with, and that one's measurement
    ratio: str = ""  # result / against, as the target reads it
    target: str = ""  # the target, as a ratio or a count
    verdict: str = ""  # PASS | MISS | "" (no target) | "floor" | "not installed" | ...


HEADERS = ("case", "what", "result", "against", "ratio", "target", "verdict")


def cells(row: Row) -> tuple[str, ...]:
    return (row.case, row.what, row.result, row.against, row.ratio, row.target, row.verdict)


def as_text(rows: Sequence[Row]) -> str:
    table = [HEADERS, *(cells(r) for r in rows)]
    widths = [max(len(line[i]) for line in table) for i in range(len(HEADERS))]
    out = []
    for number, line in enumerate(table):
        out.append("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip())
        if number == 0:
            out.append("  ".join("-" * width for width in widths))
    return "\n".join(out)


def as_markdown(rows: Sequence[Row]) -> str:
    def escape(cell: str) -> str:
        return cell.replace("|", "\\|")

    out = ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    for row in rows:
        out.append("| " + " | ".join(escape(c) for c in cells(row)) + " |")
    return "\n".join(out)


# -- statistics ---------------------------------------------------------------------------


def median(samples: Sequence[float]) -> float:
    ordered = sorted(samples)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def p99(samples: Sequence[float]) -> float:
    """The 99th percentile, nearest rank (with few samples: the largest)."""
    ordered = sorted(samples)
    rank = max(1, -(-99 * len(ordered) // 100))  # ceil(0.99 n)
    return ordered[rank - 1]


def interleaved(contenders: dict[str, Callable[[], object]], calls: int, blocks: int = 8) -> dict[str, list[float]]:
    """Seconds per call of each contender, ``calls`` each, run in alternating blocks.

    The machine is shared: alternating blocks spreads whatever else runs over every
    contender alike, instead of landing on whichever happened to run then.
    """
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    per_block = max(1, calls // blocks)
    for block in range(blocks):
        order = list(contenders.items())
        if block % 2:
            order.reverse()
        for name, call in order:
            clock = time.perf_counter_ns
            for _ in range(per_block):
                started = clock()
                call()
                samples[name].append((clock() - started) / 1e9)
    return samples


def best_block(samples: Sequence[float], blocks: int) -> float:
    """The lowest of the medians of ``blocks`` consecutive runs of samples (as
    :func:`interleaved` takes them): the estimate least disturbed by other work on the
    machine, which comes and goes by the second."""
    per_block = max(1, len(samples) // blocks)
    return min(median(samples[i : i + per_block]) for i in range(0, len(samples), per_block))


def repeated(call: Callable[[], object], times: int) -> list[float]:
    """Seconds taken by each of ``times`` calls."""
    out = []
    for _ in range(times):
        started = time.perf_counter_ns()
        call()
        out.append((time.perf_counter_ns() - started) / 1e9)
    return out


# -- how numbers read ---------------------------------------------------------------------


def us(seconds: float) -> str:
    micro = seconds * 1e6
    if micro >= 10_000:
        return f"{micro / 1000:,.1f} ms"
    if micro >= 100:
        return f"{micro:,.0f} µs"
    if micro >= 1:
        return f"{micro:.1f} µs"
    return f"{micro * 1000:.0f} ns"


def ms(seconds: float) -> str:
    return f"{seconds * 1000:,.1f} ms"


def gbps(nbytes: int, seconds: float) -> float:
    """Round-trip throughput: the bytes went there and came back."""
    return 2 * nbytes / seconds / 1e9


def size(nbytes: int) -> str:
    if nbytes >= 1 << 20:
        return f"{nbytes >> 20} MiB"
    if nbytes >= 1 << 10:
        return f"{nbytes >> 10} KiB"
    return f"{nbytes} B"


def ratio(value: float) -> str:
    """Three significant digits: enough that a ratio printed 0.50x never reads as a PASS of
    a 0.5x target it missed."""
    return f"{value:.3g}x"


def at_most(value: float, limit: float) -> str:
    return PASS if value <= limit else MISS


def at_least(value: float, limit: float) -> str:
    return PASS if value >= limit else MISS
