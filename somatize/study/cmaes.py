"""Optuna's CMA-ES, its optimizer rebuilt from the trials instead of unpickled.

Optuna's ``CmaEsSampler`` keeps its optimizer from one trial to the next as a pickle in a
trial's system attributes, and loads it back with ``pickle.loads``. A study's trials are
records in a folder others may write, so that pickle would be their code, run by every
runner. This sampler never loads one: each time it is asked, it starts the optimizer afresh
(from its seed) and tells it every generation again, from the trials each generation tried
(their parameters, their scores, and the generation number each trial noted, plain JSON).
The pickle Optuna still writes stays in this runner's memory: the record never keeps it.

Importing this module imports Optuna; ``definition`` imports it only when asked for CMA-ES.
"""

from __future__ import annotations

from typing import Any, cast

import optuna
from optuna._transform import _SearchSpaceTransform
from optuna.study import StudyDirection


class RebuiltCmaEs(optuna.samplers.CmaEsSampler):
    """``CmaEsSampler`` whose ``_restore_optimizer`` replays the trials, never a pickle."""

    _asked: tuple[dict[str, Any], StudyDirection] | None = None

    def sample_relative(self, study: Any, trial: Any, search_space: dict[str, Any]) -> dict[str, Any]:
        self._asked = (search_space, study.direction)
        return super().sample_relative(study, trial, search_space)

    def _restore_optimizer(self, completed_trials: list[Any]) -> Any:
        if self._asked is None:
            return None
        search_space, direction = self._asked
        trans = _SearchSpaceTransform(search_space, transform_step=not self._with_margin, transform_0_1=True)
        optimizer = self._init_optimizer(trans, direction)
        sign = 1.0 if direction == StudyDirection.MINIMIZE else -1.0
        for _ in range(len(completed_trials)):  # each pass tells one generation: bounded
            tried = self._get_solution_trials(completed_trials, optimizer.generation)
            if len(tried) < optimizer.population_size:
                break
            try:
                optimizer.tell(
                    # complete trials: each has a value
                    [
                        (trans.transform(t.params), sign * cast(float, t.value))
                        for t in tried[: optimizer.population_size]
                    ]
                )
            except Exception:  # trials a writer altered so CMA-ES cannot learn from them
                break
        return optimizer
