"""Tensors, and training a graph: the tensor codec, ``Trainer``, and a progress view.

Importing this module registers the codec for ``torch.Tensor`` (kind ``"torch.Tensor"``),
and that is the only way in: bytes of that kind arriving in a process that never imported
it make the codec layer import it by name. It also holds the training run's vocabulary,
which the engine never learns: ``loss`` (said after each forward, so a recorder files it
into the forward it belongs to) and ``updated`` (said once per optimizer step).

The written form of a tensor is not a pickle, and reading one runs no code: a fixed header
and the raw bytes of its elements, all little-endian::

    offset 0   b"SMZT"                       magic
           4   u8  version (1)
           5   u8  ndim (at most codec.MAX_NDIM)
           6   u8  length of the dtype's name
           7   u8  0 (reserved)
           8   the dtype's name in ASCII, as torch spells it ("bfloat16")
               ndim x u64, the sizes
               zero bytes up to a multiple of 16
               the elements, in C order (numel x itemsize bytes, nothing after)

``load`` checks every field (magic, version, dtype against an allow-list, sizes, that the
data is exactly as long as the header says, zero padding, bool bytes being 0 or 1) before
it allocates anything, and gives back a CPU tensor that is a leaf: whatever graph produced
a value is gone once it is written down (a ``.frozen()`` promise is what makes that sound).
Strides, device, ``requires_grad`` and tensor subclasses are not kept: a transposed tensor
comes back contiguous with the same values, a CUDA one comes back on the CPU (a node
declared ``.on(device)`` gets it moved), an ``nn.Parameter`` comes back a plain tensor.

This module is not a serialisation library for models: it writes one dense tensor at a
time, and refuses sparse, quantized, nested and meta tensors with the call that fixes it.
"""

from __future__ import annotations

import struct
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import torch

from .codec import MAX_NDIM
from .codec import codec as _register
from .errors import PlanError, Unreadable, Unsettled, Unwritable
from .facts import Watchers, fact
from .graph import Graph, as_graph

__all__ = [
    "DTYPES",
    "FORMAT_VERSION",
    "KIND",
    "Progress",
    "Trainer",
    "dump_tensor",
    "load_tensor",
    "progress",
]

KIND = "torch.Tensor"
FORMAT_VERSION = 1

_MAGIC = b"SMZT"
_FIXED = struct.Struct("<4sBBBB")
_SIZE = struct.Struct("<Q")
_ALIGN = 16
_MAX_NAME = 32
_MAX_NBYTES = 2**63  # no tensor is bigger; checked with Python ints before torch is asked

# What is written, by torch's own names. Any bit pattern is a valid value of each (bool
# aside, which is checked), so reading one can never produce something torch cannot hold.
# Left out on purpose: complex32 (experimental in torch), the float8 "fnuz"/e8m0 and float4
# variants, bits*, and the quantized dtypes (refused with `.dequantize()`).
_DTYPE_NAMES = (
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "complex64",
    "complex128",
    "float8_e4m3fn",
    "float8_e5m2",
)
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in _DTYPE_NAMES
    if isinstance(getattr(torch, name, None), torch.dtype)
}
"""The dtypes a tensor may have to be written down or read back, by name."""
_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_DTYPE_WORDS = (
    "bool, (u)int8..(u)int64, float16, bfloat16, float32, float64, complex64, complex128 "
    "and float8_e4m3fn / float8_e5m2"
)


# -- the codec ---------------------------------------------------------------------------


def dump_tensor(t: torch.Tensor) -> memoryview:
    """``t`` in the written form above. Copies the data once, straight into the result
    (from any device, from any strides), and never pickles."""
    _little_endian("written down")
    name = _writable(t)
    shape = tuple(t.shape)
    head = _header(name, shape)
    nbytes = t.numel() * t.element_size()
    out = torch.empty(len(head) + nbytes, dtype=torch.uint8)  # not zero-filled: all of it is written
    written = out.numpy()
    written[: len(head)] = np.frombuffer(head, np.uint8)
    if nbytes:
        # the tail of `out`, shaped like `t`: copy_ does the device transfer and the
        # strides in the one copy
        out[len(head) :].view(t.dtype).view(shape).copy_(t.detach())
    return memoryview(written)


