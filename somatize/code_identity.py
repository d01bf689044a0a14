"""What a node's code adds to its identity, so that a cache key changes when the code does.

A cached node's key is made of its identity and the key of its input (:mod:`somatize.keys`).
Without the code in the identity, a ``forward`` edited from ``x + 1`` to ``x + 2`` would
recall what ``x + 1`` made, on every machine that shares the store. :func:`code_digest`
gives a node class a short digest of the code that runs when it does:

- the source of the class, and of each base class outside somatize and the standard
  library (a base from another installed library, ``torch.nn.Module`` say, counts, so
  upgrading it misses once);
- the source of every function the class holds that was written elsewhere (``forward =
  _forward``, ``forward = impl.forward`` from another module);
- what the code of the user's project loads as a global (by ``LOAD_GLOBAL``/``LOAD_NAME``,
  as cloudpickle finds what it sends; not the attribute and import names that share
  ``co_names``), and what its closures hold: a function or a class of the user's project
  (not somatize, the standard library or an installed library) is followed, its source
  digested and what it loads followed in turn; a module, a builtin and a function or class
  from elsewhere count by their name; any other value (a number, a table, a model) by
  nothing but that it is one;
- each text normalised by Python's tokenizer: comments, blank lines, line endings,
  indentation style and spacing inside a line do not count; every token does, docstrings
  included. So the same file gives the same digest on every machine and on every Python
  from 3.11;
- a text is taken for the code only when compiling the lines read gives the very code
  objects that run (:mod:`somatize.code_source`): a ``.pyc`` Python loaded that is older
  than its file (an edit within the same second that kept the size), or a file edited
  since the import, is not. Where there is no source to trust (a class made with
  ``type()``, rebuilt by cloudpickle, typed at ``python -c``, a stale ``.pyc``), the
  bytecode counts instead, said once on stderr: bytecode differs between Python versions,
  so that key holds within one.

The lines of the files a class's own functions come from are kept as the class is made, so
editing a module a running process imported and did not reload does not give the old code
the new code's key. A class whose methods are replaced in place (IPython's autoreload), or a
global its code loads that is bound anew (a notebook cell run again), is read again.

Not seen: what code reaches as an attribute (``impl.helper()``, ``self.model``), values
other than code (module constants, closures' numbers), methods attached to the class after
its first key, and data files. ``.cached(version=...)`` replaces the digest with a name the
user chooses, for an edit that does not change results.

Nothing here touches a store or the wire.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import sysconfig
import threading
import types
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from .code_source import class_source, function_source, lines_now, loaded_globals, normalised

__all__ = ["code_digest", "noted"]

#: Named in every digest: a change of what is digested makes every key new, once.
_SCHEME = b"somatize code 2"
#: The most functions and classes one digest follows; past it, one line on stderr.
_FOLLOWED = 1024
_HEAPTYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: made by a class statement or type(), not static C
# Attributes every class has, or that only say where it was written.
_NOT_CODE = {
    "__module__",
    "__qualname__",
    "__dict__",
    "__weakref__",
    "__firstlineno__",
    "__static_attributes__",
    "__slotnames__",
}
_MISSING = object()
_STALE = (
    "the code it runs is not what its file holds now (Python loaded a .pyc older than an "
    "edit made within the same second that kept the file's size, or the file was edited "
    "after it was imported)"
)

_lock = threading.RLock()
_said: set[str] = set()


class _Birth:
    """What a class was when it was made: its code objects and the lines of its files."""

    __slots__ = ("fingerprint", "body", "files")

    def __init__(self, fingerprint: tuple, body: frozenset[str], files: dict[str, list[str]]) -> None:
        self.fingerprint = fingerprint
        self.body = body
        self.files = files


class _Held:
    """A digest, and what shows it still holds: the code object of each function it read,
    and what each global it read is bound to."""

    __slots__ = ("mro", "codes", "names", "kinds", "digest")

    def __init__(self, mro: tuple, codes: list, names: list, kinds: list, digest: str) -> None:
        self.mro = mro
        self.codes = tuple(codes)
        self.names = tuple(names)
        self.kinds = tuple(kinds)
        self.digest = digest

    def holds(self) -> bool:
        for function, code in self.codes:
            if function.__code__ is not code:
                return False  # replaced in place since (IPython's autoreload does this)
        for names, name, value in self.names:
            if names.get(name, _MISSING) is not value:
                return False  # bound anew (a notebook cell run again, a reload)
        for names, name, kind in self.kinds:
            if type(names.get(name, _MISSING)) is not kind:
                return False
        return True


_births: weakref.WeakKeyDictionary[type, _Birth] = weakref.WeakKeyDictionary()
_digests: weakref.WeakKeyDictionary[type, _Held] = weakref.WeakKeyDictionary()
_pieces: weakref.WeakKeyDictionary[type, tuple[tuple, bytes]] = weakref.WeakKeyDictionary()
_function_pieces: weakref.WeakKeyDictionary[types.FunctionType, tuple[types.CodeType, bytes]] = (
    weakref.WeakKeyDictionary()
)
_loads: weakref.WeakKeyDictionary[types.CodeType, tuple[str, ...]] = weakref.WeakKeyDictionary()


def noted(cls: type) -> None:
    """Called as ``cls`` is made (``Node.__init_subclass__``): keep the lines of the files its
    code comes from, as they are now, and what its methods are. Never raises: a class is
    always made, and what could not be noted is read later."""
    if cls.__module__.partition(".")[0] == "somatize":
        return  # ours, made as somatize is imported: nothing is read then, and read later
    try:
        classes = _read(cls)
        files: dict[str, list[str]] = {}
        for klass in classes:
            for filename in _files_of(klass):
                if filename not in files:
                    files[filename] = lines_now(filename, klass.__module__)
            for _, function in _functions(klass):  # those written elsewhere too
                filename = function.__code__.co_filename
                if filename not in files:
                    files[filename] = lines_now(filename, function.__module__ or "")
        _births[cls] = _Birth(_fingerprint(classes), _body_names(cls), files)
    except Exception:  # pragma: no cover - a class must be made whatever its source is
        _births.pop(cls, None)


def code_digest(cls: type) -> str:
    """A digest of the code of node class ``cls``: ``"code:"`` and 32 hex digits.

    Made once per class and kept; checked on every call against the code objects and the
    globals it was made from (a few microseconds), so a class whose methods were replaced
    in place, or whose helper was defined anew, is read again.
    """
    held = _digests.get(cls)
    if held is not None and held.mro is cls.__mro__ and held.holds():
        return held.digest
    with _lock:
        classes = _read(cls)
        walk = _Walk()
        try:
            walk.all(cls, classes)
            digest = walk.digest.hexdigest()[:32]
        except Exception as exc:  # never an exception: at worst, a key no other process has
            _say(
                _name(cls),
                f"has code that could not be read ({type(exc).__name__}: {exc}), so "
                f"its cache key is new in every process",
            )
            digest = os.urandom(16).hex()
            walk.names.clear()
            walk.kinds.clear()
            walk.codes[:] = [(f, f.__code__) for klass in classes for _, f in _functions(klass)]
        held = _Held(cls.__mro__, walk.codes, walk.names, walk.kinds, "code:" + digest)
        _digests[cls] = held
        return held.digest


# -- which classes, and whether they changed -----------------------------------------------


def _read(cls: type) -> tuple[type, ...]:
    """``cls`` and the bases whose code is read: not somatize's, not the standard library's,
    not compiled in C."""
    return tuple(k for k in cls.__mro__ if k is cls or _is_users(k))


def _is_users(klass: type) -> bool:
    if not klass.__flags__ & _HEAPTYPE:
        return False  # a static type, compiled: object, int, an extension's class
    module = klass.__module__ if isinstance(klass.__module__, str) else ""
    top = module.partition(".")[0]
    if top in ("somatize", "builtins"):
        return False
    return not (top in sys.stdlib_module_names and _in_stdlib(sys.modules.get(module)))


def _in_stdlib(module: types.ModuleType | None) -> bool:
    where = getattr(module, "__file__", None)
    if not isinstance(where, str):
        return True  # built in, or frozen
    path = os.path.realpath(where)
    return any(path.startswith(root) for root in _stdlib_roots()) and not any(
        part in ("site-packages", "dist-packages") for part in path.split(os.sep)
    )


@functools.lru_cache(maxsize=1)
def _stdlib_roots() -> tuple[str, ...]:
    roots = {sysconfig.get_path(name) for name in ("stdlib", "platstdlib")}
    return tuple(os.path.realpath(r) + os.sep for r in roots if r)


@functools.lru_cache(maxsize=4096)
def _in_project(module_name: str, filename: str) -> bool:
    """Whether code of ``module_name`` (written in ``filename``) is the user's project's:
    not somatize's, the standard library's or an installed library's. A script, a notebook
    cell and a package installed editable from its folder are."""
    top = module_name.partition(".")[0]
    if top in ("somatize", "builtins"):
        return False
    module = sys.modules.get(module_name)
    if top in sys.stdlib_module_names and _in_stdlib(module):
        return False
    where = getattr(module, "__file__", None)
    where = where if isinstance(where, str) else filename
    if not os.path.isabs(where):
        return True  # a notebook cell, `python -c`, code made by exec
    path = os.path.realpath(where)
    return not (
        any(path.startswith(root) for root in _stdlib_roots())
        or any(part in ("site-packages", "dist-packages") for part in path.split(os.sep))
    )


def _functions(klass: type) -> Iterator[tuple[str, types.FunctionType]]:
    """The functions ``klass`` holds, by attribute name (those in a static, class or property
    method too)."""
    for name, value in vars(klass).items():
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        if isinstance(value, property):
            for part in (value.fget, value.fset, value.fdel):
                if isinstance(part, types.FunctionType):
                    yield name, part
        elif isinstance(value, functools.cached_property):
            if isinstance(value.func, types.FunctionType):
                yield name, value.func
        elif isinstance(value, types.FunctionType):
            yield name, value


def _fingerprint(classes: tuple[type, ...]) -> tuple:
    """What shows that a class's code changed since: the code object of each of its
    functions (a tuple compares its items by identity first, so this is cheap)."""
    return tuple(f.__code__ for klass in classes for _, f in _functions(klass))


def _in_body(klass: type, function: types.FunctionType) -> bool:
    """Whether ``function`` was written in ``klass``'s body (its qualified name says so)."""
    return function.__qualname__.startswith(klass.__qualname__ + ".")


