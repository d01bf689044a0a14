"""A study's definition: what it searches, how, for how long, written once as plain data.

The definition lives at ``<study>/study`` as a record of text: the objective by import name
(``"myproject.train:objective"``, never a pickle), the space as Optuna distributions in their
JSON form, and the numbers and names that say how trials are sampled, judged and retried.
Anyone who can read the folder can read it; a runner on another machine builds everything
it needs from it and the trials' records.

This module only checks, writes down and compares; it does not run trials. Optuna is
imported when a sampler or a distribution is actually needed, never at import time.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import re
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import SomatizeError
from ..record.studies import definition_name
from ..store import valid_part

#: Optuna's samplers, by the name a definition keeps. A sampler is seeded per trial number
#: (see ``Definition.sampler_for``) except where the seed picks a sequence (``qmc``, ``grid``).
SAMPLERS = ("tpe", "random", "grid", "cmaes", "qmc", "gp", "nsga2", "bruteforce")
#: Optuna's pruners that need no settings, by name.
PRUNERS = ("median", "hyperband", "successive_halving", "wilcoxon", "nop")
DIRECTIONS = ("minimize", "maximize")
#: Names other parts of somatize keep at the top of a store.
RESERVED = ("cache", "run", "machine")
MAX_TRIALS = 1_000_000  # trial numbers are written with six digits
MAX_ATTEMPTS = 999  # attempt numbers with three

_OBJECTIVE = re.compile(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*")


def optuna() -> Any:
    """Optuna, imported on first use, with the fix when it is not installed."""
    try:
        import optuna as module
    except ImportError as exc:
        raise ImportError(
            "Studies use Optuna's samplers and distributions, and Optuna is not installed "
            "here: pip install 'somatize[study]' (or pip install 'optuna>=4')."
        ) from exc
    return module


@dataclasses.dataclass(frozen=True)
class Definition:
    """A checked definition; ``record()`` writes it down, ``from_record`` reads it back."""

    objective: str
    space: dict[str, Any]  # name -> optuna.distributions.BaseDistribution
    trials: int
    sampler: str
    seed: int
    attempts: int
    direction: str
    patience: float
    pruner: str  # "" for none

    @classmethod
    def checked(
        cls,
        *,
        objective: object,
        space: object,
        trials: object,
        sampler: object,
        seed: object,
        attempts: object,
        direction: object,
        patience: object,
        pruner: object,
    ) -> Definition:
        definition = cls(
            objective=import_name(objective),
            space=_space(space),
            trials=_whole("trials", trials, 1, MAX_TRIALS),
            sampler=_choice("sampler", sampler, SAMPLERS),
            seed=_whole("seed", seed, 0, 2**32 - 1),
            attempts=_whole("attempts", attempts, 1, MAX_ATTEMPTS),
            direction=_choice("direction", direction, DIRECTIONS),
            patience=_patience(patience),
            pruner="" if pruner is None or pruner == "" else _choice("pruner", pruner, PRUNERS),
        )
        if definition.sampler == "grid":
            definition.grid()  # refuses a space without a finite set of values, up front
        return definition

    def record(self) -> dict[str, str]:
        from_json = optuna().distributions.distribution_to_json
        space = {name: json.loads(from_json(d)) for name, d in sorted(self.space.items())}
        return {
            "objective": self.objective,
            "space": json.dumps(space, sort_keys=True),
            "trials": str(self.trials),
            "sampler": self.sampler,
            "seed": str(self.seed),
            "attempts": str(self.attempts),
            "direction": self.direction,
            "patience": repr(self.patience),
            "pruner": self.pruner,
        }

    @classmethod
    def from_record(cls, study: str, record: Mapping[str, str]) -> Definition:
        to_distribution = optuna().distributions.json_to_distribution
        try:
            written = json.loads(record["space"])
            if not isinstance(written, dict):
                raise TypeError(f"its space is a JSON {type(written).__name__}, not an object of names")
            space = {name: to_distribution(json.dumps(d)) for name, d in written.items()}
            return cls.checked(
                objective=record["objective"],
                space=space,
                trials=int(record["trials"]),
                sampler=record["sampler"],
                seed=int(record["seed"]),
                attempts=int(record["attempts"]),
                direction=record["direction"],
                patience=float(record["patience"]),
                pruner=record.get("pruner", ""),
            )
        # a writer of the folder's: any shape, nested past the recursion limit
        except (KeyError, ValueError, TypeError, AttributeError, RecursionError) as exc:
            raise SomatizeError(
                f"The definition of the study {study!r} (its entry `{definition_name(study)}`) cannot be read "
                f"({type(exc).__name__}: {exc}); it was written by another version or altered by hand. Define the "
                f"study again under a new name."
            ) from exc

    def differences(self, other: Definition) -> list[str]:
        """What differs from ``other``, one phrase per field: '<field> is <ours> there and <theirs> here'."""
        out = []
        for field in dataclasses.fields(self):
            ours, theirs = getattr(self, field.name), getattr(other, field.name)
            if field.name == "space":
                out.extend(_space_differences(ours, theirs))
            elif ours != theirs:
                out.append(f"{field.name} is {ours!r} there and {theirs!r} here")
        return out

    # -- what a runner builds from it

    def sampler_for(self, number: int, *, reuse: Any = None) -> Any:
        """The named Optuna sampler that proposes trial ``number``.

        A runner builds a fresh sampler from the history each time, so a sampler seeded
        with the study's seed alone would propose the same first draw for every trial; it
        is seeded with the study's seed and the trial's number instead. QMC is the
        exception, and so is the grid: there the seed picks one scrambled sequence (one
        shuffled grid), and the history says where in it the study is.

        ``reuse``, a sampler this made before, is seeded anew and given back where its
        random state is all it keeps between trials (the random sampler): what it proposes
        is what a fresh one would, without a fresh one's cost (numpy draws entropy from
        the system for every random state it makes, before the seed replaces it: about
        0.1 ms, a tenth of an instant trial's claim). Any other sampler keeps more (TPE
        caches the search space it saw), so it is made afresh, and so is a random sampler
        whose insides are not as this Optuna's are.
        """
        seed = self.seed if self.sampler in ("qmc", "grid") else _mixed(self.seed, number)
        if reuse is not None and self.sampler == "random" and _reseeded(reuse, seed):
            return reuse
        samplers = optuna().samplers
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna().exceptions.ExperimentalWarning)
            if self.sampler == "tpe":
                # running trials count as bad ones, so runners that ask at once spread out
                return samplers.TPESampler(seed=seed, constant_liar=True)
            if self.sampler == "random":
                return samplers.RandomSampler(seed=seed)
            if self.sampler == "grid":
                return samplers.GridSampler(self.grid(), seed=seed)
            if self.sampler == "cmaes":  # never Optuna's own: it unpickles what a record holds
                from .cmaes import RebuiltCmaEs

                return RebuiltCmaEs(seed=seed)
            if self.sampler == "qmc":
                return samplers.QMCSampler(seed=seed)
            if self.sampler == "gp":
                return samplers.GPSampler(seed=seed)
            if self.sampler == "nsga2":
                return samplers.NSGAIISampler(seed=seed)
            return samplers.BruteForceSampler(seed=seed)

    def make_pruner(self) -> Any:
        pruners = optuna().pruners
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna().exceptions.ExperimentalWarning)
            return {
                "": pruners.NopPruner,
                "nop": pruners.NopPruner,
                "median": pruners.MedianPruner,
                "hyperband": pruners.HyperbandPruner,
                "successive_halving": pruners.SuccessiveHalvingPruner,
                "wilcoxon": pruners.WilcoxonPruner,
            }[self.pruner]()

    def grid(self) -> dict[str, list[Any]]:
        """The grid sampler's search space: every value each distribution allows."""
        d = optuna().distributions
        grid: dict[str, list[Any]] = {}
        for name, dist in self.space.items():
            if isinstance(dist, d.CategoricalDistribution):
                grid[name] = list(dist.choices)
            elif isinstance(dist, d.IntDistribution) and not dist.log:
                grid[name] = list(range(dist.low, dist.high + 1, dist.step))
            elif isinstance(dist, d.FloatDistribution) and dist.step is not None:
                count = int(round((dist.high - dist.low) / dist.step))
                grid[name] = [dist.low + i * dist.step for i in range(count + 1)]
            else:
                raise ValueError(
                    f"sampler='grid' tries every value of every parameter, and {name!r} is "
                    f"{dist!r}, which has no finite set of values. Give it a "
                    f"CategoricalDistribution, an IntDistribution, or a FloatDistribution "
                    f"with step=, or choose another sampler ('tpe', 'random', ...)."
                )
        return grid


