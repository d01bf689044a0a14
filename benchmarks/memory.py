"""Case (m): the memory a bulk round trip holds, per process, per path.

Each path and kind is measured in a fresh process (``python benchmarks/memory.py PATH KIND
NBYTES``), so one path's buffers never inflate another's figures. That process makes the
value, warms the path once (spawning the worker, sending the artifact), then resets the peak
resident set (``VmHWM``) of itself and of every process it started (writing ``5`` to
``/proc/PID/clear_refs``), runs three round trips, and reads each peak again. A row gives
each process's peak and how far it rose over what it held before the round trips, in units
of the cargo: ``+1.0x`` is one more cargo-sized buffer alive at the peak (one copy held),
``+0.0x`` none. A copy made into memory that was already resident (a pooled segment) does
not raise the peak: the copy budget in ``docs/performance.md`` says which copies those are.

The client is the measuring process; Direct and Mount workers are its children; Relayed
has a standalone broker and a dialing worker, both its children too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROUNDS = 3
PATHS = ("raw", "Direct", "Mount", "Mount views", "Relayed")


def _status(pid: int | str, field: str) -> int:
    """A ``/proc/PID/status`` figure in bytes (``VmHWM``, ``VmRSS``); 0 when it cannot be read."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _reset_peak(pid: int | str) -> None:
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux 4.0+)
    except OSError:
        pass


def _children() -> list[int]:
    pids: list[int] = []
    for task in os.listdir("/proc/self/task"):
        try:
            pids += [int(p) for p in Path(f"/proc/self/task/{task}/children").read_text().split()]
        except OSError:
            continue
    return sorted(set(pids))


def _role(pid: int) -> str:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "gone"
    if "somatize.broker" in cmdline:
        return "broker"
    if "floor.py" in cmdline:
        return "echo server"
    return "worker"


def probe(path: str, kind: str, nbytes: int) -> dict[str, dict[str, int]]:
    """Run in the fresh process: the peaks of this process and its children, in bytes."""
    here = Path(__file__).resolve().parent
    sys.path[:0] = [str(here), str(here.parent)]
    import cases  # noqa: F401  (sets nothing up by itself)
    import paths
    from nodes import Echo

    if kind == "torch":
        import torch

        import somatize.torch  # noqa: F401

        value = torch.ones(nbytes // 4, dtype=torch.float32)
    else:
        import numpy as np

        value = np.ones(nbytes // 4, np.float32)
    if path == "raw":
        setup = cases.floor()
    else:
        setup = {
            "Direct": paths.direct,
            "Mount": paths.mount,
            "Relayed": paths.relayed,
            "Mount views": getattr(paths, "mount_views", None),
        }[path]()
    with setup as through:
        if path == "raw":
            if kind != "numpy":
                raise SystemExit("the raw floor sends NumPy bytes only")

            def call() -> object:
                return through.array(value)
        else:
            echo = Echo().named("echo").at("w1")

            def call() -> object:
                return echo.forward(value, broker=through)

        out = call()  # warm: spawn, connect, provision
        del out
        pids = {"client": os.getpid(), **{f"{_role(p)}": p for p in _children()}}
        before = {role: _status(pid, "VmRSS") for role, pid in pids.items()}
        for pid in pids.values():
            _reset_peak(pid)
        for _ in range(ROUNDS):
            out = call()
            del out
        peaks = {role: _status(pid, "VmHWM") for role, pid in pids.items()}
    return {role: {"before": before[role], "peak": peaks[role]} for role in pids}


def memory_rows(settings, floors) -> list:  # noqa: ANN001  (cases.Settings, cases.Floors)
    from table import Row

    nbytes = max(settings.sizes)
    kinds = ["numpy"]
    try:
        import torch  # noqa: F401

        import somatize.torch  # noqa: F401

        kinds.append("torch")
    except Exception:
        pass
    rows = []
    for path in PATHS:
        if path == "Mount views":
            import paths

            if getattr(paths, "mount_views", None) is None:
                continue
        for kind in kinds:
            if path == "raw" and kind != "numpy":
                continue
            done = subprocess.run(
                [sys.executable, __file__, path, kind, str(nbytes)], capture_output=True, text=True, timeout=600
            )
            if done.returncode != 0:
                tail = (done.stderr.strip().splitlines() or ["no output"])[-1][:80]
                rows.append(Row("m", f"{path}, {kind} {nbytes >> 20} MiB", "-", verdict=f"FAILED: {tail}"))
                continue
            figures = json.loads(done.stdout.strip().splitlines()[-1])
            parts = []
            for role in ("client", "broker", "worker", "echo server"):
                if role in figures:
                    f = figures[role]
                    held = max(0, f["peak"] - f["before"]) / nbytes
                    parts.append(f"{role} {f['peak'] >> 20} MiB (+{held:.1f}x)")
            name = "raw pyzmq echo" if path == "raw" else path
            rows.append(Row("m", f"{name}, {kind} {nbytes >> 20} MiB: peak RSS (+cargo held)", "; ".join(parts)))
    return rows


if __name__ == "__main__":
    path, kind, nbytes = sys.argv[1], sys.argv[2], int(sys.argv[3])
    print(json.dumps(probe(path, kind, nbytes)))
