"""What changed in the store, by its folders' stamps, and which studies it holds.

A page is told to read again when what it shows has changed: the stamps (modification times)
of the folders its entries live in. Every write of a ``FolderStore`` renames a file into its
folder, which moves that folder's stamp, so a look costs one ``stat`` per folder a page
shows (a run's one folder; a study's folder per trial), never a read of a record. Names are
checked as the readers check them before any path is made of them, and a link is never
followed: a folder that is a link counts as absent.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

from ..errors import BadName, Missing, SomatizeError
from ..record.recorder import RUNS, check_run
from ..store import check_name

_MACHINES = "machine"


class Changes:
    """Stamps of what each page shows, in one store."""

    def __init__(self, store: Any) -> None:
        path = getattr(store, "path", None)
        if path is None:
            raise TypeError("the view reads a folder store: give it a FolderStore (or --store DIR)")
        self.root = Path(path)
        self.store = store

    def stamp(self, subject: str) -> tuple:
        """A value that changes whenever what ``subject`` shows changes: ``runs``, ``run:NAME``,
        ``machines`` (with ``:RUN`` for that run's fleet), ``studies`` or ``study:NAME``."""
        kind, _, name = subject.partition(":")
        if kind == "runs":
            return self._folders(self.root / RUNS.rstrip("/"), depth=1)
        if kind == "run":
            check_run(name, "the view")
            return self._folders(self.root / RUNS.rstrip("/") / name)
        if kind == "machines":
            if name:
                check_run(name, "the view")
                return self._folders(self.root / _MACHINES) + self._folders(self.root / RUNS.rstrip("/") / name)
            return self._folders(self.root / _MACHINES)
        if kind == "studies":
            return tuple(self._folders(self.root / s / "trial", depth=1) for s in _study_names(self.root))
        if kind == "study":
            check_name(f"{name}/study")
            return self._folders(self.root / name) + self._folders(self.root / name / "trial", depth=1)
        raise ValueError(f"the view shows runs, run:NAME, machines, studies or study:NAME; not {subject[:40]!r}")

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

    def last_forward(self, run: str) -> tuple[int, dict[str, str]]:
        """How many forwards ``run`` holds, and the last one's record: a listing of its folder
        and one read, where ``forwards`` would read every record."""
        check_run(run, "the view")
        numbers = self.forward_files(run)
        if not numbers:
            return 0, {}
        try:
            return len(numbers), self.store.record(f"{RUNS}{run}/{max(numbers)}")
        except (Missing, OSError, SomatizeError):
            return len(numbers), {}

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

    def _folders(self, folder: Path, depth: int = 0) -> tuple:
        """The stamps of ``folder`` and, ``depth`` levels down, of the folders in it."""
        try:
            info = os.lstat(folder)
        except OSError:
            return ((str(folder), 0),)
        if not stat.S_ISDIR(info.st_mode):
            return ((str(folder), 0),)
        out = [(str(folder), info.st_mtime_ns)]
        if depth > 0:
            try:
                entries = sorted(os.scandir(folder), key=lambda e: e.name)
            except OSError:
                return tuple(out)
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    out.extend(self._folders(Path(entry.path), depth - 1))
        return tuple(out)


def studies(store: Any, only: str | None = None) -> Any:
    """The studies ``store`` holds, by name: each one's definition as written (``direction``,
    ``trials``, ``sampler``, ...), text. With ``only``, that study's definition ({} if none)."""
    names = [only] if only is not None else _study_names(Path(store.path))
    out: dict[str, dict[str, str]] = {}
    for name in names:
        try:
            check_name(f"{name}/study")
            record = store.record(f"{name}/study")
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
        if os.path.isfile(os.path.join(entry.path, "study.rec")) and not os.path.islink(os.path.join(entry.path, "study.rec")):
            found.append(entry.name)
    return found