# -- the objective, by import name ------------------------------------------------------


def import_name(objective: object) -> str:
    """``"package.module:function"`` for an objective given by name or as a function.

    A callable is accepted only when importing its name gives it back: a lambda, a
    function defined inside another, or one defined in ``__main__`` (a script, a notebook)
    has no name another machine could import.
    """
    if isinstance(objective, str):
        if not _OBJECTIVE.fullmatch(objective):
            raise ValueError(
                f"objective={objective!r} is not an import name; write it as "
                f"'package.module:function' (for example 'myproject.train:objective')."
            )
        return objective
    if not callable(objective):
        raise TypeError(
            f"objective= is the import name of a function, such as "
            f"'myproject.train:objective'; got a `{type(objective).__name__}`."
        )
    module = getattr(objective, "__module__", None)
    qualname = getattr(objective, "__qualname__", None)
    fix = (
        "Runners on other machines import the objective by name, so it must live in a module "
        "they can import: move it to a file such as myproject/train.py (a top-level `def`) "
        "and pass objective='myproject.train:objective'."
    )
    if not module or not qualname or "<" in qualname:
        raise TypeError(
            f"The objective {objective!r} has no import name (a lambda, or a function defined inside another). {fix}"
        )
    if module == "__main__":
        raise TypeError(
            f"The objective {qualname} is defined in __main__ (a script or a notebook), "
            f"which no other process can import. {fix}"
        )
    name = f"{module}:{qualname}"
    try:
        found = load(name)
    except ImportError:
        found = None
    if found is not objective:
        raise TypeError(f"Importing {name!r} does not give back the objective {objective!r}. {fix}")
    return name


