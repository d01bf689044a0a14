"""What both sides of packing share: an artifact's name and format, the modes, and how a
name is looked up without running anything."""

from __future__ import annotations

import hashlib
import inspect
from typing import Any

from ..wire.limits import SOURCES as MODES

ARTIFACT_FORMAT = "somatize.artifact/1"


def digest_of(artifact: bytes | bytearray | memoryview) -> str:
    """The name of an artifact: ``"sha256:"`` and the hex sha256 of its bytes."""
    return "sha256:" + hashlib.sha256(artifact).hexdigest()


def check_mode(mode: object) -> str:
    if mode not in MODES:
        raise ValueError(
            f'mode has to be "project" (the worker imports your nodes by name) or "network" '
            f"(nodes travel as cloudpickle artifacts); it was given {mode!r}"
            if isinstance(mode, (str, type(None)))
            else f'mode has to be "project" or "network"; it was given a `{type(mode).__name__}`'
        )
    return mode


def short(digest: str) -> str:
    return digest[:19] if isinstance(digest, str) else "?"


def lookup(obj: Any, qualname: str) -> Any:
    """Walk a dotted qualname from ``obj`` without running descriptors or ``__getattr__``."""
    if obj is None:
        return None
    for part in qualname.split("."):
        try:
            obj = inspect.getattr_static(obj, part)
        except AttributeError:
            return None
    return obj


def is_main(module: str) -> bool:
    """``__main__`` or ``pkg.__main__``: a module that runs a program when imported."""
    return module.rpartition(".")[2] == "__main__"
