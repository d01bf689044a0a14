"""Objectives the study tests run, imported by name by runner processes (PYTHONPATH=tests/support).

Where a test needs to see what happened inside a runner, the objective appends a line to
the file named by ``STUDY_TEST_LOG``.
"""

from __future__ import annotations

import math
import os
import time

from somatize import Node


def _log(text: str) -> None:
    path = os.environ.get("STUDY_TEST_LOG")
    if path:
        with open(path, "a") as file:
            file.write(text + "\n")


def quadratic(trial):
    """Instant: (x - 2)^2, and a said value so the record has one."""
    x = trial.config["x"]
    trial.say(half=x / 2)
    return (x - 2.0) ** 2


def quadratic_slowly(trial):
    """(x - 2)^2 after 80 ms, so that two runners both get some."""
    time.sleep(0.08)
    return quadratic(trial)


def with_curve_of_x(trial):
    """For spaces of an integer x and a kind."""
    return float(trial.config["x"]) + (trial.config["kind"] == "b")


def boom(trial):
    raise ValueError(f"no good at x={trial.config['x']:.3f}")


def not_a_number(trial):
    return "fast"


def stalls_on_first_attempt(trial):
    """Trial 0's attempt 0 goes on (saying, so it stays alive) until it is stopped or
    overtaken; every other attempt is instant. The score says which attempt made it."""
    if trial.number == 0 and trial.attempt == 0:
        _log(f"started {os.getpid()}")
        deadline = time.monotonic() + 60
        step = 0
        while time.monotonic() < deadline:
            trial.say(step=step)
            step += 1
            time.sleep(0.05)
        return 1000.0
    return float(trial.attempt)


def overtakes_the_first_trial(trial):
    """Trial 2 writes, before it ends, what a runner that took trial 0 over while its attempt
    0 was finishing writes: trial 0's attempt 1, running, by another runner. Its own runner
    read trial 0 finished as it started; only its last look at the study can find this."""
    if trial.number == 2:
        first = dict(trial.store.scan(f"{trial.study}/trial/000000.000"))[f"{trial.study}/trial/000000.000"]
        trial.store.create(
            f"{trial.study}/trial/000000.001",
            {**first, "attempt": "1", "state": "running", "score": "", "runner": "elsewhere"},
        )
    return 1.0


def quiet_until_judged(trial):
    """Says nothing (only the pulse keeps it alive) until another runner has judged it,
    then for 2.5 s more while that runner keeps judging, then finishes."""
    deadline = time.monotonic() + 30
    while not list(trial.store.scan(f"{trial.study}/judge/")) and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(2.5)
    return 1.0


def sleeps_unless_taken_over(trial):
    """Attempt 0 says nothing and sleeps a minute (the pulse keeps it alive); later
    attempts are instant."""
    if trial.attempt == 0:
        _log(f"started {os.getpid()}")
        time.sleep(60)
    return float(trial.attempt)


def with_curve(trial):
    """Says a falling curve; a pruner may stop it."""
    x = trial.config["x"]
    for step in range(5):
        trial.say(step=step, value=x * (5 - step))
    return x


class Embed(Node):
    """An expensive frozen prefix: it counts its runs in the log."""

    def forward(self, text):
        _log(f"embed {os.getpid()}")
        return [len(word) for word in text.split()]


class Head(Node):
    def __init__(self, scale: float) -> None:
        self.scale = scale

    def forward(self, lengths):
        return sum(lengths) * self.scale


def shares_embed(trial):
    graph = Embed().named("embed").cached().frozen() >> Head(trial.config["scale"]).named("head")
    return graph.forward("a bb ccc dddd", store=trial.store, watching=trial.watching)


def tuned_slowly(trial):
    """A small model's validation loss, as a sweep over it might find one: x matters most,
    the learning rate some, the layers and the kind little; 80 ms each, so that two runners
    share the trials."""
    time.sleep(0.08)
    c = trial.config
    return (
        (c["x"] - 2) ** 2 + 0.5 * abs(math.log10(c["lr"]) + 2) + 0.05 * c["layers"] + (0.1 if c["kind"] == "b" else 0)
    )


class _Cycle:
    """Refers to itself: only the cyclic collector frees it. Freed, it says so in the log
    (with what it needs bound now: at exit, module globals may already be gone)."""

    def __init__(self, path: str, number: int) -> None:
        self.me = self
        self._path, self._number, self._open = path, number, open

    def __del__(self) -> None:
        with self._open(self._path, "a") as file:
            file.write(f"finalized {self._number}\n")


def counts_the_frozen_heap(trial):
    """Logs how many objects the collector skips (``gc.get_freeze_count``) and leaves behind
    a cycle whose finalizer logs when it runs: at the latest, at the runner's exit."""
    import gc

    _log(f"frozen {trial.number} {gc.get_freeze_count()}")
    path = os.environ.get("STUDY_TEST_LOG")
    if path:
        _Cycle(path, trial.number)
    return float(trial.number)