def load(name: str) -> Callable[..., Any]:
    """Import the objective called ``name`` (``"package.module:function"``)."""
    module_name, _, qualname = name.partition(":")
    try:
        found: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportError(
            f"The objective {name!r} cannot be imported here ({type(exc).__name__}: {exc}). "
            f"Install the project that holds {module_name} on this machine, or add its "
            f"folder to PYTHONPATH."
        ) from exc
    for part in qualname.split("."):
        try:
            found = getattr(found, part)
        except AttributeError:
            raise ImportError(
                f"The objective {name!r} cannot be imported here: {module_name} has no "
                f"{qualname!r}. Check the name in the study's definition."
            ) from None
    if not callable(found):
        raise ImportError(f"The objective {name!r} is a `{type(found).__name__}`, not a function.")
    return found


# -- checks -----------------------------------------------------------------------------


def check_name(name: object) -> str:
    if not isinstance(name, str) or not valid_part(name) or "/" in name:
        raise ValueError(
            f"A study's name is one store name component: 1 to 200 characters of A-Z a-z "
            f"0-9 and . _ : @ + = -, not starting with '.' (for example 'lr-sweep'); "
            f"got {name!r}."
        )
    if name in RESERVED:
        raise ValueError(
            f"A study cannot be called {name!r}: the store keeps {', '.join(RESERVED)} for "
            f"cached values, records and machine reports. Choose another name."
        )
    return name


def check_runner(runner: object) -> str:
    if not isinstance(runner, str) or not valid_part(runner):
        raise ValueError(
            f"A runner's name is one store name component (A-Z a-z 0-9 and . _ : @ + = -, "
            f"such as 'node17-3'); got {runner!r}."
        )
    return runner


def _space(space: object) -> dict[str, Any]:
    base = optuna().distributions.BaseDistribution
    if not isinstance(space, Mapping) or not space:
        raise TypeError(
            f"space= is a dict of parameter names to Optuna distributions, such as "
            f"{{'lr': FloatDistribution(1e-4, 1e-1, log=True)}}; got {space!r}."
        )
    out = {}
    for name, dist in space.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"space= names each parameter with a non-empty str; got {name!r}.")
        if not isinstance(dist, base):
            raise TypeError(
                f"space[{name!r}] is a `{type(dist).__name__}`; each parameter takes an "
                f"Optuna distribution: FloatDistribution(low, high, log=...), "
                f"IntDistribution(low, high, step=...) or CategoricalDistribution(choices) "
                f"from optuna.distributions."
            )
        out[name] = dist
    # one order everywhere (asked, written, rebuilt): some samplers walk parameters in order
    return dict(sorted(out.items()))


def _space_differences(ours: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    out = []
    for name in sorted(set(ours) | set(theirs)):
        if name not in theirs:
            out.append(f"space has {name!r} there and not here")
        elif name not in ours:
            out.append(f"space has {name!r} here and not there")
        elif ours[name] != theirs[name]:
            out.append(f"space[{name!r}] is {ours[name]!r} there and {theirs[name]!r} here")
    return out


def _whole(what: str, value: object, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{what}= takes a whole number from {low} to {high}; got {value!r}.")
    return value


def _choice(what: str, value: object, names: tuple[str, ...]) -> str:
    if value not in names:
        raise ValueError(f"{what}= is one of {', '.join(map(repr, names))}; got {value!r}.")
    return value


def _patience(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise ValueError(
            f"patience= is how many seconds an attempt may go unwritten before another "
            f"runner takes it over: a positive number; got {value!r}."
        )
    return float(value)


def _mixed(seed: int, number: int) -> int:
    """A seed for trial ``number`` of a study seeded ``seed``: distinct and reproducible."""
    return (seed * 1_000_003 + number * 7_919 + 1) % 2**32


def _reseeded(sampler: Any, seed: int) -> bool:
    """Seed a random sampler's random state as its constructor does; ``False`` where it
    is not a random sampler, or its state is not where this Optuna keeps it."""
    if type(sampler) is not optuna().samplers.RandomSampler:
        return False
    seed_it = getattr(getattr(getattr(sampler, "_rng", None), "rng", None), "seed", None)
    if not callable(seed_it):
        return False
    seed_it(seed)
    return True
