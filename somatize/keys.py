"""Content addresses for the cache.

A value entering a graph is named by the sha256 of its written form; a node's output is
named by the sha256 of the node's identity and the name of its input. So every key is
known before anything runs, the same input recalls in another process or on another
machine, and the chain of keys does not depend on where a node ran.

A node's identity (:attr:`somatize.graph.Step.identity`) is its name, its class, its plain
constructor arguments and its code (:mod:`somatize.code_identity`), or in place of the code
the ``version`` given to ``.cached()``. Only the client computes keys: a worker is sent
them with the work, and what it makes is kept under those, so a worker that holds other
code (or none: a class cloudpickle rebuilt) never names a value.

Nothing here touches a store.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from .codec import written_parts

PREFIX = "sha256:"


def value_key(value: object) -> str:
    """The key of a value given from outside: the hash of its written form.

    Raises :class:`~somatize.errors.Unwritable` (or ``BadCodec``) when it cannot be
    written down, in which case nothing downstream of it can be cached.
    """
    digest = hashlib.sha256()
    for part in written_parts(value):
        digest.update(part)
    return PREFIX + digest.hexdigest()


def output_key(identity: str, input_key: str) -> str:
    """The key of what a node with ``identity`` makes from the value keyed ``input_key``."""
    return _combine("out", (identity, input_key))


def tuple_key(keys: Iterable[str]) -> str:
    """The key of the tuple that parallel branches produce, from the branches' keys."""
    return _combine("tuple", keys)


def _combine(tag: str, parts: Iterable[str]) -> str:
    digest = hashlib.sha256(tag.encode())
    for part in parts:
        encoded = part.encode()
        # length-prefixed, so ("ab", "c") and ("a", "bc") never meet
        digest.update(len(encoded).to_bytes(8, "little"))
        digest.update(encoded)
    return PREFIX + digest.hexdigest()


def cache_name(key: str) -> str:
    """Where a kept value lives in a store."""
    return "cache/" + key
