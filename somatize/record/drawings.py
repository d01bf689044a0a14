"""Drawings of the record: the fleet per host (``machines``) and a study's scores (``scores``).

Each is a matplotlib ``Figure`` when matplotlib can be imported (``pip install
somatize[plot]``) and ``as_text`` is false, otherwise a text chart, a :class:`Chart`. A
drawing is returned, never printed: a notebook shows it. Each costs what the reader it
draws costs, and nothing more.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from ..store import Store
from .readers import fleet
from .studies import scored

_WIDTH = 40


class Chart(str):
    """A text chart: a ``str`` that shows itself as drawn rather than quoted."""

    def __repr__(self) -> str:
        return str(self)


def machines(store: Store, run: str, *, as_text: bool = False) -> Any:
    """The fleet, drawn: what ran on each host against what waited on the wire and queue.

    A matplotlib ``Figure`` when matplotlib can be imported (and ``as_text`` is false),
    otherwise a text chart (a ``str``), one line per host, naming the machine and the items
    per second where the facts said them. Returns it; prints nothing. Costs what
    :func:`fleet` costs.
    """
    hosts = fleet(store, run)
    if not as_text:
        Figure = _matplotlib()
        if Figure is not None:
            return _fleet_figure(Figure, run, hosts)
    return _fleet_text(run, hosts)


def scores(store: Store, study: str, *, as_text: bool = False) -> Any:
    """A study, drawn: the score of each trial, and the best so far.

    A matplotlib ``Figure`` when matplotlib can be imported (and ``as_text`` is false),
    otherwise a text chart, one line per trial: its state, score, a bar, the best so far,
    and ``*`` where it set a new best. Returns it; prints nothing. One scan of ``<study>/``,
    no fetch (as :func:`best`).
    """
    direction, rows = scored(store, study, "scores(study=...)")
    if not as_text:
        Figure = _matplotlib()
        if Figure is not None:
            return _scores_figure(Figure, study, direction, rows)
    return _scores_text(study, direction, rows)


def _matplotlib() -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return None
    return Figure


# -- the fleet ----------------------------------------------------------------------------


def _fleet_text(run: str, hosts: dict[str, dict[str, Any]]) -> Chart:
    if not hosts:
        return Chart(f"nothing ran on another machine in run {run!r}")
    widest = max(len(printable(host)) for host in hosts)
    most = max(row["took_us"] + row["waiting_us"] for row in hosts.values()) or 1
    lines = [f"run {run!r}, per host: # ran there, . waited (the wire and the queue)"]
    for host, row in hosts.items():
        ran = _bar(row["took_us"], most)
        waited = _bar(row["waiting_us"], most)
        line = (
            f"{printable(host):<{widest}}  {'#' * ran}{'.' * waited}{' ' * (_WIDTH - ran - waited)}"
            f"  slices {row['slices']}  ran {row['took_us']} us  waited {row['waiting_us']} us"
        )
        if row.get("items_per_s") is not None:
            line += f"  {row['items_per_s']:.4g} items/s"
        if "machine" in row:
            line += f"  on {printable(row['machine'])}"
        lines.append(line)
    return Chart("\n".join(lines))


def printable(text: object, limit: int | None = None) -> str:
    """Text from the store (a host's or machine's name, a runner's, an error: written by other
    processes) as a terminal may show it: no escape sequence, no line break, at most
    ``limit`` characters."""
    return "".join(c if c.isprintable() else "?" for c in str(text)[:limit])


def _bar(amount: float, most: float) -> int:
    if amount <= 0:
        return 0
    return max(1, round(amount * (_WIDTH - 1) / most))


def _fleet_figure(Figure: Any, run: str, hosts: dict[str, dict[str, Any]]) -> Any:
    names = list(hosts)
    labels = [f"{h}\n{hosts[h]['machine']}" if "machine" in hosts[h] else h for h in names]
    figure = Figure(figsize=(7, 1.2 + 0.45 * max(1, len(names))), layout="constrained")
    axes = figure.subplots()
    ran = [hosts[h]["took_us"] for h in names]
    waited = [hosts[h]["waiting_us"] for h in names]
    axes.barh(labels, ran, label="ran there")
    axes.barh(labels, waited, left=ran, label="waited (the wire and the queue)")
    axes.invert_yaxis()
    axes.set_xlabel("microseconds")
    axes.set_title(f"run {run!r}, per host" if names else f"nothing ran elsewhere in run {run!r}")
    if names:
        figure.legend(loc="outside lower center", ncols=2, frameon=False)
    return figure


# -- a study ------------------------------------------------------------------------------


def _scores_text(study: str, direction: str | None, rows: list[dict[str, Any]]) -> Chart:
    if not rows:
        return Chart(f"study {study!r} has no trials yet")
    low, high = _scale([row["score"] for row in rows if _finite(row["score"])])
    wide = max(5, len(str(rows[-1]["trial"])))
    lines = [f"study {study!r} ({direction or 'direction unknown'}): score per trial, the best so far, * a new best"]
    if any(_finite(row["score"]) and not low <= row["score"] <= high for row in rows):
        lines[0] += f"; bars span {low:.6g} to {high:.6g}, < and > mark scores beyond"
    for row in rows:
        score = row["score"]
        bar = ""
        if _finite(score):
            if score < low:
                bar = "<"
            elif score > high:
                bar = "#" * (_WIDTH - 1) + ">"
            else:
                bar = "#" * (_WIDTH if high == low else 1 + round((score - low) * (_WIDTH - 1) / (high - low)))
        best = "" if row["best"] is None else f"  best {row['best']:.6g}"
        line = f"{row['trial']:>{wide}}  {row['state']:<9}  {_number(score):>11}  {bar:<{_WIDTH}}{best}"
        lines.append((line + ("  *" if row["improved"] else "")).rstrip())
    return Chart("\n".join(lines))


def _scale(scores: list[float]) -> tuple[float, float]:
    """The range the bars span: the scores', less those far out (beyond 1.5 interquartile
    ranges from the quartiles, Tukey's fences), so one diverged trial does not flatten the
    differences among the rest into full bars."""
    if not scores:
        return 0.0, 0.0
    if len(scores) < 4:
        return min(scores), max(scores)
    first, _, third = statistics.quantiles(scores, n=4, method="inclusive")
    reach = 1.5 * (third - first)
    kept = [s for s in scores if first - reach <= s <= third + reach]
    return min(kept), max(kept)


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.6g}"


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def _scores_figure(Figure: Any, study: str, direction: str | None, rows: list[dict[str, Any]]) -> Any:
    figure = Figure(figsize=(7, 3.5), layout="constrained")
    axes = figure.subplots()
    done = [row for row in rows if row["state"] == "done" and _finite(row["score"])]
    others = [row for row in rows if row not in done and _finite(row["score"])]
    axes.scatter([r["trial"] for r in done], [r["score"] for r in done], label="score", zorder=3)
    if others:  # pruned, or stopped before the end: their last score, apart
        axes.scatter([r["trial"] for r in others], [r["score"] for r in others], marker="x", label="not done", zorder=3)
    steps = [row for row in rows if row["best"] is not None]
    if steps:
        axes.step([r["trial"] for r in steps], [r["best"] for r in steps], where="post", label="best so far")
    axes.set_xlabel("trial")
    axes.set_ylabel("score")
    axes.set_title(
        f"study {study!r} ({direction or 'direction unknown'})" if rows else f"study {study!r} has no trials yet"
    )
    if done or others:
        axes.legend(frameon=False)
    return figure
