"""One attempt of one trial, while it runs here: its record, its pulse, and its fence.

The runner that claimed an attempt is the only writer of its entry. It rewrites the record
on each ``trial.say`` and, from a thread of its own, at least every ``patience / 3``, so
the entry's stamp keeps moving while the attempt is alive. Before every write it looks for
the next attempt of the same trial: if another runner has created it, this one was judged
abandoned (it was paused, or cut off), and from then on it writes nothing that counts.
Where something else holds the next attempt's name (a folder, a link, a FIFO: see
``names``), the attempt after it is the fence, as it is for the runner that takes it over.
An attempt whose own name something else comes to hold can no longer be written: it stops
as an overtaken one does, and nothing it did counts.

What an objective sees is a :class:`Trial`.
"""

from __future__ import annotations

import json
import operator
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

from ..errors import Superseded
from ..facts import ENGINE, fact
from ..store import ClaimingStore, scanned_record
from . import names
from .history import attempt_name


class Trial:
    """What an objective is handed: the configuration to try, and where to say how it goes.

    ``config`` is a dict of the parameters the sampler chose. ``number`` is the trial's
    number in the study, ``attempt`` counts from 0 (a trial runs again as attempt 1, 2, ...
    only when a runner stopped writing). ``say(**values)`` writes intermediate values into
    the attempt's record; saying ``step=`` and ``value=`` also lets the study's pruner stop
    the trial there (``say`` then raises ``optuna.TrialPruned``). ``watching`` is a watcher
    for ``forward(..., watching=trial.watching)``: the facts land in the attempt's blob, and
    the last of each kind outside the engine's vocabulary (``loss``, ...) in its record.
    ``store`` is the study's store, for a graph whose cached nodes are shared by trials.
    """

    __slots__ = ("_running",)

    def __init__(self, running: Running) -> None:
        self._running = running

    @property
    def config(self) -> dict[str, Any]:
        return dict(self._running.config)

    @property
    def number(self) -> int:
        return self._running.number

    @property
    def attempt(self) -> int:
        return self._running.attempt

    @property
    def study(self) -> str:
        return self._running.study

    @property
    def store(self) -> ClaimingStore:
        return self._running.store

    @property
    def watching(self) -> Any:
        return self._running.saw

    def say(self, **values: object) -> None:
        self._running.say(values)

    def __repr__(self) -> str:
        return f"Trial(study={self.study!r}, number={self.number}, attempt={self.attempt}, config={self.config!r})"


