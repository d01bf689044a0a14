"""Whether two codecs of one kind write the same format, as a network-mode worker runs them.

A worker's codec registry is one per process, so it reads one format per kind while it
runs (:mod:`somatize.packing`): an artifact carrying a codec for a kind an earlier artifact
brought is held only when the two write the same bytes for the same value. Two pickles of
one codec are not the same bytes when they come from two processes (a class pickled by
value gets a new identity in each), so the codecs themselves are written down
(:func:`format_of`) after they were unpickled here, by what decides what they do on this
worker:

- a function by its code (every nested code object's too), its defaults, the values its
  closure holds, and every global its code (or nested code) names, each written the same
  way; not by its name, file or lines;
- a class pickled by value by its bases and everything its body holds; a function or class
  this worker imports by name, and a module it has imported, by that name (both codecs run
  here, against the same installation);
- a bound method by its function and its instance, a ``functools.partial`` by its
  function and arguments, any other object by its class and its attributes;
- plain values (numbers, text, bytes, and containers of them) by their value.

Anything else (an object with no attributes to read, a module this worker did not import
by name, something nested past ``DEPTH``) cannot be written down, and then the codec's
pickled bytes decide: equal bytes are the same codec, any others are not. That refuses
some codecs that are the same, and never holds two that differ: a refusal says what to do,
a codec taken for the same one would read values wrong without a word.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import types
from typing import Any

from ..code_source import loaded_globals as _names

__all__ = ["DEPTH", "format_of"]

#: How deep a codec is followed (through globals, closures, attributes) before it is
#: judged by its bytes.
DEPTH = 24
_PLAIN = (bool, int, float, complex, str, bytes, type(None), type(Ellipsis))
_HEAPTYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: made by a class statement (or by a C module at run time)
# Attributes of a class that say where it was written, not what it does.
_WHERE = frozenset(
    (
        "__module__",
        "__qualname__",
        "__dict__",
        "__weakref__",
        "__firstlineno__",
        "__static_attributes__",
        "__slotnames__",
        "__doc__",
    )
)


class _Opaque(Exception):
    """Something in the codec could not be written down."""


def format_of(blob: bytes | bytearray | None, type_: type, dump: Any, load: Any) -> str:
    """A digest that is equal for two codecs only when they write the same format on this
    worker (see the module's text); ``blob`` is the codec's pickled bytes, which decide when
    a part of it cannot be written down. A codec registered here (the worker's own code, a
    module an artifact imported) has no bytes: one of those that cannot be written down
    gets a digest of its own, equal to no other (the very same objects are told apart
    before a format is asked)."""
    try:
        text = _Writer().write((getattr(type_, "__qualname__", "?"), dump, load), 0)
    except Exception:  # noqa: BLE001 - _Opaque, a recursion too deep, an object that will not say
        text = "bytes:" + hashlib.sha256(blob).hexdigest() if blob is not None else "unique:" + os.urandom(16).hex()
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


class _Writer:
    def __init__(self) -> None:
        self._seen: dict[int, int] = {}  # id -> the order it was first written in: a cycle names it

    def write(self, value: Any, depth: int) -> str:
        if depth > DEPTH:
            raise _Opaque
        if type(value) in _PLAIN:  # a subclass of one (its methods may differ) is an object
            return f"{type(value).__name__}:{value!r}"
        if type(value) in (tuple, list):
            return f"{type(value).__name__}(" + ",".join(self.write(v, depth + 1) for v in value) + ")"
        if type(value) in (set, frozenset):
            return f"{type(value).__name__}(" + ",".join(sorted(self.write(v, depth + 1) for v in value)) + ")"
        if type(value) is dict:
            items = sorted(f"{self.write(k, depth + 1)}:{self.write(v, depth + 1)}" for k, v in value.items())
            return "dict(" + ",".join(items) + ")"
        if type(value) is types.MappingProxyType:
            return "mapping" + self.write(dict(value), depth + 1)
        if isinstance(value, (types.MemberDescriptorType, types.GetSetDescriptorType)):
            return f"descriptor:{value.__name__}"  # a slot of the class, or its C-level attribute
        if isinstance(value, types.ModuleType):
            if sys.modules.get(value.__name__) is value:
                return f"module:{value.__name__}"
            raise _Opaque  # a module made for this artifact (sent by value): its bytes decide
        named = _imported_name(value)
        if named is not None:
            return named
        key = id(value)
        if key in self._seen:
            return f"again:{self._seen[key]}"
        self._seen[key] = len(self._seen)
        if isinstance(value, types.FunctionType):
            return self._function(value, depth)
        if isinstance(value, types.CodeType):
            return self._code(value, depth)
        if isinstance(value, types.MethodType):
            return f"method({self.write(value.__func__, depth + 1)},{self.write(value.__self__, depth + 1)})"
        if isinstance(value, functools.partial):
            return (
                f"partial({self.write(value.func, depth + 1)},{self.write(value.args, depth + 1)},"
                f"{self.write(value.keywords, depth + 1)})"
            )
        if isinstance(value, (staticmethod, classmethod)):
            return f"{type(value).__name__}({self.write(value.__func__, depth + 1)})"
        if isinstance(value, property):
            return f"property({self.write((value.fget, value.fset, value.fdel), depth + 1)})"
        if isinstance(value, type):
            return self._class(value, depth)
        if isinstance(
            value,
            (
                types.BuiltinFunctionType,
                types.MethodWrapperType,
                types.WrapperDescriptorType,
                types.MethodDescriptorType,
                types.ClassMethodDescriptorType,
            ),
        ):
            raise _Opaque  # bound to an object, or not where its name says: its bytes decide
        return self._instance(value, depth)

    def _function(self, function: types.FunctionType, depth: int) -> str:
        code = function.__code__
        cells = []
        for cell in function.__closure__ or ():
            try:
                cells.append(self.write(cell.cell_contents, depth + 1))
            except ValueError:  # a cell not filled yet
                cells.append("empty")
        names = function.__globals__
        # a name its globals lack yet (a module still being imported defines it below) is
        # written as missing, never left out: two codecs alike but for it are not the same
        used = sorted(
            f"{name}={self.write(names[name], depth + 1)}" if name in names else f"{name}=?"
            for name in sorted(_names(code))
        )
        return (
            f"function({self._code(code, depth + 1)},{self.write(function.__defaults__, depth + 1)},"
            f"{self.write(function.__kwdefaults__, depth + 1)},cells({','.join(cells)}),"
            f"globals({','.join(used)}))"
        )

    def _code(self, code: types.CodeType, depth: int) -> str:
        consts = ",".join(
            self._code(c, depth + 1) if isinstance(c, types.CodeType) else self.write(c, depth + 1)
            for c in code.co_consts
        )
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
                    consts,
                )
            )
            + ")"
        )

    def _class(self, cls: type, depth: int) -> str:
        bases = ",".join(self.write(base, depth + 1) for base in cls.__bases__)
        body = sorted(
            f"{name}={self.write(value, depth + 1)}" for name, value in vars(cls).items() if name not in _WHERE
        )
        return f"class({cls.__qualname__},bases({bases}),{','.join(body)})"

    def _instance(self, value: Any, depth: int) -> str:
        held: dict[str, Any] = {}
        for klass in type(value).__mro__:
            slots = vars(klass).get("__slots__", ())
            for slot in (slots,) if isinstance(slots, str) else slots:
                if slot not in ("__dict__", "__weakref__") and hasattr(value, slot):
                    held[slot] = getattr(value, slot)
        attributes = getattr(value, "__dict__", None)
        if type(attributes) is dict:
            held.update(attributes)
        elif attributes is not None:
            raise _Opaque
        if not _plain_class(type(value)):
            raise _Opaque  # it may hold what is not in its attributes (a C base): its bytes decide
        fields = sorted(f"{name}={self.write(v, depth + 1)}" for name, v in held.items())
        return f"object({self.write(type(value), depth + 1)},{','.join(fields)})"


def _imported_name(value: Any) -> str | None:
    """``value``'s name, when this worker reaches it by that name from a module it has
    imported (then both codecs reach the very same object here); None otherwise."""
    if not isinstance(value, (type, types.FunctionType, types.BuiltinFunctionType)):
        return None
    module = sys.modules.get(getattr(value, "__module__", None) or "")
    qualname = getattr(value, "__qualname__", None)
    if module is None or not isinstance(qualname, str) or module.__name__ == "__main__":
        return None
    found: Any = module
    for part in qualname.split("."):
        holder = vars(found) if isinstance(found, (types.ModuleType, type)) else None
        if holder is None or part not in holder:
            return None
        found = holder[part]
    return f"name:{module.__name__}.{qualname}" if found is value else None


def _plain_class(cls: type) -> bool:
    """Whether instances of ``cls`` hold nothing outside their attributes: every class of
    its line written in Python (a heap type whose ``__new__``, if it has one, is Python's
    too), down to ``object``. A subclass of ``dict`` or of a C type is not."""
    for klass in cls.__mro__:
        if klass is object:
            continue
        if not klass.__flags__ & _HEAPTYPE:
            return False
        made = vars(klass).get("__new__")
        if made is not None and not isinstance(made, (staticmethod, types.FunctionType)):
            return False
    return True
