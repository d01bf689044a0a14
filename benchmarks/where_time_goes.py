"""Where the time goes: one case's measured loop, to run under a sampling profiler, and a
summary of what the profiler saw, per process.

    py-spy record --native --subprocesses -r 997 --format raw -o /tmp/a.folded -- \\
        python benchmarks/where_time_goes.py run a
    python benchmarks/where_time_goes.py summarise /tmp/a.folded

``run`` takes one of:

    a        a one-node forward of 100 B, Direct (case a), 3000 times
    c        a 3-node chain on an InProcess host (case c), 20000 times
    d        a 200-node local chain (case d), 1000 times
    mount    a 64 MiB NumPy round trip through a Mount in /dev/shm, 20 times
    relayed  the same, Relayed, 10 times
    torch    a 64 MiB torch tensor round trip, Direct, 10 times

py-spy samples every process of the tree (``--subprocesses``): the client, and the spawned
worker, or the standalone broker and the dialing worker. ``summarise`` keeps only samples
taken inside the measured loop (the client's ``measured``) or inside a worker's or
broker's serving loop (so start-up and imports are left out), sets apart the samples taken
waiting (in poll, select, a lock), then prints, for each process, the functions holding the
most of the working samples (inclusive) and the leaves where they were taken (self; native
frames grouped by library). With ``--gil`` py-spy keeps only samples holding the GIL: the
Python work, without the copies and syscalls that release it; without, it samples wall
time, waits included (this container does not let it tell idle threads apart).

Without py-spy, ``run a --cprofile`` profiles the client's loop with cProfile.

``cpu`` runs case (a) on somatize and on raw pyzmq and says, per call, the wall time and the
CPU time each side spent (Linux: the other side's is read from /proc). ``ceilings`` says
how fast this machine copies 64 MiB: in memory, and into a new or an existing file in
/dev/shm (what bounds the Mount path).
"""

from __future__ import annotations

import collections
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

SMALL = b"x" * 100


def measured(call, times: int) -> None:
    """The loop the summary keeps (a marker the summariser looks for)."""
    for _ in range(times):
        call()


def run(which: str) -> None:
    import numpy as np

    import paths
    from nodes import Echo, Inc
    from somatize import Broker, Worker

    echo = Echo().named("echo").at("w1")
    if which == "a":
        with paths.direct() as broker:
            for _ in range(200):
                echo.forward(SMALL, broker=broker)
            measured(lambda: echo.forward(SMALL, broker=broker), 3000)
    elif which == "c":
        hosted = Inc().named("i1").at("here") >> Inc().named("i2").at("here") >> Inc().named("i3").at("here")
        with Broker.embedded({"here": Worker.inprocess()}) as broker:
            for _ in range(200):
                hosted.forward(0, broker=broker)
            measured(lambda: hosted.forward(0, broker=broker), 20000)
    elif which == "d":
        import functools

        chain = functools.reduce(lambda a, b: a >> b, [Inc() for _ in range(200)])
        chain.forward(0)
        measured(lambda: chain.forward(0), 1000)
    elif which in ("mount", "relayed"):
        x = np.ones(16 << 20, np.float32)
        with (paths.mount() if which == "mount" else paths.relayed()) as broker:
            echo.forward(x, broker=broker)
            measured(lambda: echo.forward(x, broker=broker), 20 if which == "mount" else 10)
    elif which == "torch":
        import somatize.torch  # noqa: F401
        import torch

        x = torch.ones(16 << 20)
        with paths.direct() as broker:
            echo.forward(x, broker=broker)
            measured(lambda: echo.forward(x, broker=broker), 10)
    else:
        raise SystemExit(f"run takes a, c, d, mount, relayed or torch; got {which!r}")


def cpu(calls: int = 3000) -> str:
    """Case (a) per call: wall time, and the CPU time each side spent, somatize and raw.

    The client's CPU is this process's (its libzmq I/O thread and the embedded broker's
    thread included); the worker's and the echo server's are read from /proc (Linux).
    """
    import os
    import time

    import paths
    from cases import floor
    from nodes import Echo

    def cpu_of(pid: int) -> float:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def per_call(call, pid: int) -> tuple[float, float, float]:
        for _ in range(200):
            call()
        wall, mine, theirs = time.perf_counter(), time.process_time(), cpu_of(pid)
        for _ in range(calls):
            call()
        return tuple(
            1e6 * (after - before) / calls
            for before, after in ((wall, time.perf_counter()), (mine, time.process_time()), (theirs, cpu_of(pid)))
        )

    echo = Echo().named("echo").at("w1")
    with paths.direct() as broker, floor() as raw:
        echo.forward(SMALL, broker=broker)
        worker = broker._server.children["w1"].process.pid
        lines = []
        for name, call, pid in (
            ("somatize Direct", lambda: echo.forward(SMALL, broker=broker), worker),
            ("raw pyzmq", lambda: raw.small(SMALL), raw.server_pid),
        ):
            wall, client, other = per_call(call, pid)
            lines.append(f"{name:16} {wall:6.0f} µs per call; CPU: client {client:4.0f} µs, other side {other:4.0f} µs")
    return "\n".join(lines)


