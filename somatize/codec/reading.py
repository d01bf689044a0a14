"""Reading: a descriptor and its frames become a value (``check`` then ``build``, or
``decode`` for both), and so does a written form (``loads``). The layout is documented in
the package's docstring.

Nothing received is trusted. ``check`` walks a descriptor once and refuses anything
malformed or over a limit (node shapes, frame indices, dtypes, sizes against frames, bool
bytes, Arrow streams) before ``build`` allocates anything; nothing is ever unpickled.

Arrays and tensors are views of writable frames and copies of read-only ones, unless the
caller asks for views (``views=True``): then read-only frames are viewed too, NumPy arrays
come back read-only, and a tensor over read-only memory must not be written to (torch has
no read-only flag).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np

from somatize.errors import Unreadable

from . import arrow, tensors
from .layout import (
    ALIGN,
    ARROW_KINDS,
    BUILTIN_KINDS,
    DTYPE_WORDS,
    DTYPES,
    FIXED,
    INLINE_TYPES,
    MAGIC,
    MAX_DEPTH,
    MAX_NODES,
    NDARRAY,
    NPSCALAR,
    PLAIN,
    TENSOR,
    bytes_of,
    check_shape,
    shape_text,
)
from .registered import Entry, Opaque, for_kind

#: The library's own registry kinds whose `load` takes any buffer and copies what it keeps,
#: so no bytes are made for them first (a registered codec is promised bytes).
TAKES_BUFFERS = frozenset({TENSOR})


def _frame_views(frames: Sequence[bytes | bytearray | memoryview]) -> list[memoryview]:
    if isinstance(frames, (str, bytes, bytearray, memoryview)) or not isinstance(frames, Sequence):
        raise Unreadable(f"frames have to be a sequence of buffers; they were a `{type(frames).__name__}`")
    return [bytes_of(f, f"frame {i}") for i, f in enumerate(frames)]


class Checker:
    """Walks a descriptor once and refuses anything malformed or over a limit, before any
    value is built. ``views`` is None when there are no frames to hold it against; when
    there are, what each frame has to hold is noted on the walk and checked after it
    (``frames_hold``), so a descriptor's own faults are named before its frames'."""

    __slots__ = ("views", "kinds", "registered", "used", "nodes", "holds")

    def __init__(self, views: list[memoryview] | None) -> None:
        self.views = views
        self.kinds: set[str] = set()
        self.registered: set[str] = set()  # the kinds only the registry reads ("C" / "O" nodes)
        self.used: set[int] = set()
        self.nodes = 0
        self.holds: list[tuple[Any, ...]] = []

    def frames_hold(self) -> None:
        """Each frame holds what its node says: an array's or a tensor's size and bools,
        Arrow's streams."""
        views = self.views
        if views is None:  # no frames to hold against: nothing was noted (`holds` is empty)
            return
        for hold in self.holds:
            if hold[0] == "X":
                _, name, shape, count, i = hold
                have = views[i].nbytes
                need = count * tensors.ITEMSIZE[name]
                if need != have:
                    raise Unreadable(
                        f"a tensor of dtype {name} and shape {shape_text(shape)} needs {need} "
                        f"bytes, and frame {i} holds {have}"
                    )
                if name == "bool" and have and np.frombuffer(views[i], np.uint8).max() > 1:
                    raise Unreadable("a bool tensor holds bytes other than 0 or 1")
            elif hold[0] == "A":
                _, dt, shape, count, i = hold
                have = views[i].nbytes
                need = count * dt.itemsize
                if need != have:
                    raise Unreadable(
                        f"an array of dtype `{dt}` and shape {shape_text(shape)} needs {need} "
                        f"bytes, and frame {i} holds {have}"
                    )
                if dt.kind == "b" and have and np.frombuffer(views[i], np.uint8).max() > 1:
                    raise Unreadable("a NumPy bool array holds bytes other than 0 or 1")
            else:
                _, kind, i = hold
                arrow.check(kind, views[i])

    def count(self) -> None:
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise Unreadable(f"the descriptor has more than {MAX_NODES:,} pieces")

    def node(self, d: Any, depth: int) -> None:
        self.count()
        t = type(d)
        if t is not list:
            if t not in INLINE_TYPES:
                raise Unreadable(
                    f"a descriptor is built of None, bool, int, float, str, bytes and lists; it held a `{t.__name__}`"
                )
            self.kinds.add(PLAIN)
            return
        if not d:
            raise Unreadable("a descriptor node is an empty list; every node starts with its tag")
        tag = d[0]
        if tag == "L" or tag == "T":
            if depth >= MAX_DEPTH:
                raise Unreadable(f"the descriptor nests containers more than {MAX_DEPTH} deep")
            self.kinds.add(PLAIN)
            for i in range(1, len(d)):
                self.node(d[i], depth + 1)
        elif tag == "D":
            if depth >= MAX_DEPTH:
                raise Unreadable(f"the descriptor nests containers more than {MAX_DEPTH} deep")
            if len(d) % 2 != 1:
                raise Unreadable("a dict node holds a key without a value")
            self.kinds.add(PLAIN)
            seen: set[Any] = set()
            for i in range(1, len(d), 2):
                key = self.key(d[i])
                if key in seen:
                    raise Unreadable("a dict node holds the same key twice")
                seen.add(key)
                self.node(d[i + 1], depth + 1)
        elif tag == "I":
            self.big_int(d)
            self.kinds.add(PLAIN)
        elif tag == "B":
            self.arity(d, 2, "bytes")
            self.frame(d[1], "bytes")
            self.kinds.add(PLAIN)
        elif tag == "A":
            self.array(d)
            self.kinds.add(NDARRAY)
        elif tag == "X":
            self.tensor(d)
            self.kinds.add(TENSOR)
        elif tag == "N":
            self.arity(d, 3, "NumPy scalar")
            dt = self.dtype(d[1])
            raw = d[2]
            if type(raw) is not bytes or len(raw) != dt.itemsize:
                raise Unreadable(f"a NumPy scalar of dtype `{dt}` needs {dt.itemsize} bytes")
            if dt.kind == "b" and raw[0] > 1:
                raise Unreadable("a NumPy bool scalar holds a byte other than 0 or 1")
            self.kinds.add(NPSCALAR)
        elif tag == "C" or tag == "O":
            what = "codec" if tag == "C" else "Opaque"
            self.arity(d, 3, what)
            kind = d[1]
            if type(kind) is not str or not kind:
                raise Unreadable(f"a {what} node names its kind with a non-empty str")
            if kind in BUILTIN_KINDS and (tag == "O" or kind not in ARROW_KINDS):
                raise Unreadable(f"a {what} node cannot name the built-in kind `{kind}`")
            i = self.frame(d[2], what)
            if kind in ARROW_KINDS:
                if self.views is not None:
                    self.holds.append(("C", kind, i))
            else:
                self.registered.add(kind)
            self.kinds.add(kind)
        else:
            shown = repr(tag) if type(tag) is str and len(tag) <= 8 else f"a `{type(tag).__name__}`"
            raise Unreadable(f"a descriptor node has the unknown tag {shown}")

    def key(self, k: Any) -> Any:
        self.count()
        t = type(k)
        if t in INLINE_TYPES:
            return k
        if t is list and k and k[0] == "I":
            return self.big_int(k)
        raise Unreadable("a dict key in the descriptor is not a scalar")

    def big_int(self, d: list[Any]) -> int:
        self.arity(d, 2, "big int")
        raw = d[1]
        if type(raw) is not bytes or not raw:
            raise Unreadable("a big int node holds its value as non-empty bytes")
        return int.from_bytes(raw, "big", signed=True)

    def arity(self, d: list[Any], n: int, what: str) -> None:
        if len(d) != n:
            raise Unreadable(f"a {what} node has {len(d)} items instead of {n}")

    def dtype(self, s: Any) -> np.dtype:
        dt = DTYPES.get(s) if type(s) is str else None
        if dt is None:
            shown = repr(s) if type(s) is str and len(s) <= 16 else f"a `{type(s).__name__}`"
            raise Unreadable(
                f"the dtype {shown} is not one somatize reads: it reads {DTYPE_WORDS}, in either byte order"
            )
        return dt

    def frame(self, i: Any, what: str) -> int:
        if type(i) is not int or i < 0:
            raise Unreadable(f"a {what} node points to a frame with something other than an index")
        if self.views is not None and i >= len(self.views):
            raise Unreadable(
                f"a {what} node points to frame {i}, and there are only {len(self.views)}: frames are missing"
            )
        if i in self.used:
            raise Unreadable(f"frame {i} is pointed to twice; each frame holds one value")
        self.used.add(i)
        return i

    def array(self, d: list[Any]) -> None:
        self.arity(d, 4, "array")
        dt = self.dtype(d[1])
        count = check_shape(d[2], dt.itemsize, "an array")
        i = self.frame(d[3], "array")
        if self.views is not None:
            self.holds.append(("A", dt, d[2], count, i))

    def tensor(self, d: list[Any]) -> None:
        self.arity(d, 4, "tensor")
        name = d[1]
        itemsize = tensors.ITEMSIZE.get(name) if type(name) is str else None
        if itemsize is None:
            shown = repr(name) if type(name) is str and len(name) <= 16 else f"a `{type(name).__name__}`"
            raise Unreadable(f"the tensor dtype {shown} is not one somatize reads: it reads {tensors.WORDS}")
        count = check_shape(d[2], itemsize, "a tensor")
        i = self.frame(d[3], "tensor")
        if self.views is not None:
            self.holds.append(("X", name, d[2], count, i))


