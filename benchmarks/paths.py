"""The setups measured: a broker whose host ``w1`` is reached Direct, through a Mount (its
answers copied out, or handed over as views), or Relayed,
each a context manager that stops and reaps everything it started."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator

import nodes
from children import Child

from somatize import Broker, Worker

WORKER = [sys.executable, "-m", "somatize.worker"]
BROKER = [sys.executable, "-m", "somatize.broker"]
SHM = "/dev/shm"


@contextlib.contextmanager
def direct() -> Iterator[Broker]:
    """A spawned network-mode worker, reached on one DEALER -> ROUTER connection."""
    with Broker.embedded({"w1": Worker.spawn(WORKER, mode="network", send=[nodes], mount=False)}) as broker:
        yield broker


@contextlib.contextmanager
def mount() -> Iterator[Broker]:
    """A spawned worker sharing a fresh directory under /dev/shm: cargo goes through files."""
    shared = tempfile.mkdtemp(prefix="somatize-bench-", dir=SHM if os.path.isdir(SHM) else None)
    try:
        with Broker.embedded({"w1": Worker.spawn(WORKER, mode="network", send=[nodes], mount=shared)}) as broker:
            yield broker
    finally:
        shutil.rmtree(shared, ignore_errors=True)


@contextlib.contextmanager
def mount_views() -> Iterator[Broker]:
    """The Mount path, with answers handed over as views of the shared segment (``views=True``):
    what Ray's object store does on one host."""
    shared = tempfile.mkdtemp(prefix="somatize-bench-", dir=SHM if os.path.isdir(SHM) else None)
    try:
        worker = Worker.spawn(WORKER, mode="network", send=[nodes], mount=shared, views=True)
        with Broker.embedded({"w1": worker}) as broker:
            yield broker
    finally:
        shutil.rmtree(shared, ignore_errors=True)


@contextlib.contextmanager
def relayed() -> Iterator[Broker]:
    """A standalone broker process and a worker process that dialed in to it."""
    with Child([*BROKER, "--listen", "tcp://127.0.0.1:0", "--announce"], announce="somatize-broker ready ") as hub:
        with Child([*WORKER, "--broker", hub.endpoint, "--offer", "w1", "--mode", "network"]):
            with Broker.at(hub.endpoint, send={"w1": [nodes]}) as broker:
                until = time.monotonic() + 60
                while not broker.knows("w1"):
                    if time.monotonic() > until:
                        raise RuntimeError("the dialing worker never reached the broker")
                    time.sleep(0.05)
                yield broker


def pickles(broker: Broker, host: str = "w1") -> int:
    """How many artifacts the broker's packer for ``host`` has made (pickled) so far."""
    packer = broker._channels.packers.get(host)  # no public counter yet: see docs/performance.md
    return -1 if packer is None else packer.pickles
