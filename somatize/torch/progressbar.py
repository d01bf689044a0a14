"""A progress view of a training run: a watcher that draws a live tqdm bar, one tick per
``loss`` fact. tqdm is imported when a bar is made, not before.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["Progress", "progress"]


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
