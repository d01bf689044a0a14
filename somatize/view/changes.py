"""The listings the view reads besides the records: a store's runs, a run's forward files,
and which studies it holds.

A listing names files without opening them (a run's forwards are counted, and its last one
found, without reading the thousands before it). Names are checked as the readers check
them before any path is made of them, and a link is never followed: a folder that is a
link counts as absent. Whether a page's subject changed is ``watching``'s.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Collection
from pathlib import Path
from typing import Any

from ..errors import BadName, Missing, SomatizeError
from ..record.recorder import RUNS, check_run
from ..record.studies import definition_name
from ..store import check_name


class Changes:
    """The listings of one store's runs."""

    def __init__(self, store: Any) -> None:
        path = getattr(store, "path", None)
        if path is None:
            raise TypeError("the view reads a folder store: give it a FolderStore (or --store DIR)")
        self.root = Path(path)
        self.store = store

    def runs(self) -> list[str]:
        """The runs the store holds, from a listing of ``run/`` (``runs`` reads every record)."""
        try:
            folder = self.run_folder()
            if folder is None:
                return []
            with os.scandir(folder) as entries:
                names = [e.name for e in entries if e.is_dir(follow_symlinks=False)]
        except OSError:
            return []
        kept = []
        for name in sorted(names):
            try:
                kept.append(check_run(name, "the view"))
            except BadName:
                continue
        return kept

    def last_forward(self, run: str, numbers: Collection[int] | None = None) -> dict[str, str]:
        """The record of ``run``'s last forward (of ``numbers``, its forwards' numbers, when
        the caller listed them): one read, where ``forwards`` would read every record."""
        check_run(run, "the view")
        if numbers is None:
            numbers = self.forward_files(run)
        if not numbers:
            return {}
        try:
            return self.store.record(f"{RUNS}{run}/{max(numbers)}")
        except (Missing, OSError, SomatizeError):
            return {}

    def forward_files(self, *parts: str, stats: bool = False) -> dict[int, Any]:
        """The files ``N.rec`` of the folder ``run/<parts...>`` (a run's forwards, or its
        chunks), by number: each one's inode, from the listing alone (no file opened), or with
        ``stats`` its ``os.stat_result`` (one ``stat`` each). Regular files only, never
        through a link (see `run_folder`)."""
        found: dict[int, Any] = {}
        try:
            folder = self.run_folder(*parts)
            if folder is None:
                return found
            with os.scandir(folder) as entries:
                for entry in entries:
                    name = entry.name
                    if name.endswith(".rec") and name[:-4].isdigit() and entry.is_file(follow_symlinks=False):
                        found[int(name[:-4])] = entry.stat(follow_symlinks=False) if stats else entry.inode()
        except OSError:
            return found
        return found

    def run_folder(self, *parts: str) -> Path | None:
        """``run/<parts...>`` under the store, if each step of it is a folder and none a link
        (the reads go through the store, which never follows one; its listings do not either);
        ``OSError`` where a step is missing."""
        folder = self.root / RUNS.rstrip("/")
        for part in ("", *parts):
            folder = folder / part if part else folder
            if not stat.S_ISDIR(os.lstat(folder).st_mode):
                return None
        return folder


def studies(store: Any, only: str | None = None) -> Any:
    """The studies ``store`` holds, by name: each one's definition as written (``direction``,
    ``trials``, ``sampler``, ...), text. With ``only``, that study's definition ({} if none)."""
    names = [only] if only is not None else _study_names(Path(store.path))
    out: dict[str, dict[str, str]] = {}
    for name in names:
        try:
            check_name(definition_name(name))
            record = store.record(definition_name(name))
        except (BadName, Missing, OSError, SomatizeError):
            continue
        if isinstance(record, dict):
            out[name] = {k: v for k, v in record.items() if isinstance(v, str) and k in _SHOWN}
    if only is not None:
        return out.get(only, {})
    return out


_SHOWN = ("name", "direction", "trials", "attempts", "patience", "sampler", "objective", "space")


def _study_names(root: Path) -> list[str]:
    """Top-level folders holding a ``study`` entry: a study's definition."""
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except OSError:
        return []
    found = []
    for entry in entries:
        if not entry.is_dir(follow_symlinks=False) or entry.name in ("run", "machine", "cache", "computing"):
            continue
        try:
            check_name(f"{entry.name}/study")
        except BadName:
            continue
        if os.path.isfile(os.path.join(entry.path, "study.rec")) and not os.path.islink(
            os.path.join(entry.path, "study.rec")
        ):
            found.append(entry.name)
    return found