def _body_names(klass: type) -> frozenset[str]:
    """The functions written in the class's body."""
    return frozenset(name for name, f in _functions(klass) if _in_body(klass, f))


def _files_of(klass: type) -> list[str]:
    """The files ``klass``'s body could be in: those of the functions written in it, else its
    module's."""
    found = [f.__code__.co_filename for _, f in _functions(klass) if _in_body(klass, f)]
    if not found:
        where = getattr(sys.modules.get(klass.__module__), "__file__", None)
        if isinstance(where, str):
            found.append(where)
    return list(dict.fromkeys(found))


# -- the digest ----------------------------------------------------------------------------

Lines = Callable[[str, str], list[str]]


def _lines_of(cls: type) -> Lines | None:
    """How the lines of ``cls``'s files are read: as kept when it was made, or now when it
    changed in place since (autoreload); None when its functions were set after it was made
    (cloudpickle and dill rebuild a class so, and the files its code names are another
    process's)."""
    birth = _births.get(cls)
    if birth is not None and not birth.body and _body_names(cls):
        return None
    if birth is not None and birth.fingerprint == _fingerprint(_read(cls)):
        files = birth.files
        return lambda filename, module: files[filename] if filename in files else lines_now(filename, module)
    return lines_now


class _Walk:
    """One digest: the classes of a node, then every function and class of the project
    their code reaches by a global, each once, in the order first reached."""

    def __init__(self) -> None:
        self.digest = hashlib.sha256(_SCHEME)
        self.seen: dict[int, int] = {}
        self.todo: deque[tuple[Any, Lines | None]] = deque()
        self.codes: list[tuple[types.FunctionType, types.CodeType]] = []
        self.names: list[tuple[dict, str, Any]] = []
        self.kinds: list[tuple[dict, str, type]] = []
        self.full = False

    def all(self, cls: type, classes: tuple[type, ...]) -> None:
        lines_of = _lines_of(cls)
        for klass in classes:
            self.seen.setdefault(id(klass), len(self.seen))
        for klass in classes:
            self.klass(klass, lines_of)
        while self.todo:
            unit, lines_of = self.todo.popleft()
            _feed(self.digest, f"unit {self.seen[id(unit)]}".encode())
            if isinstance(unit, type):
                self.klass(unit, lines_of)
            else:
                self.function(unit, lines_of)

    def klass(self, klass: type, lines_of: Lines | None) -> None:
        piece = _piece(klass, lines_of)
        _feed(self.digest, piece)
        ours = _in_project(klass.__module__ if isinstance(klass.__module__, str) else "", "")
        for name, function in sorted(_functions(klass), key=lambda item: item[0]):
            self.codes.append((function, function.__code__))
            if not _in_body(klass, function) and piece.startswith(b"source:"):
                # written elsewhere: its source is not the class's (bytecode holds it all)
                _feed(self.digest, f"holds {name}".encode())
                _feed(self.digest, _function_piece(function, lines_of))
            if ours or not _in_body(klass, function):
                self.uses(function, lines_of)

    def function(self, function: types.FunctionType, lines_of: Lines | None) -> None:
        self.codes.append((function, function.__code__))
        _feed(self.digest, _function_piece(function, lines_of))
        self.uses(function, lines_of)

    def uses(self, function: types.FunctionType, lines_of: Lines | None) -> None:
        """What ``function``'s code loads as globals, what its closure holds, and what it
        wraps, where it is the project's code."""
        code = function.__code__
        if not _in_project(function.__module__ or "", code.co_filename):
            return
        names = function.__globals__
        for name in _loads_of(code):
            value = names.get(name, _MISSING)
            if value is _MISSING:
                builtins = getattr(function, "__builtins__", None)
                seen = f"builtin:{name}" if isinstance(builtins, dict) and name in builtins else "missing"
                self.names.append((names, name, _MISSING))
            else:
                seen = self.value(value, lines_of)
                if seen == "value":
                    self.kinds.append((names, name, type(value)))
                else:
                    self.names.append((names, name, value))
            _feed(self.digest, f"global {name}={seen}".encode("utf-8", "surrogatepass"))
        for free, cell in zip(code.co_freevars, function.__closure__ or (), strict=False):
            try:
                held = cell.cell_contents
            except ValueError:  # a cell not filled yet
                seen = "empty"
            else:
                seen = self.value(held, lines_of)
            _feed(self.digest, f"cell {free}={seen}".encode("utf-8", "surrogatepass"))
        wrapped = vars(function).get("__wrapped__")
        if wrapped is not None:  # functools.wraps: the function that does the work
            _feed(self.digest, f"wraps {self.value(wrapped, lines_of)}".encode("utf-8", "surrogatepass"))

    def value(self, value: Any, lines_of: Lines | None) -> str:
        """How a global or a captured value counts: code of the project by what it is
        (followed), a module, builtin or library's code by its name, anything else not."""
        if isinstance(value, types.ModuleType):
            return f"module:{value.__name__}"
        if isinstance(value, types.FunctionType):
            module = value.__module__ or ""
            if _in_project(module, value.__code__.co_filename):
                return self.follow(value, lines_of)
            return f"function:{module}.{value.__qualname__}"
        if isinstance(value, type):
            module = value.__module__ if isinstance(value.__module__, str) else ""
            if value.__flags__ & _HEAPTYPE and _in_project(module, ""):
                return self.follow(value, _lines_of(value) if value in _births else lines_now)
            return f"class:{module}.{value.__qualname__}"
        if isinstance(value, types.BuiltinFunctionType):
            return f"builtin:{getattr(value, '__module__', None)}.{value.__qualname__}"
        return "value"

    def follow(self, unit: Any, lines_of: Lines | None) -> str:
        key = id(unit)
        if key not in self.seen:
            if len(self.seen) >= _FOLLOWED:
                if not self.full:
                    self.full = True
                    _say(
                        _name(unit),
                        f"is past the {_FOLLOWED} functions and classes a cache key "
                        f"follows, so it and what it calls are not part of the key",
                    )
                return f"unfollowed:{_name(unit)}"
            self.seen[key] = len(self.seen)
            self.todo.append((unit, lines_of))
        return f"unit:{self.seen[key]}"


