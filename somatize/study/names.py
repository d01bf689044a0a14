"""A study's shared names, and what a runner does when something else holds one.

A study writes a handful of names, always the same ones: ``<study>/study`` (its definition),
``<study>/trial/<n>.<attempt>`` (one per attempt: created to claim it, rewritten as it
goes), and ``<study>/judge/<runner>`` (a runner's own entry, written to read the store's
clock). Whoever may write the folder may put anything at any of them: a folder where an entry
belongs, a file where a folder belongs (``trial``), a link, a FIFO, bytes that are
no store entry. The store never follows nor opens past such a thing (``somatize.folders``):
the name is *blocked*, and that is an answer here, never an error that stops a runner.

- **Creating** an attempt answers ``MADE`` (this runner holds it now), ``TAKEN`` (another
  runner's readable entry is there) or ``BLOCKED`` (something else holds the name: the store
  said so, or a file is there that no read shows). A runner then takes the next attempt's
  name, or counts the trial as blocked and goes on (``study``, ``view``).
- **Looking** at a name (the fence an attempt checks before each write, a reader's look at a
  trial it did not find) answers ``FREE``, ``TAKEN`` or ``BLOCKED`` the same way.
- **Writing** (a put) answers whether it was written: an attempt whose own name is taken
  from under it (a folder put there) can no longer be written, and its result does not count.
- **Judging** takes the next name when the judge's own is blocked (``Judge``).

Nothing here retries a name in a loop: each call tries one name (the judge a few fresh
ones) and answers.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterable
from typing import Any, Final, Literal

from ..errors import Missing, StoreError
from ..folders import Blocked, Descent, tell_blocked, tell_once
from ..store import ClaimingStore, FolderStore, Store, scanned_record

MADE: Final = "made"
FREE: Final = "free"
TAKEN: Final = "taken"
BLOCKED: Final = "blocked"
Made = Literal["made", "taken", "blocked"]
Held = Literal["free", "taken", "blocked"]


def create(store: ClaimingStore, name: str, record: dict[str, str], *, durable: bool = True) -> Made:
    """Create ``name`` if nothing holds it: ``MADE``, ``TAKEN`` (another runner's entry, one
    a read shows) or ``BLOCKED`` (anything else: said in one line). ``durable`` as
    ``ClaimingStore.create`` says."""
    try:
        made = store.create(name, record, durable=durable)
    except StoreError as exc:
        if not held_else(exc):
            raise
        told(store, exc)
        return BLOCKED
    if made:
        return MADE
    return TAKEN if scanned_record(store, name) is not None else BLOCKED


def put(store: Store, name: str, record: dict[str, str], blob: object = None) -> bool:
    """Write ``name``; ``False`` (said in one line) when something else holds it."""
    try:
        store.put(name, record, blob)  # type: ignore[arg-type]
    except StoreError as exc:
        if not held_else(exc):
            raise
        told(store, exc)
        return False
    return True


def stamp(store: ClaimingStore, name: str) -> int | None:
    """The store's stamp of the entry ``name``; ``None`` when nothing readable is there."""
    try:
        return store.stamp(name)
    except Missing:
        return None
    except Blocked as exc:
        told(store, exc)
        return None


def look(store: ClaimingStore, name: str) -> Held:
    """Whether ``name`` is ``FREE``, ``TAKEN`` (a regular file is there: an entry, or one a
    writer is still filling) or ``BLOCKED`` (a folder, a link, a FIFO, a file where a folder
    belongs). A folder store answers in one look (``FolderStore.holder``, which opens the
    name, so on NFS the server answers, not the client's cache); any other claiming store
    holds only its own entries, and its stamp says whether one is there."""
    if isinstance(store, FolderStore):
        held = store.holder(name)
        return FREE if held is None else TAKEN if held == "a file" else BLOCKED
    try:
        store.stamp(name)
        return TAKEN
    except Blocked:
        return BLOCKED
    except Missing:
        return FREE


def held_else(exc: StoreError) -> bool:
    """Whether a store's error says a name is held by something else (``Blocked``, or a
    write that met a folder where a file belongs, or a file where a folder does)."""
    return isinstance(exc, Blocked) or isinstance(exc.__cause__, (Blocked, NotADirectoryError, IsADirectoryError))


