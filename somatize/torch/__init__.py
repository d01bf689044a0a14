"""Tensors, and training a graph: the tensor codec's older form, ``Trainer``, and a
progress view.

Tensors need nothing from here to travel: the codec writes them itself (``somatize.codec``,
the "X" node), with no copy of a contiguous CPU tensor on the way out. Importing this
package registers ``"torch.Tensor"``, the form tensors were written in before that (SMZT,
:mod:`.tensors`), so values kept then still read, and an ``Opaque`` around a tensor has a
codec; bytes of that kind arriving in a process that never imported it make the codec
layer import it by name. It also holds the training run's vocabulary, which the engine
never learns: ``loss`` and ``updated`` (:mod:`.trainer`), and a tqdm view of them
(:mod:`.progressbar`).

This package is not a serialisation library for models: tensors cross one dense tensor at a
time; sparse, quantized, nested and meta tensors are refused with the call that fixes it.
"""

from __future__ import annotations

import torch  # noqa: F401  (`somatize.torch.torch` is torch itself, as it always was)

from .progressbar import Progress, progress
from .tensors import DTYPES, FORMAT_VERSION, KIND, dump_tensor, load_tensor
from .trainer import Trainer

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
