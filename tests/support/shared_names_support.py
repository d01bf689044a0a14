"""What the tests of shared names share: a writer of the folder played by `nobody`, and counts.

The writer plants, with nothing but the standard library and as `nobody` (``setpriv``), what
a colleague in the store's group may put anywhere in a shared store: a folder, a link to a
file, to a folder or to nothing, a FIFO, a socket, a sparse file, raw bytes, a store entry
written by hand. ``keeper`` runs the writer for as long as a test wants, writing entries
again and again (a claim kept fresh).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from conftest import SETPRIV

#: Every kind of thing a writer may put where a store's entry belongs.
KINDS = ("folder", "link-file", "link-folder", "link-nowhere", "fifo", "socket", "sparse")

PLANTER = r"""
import json, os, socket, sys, time, zlib

def record(path, fields):
    data = (json.dumps(fields, sort_keys=True) + "\n").encode()
    head = b"SMZS1 %08x ---------------- " % len(data)
    with open(path + ".planting", "wb") as file:
        file.write(head + b"%08x\n" % zlib.crc32(data, zlib.crc32(head)) + data)
    os.replace(path + ".planting", path)

def plant(op, path, *rest):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if op == "folder":
        os.mkdir(path)
    elif op == "file":
        with open(path, "wb") as file:
            file.write(bytes.fromhex(rest[0]))
    elif op == "record":
        record(path, rest[0])
    elif op.startswith("link"):
        os.symlink(rest[0], path)
    elif op == "fifo":
        os.mkfifo(path)
    elif op == "socket":
        sock = socket.socket(socket.AF_UNIX)
        os.chdir(os.path.dirname(path))  # a socket's path holds 107 bytes at most: bind it relative
        sock.bind(os.path.basename(path))
        os.chdir("/")
        sock.close()
    elif op == "sparse":  # a store header declaring a blob as long as the file, the rest holes
        size = int(rest[0])
        data = b'{"node": "x", "type": "bytes"}\n'
        head = b"SMZS1 %08x %016x " % (len(data), size - 41 - len(data))
        with open(path, "wb") as file:
            file.write(head + b"%08x\n" % zlib.crc32(data, zlib.crc32(head)) + data)
            file.truncate(size)
    else:
        raise SystemExit(f"no such plant: {op}")

spec = json.loads(sys.stdin.readline())
for each in spec["plant"]:
    plant(*each)
print("planted", flush=True)
if spec.get("keep"):  # write these entries again every `every` seconds until `stop` exists
    while not os.path.exists(spec["stop"]):
        for path, fields in spec["keep"]:
            record(path, fields)
        time.sleep(spec["every"])
"""


def plant_args(kind: str, path: Path, elsewhere: Path) -> list:
    """The planter's operation putting ``kind`` at ``path`` (links point into ``elsewhere``)."""
    targets = {"link-file": elsewhere / "secret.rec", "link-folder": elsewhere, "link-nowhere": elsewhere / "nothing"}
    if kind in targets:
        return [kind, str(path), str(targets[kind])]
    if kind == "sparse":
        return [kind, str(path), str(1 << 40)]  # a TiB by its length, nothing on disk
    return [kind, str(path)]


def planting(
    python: str, ops: list, *, keep: list | None = None, stop: Path | None = None, every: float = 0.3
) -> subprocess.Popen:
    """Start the writer as `nobody`; return once it planted ``ops`` (it goes on keeping
    ``keep`` fresh until ``stop`` exists, when given)."""
    writer = subprocess.Popen(
        [*SETPRIV, python, "-c", PLANTER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd="/",
    )
    assert writer.stdin is not None and writer.stdout is not None
    writer.stdin.write(json.dumps({"plant": ops, "keep": keep or [], "stop": str(stop), "every": every}) + "\n")
    writer.stdin.close()
    line = writer.stdout.readline()
    if line != "planted\n":
        writer.kill()
        writer.wait()
        raise AssertionError(f"the writer planted nothing: {writer.stderr.read() if writer.stderr else ''}")
    return writer


def plant(python: str, *ops: list) -> None:
    """Plant ``ops`` as `nobody`, and wait for the writer to end."""
    writer = planting(python, list(ops))
    assert writer.wait(timeout=30) == 0, writer.stderr.read() if writer.stderr else ""


def open_to_others(*folders: Path) -> None:
    """What a group-writable store gives everyone in the group: write in these folders."""
    for folder in folders:
        folder.mkdir(parents=True, exist_ok=True)
        folder.chmod(0o777)


def descriptors() -> int:
    """How many descriptors this process holds open now."""
    return len(os.listdir("/proc/self/fd"))
