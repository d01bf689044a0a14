"""The registry: ``codec(kind, Type, dump=, load=)`` and what it fills, the library's own
kinds that are imported by name when their bytes arrive, and ``Opaque``.

The registry is asked after the built-in kinds (plain data, NumPy, Arrow, tensors), both
when writing and when reading. It knows nothing of descriptors or frames.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from somatize.errors import BadCodec, Unreadable

from .layout import ARROW_KINDS, BUILTIN_KINDS, NDARRAY, NPSCALAR, PLAIN, TENSOR

T = TypeVar("T")

# The library's own codecs, imported by name when their bytes arrive first. Only these:
# somatize cannot guess which module of yours gives a kind of yours its meaning. A tensor
# in today's form is built in and needs no codec; "torch.Tensor" here reads the SMZT bytes
# that stores written before tensors were built in still hold.
OWN_KINDS = {TENSOR: "somatize.torch"}


@dataclass(frozen=True, slots=True)
class Entry:
    kind: str
    type: type
    dump: Callable[[Any], bytes | bytearray | memoryview]
    load: Callable[[bytes], Any]


class _Registry:
    """The registry at one moment: both of its maps, published together as one object (so
    that what one reader sees by kind and by type is one registry), never changed after."""

    __slots__ = ("by_kind", "by_type")

    def __init__(self, by_kind: dict[str, Entry], by_type: dict[type, Entry]) -> None:
        self.by_kind = by_kind
        self.by_type = by_type


# Reentrant: a judge (below) runs under it, and what it looks at may register a codec too.
_lock = threading.RLock()
# Replaced whole under the lock; a reader takes it once and never sees half a change.
_now = _Registry({}, {})
# Asked, while one is set, about every registration (``judge(entry, previous)``) and every
# forgetting (``judge(None, previous)``) before it is published, under the lock; it refuses
# by raising, and then nothing changed. A network-mode worker sets one while it opens what
# a client sent (:mod:`somatize.packing.kinds`): one tenant's import must not change how
# another's bytes are read. Readers never look at it: lookups cost what they did.
_judge: Callable[[Entry | None, Entry | None], None] | None = None


def codec(
    kind: str, type_: type, *, dump: Callable[[T], bytes | bytearray | memoryview], load: Callable[[bytes], T]
) -> None:
    """Say how to write a ``type_`` down (``dump``) and read it back (``load``), under ``kind``.

    Call it in the module that defines the type, so that whoever can build one can also
    write one down. Name the kind after the type (``"myproject.Reading"``): it is written
    beside the bytes and kept as long as they are. Registering a kind again replaces it,
    except in a worker process (``python -m somatize.worker``), whose tenants share its
    registry: there a kind registered again in another format raises ``BadCodec`` and
    the kind stays as it was (see docs/codecs.md).
    """
    if not isinstance(kind, str) or not kind:
        raise BadCodec(
            f"a codec's kind has to be a non-empty str named after its type, like "
            f'"myproject.Reading"; it was given a `{type(kind).__name__}`'
            + (" that is empty" if isinstance(kind, str) else "")
        )
    if kind in BUILTIN_KINDS:
        raise BadCodec(
            f"`{kind}` is one of somatize's built-in kinds, which are asked before the "
            f"registry: a codec under that name would change what bytes of that kind mean "
            f'rather than add a kind. Name yours after your type, like "myproject.Reading"'
        )
    if not isinstance(type_, type):
        raise BadCodec(
            f'codec("{kind}", ...) needs the class it writes down as its second argument; '
            f"it was given a `{type(type_).__name__}`"
        )
    if type_ is Opaque:
        raise BadCodec(
            f'codec("{kind}", Opaque, ...) would never be asked: an `Opaque` crosses through '
            f"the codec of the type it wraps, so register that type instead"
        )
    for name, fn in (("dump", dump), ("load", load)):
        if not callable(fn):
            raise BadCodec(
                f'codec("{kind}", {type_.__name__}, ...) needs `{name}` to be callable '
                f"(dump: one `{type_.__name__}` -> bytes, load: bytes -> one); "
                f"it was given a `{type(fn).__name__}`"
            )
    entry = Entry(kind, type_, dump, load)
    global _now
    with _lock:
        if _judge is not None:
            _judge(entry, _now.by_kind.get(kind))
        by_kind = dict(_now.by_kind)
        by_type = {t: c for t, c in _now.by_type.items() if c.kind != kind}
        by_kind[kind] = entry
        by_type[type_] = entry
        _now = _Registry(by_kind, by_type)


def codecs_registered() -> list[str]:
    """The kinds registered with ``codec(...)`` in this process, sorted (built-ins aside)."""
    return sorted(_now.by_kind)


def registered_now() -> object:
    """The registry as it stands, as a token: the very same object until a codec is
    registered or forgotten (each change makes a new one), so ``is`` against one kept tells
    whether the registry changed since, in one comparison: when it did not, every codec
    looked up in between (writing, reading) was this registry's. Nothing else about it is
    promised."""
    return _now


def registry() -> tuple[tuple[str, type, Callable[[Any], bytes | bytearray | memoryview], Callable[[bytes], Any]], ...]:
    """The registered codecs as ``(kind, type, dump, load)``, in registration order (for
    packing, which carries them to a network-mode worker, and which compares two of these
    item by item with ``is`` to tell whether the registry changed in between)."""
    return tuple((c.kind, c.type, c.dump, c.load) for c in _now.by_kind.values())


def forget(kind: str) -> None:
    """Drop a registered kind, so bytes of it are unreadable again (a test that registers
    its own kinds, a notebook that registered one by mistake). Unknown kinds are ignored."""
    global _now
    with _lock:
        if _judge is not None and kind in _now.by_kind:
            _judge(None, _now.by_kind[kind])
        _now = _Registry(
            {k: c for k, c in _now.by_kind.items() if k != kind},
            {t: c for t, c in _now.by_type.items() if c.kind != kind},
        )


def _judged_by(judge: Callable[[Entry | None, Entry | None], None] | None) -> Callable | None:
    """Set the judge of registrations (None: none); gives the one it replaces."""
    global _judge
    with _lock:
        before, _judge = _judge, judge
    return before


def _put_back(before: object) -> tuple[str, ...]:
    """Make every kind whose entry is not the one it was in ``before`` (a token from
    :func:`registered_now`) what it was there again: a kind registered since is forgotten,
    one replaced or forgotten since is as it was; kinds nobody touched stay as they are
    now. Gives the kinds put back. Not judged: it only ever returns to what was."""
    if not isinstance(before, _Registry):
        raise TypeError(f"_put_back takes what registered_now() gave, not a `{type(before).__name__}`")
    global _now
    with _lock:
        now = _now
        changed = {
            k for k in now.by_kind.keys() | before.by_kind.keys() if now.by_kind.get(k) is not before.by_kind.get(k)
        }
        if not changed:
            return ()
        by_kind = {k: c for k, c in now.by_kind.items() if k not in changed}
        by_kind.update((k, c) for k, c in before.by_kind.items() if k in changed)
        by_type = {t: c for t, c in now.by_type.items() if c.kind not in changed}
        for t, c in before.by_type.items():
            if t not in by_type and by_kind.get(c.kind) is c:
                by_type[t] = c
        _now = _Registry(by_kind, by_type)
    return tuple(sorted(changed))


def readable_kinds() -> list[str]:
    """Every kind this process can read: built-ins (Arrow's when pyarrow is installed,
    tensors when torch is), the registry, and the library's own kinds it would import by
    name on arrival. Sorted."""
    return readable_with(_now)


def registered_with(token: object) -> list[str]:
    """What :func:`codecs_registered` said when :func:`registered_now` gave ``token``."""
    if not isinstance(token, _Registry):
        raise TypeError(f"registered_with takes what registered_now() gave, not a `{type(token).__name__}`")
    return sorted(token.by_kind)


def readable_with(token: object) -> list[str]:
    """What :func:`readable_kinds` says with the registry as it was when
    :func:`registered_now` gave ``token``: the token and the kinds read at once, so a codec
    registered or forgotten by another thread in between cannot make them disagree."""
    kinds = {PLAIN, NDARRAY, NPSCALAR}
    if _installed("pyarrow"):
        kinds |= ARROW_KINDS
    kinds.update(registered_with(token))
    kinds.update(k for k in OWN_KINDS if k != TENSOR)
    if _installed("torch"):
        kinds.add(TENSOR)
    return sorted(kinds)


def _installed(name: str) -> bool:
    """Whether ``name`` imports here. What ``sys.modules`` holds says so first (``None`` there
    is Python's way to say "not importable"); otherwise the path is searched once a process:
    a search stats the file system, and every new channel's greeting asks."""
    if name in sys.modules:
        return sys.modules[name] is not None
    return _found_on_path(name)


@functools.cache
def _found_on_path(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def for_type(t: type) -> Entry | None:
    by_type = _now.by_type
    entry = by_type.get(t)
    if entry is None and by_type:
        for base in t.__mro__[1:]:
            entry = by_type.get(base)
            if entry is not None:
                break
    return entry


def for_kind(kind: str) -> Entry:
    entry = _now.by_kind.get(kind)
    if entry is not None:
        return entry
    module = OWN_KINDS.get(kind)
    if module is None:
        raise Unreadable(
            f"bytes of kind `{kind}` arrived and nothing in this process reads that kind: "
            f'import the module that calls `codec("{kind}", ...)` before reading it '
            f"(somatize only imports its own codecs by name)"
        )
    extra = module.rsplit(".", 1)[-1]
    try:
        importlib.import_module(module)
    except ImportError as exc:
        raise Unreadable(
            f"bytes of kind `{kind}` arrived, and reading them needs `{module}`, which could "
            f"not be imported here ({type(exc).__name__}: {exc}): pip install somatize[{extra}]"
        ) from exc
    except Exception as exc:
        raise Unreadable(
            f"bytes of kind `{kind}` arrived, and importing `{module}` to read them raised {type(exc).__name__}"
        ) from exc
    entry = _now.by_kind.get(kind)
    if entry is None:
        raise Unreadable(
            f"bytes of kind `{kind}` arrived and importing `{module}` did not register a "
            f"codec for it; this somatize is broken or mismatched: reinstall somatize[{extra}]"
        )
    return entry


# -- Opaque ------------------------------------------------------------------------------


class Opaque:
    """Something that exists in this process only: a tensor with its graph, a tokenizer, a
    connection. It crosses (to a wire, to a store) only through a codec registered for the
    type of ``value``; reading it back gives an ``Opaque`` around what that codec loads."""

    __slots__ = ("value",)
    __hash__ = None  # type: ignore[assignment]

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:  # the type only: contents never appear in a repr or message
        return f"Opaque(<{type(self.value).__qualname__}>)"

    def __eq__(self, other: object) -> Any:
        if not isinstance(other, Opaque):
            return NotImplemented
        return self.value == other.value