def load_tensor(raw: bytes | bytearray | memoryview) -> torch.Tensor:
    """The tensor whose written form ``raw`` is: a new CPU tensor, a leaf.

    Raises ``Unreadable`` for anything malformed, before allocating the tensor.
    """
    _little_endian("read back")
    data = memoryview(raw).cast("B")
    name, shape, start = _read_header(data)
    dtype = DTYPES[name]
    elements = np.frombuffer(data, np.uint8, offset=start) if len(data) > start else None
    if dtype is torch.bool and elements is not None and elements.max() > 1:
        raise Unreadable("a bool tensor's bytes hold something other than 0 or 1")
    out = torch.empty(shape, dtype=dtype)  # requires_grad=False: a leaf
    if elements is not None:
        out.reshape(-1).view(torch.uint8).numpy()[:] = elements
    return out


def _writable(t: torch.Tensor) -> str:
    """The dtype's name, or the sentence that says why ``t`` cannot be written down."""
    if t.is_nested:
        raise Unwritable(
            "a nested tensor cannot be written down: somatize writes dense tensors only. "
            "Send `t.unbind()` (a tuple of dense tensors) or `t.to_padded_tensor(0.0)` instead"
        )
    if t.is_quantized:
        raise Unwritable(
            f"a quantized tensor (dtype `{t.dtype}`) cannot be written down: somatize writes "
            f"dense, unquantized tensors only. Send `t.dequantize()`, or `t.int_repr()` "
            f"together with its scale and zero point"
        )
    if t.layout != torch.strided:
        raise Unwritable(
            f"a tensor with layout `{t.layout}` cannot be written down: somatize writes dense "
            f"(strided) tensors only. Send `t.to_dense()`, or its parts (indices and values) "
            f"as a tuple and rebuild it on the other side"
        )
    if t.is_meta:
        raise Unwritable(
            "a tensor on the `meta` device has a shape and no data, so there is nothing to "
            "write down. Materialise it first (`torch.zeros_like(t, device=\"cpu\")`, or "
            "load its weights), or send its shape instead"
        )
    name = _NAMES.get(t.dtype)
    if name is None:
        raise Unwritable(
            f"a tensor of dtype `{t.dtype}` cannot be written down: somatize writes tensors "
            f"of {_DTYPE_WORDS}. Convert it first, e.g. `t.to(torch.float32)`"
        )
    if t.dim() > MAX_NDIM:
        raise Unwritable(
            f"a tensor with {t.dim()} dimensions cannot be written down: readers accept at "
            f"most {MAX_NDIM}. Reshape it first"
        )
    return name


def _header(name: str, shape: tuple[int, ...]) -> bytes:
    encoded = name.encode("ascii")
    head = _FIXED.pack(_MAGIC, FORMAT_VERSION, len(shape), len(encoded), 0) + encoded
    head += b"".join(_SIZE.pack(n) for n in shape)
    return head + bytes(-len(head) % _ALIGN)


