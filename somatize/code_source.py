"""Finding the source of a node's code, and whether it is the source of the code that runs.

:mod:`somatize.code_identity` digests a class statement or a function's ``def`` by its text.
This module finds that text in the lines of a file or a notebook cell, and trusts it only
when compiling those very lines gives the code objects the process runs: a ``.pyc`` written
within the second of an edit that kept the file's size (Python then loads the old
bytecode), or a file edited after the import, reads as source that does not run, and is not
taken for it. It also normalises a text to its tokens, so layout does not count.

Nothing here touches a store or the wire.
"""

from __future__ import annotations
import __future__

import ast
import dis
import hashlib
import io
import linecache
import sys
import tokenize
import types
from collections.abc import Iterable, Iterator
from typing import Any

__all__ = ["class_source", "compiled_from", "function_source", "lines_now", "loaded_globals", "normalised"]

_WORDS = {tokenize.NAME, tokenize.ERRORTOKEN}
_TOKENS_SKIPPED = {tokenize.COMMENT, tokenize.NL, tokenize.ENCODING, tokenize.ENDMARKER}
# Python 3.12 splits an f-string into parts (3.14 a t-string); 3.11 gives one STRING token.
# The whole literal, as written, is one token here on every version.
_STRING_STARTS = {"FSTRING_START", "TSTRING_START"}
_STRING_ENDS = {"FSTRING_END", "TSTRING_END"}
# The flags a ``from __future__`` import sets on the code it compiles: a notebook's cell is
# compiled with those of earlier cells, which its own text does not show.
_FUTURE = 0
for _name in __future__.all_feature_names:
    _FUTURE |= getattr(__future__, _name).compiler_flag
_HELD = 16  # files whose parse and compilation are kept, for classes read one after another


def lines_now(filename: str, module_name: str) -> list[str]:
    """The lines of ``filename`` as they are now: a file on disk, or what linecache holds for
    a notebook cell (IPython puts every cell there)."""
    linecache.checkcache(filename)  # a file that changed since it was cached is read again
    module = sys.modules.get(module_name)
    # the module's loader may read the file (a zip, say), only when it is the module's own:
    # linecache would otherwise give the module's source under another file's name
    ours = getattr(module, "__file__", None) == filename
    return linecache.getlines(filename, getattr(module, "__dict__", None) if ours else None)


_GLOBAL_OPS = frozenset(("LOAD_GLOBAL", "STORE_GLOBAL", "DELETE_GLOBAL", "LOAD_NAME"))


def loaded_globals(code: types.CodeType) -> set[str]:
    """Every global ``code`` or a code object nested in it looks up (not the names of
    attributes or imports, which share ``co_names``), as cloudpickle finds the globals it
    sends."""
    names = {op.argval for op in dis.get_instructions(code) if op.opname in _GLOBAL_OPS}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= loaded_globals(const)
    return names


# -- what a file's lines hold ----------------------------------------------------------------


class _Statement:
    """A class statement in a file: where it starts (its first decorator) and ends, what it
    is called, and the name and first line of each function its body makes."""

    __slots__ = ("first", "last", "qualname", "defs")

    def __init__(self, node: ast.ClassDef, qualname: str) -> None:
        self.first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        self.last = node.end_lineno or node.lineno
        self.qualname = qualname
        self.defs = {(d.name, min([d.lineno, *(x.lineno for x in d.decorator_list)])) for d in _defs(node)}


