"""A real worker spoken to by hand: the Works a raw client writes to it (in full, or naming
their recipe by digest), the answer that ends each, and the bounds the tests that play such
a client share (conftest's ``spawned``, ``raws`` and ``serving`` give the worker and the
clients)."""

from __future__ import annotations

import socket

from conftest import WORKER, env_with_tests
from peers import Raw

from somatize import Broken, Busy, Overdue, Unreachable
from somatize.packing import Packer
from somatize.wire import Hello, NodeSpec, Ready, Recipe, Runtime, Saw, Work, encode

MARGIN = 8.0  # added to every bound: the machine may be busy with others' tests
WAIT = 10.0 + MARGIN
PATIENCE = 2.0
#: How a call may end whose worker was killed, replaced or closed under it: never a hang,
#: a wrong value or a bare ZeroMQ error.
TYPED = (Broken, Unreachable, Overdue, Busy)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def project_worker(processes, *extra: str):
    """A listening project-mode worker on loopback that imports the tests' nodes by name."""
    return processes([*WORKER, "--listen", "127.0.0.1:0", "--announce", *extra], env=env_with_tests())


def spec_of(node, label: str | None = None, cache: bool = False) -> NodeSpec:
    """The spec a project-mode client writes for ``node`` named ``label`` (and cached), or for
    the first step of ``node`` when it is named already (``label`` left out)."""
    step = node if label is None else node.named(label)
    if cache:
        step = step.cached()
    return Packer("project").spec(step.steps[0])


def full(ref: int, recipe: Recipe, value, *, watched: bool = False, **fields) -> list[bytes]:
    return encode(Work(ref, recipe, value, watched=watched, **fields))


def by_digest(ref: int, digest: str, value, *, watched: bool = False, **fields) -> list[bytes]:
    return encode(Work(ref, None, value, watched=watched, recipe_digest=digest, **fields))


def final(raw: Raw, ref: int, timeout: float = WAIT):
    """The answer that ends work ``ref`` on ``raw`` (its Saws skipped)."""
    while True:
        msg = raw.answer(timeout)
        assert msg is not None, f"no answer to work {ref}"
        if isinstance(msg, Saw):
            assert msg.ref == ref, msg  # what a watched work says is its own
            continue
        return msg


def greeted(endpoint: str) -> Raw:
    raw = Raw(endpoint)
    ready = raw.ask(Hello(Runtime.here(mode="project")))
    assert isinstance(ready, Ready), ready
    return raw