class Reader:
    """Builds a value from a descriptor that ``Checker`` has passed. ``wanted`` is the
    caller's ``views``: arrays and tensors over read-only frames are views, not copies."""

    __slots__ = ("views", "frames", "codecs", "wanted")

    def __init__(self, views: list[memoryview], frames: Sequence[Any], codecs: dict[str, Entry], wanted: bool) -> None:
        self.views = views
        self.frames = frames
        self.codecs = codecs
        self.wanted = wanted

    def value(self, d: Any) -> Any:
        if type(d) is not list:
            return d
        tag = d[0]
        if tag == "L":
            return [self.value(d[i]) for i in range(1, len(d))]
        if tag == "T":
            return tuple([self.value(d[i]) for i in range(1, len(d))])
        if tag == "D":
            return {self.value(d[i]): self.value(d[i + 1]) for i in range(1, len(d), 2)}
        if tag == "I":
            return int.from_bytes(d[1], "big", signed=True)
        if tag == "B":
            return self.views[d[1]].tobytes()
        if tag == "A":
            dt = DTYPES[d[1]]
            mv = self.views[d[3]]
            flat = np.frombuffer(mv, dt)  # read-only when the frame is
            if mv.readonly and not self.wanted:
                flat = flat.copy()  # the one copy: arrays are writable unless views were asked for
            return flat.reshape(d[2])
        if tag == "X":
            return tensors.build(d[1], d[2], self.views[d[3]], self.wanted)
        if tag == "N":
            return np.frombuffer(d[2], DTYPES[d[1]])[0]
        kind, i = d[1], d[2]
        if kind in ARROW_KINDS:
            return arrow.load(kind, self.views[i])
        entry = self.codecs[kind]
        raw = self.frames[i]
        if kind in TAKES_BUFFERS:
            raw = self.views[i]  # the library's own loader copies once itself
        elif type(raw) is not bytes:  # `load` is promised bytes
            raw = self.views[i].tobytes()
        try:
            loaded = entry.load(raw)
        except Exception as exc:
            raise Unreadable(f"the codec for `{kind}` raised {type(exc).__name__} while reading its bytes") from exc
        return Opaque(loaded) if tag == "O" else loaded


