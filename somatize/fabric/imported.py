"""What a worker imported, and whether the code on disk changed since.

A worker imports a node's module once and keeps it. After a package update or an edit of
the project, the files on disk are new and the worker still runs the old code: a node the
new code adds "does not exist" (pickle's ``Can't get attribute 'Twice' on <module ...>``),
a class lost a method. Nothing in those errors says the worker is behind. This module keeps,
for every module the process imported, the file's identity when it was first seen (inode,
size, modification time), so a failure can be told apart from stale code and say so, with
the fix: restart the worker.

It is not a reloader: reloading a module under running threads is not safe, and a restart
is one command. The cost while nothing fails is one ``len(sys.modules)`` per answer.
"""

from __future__ import annotations

import os
import re
import sys
import threading

#: Modules named in an error's text: pickle's ``<module 'a.b' from ...>``, and our `a.b:C` / `a.b`.
_NAMED = re.compile(r"<module '([\w.]+)'|`([A-Za-z_][\w.]*)(?::[\w.]+)?`")
#: Source files named in a traceback.
_FILES = re.compile(r'File "([^"]+\.py)"')
#: At most this many modules are looked at for one failure (a traceback can be long).
_MOST = 64
#: A module name longer than this, or with more dots than this, is not looked at.
_LONGEST, _DEEPEST = 200, 16

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

    def changed(self, text: str) -> list[tuple[str, str]]:
        """``(module, file)`` for each module named in ``text`` (an error, a traceback) whose
        file is not the one this process imported any more."""
        # linear in the text whatever it holds: a client's text (an error naming its own key,
        # say) is in it. A module's name is short and a few parts deep; longer ones are not
        # modules of ours, and once `_MOST` names are found the rest is not looked at.
        names: dict[str, None] = {}
        for found in _NAMED.finditer(text):
            name = found.group(1) or found.group(2)
            if len(name) > _LONGEST or name.count(".") >= _DEEPEST:
                continue
            parts = name.split(".")
            for i in range(len(parts), 0, -1):
                names[".".join(parts[:i])] = None
            if len(names) >= _MOST:
                break
        for found in _FILES.finditer(text):
            if len(names) >= 2 * _MOST:
                break
            if found.group(1) in self._files:
                names[self._files[found.group(1)]] = None
        out: list[tuple[str, str]] = []
        for name in list(names)[: 2 * _MOST]:
            then = self._seen.get(name)
            if then is None:
                continue
            if _identity(then[0]) != then:
                out.append((name, then[0]))
        return out

    def imported(self, name: str) -> bool:
        return name in self._seen

    def explain(self, text: str) -> str | None:
        """A sentence saying the worker holds an older import, when ``text`` points at one."""
        changed = self.changed(text)
        if changed:
            name, path = changed[0]
            more = f" (and {', '.join(f'`{n}`' for n, _ in changed[1:4])})" if len(changed) > 1 else ""
            return (
                f"This worker holds an older import of `{name}`{more}: its file {path} changed after "
                f"the worker imported it, so the worker still runs the old code. {RESTART}."
            )
        missing = re.search(r"Can't get attribute '([\w.]+)' on <module '([\w.]+)'", text)
        if missing and self.imported(missing.group(2)):
            return (
                f"This worker imported `{missing.group(2)}` before, and its import has no "
                f"`{missing.group(1)}`: if that code was updated since the worker started, the "
                f"worker holds an older import. {RESTART}."
            )
        return None


def _identity(path: str) -> tuple[str, int, int, int] | None:
    try:
        info = os.stat(path)
    except OSError:
        return (path, -1, -1, -1)  # gone since: changed, as far as anyone can tell
    return (path, info.st_ino, info.st_size, info.st_mtime_ns)
