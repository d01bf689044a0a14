"""What the reliability tests share: processes watched from outside, and a fuzzer.

``Proc`` is conftest's ``Process``: it starts a command (a worker, a broker, a client
script), reads the line it announces itself with, sends its stderr to a file (read at any
time, never a pipe that fills and stalls the child), and is always reaped.

``Fuzzer`` makes the frames of one multipart message at a time, from a seeded generator:
random frame lists, and real messages (built with ``somatize.wire.encode``) mutated the ways
libzmq's own fuzzers mutate theirs (bytes flipped, frames truncated, dropped, duplicated,
extended) plus a structure-aware mutation of the MessagePack header. The real messages
include the carriers (``Relay``, ``Begin``, ``Chunk``, ``Credit``, ``Mounted``), so their
headers are mutated like any other; for a broker some messages also go out inside a
``Relay`` to a worker that dialed in, which then gets the mutated message as its cargo.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
from conftest import Process

SUPPORT = Path(__file__).resolve().parent
TESTS = SUPPORT.parent
ROOT = TESTS.parent


def wait_until(fact, seconds: float, what: str):
    """Poll ``fact()`` until it is true; fail naming ``what`` past ``seconds``."""
    until = time.monotonic() + seconds
    while True:
        found = fact()
        if found:
            return found
        if time.monotonic() > until:
            raise AssertionError(f"{what} did not happen within {seconds:g} s")
        time.sleep(0.02)


def key_ring(folder: Path, *, clients: tuple[str, ...], workers: tuple[str, ...], others: tuple[str, ...] = ()) -> dict:
    """A broker's key pair and one pair per name, under ``folder``: ``clients`` in its
    ``allow`` folder, ``workers`` in its ``workers`` folder (may offer hosts), ``others``
    allowed nowhere. Maps each name to its public key file, ``name + "_secret"`` to its
    secret one, and ``"dir"``, ``"allow"``, ``"workers"`` to the folders."""
    from somatize.fabric.curve import make_pair

    allow, offer = folder / "allow", folder / "workers"
    allow.mkdir(mode=0o755)
    offer.mkdir(mode=0o755)
    out: dict = {"dir": folder, "allow": allow, "workers": offer}
    for name in ("broker", *clients, *workers, *others):
        out[name], out[name + "_secret"] = make_pair(folder / "keys", name)
    for name in clients:
        (allow / f"{name}.key").write_bytes(out[name].read_bytes())
    for name in workers:
        (offer / f"{name}.key").write_bytes(out[name].read_bytes())
    return out


def child_env() -> dict:
    """This environment, with somatize and the tests folder importable in a child."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), str(SUPPORT), str(TESTS), env.get("PYTHONPATH", "")]))
    return env


