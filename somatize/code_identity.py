"""What a node's code adds to its identity, so that a cache key changes when the code does.

A cached node's key is made of its identity and the key of its input (:mod:`somatize.keys`).
Without the code in the identity, a ``forward`` edited from ``x + 1`` to ``x + 2`` would
recall what ``x + 1`` made, on every machine that shares the store. :func:`code_digest`
gives a node class a short digest of:

- the source of the class, and of each base class outside somatize and the standard
  library (a base from another installed library, ``torch.nn.Module`` say, counts, so
  upgrading it misses once), read from the file or the notebook cell it was defined in;
- normalised by Python's tokenizer: comments, blank lines, line endings, indentation style
  and spacing inside a line do not count; every token does, docstrings included. So the
  same file gives the same digest on every machine and on every Python from 3.11;
- where a class has no source to read (made with ``type()``, rebuilt by cloudpickle, typed
  at ``python -c``), its bytecode instead, said once on stderr: bytecode differs between
  Python versions, so that key holds within one.

The source read is the file as it was when the class was made (a copy of its lines is
taken then), so editing a module a running process imported and did not reload does not
give the old code the new code's key. A class whose methods are replaced in place
(IPython's autoreload) is read again.

Not seen: functions and modules ``forward`` calls, methods attached to the class after
its body, closures, and data files. ``.cached(version=...)`` replaces the digest with a
name the user chooses, for an edit that does not change results.

Nothing here touches a store or the wire.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import io
import linecache
import os
import sys
import sysconfig
import threading
import tokenize
import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["code_digest", "noted"]

_HEAPTYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: made by a class statement or type(), not static C
_WORDS = {tokenize.NAME, tokenize.ERRORTOKEN}
_TOKENS_SKIPPED = {tokenize.COMMENT, tokenize.NL, tokenize.ENCODING, tokenize.ENDMARKER}
# Python 3.12 splits an f-string into parts (3.14 a t-string); 3.11 gives one STRING token.
# The whole literal, as written, is one token here on every version.
_STRING_STARTS = {"FSTRING_START", "TSTRING_START"}
_STRING_ENDS = {"FSTRING_END", "TSTRING_END"}
# Attributes every class has, or that only say where it was written.
_NOT_CODE = {"__module__", "__qualname__", "__dict__", "__weakref__", "__firstlineno__",
             "__static_attributes__", "__slotnames__"}

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
    """A digest, and the code objects of the functions it was made from."""

    __slots__ = ("mro", "checks", "digest")

    def __init__(self, mro: tuple, classes: tuple[type, ...], digest: str) -> None:
        self.mro = mro
        self.checks = tuple((f, f.__code__) for klass in classes for _, f in _functions(klass))
        self.digest = digest


_births: weakref.WeakKeyDictionary[type, _Birth] = weakref.WeakKeyDictionary()
_digests: weakref.WeakKeyDictionary[type, _Held] = weakref.WeakKeyDictionary()
_pieces: weakref.WeakKeyDictionary[type, tuple[tuple, bytes]] = weakref.WeakKeyDictionary()


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
                    files[filename] = _lines_now(filename, klass)
        _births[cls] = _Birth(_fingerprint(classes), _body_names(cls), files)
    except Exception:  # pragma: no cover - a class must be made whatever its source is
        _births.pop(cls, None)


def code_digest(cls: type) -> str:
    """A digest of the code of node class ``cls``: ``"code:"`` and 32 hex digits.

    Made once per class and kept; checked against the class's code objects on every call
    (a few microseconds), so a class whose methods were replaced in place is read again.
    """
    held = _digests.get(cls)
    if held is not None and held.mro is cls.__mro__:
        for function, code in held.checks:
            if function.__code__ is not code:
                break  # replaced in place since (IPython's autoreload does this)
        else:
            return held.digest
    with _lock:
        classes = _read(cls)
        fingerprint = _fingerprint(classes)
        try:
            digest = _digest(cls, classes, fingerprint)
        except Exception as exc:  # never an exception: at worst, a key no other process has
            _say(cls, f"has code that could not be read ({type(exc).__name__}: {exc}), so its "
                      f"cache key is new in every process")
            digest = os.urandom(16).hex()
        _digests[cls] = _Held(cls.__mro__, classes, "code:" + digest)
        return "code:" + digest


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


def _body_names(klass: type) -> frozenset[str]:
    """The functions written in the class's body (their qualified name says so)."""
    inside = klass.__qualname__ + "."
    return frozenset(name for name, f in _functions(klass) if f.__qualname__.startswith(inside))


# -- the digest ----------------------------------------------------------------------------


