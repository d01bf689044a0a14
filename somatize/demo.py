"""The demo behind ``python -m somatize demo``: a graph over two worker processes, told live.

An embedded broker and two spawned workers: ``embed`` runs on ``w1``, ``pool`` and ``norm``
on ``w2``, the rest here. The first forward runs everything and keeps the frozen, cached
``embed`` in a store; the second recalls it and never sends anything to ``w1``. Every fact
is printed as it happens, then a short summary per host.
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict

import numpy as np

from .facts import Fact
from .graph import Node
from .store import FolderStore

TEXT = (
    "a graph of nodes runs in one process or spread over machines "
    "and keeps what was computed so the frozen part is never computed twice"
)


class Tokenize(Node):
    def forward(self, text: str) -> list[str]:
        return text.split()


class Embed(Node):
    """Stands in for an expensive frozen model: a fixed projection, slowly."""

    def __init__(self, width: int = 8) -> None:
        self.width = width

    def forward(self, words: list[str]) -> np.ndarray:
        time.sleep(0.2)  # the expensive part, worth keeping
        codes = np.array([[ord(c) for c in w[: self.width].ljust(self.width)] for w in words], dtype=np.float32)
        return codes / 128.0


class Pool(Node):
    def forward(self, vectors: np.ndarray) -> np.ndarray:
        return vectors.mean(axis=0)


class Norm(Node):
    def forward(self, vectors: np.ndarray) -> float:
        return float(np.linalg.norm(vectors, axis=1).mean())


class Score(Node):
    def forward(self, pair: tuple[np.ndarray, float]) -> float:
        pooled, norm = pair
        return round(float(pooled.sum()) / norm, 4)


def build():
    """tokenize >> embed on w1 (cached, frozen) >> (pool & norm) on w2 >> score, here."""
    embed = Tokenize().named("tokenize").frozen() >> Embed(width=8).named("embed").at("w1").frozen().cached()
    both = (Pool().named("pool") & Norm().named("norm")).at("w2")
    return embed >> both >> Score().named("score")


def main(folder: str) -> int:
    from .fabric import Broker, Worker

    graph = build()
    store = FolderStore(folder)
    worker = [sys.executable, "-m", "somatize.worker"]
    hosts = {
        # w1 imports the nodes by name (they live in an installed module): project mode
        "w1": Worker.spawn(worker, mode="project"),
        # w2 receives them as cloudpickle artifacts, as a notebook's nodes would travel
        "w2": Worker.spawn(worker, mode="network"),
    }
    per_host: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))

    def tally(f: Fact) -> None:
        host = f.get("host", "here")
        if f["fact"] == "ran":
            per_host[host]["ran_us"] += int(f["took_us"])
            per_host[host]["nodes"] += 1
        elif f["fact"] == "left":
            per_host[host]["slices"] += 1
            per_host[host]["round_trip_us"] += int(f["took_us"])

    print(f"graph: {graph!r}")
    print(f"store: {store.path}")
    print("workers: w1 and w2, spawned on first use\n")
    with Broker.embedded(hosts) as broker:
        for attempt in ("first", "second"):
            print(f"-- {attempt} forward")
            answer = graph.forward(TEXT, broker=broker, store=store, watching=[print, tally])
            print(f"   answer: {answer}\n")
    print("-- per host, over both forwards")
    print(f"   {'host':<6} {'slices':>6} {'nodes':>6} {'ran ms':>9} {'waiting ms':>11}")
    for host in sorted(per_host):
        row = per_host[host]
        waiting = row["round_trip_us"] - row["ran_us"] if row["slices"] else 0
        print(f"   {host:<6} {row['slices']:>6} {row['nodes']:>6} {row['ran_us'] / 1000:>9.1f} {waiting / 1000:>11.1f}")
    print("   (waiting = round trip minus what ran there: the wire and the queue)")
    print("   (embed ran once on w1: the second forward recalled it and sent nothing to w1)")
    return 0