def _loads_of(code: types.CodeType) -> tuple[str, ...]:
    """The globals ``code`` (or code nested in it) loads, sorted; kept per code object."""
    held = _loads.get(code)
    if held is None:
        held = _loads[code] = tuple(sorted(loaded_globals(code)))
    return held


def _piece(klass: type, lines_of: Lines | None) -> bytes:
    """The digest of one class's own code, kept per class while its code objects stay."""
    fingerprint = _fingerprint((klass,))
    held = _pieces.get(klass)
    if held is not None and held[0] == fingerprint and lines_of is not None:
        return held[1]
    source, stale = None, False
    if lines_of is not None:
        written = [f for _, f in _functions(klass) if _in_body(klass, f)]
        module = klass.__module__ if isinstance(klass.__module__, str) else ""
        source, stale = class_source(klass, written, _files_of(klass), lambda name: lines_of(name, module))
    if source is not None:
        piece = b"source:" + normalised(source)
    else:
        why = (
            "its methods were set after the class was made, as cloudpickle does"
            if lines_of is None
            else _STALE
            if stale
            else "no file or notebook cell holds its class statement"
        )
        _no_source(_name(klass), why)
        piece = b"bytecode:" + _bytecode(klass)
    if lines_of is not None:
        _pieces[klass] = (fingerprint, piece)
    return piece