class _Index:
    """The class statements of a file's lines by name, and the span of every function (a
    ``def`` or a lambda) by its qualified name and the first line its code object says."""

    __slots__ = ("lines", "classes", "functions", "compiled")

    def __init__(self, lines: list[str]) -> None:
        self.lines = lines
        self.classes: dict[str, list[_Statement]] = {}
        self.functions: dict[tuple[str, int], list[tuple[int, int]]] = {}
        self.compiled: dict[int, dict[tuple[str, int], list[types.CodeType]] | None] = {}
        try:
            tree = ast.parse("".join(lines))
        except (SyntaxError, ValueError):
            return
        self._walk(tree, "")

    def _walk(self, node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                qualname = prefix + child.name
                self.classes.setdefault(child.name, []).append(_Statement(child, qualname))
                self._walk(child, qualname + ".")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                name = "<lambda>" if isinstance(child, ast.Lambda) else child.name
                decorators = getattr(child, "decorator_list", [])
                first = min([child.lineno, *(d.lineno for d in decorators)])
                span = (first, child.end_lineno or child.lineno)
                self.functions.setdefault((prefix + name, first), []).append(span)
                for part in (*decorators, child.args):  # a lambda in a default is the enclosing scope's
                    self._walk(part, prefix)
                inner = ast.Module(
                    body=child.body if isinstance(child.body, list) else [ast.Expr(child.body)], type_ignores=[]
                )
                self._walk(inner, prefix + name + ".<locals>.")
            else:
                self._walk(child, prefix)

    def codes(self, filename: str, flags: int) -> dict[tuple[str, int], list[types.CodeType]] | None:
        """Every code object compiling these lines makes, by qualified name and first line;
        None when they do not compile."""
        if flags not in self.compiled:
            self.compiled[flags] = _compile(self.lines, filename, flags)
        return self.compiled[flags]


def _defs(node: ast.AST) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    """The functions a class body makes, under an ``if`` or a ``try`` too, not those of a
    nested class or function."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield child
        elif not isinstance(child, (ast.ClassDef, ast.Lambda, ast.expr)):
            yield from _defs(child)


def _compile(lines: list[str], filename: str, flags: int) -> dict[tuple[str, int], list[types.CodeType]] | None:
    text = "".join(lines)
    for extra in (0, ast.PyCF_ALLOW_TOP_LEVEL_AWAIT):  # a notebook's cell may await at its top
        try:
            module = compile(text, filename, "exec", flags=flags | extra, dont_inherit=True)
            break
        except (SyntaxError, ValueError):
            continue
    else:
        return None
    found: dict[tuple[str, int], list[types.CodeType]] = {}
    todo = [module]
    while todo:
        code = todo.pop()
        found.setdefault((code.co_qualname, code.co_firstlineno), []).append(code)
        todo.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    return found


_indexes: dict[str, _Index] = {}


def _index(filename: str, lines: list[str]) -> _Index:
    held = _indexes.get(filename)
    if held is not None and held.lines is lines:
        return held
    made = _Index(lines)
    if len(_indexes) >= _HELD:
        _indexes.clear()
    _indexes[filename] = made
    return made


# -- whether the lines are the source of what runs ------------------------------------------


def compiled_from(function: types.FunctionType, filename: str, lines: list[str]) -> bool:
    """Whether compiling ``lines`` makes ``function``'s code: the same instructions,
    constants (nested code compared the same way), names and arguments. Where it was
    written (its file, its line table) is not compared; its qualified name and first line
    find it."""
    code = function.__code__
    codes = _index(filename, lines).codes(filename, code.co_flags & _FUTURE)
    if codes is None:
        return False
    return any(_same(made, code) for made in codes.get((code.co_qualname, code.co_firstlineno), ()))


def _same(a: types.CodeType, b: types.CodeType) -> bool:
    if (
        a.co_code,
        a.co_names,
        a.co_varnames,
        a.co_freevars,
        a.co_cellvars,
        a.co_flags,
        a.co_argcount,
        a.co_posonlyargcount,
        a.co_kwonlyargcount,
        a.co_name,
    ) != (
        b.co_code,
        b.co_names,
        b.co_varnames,
        b.co_freevars,
        b.co_cellvars,
        b.co_flags,
        b.co_argcount,
        b.co_posonlyargcount,
        b.co_kwonlyargcount,
        b.co_name,
    ):
        return False
    return len(a.co_consts) == len(b.co_consts) and all(
        _same_constant(x, y) for x, y in zip(a.co_consts, b.co_consts, strict=False)
    )


def _same_constant(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False  # 1, 1.0 and True are equal, and not the same constant
    if isinstance(a, types.CodeType):
        return _same(a, b)
    if isinstance(a, tuple):
        return len(a) == len(b) and all(_same_constant(x, y) for x, y in zip(a, b, strict=False))
    if isinstance(a, float) or isinstance(a, complex):
        return repr(a) == repr(b)  # -0.0 == 0.0, and nan != nan
    return bool(a == b)


# -- the text of a class statement, or of a function -----------------------------------------


def class_source(
    klass: type, written: Iterable[types.FunctionType], files: Iterable[str], lines_of: Any
) -> tuple[list[str] | None, bool]:
    """The lines of ``klass``'s class statement, decorators included, and whether a file was
    found holding it that does not compile to the code that runs (stale). ``None`` for the
    lines when no file holds exactly one statement that made it, or it is stale.

    ``written`` are the functions written in its body; ``lines_of(filename)`` reads a file."""
    written = list(written)
    stale = False
    for filename in files:
        lines = lines_of(filename)
        if not lines:
            continue
        statements = _index(filename, lines).classes.get(klass.__name__, [])
        anchors = [f for f in written if f.__code__.co_filename == filename]
        if anchors:
            fits = [s for s in statements if all(_holds(s, f) for f in anchors)]
        elif "__firstlineno__" in vars(klass):  # Python 3.13+, a class statement's own
            fits = [s for s in statements if s.first == vars(klass)["__firstlineno__"]]
        else:
            fits = [s for s in statements if s.qualname == klass.__qualname__]
        if len(fits) == 1:
            if all(compiled_from(f, filename, lines) for f in anchors):
                return lines[fits[0].first - 1 : fits[0].last], False
            stale = True
    return None, stale


def _holds(statement: _Statement, function: types.FunctionType) -> bool:
    """Whether ``function`` was made by this statement: a ``def`` of its name starts on the
    very line its code object says (so a file edited since, lines moved, does not fit)."""
    line = function.__code__.co_firstlineno
    if function.__name__ == "<lambda>":
        return statement.first <= line <= statement.last
    return (function.__name__, line) in statement.defs


def function_source(function: types.FunctionType, lines: list[str]) -> tuple[list[str] | None, bool]:
    """The lines of the ``def`` (or lambda) that made ``function``, decorators included, and
    whether the file holds one that does not compile to the code that runs (stale)."""
    code = function.__code__
    if not lines:
        return None, False
    spans = _index(code.co_filename, lines).functions.get((code.co_qualname, code.co_firstlineno), [])
    if len(spans) != 1:
        return None, bool(spans)
    if not compiled_from(function, code.co_filename, lines):
        return None, True
    first, last = spans[0]
    return lines[first - 1 : last], False


# -- normalising -------------------------------------------------------------------------


def normalised(lines: list[str]) -> bytes:
    """The digest of a statement's tokens: what Python reads, not how it is laid out.

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
        encoded = part.encode("utf-8", "surrogatepass")
        # length-prefixed, so two sequences of parts never give the same stream
        digest.update(len(encoded).to_bytes(8, "little"))
        digest.update(encoded)
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
    # a nested statement starts deeper than its first line, and ends where the tokenizer
    # climbs back out: neither is its own
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
