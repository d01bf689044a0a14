"""One store entry as a file: its record written down, its header, and reading them back.

A ``FolderStore`` entry is one file holding, in order:
  a 41-byte ASCII header line: b"SMZS1 " + record length (8 hex digits) + " " + blob length
    (16 hex digits, or 16 '-' when the entry has no blob) + " " + CRC-32 (8 hex digits) + "\n"
  the record: one line of UTF-8 JSON with sorted keys, ending in "\n"
  the blob bytes, if any.
This module checks what is written and what is read; ``store`` decides where files go and
how they are opened. A file read back is never trusted: it may have been written by anyone
who may write the folder, so every length is checked against the file before it is read.
"""

from __future__ import annotations

import io
import json
import os
import re
import stat
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path

from somatize.errors import StoreError

# -- records ----------------------------------------------------------------------------

_RECORD_MAX = 64 << 20  # a record is small; bulk data belongs in the blob


def _half_the_memory() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (ValueError, OSError, AttributeError):
        return 1 << 34  # 16 GiB where the machine does not say


#: The longest entry file a store reads (by its length, a sparse one too), unless told
#: otherwise: half this machine's memory, so a planted entry never makes a read take more.
LARGEST = _half_the_memory()


def record_bytes(name: str, record: object) -> bytes:
    if not isinstance(record, Mapping):
        raise TypeError(f"The record for {name!r} must be a mapping of str to str, not {type(record).__name__}.")
    plain: dict[str, str] = {}
    for key, value in record.items():
        if not isinstance(key, str):
            raise TypeError(f"The record for {name!r} has a key of type {type(key).__name__}; record keys must be str.")
        if not isinstance(value, str):
            raise TypeError(
                f"The record for {name!r} holds a {type(value).__name__} under {key!r}; "
                "record values must be str (write the value down as text first)."
            )
        plain[key] = value
    try:
        text = json.dumps(plain, sort_keys=True, ensure_ascii=False, separators=(", ", ": "))
        data = (text + "\n").encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: escape everything instead, still exact
        text = json.dumps(plain, sort_keys=True, ensure_ascii=True, separators=(", ", ": "))
        data = (text + "\n").encode("ascii")
    if len(data) > _RECORD_MAX:
        raise StoreError(
            f"The record for {name!r} is {len(data)} bytes written down; a record holds at "
            f"most {_RECORD_MAX} bytes. Put bulk data in the blob."
        )
    return data


def blob_parts(name: str, blob: object) -> list[memoryview] | None:
    if blob is None:
        return None
    items = blob if isinstance(blob, (list, tuple)) else (blob,)
    parts = []
    for item in items:
        if isinstance(item, str):
            raise TypeError(
                f"The blob for {name!r} holds a str; a blob is bytes-like "
                "(bytes, bytearray, memoryview) or a list/tuple of those. Encode the text first."
            )
        try:
            view = memoryview(item)
        except TypeError:
            raise TypeError(
                f"The blob for {name!r} holds a {type(item).__name__}; a blob is bytes-like "
                "(bytes, bytearray, memoryview) or a list/tuple of those."
            ) from None
        if not view.c_contiguous:
            raise TypeError(
                f"The blob for {name!r} holds a non-contiguous {type(item).__name__}; pass a contiguous copy of it."
            )
        parts.append(view.cast("B") if view.ndim != 1 or view.format != "B" else view)
    return parts


# -- the file format --------------------------------------------------------------------
#
# The CRC covers the header up to the CRC field and the record, so a damaged length or
# record is caught. The blob carries no checksum: files only ever appear whole (rename), and
# hashing 256 MiB on every fetch is a cost nobody asked for.

_MAGIC = b"SMZS1 "
_HEADER = re.compile(rb"SMZS1 ([0-9a-f]{8}) ([0-9a-f]{16}|-{16}) ([0-9a-f]{8})\n")
_HEADER_SIZE = 41
_CRC_AT = 32  # the CRC covers header[:32] and the record
_NO_BLOB = b"-" * 16
CHUNK = 1 << 30  # one write() at most; some systems refuse more than 2 GiB at once


def header(record_len: int, blob_len: int | None) -> bytes:
    blob_field = _NO_BLOB if blob_len is None else b"%016x" % blob_len
    return _MAGIC + b"%08x " % record_len + blob_field + b" "


def write_all(fd: int, view: memoryview) -> None:
    done, size = 0, view.nbytes
    while done < size:
        done += os.write(fd, view[done : done + CHUNK])


def read_exact(file: io.FileIO, size: int, path: Path) -> bytearray:
    buffer = bytearray(size)
    _fill(file, memoryview(buffer), 0, path)
    return buffer


def _fill(file: io.FileIO, view: memoryview, done: int, path: Path) -> None:
    """Read into ``view`` from byte ``done`` to its end."""
    size = view.nbytes
    while done < size:
        got = file.readinto(view[done:])
        if not got:
            raise StoreError(
                f"The store file {path} ends early (read {done} of {size} bytes); it was cut "
                "short or altered outside somatize. Delete it and put the entry again."
            )
        done += got


