"""Whether what a page shows has changed: one watcher for the whole view, at a bounded cost.

A page is told to read again when what it shows has changed: the stamps (modification
times) of the folders its entries live in. Every write of a ``FolderStore`` renames a file
into its folder, which moves that folder's stamp, so a look is a ``stat`` per folder, never
a read of a record. What a page shows is a *subject* (``runs``, ``run:NAME``, ``compare:A/B/...``,
``machines``, ``machines:RUN``, ``studies``, ``study:NAME``), and each subject is looked at by the one
watcher of the view, twice a second, however many streams follow it: sixteen tabs on one
study cost one look.

A look is bounded, whoever wrote the folders. A folder whose sub-folders matter (a study's
trials, the runs) is listed again only when its own stamp moved, and at most
:data:`SWEPT` of its sub-folders are looked at per look: the :data:`HOT` that changed last
every time, those new since the listing, and the others in turn. So a study of 30,000
trial folders is looked at whole within a second, and one of 160,000 (planted, say, by a
writer of the folder) within five: what is new or changing shows within a second; a trial
untouched for a while that changes shows within a sweep. Of a folder's sub-folders,
:data:`LISTED` are watched at most; a new one beyond them still shows, by the folder's own
stamp. The first look at a subject looks at all it watches, so that nothing is missed
between it and the next.

Names are checked as the readers check them before a folder is opened, each folder is
opened from the root one step at a time, and a link is never followed: a folder that is a
link counts as absent.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import stat
import threading
import time
from collections import OrderedDict
from pathlib import Path

from ..folders import Blocked, Descent, tell_once
from ..record.recorder import check_run
from ..record.studies import definition_name
from ..store import check_name

#: How often the watcher looks (seconds).
LOOK = 0.5
#: Sub-folders of one folder looked at per look, at most.
SWEPT = 16_384
#: Of those, the ones that changed last, looked at every time.
HOT = 512
#: Sub-folders of one folder watched at all (a listing reads no more).
LISTED = 200_000
#: Subjects kept once no stream follows them (the least recently followed let go first).
KEPT = 64
#: How long a subject nobody follows is kept (a page reloaded finds it still looked at).
IDLE = 60.0
#: Runs one comparison shows, at most (``compare:A/B/...``; ``/api/compare`` holds to it too).
COMPARED = 8
_NOT_STUDIES = frozenset({"run", "machine", "cache", "computing"})


class Folder:
    """One folder of the store and, with ``sweep``, the folders in it."""

    def __init__(self, parts: list[str], *, sweep: bool = False, skip: frozenset[str] = frozenset()) -> None:
        self.parts, self.sweep, self.skip = parts, sweep, skip
        self.own: tuple[int, int] | None = None
        self.names: list[str] = []
        self.seen: dict[str, tuple[int, int] | None] = {}
        self.hot: OrderedDict[str, None] = OrderedDict()
        self.fresh: list[str] = []
        self.cursor = 0

    def look(self, root: Path, whole: bool = False) -> bool:
        """Whether anything changed since the last look; ``whole``: every sub-folder."""
        try:
            with Descent(root) as descent:
                fd = descent.at(self.parts)
                found = os.fstat(fd)
                own = (found.st_ino, found.st_mtime_ns)
                changed = own != self.own
                self.own = own
                if self.sweep:
                    if changed:
                        self._list(fd)
                    changed = self._sweep(fd, whole) or changed
                return changed
        except (OSError, Blocked):  # missing, a link, not a folder: absent
            changed = self.own is not None
            self.own, self.names, self.seen, self.fresh, self.cursor = None, [], {}, [], 0
            self.hot.clear()
            return changed

    def _list(self, fd: int) -> None:
        with os.scandir(fd) as entries:
            names = sorted(
                itertools.islice(
                    (e.name for e in entries if e.name not in self.skip and e.is_dir(follow_symlinks=False)), LISTED
                )
            )
        kept = set(names)
        self.seen = {name: at for name, at in self.seen.items() if name in kept}
        for name in [n for n in self.hot if n not in kept]:
            del self.hot[name]
        self.names = names
        self.fresh = [name for name in names if name not in self.seen]  # looked at first
        self.cursor %= max(1, len(names))

    def _sweep(self, fd: int, whole: bool) -> bool:
        names, count = self.names, len(self.names)
        if whole or count <= SWEPT:
            chosen, self.fresh = names, []
        else:  # the hot ones, those new since the listing, then the others in turn
            room = SWEPT - len(self.hot)
            fresh, self.fresh = self.fresh[:room], self.fresh[room:]
            turn = [names[(self.cursor + i) % count] for i in range(min(room - len(fresh), count))]
            self.cursor = (self.cursor + len(turn)) % count
            chosen = [*self.hot, *fresh, *turn]
        changed = False
        for name in chosen:
            try:
                found = os.stat(name, dir_fd=fd, follow_symlinks=False)
                at = (found.st_ino, found.st_mtime_ns) if stat.S_ISDIR(found.st_mode) else None
            except OSError:
                at = None
            if name not in self.seen:
                self.seen[name] = at  # new since the listing, whose own stamp moved
                continue
            if self.seen[name] != at:
                self.seen[name] = at
                changed = True
                self.hot[name] = None
                self.hot.move_to_end(name)
                while len(self.hot) > HOT:
                    self.hot.popitem(last=False)
        return changed


def folders_of(subject: str) -> list[Folder]:
    """What ``subject`` shows, as the folders to look at; ``ValueError`` (``BadName``) for a
    subject that is none of those the view shows."""
    kind, _, name = subject.partition(":")
    if kind == "runs" and not name:
        return [Folder(["run"], sweep=True)]
    if kind == "run":
        check_run(name, "the view")
        return [Folder(["run", name])]
    if kind == "compare":  # the runs one comparison shows, and no other: a run's name has no '/'
        names = list(dict.fromkeys(name.split("/")))  # as /api/compare counts them: once each
        if not 1 <= len(names) <= COMPARED:
            raise ValueError(f"a comparison follows 1 to {COMPARED} runs (compare:A/B/...), not {len(names)}")
        return [Folder(["run", check_run(run, "the view")]) for run in names]
    if kind == "machines":
        if name:
            check_run(name, "the view")
            return [Folder(["machine"]), Folder(["run", name])]
        return [Folder(["machine"])]
    if kind == "studies" and not name:
        return [Folder([], sweep=True, skip=_NOT_STUDIES)]
    if kind == "study":
        check_name(definition_name(name))
        return [Folder([name]), Folder([name, "trial"], sweep=True)]
    raise ValueError(
        f"the view shows runs, run:NAME, compare:NAME/NAME..., machines, studies or study:NAME; not {subject[:40]!r}"
    )


class Subject:
    """One subject: its folders, how many times a look found it changed, who follows it."""

    def __init__(self, folders: list[Folder]) -> None:
        self.folders = folders
        self.version = 0
        self.following = 0
        self.since = time.monotonic()  # when it was last followed
        self.lock = threading.Lock()  # one look at a time
        self.looked = False
        self.moved = asyncio.Event()  # set (and replaced) at each change

    def look(self, root: Path) -> bool:
        with self.lock:
            whole = not self.looked
            changed = False
            for folder in self.folders:
                changed = folder.look(root, whole) or changed
            first, self.looked = not self.looked, True
            return changed and not first


class Watcher:
    """The view's one watcher: ``follow`` a subject, and wait for it to change."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.subjects: OrderedDict[str, Subject] = OrderedDict()
        self._task: asyncio.Task | None = None

    async def follow(self, subject: str) -> Subject:
        """The subject, looked at once already (so a page drawn after this misses nothing),
        followed until `leave`."""
        known = self.subjects.get(subject)
        if known is None:
            known = Subject(folders_of(subject))
            self.subjects[subject] = known
            self._let_go()
        self.subjects.move_to_end(subject)
        known.following += 1
        try:
            if not known.looked:
                await asyncio.to_thread(known.look, self.root)
        except BaseException:
            self.leave(known)
            raise
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._looking())
        return known

    def leave(self, subject: Subject) -> None:
        subject.following -= 1
        subject.since = time.monotonic()

    def _let_go(self) -> None:
        now = time.monotonic()
        for name, subject in list(self.subjects.items()):
            if len(self.subjects) <= KEPT and now - subject.since < IDLE:
                break
            if subject.following == 0:
                del self.subjects[name]

    async def _looking(self) -> None:
        while self.subjects:
            await asyncio.sleep(LOOK)
            self._let_go()
            followed = [s for s in self.subjects.values() if s.following > 0]
            if not followed:
                continue
            try:
                changed = await asyncio.to_thread(self._look, followed)
            except Exception as exc:  # noqa: BLE001 - one bad look never ends the watching
                tell_once(
                    self.root / ".view-watcher",
                    f"somatize view: a look at the store failed ({exc!r}); the view goes on looking",
                )
                continue
            for subject in changed:
                subject.version += 1
                moved, subject.moved = subject.moved, asyncio.Event()
                moved.set()

    def _look(self, subjects: list[Subject]) -> list[Subject]:
        return [subject for subject in subjects if subject.look(self.root)]