class Checked:
    """A descriptor that :func:`check` has passed, with what it found: the kinds its values
    use and the frames they point to. :func:`build` takes one and checks nothing again."""

    __slots__ = ("descriptor", "frames", "views", "kinds", "used", "registered")

    def __init__(self, descriptor: Any, frames: Any, views: list[memoryview] | None, checker: Checker):
        self.descriptor = descriptor
        self.frames = frames
        self.views = views
        self.kinds: frozenset[str] = frozenset(checker.kinds)
        """The kinds the values use (``"plain"``, ``"numpy.ndarray"``, a registered kind...)."""
        self.used: frozenset[int] = frozenset(checker.used)
        """The frames the values point to, by index."""
        self.registered: frozenset[str] = frozenset(checker.registered)
        """The kinds that only the registry reads (a registered codec's, an ``Opaque``'s)."""

    def __repr__(self) -> str:
        return f"<Checked: kinds {sorted(self.kinds)}, {len(self.used)} frames>"


def check(descriptor: Any, frames: Sequence[bytes | bytearray | memoryview] | None) -> Checked:
    """Check a descriptor once, against its frames, building nothing: node shapes, limits,
    dtypes, frame indices (each frame used once), that every array's and tensor's size
    matches its frame (and bools are 0 or 1), and that Arrow bytes are an uncompressed IPC
    stream. Imports nothing (not torch, not pyarrow unless Arrow bytes are there to check).
    Raises ``Unreadable``.

    With ``frames=None`` the descriptor alone is checked (what a receiver can know from a
    header before its frames matter), and the result cannot be built.
    """
    views = None if frames is None else _frame_views(frames)
    checker = Checker(views)
    checker.node(descriptor, 0)
    checker.frames_hold()
    return Checked(descriptor, frames, views, checker)


