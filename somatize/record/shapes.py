"""What a record or a blob read back must look like, checked in one place before it is used.

Whoever may write a store's folder may write any entry there (the runbook shares a study's
store with a group), so nothing read back is trusted: not a blob's size, not its lines, not
a record's numbers. Every reader of the record (``runs``, ``forwards``, ``curve``, ``facts``,
``nodes``, ``fleet``, ``machines``, ``trials``, ``best``, ``scores``), ``--show`` and the view
read through here:

- :func:`read_blob`: an entry's blob, its length bounded by the file's length (``fstat``)
  before a byte is read, so a sparse file counts by its length, not by what it holds on disk.
- :func:`facts_in`: a forward's blob as facts. Each line must be a flat JSON object of text
  naming its ``fact``; that shape is matched on the raw bytes before ``json.loads`` sees them,
  so nothing nests and nothing but text comes back. A line that fails is left out.
- :func:`plain_json`: JSON whose nesting is measured on the raw text (strings taken out,
  bracket pairs removed a level at a time, at C speed) before ``json.loads`` runs, so the
  parser never recurses past the bound; numbers are finite unless the caller allows more.
- :func:`whole` and :func:`number`: text that must be a number, read strictly (ASCII digits
  only: ``"²".isdigit()`` is true in Python and ``int("١٢")`` is 12).
- :func:`left_out`: the one line saying an entry was left out and why, once per entry per
  process (``folders.tell_once``, which stops telling after 10,000 names).

A read that fails its shape is left out with that line, and never raises to a reader, a
runner, ``--show`` or the view. What a reader keeps is a fixed multiple of what it returns:
a blob is at most :data:`BLOB_MOST` bytes, read once, and only the lines that pass are copied.

This module knows what a fact and a plain JSON value look like; what they mean is the
readers'.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any

from ..errors import Missing, StoreError
from ..facts import Fact
from ..folders import tell_once
from ..store import FolderStore, Store
from ..store_file import read_blob as _read_blob
from ..store_file import read_head

#: The longest entry file a forward's blob is read from, header and record included (bytes,
#: by the file's length). A recorder's forward is a few hundred bytes a node; one longer than
#: this was put there by someone else, and is left out unread.
BLOB_MOST = 64 << 20
#: The most text a forward's or a machine's record holds, keys and values together; a
#: recorder's is a few hundred characters.
RECORD_MOST = 1 << 20


class Malformed(ValueError):
    """What was read back does not have the shape its kind has; the text says how not."""


# -- reading an entry ---------------------------------------------------------------------------


def read_blob(store: Store, name: str, most: int = BLOB_MOST) -> bytearray | bytes | None:
    """The blob of ``name``, read only if its entry's file is at most ``most`` bytes long.

    On a ``FolderStore`` the file is opened through the store (never through a link, as
    ``fetch`` opens it), its length is taken with ``fstat`` and judged before anything is
    read. Any other store, or a ``FolderStore`` whose ``fetch`` is its own (one that counts
    or wraps it), is asked with ``fetch`` and judged after it answers. ``Missing`` when
    nothing is there (as ``fetch``), ``StoreError`` when the entry cannot be read,
    ``Malformed`` when it is too long."""
    if not isinstance(store, FolderStore) or type(store).fetch is not FolderStore.fetch:
        blob = store.fetch(name)
        if blob is not None and len(blob) > most:
            raise Malformed(f"its blob is {len(blob)} bytes long, more than the {most} a reader reads")
        return blob
    opened, path = store._open(name)  # the store's own open: relative to its root, no link followed
    with opened as file:
        size = os.fstat(file.fileno()).st_size
        if size > most:
            raise Malformed(
                f"its file is {size} bytes long, more than the {most} a reader reads "
                f"(a sparse file counts by its length)"
            )
        _, room, blob_len = read_head(file, path)
        return _read_blob(file, path, room, blob_len)


def read_facts(store: Store, name: str) -> list[Fact]:
    """The facts of the forward entry ``name``: its blob, bounded, each line checked.

    ``Missing`` when nothing is stored there. An entry that cannot be read, is too long or
    holds lines that are not facts gives what it can (nothing, or its good lines), with one
    line saying so."""
    try:
        blob = read_blob(store, name)
    except Missing:
        raise
    except (Malformed, StoreError) as exc:
        left_out(store, name, exc)
        return []
    if blob is None:
        return []
    found, bad = facts_in(blob)
    if bad:
        _tell(
            store,
            name,
            f"somatize record: {bad} line{'s' if bad > 1 else ''} of {name} "
            f"{'are' if bad > 1 else 'is'} left out: not a fact (a flat JSON object of "
            f"text naming its 'fact'); its other {len(found)} are read. {_WHO}",
        )
    return found


# -- a forward's blob: one flat JSON object of text per line --------------------------------------

# A JSON string, unrolled (a run of plain characters, then an escape and another run...): one
# repetition of a character class per run, so the match is linear and holds no state per byte.
_STRING = rb'"[^"\\\x00-\x1f]*(?:\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4})[^"\\\x00-\x1f]*)*"'
_SPACE = rb"[ \t\r]*"
_PAIR = _SPACE + _STRING + _SPACE + rb":" + _SPACE + _STRING + _SPACE
_FACT_LINE = re.compile(_SPACE + rb"\{(?:" + _PAIR + rb"(?:," + _PAIR + rb")*|" + _SPACE + rb")\}" + _SPACE)


def facts_in(blob: bytes | bytearray) -> tuple[list[Fact], int]:
    """The facts a forward's blob holds, in order, and how many of its lines were not one.

    Lines are split on ``\\n`` only (JSON escapes it inside strings, but not U+2028 and its
    kin). Each is matched against the shape of a fact on the raw bytes, where it lies in the
    blob (no copy), and only a line that matches is parsed: it can only be an object of
    strings, so the parser never recurses, and a huge line of anything else costs no memory."""
    out: list[Fact] = []
    bad = 0
    start, end = 0, len(blob)
    while start < end:
        stop = blob.find(b"\n", start)
        if stop < 0:
            stop = end
        if stop > start:
            f = _fact(blob, start, stop)
            if f is None:
                bad += 1
            else:
                out.append(f)
        start = stop + 1
    return out, bad


def _fact(blob: bytes | bytearray, start: int, stop: int) -> Fact | None:
    if _FACT_LINE.fullmatch(blob, start, stop) is None:
        return None
    try:
        f = json.loads(blob[start:stop])
    except ValueError:  # not UTF-8 (UnicodeDecodeError is one), or an escape JSON refuses
        return None
    return f if isinstance(f, dict) and f.get("fact") else None


# -- a JSON value, its depth bounded before it is parsed ----------------------------------------

_TEXT = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_ONE_KIND = str.maketrans("{}", "[]")


def nesting(text: str, most: int) -> int:
    """How deep ``text``'s brackets nest (0: none), if at most ``most``; ``Malformed`` when
    deeper, or when they do not pair. Strings are taken out first, as a parser reads them;
    then each round removes the innermost pairs, at most ``most`` rounds, each a C-speed pass
    over the brackets alone."""
    # one kind of bracket: a '[' closed by '}' counts as a pair, which no parser takes past it
    rest = _NOT_BRACKET.sub("", _TEXT.sub("", text)).translate(_ONE_KIND)
    depth = 0
    while rest:
        shorter = rest.replace("[]", "")
        if len(shorter) == len(rest):
            raise Malformed("is not JSON (its brackets do not pair)")
        if depth == most:
            raise Malformed(f"nests more than {most} deep")
        rest, depth = shorter, depth + 1
    return depth


def _refuse_constant(name: str) -> Any:
    raise Malformed(f"it holds {name}, which is not a finite number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise Malformed(f"it holds {text[:40]}, which is too large to be a finite number")
    return value


def plain_json(text: str, most: int, *, finite: bool = True, what: str = "it") -> Any:
    """``text`` parsed as JSON, if it nests at most ``most`` deep (and, with ``finite``, holds
    no NaN, Infinity or number too large for a float); ``Malformed`` saying why otherwise.
    The depth is measured before the parser runs (:func:`nesting`), so it never recurses past
    ``most``; the caller bounds ``text``'s length."""
    try:
        nesting(text, most)
    except Malformed as exc:
        raise Malformed(f"{what} {exc}") from None
    hooks: dict[str, Any] = {"parse_constant": _refuse_constant, "parse_float": _finite_float} if finite else {}
    try:
        return json.loads(text, **hooks)
    except Malformed as exc:
        raise Malformed(f"{what} is not plain JSON: {exc}") from None
    except ValueError as exc:  # (a number of more than 4,300 digits is one too)
        raise Malformed(f"{what} is not JSON ({exc})") from None