def ceilings(nbytes: int = 64 << 20) -> str:
    """What this machine's memory and /dev/shm allow, for one direction of 64 MiB: the
    bounds under the Mount path (which writes one new file each way)."""
    import os
    import shutil
    import tempfile
    import time

    import numpy as np

    from table import median

    x = np.ones(nbytes, np.uint8)
    y = np.zeros(nbytes, np.uint8)
    folder = tempfile.mkdtemp(prefix="somatize-bench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    path = os.path.join(folder, "cargo")

    def fresh_file() -> None:
        with open(path, "wb") as out:
            out.write(x)
        os.unlink(path)

    def same_file() -> None:
        with open(path, "r+b") as out:
            out.write(x)

    def speed(call) -> float:
        times = []
        for _ in range(7):
            started = time.perf_counter()
            call()
            times.append(time.perf_counter() - started)
        return nbytes / median(times) / 1e9

    try:
        rows = [("memcpy into memory already touched", lambda: np.copyto(y, x)),
                ("memcpy into fresh memory (page faults)", lambda: x.copy()),
                ("write a new file in /dev/shm", fresh_file)]
        out = [f"{what:40} {speed(call):5.2f} GB/s" for what, call in rows]
        with open(path, "wb") as first:
            first.write(x)
        out.append(f"{'rewrite an existing file in /dev/shm':40} {speed(same_file):5.2f} GB/s")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return "\n".join(out)


# -- the summary ----------------------------------------------------------------------------

_FRAME = re.compile(r"^(?P<name>.+?) \((?P<where>[^()]*)\)$")
#: Frames that mark a sample as taken inside the part of a process that is measured.
_INSIDE = ("measured (", "WorkerLoop.serve (", "BrokerLoop.serve (")
#: Leaves where a thread waits rather than works (py-spy here samples idle threads too).
_WAITING = ("Poller.poll", "Socket.poll", "select", "EpollSelector.select", "Popen._wait", "Popen.wait",
            "Event.wait", "Condition.wait", "sleep", "Thread.join")


def _frame(text: str) -> str:
    """A frame as a reader wants it: ``Class.method (module.py)``, or a native library."""
    match = _FRAME.match(text)
    if match is None:
        return text
    name, where = match["name"], match["where"]
    if name.startswith("0x") or ".so" in where:  # a native frame: its library is what tells
        return f"[{where.split('/')[-1].split('.cpython')[0]}]"
    return f"{name} ({where.split(':')[0].replace('somatize/', '')})"


def summarise(folded: str, top: int = 12) -> str:
    processes: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    leaves: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    totals: collections.Counter = collections.Counter()
    waiting: collections.Counter = collections.Counter()
    for line in Path(folded).read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        process = "this process"
        while frames and frames[0].startswith("process "):  # a child's follow its parent's
            process = _role(frames.pop(0))
        if not any(frame.startswith(_INSIDE) for frame in frames):
            continue
        if any(frame.startswith("_find_and_load (") for frame in frames):
            continue  # an import: start-up (a worker importing torch on first use), not the loop
        n = int(count)
        if _frame(frames[-1]).split(" (")[0] in _WAITING:
            waiting[process] += n
            continue
        totals[process] += n
        for name in dict.fromkeys(_frame(f) for f in frames):
            processes[process][name] += n
        leaves[process][_frame(frames[-1])] += n
    out = []
    for process, total in totals.most_common():
        out.append(f"== {process}: {total} samples working in the measured part, "
                   f"{waiting[process]} more waiting (in poll, select, wait)")
        out.append("   inclusive (share of the working samples):")
        for name, n in _interesting(processes[process], top):
            out.append(f"   {100 * n / total:5.1f}%  {name}")
        out.append("   self (leaf):")
        for name, n in leaves[process].most_common(top):
            out.append(f"   {100 * n / total:5.1f}%  {name}")
    return "\n".join(out)


def _interesting(counter: collections.Counter, top: int) -> list[tuple[str, int]]:
    """The most-sampled frames, less the outer ones every sample shares."""
    ranked = counter.most_common()
    if not ranked:
        return []
    everything = ranked[0][1]
    return [(name, n) for name, n in ranked if n < everything * 0.995][:top]


def _role(frame: str) -> str:
    command = frame.split(":", 1)[-1].strip('"')
    for word, role in (("somatize.worker", "worker"), ("somatize.broker", "broker"), ("where_time_goes", "client")):
        if word in command:
            return role
    return command[:60]


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "run":
        if "--cprofile" in argv:
            import cProfile
            import pstats

            profiler = cProfile.Profile()
            profiler.runcall(run, argv[1])
            pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
        else:
            run(argv[1])
        return 0
    if argv == ["cpu"]:
        print(cpu())
        return 0
    if argv == ["ceilings"]:
        print(ceilings())
        return 0
    if len(argv) == 2 and argv[0] == "summarise":
        print(summarise(argv[1]))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