def build(checked: Checked, *, views: bool = False) -> Any:
    """The value that a descriptor :func:`check` passed with its frames stands for.

    Nothing is checked again; this is how a reader that checks first (the wire, before it
    answers anything) reads each value once. Arrays and tensors are views of writable
    frames and copies of read-only ones; with ``views=True`` they are views of read-only
    frames too: NumPy arrays then come back read-only, and tensors over read-only memory
    must not be written to (torch has no read-only flag). Either way a view keeps its frame
    alive. Raises ``Unreadable`` for a kind this process cannot read, or a registered
    codec's ``load`` that fails.
    """
    if type(checked) is not Checked or checked.views is None:
        raise TypeError("build takes what check(descriptor, frames) returned, with its frames")
    codecs = {}
    for kind in checked.kinds:
        if kind in ARROW_KINDS:
            arrow.pyarrow_modules(kind)
        elif kind == TENSOR and kind not in checked.registered:
            tensors.torch_module()  # "install somatize[torch]" before anything is built
    for kind in checked.registered:
        codecs[kind] = for_kind(kind)
    try:
        return Reader(checked.views, checked.frames, codecs, views).value(checked.descriptor)
    except Unreadable:
        raise
    except (ValueError, TypeError, MemoryError) as exc:  # checked above; a last guard
        raise Unreadable(f"the value could not be built: {type(exc).__name__}") from exc


def kinds_in(descriptor: Any) -> set[str]:
    """The kinds a descriptor uses, so a receiver can refuse what it cannot read before it
    reads anything. Raises ``Unreadable`` when the descriptor is malformed."""
    checker = Checker(None)
    checker.node(descriptor, 0)
    return checker.kinds