def _read_header(data: memoryview) -> tuple[str, tuple[int, ...], int]:
    """``(dtype name, shape, where the elements start)``, every field checked."""
    total = len(data)
    if total < _FIXED.size or data[:4] != _MAGIC:
        raise Unreadable("these bytes are not a tensor somatize wrote: they do not start with SMZT")
    _, version, ndim, name_len, reserved = _FIXED.unpack_from(data)
    if version != FORMAT_VERSION:
        raise Unreadable(
            f"this tensor was written in version {version} of somatize's tensor format, and "
            f"this somatize reads version {FORMAT_VERSION}: read it with the somatize that "
            f"wrote it, or upgrade this one"
        )
    if reserved != 0:
        raise Unreadable("a tensor's header has a nonzero reserved byte")
    if ndim > MAX_NDIM:
        raise Unreadable(f"a tensor's header says {ndim} dimensions, more than {MAX_NDIM}")
    if not 0 < name_len <= _MAX_NAME:
        raise Unreadable(f"a tensor's header gives its dtype a name {name_len} bytes long")
    end = _FIXED.size + name_len + ndim * _SIZE.size
    if end > total:
        raise Unreadable(f"a tensor's header is cut short: it needs {end} bytes and there are {total}")
    raw_name = bytes(data[_FIXED.size : _FIXED.size + name_len])
    name = raw_name.decode("ascii", errors="replace")
    if name not in DTYPES:
        shown = repr(name) if raw_name.isascii() and name.isprintable() else "an unreadable name"
        raise Unreadable(f"the dtype {shown} is not one somatize reads: it reads {_DTYPE_WORDS}")
    itemsize = DTYPES[name].itemsize
    shape = []
    count, bound = 1, itemsize
    for i in range(ndim):
        (n,) = _SIZE.unpack_from(data, _FIXED.size + name_len + i * _SIZE.size)
        count *= n
        bound *= max(n, 1)  # torch refuses strides past this, even with a zero elsewhere
        if bound >= _MAX_NBYTES:
            raise Unreadable("a tensor's header gives it a shape too big to exist")
        shape.append(n)
    start = end + (-end % _ALIGN)
    if start > total or any(data[end:start]):
        raise Unreadable("a tensor's header is not followed by its zero padding")
    need = count * itemsize
    if total - start != need:
        raise Unreadable(
            f"a {name} tensor of shape ({', '.join(map(str, shape))}) needs {need} bytes of "
            f"data, and {total - start} follow its header"
        )
    return name, tuple(shape), start


def _little_endian(what: str) -> None:
    if sys.byteorder != "little":
        raise (Unwritable if what == "written down" else Unreadable)(
            f"somatize's tensor format is little-endian, and this machine is big-endian: "
            f"tensors cannot be {what} here"
        )


_register(KIND, torch.Tensor, dump=dump_tensor, load=load_tensor)


# -- training ----------------------------------------------------------------------------


