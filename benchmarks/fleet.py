"""Case (h): a fleet on one broker. N workers dial in to one standalone broker as real worker
loops (many to a process, on threads, as a cluster's nodes would each run one), and clients
forward a small value to every host through the broker (Relayed).

The row reports what the fleet costs the broker: how long until every host is registered,
its resident memory and open descriptors per worker, its CPU while the fleet idles, its
CPU per relayed forward, and forwards a second for one client and for four at once.

Run alone: ``python benchmarks/fleet.py [N]`` prints the figures as JSON;
``python benchmarks/fleet.py --first-contact [N]`` what a client's first forward to each of
N hosts costs each side against a repeated one. The workers'
processes are this file too: ``python benchmarks/fleet.py --workers URL PREFIX COUNT``
runs COUNT dialed worker loops named PREFIX00000... until its stdin closes.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PER_PROCESS = 125  # worker loops in one process
IN_FLIGHT = 16  # the pool case's forwards in flight (100 B each: the broker's Python is the bound)


def serve_workers(
    url: str, prefix: str, count: int, patience: float = 5.0, mode: str = "project", start: int | None = None
) -> None:
    """Run ``count`` dialed worker loops on threads of this process until stdin closes;
    named PREFIX00000..., or, given ``start``, members PREFIX<start>, PREFIX<start + 1>...
    of a pool (PREFIX ending in '#')."""
    import zmq

    from somatize.fabric.worker.loop import WorkerLoop

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    zmq.Context.instance().set(zmq.MAX_SOCKETS, max(1023, 4 * count + 64))  # before the first socket
    loops = []
    for n in range(count):
        loop = WorkerLoop(mode=mode, patience=patience)
        loop.dial(url, f"{prefix}{n:05d}" if start is None else f"{prefix}{start + n}")
        threading.Thread(target=loop.serve, daemon=True, name=f"worker-{n}").start()
        loops.append(loop)
    print(f"dialing {count}", flush=True)
    sys.stdin.read()  # until whoever started us closes our stdin (or goes away)
    for loop in loops:
        loop.stopping.set()
    time.sleep(0.5)  # a turn of each loop: they close their sockets
    sys.stdout.flush()
    os._exit(0)


class Fleet:
    """``count`` dialed workers in processes of `PER_PROCESS`, started and stopped together."""

    def __init__(
        self, url: str, count: int, *, prefix: str = "node", patience: float = 5.0, env=None, pool: str | None = None
    ) -> None:
        self.procs = []
        for first in range(0, count, PER_PROCESS):
            size = min(PER_PROCESS, count - first)
            # each process numbers its own loops from 0: give each its own prefix (a pool's
            # members are numbered across the processes instead)
            part = f"{prefix}{first // PER_PROCESS:02d}x" if pool is None else f"{pool}#"
            extra = [] if pool is None else [str(first)]
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, __file__, "--workers", url, part, str(size), str(patience), *extra],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    cwd=ROOT,
                    env=env,
                )
            )
        if pool is None:
            self.hosts = [
                f"{prefix}{first // PER_PROCESS:02d}x{n:05d}"
                for first in range(0, count, PER_PROCESS)
                for n in range(min(PER_PROCESS, count - first))
            ]
        else:
            self.hosts = [f"{pool}#{n}" for n in range(count)]
        for proc in self.procs:
            proc.stdout.readline()

    def registered(self, client) -> bool:  # noqa: ANN001 - a somatize.Broker
        """Whether ``client`` sees every host of the fleet (`Broker.hosts` is the listing it
        last had; `Broker.knows` asks again for a host it lacks)."""
        listed = set(client.hosts())
        missing = next((h for h in self.hosts if h not in listed), None)
        return missing is None or (client.knows(missing) and set(self.hosts) <= set(client.hosts()))

    def close(self) -> None:
        for proc in self.procs:
            try:
                proc.stdin.close()
            except OSError:
                pass
        for proc in self.procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def measure(count: int = 1000, forwards: int = 2000, idle_s: float = 5.0) -> dict:
    from children import BROKER, BROKER_READY, Child, cpu_seconds, status
    from nodes import Echo  # benchmarks/nodes.py: the workers import it by name (project mode)

    from somatize import Broker

    broker = Child(BROKER, announce=BROKER_READY)
    fleet = None
    try:
        url = broker.endpoint
        rss_empty = status(broker.pid, "VmRSS")
        fds_empty = len(os.listdir(f"/proc/{broker.pid}/fd"))
        started = time.perf_counter()
        fleet = Fleet(url, count)
        client = Broker.at(url)
        try:
            until = time.monotonic() + 120 + count / 10
            while not fleet.registered(client) and time.monotonic() < until:
                time.sleep(0.05)
            registered = time.perf_counter() - started
            registered_count = len(set(fleet.hosts) & set(client.hosts()))
            time.sleep(1.0)
            rss = status(broker.pid, "VmRSS")
            fds = len(os.listdir(f"/proc/{broker.pid}/fd"))
            cpu0, t0 = cpu_seconds(broker.pid), time.perf_counter()
            time.sleep(idle_s)
            idle = (cpu_seconds(broker.pid) - cpu0) / (time.perf_counter() - t0)
        finally:
            client.close()
        echo = Echo()
        rates = {}
        for clients in (1, 4):
            done, failed = [0], [0]

            def run(share: list[str]) -> None:
                b = Broker.at(url)
                try:
                    for host in share:
                        try:
                            echo.at(host).forward(1, broker=b)
                            done[0] += 1
                        except Exception:  # noqa: BLE001 - counted, and shown
                            failed[0] += 1
                finally:
                    b.close()

            hosts = [fleet.hosts[n % count] for n in range(forwards)]
            shares = [hosts[k::clients] for k in range(clients)]
            cpu0, t0 = cpu_seconds(broker.pid), time.perf_counter()
            threads = [threading.Thread(target=run, args=(share,)) for share in shares]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            took = time.perf_counter() - t0
            rates[clients] = {
                "per_s": done[0] / took,
                "failed": failed[0],
                "cpu_ms_per_forward": 1000 * (cpu_seconds(broker.pid) - cpu0) / max(1, done[0]),
            }
        time.sleep(2.0)
        rss_after = status(broker.pid, "VmRSS")
        return {
            "workers": count,
            "registered": registered_count,
            "registered_s": registered,
            "rss_per_worker_kib": (rss - rss_empty) / count / 1024,
            "fds_per_worker": (fds - fds_empty) / count,
            "idle_cpu_percent": 100 * idle,
            "rss_after_clients_mib": rss_after / 2**20,
            "rss_registered_mib": rss / 2**20,
            "one_client": rates[1],
            "four_clients": rates[4],
        }
    finally:
        if fleet is not None:
            fleet.close()
        broker.stop()


def pool_map(count: int = 1000, inputs: int = 20_000) -> dict:
    """``count`` dialed workers as one pool (``fleet#0`` ...), and one client mapping
    ``inputs`` tiny inputs over it: inputs a second, and how many members answered."""
    from children import BROKER, BROKER_READY, Child
    from nodes import Echo

    from somatize import Broker

    broker = Child(BROKER, announce=BROKER_READY)
    fleet = None
    try:
        fleet = Fleet(broker.endpoint, count, pool="fleet")
        with Broker.at(broker.endpoint) as client:
            until = time.monotonic() + 120 + count / 10
            while len(client.members("fleet", refresh=True)) < count and time.monotonic() < until:
                time.sleep(0.2)
            members = len(client.members("fleet"))
            seen: set[str] = set()
            lock = threading.Lock()

            def told(fact) -> None:  # noqa: ANN001
                if fact["fact"] == "left":
                    with lock:
                        seen.add(fact["host"])

            echo = Echo().named("echo").at("fleet")
            started = time.perf_counter()
            # tiny inputs: a few in flight keep the broker busy, a thread per member would not
            answered = sum(
                1 for _ in echo.map(range(inputs), broker=client, watching=told, errors="return", in_flight=IN_FLIGHT)
            )
            took = time.perf_counter() - started
        return {
            "members": members,
            "inputs": inputs,
            "answered": answered,
            "per_s": inputs / took,
            "members_used": len(seen),
        }
    finally:
        if fleet is not None:
            fleet.close()
        broker.stop()


def first_and_again(count: int = 250, rounds: int = 2) -> dict:
    """What a client's first forward to a host costs against a repeated one: a new client
    forwards once to each of ``count`` dialed hosts, then once more, ``rounds`` times. Per
    forward: wall time, and the CPU time of the client (this process), the broker and the
    workers' processes (from ``/proc``). Not a row of the table: the breakdown behind case
    h, whose clients meet half their hosts for the first time."""
    from children import BROKER, BROKER_READY, Child, cpu_seconds
    from nodes import Echo

    from somatize import Broker

    broker = Child(BROKER, announce=BROKER_READY)
    fleet = None
    try:
        fleet = Fleet(broker.endpoint, count)
        with Broker.at(broker.endpoint) as probe:
            until = time.monotonic() + 60 + count / 10
            while not fleet.registered(probe) and time.monotonic() < until:
                time.sleep(0.05)
        workers = [p.pid for p in fleet.procs]
        echo, got = Echo(), {"first": [], "again": []}
        for _ in range(rounds):
            with Broker.at(broker.endpoint) as client:
                for what in ("first", "again"):
                    wall, mine, theirs = time.perf_counter(), time.process_time(), cpu_seconds(broker.pid)
                    others = sum(cpu_seconds(pid) for pid in workers)
                    for host in fleet.hosts:
                        echo.at(host).forward(1, broker=client)
                    per = 1000 / len(fleet.hosts)  # ms per forward
                    got[what].append(
                        {
                            "wall_ms": (time.perf_counter() - wall) * per,
                            "client_ms": (time.process_time() - mine) * per,
                            "broker_ms": (cpu_seconds(broker.pid) - theirs) * per,
                            "workers_ms": (sum(cpu_seconds(pid) for pid in workers) - others) * per,
                        }
                    )
        return got
    finally:
        if fleet is not None:
            fleet.close()
        broker.stop()


def fleet_rows(settings, floors) -> list:  # noqa: ANN001  (cases.Settings, cases.Floors)
    from table import Row, at_least, at_most

    n = settings.fleet
    got = measure(n, settings.fleet_forwards, idle_s=10.0 if n >= 1000 else 3.0)
    one, four = got["one_client"], got["four_clients"]
    return [
        Row(
            "h",
            f"{n:,} dialed workers registered",
            f"{got['registered']:,} in {got['registered_s']:.1f} s",
            target="all",
            verdict="PASS" if got["registered"] == n else "MISS",
        ),
        Row(
            "h",
            "broker memory and descriptors a worker",
            f"{got['rss_per_worker_kib']:.1f} KiB, {got['fds_per_worker']:.2f} fds",
            target="<= 40 KiB",
            verdict=at_most(got["rss_per_worker_kib"], 40.0),
        ),
        Row(
            "h",
            f"idle broker CPU with {n:,} workers",
            f"{got['idle_cpu_percent']:.1f}%",
            target="<= 2%",
            verdict=at_most(got["idle_cpu_percent"], 2.0),
        ),
        Row(
            "h",
            "relayed forwards a second, 1 client, a new host each",
            f"{one['per_s']:,.0f}/s, {one['failed']} failed, {one['cpu_ms_per_forward']:.2f} ms broker CPU each",
        ),
        Row(
            "h",
            "relayed forwards a second, 4 clients at once",
            f"{four['per_s']:,.0f}/s, {four['failed']} failed, {four['cpu_ms_per_forward']:.2f} ms broker CPU each",
            target=">= 1,000/s, none failed",
            verdict=at_least(four["per_s"], 1000.0) if not four["failed"] else "MISS",
        ),
        Row(
            "h",
            "broker memory after the clients left",
            f"{got['rss_after_clients_mib']:.0f} MiB ({got['rss_registered_mib']:.0f} MiB registered)",
            target="within 10%",
            verdict=at_most(got["rss_after_clients_mib"], 1.1 * got["rss_registered_mib"]),
        ),
    ] + _pool_rows(n, 20_000 if n >= 1000 else 1000)


def _pool_rows(n: int, inputs: int) -> list:
    from table import Row, at_least

    got = pool_map(n, inputs)
    every = got["members_used"] == got["members"] == n and got["answered"] == inputs
    return [
        Row(
            "h",
            f"map of {inputs:,} inputs of 100 B over {n:,} dialed workers as one pool, in_flight={IN_FLIGHT}",
            f"{got['per_s']:,.0f} inputs/s, {got['members_used']:,} members used, {got['answered']:,} answered",
            target=">= 1,000/s, every member",
            verdict=at_least(got["per_s"], 1000.0) if every else "MISS",
        )
    ]


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--workers":
        serve_workers(
            sys.argv[2],
            sys.argv[3],
            int(sys.argv[4]),
            float(sys.argv[5]) if len(sys.argv) > 5 else 5.0,
            start=int(sys.argv[6]) if len(sys.argv) > 6 else None,
        )
    elif len(sys.argv) > 1 and sys.argv[1] == "--first-contact":
        print(json.dumps(first_and_again(int(sys.argv[2]) if len(sys.argv) > 2 else 250), indent=1))
    else:
        print(json.dumps(measure(int(sys.argv[1]) if len(sys.argv) > 1 else 1000), indent=1))