def _digest(cls: type, classes: tuple[type, ...], fingerprint: tuple) -> str:
    birth = _births.get(cls)
    if birth is not None and not birth.body and _body_names(cls):
        # made empty, its functions set afterwards: cloudpickle (and dill) rebuild a class
        # this way, and the file its code names is another process's
        lines_of: Callable[[str, type], list[str]] | None = None
    elif birth is not None and birth.fingerprint == fingerprint:
        lines_of = functools.partial(_lines_then, birth.files)
    else:
        lines_of = _lines_now  # changed in place since it was made (autoreload): read again
    digest = hashlib.sha256(b"somatize code 1")
    for klass in classes:
        _feed(digest, _piece(klass, lines_of))
    return digest.hexdigest()[:32]


def _piece(klass: type, lines_of: Callable[[str, type], list[str]] | None) -> bytes:
    """The digest of one class's own code, kept per class while its code objects stay."""
    fingerprint = _fingerprint((klass,))
    held = _pieces.get(klass)
    if held is not None and held[0] == fingerprint and lines_of is not None:
        return held[1]
    source = None if lines_of is None else _source(klass, lines_of)
    if source is not None:
        piece = b"source:" + _normalised(source)
    else:
        why = ("its methods were set after the class was made, as cloudpickle does"
               if lines_of is None else "no file or notebook cell holds its class statement")
        _say(klass, f"has no source to read ({why}), so its cache key follows its bytecode, which "
                    f"differs between Python versions. Give the node `.cached(version=\"...\")` "
                    f"to name its code yourself")
        piece = b"bytecode:" + _bytecode(klass)
    if lines_of is not None:
        _pieces[klass] = (fingerprint, piece)
    return piece


def _feed(digest: Any, part: bytes) -> None:
    # length-prefixed, so two sequences of parts never give the same stream
    digest.update(len(part).to_bytes(8, "little"))
    digest.update(part)


def _say(klass: type, line: str) -> None:
    name = f"{klass.__module__}.{klass.__qualname__}"
    with _lock:
        if name in _said:
            return
        _said.add(name)
    print(f"somatize: `{name}` {line}.", file=sys.stderr, flush=True)


# -- finding the source --------------------------------------------------------------------


def _files_of(klass: type) -> list[str]:
    """The files ``klass``'s body could be in: those of the functions written in it, else its
    module's."""
    inside = klass.__qualname__ + "."
    found = [f.__code__.co_filename for _, f in _functions(klass) if f.__qualname__.startswith(inside)]
    if not found:
        where = getattr(sys.modules.get(klass.__module__), "__file__", None)
        if isinstance(where, str):
            found.append(where)
    return list(dict.fromkeys(found))


def _lines_now(filename: str, klass: type) -> list[str]:
    """The lines of ``filename`` as they are now: a file on disk, or what linecache holds for
    a notebook cell (IPython puts every cell there)."""
    linecache.checkcache(filename)  # a file that changed since it was cached is read again
    module = sys.modules.get(klass.__module__)
    # the module's loader may read the file (a zip, say), only when it is the module's own:
    # linecache would otherwise give the module's source under another file's name
    ours = getattr(module, "__file__", None) == filename
    return linecache.getlines(filename, getattr(module, "__dict__", None) if ours else None)


def _lines_then(files: dict[str, list[str]], filename: str, klass: type) -> list[str]:
    """The lines of ``filename`` as they were when the class was made, where they were kept."""
    return files[filename] if filename in files else _lines_now(filename, klass)


def _source(klass: type, lines_of: Callable[[str, type], list[str]]) -> list[str] | None:
    """The lines of ``klass``'s class statement, decorators included, or ``None`` when no
    file holds exactly one statement that made it."""
    inside = klass.__qualname__ + "."
    written = [f for _, f in _functions(klass) if f.__qualname__.startswith(inside)]
    for filename in _files_of(klass):
        lines = lines_of(filename, klass)
        if not lines:
            continue
        statements = _classes_in(filename, lines).get(klass.__name__, [])
        anchors = [f for f in written if f.__code__.co_filename == filename]
        if anchors:
            fits = [s for s in statements if all(_holds(s, f) for f in anchors)]
        elif "__firstlineno__" in vars(klass):  # Python 3.13+, a class statement's own
            fits = [s for s in statements if s.first == vars(klass)["__firstlineno__"]]
        else:
            fits = [s for s in statements if s.qualname == klass.__qualname__]
        if len(fits) == 1:
            return lines[fits[0].first - 1 : fits[0].last]
    return None


class _Statement:
    """A class statement in a file: where it starts (its first decorator) and ends, what it
    is called, and the name and first line of each function its body makes."""

    __slots__ = ("first", "last", "qualname", "defs")

    def __init__(self, node: ast.ClassDef, qualname: str) -> None:
        self.first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        self.last = node.end_lineno or node.lineno
        self.qualname = qualname
        self.defs = {(d.name, min([d.lineno, *(x.lineno for x in d.decorator_list)])) for d in _defs(node)}


