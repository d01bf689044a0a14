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

``stages`` runs case (a) and says, per call, where each side's CPU goes, stage by stage (plan,
pack, encode, send, decode, check, run, answer...): each stage's share of the side's Python in
a cProfile of both sides, times the side's CPU per call measured without one.

``placement`` runs case (a) on both with each process pinned: left free, both on one CPU, and
on a CPU each, which is where a free run's least disturbed blocks of raw come from.

``cpu`` runs case (a) on somatize and on raw pyzmq and says, per call, the wall time and the
CPU time each side spent, by thread (the calling thread, libzmq's I/O thread) and as user and
system time (Linux: read from /proc). ``ceilings`` says
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
        with paths.mount() if which == "mount" else paths.relayed() as broker:
            echo.forward(x, broker=broker)
            measured(lambda: echo.forward(x, broker=broker), 20 if which == "mount" else 10)
    elif which == "torch":
        import torch

        import somatize.torch  # noqa: F401

        x = torch.ones(16 << 20)
        with paths.direct() as broker:
            echo.forward(x, broker=broker)
            measured(lambda: echo.forward(x, broker=broker), 10)
    else:
        raise SystemExit(f"run takes a, c, d, mount, relayed or torch; got {which!r}")


def cpu(calls: int = 3000) -> str:
    """Case (a) per call: wall time, and the CPU time each side spent, somatize and raw,
    each side's split by thread (the thread that calls, against libzmq's I/O thread, which
    moves the bytes) and into user and system time.

    Read from /proc (Linux) for every thread of both processes: the client's (its embedded
    broker's thread included, under "other threads") and the worker's or the echo server's.
    """
    import os
    import time

    import paths
    from cases import floor
    from nodes import Echo

    tick = 1e6 / os.sysconf("SC_CLK_TCK") / calls  # µs per call in one clock tick

    def threads(pid: int) -> dict[str, tuple[int, int]]:
        """(user, system) clock ticks by thread, the threads named by role."""
        found: dict[str, tuple[int, int]] = {}
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            except OSError:  # it ended meanwhile
                continue
            name = stat[stat.index("(") + 1 : stat.rindex(")")]
            fields = stat.rsplit(")", 1)[1].split()
            role = "main" if tid == str(pid) else "I/O" if name.startswith("ZMQbg/IO") else "other threads"
            user, system = found.get(role, (0, 0))
            found[role] = (user + int(fields[11]), system + int(fields[12]))
        return found

    def said(before: dict, after: dict) -> str:
        parts = []
        for role in ("main", "I/O", "other threads"):
            user, system = (after.get(role, (0, 0))[i] - before.get(role, (0, 0))[i] for i in (0, 1))
            if user or system or role != "other threads":
                parts.append(f"{role} {tick * user:.0f}+{tick * system:.0f}")
        total = sum(tick * (a[0] + a[1]) for a in after.values()) - sum(tick * (b[0] + b[1]) for b in before.values())
        return f"{total:4.0f} µs ({', '.join(parts)}: user+system)"

    echo = Echo().named("echo").at("w1")
    with paths.direct() as broker, floor() as raw:
        echo.forward(SMALL, broker=broker)
        worker = broker._server.children["w1"].process.pid
        lines = []
        for name, call, pid in (
            ("somatize Direct", lambda: echo.forward(SMALL, broker=broker), worker),
            ("raw pyzmq", lambda: raw.small(SMALL), raw.server_pid),
        ):
            for _ in range(200):
                call()
            mine, theirs, wall = threads(os.getpid()), threads(pid), time.perf_counter()
            for _ in range(calls):
                call()
            wall = 1e6 * (time.perf_counter() - wall) / calls
            lines.append(
                f"{name:16} {wall:6.0f} µs per call; CPU per call: client {said(mine, threads(os.getpid()))}; "
                f"other side {said(theirs, threads(pid))}"
            )
    return "\n".join(lines)


def placement(calls: int = 2000, blocks: int = 5) -> str:
    """Case (a), somatize and raw, with each process's threads pinned to CPUs: left free (as
    the benchmark runs), both processes on one CPU, and each on a CPU of its own (the
    client's threads on CPU 0, the other side's on CPU 1). For each, the median of
    ``blocks`` blocks of ``calls`` calls, and their least. Where the least disturbed blocks
    of a free run come from: a raw round trip is fastest when the two processes happen to
    sit on two CPUs, somatize's barely moves, since its time per call is mostly its CPU."""
    import os
    import time

    import paths
    from cases import floor
    from nodes import Echo
    from table import median

    if len(os.sched_getaffinity(0)) < 2:
        return "placement needs two CPUs at least"

    def pin(pid: int, cpus: set[int]) -> None:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                os.sched_setaffinity(int(tid), cpus)
            except OSError:  # it ended meanwhile
                pass

    everywhere = os.sched_getaffinity(0)
    first, second = sorted(everywhere)[:2]
    placements = (("free", everywhere, everywhere), ("one CPU", {first}, {first}), ("a CPU each", {first}, {second}))
    echo = Echo().named("echo").at("w1")
    lines = [f"case (a), {blocks} blocks of {calls} calls each: median of the blocks (least), µs per call"]
    with paths.direct() as broker, floor() as raw:
        echo.forward(SMALL, broker=broker)
        worker = broker._server.children["w1"].process.pid
        try:
            for name, call, pid in (
                ("raw pyzmq", lambda: raw.small(SMALL), raw.server_pid),
                ("somatize Direct", lambda: echo.forward(SMALL, broker=broker), worker),
            ):
                said = []
                for where, mine, theirs in placements:
                    pin(os.getpid(), mine)
                    pin(pid, theirs)
                    for _ in range(calls):  # settled where it now runs
                        call()
                    took = []
                    for _ in range(blocks):
                        started = time.perf_counter()
                        for _ in range(calls):
                            call()
                        took.append(1e6 * (time.perf_counter() - started) / calls)
                    said.append(f"{where} {median(took):.0f} ({min(took):.0f})")
                lines.append(f"{name:16} " + ", ".join(said))
        finally:
            pin(os.getpid(), everywhere)
    return "\n".join(lines)


# Each stage of a call, by the functions that do it (file, function, and the caller it is
# counted from, where it is called from elsewhere too): their inclusive time in a
# deterministic profile of each side. What no stage names is "the rest".
CLIENT_STAGES = (
    (
        "plan: the graph's checks and its walk",
        (("plan.py", "check"), ("engine.py", "prepare"), ("planned.py", "trip_of")),
    ),
    (
        "locate, borrow, give back the channel",
        (("rendezvous.py", "locate"), ("pool.py", "borrow"), ("pool.py", "give_back")),
    ),
    (
        "pack: specs, Work, recipe digest, kinds",
        (
            ("pieces.py", "specs_of"),
            ("pieces.py", "work_of"),
            ("channel.py", "_digest_of"),
            ("channel.py", "_check_kinds"),
            ("channel.py", "_provision"),
        ),
    ),
    # the express way writes a repeated call's Work with `work_frames`; the general way `encode`s it
    ("encode the Work", (("writing.py", "encode"), ("short.py", "work_frames"))),
    ("send", (("channel.py", "_send_work"),)),
    ("decode the answer", (("reading.py", "decode"),)),
    ("check it against the conversation", (("conversation.py", "receive"),)),
    ("conclude (the outcome)", (("channel.py", "_conclude"), ("pieces.py", "outcome_of"))),
)
WORKER_STAGES = (
    ("receive (the socket)", (("sockets.py", "receive_frames"), ("sockets.py", "readable"))),
    # the express way in reads a repeated call with `short.express` and asks `recall`; the
    # general way (`decode`, `receive`) takes the rest (the first call of a recipe, say)
    ("decode the Work", (("reading.py", "decode"), ("short.py", "express", "_expressed"))),
    ("check it against the conversation", (("conversation.py", "receive"), ("conversation.py", "recall"))),
    (
        "look up and build the nodes",
        (("catalog.py", "missing"), ("catalog.py", "build"), ("prepared.py", "prepare"), ("pieces.py", "piece_of")),
    ),
    # a lone node runs directly (`run_lone`); any other piece is walked (`run_piece`)
    ("run the piece (the node's forward inside)", (("engine.py", "run_piece"), ("engine.py", "run_lone"))),
    ("encode the answer", (("writing.py", "encode"),)),
    # what the serving thread answers leaves straight away (`_post`), what other threads
    # queued through the outbox (`_flush`); both send with `_deliver`
    ("send the answer", (("outbox.py", "_deliver"),)),
)


def stages(calls: int = 2000) -> str:
    """Case (a), per call and per stage on each side: each stage's share of that side's
    Python in a deterministic profile (cProfile in the client, and in the worker, which is
    spawned under it), and that share of the side's CPU time per call measured without a
    profiler. A profiler slows small functions most, so read the shares as a map of where
    the time goes, not as exact figures."""
    import cProfile
    import os
    import pstats
    import tempfile
    import time

    import nodes
    from nodes import Echo

    from somatize import Broker, Worker

    def cpu_of(pid: int) -> float:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    echo = Echo().named("echo").at("w1")
    folder = tempfile.mkdtemp(prefix="somatize-stages-")
    profiled = os.path.join(folder, "worker.prof")
    out = [
        f"case (a), {calls} calls a run: stage, share of the side's Python (cProfile), "
        f"that share of its CPU per call (measured without a profiler)"
    ]
    # first unprofiled, for the CPU per call; then both sides profiled
    for profile in (False, True):
        command = [sys.executable, *(["-m", "cProfile", "-o", profiled] if profile else []), "-m", "somatize.worker"]
        worker = Worker.spawn(command, mode="network", send=[nodes], mount=False)
        with Broker.embedded({"w1": worker}) as broker:
            for _ in range(200):
                echo.forward(SMALL, broker=broker)
            pid = broker._server.children["w1"].process.pid
            if not profile:
                mine, theirs, wall = time.process_time(), cpu_of(pid), time.perf_counter()
                measured(lambda: echo.forward(SMALL, broker=broker), calls)
                cpu = {
                    "client": 1e6 * (time.process_time() - mine) / calls,
                    "worker": 1e6 * (cpu_of(pid) - theirs) / calls,
                }
                out.append(
                    f"wall {1e6 * (time.perf_counter() - wall) / calls:.0f} µs per call; CPU per call: "
                    f"client {cpu['client']:.0f} µs, worker {cpu['worker']:.0f} µs"
                )
                continue
            profiler = cProfile.Profile()
            profiler.runcall(measured, lambda: echo.forward(SMALL, broker=broker), calls)
        client = pstats.Stats(profiler)
    worker_stats = pstats.Stats(profiled)
    for side, stats, named, root in (
        ("client", client, CLIENT_STAGES, ("where_time_goes.py", "measured")),
        ("worker", worker_stats, WORKER_STAGES, ("loop.py", "_turn")),
    ):
        table = stats.stats  # (file, line, function) -> (calls, calls, own time, inclusive time, callers)

        def inclusive(file: str, function: str, caller: str | None = None) -> float:
            """Its inclusive time; with ``caller``, only what it spent called from that function."""
            found = [v for (f, _, fn), v in table.items() if f.endswith(file) and fn == function]
            if caller is None:
                return sum(v[3] for v in found)
            return sum(c[3] for v in found for (_, _, by), c in v[4].items() if by == caller)

        # waiting: in a poll, a lock, or (the client, which waits for its answer inside the
        # receive, RCVTIMEO) a blocking receive, which cProfile counts as the own time of
        # `receive_frames` (pyzmq's compiled recv is not seen by it): the receive itself is
        # then left out of the client's figures too, a few µs
        waiting = sum(
            v[2]
            for (f, _, fn), v in table.items()
            if fn in ("poll", "wait")
            or "acquire" in fn
            or (side == "client" and f.endswith("sockets.py") and fn == "receive_frames")
        )
        total = inclusive(*root) - waiting
        out.append(f"{side}: {1e6 * total / calls:.0f} µs of Python per call under the profiler")
        shown = 0.0
        for name, functions in named:
            share = sum(inclusive(*f) for f in functions) / total
            shown += share
            out.append(f"  {name:44} {100 * share:5.1f}%  {share * cpu[side]:6.0f} µs")
        out.append(
            f"  {'the rest (the engine, the loop, the channel)':44} {100 * (1 - shown):5.1f}%  "
            f"{(1 - shown) * cpu[side]:6.0f} µs"
        )
    return "\n".join(out)


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
        rows = [
            ("memcpy into memory already touched", lambda: np.copyto(y, x)),
            ("memcpy into fresh memory (page faults)", lambda: x.copy()),
            ("write a new file in /dev/shm", fresh_file),
        ]
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
_WAITING = (
    "Poller.poll",
    "Socket.poll",
    "select",
    "EpollSelector.select",
    "Popen._wait",
    "Popen.wait",
    "Event.wait",
    "Condition.wait",
    "sleep",
    "Thread.join",
)


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
        out.append(
            f"== {process}: {total} samples working in the measured part, "
            f"{waiting[process]} more waiting (in poll, select, wait)"
        )
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
    if argv == ["placement"]:
        print(placement())
        return 0
    if argv == ["ceilings"]:
        print(ceilings())
        return 0
    if argv[:1] == ["stages"] and len(argv) <= 2:
        print(stages(*(int(a) for a in argv[1:])))
        return 0
    if len(argv) == 2 and argv[0] == "summarise":
        print(summarise(argv[1]))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
