"""Case (k): one key floods a keyed standalone broker in every way its admission step bounds,
while another key forwards and asks.

The flooding key (a client key and a worker key of one attacker, in a process of its own) at
once: sends ``Relay(host, lane, Bye)`` for exchanges that are not open from eight
connections; asks ``Hosts`` and ``Where`` from eight more and reads nothing; and, as a dialed
worker, answers 4 MiB messages without end into an exchange whose client never reads.
Meanwhile another key forwards a small value to an honest dialed worker through the broker
(Relayed) and asks ``Hosts`` on a connection of its own. The rows report that key's median
(and p99) forward and ``Hosts`` times, and the broker's peak resident memory (``VmHWM``)
against what it holds by its stated bounds (`outbox.ALL_BYTES` in all).

Run alone: ``python benchmarks/admission.py [SECONDS]`` prints the figures as JSON. The
flooder's process is this file too: ``python benchmarks/admission.py --flood URL RING``
floods until its stdin closes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CONNECTIONS = 8  # connections of each of the flooding client's floods


def _ring(folder: Path) -> dict:
    """The broker's keys, an honest client and worker key, and the attacker's two."""
    from somatize.fabric.curve import make_pair

    allow, workers = folder / "allow", folder / "workers"
    allow.mkdir(mode=0o755)
    workers.mkdir(mode=0o755)
    ring = {"dir": str(folder), "allow": str(allow), "workers": str(workers)}
    for name, into in (
        ("broker", None),
        ("alice", allow),
        ("honest", workers),
        ("mallory", allow),
        ("mallory_worker", workers),
    ):
        public, secret = make_pair(folder / "keys", name)
        ring[name], ring[name + "_secret"] = str(public), str(secret)
        if into is not None:
            (into / f"{name}.key").write_bytes(public.read_bytes())
    return ring


def _dealer(url: str, ring: dict, who: str, *, hwm: int | None = None, deaf: bool = False):
    import zmq

    from somatize.fabric.curve import read_public, read_secret

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    if hwm is not None:  # a flooder: it queues all it likes, and takes all it is sent (a
        # full queue of answers would stall its own connection, and flatter the broker)
        sock.sndhwm = hwm
        sock.rcvhwm = 0
    if deaf:  # it reads nothing: what is sent to it stays at the broker
        sock.rcvhwm = 1
        sock.rcvbuf = 4096
    sock.curve_publickey, sock.curve_secretkey = read_secret(ring[who + "_secret"])
    sock.curve_serverkey = read_public(ring["broker"])
    sock.connect(url)
    return sock


def flood(url: str, ring: dict, stop: threading.Event) -> None:
    """Every flood of the attacker at once, until ``stop``; each thread counts what it sent."""
    import zmq

    from somatize.wire import Bye, Chunk, Hello, Hosts, Ready, Relay, Runtime, Where, decode, encode

    rt = Runtime.here(mode="project")
    sent = {"byes": 0, "questions": 0, "answers": 0}

    def byes() -> None:
        socks = [_dealer(url, ring, "mallory", hwm=0) for _ in range(CONNECTIONS)]
        frames = [encode(Relay(host="trap", lane=n + 1, inner=(*encode(Bye()), bytes(2048)))) for n in range(64)]
        while not stop.is_set():
            for sock in socks:
                for n in range(100):
                    sock.send_multipart(frames[n % 64], copy=False)
            sent["byes"] += 100 * len(socks)
            time.sleep(0)
        for sock in socks:
            sock.close(0)

    def questions() -> None:
        socks = [_dealer(url, ring, "mallory", hwm=0) for _ in range(CONNECTIONS)]
        asks = [encode(Hosts()), encode(Where("nowhere"))]
        while not stop.is_set():
            for sock in socks:
                for n in range(100):
                    sock.send_multipart(asks[n & 1])
            sent["questions"] += 100 * len(socks)
            time.sleep(0)
        for sock in socks:
            sock.close(0)

    def answers() -> None:
        worker = _dealer(url, ring, "mallory_worker", hwm=64)
        client = _dealer(url, ring, "mallory", deaf=True)
        try:
            worker.send_multipart(encode(Hello(rt, offering="trap")))
            if not worker.poll(20_000) or not isinstance(decode(worker.recv_multipart()), Ready):
                return
            client.send_multipart(encode(Relay(host="trap", inner=tuple(encode(Hello(rt))))))
            if not worker.poll(20_000):
                return
            exchange = decode(worker.recv_multipart()).exchange
            answer = encode(Relay(exchange=exchange, inner=tuple(encode(Chunk(1, bytes(4 << 20))))))
            while not stop.is_set():
                if worker.poll(100, zmq.POLLOUT):
                    worker.send_multipart(answer, copy=False)
                    sent["answers"] += 1
                while worker.poll(0):  # the broker's checks and Byes: read, never answered
                    worker.recv_multipart()
        finally:
            worker.close(0)
            client.close(0)

    threads = [threading.Thread(target=f, daemon=True) for f in (byes, questions, answers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    print(json.dumps(sent), flush=True)


def _median_p99(times: list[float]) -> tuple[float | None, float | None]:
    if not times:
        return None, None
    times = sorted(times)
    return 1000 * times[len(times) // 2], 1000 * times[min(len(times) - 1, int(len(times) * 0.99))]


def measure(seconds: float = 10.0) -> dict:
    from children import BROKER, BROKER_READY, Child, status
    from nodes import Echo

    from somatize import Broker
    from somatize.fabric.broker import outbox
    from somatize.fabric.curve import Keys
    from somatize.wire import Hosts, Listed, decode, encode

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), str(ROOT), env.get("PYTHONPATH", "")]))
    with tempfile.TemporaryDirectory(prefix="somatize-bench-admission-") as folder:
        ring = _ring(Path(folder))
        argv = [*BROKER, "--key", ring["broker_secret"], "--allow", ring["allow"], "--allow-workers", ring["workers"]]
        with Child(argv, announce=BROKER_READY) as broker:
            url = broker.endpoint
            worker = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "somatize.worker",
                    "--broker",
                    url,
                    "--offer",
                    "honest",
                    "--key",
                    ring["honest_secret"],
                    "--broker-key",
                    ring["broker"],
                ],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                cwd=ROOT,
                env=env,
            )
            flooder = None
            client = Broker.at(url, keys=Keys.client(ring["alice_secret"], server=ring["broker"]))
            asker = _dealer(url, ring, "alice")
            try:
                until = time.monotonic() + 60
                while not client.knows("honest") and time.monotonic() < until:
                    time.sleep(0.1)
                echo = Echo().named("echo").at("honest")
                for n in range(20):  # warm: the channel, the worker's imports
                    echo.forward(n, broker=client)
                rss_before = status(broker.pid, "VmRSS")
                flooder = subprocess.Popen(
                    [sys.executable, __file__, "--flood", url, json.dumps(ring)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    cwd=ROOT,
                    env=env,
                )
                time.sleep(1.0)  # the floods under way
                forwards, hosts, failed, unanswered = [], [], 0, 0
                until = time.monotonic() + seconds
                while time.monotonic() < until:
                    started = time.perf_counter()
                    try:
                        echo.forward(1, broker=client)
                        forwards.append(time.perf_counter() - started)
                    except Exception:  # noqa: BLE001 - counted, and shown
                        failed += 1
                    started = time.perf_counter()
                    asker.send_multipart(encode(Hosts()))
                    if asker.poll(5_000) and isinstance(decode(asker.recv_multipart()), Listed):
                        hosts.append(time.perf_counter() - started)
                    else:
                        unanswered += 1
                    time.sleep(0.02)
                peak = status(broker.pid, "VmHWM")
                rss = status(broker.pid, "VmRSS")
                flooder.stdin.close()
                said = json.loads(flooder.stdout.readline() or "{}")
                flooder.wait(30)
                flooder = None
                survived = broker.popen.poll() is None
            finally:
                asker.close(0)
                client.close()
                for proc in (flooder, worker):
                    if proc is not None:
                        proc.terminate()
                        try:
                            proc.wait(10)
                        except subprocess.TimeoutExpired:
                            proc.kill()
                            proc.wait(10)
    forward_ms, forward_p99 = _median_p99(forwards)
    hosts_ms, hosts_p99 = _median_p99(hosts)
    return {
        "sent": said,
        "forwards": len(forwards),
        "failed": failed,
        "hosts_asked": len(hosts) + unanswered,
        "unanswered": unanswered,
        "forward_median_ms": forward_ms,
        "forward_p99_ms": forward_p99,
        "hosts_median_ms": hosts_ms,
        "hosts_p99_ms": hosts_p99,
        "rss_before_mib": rss_before / 2**20,
        "rss_mib": rss / 2**20,
        "peak_mib": peak / 2**20,
        "bound_mib": outbox.ALL_BYTES / 2**20,
        "survived": bool(survived),
    }


def admission_rows(settings, floors) -> list:  # noqa: ANN001  (cases.Settings, cases.Floors)
    from table import Row, at_most

    got = measure(10.0 if settings.calls >= 1000 else 3.0)  # a quick run makes few calls
    sent = got["sent"]
    flood = (
        f"{sent.get('byes', 0):,} Byes ending nothing, {sent.get('questions', 0):,} unread questions, "
        f"{sent.get('answers', 0):,} 4 MiB answers nobody reads"
    )
    rows = []
    for what, key in (("forward", "forward"), ("Hosts", "hosts")):
        median, p99 = got[key + "_median_ms"], got[key + "_p99_ms"]
        lost = got["failed"] if key == "forward" else got["unanswered"]
        asked = got["forwards"] + got["failed"] if key == "forward" else got["hosts_asked"]
        rows.append(
            Row(
                "k",
                f"another key's relayed {what} while one key floods ({flood})"
                if key == "forward"
                else f"another key's {what} meanwhile",
                f"median {median:.1f} ms, p99 {p99:.1f} ms, {lost} of {asked} lost"
                if median is not None
                else "never answered",
                target="median <= 100 ms",
                verdict=at_most(median, 100.0) if median is not None else "MISS",
            )
        )
    rows.append(
        Row(
            "k",
            "the broker's memory meanwhile",
            f"peak {got['peak_mib']:.0f} MiB (RSS {got['rss_mib']:.0f} MiB, {got['rss_before_mib']:.0f} MiB before)",
            target=f"<= {got['bound_mib']:.0f} MiB",
            verdict=at_most(got["peak_mib"], got["bound_mib"]) if got["survived"] else "MISS",
        )
    )
    return rows


if __name__ == "__main__":
    sys.path[:0] = [str(HERE), str(ROOT)]
    if len(sys.argv) > 1 and sys.argv[1] == "--flood":
        stop = threading.Event()
        threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
        flood(sys.argv[2], json.loads(sys.argv[3]), stop)
    else:
        print(json.dumps(measure(float(sys.argv[1]) if len(sys.argv) > 1 else 10.0), indent=1))
