"""The demo behind ``python -m somatize demo``: a small graph, run twice, told live.

The first forward runs everything and keeps the frozen, cached part in a store; the
second recalls it and runs only what is left. Every fact is printed as it happens, then a
short summary of who spent the time.
"""

from __future__ import annotations

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
    """tokenize >> embed (cached, frozen) >> (pool & norm) >> score"""
    embed = Tokenize().named("tokenize").frozen() >> Embed(width=8).named("embed").frozen().cached()
    return embed >> (Pool().named("pool") & Norm().named("norm")) >> Score().named("score")


def main(folder: str) -> int:
    graph = build()
    store = FolderStore(folder)
    spent: dict[str, int] = defaultdict(int)

    def tally(f: Fact) -> None:
        if f["fact"] == "ran":
            spent[f["node"]] += int(f["took_us"])

    print(f"graph: {graph!r}")
    print(f"store: {store.path}\n")
    for attempt in ("first", "second"):
        print(f"-- {attempt} forward")
        answer = graph.forward(TEXT, store=store, watching=[print, tally])
        print(f"   answer: {answer}\n")
    print("-- time spent, by node, over both forwards")
    for node, took_us in sorted(spent.items(), key=lambda item: -item[1]):
        print(f"   {node:<10} {took_us / 1000:9.1f} ms")
    print("   (embed ran once: the second forward recalled it from the store)")
    return 0
