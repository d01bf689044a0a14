"""Case (g): a flooding tenant. One client floods a standalone broker with control requests
from several connections and never reads an answer; meanwhile another client asks ``Hosts``
on a connection of its own. The row reports that client's answer time (median and p99) and
the broker's resident memory while the flood goes on (its peak, ``VmHWM``): the broker
answers the other tenant within 100 ms at the median, and holds a bounded amount however
long the flood lasts (a peer that does not read loses its answers and never stalls the
loop; one that asks faster than the loop reads has its connection closed, and with it what
it had queued).

Run alone: ``python benchmarks/flooding.py [SECONDS]`` prints the figures as JSON.
"""

from __future__ import annotations

import json
import sys
import threading
import time

import zmq

FLOODERS = 8  # connections of the flooding client


def measure(seconds: float = 10.0) -> dict:
    from children import BROKER, BROKER_READY, Child, status

    from somatize.wire import Hosts, Where, encode

    with Child(BROKER, announce=BROKER_READY) as broker:
        url = broker.endpoint
        ctx = zmq.Context.instance()
        stop = threading.Event()
        sent = [0]

        def flood() -> None:
            socks = []
            for _ in range(FLOODERS):
                s = ctx.socket(zmq.DEALER)
                s.linger = 0
                s.sndhwm = 0  # the flooder queues as much as it likes; the broker must not
                s.connect(url)
                socks.append(s)
            asks = [encode(Hosts()), encode(Where("nowhere"))]
            while not stop.is_set():
                for s in socks:
                    for _ in range(200):
                        s.send_multipart(asks[sent[0] & 1])
                        sent[0] += 1
                time.sleep(0)  # the answers are never read
            for s in socks:
                s.close(0)

        other = ctx.socket(zmq.DEALER)
        other.linger = 0
        other.connect(url)
        other.send_multipart(encode(Hosts()))
        assert other.poll(10_000), "the broker did not answer before the flood"
        other.recv_multipart()
        rss_before = status(broker.pid, "VmRSS")
        flooder = threading.Thread(target=flood, daemon=True)
        flooder.start()
        latencies, unanswered = [], 0
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            started = time.perf_counter()
            other.send_multipart(encode(Hosts()))
            if other.poll(5_000):
                other.recv_multipart()
                latencies.append(time.perf_counter() - started)
            else:
                unanswered += 1
            time.sleep(0.05)
        peak = status(broker.pid, "VmHWM")
        rss = status(broker.pid, "VmRSS")
        stop.set()
        flooder.join(10)
        time.sleep(1.0)  # the flooder's connections close with their queues full
        other.send_multipart(encode(Hosts()))
        survived = broker.popen.poll() is None and other.poll(5_000)
        other.close(0)
        latencies.sort()
        return {
            "flood_messages": sent[0],
            "asked": len(latencies) + unanswered,
            "unanswered": unanswered,
            "median_ms": 1000 * latencies[len(latencies) // 2] if latencies else None,
            "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] if latencies else None,
            "rss_before_mib": rss_before / 2**20,
            "rss_mib": rss / 2**20,
            "peak_mib": peak / 2**20,
            "survived": bool(survived),
        }


def flood_rows(settings, floors) -> list:  # noqa: ANN001  (cases.Settings, cases.Floors)
    from table import Row, at_most

    got = measure()
    median, p99 = got["median_ms"], got["p99_ms"]
    rows = [
        Row(
            "g",
            f"another tenant's Hosts while one floods ({got['flood_messages']:,} unread requests)",
            f"median {median:.1f} ms, p99 {p99:.1f} ms, {got['unanswered']} of {got['asked']} unanswered"
            if median is not None
            else "never answered",
            target="median <= 100 ms",
            verdict=at_most(median, 100.0) if median is not None else "MISS",
        ),
        Row(
            "g",
            "the broker's memory while flooded",
            f"peak {got['peak_mib']:.0f} MiB (RSS {got['rss_mib']:.0f} MiB, {got['rss_before_mib']:.0f} MiB before)",
            target="bounded (<= 512 MiB)",
            verdict=at_most(got["peak_mib"], 512.0),
        ),
        Row(
            "g",
            "the broker after the flooder left with its queues full",
            "serving" if got["survived"] else "gone",
            target="serving",
            verdict="PASS" if got["survived"] else "MISS",
        ),
    ]
    return rows


if __name__ == "__main__":
    print(json.dumps(measure(float(sys.argv[1]) if len(sys.argv) > 1 else 10.0), indent=1))
