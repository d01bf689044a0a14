"""Studies: trials claimed from a shared folder, by runners watched by "is it still writing".

    from somatize import FolderStore, Study
    from optuna.distributions import FloatDistribution

    study = Study(FolderStore("/shared/sweeps"), "lr-sweep",
                  objective="myproject.train:objective",
                  space={"lr": FloatDistribution(1e-4, 1e-1, log=True)}, trials=40)
    study.run()                      # here; or on any machine that sees the folder:
    # python -m somatize study --store /shared/sweeps lr-sweep

``definition`` checks and writes down what a study is; ``history`` reads its trials (all with
one scan, or one trial's folder); ``view`` is what a runner knows of them, kept current by
reading only what may have changed; ``mirror`` is Optuna's view of them, kept in the
runner's memory; ``attempt`` is one attempt while it runs (its record, its pulse, its
fence); ``study`` is the runner's loop; ``command`` the command line.
Optuna is needed to run or rebuild a study (the ``study`` extra), not to import this package.
"""

from ..errors import StudyMismatch, Superseded
from .attempt import Trial
from .command import main
from .study import Study

__all__ = ["Study", "StudyMismatch", "Superseded", "Trial", "main"]