# -- text that must be a number -----------------------------------------------------------------

_WHOLE = re.compile(r"[0-9]{1,30}")
# what repr() writes for a float or int, and the names of the non-finite ones float() reads
_NUMBER = re.compile(r"[+-]?(?:(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|inf|infinity|nan)", re.IGNORECASE)
_NUMBER_MOST = 400


def whole(value: str | None) -> int | None:
    """A whole number from 0 written in ASCII digits (at most 30), or ``None``."""
    if not isinstance(value, str) or not _WHOLE.fullmatch(value):
        return None
    return int(value)


def number(value: str | None) -> float | None:
    """A number as a recorder writes one (``repr`` of an int or float, ``nan`` and ``inf``
    included: a diverged loss is one), or ``None``. No space, no ``_``, no digits but ASCII."""
    if not isinstance(value, str) or len(value) > _NUMBER_MOST or not _NUMBER.fullmatch(value):
        return None
    return float(value)


def maybe_float(value: str) -> float | str:
    """A record's value as a float when it reads as one (strictly: :func:`number`), else as text."""
    found = number(value)
    return value if found is None else found


# -- a record of text ---------------------------------------------------------------------------


def small_record(record: dict[str, str], most: int = RECORD_MOST) -> dict[str, str]:
    """``record`` if its keys and values hold at most ``most`` characters in all (a store
    checks already that it is an object of text); ``Malformed`` otherwise."""
    size = 0
    for key, value in record.items():
        size += len(key) + len(value)
        if size > most:
            raise Malformed(f"its record holds more than {most} characters; a recorder's is a few hundred")
    return record


_WHO = "It was not written by a recorder of this version (someone who may write the store's folder wrote it)."


def left_out(store: Store, name: str, why: object) -> None:
    """Say once that the entry ``name`` of the record is left out, and why."""
    _tell(store, name, f"somatize record: {name} is left out: {why}. {_WHO}")


def _tell(store: Store, name: str, line: str) -> None:
    where = getattr(store, "path", None)
    tell_once(f"{where}/{name}" if where is not None else f"{id(store)}:{name}", line)
