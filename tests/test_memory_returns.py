"""Memory that comes back (issue 18): a worker keeps of what a client sent it no more than its
catalog's stated bound on constructor arguments, whether the node's forward failed or not.

Before: 16 Works naming ``Add(n)``, each with a different 32 MiB ``n``, whose forward then
raised, took a project-mode worker from 43 to 555 MiB of resident memory (652 in the
issue), and it stayed there after the burst and after the next client. The catalog kept
224 MiB of it, seven arguments, within its bound; the rest was the failed forwards' input,
each message as it arrived (32 MiB of ``zmq.Frame``): the exception was kept in a local
(the walk's ``failure``, the worker's ``cause``) of a frame its own traceback holds, a
cycle, and the frames below that one held the message until the cyclic collector ran
(which, in a worker that builds few objects, it rarely does). After: 266 MiB, the worker's
own 43 and the catalog's 224. What ``malloc`` keeps of freed cargo (37 MiB after a burst of
12 MiB arguments) is given back too (:mod:`somatize.fabric.worker.heap`).

Each test reads a real worker process's memory as the kernel counts it (``/proc/PID``),
after the work it was sent has been answered and a next piece of work has run: no timing.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import textwrap

import pytest
import zmq
from conftest import WORKER, env_with_tests
from fabric_nodes import Add, Pid

from somatize import Broker, NodeFailed, Worker
from somatize.fabric.worker import heap
from somatize.packing import MAX_BUILT, MAX_BUILT_BYTES

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads a worker's memory from /proc"),
]

MIB = 1 << 20
BURST, SIZE = 16, 32 * MIB
#: What a worker may hold beyond the arguments its catalog keeps (``MAX_BUILT_BYTES``), over
#: what it held once warm: one message's cargo each way. The last answer's frame is let go
#: of by libzmq's I/O thread once it is sent, which nothing here waits for, and ``malloc``
#: may keep a block of a message's size where a live one sits above it. Measured: the
#: worker grew by 223 MiB over the burst, the catalog's seven 32 MiB arguments and no more
#: (512 MiB before the fix), and by nothing once newer nodes had pushed them out.
FIXED = 2 * SIZE


def held(pid: int) -> int:
    """Bytes resident in ``pid`` that are its own: ``VmRSS`` less the shared-memory segments
    it maps (a spawned worker's cargo lies in its client's pool, which the client keeps)."""
    fields = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "RssShmem"):
                fields[name] = int(value.split()[0]) << 10
    return fields["VmRSS"] - fields.get("RssShmem", 0)


def send_burst(broker: Broker, fails: bool) -> None:
    """BURST Works, each naming ``Add`` with a different SIZE-byte argument; ``fails``: the
    forward raises (an int plus bytes), else it answers the argument back."""
    for i in range(BURST):
        argument = bytes([i]) * SIZE
        g = Add(argument).named("big").at("w1")
        if fails:
            with pytest.raises(NodeFailed, match="unsupported operand"):
                g.forward(0, broker=broker)
        else:
            assert g.forward(b"", broker=broker) == argument


def within(grew: int, bound: int, when: str) -> None:
    assert grew <= bound, (
        f"{when}, the worker held {grew / MIB:.0f} MiB more than when warm, over the bound of "
        f"{bound / MIB:.0f} MiB (its catalog's {MAX_BUILT_BYTES / MIB:.0f} MiB of arguments, plus "
        f"{FIXED / MIB:.0f})"
    )


@pytest.mark.parametrize("fails", [True, False], ids=["forward fails", "forward succeeds"])
def test_a_burst_of_big_arguments_leaves_a_listening_worker_within_its_bound(processes, fails):
    worker = processes([*WORKER, "--listen", "127.0.0.1:0", "--announce", "--mode", "project"], env=env_with_tests())
    bound = MAX_BUILT_BYTES + FIXED
    with Broker.embedded({"w1": Worker.at(worker.endpoint, mode="project")}) as broker:
        small = Add(1).named("small").at("w1")
        assert small.forward(0, broker=broker) == 1  # warm: connected, imported
        before = held(worker.pid)
        send_burst(broker, fails)
        # answered: the burst's last Work has run and been let go of before this one ran
        assert small.forward(0, broker=broker) == 1
        within(held(worker.pid) - before, bound, "after the burst")
    with Broker.embedded({"w1": Worker.at(worker.endpoint, mode="project")}) as broker:
        assert Add(2).named("small").at("w1").forward(0, broker=broker) == 2
        within(held(worker.pid) - before, bound, "after the next client was served")
        # what the catalog kept comes back once newer nodes push it out
        for n in range(3, 3 + MAX_BUILT):
            assert Add(n).named("small").at("w1").forward(0, broker=broker) == n
        assert worker.alive
        grew = held(worker.pid) - before
    assert grew <= FIXED, (
        f"with the big arguments out of its catalog, the worker still held {grew / MIB:.0f} MiB "
        f"more than when warm (over {FIXED / MIB:.0f})"
    )


def test_a_burst_of_big_arguments_leaves_a_spawned_worker_within_its_bound(monkeypatch):
    # spawned: the cargo goes through the client's pooled shared memory where /dev/shm is
    # memory, the path a notebook takes; the worker imports the nodes from the tests folder
    monkeypatch.setenv("PYTHONPATH", env_with_tests()["PYTHONPATH"])
    with Broker.embedded({"w1": Worker.spawn(WORKER, mode="project")}) as broker:
        pid = Pid().named("pid").at("w1").forward(0, broker=broker)  # warm: started, imported
        before = held(pid)
        send_burst(broker, fails=True)
        assert Pid().named("pid").at("w1").forward(0, broker=broker) == pid
        within(held(pid) - before, MAX_BUILT_BYTES + FIXED, "after the burst")


def test_the_heap_counts_cargo_and_trims_once_enough_went_through():
    counted = heap.Heap(every=10)
    counted.moved([b"abcd", memoryview(bytes(8)).cast("B", (2, 4)), bytearray(2)])
    assert counted.count == 14 and counted.due()
    counted.trim()
    assert counted.count == 0 and counted.trims == 1 and not counted.due()
    counted.received([zmq.Frame(b"route"), zmq.Frame(bytes(6))])  # what a socket gave: bytes each
    assert counted.count == 11 and counted.due()


# A child whose heap holds 192 MiB freed below one live block: glibc keeps it (it returns
# memory only from the top of a heap) until ``malloc_trim``. The first 2 MiB block, freed,
# raises glibc's threshold for mapping blocks of their own, so the 1 MiB ones go on the heap.
FRAGMENTED = textwrap.dedent(
    """
    import json
    from somatize.fabric.worker import heap

    def rss():
        with open("/proc/self/status") as status:
            return next(int(l.split()[1]) << 10 for l in status if l.startswith("VmRSS:"))

    first = bytearray(2 << 20)
    del first
    blocks = [bytearray(1 << 20) for _ in range(193)]
    del blocks[:-1]
    kept = rss()
    gave = heap.trim()
    print(json.dumps({"kept": kept, "after": rss(), "gave": gave}))
    """
)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_trim_gives_back_what_glibc_kept_of_freed_memory():
    done = subprocess.run([sys.executable, "-c", FRAGMENTED], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["gave"], result
    assert result["kept"] - result["after"] >= 128 * MIB, result