class Trainer:
    """Train the local part of a graph: forward, objective, backward, optimizer.

    ``graph`` is run with ``graph.forward(x, broker=broker, store=store, watching=...)`` on
    each batch; ``objective(output, y)`` returns the loss, a tensor with one element; the
    gradients of ``loss / accumulate`` are added up and every ``accumulate`` steps the
    optimizer moves (``optimizer.step()``, then ``optimizer.zero_grad()``). A group cut
    short by the end of an epoch moves too, with its gradients rescaled so that every move
    follows the mean gradient of the steps it covers.

    Said to the watchers, after the forward each belongs to has closed (so a ``Recorder``
    files it into that forward's record):

    ``{"fact": "loss", "value": "0.2517", "step": "12", "epoch": "1"}``
        after every step; ``value`` has 6 significant digits.
    ``{"fact": "updated", "step": "15", "steps": "4"}``
        once per optimizer move: the step it came after and how many forwards it covers.

    Steps and epochs are numbered from 0 and keep counting across calls to :meth:`fit`,
    as a recorder's forwards do, so step ``n`` is the ``n``-th forward a fresh recorder saw.

    Refused before anything runs (:meth:`check`, also called by the constructor and by
    every :meth:`fit`): a node whose parameters would train (a ``torch.nn.Module``, or a
    node holding one, with a parameter that requires grad, and not ``.frozen()``) but that
    is placed on another host with ``.at()`` (``PlanError``) or ``.cached()``
    (``Unsettled``): what comes back from either is a leaf, so it would never learn. And an
    optimizer holding parameters of a node declared ``.frozen()``, which would break that
    promise (``PlanError``). Then every check of ``graph.forward`` runs too.
    """

    def __init__(
        self,
        graph: Any,
        *,
        objective: Callable[[Any, Any], torch.Tensor],
        optimizer: Any,
        watching: Any = None,
        accumulate: int = 1,
        broker: Any = None,
        store: Any = None,
    ) -> None:
        self.graph: Graph = as_graph(graph)
        if not callable(objective):
            raise TypeError(
                f"`objective=` is called as `objective(output, y)` and returns the loss; it "
                f"was given a `{type(objective).__name__}`"
            )
        if not (callable(getattr(optimizer, "step", None)) and callable(getattr(optimizer, "zero_grad", None))):
            raise TypeError(
                f"`optimizer=` needs `step()` and `zero_grad()`, like a `torch.optim.Adam(...)`; "
                f"it was given a `{type(optimizer).__name__}`"
            )
        if type(accumulate) is not int or accumulate < 1:
            raise ValueError(
                f"`accumulate=` is how many steps add up their gradients before the optimizer "
                f"moves, a whole number >= 1; it was given {accumulate!r}"
            )
        self.objective = objective
        self.optimizer = optimizer
        self.accumulate = accumulate
        self.broker = broker
        self.store = store
        self.watching = Watchers(watching)  # a watcher that cannot be called is refused here
        self.step = 0
        """The number the next step will have."""
        self.epoch = 0
        """The number the next epoch will have."""
        self.check()

    def check(self) -> None:
        """Refuse, before anything runs, what cannot train as declared (see the class)."""
        held = {id(p) for group in getattr(self.optimizer, "param_groups", ()) for p in group.get("params", ())}
        for step in self.graph.steps:
            trainable = _trainable(step.node)
            if not trainable:
                continue
            if step.freeze:
                moved = [p for p in trainable if id(p) in held]
                if moved:
                    raise PlanError(
                        f"`{step.label}` is declared `.frozen()`, and the optimizer holds "
                        f"{len(moved)} of its parameters, so a step would change what "
                        f"was promised not to change (and anything cached after it would go "
                        f"stale). Build the optimizer over the parameters of the nodes that "
                        f"train only (e.g. `torch.optim.Adam(head.parameters())`), or drop "
                        f"`.frozen()` from `{step.label}` and keep it local and uncached."
                    )
                continue
            what = (
                f"`{step.label}` would train (it has {_count(len(trainable))} that require "
                f"grad and it is not `.frozen()`)"
            )
            if step.host is not None:
                raise PlanError(
                    f"{what}, but it is placed on `{step.host}` with `.at(\"{step.host}\")`: what "
                    f"comes back from another host is a leaf, so its parameters would never get "
                    f"a gradient. Mark it `.frozen()` if it should not train, or keep it local "
                    f"(drop the `.at()`) so that it does."
                )
            if step.cache:
                raise Unsettled(
                    f"{what}, but it is `.cached()`: what is recalled from a store is a leaf, "
                    f"and a cache of something that changes every step goes stale. Mark it "
                    f"`.frozen()` if it should not train, or drop `.cached()` so that it does."
                )
        from .plan import check

        check(self.graph, broker=self.broker, store=self.store)

    def fit(self, batches: Any, epochs: int = 1) -> list[float]:
        """Train for ``epochs`` passes over ``batches``; return every step's loss, in order.

        ``batches`` is an iterable of ``(x, y)`` pairs, iterated afresh each epoch (a list,
        a ``DataLoader``), or a callable taking no arguments that returns one (called at
        the start of each epoch, to make a fresh generator say). A one-shot iterator is
        refused when ``epochs > 1``: its second epoch would be silently empty.

        Gradients are zeroed first. While it runs, the parameters of nodes declared
        ``.frozen()`` do not require grad (they are given back as they were after): no
        graph is built through a frozen node, so what it hands on is a leaf whether it ran
        here, ran elsewhere or was recalled. Runs with grad enabled in this thread; the engine's
        pool threads, where parallel branches run, have it enabled unless a node turned it
        off for good. Watchers are not closed: they belong to whoever made them.
        """
        if type(epochs) is not int or epochs < 0:
            raise ValueError(f"`epochs=` is a whole number >= 0; it was given {epochs!r}")
        fresh = _batches(batches, epochs)
        self.check()
        losses: list[float] = []
        self.optimizer.zero_grad()
        # A frozen node promised its parameters do not change, and the optimizer holds none
        # of them (checked): build no graph through them and keep no gradient for them.
        quiet = [p for step in self.graph.steps if step.freeze for p in _trainable(step.node)]
        for p in quiet:
            p.requires_grad_(False)
        try:
            self._epochs(fresh, epochs, losses)
        finally:
            for p in quiet:
                p.requires_grad_(True)
        return losses

    def _epochs(self, fresh: Callable[[], Iterable[Any]], epochs: int, losses: list[float]) -> None:
        with torch.enable_grad():
            for _ in range(epochs):
                pending = 0
                last = self.step
                for item in fresh():
                    x, y = _pair(item, self.step)
                    losses.append(self._one(x, y))
                    pending += 1
                    last = self.step
                    self.step += 1
                    if pending == self.accumulate:
                        self._update(last, pending)
                        pending = 0
                if pending:
                    self._update(last, pending)
                self.epoch += 1

    def _one(self, x: Any, y: Any) -> float:
        output = self.graph.forward(x, broker=self.broker, store=self.store, watching=self.watching)
        loss = self.objective(output, y)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shown = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else f"a `{type(loss).__name__}`"
            raise TypeError(
                f"the objective has to return the loss as a tensor with one element, and at "
                f"step {self.step} it returned {shown}. Reduce it, e.g. with `.mean()`."
            )
        if not loss.requires_grad:
            raise ValueError(
                f"the loss at step {self.step} does not depend on anything that trains: every "
                f"node before it is frozen, cached or on another host, or the objective cut "
                f"the graph (`.item()`, `.detach()`, `torch.no_grad()`). Leave the part you "
                f"train local and unfrozen."
            )
        (loss / self.accumulate).backward()
        value = loss.item()
        self.watching(fact("loss", value=f"{value:.6g}", step=self.step, epoch=self.epoch))
        return value

    def _update(self, step: int, steps: int) -> None:
        if steps != self.accumulate:  # a group cut short: mean over the steps it has
            scale = self.accumulate / steps
            with torch.no_grad():
                for group in getattr(self.optimizer, "param_groups", ()):
                    for p in group.get("params", ()):
                        if p.grad is not None:
                            p.grad.mul_(scale)
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.watching(fact("updated", step=step, steps=steps))