def read_head(file: io.FileIO, path: Path) -> tuple[dict[str, str], int, int | None]:
    """Read the header and the record, and nothing of the blob (the file is unbuffered)."""
    size = _regular_size(file.fileno(), path)
    head = bytes(read_exact(file, min(size, _HEADER_SIZE), path))
    record_len, blob_len, crc = _check_head(head, size, path)
    body = bytes(read_exact(file, record_len, path))
    return _check_record(head, body, crc, path), size - _HEADER_SIZE - record_len, blob_len


#: What a scan reads of an entry at once: its header and a record of the usual size.
_FIRST_READ = _HEADER_SIZE + (16 << 10)


def scan_record(fd: int, path: str | Path) -> dict[str, str]:
    """The record of the entry open at ``fd``, never its blob, with `read_head`'s checks:
    one ``fstat`` and, for a record under 16 KiB, one read (a scan reads thousands)."""
    size = _regular_size(fd, path)
    got = os.read(fd, min(size, _FIRST_READ))
    record_len, _, crc = _check_head(got[:_HEADER_SIZE], size, path)
    want = _HEADER_SIZE + record_len
    while len(got) < want:
        more = os.read(fd, want - len(got))
        if not more:
            raise StoreError(
                f"The store file {path} ends early (read {len(got)} of {want} bytes); it was cut "
                "short or altered outside somatize. Delete it and put the entry again."
            )
        got += more
    return _check_record(got[:_HEADER_SIZE], got[_HEADER_SIZE:want], crc, path)


def _regular_size(fd: int, path: str | Path) -> int:
    found = os.fstat(fd)
    if not stat.S_ISREG(found.st_mode):  # a FIFO or a device planted under an entry's name
        raise StoreError(
            f"The store file {path} is not a regular file; it was not written by somatize. "
            "Remove it and put the entry again."
        )
    return found.st_size


def _check_head(head: bytes, size: int, path: str | Path) -> tuple[int, int | None, int]:
    """The record's length, the blob's (None: no blob) and the checksum a header names."""
    found = _HEADER.fullmatch(head)
    if found is None:
        raise StoreError(
            f"The store file {path} does not start with a somatize store header; it is not "
            "a store entry, or was damaged. Delete it and put the entry again."
        )
    record_len = int(found[1], 16)
    blob_len = None if found[2] == _NO_BLOB else int(found[2], 16)
    if record_len > _RECORD_MAX or _HEADER_SIZE + record_len > size:
        raise StoreError(
            f"The store file {path} declares a record of {record_len} bytes but holds "
            f"{size} bytes in all; it was cut short or damaged. Delete it and put the entry again."
        )
    return record_len, blob_len, int(found[3], 16)


def _check_record(head: bytes, body: bytes, crc: int, path: str | Path) -> dict[str, str]:
    if zlib.crc32(body, zlib.crc32(head[:_CRC_AT])) != crc:
        raise StoreError(
            f"The store file {path} fails its checksum; its header or record was damaged. "
            "Delete it and put the entry again."
        )
    try:
        record = json.loads(body)
    except (ValueError, RecursionError):
        record = None
    # a JSON object's keys are strings: only the values need a look
    if not isinstance(record, dict) or not all(type(v) is str for v in record.values()):
        raise StoreError(
            f"The store file {path} holds a record that is not a JSON object of strings; "
            "it was not written by somatize. Delete it and put the entry again."
        )
    return record


#: What ``read_blob`` reads of a blob before its ``admit`` looks (and before room is made
#: for the rest).
BLOB_START = 64 * 1024


def read_blob(
    file: io.FileIO,
    path: Path,
    room: int,
    blob_len: int | None,
    admit: Callable[[bytearray, int], object] | None = None,
) -> bytearray | None:
    """The blob that follows the record, read whole into one buffer of its exact size.
    ``admit(start, length)``, when given, sees its first ``BLOB_START`` bytes and its
    declared length first and may raise to refuse it: a file that declares gigabytes of
    nothing (a sparse file) is refused before they are allocated or read."""
    if blob_len is None and room == 0:
        return None
    if blob_len is None or room != blob_len:
        raise StoreError(
            f"The store file {path} holds {room} bytes after its record but its header "
            f"declares {'no blob' if blob_len is None else f'{blob_len} bytes'}; it was cut "
            "short or altered. Delete it and put the entry again."
        )
    if admit is None or blob_len <= BLOB_START:
        blob = read_exact(file, blob_len, path)  # exact size, filled in place: no second copy
        if admit is not None:
            admit(blob, blob_len)
        return blob
    start = read_exact(file, BLOB_START, path)
    admit(start, blob_len)
    blob = bytearray(blob_len)
    blob[:BLOB_START] = start
    del start
    _fill(file, memoryview(blob), BLOB_START, path)
    return blob