def _function_piece(function: types.FunctionType, lines_of: Lines | None) -> bytes:
    """The digest of a function written outside the class that holds it: its ``def``'s
    source, or its bytecode where no source is the code that runs. Kept per function while
    its code object stays (a source is taken only when it compiles to that very code)."""
    code = function.__code__
    held = _function_pieces.get(function)
    if held is not None and held[0] is code:
        return held[1]
    read = lines_of or lines_now  # a function's own file, where it compiles to it, is its source
    source, stale = function_source(function, read(code.co_filename, function.__module__ or ""))
    if source is not None:
        piece = b"source:" + normalised(source)
    else:
        if stale or os.path.isabs(code.co_filename):
            # not code made by exec (a dataclass's __init__, say): the class's source says it
            _no_source(_name(function), _STALE if stale else "no file or notebook cell holds its `def`")
        piece = b"bytecode:" + hashlib.sha256(_written(function).encode("utf-8", "surrogatepass")).digest()
    _function_pieces[function] = (code, piece)
    return piece


def _feed(digest: Any, part: bytes) -> None:
    # length-prefixed, so two sequences of parts never give the same stream
    digest.update(len(part).to_bytes(8, "little"))
    digest.update(part)


def _name(thing: Any) -> str:
    return f"{getattr(thing, '__module__', None)}.{getattr(thing, '__qualname__', '?')}"


