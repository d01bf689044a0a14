"""The checks of one field of a message: a whole number in a range, a flag, a line of text,
one of a few words, a digest, a class to import; and `Bad`, what each raises, naming the
field, what it has to be and a short picture of what it was (`shown`). The checks of whole
messages (:mod:`somatize.wire.checks`) are built of these.
"""

from __future__ import annotations

from typing import Any

from . import limits


class Bad(Exception):
    """A check failed: ``why`` is the sentence; ``kind`` what ``encode`` raises with it."""

    def __init__(self, why: str, kind: type[Exception] = ValueError) -> None:
        super().__init__(why)
        self.why = why
        self.kind = kind


def a_type(x: Any) -> str:
    return f"a `{type(x).__name__}`"


def shown(x: Any) -> str:
    """A short, safe picture of a header item for a sentence (never a long string)."""
    if isinstance(x, str):
        return repr(x) if len(x) <= 40 else f"a str of {len(x):,} characters"
    if type(x) is int:
        return str(x) if abs(x) < 10**12 else "a very large number"
    return a_type(x)


def integer(x: Any, where: str, lo: int, hi: int) -> int:
    if not isinstance(x, int) or isinstance(x, bool):
        raise Bad(f"`{where}` has to be a whole number, and it is {a_type(x)}", TypeError)
    if not lo <= x <= hi:
        raise Bad(f"`{where}` has to be from {lo} to {hi}, and it is {shown(x)}")
    return x


def ref(x: Any, where: str) -> None:
    integer(x, where, 0, limits.MAX_REF)


def flag(x: Any, where: str) -> None:
    if not isinstance(x, bool):
        raise Bad(f"`{where}` has to be True or False, and it is {a_type(x)}", TypeError)


def printable(x: str, where: str) -> None:
    """A host's name is one line of text: no newline, escape or NUL to forge a log line with."""
    if not x.isprintable():
        raise Bad(
            f"`{where}` holds a character that is not printable (a newline, an escape, a NUL): "
            f"a host's name is one line of text"
        )


def text(x: Any, where: str, limit: int, *, empty: bool = False) -> str:
    if not isinstance(x, str):
        raise Bad(f"`{where}` has to be a str, and it is {a_type(x)}", TypeError)
    if len(x) > limit:
        raise Bad(f"`{where}` is {len(x):,} characters long, over the limit of {limit:,}")
    if not x and not empty:
        raise Bad(f"`{where}` is empty, and it has to name something")
    if not x.isascii():
        try:
            x.encode("utf-8")
        except UnicodeEncodeError:
            raise Bad(f"`{where}` holds a lone surrogate, which is not valid Unicode") from None
    return x


def choice(x: Any, where: str, options: tuple[str, ...]) -> None:
    if not isinstance(x, str) or x not in options:
        words = ", ".join(f'"{o}"' for o in options)
        raise Bad(f"`{where}` is one of {words}, and it is {shown(x)}")


def digest(x: Any, where: str) -> None:
    text(x, where, limits.MAX_NAME)
    if not limits.DIGEST.fullmatch(x):
        raise Bad(f'`{where}` has to be "sha256:" and 64 lowercase hex digits, and it is {shown(x)}')


def qualname(x: Any, where: str) -> None:
    text(x, where, limits.MAX_NAME)
    module, colon, qualname = x.partition(":")
    if not (
        colon
        and all(part.isidentifier() for part in module.split("."))
        and all(part.isidentifier() for part in qualname.split("."))
    ):
        raise Bad(f'`{where}` names a class to import, like "package.module:Class", and it is {shown(x)}')