def decode(descriptor: Any, frames: Sequence[bytes | bytearray | memoryview], *, views: bool = False) -> Any:
    """The value ``encode`` wrote as ``(descriptor, frames)``.

    The descriptor's nodes are lists (as MessagePack unpacks them with ``use_list=True``;
    tuples are refused). Everything is checked before anything is built: node shapes, frame
    indices (each frame used once), limits, dtypes, that every array's and tensor's size
    matches its frame. Arrays and tensors are writable: views of writable frames, copies of
    read-only ones; with ``views=True``, views of read-only frames too (see :func:`build`).
    Tensors come back on the CPU, as leaves. Raises ``Unreadable`` and nothing else for
    anything malformed or of a kind this process cannot read.
    """
    if type(descriptor) in INLINE_TYPES:  # the common small case: a bare scalar
        return descriptor
    return build(check(descriptor, frames), views=views)


def loads(data: bytes | bytearray | memoryview, *, views: bool = False) -> Any:
    """The value whose written form ``data`` is. Frames are read in place: arrays and
    tensors are views of ``data`` when it is writable (a ``bytearray``, a private mapping),
    copies otherwise, or read-only views with ``views=True`` (see :func:`build`)."""
    mv = bytes_of(data, "what loads was given")
    descriptor, spans = _layout(mv, mv.nbytes)
    return decode(descriptor, [mv[start:end] for start, end in spans], views=views)


#: How much of a written form ``check_start`` needs to see its header whole, usually.
START_BYTES = 64 * 1024


def check_start(start: bytes | bytearray | memoryview, total: int) -> None:
    """Refuse a written form of ``total`` bytes from its first bytes alone, before the rest
    is read or room is made for it: the magic, a header that fits, and (when ``start``
    holds the whole header, as it does for all but huge descriptors) frame lengths that
    account for exactly ``total`` bytes. Raises ``Unreadable``; what passes may still be
    refused by ``loads``. Reading ``START_BYTES`` first is enough for the usual header."""
    mv = bytes_of(start, "the start of a written form")
    _magic(mv, total)
    if FIXED.size + FIXED.unpack_from(mv)[1] <= mv.nbytes:
        _layout(mv, total)


def _magic(mv: memoryview, total: int) -> int:
    """Where the header ends, once the magic and the header's length are found good."""
    if total < FIXED.size or mv.nbytes < FIXED.size or mv[:4] != MAGIC:
        raise Unreadable("these bytes are not somatize's written form: they do not start with SMZ1")
    end = FIXED.size + FIXED.unpack_from(mv)[1]
    if end > total:
        raise Unreadable(f"the written form is cut short: its header needs {end} bytes and there are {total}")
    return end


def _layout(mv: memoryview, total: int) -> tuple[Any, list[tuple[int, int]]]:
    """The descriptor and the frames' spans of a written form ``total`` bytes long, from
    ``mv``, which holds at least its header."""
    end = _magic(mv, total)
    try:
        header = msgpack.unpackb(
            mv[FIXED.size : end],
            raw=False,
            use_list=True,
            strict_map_key=True,
            max_map_len=0,  # descriptors hold no maps
            ext_hook=_no_ext,
        )
    except Exception as exc:
        raise Unreadable(f"the written form's header is not valid MessagePack ({type(exc).__name__})") from exc
    if type(header) is not list or len(header) != 2 or type(header[1]) is not list:
        raise Unreadable("the written form's header is not [descriptor, [frame lengths]]")
    descriptor, lengths = header
    spans = []
    for i, n in enumerate(lengths):
        if type(n) is not int or n < 0:
            raise Unreadable(f"the written form's header gives frame {i} a length that is not a size")
        start = end + (-end % ALIGN)
        end = start + n
        if end > total:
            raise Unreadable(f"the written form is cut short: frame {i} ends at byte {end} and there are {total}")
        spans.append((start, end))
    if end != total:
        raise Unreadable(f"the written form holds {total - end} bytes more than its header accounts for")
    return descriptor, spans


def _no_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"MessagePack extension type {code} is not part of a descriptor")