def _trainable(node: Any) -> list[torch.Tensor]:
    """The parameters of ``node`` that require grad: its own when it is a module, else
    those of the modules and leaf tensors it holds as attributes."""
    if isinstance(node, torch.nn.Module):
        return [p for p in node.parameters() if p.requires_grad]
    found: dict[int, torch.Tensor] = {}
    for value in getattr(node, "__dict__", {}).values():
        if isinstance(value, torch.nn.Module):
            for p in value.parameters():
                if p.requires_grad:
                    found[id(p)] = p
        elif isinstance(value, torch.Tensor) and value.requires_grad and value.is_leaf:
            found[id(value)] = value
    return list(found.values())


def _count(n: int) -> str:
    return "1 parameter" if n == 1 else f"{n} parameters"


def _batches(batches: Any, epochs: int) -> Callable[[], Iterable[Any]]:
    if isinstance(batches, Iterable) and not isinstance(batches, (str, bytes)):
        if epochs > 1 and isinstance(batches, Iterator):
            raise TypeError(
                f"`fit(batches, epochs={epochs})` was given a one-shot iterator (a "
                f"`{type(batches).__name__}`), which would be empty from the second epoch on. "
                f"Pass a list or a DataLoader, or a function returning a fresh iterable: "
                f"`fit(lambda: make_batches(), epochs={epochs})`."
            )
        return lambda: batches
    if callable(batches):
        def fresh() -> Iterable[Any]:
            made = batches()
            if not isinstance(made, Iterable):
                raise TypeError(
                    f"the function given as `batches` has to return an iterable of (x, y) "
                    f"pairs; it returned a `{type(made).__name__}`"
                )
            return made

        return fresh
    raise TypeError(
        f"`fit` takes an iterable of (x, y) pairs (a list, a DataLoader) or a function "
        f"returning one; it was given a `{type(batches).__name__}`"
    )


