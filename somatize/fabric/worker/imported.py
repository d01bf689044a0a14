"""What a worker imported, and whether the code on disk changed since.

A worker imports a node's module once and keeps it. After a package update or an edit of
the project, the files on disk are new and the worker still runs the old code: a node the
new code adds "does not exist" (pickle's ``Can't get attribute 'Twice' on <module ...>``),
a class lost a method. Nothing in those errors says the worker is behind. This module keeps,
for every module the process imported, the file's identity when it was first seen (inode,
size, modification time), so a failure can be told apart from stale code and say so, with
the fix: restart the worker.

The advice comes from that record alone: a module is said to be older than its file only
when its file, looked at now, is not the one imported. Text a peer chose (a node's label,
an error's message, a traceback) never makes it say so: at most it puts the modules it
names first among those the record found changed. Looking costs one ``stat`` per imported
module, done at most once per ``LOOK`` seconds however many failures ask.

It is not a reloader: reloading a module under running threads is not safe, and a restart
is one command. The cost while nothing fails is one ``len(sys.modules)`` per answer.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time

#: Modules named in an error's text: pickle's ``<module 'a.b' from ...>``, and our `a.b:C` / `a.b`.
_NAMED = re.compile(r"<module '([\w.]+)'|`([A-Za-z_][\w.]*)(?::[\w.]+)?`")
#: Source files named in a traceback.
_FILES = re.compile(r'File "([^"]+\.py)"')
#: At most this many modules are looked at for one failure (a traceback can be long).
_MOST = 64
#: A module name longer than this, or with more dots than this, is not looked at.
_LONGEST, _DEEPEST = 200, 16
#: Seconds between two looks at the imported files (a flood of failures looks once).
LOOK = 0.25

RESTART = (
    "Restart the worker to load the new code (`systemctl restart somatize-worker`, or cancel "
    "and submit its SLURM job again; a worker a broker spawned starts afresh with that broker)"
)


class Imports:
    """The identity of each imported module's file, as it was when this object first saw it."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[str, int, int, int] | None] = {}
        self._files: dict[str, str] = {}  # file -> module name
        self._count = -1
        self._lock = threading.Lock()
        self._stale: list[tuple[str, str]] = []
        self._looked_at = -1e9
        self.note()

    def note(self) -> None:
        """Record the modules imported since the last look (nothing to do when none were)."""
        if len(sys.modules) == self._count:
            return
        with self._lock:
            for name, module in list(sys.modules.items()):
                if name in self._seen:
                    continue
                path = getattr(module, "__file__", None)
                self._seen[name] = _identity(path) if isinstance(path, str) else None
                if isinstance(path, str):
                    self._files[path] = name
            self._count = len(sys.modules)

    def stale(self) -> list[tuple[str, str]]:
        """``(module, file)`` for each module this process imported whose file is not the one
        it imported any more, from the record alone; looked at most once per ``LOOK`` seconds."""
        now = time.monotonic()
        with self._lock:
            if now - self._looked_at < LOOK:
                return list(self._stale)
            seen = list(self._seen.items())
        found = [(name, then[0]) for name, then in seen if then is not None and _identity(then[0]) != then]
        with self._lock:
            self._stale, self._looked_at = found, time.monotonic()
        return found

    def changed(self, text: str = "") -> list[tuple[str, str]]:
        """The modules whose files changed (:meth:`stale`), those ``text`` (an error, a
        traceback) names first. ``text`` only orders what the record found."""
        stale = self.stale()
        if not stale or not text:
            return stale
        named = self._named(text)
        return sorted(stale, key=lambda found: found[0] not in named)

    def _named(self, text: str) -> set[str]:
        """The modules ``text`` names, bounded: linear in the text whatever it holds."""
        names: set[str] = set()
        for found in _NAMED.finditer(text):
            name = found.group(1) or found.group(2)
            if len(name) > _LONGEST or name.count(".") >= _DEEPEST:
                continue
            parts = name.split(".")
            for i in range(len(parts), 0, -1):
                names.add(".".join(parts[:i]))
            if len(names) >= _MOST:
                break
        for found in _FILES.finditer(text):
            if len(names) >= 2 * _MOST:
                break
            module = self._files.get(found.group(1))
            if module is not None:
                names.add(module)
        return names

    def imported(self, name: str) -> bool:
        return name in self._seen

    def explain(self, text: str = "") -> str | None:
        """A sentence saying the worker holds an older import, when a file it imported has
        changed since (``text``, the failure, only chooses which is named first)."""
        changed = self.changed(text)
        if not changed:
            return None
        name, path = changed[0]
        more = f" (and {', '.join(f'`{n}`' for n, _ in changed[1:4])})" if len(changed) > 1 else ""
        return (
            f"This worker holds an older import of `{name}`{more}: its file {path} changed after "
            f"the worker imported it, so the worker still runs the old code. {RESTART}."
        )


def _identity(path: str) -> tuple[str, int, int, int] | None:
    try:
        info = os.stat(path)
    except OSError:
        return (path, -1, -1, -1)  # gone since: changed, as far as anyone can tell
    return (path, info.st_ino, info.st_size, info.st_mtime_ns)