def _no_source(name: str, why: str) -> None:
    _say(
        name,
        f"has no source to read ({why}), so its cache key follows its bytecode, which "
        f'differs between Python versions. Give the node `.cached(version="...")` to '
        f"name its code yourself",
    )


def _say(name: str, line: str) -> None:
    with _lock:
        if name in _said:
            return
        _said.add(name)
    print(f"somatize: `{name}` {line}.", file=sys.stderr, flush=True)


# -- bytecode, where there is no source ----------------------------------------------------


def _bytecode(klass: type) -> bytes:
    """A digest of what the class holds, the same in every process of one Python version:
    its name, its bases' names, and each attribute (functions by their code, plain values
    by their text, anything else by its type's name)."""
    digest = hashlib.sha256()
    _feed(digest, klass.__qualname__.encode())
    for base in klass.__bases__:
        _feed(digest, f"{base.__module__}.{base.__qualname__}".encode())
    attributes = vars(klass)
    for name in sorted(attributes):
        if name in _NOT_CODE:
            continue
        _feed(digest, name.encode())
        _feed(digest, _written(attributes[name]).encode("utf-8", "surrogatepass"))
    return digest.digest()


def _written(value: Any, depth: int = 0) -> str:
    if depth > 16:
        return "..."
    if isinstance(value, (staticmethod, classmethod)):
        return f"{type(value).__name__}({_written(value.__func__, depth + 1)})"
    if isinstance(value, property):
        parts = (value.fget, value.fset, value.fdel)
        return "property(" + ",".join(_written(p, depth + 1) for p in parts) + ")"
    if isinstance(value, functools.cached_property):
        return f"cached_property({_written(value.func, depth + 1)})"
    if isinstance(value, types.FunctionType):
        defaults = (_written(value.__defaults__, depth + 1), _written(value.__kwdefaults__, depth + 1))
        return f"function({_code(value.__code__, depth + 1)},{defaults[0]},{defaults[1]})"
    if isinstance(value, types.CodeType):
        return _code(value, depth + 1)
    if value is None or value is Ellipsis or isinstance(value, (bool, int, float, complex, str, bytes)):
        return f"{type(value).__name__}:{value!r}"
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__}(" + ",".join(_written(v, depth + 1) for v in value) + ")"
    if isinstance(value, (frozenset, set)):  # its order follows the hash seed: sort it
        return f"{type(value).__name__}(" + ",".join(sorted(_written(v, depth + 1) for v in value)) + ")"
    if isinstance(value, dict):
        return (
            "dict("
            + ",".join(sorted(f"{_written(k, depth + 1)}:{_written(v, depth + 1)}" for k, v in value.items()))
            + ")"
        )
    return f"<{type(value).__module__}.{type(value).__qualname__}>"


def _code(code: types.CodeType, depth: int) -> str:
    # not the file, line numbers or qualified name: where code was written is not what it does
    return (
        "code("
        + ",".join(
            (
                str(code.co_argcount),
                str(code.co_posonlyargcount),
                str(code.co_kwonlyargcount),
                str(code.co_flags),
                code.co_code.hex(),
                repr(code.co_names),
                repr(code.co_varnames),
                repr(code.co_freevars),
                repr(code.co_cellvars),
                _written(code.co_consts, depth + 1),
            )
        )
        + ")"
    )