def _pair(item: Any, step: int) -> tuple[Any, Any]:
    try:
        x, y = item
    except (TypeError, ValueError):
        raise TypeError(
            f"each batch is an (x, y) pair: the input of the graph and what the objective "
            f"compares its output with; batch {step} was a `{type(item).__name__}`"
            + (f" of length {len(item)}" if hasattr(item, "__len__") else "")
        ) from None
    return x, y


# -- a progress view ---------------------------------------------------------------------


def progress(total: int | None = None, desc: str = "training", **tqdm_kwargs: Any) -> Progress:
    """A watcher that draws a live tqdm bar of a training run: one tick per ``loss``
    fact, with the step, the latest loss and the throughput (steps/s).

        with progress(total=5 * len(batches)) as bar:
            Trainer(g, ..., watching=[Recorder(store), bar]).fit(batches, epochs=5)

    The bar appears with the first loss and closes itself when it reaches ``total``, on
    ``.close()``, or at the end of a ``with`` block; ``Trainer.fit`` does not close it, so
    one bar can span several fits. ``tqdm_kwargs`` go to tqdm (``file=``, ``leave=``, ...).
    In a notebook it draws a widget (``tqdm.auto``). Needs tqdm: ``pip install tqdm``.
    """
    return Progress(total=total, desc=desc, **tqdm_kwargs)


class Progress:
    """The watcher :func:`progress` returns."""

    def __init__(self, total: int | None = None, desc: str = "training", **tqdm_kwargs: Any) -> None:
        self._tqdm = _tqdm()  # refuse now, not at the first fact, when tqdm is missing
        self._options = {"total": total, "desc": desc, "unit": "step", **tqdm_kwargs}
        self._lock = threading.Lock()
        self._bar: Any = None
        self._closed = False
        self.updates = 0
        """How many ``updated`` facts it saw."""

    def __call__(self, f: dict[str, str]) -> None:
        kind = f.get("fact")
        if kind == "updated":
            with self._lock:
                self.updates += 1
            return
        if kind != "loss":
            return
        with self._lock:
            if self._closed:
                return
            if self._bar is None:
                self._bar = self._tqdm(**self._options)
            bar = self._bar
            postfix = {"loss": f.get("value", "?")}
            if "epoch" in f:
                postfix["epoch"] = f["epoch"]
            if "step" in f:
                postfix["step"] = f["step"]
            bar.set_postfix(postfix, refresh=False)
            bar.update(1)
            if bar.total is not None and bar.n >= bar.total:
                self._close()

    def close(self) -> None:
        """Stop drawing; the bar stays on screen. Later facts are ignored."""
        with self._lock:
            self._close()

    def _close(self) -> None:
        self._closed = True
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _tqdm() -> Any:
    try:
        from tqdm.auto import tqdm
    except ImportError as exc:
        raise ImportError(
            "the progress view draws with tqdm, which is not installed here: "
            "pip install tqdm (or pip install somatize[torch])"
        ) from exc
    return tqdm
