"""A header's items as both readers take them: the long way (:mod:`somatize.wire.reading`)
and the short one (:mod:`somatize.wire.short`) name an item's MessagePack type in their
sentences, read ``[[index, value], ...]`` pairs (a Work's keys and placement, a Done's
produced values) the same way, and build a header's maps the same way (``text_map``).
"""

from __future__ import annotations

from typing import Any

from .checks import Bad, shown


def msgpack_type(x: Any) -> str:
    """The MessagePack name of a header item's type, for a sentence."""
    return {bytes: "bin", list: "array", dict: "map", str: "str", type(None): "nil"}.get(type(x), type(x).__name__)


def text_map(pairs: list[tuple[Any, Any]]) -> dict[str, Any]:
    """A header map from its pairs as MessagePack wrote them (``unpackb``'s
    ``object_pairs_hook``): keyed by text, each key once (``unpackb`` alone would keep the
    last of a key given twice)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if type(key) is not str:
            raise Bad(f"a map in the header has a key that is `{msgpack_type(key)}`; the wire's maps are keyed by text")
        if key in out:
            raise Bad(f"a map in the header holds the key {shown(key)} twice")
        out[key] = value
    return out


def index_pairs(x: Any, where: str) -> dict[int, Any]:
    """``[[index, value], ...]`` as a dict, refusing anything else."""
    if type(x) is not list:
        raise Bad(f"`{where}` has to be an array of [index, value] pairs, and it is a `{msgpack_type(x)}`")
    out: dict[int, Any] = {}
    for pair in x:
        if type(pair) is not list or len(pair) != 2 or type(pair[0]) is not int:
            raise Bad(f"`{where}` has to be an array of [index, value] pairs, and one entry is not")
        if pair[0] in out:
            raise Bad(f"`{where}` gives node {pair[0]} twice")
        out[pair[0]] = pair[1]
    return out