class Running:
    """An attempt claimed by this runner: the one writer of its entry."""

    def __init__(
        self,
        store: ClaimingStore,
        study: str,
        number: int,
        attempt: int,
        config: Mapping[str, Any],
        *,
        runner: str,
        patience: float,
        sampler_attrs: Mapping[str, Any] | None = None,
        otrial: Any = None,
        storage: Any = None,
        pulse: Pulse | None = None,
        attempts: int = 0,
    ) -> None:
        self.store = store
        self.study = study
        self.number = number
        self.attempt = attempt
        self.config = dict(config)
        self.name = attempt_name(study, number, attempt)
        # the fences: the next attempt's name, and while something else holds it the next,
        # up to the study's give-up record (written as attempt ``attempts``)
        self._fences = [attempt_name(study, number, k) for k in range(attempt + 1, max(attempts, attempt + 1) + 1)]
        self._runner = runner
        self.interval = patience / 3  # how often the pulse writes the record, at least
        self._sampler_attrs = dict(sampler_attrs or {})
        self._otrial = otrial  # the in-memory Optuna trial the pruner judges, if any
        self._storage = storage
        self._trial_id = None
        if otrial is not None and storage is not None:
            study_id = storage.get_study_id_from_name(otrial.study.study_name)
            self._trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, otrial.number)
        self._lock = threading.Lock()
        self._state = "running"
        self._score = ""
        self._error = ""
        self._said: dict[str, str] = {}
        self._summaries: dict[str, str] = {}
        self._intermediate: list[tuple[int, float]] = []
        self._lines: list[bytes] = []
        self._started = time.perf_counter_ns()
        self._closed = False
        self.superseded = False
        self.blocked = False  # its own name came to be held by something else: it stopped
        self.claimed: dict[str, str] | None = None  # the record this runner created, once it has
        self.finished: dict[str, str] | None = None  # the result it wrote, once it has
        self._pulse = pulse
        self._own_pulse = pulse is None
        self._pulse_error_told = False

    # -- claiming and the pulse

    def claim(self) -> names.Made:
        """Create the attempt's entry if nothing holds its name: ``names.MADE`` when this
        runner holds it now (and ``claimed`` is the record it created), ``names.TAKEN`` when
        another runner's entry is there, ``names.BLOCKED`` when anything else is."""
        record = self._record()
        # not synced as a name (``ClaimingStore.create``): a claim a power cut takes back was
        # made by a runner the same cut stopped, and its trial is claimed again; the attempt's
        # next write (a pulse, its result) is synced, and the claim with it
        got = names.create(self.store, self.name, record, durable=False)
        if got == names.MADE:
            self.claimed = record
        return got

    def let_go(self) -> None:
        """Told to stop before the objective ran (between claiming and starting): if this
        runner holds the attempt, mark it ``abandoned`` so another takes it over at once.
        Whether it holds it is read from the store, never assumed: a stop may land while
        the claim itself is under way, and another runner's attempt must not be touched."""
        with self._lock:
            if self._closed:
                return
        held = scanned_record(self.store, self.name)
        if held is not None and held.get("runner") == self._runner and held.get("state") == "running":
            self.finish("abandoned")

    def start(self) -> None:
        """From now on the pulse writes the record every ``interval`` at least."""
        if self._pulse is None:
            self._pulse = Pulse()
        self._pulse.hold(self)

    def stop(self) -> None:
        """No more pulses for this attempt (one under way finds it closed, or writes first)."""
        if self._pulse is not None:
            self._pulse.release(self)
            if self._own_pulse:
                self._pulse.close()

    def beat(self) -> None:
        """One pulse: write the record again."""
        try:
            self.rewrite()
        except Exception as exc:  # keep beating: a store that hiccups once is not dead
            if not self._pulse_error_told:
                self._pulse_error_told = True
                print(
                    f"somatize study: rewriting {self.name} failed ({type(exc).__name__}: "
                    f"{exc}); will keep trying every {self.interval:.3g} s",
                    file=sys.stderr,
                )

    # -- what the objective says and sees

    def say(self, values: Mapping[str, object]) -> None:
        plain = {key: _said_value(key, value) for key, value in values.items()}
        f = fact("said", **plain)
        pruned = False
        with self._lock:
            self._lines.append(_line(f))
            self._said.update({key: f[key] for key in plain})
            point = _point(plain)
            if point is not None:
                self._intermediate.append(point)
        if point is not None and self._otrial is not None:
            self._otrial.report(point[1], point[0])
            pruned = self._otrial.should_prune()
        if not self.rewrite():
            if self.blocked:
                raise Superseded(
                    f"Attempt {self.attempt} of trial {self.number} of the study {self.study!r} "
                    f"can no longer be written: something other than its entry holds its name "
                    f"now (someone who may write the study's folder put it there); it stops here "
                    f"and its result would not count."
                )
            raise Superseded(
                f"Trial {self.number} of the study {self.study!r} was taken over by another "
                f"runner (attempt {self.attempt + 1}) while this runner was not writing; "
                f"attempt {self.attempt} stops here and its result would not count."
            )
        if pruned:
            raise optuna_pruned(f"pruned at step {point[0]} by the study's pruner")  # type: ignore[index]

    def saw(self, f: Mapping[str, str]) -> None:
        """A watcher: every fact goes to the blob; the last of each kind outside the
        engine's vocabulary is summarised in the record, as ``<kind>.<field>``."""
        line = _line(dict(f))
        with self._lock:
            self._lines.append(line)
            kind = f.get("fact", "")
            if kind and kind not in ENGINE and kind != "said":
                for field, value in f.items():
                    if field != "fact" and isinstance(value, str):
                        self._summaries[f"{kind}.{field}"] = value

    # -- writing

    def rewrite(self) -> bool:
        """Write the record again (its pulse); ``False`` once this attempt is superseded."""
        with self._lock:
            if self._closed:
                return not self.superseded
            if self._overtaken():
                return False
            return self._put(self._record())

    def finish(self, state: str, score: str = "", error: str = "") -> bool:
        """Write the attempt's result; ``False`` (and nothing that counts) when superseded."""
        self.stop()
        with self._lock:
            if self._closed:
                return not self.superseded
            if self._overtaken():
                return False
            self._state, self._score, self._error = state, score, error
            self._closed = True
            record = self._record()
            if not self._put(record):
                return False
            self.finished = record
            return True

    def _put(self, record: dict[str, str]) -> bool:
        """Write this attempt's entry; when something else holds its name, the attempt is
        over (``blocked``): ``False``, and nothing is written again. Called with the lock held."""
        if names.put(self.store, self.name, record, self._blob()):
            return True
        self.superseded = self.blocked = self._closed = True
        return False

    def _overtaken(self) -> bool:
        """Whether a later attempt exists (the next one, or while something else holds its
        name the one after: see ``names.look``); if so, say so in this attempt's own record
        (which no longer counts) and close it. Called with the lock held."""
        for fence in self._fences:
            held = names.look(self.store, fence)
            if held == names.FREE:
                return False
            if held == names.TAKEN:
                break
        else:
            return False  # every later name is blocked: nobody can take this attempt over
        self.superseded = True
        self._closed = True
        self._state = "abandoned"
        names.put(self.store, self.name, self._record(), self._blob())
        return True

    def _record(self) -> dict[str, str]:
        record = {
            "trial": str(self.number),
            "attempt": str(self.attempt),
            "config": json.dumps(self.config, sort_keys=True),
            "state": self._state,
            "score": self._score,
            "took_us": str((time.perf_counter_ns() - self._started) // 1000),
            "runner": self._runner,
            "error": self._error,
            "facts": str(len(self._lines)),
        }
        if self._intermediate:
            record["intermediate"] = json.dumps(self._intermediate)
        attrs = {
            side: {k: v for k, v in notes.items() if "optimizer" not in k}  # a pickle: never written
            for side, notes in self._current_sampler_attrs().items()
        }
        if any(attrs.values()):
            record["sampler_attrs"] = json.dumps(attrs, sort_keys=True)
        record.update({f"said.{key}": value for key, value in self._said.items()})
        record.update(self._summaries)
        return record

    def _current_sampler_attrs(self) -> dict[str, Any]:
        if self._trial_id is None:
            return self._sampler_attrs
        # a pruner may note things on the trial as it goes (successive halving's rungs)
        trial_attrs = self._storage.get_trial_system_attrs(self._trial_id)
        out = dict(self._sampler_attrs)
        merged = dict(out.get("trial", {}))
        for key, value in trial_attrs.items():
            if key == "fixed_params":
                continue  # how a taken-over attempt was given its trial's configuration
            try:
                json.dumps(value)
            except (TypeError, ValueError):
                continue
            merged[key] = value
        out["trial"] = merged
        return out

    def _blob(self) -> list[bytes] | None:
        return list(self._lines) if self._lines else None


class Pulse:
    """One thread that keeps a runner's attempt written while its objective runs.

    A runner holds one attempt at a time: ``hold`` gives the pulse that attempt, ``release``
    takes it back. While it is held, it is written again (``Running.beat``) every
    ``interval`` seconds, however long the objective goes without saying anything. The
    thread starts with the first attempt and lives until ``close``, so a runner that runs
    thousands of short trials starts one thread, not one per trial.
    """

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._held: Running | None = None
        self._due = 0.0  # when the held attempt is written next (this process's monotonic clock)
        self._idle = False  # the thread waits for an attempt, with no time set
        self._until = 0.0  # or until when it waits
        self._closed = False
        self._thread: threading.Thread | None = None

    def hold(self, running: Running) -> None:
        with self._changed:
            self._held, self._due = running, time.monotonic() + running.interval
            if self._thread is None:
                self._thread = threading.Thread(target=self._beat, name="somatize-study-pulse", daemon=True)
                self._thread.start()
            elif self._idle or self._due < self._until:
                self._changed.notify()
            # else the thread wakes at the time it had set, no later than this one's, and
            # looks again: a trial shorter than ``interval`` never wakes it

    def release(self, running: Running) -> None:
        with self._changed:
            if self._held is running:
                self._held = None

    def close(self) -> None:
        with self._changed:
            self._closed, self._held = True, None
            self._changed.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _beat(self) -> None:
        while True:
            with self._changed:
                if self._closed:
                    return
                running = self._held
                if running is None:
                    self._idle = True
                    self._changed.wait()
                    self._idle = False
                    continue
                left = self._due - time.monotonic()
                if left > 0:
                    self._until = self._due
                    self._changed.wait(left)
                    continue
                self._due = time.monotonic() + running.interval
            running.beat()  # outside the lock: a slow store never holds up hold or release


def optuna_pruned(message: str) -> BaseException:
    from .definition import optuna

    return optuna().TrialPruned(message)


def _said_value(key: str, value: object) -> object:
    if isinstance(value, (str, bool, int, float)):
        return value
    try:
        return operator.index(value)  # type: ignore[arg-type]  # numpy integers: a step stays a whole number
    except TypeError:
        pass
    if hasattr(value, "__float__"):  # numpy and torch scalars
        return float(value)
    raise TypeError(f"trial.say({key}=...) takes text, numbers or booleans; got a `{type(value).__name__}`.")


def _point(values: Mapping[str, object]) -> tuple[int, float] | None:
    """The (step, value) a pruner judges, when both were said."""
    step, value = values.get("step"), values.get("value")
    if isinstance(step, bool) or not isinstance(step, int) or isinstance(value, (bool, str)):
        return None
    if not isinstance(value, (int, float)):
        return None
    return step, float(value)


def _line(f: Mapping[str, str]) -> bytes:
    try:
        return (json.dumps(f, ensure_ascii=False) + "\n").encode("utf-8")
    except UnicodeEncodeError:
        return (json.dumps(f) + "\n").encode("ascii")