def _defs(node: ast.AST) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    """The functions a class body makes, under an ``if`` or a ``try`` too, not those of a
    nested class or function."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield child
        elif not isinstance(child, (ast.ClassDef, ast.Lambda, ast.expr)):
            yield from _defs(child)


def _holds(statement: _Statement, function: types.FunctionType) -> bool:
    """Whether ``function`` was made by this statement: a ``def`` of its name starts on the
    very line its code object says (so a file edited since, lines moved, does not fit)."""
    line = function.__code__.co_firstlineno
    if function.__name__ == "<lambda>":
        return statement.first <= line <= statement.last
    return (function.__name__, line) in statement.defs


# One parse per file's lines, for the classes of one module read one after the other.
_parsed: dict[str, tuple[list[str], dict[str, list[_Statement]]]] = {}


def _classes_in(filename: str, lines: list[str]) -> dict[str, list[_Statement]]:
    held = _parsed.get(filename)
    if held is not None and held[0] is lines:
        return held[1]
    try:
        tree = ast.parse("".join(lines))
    except (SyntaxError, ValueError):
        found: dict[str, list[_Statement]] = {}
    else:
        found = {}
        _walk(tree, "", found)
    if len(_parsed) >= 16:
        _parsed.clear()
    _parsed[filename] = (lines, found)
    return found


def _walk(node: ast.AST, prefix: str, found: dict[str, list[_Statement]]) -> None:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.ClassDef):
            qualname = prefix + child.name
            found.setdefault(child.name, []).append(_Statement(child, qualname))
            _walk(child, qualname + ".", found)
        elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            _walk(child, prefix + child.name + ".<locals>.", found)
        else:
            _walk(child, prefix, found)


# -- normalising -------------------------------------------------------------------------


def _normalised(lines: list[str]) -> bytes:
    """The digest of a class statement's tokens: what Python reads, not how it is laid out.

    Comments, blank lines and spacing inside a line are dropped; indentation becomes
    "deeper" / "shallower" marks, so the same class nested or not, with tabs or spaces,
    reads the same. Tokens, not ``ast.dump``: the tree's form changes between Python
    versions, the tokens of a given text do not (f-strings aside, joined back here).
    """
    text = "".join(lines).replace("\r\n", "\n").replace("\r", "\n")
    rows = io.StringIO(text).readlines()
    digest = hashlib.sha256()
    try:
        tokens = _tokens(text, rows)
    except (tokenize.TokenError, SyntaxError):
        # not expected of a class Python compiled; the text then, line ends made the same
        tokens = [row.rstrip() for row in rows]
    for part in tokens:
        _feed(digest, part.encode("utf-8", "surrogatepass"))
    return digest.digest()


def _tokens(text: str, rows: list[str]) -> list[str]:
    out: list[str] = []
    depth = 0
    began = (0, 0)
    word_ends = None  # where the last name ended
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        kind = tokenize.tok_name[token.type]
        if token.type in _WORDS and not depth:
            if token.string.isspace():
                continue
            if token.start == word_ends:
                # 3.11's tokenizer splits a name at a combining mark (`עִברִית`); 3.12's
                # does not: a name is every piece that touches the one before
                out[-1] += token.string
            else:
                out.append(token.string)
            word_ends = token.end
            continue
        word_ends = None
        if kind in _STRING_STARTS:
            if depth == 0:
                began = token.start
            depth += 1
        elif kind in _STRING_ENDS:
            depth -= 1
            if depth == 0:
                out.append(_span(rows, began, token.end))
        elif depth or token.type in _TOKENS_SKIPPED:
            continue
        elif token.type == tokenize.NEWLINE:
            out.append("\n")
        elif token.type == tokenize.INDENT:
            out.append("\t>")
        elif token.type == tokenize.DEDENT:
            out.append("\t<")
        else:
            out.append(token.string)
    # a nested class starts deeper than its first line, and ends where the tokenizer
    # climbs back out: neither is the class's own
    start, end = 0, len(out)
    while start < end and out[start] == "\t>":
        start += 1
    while end > start and out[end - 1] in ("\t<", "\n"):
        end -= 1
    return out[start:end]


def _span(rows: list[str], start: tuple[int, int], end: tuple[int, int]) -> str:
    (r0, c0), (r1, c1) = start, end
    if r0 == r1:
        return rows[r0 - 1][c0:c1]
    return rows[r0 - 1][c0:] + "".join(rows[r0 : r1 - 1]) + rows[r1 - 1][:c1]


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
        return "dict(" + ",".join(sorted(f"{_written(k, depth + 1)}:{_written(v, depth + 1)}"
                                         for k, v in value.items())) + ")"
    return f"<{type(value).__module__}.{type(value).__qualname__}>"


def _code(code: types.CodeType, depth: int) -> str:
    # not the file, line numbers or qualified name: where code was written is not what it does
    return "code(" + ",".join((
        str(code.co_argcount), str(code.co_posonlyargcount), str(code.co_kwonlyargcount),
        str(code.co_flags), code.co_code.hex(), repr(code.co_names), repr(code.co_varnames),
        repr(code.co_freevars), repr(code.co_cellvars),
        _written(code.co_consts, depth + 1),
    )) + ")"