def rss_kib(pid: int, field: str = "VmRSS") -> int:
    """A process's resident memory (or another /proc status field), in KiB."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"/proc/{pid}/status has no {field}")


# The one process helper of the suite lives in conftest; this module's name for it stays.
Proc = Process


def crashed(returncode: int | None) -> bool:
    """Whether an exit code says the process crashed (anything but 0, or our own SIGTERM)."""
    return returncode not in (None, 0, -signal.SIGTERM)


# -- the fuzzer ----------------------------------------------------------------------------

#: The biggest stream a fuzzed ``Begin`` may announce (see ``Fuzzer.safe``).
SAFE_STREAM = 1 << 20
#: The stream number of every stream piece in the corpus: a fuzzed ``Chunk`` or ``Credit``
#: can meet a fuzzed ``Begin``.
FUZZ_SID = 77

_EDGE_VALUES: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    1,
    2**31 - 1,
    2**31,
    2**32,
    2**63 - 1,
    -(2**63),
    2**64 - 1,
    0.5,
    float("nan"),
    float("inf"),
    "",
    "x",
    "sha256:" + "0" * 64,
    "a" * 5000,
    "\u00e9\u4e2d",
    b"",
    b"\x00" * 40,
    [],
    [1],
    [[[[]]]],
    {},
    {"t": "Work"},
    ["step", 0],
    ["seq", []],
    ["par", [["step", 0], ["step", 99]]],
    ["T"],
    ["N", "<f8", [2, 2], 0],
    ["B", 0],
    ["B", 7],
    "Relay",
    "Begin",
    "Chunk",
    "Credit",
    "Mounted",
    [1 << 40],
    [0, 1 << 33],
    FUZZ_SID,
]


class Fuzzer:
    """Seeded frames for one multipart message at a time.

    ``corpus`` is a list of real messages, each a list of frames. ``relay`` (for a broker)
    is a host name: some messages go out inside ``Relay(host=relay)``, so the broker
    forwards them to the worker serving it.
    """

    def __init__(self, seed: int, corpus: list[list[bytes]], *, relay: str | None = None) -> None:
        self.rng = random.Random(seed)
        self.corpus = corpus
        self.relay = relay
        self.counts = {"random": 0, "mutated": 0, "structural": 0, "valid": 0, "relayed": 0, "tamed": 0}

    def message(self) -> list[bytes]:
        roll = self.rng.random()
        if roll < 0.25:
            self.counts["random"] += 1
            frames = self.random_frames()
        elif roll < 0.45:
            self.counts["structural"] += 1
            frames = self.structural(list(self.rng.choice(self.corpus)))
        elif roll < 0.95:
            self.counts["mutated"] += 1
            frames = self.mutate(list(self.rng.choice(self.corpus)))
        else:
            self.counts["valid"] += 1
            frames = list(self.rng.choice(self.corpus))
        if self.relay is not None and self.rng.random() < 0.3:
            self.counts["relayed"] += 1
            frames = relayed(self.relay, frames or [b""])
        tamed = self.safe(frames)
        self.counts["tamed"] += tamed is not frames
        return tamed or [b""]

    def random_frames(self) -> list[bytes]:
        rng = self.rng
        out = []
        for _ in range(rng.choice([1, 1, 1, 2, 2, 3, 5, 9])):
            size = rng.choice([0, 1, 2, 8, 30, 100, 1000, 70_000])
            frame = rng.randbytes(rng.randint(0, size))
            if rng.random() < 0.3:  # something MessagePack-shaped
                variant = rng.choice(["Hello", "Work", "Zap", "Where", "Relay", "Begin", "Chunk", "Credit", "Mounted"])
                frame = msgpack.packb({"v": rng.choice([1, 0, 2]), "t": variant}) + frame[:20]
            out.append(frame)
        return out

    def mutate(self, frames: list[bytes]) -> list[bytes]:
        rng = self.rng
        for _ in range(rng.choice([1, 1, 2, 3])):
            if not frames:
                frames = [b""]
            i = rng.randrange(len(frames))
            frame = bytearray(frames[i])
            how = rng.choice(
                ["flip", "flip", "truncate", "drop", "duplicate", "extend", "insert", "swap", "splice", "empty"]
            )
            if how == "flip" and frame:
                for _ in range(rng.choice([1, 1, 2, 8])):
                    frame[rng.randrange(len(frame))] ^= 1 << rng.randrange(8)
                frames[i] = bytes(frame)
            elif how == "truncate":
                frames[i] = bytes(frame[: rng.randrange(len(frame) + 1)])
            elif how == "drop" and len(frames) > 1:
                del frames[i]
            elif how == "duplicate":
                frames.insert(i, frames[i])
            elif how == "extend":
                frames[i] = bytes(frame) + rng.randbytes(rng.choice([1, 7, 100, 5000]))
            elif how == "insert":
                frames.insert(rng.randrange(len(frames) + 1), rng.randbytes(rng.choice([0, 3, 64])))
            elif how == "swap" and len(frames) > 1:
                j = rng.randrange(len(frames))
                frames[i], frames[j] = frames[j], frames[i]
            elif how == "splice":
                other = rng.choice(self.corpus)
                frames[i] = other[rng.randrange(len(other))]
            elif how == "empty":
                frames[i] = b""
        return frames

    def structural(self, frames: list[bytes]) -> list[bytes]:
        """Decode the header, replace one value deep inside it, encode it again."""
        try:
            header = msgpack.unpackb(frames[0], strict_map_key=False)
        except Exception:  # noqa: BLE001 - not MessagePack: mutate its bytes instead
            return self.mutate(frames)
        holders = []

        def walk(x: Any) -> None:
            if isinstance(x, dict):
                for k in list(x):
                    holders.append((x, k))
                    walk(x[k])
            elif isinstance(x, list):
                for k in range(len(x)):
                    holders.append((x, k))
                    walk(x[k])

        walk(header)
        if not holders:
            return self.mutate(frames)
        holder, key = self.rng.choice(holders)
        roll = self.rng.random()
        if roll < 0.7:
            holder[key] = self.rng.choice(_EDGE_VALUES)
        elif roll < 0.85 and isinstance(holder, dict):
            del holder[key]
            if self.rng.random() < 0.5:
                holder["extra"] = self.rng.choice(_EDGE_VALUES)
        else:
            holder[key] = [holder[key]] * self.rng.choice([2, 3, 50])
        return [msgpack.packb(header, use_bin_type=self.rng.random() < 0.8), *frames[1:]]

    @staticmethod
    def safe(frames: list[bytes]) -> list[bytes]:
        """Keep a stream's ``Begin`` from announcing more than ``SAFE_STREAM`` bytes.

        A worker takes a frame's memory only once all its chunks have arrived (tested on
        its own, with modest sizes: ``test_a_stream_does_not_make_a_worker_allocate_what_it_announces``);
        should that ever regress, a mutated size could ask this shared machine for
        gibibytes. So a ``Begin`` the target would accept, at the top or inside ``Relay``
        envelopes, is made to announce ``SAFE_STREAM // 2`` bytes when it announces more
        than ``SAFE_STREAM`` (or more than 1,000 frames). Every other message goes out as
        the fuzzer made it.
        """
        from somatize.errors import ProtocolError
        from somatize.wire import Begin, Relay, decode, encode, variant_of

        at = 0
        while at < len(frames):
            try:
                variant = variant_of(frames[at:])
            except ProtocolError:
                return frames  # refused before anything is allocated
            if variant is Relay:
                at += 1  # its cargo is the frames after its header
                continue
            if variant is not Begin:
                return frames
            try:
                begin = decode(frames[at:])
            except ProtocolError:
                return frames  # refused before anything is allocated
            if sum(begin.sizes) > SAFE_STREAM or len(begin.sizes) > 1000:
                tamed = bytes(memoryview(encode(Begin(begin.sid, (SAFE_STREAM // 2,)))[0]))
                frames = [*frames[:at], tamed, *frames[at + 1 :]]
            return frames
        return frames


def relayed(host: str, frames: list) -> list[bytes]:
    """``frames`` inside a ``Relay`` for the worker serving ``host``, as a client sends it to a broker."""
    from somatize.wire import Relay, encode

    return [bytes(memoryview(f)) for f in encode(Relay(host=host, inner=tuple(frames)))]


def corpus(packers: dict, *, host: str = "w1") -> list[list[bytes]]:
    """Real messages of every variant, carriers included (``host``: the one relays name), as frames, to mutate."""
    from somatize.wire import (
        Begin,
        Bye,
        Chunk,
        Credit,
        Done,
        Failed,
        Hello,
        Hosts,
        Listed,
        Located,
        Mounted,
        Provision,
        Ready,
        Recipe,
        Refusal,
        Relay,
        Runtime,
        Saw,
        Send,
        Where,
        Work,
        encode,
    )

    network, project, nodes = packers["network"], packers["project"], packers["nodes"]
    here = Runtime.here(mode="network")
    net_specs = tuple(network.spec(n) for n in nodes)
    proj_specs = tuple(project.spec(n) for n in nodes)
    digest = net_specs[0].target
    work = Work(1, Recipe(net_specs[:1], ("step", 0)), 41)
    done = Done(6, np.ones(5), {0: 1}, 12)
    messages: list[Any] = [
        Hello(here),
        Hello(Runtime.here(mode="project")),
        Hello(here, offering="fuzzed"),
        Provision(digest, network.artifact(digest)),
        Provision(net_specs[1].target, network.artifact(net_specs[1].target)),
        work,
        Work(2, Recipe(net_specs, ("seq", (("step", 0), ("step", 1)))), np.arange(12.0).reshape(3, 4)),
        Work(
            3,
            Recipe(net_specs, ("par", (("step", 0), ("step", 1)))),
            {"a": [1, 2, 3], "b": b"x" * 70_000},
            keys={0: "sha256:" + "a" * 64},
            placement={1: "cpu"},
        ),
        Work(4, Recipe(proj_specs, ("seq", (("step", 1), ("step", 0)))), "text"),
        Where("w1"),
        Where("nowhere", lost=True),
        Hosts(),
        Bye(),
        Ready(here),
        Send(5, (digest,)),
        Refusal("no", ref=3),
        done,
        Failed(7, "why", "a", "ValueError", "tb"),
        Saw(8, {"fact": "ran", "node": "a"}),
        Located("w1", "direct", address="tcp://127.0.0.1:1", mode="network"),
        Listed({"w1": "network"}),
        # a stream's pieces, each a message of its own, all for one stream number
        Begin(FUZZ_SID, (100, 5000)),
        Begin(FUZZ_SID, (SAFE_STREAM // 2,)),
        Chunk(FUZZ_SID, b"y" * 100),
        Credit(FUZZ_SID, 4096),
        # envelopes: what a client sends a broker, and what only a broker and a worker say
        Relay(host=host, inner=tuple(encode(Hello(here)))),
        Relay(host=host, inner=tuple(encode(work))),
        Relay(host=host, inner=tuple(encode(Begin(FUZZ_SID, (100, 5000))))),
        Relay(host=host, inner=tuple(encode(Chunk(FUZZ_SID, b"y" * 100)))),
        Relay(exchange=1, tenant="route:00", inner=tuple(encode(Hello(here)))),
        Relay(exchange=3, inner=tuple(encode(done))),
        # cargo said to lie in a shared folder
        Mounted((f"{os.getpid()}-{'0' * 32}-0",), bytes(memoryview(encode(work)[0]))),
    ]
    frames = [list(encode(m)) for m in messages]
    return [[bytes(memoryview(f)) for f in m] for m in frames]


# -- scripts run as child processes --------------------------------------------------------

#: A client process for the load test: ``url host client count log``; one forward to warm
#: up, "ready", then on "go" its forwards, then one JSON line with what it measured.
LOAD_CLIENT = """if True:
    import json, sys, time
    from somatize import Broker
    from reliability_nodes import Tag, tag_of
    url, host, client, count, log = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
    with Broker.at(url) as broker:
        g = Tag(log).named("tag").at(host)
        assert g.forward(f"warm:{client}", broker=broker)[0] == f"warm:{client}"
        print("ready", flush=True)
        sys.stdin.readline()
        latencies, wrong = [], []
        for i in range(count):
            x = f"{client}:{i}"
            started = time.perf_counter()
            out = g.forward(x, broker=broker)
            latencies.append(time.perf_counter() - started)
            if list(out) != [x, tag_of(x)]:
                wrong.append([x, repr(out)[:200]])
    print(json.dumps({"latencies": latencies, "wrong": wrong}), flush=True)
"""

#: A store writer that says when each put begins and ends: ``root seed``; runs until killed.
STORE_WRITER = """if True:
    import hashlib, random, sys
    from somatize.store import FolderStore
    root, seed = sys.argv[1], int(sys.argv[2])
    store = FolderStore(root)
    rng = random.Random(seed)
    print("ready", flush=True)
    n = 0
    while True:
        name = "crash/%d" % rng.randrange(5)
        size = rng.choice([0, 10, 4096, 100_000, 1 << 20, 3 << 20])
        blob = None if rng.random() < 0.1 else rng.randbytes(size)
        sha = "none" if blob is None else hashlib.sha256(blob).hexdigest()
        record = {"writer": str(seed), "n": str(n), "size": str(size), "sha": sha}
        print("begin", n, flush=True)
        store.put(name, record, blob if n % 2 else ([blob[: size // 3], blob[size // 3 :]] if blob else blob))
        print("end", n, flush=True)
        n += 1
"""
