"""The record of what happened, and the readers that answer from it.

- :mod:`.recorder`: a :class:`Recorder` is a watcher that writes one entry per forward,
  ``run/<run>/<n>``: a small record a scan answers from, and a blob with every fact.
- :mod:`.readers`: ``runs``, ``forwards``, ``curve`` and ``curve_costs`` (one scan each),
  ``run_end`` (how a run said it ended: one read),
  ``facts`` (one fetch), ``nodes`` and ``fleet`` (a fetch per forward read).
- :mod:`.reports`: ``report``, ``latest`` and ``self_report``, what each machine last said
  about itself, under ``machine/<name>``.
- :mod:`.studies`: ``trials`` and ``best``, a study's trials from one scan of its folder.
- :mod:`.drawings`: ``machines`` (the fleet) and ``scores`` (a study), as a figure or text.
- :mod:`.shapes`: what a blob or record read back must look like, checked before any of
  them uses it (a blob bounded by its file's length, a fact's line, JSON of bounded depth,
  numbers read strictly); one that fails is left out with one line.

This package does not judge the numbers; it writes them down and adds them up.
"""

from .drawings import Chart, machines, scores
from .readers import curve, curve_costs, facts, fleet, forwards, nodes, run_end, runs
from .recorder import Recorder
from .reports import latest, report, self_report
from .studies import best, trials

__all__ = [
    "Chart",
    "Recorder",
    "best",
    "curve",
    "curve_costs",
    "facts",
    "fleet",
    "forwards",
    "latest",
    "machines",
    "nodes",
    "report",
    "run_end",
    "runs",
    "scores",
    "self_report",
    "trials",
]