def told(store: Store, exc: StoreError) -> None:
    """One line, once per name, that the name ``exc`` is about is blocked."""
    root = getattr(store, "path", None)
    blocked = exc if isinstance(exc, Blocked) else exc.__cause__
    if root is not None and isinstance(blocked, Blocked):
        tell_blocked(root, blocked.where, blocked.held)
    else:
        tell_once(f"{root or id(store)}:{exc}", f"somatize study: {exc}")


class Judge:
    """A runner's own entry, written to read the store's clock: ``<study>/judge/<runner>``.

    ``now()`` writes it and returns its stamp. When something else holds that name (or the
    ``judge`` folder: a file planted there), the judge takes the next name,
    ``<study>/judge-<random>`` (a name nobody can plant ahead of it), a few
    fresh ones at most per call; ``None`` when none could be written: the runner judges
    nothing this time, and tries again at its next judging.
    """

    TRIES = 3

    def __init__(self, store: ClaimingStore, study: str, runner: str) -> None:
        self._store = store
        self._study = study
        self._runner = runner
        self.name = f"{study}/judge/{runner}"
        self._told = False

    def now(self) -> int | None:
        for _ in range(self.TRIES):
            if put(self._store, self.name, {"runner": self._runner}):
                written = stamp(self._store, self.name)
                if written is not None:
                    return written
            self.name = f"{self._study}/judge-{secrets.token_hex(8)}"
        if not self._told:
            self._told = True
            tell_once(
                f"judge:{self._study}:{self._runner}",
                f"somatize study: this runner could not write a judge's entry in {self._study} "
                f"({self.TRIES} names were held by something else); it judges no attempt this "
                f"time and tries again later. Check who else may write that folder.",
            )
        return None


# -- what a reader makes of them -----------------------------------------------------------


def blocked_trials(
    store: ClaimingStore, study: str, count: int, attempts: int, trials: Iterable[Any]
) -> dict[int, str]:
    """The trials below ``count`` that runners count as blocked, by number, each with why;
    ``trials`` are the study's trials as one scan read them (``history.TrialHistory``).

    The same rules the runners follow: a trial no read shows is blocked when something
    other than an entry holds its first attempt's name (``trial/<n>.000`` a folder, a link, a
    FIFO, or a file no read shows); a trial whose last attempt did not
    finish is blocked when something else holds every later attempt's name, up to the
    give-up record (attempt ``attempts``): nobody can take it over. Costs one listing of the
    study's ``trial`` folder, and a look at a name or two per trial not finished."""
    from .history import attempt_name

    found: dict[int, str] = {}
    if not isinstance(store, FolderStore):
        return found  # only a folder can hold what a store did not write
    read_ones = set()
    for trial in trials:
        read_ones.add(trial.number)
        if trial.number >= count or trial.finished:
            continue
        last = trial.last.attempt
        later = range(last + 1, max(attempts, last + 1) + 1)
        if all(look(store, attempt_name(study, trial.number, k)) == BLOCKED for k in later):
            found[trial.number] = f"something else holds every attempt's name after attempt {last}"
    present = _numbers_present(store, study)
    if present is None:  # the trial folder itself is held by something else
        return {
            **found,
            **{n: "something else holds the study's trial folder" for n in range(count) if n not in read_ones},
        }
    for number in sorted(present - read_ones):
        if number >= count:
            continue
        name = attempt_name(study, number, 0)
        held = look(store, name)
        if held == BLOCKED or (held == TAKEN and scanned_record(store, name) is None):
            found[number] = "something else holds its first attempt's name"
    return dict(sorted(found.items()))


def _numbers_present(store: FolderStore, study: str) -> set[int] | None:
    """The trial numbers something is listed at in ``<study>/trial`` (``<n>.<anything>`` or
    ``<n>``: a file, a folder, a link, anything); ``None`` when the ``trial`` folder itself is
    held by something else."""
    try:
        with Descent(store.path) as descent:
            listed = os.listdir(descent.at([*study.split("/"), "trial"]))
    except (FileNotFoundError, NotADirectoryError):
        return set()
    except Blocked:
        return None
    except OSError:
        return set()
    present = set()
    for part in listed:
        number = part.partition(".")[0]
        if len(number) == 6 and number.isascii() and number.isdigit():
            present.add(int(number))
    return present
