"""The Mount path's cargo: frames written to a directory both ends see.

Only control crosses ZeroMQ: ``[MARK, header, manifest]``, where the manifest lists the
files holding frames 1..n. Files are written atomically (temp name, then rename) so the
reader never maps half of one, and they are named by a random token so two exchanges never
meet. The client, which survives the exchange either way, removes the files of both
directions once the terminal answer has been read, also when the work failed.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import secrets
from collections.abc import Sequence
from pathlib import Path

import msgpack

from ..errors import ProtocolError

MARK = b"\x00somatize-mount"
_NAME = re.compile(r"[0-9a-f]{32}-\d{1,6}")
_MAX_FILES = 100_000


def write(frames: Sequence[bytes | memoryview], folder: str | os.PathLike[str]) -> tuple[list, list[Path]]:
    """Write ``frames[1:]`` to ``folder``; return the message to send and the files made."""
    root = Path(folder)
    token = secrets.token_hex(16)
    names: list[str] = []
    made: list[Path] = []
    try:
        for number, frame in enumerate(frames[1:]):
            name = f"{token}-{number}"
            final = root / name
            temp = root / f".{name}.tmp"
            with open(temp, "wb") as out:
                out.write(frame)
            os.replace(temp, final)
            names.append(name)
            made.append(final)
    except BaseException:
        remove(made)
        raise
    manifest = msgpack.packb(names, use_bin_type=True)
    return [MARK, frames[0], manifest], made


def read(parts: Sequence[bytes | memoryview], folder: str | os.PathLike[str]) -> tuple[list, list[Path]]:
    """The frames a mounted message stands for (header, then each file mapped read-only)."""
    if len(parts) != 3:
        raise ProtocolError("a mounted message has three frames: the mark, the header and the manifest")
    try:
        names = msgpack.unpackb(bytes(parts[2]), raw=False, max_array_len=_MAX_FILES, max_str_len=64)
    except Exception as exc:
        raise ProtocolError("the manifest of a mounted message is not a MessagePack list of file names") from exc
    if not isinstance(names, list) or not all(isinstance(n, str) and _NAME.fullmatch(n) for n in names):
        raise ProtocolError("the manifest of a mounted message names files that the mount never made")
    root = Path(folder)
    frames: list = [parts[1]]
    paths = [root / name for name in names]
    for path in paths:
        try:
            with open(path, "rb") as source:
                size = os.fstat(source.fileno()).st_size
                if size == 0:
                    frames.append(b"")
                else:
                    # a private, copy-on-write mapping: the reader gets writable arrays
                    # without a copy, and its writes never reach the file or the sender
                    frames.append(memoryview(mmap.mmap(source.fileno(), size, access=mmap.ACCESS_COPY)))
        except OSError as exc:
            raise ProtocolError(
                f"a mounted message names `{path.name}`, which cannot be read in {root}: "
                f"do both ends see the same directory?"
            ) from exc
    return frames, paths


def remove(paths: Sequence[Path]) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
