"""``Trainer``: train the local part of a graph (forward, objective, backward, optimizer),
and the training run's vocabulary, which the engine never learns: ``loss`` (said after each
forward, so a recorder files it into the forward it belongs to) and ``updated`` (said once
per optimizer step).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from somatize.errors import PlanError, Unsettled
from somatize.facts import Watchers, fact
from somatize.graph import Graph, as_graph
from somatize.record.recorder import ENDED

__all__ = ["Trainer"]


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
                    f'{what}, but it is placed on `{step.host}` with `.at("{step.host}")`: what '
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
        from somatize.plan import check

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
        off for good. Watchers are not closed (they belong to whoever made them); they hear
        ``ended`` (``how`` ok or broke) as it returns or raises.
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
        how = "broke"
        try:
            self._epochs(fresh, epochs, losses)
            how = "ok"
        finally:
            for p in quiet:
                p.requires_grad_(True)
            self.watching(fact(ENDED, how=how))  # a Recorder files the run's end (the view shows it)
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
            shown = (
                f"a tensor of shape {tuple(loss.shape)}"
                if isinstance(loss, torch.Tensor)
                else f"a `{type(loss).__name__}`"
            )
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
