"""Objectives the study case runs: importable by name by its runner processes."""


def instant(trial):
    """Returns at once: what is measured is the claiming and the writing, not the work."""
    return (trial.config["x"] - 1.0) ** 2


def stalls_first(trial):
    """Trial 0's attempt 0 writes and goes on (until its runner is killed); any other attempt
    returns at once: the takeover of a killed runner's trial is what is measured."""
    import time

    if trial.number == 0 and trial.attempt == 0:
        while True:
            trial.say(alive=1)
            time.sleep(0.1)
    return float(trial.attempt)
