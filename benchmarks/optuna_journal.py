"""One Optuna process of the study case (f): ``python optuna_journal.py JOURNAL TRIALS``.

Loads the study ``speed`` from a ``JournalFileBackend`` file that several such processes
share and runs the instant objective (the one ``objectives.py`` gives somatize's runners)
until the study holds ``TRIALS`` trials: Optuna's own way for processes that share nothing
but a file, to set beside two ``python -m somatize study`` runners.
"""

from __future__ import annotations

import sys

import optuna
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
from optuna.study import MaxTrialsCallback


def instant(trial: optuna.Trial) -> float:
    return (trial.suggest_float("x", -5.0, 5.0) - 1.0) ** 2


def main(argv: list[str]) -> int:
    path, trials = argv[0], int(argv[1])
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.load_study(
        study_name="speed", storage=JournalStorage(JournalFileBackend(path)), sampler=optuna.samplers.RandomSampler()
    )
    study.optimize(instant, callbacks=[MaxTrialsCallback(trials, states=None)])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
