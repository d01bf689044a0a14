"""Red team of the pooled shared-memory Mount path, the operator logs, and the stale-import
detector (issues 13 and 14).

Each test plays an attacker for real: a standalone worker process listening with
``--mount``, spoken to by hand on a DEALER (a client that does exactly what it wants with
``Mounted``), a standalone broker with keys, and `nobody` at the mount folder. An attack
that is held is a plain test; one that succeeds today is ``xfail(strict=True)``, its
reason saying what is wrong, so that the fix turns it into a failure to remove the mark.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import zmq
from cargo_support import proved, sealed
from conftest import SETPRIV, WORKER, env_with_tests
from fabric_nodes import Scale
from reliability_support import key_ring, wait_until

from brokers import keyed_broker
from somatize import Node, ProtocolError
from somatize.fabric import leases, mount
from somatize.fabric.client import lending as client_pool
from somatize.fabric.curve import read_public, read_secret
from somatize.fabric.worker.imported import Imports
from somatize.packing import Packer
from somatize.wire import (
    WIRE_VERSION,
    Done,
    Hello,
    Mounted,
    Ready,
    Recipe,
    Refusal,
    Runtime,
    Where,
    Work,
    decode,
    encode,
)

SHM = Path("/dev/shm")
in_memory = pytest.mark.skipif(not SHM.is_dir() or not leases.in_memory(SHM), reason="needs /dev/shm on tmpfs")
RT = Runtime.here(mode="project")


class SlowScale(Node):
    """Says it started, waits (at most 10 s) for a file, then answers a new array: an answer
    that needs a segment to be written into, after its client has given up."""

    def __init__(self, started: str, go: str) -> None:
        self.started, self.go = started, go

    def forward(self, x):
        Path(self.started).write_text(str(os.getpid()))
        until = time.monotonic() + 10
        while not os.path.exists(self.go) and time.monotonic() < until:
            time.sleep(0.01)
        return np.asarray(x) * 2


# -- helpers -------------------------------------------------------------------------------


@pytest.fixture
def folder(tmp_path):
    """A fresh mount folder in /dev/shm, removed after with whatever is left in it."""
    made = SHM / f"somatize-redteam-{os.getpid()}-{tmp_path.name}"
    yield made
    shutil.rmtree(made, ignore_errors=True)


def files(folder: Path) -> list[str]:
    return sorted(os.listdir(folder)) if folder.exists() else []


def me() -> str:
    return f"{os.getpid()}-{mount._tag()}"


class Raw:
    """A client speaking the wire by hand on one DEALER."""

    def __init__(self, endpoint: str, *, keys: tuple[bytes, bytes, bytes] | None = None) -> None:
        self.key = b""  # the seal key of its session, once a worker proved it sees the folder (`greeted`)
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.linger = 0
        if keys is not None:
            self.sock.curve_publickey, self.sock.curve_secretkey, self.sock.curve_serverkey = keys
        self.sock.connect(endpoint)

    def send(self, frames) -> None:
        self.sock.send_multipart([bytes(f) for f in frames])

    def answer(self, timeout: float = 10.0):
        assert self.sock.poll(int(timeout * 1000)), "no answer"
        return decode(self.sock.recv_multipart())

    def ask(self, frames, timeout: float = 10.0):
        self.send(frames)
        return self.answer(timeout)

    def close(self) -> None:
        self.sock.close(0)


def worker(processes, folder: Path, *extra: str):
    """A standalone project-mode worker on loopback, sharing ``folder`` with its clients."""
    return processes(
        [*WORKER, "--listen", "127.0.0.1:0", "--announce", "--mount", str(folder), *extra], env=env_with_tests()
    )


def work_of(node: Node, x, ref: int = 1) -> list:
    spec = Packer("project").spec(node.named("n").steps[0])
    return encode(Work(ref, Recipe((spec,), ("step", 0)), x, watched=False))


def greeted(endpoint: str, folder: Path) -> Raw:
    """A raw client greeted by the worker, which proved it sees ``folder``: ``raw.key`` seals
    what it names there (a request with no seal of its session is refused before anything)."""
    raw = Raw(endpoint)
    raw.key = proved(raw.ask, folder)
    return raw


def tidy(folder: Path, pool: client_pool.Pool) -> None:
    pool.drain()
    for name in files(folder):
        (folder / name).unlink()


# -- the pooled Mount path -----------------------------------------------------------------


@in_memory
def test_a_sparse_segment_does_not_make_the_worker_allocate_what_the_client_never_did(processes, folder):
    w = worker(processes, folder)
    raw = greeted(w.endpoint, folder)
    mount.private(folder)
    frames = work_of(Scale(2.0), np.arange(1000, dtype=np.float64))
    name = f"{me()}{secrets.token_hex(12)}-0"
    path = folder / name
    try:
        with open(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600), "r+b") as out:
            out.truncate(64 << 20)  # a hole: nothing allocated
            out.write(bytes(frames[1]))
        before = os.stat(path).st_blocks * 512
        answer = raw.ask(
            encode(sealed(Mounted((name,), header=bytes(frames[0]), spans=((0, 0, len(frames[1])),)), raw.key))
        )
        after = os.stat(path).st_blocks * 512
        assert before < (1 << 20)
        assert isinstance(answer, Refusal) or after < (4 << 20), (
            f"the worker allocated {after - before:,} bytes of the client's hole"
        )
    finally:
        raw.close()
        for each in files(folder):
            (folder / each).unlink()


@in_memory
def test_an_answer_the_client_gave_up_on_leaves_no_segment_behind(processes, folder, tmp_path):
    started, go = tmp_path / "started", tmp_path / "go"
    w = worker(processes, folder)
    raw = greeted(w.endpoint, folder)
    pool = client_pool.pool(folder)
    for seg in [pool.lease(3 << 20), pool.lease(8 << 20)]:  # free: the input's, and a spare for the answer
        seg.lent = False
        pool.settle(seg)
    try:
        lending = client_pool.Lending(pool)
        x = np.arange(1 << 18, dtype=np.float64)  # 2 MiB: needs a spare or a new file
        sent = lending.send(work_of(SlowScale(str(started), str(go)), x), raw.key)
        assert decode(sent).spare, "the request offered no spare"
        raw.send(sent)
        wait_until(started.exists, 10, "the node starting")
        lending.end(answered=False)  # the client's deadline passed: it retires what it lent
        go.touch()
        late = raw.answer()
        assert isinstance(late, Mounted) and late.files  # the worker did write the answer
        pool.drain()  # what a client does when it closes its broker
        left = files(folder)
        assert left == [], f"left in the mount folder after the client closed: {left}"
    finally:
        raw.close()
        tidy(folder, pool)


@in_memory
def test_a_spare_that_is_the_requests_own_input_is_never_written_over(processes, folder):
    """Attack: name the request's input segment as its `spare` (and send overlapping spans
    and a `kept` the worker should ignore): the worker would write its answer over the input
    it is still reading. It does not: the answer goes to a new file, the input is intact."""
    w = worker(processes, folder)
    raw = greeted(w.endpoint, folder)
    pool = client_pool.pool(folder)
    x = np.arange(1 << 16, dtype=np.float64)
    try:
        lending = client_pool.Lending(pool)
        good = decode(lending.send(work_of(Scale(3.0), x), raw.key))
        (seg,) = good.files
        before = bytes(pool.known[seg].view[: x.nbytes])
        hostile = sealed(Mounted(good.files, header=good.header, spans=good.spans, spare=(seg,), kept=(seg,)), raw.key)
        answer = raw.ask(encode(hostile))
        assert isinstance(answer, Mounted), answer
        assert not answer.kept
        assert bytes(pool.known[seg].view[: x.nbytes]) == before, "the answer was written over the input"
        assert all(answer.files[i] != seg for i, _, n in answer.spans if n), answer
        done = decode(lending.receive(answer))
        assert isinstance(done, Done)
        np.testing.assert_array_equal(done.output, x * 3.0)
        del done
        lending.end(answered=True)

        # two spans over the same bytes: the node sees the same memory twice, nothing breaks
        lending = client_pool.Lending(pool)
        good = decode(lending.send(work_of(Scale(1.0), x), raw.key))
        twice = sealed(
            Mounted(good.files, header=good.header, spans=(good.spans[0], good.spans[0]), spare=good.spare), raw.key
        )
        answer = raw.ask(encode(twice))
        assert isinstance(answer, (Mounted, Refusal)), answer
        if isinstance(answer, Mounted):
            decode(lending.receive(answer))
        lending.end(answered=True)
        assert w.alive
    finally:
        raw.close()
        tidy(folder, pool)


@in_memory
def test_a_client_takes_no_answer_in_another_exchanges_segment(folder):
    """Attack (a worker against a client): answer one exchange with a span of the segment
    another exchange of the same client lent, so that it reads, or later reuses, memory
    someone else is writing. The client refuses a name it did not lend to this exchange,
    and a `kept` it did not lend."""
    pool = client_pool.pool(folder)
    try:
        first, second = client_pool.Lending(pool), client_pool.Lending(pool)
        a = decode(first.send(work_of(Scale(1.0), np.ones(100))))
        b = decode(second.send(work_of(Scale(1.0), np.ones(100))))
        with pytest.raises(ProtocolError, match="no segment this exchange lent"):
            second.receive(Mounted(a.files, header=b"h", spans=((0, 0, 8),)))
        with pytest.raises(ProtocolError, match="did not lend"):
            second.receive(Mounted(b.files, header=b"h", spans=((0, 0, 8),), kept=a.files))
        first.end(answered=True)
        second.end(answered=True)
    finally:
        tidy(folder, pool)
    assert files(folder) == []


NOBODY_AT_SHM = r"""
import json, os, sys
spec = json.loads(sys.stdin.read())
tried = {}
def attempt(what, action):
    try:
        action(); tried[what] = "done"
    except OSError as exc:
        tried[what] = type(exc).__name__
attempt("list", lambda: os.listdir(spec["folder"]))
attempt("read", lambda: open(spec["segment"], "rb").read(16))
attempt("write", lambda: open(spec["segment"], "r+b").write(b"x"))
attempt("truncate", lambda: os.truncate(spec["segment"], 0))
attempt("plant", lambda: open(os.path.join(spec["folder"], spec["name"]), "w").close())
print(json.dumps(tried))
"""


@in_memory
def test_another_user_can_neither_see_nor_touch_a_pooled_segment(folder):
    """Attack: `nobody` lists the mount folder, reads, writes or truncates a live pooled
    segment (a SIGBUS for the worker mapping it), or plants a file under a name the pool
    makes. The folder is 0700 and each segment 0600: every attempt is refused."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("playing another local user needs root and `setpriv`")
    pool = client_pool.pool(folder)
    try:
        seg = pool.lease(1000)
        seg.view[:5] = b"12345"
        python = next(
            (
                p
                for p in dict.fromkeys([sys.executable, "/usr/bin/python3"])
                if subprocess.run([*SETPRIV, p, "-c", "pass"], cwd="/", capture_output=True, timeout=30).returncode == 0
            ),
            None,
        )
        if python is None:
            pytest.skip("no Python interpreter that `nobody` may run")
        done = subprocess.run(
            [*SETPRIV, python, "-c", NOBODY_AT_SHM],
            cwd="/",
            capture_output=True,
            text=True,
            timeout=30,
            input=json.dumps({"folder": str(folder), "segment": str(seg.path), "name": f"{me()}{'0' * 24}-0"}),
        )
        assert done.returncode == 0, done.stderr
        tried = json.loads(done.stdout)
        assert set(tried.values()) == {"PermissionError"}, tried
        assert bytes(seg.view[:5]) == b"12345" and seg.path.stat().st_size == seg.size
        assert (os.stat(folder).st_mode & 0o777, os.stat(seg.path).st_mode & 0o777) == (0o700, 0o600)
        seg.lent = False
        pool.settle(seg)
    finally:
        tidy(folder, pool)


# -- the operator's log --------------------------------------------------------------------

FORGED = "w1\nsomatize broker: reloaded the allow-list: FORGED\x1b[2J\x1b]0;owned\x07\x00"


@pytest.fixture
def ring(tmp_path):
    """A broker's key pair, a client key (alice: may ask) and a worker key (evil: may offer)."""
    return key_ring(tmp_path, clients=("alice",), workers=("evil",))


def as_key(ring, endpoint: str, who: str) -> Raw:
    public, secret = read_secret(ring[who + "_secret"])
    return Raw(endpoint, keys=(public, secret, read_public(ring["broker"])))


def forged(message, **fields) -> list:
    """``message`` encoded, then its header's ``fields`` replaced as a hostile peer would
    (an encoder of ours refuses to write them)."""
    import msgpack

    frames = encode(message)
    header = msgpack.unpackb(bytes(frames[0]), raw=False)
    header.update(fields)
    return [msgpack.packb(header, use_bin_type=True), *frames[1:]]


def forged_lines(text: str, who: str) -> list[str]:
    """The lines of a log that are not the process's own, or that hold a control character."""
    return [
        line
        for line in text.splitlines()
        if not line.startswith(f"somatize {who}") or any(ord(c) < 32 or c == "\x7f" for c in line)
    ]


def test_a_peer_cannot_forge_a_line_in_the_brokers_log(processes, ring):
    broker = keyed_broker(processes, ring)
    alice, evil = as_key(ring, broker.endpoint, "alice"), as_key(ring, broker.endpoint, "evil")
    try:
        assert isinstance(alice.ask(forged(Hello(RT, offering="w1"), offering=FORGED)), Refusal)
        assert isinstance(evil.ask(forged(Hello(RT, offering="w1"), offering=FORGED)), Refusal)
        wait_until(lambda: broker.stderr().count("somatize broker") >= 3, 10, "the broker logging both")
    finally:
        alice.close()
        evil.close()
    lines = forged_lines(broker.stderr(), "broker")
    assert lines == [], f"lines in the broker's log a peer wrote: {lines}"


def test_an_allowed_worker_cannot_flood_the_brokers_log(processes, ring):
    broker = keyed_broker(processes, ring)
    a, b = as_key(ring, broker.endpoint, "evil"), as_key(ring, broker.endpoint, "evil")
    name = "n" * 1000
    try:
        for _ in range(150):
            for each in (a, b):
                assert isinstance(each.ask(encode(Hello(RT, offering=name))), Ready)
    finally:
        a.close()
        b.close()
    said = broker.stderr()
    assert said.count("\n") <= 50 and len(said) <= 64 << 10, (
        f"the broker wrote {said.count(chr(10)):,} lines ({len(said):,} characters) for 300 messages"
    )


def test_a_peer_cannot_forge_a_line_in_a_workers_log(processes, folder):
    """Attack: text with newlines, escapes and NULs sent to a worker in every field it may
    name in a refusal (a Hello's offer, a Mounted file name, a target). Every line of the
    worker's log is its own, with no control character: `_printable` escapes them."""
    import msgpack

    w = worker(processes, folder, "--log-level", "info")
    raw = Raw(w.endpoint)
    try:
        short = "a\nsomatize worker: F\x1b[2J\x00"
        for frames in (
            forged(Hello(RT, offering="w1"), offering=FORGED),
            [msgpack.packb({"v": WIRE_VERSION, "t": "Mounted\nsomatize worker: FORGED\x1b[2J"})],
            encode(Hello(RT)),
            forged(Where("w1"), host=FORGED),
            [
                msgpack.packb(
                    {
                        "v": WIRE_VERSION,
                        "t": "Mounted",
                        "files": [short],
                        "spans": [],
                        "spare": [],
                        "kept": [],
                        "seal": "",
                    }
                ),
                b"x",
            ],
            [
                msgpack.packb(
                    {
                        "v": WIRE_VERSION,
                        "t": "Mounted",
                        "files": [f"{me()}{'0' * 24}-0"],
                        "spans": [],
                        "spare": [short],
                        "kept": [short],
                        "seal": "",
                    }
                ),
                b"x",
            ],
        ):
            assert isinstance(raw.ask(frames), (Refusal, Ready))
        wait_until(lambda: w.stderr().count("refused") >= 5, 10, "the worker logging its refusals")
    finally:
        raw.close()
    lines = forged_lines(w.stderr(), "worker")
    assert lines == [], f"lines in the worker's log a peer wrote: {lines}"


# -- the stale-import detector -------------------------------------------------------------


def test_the_stale_import_detector_costs_little_whatever_the_text():
    imports = Imports()
    text = "KeyError: '`" + "a." * 12_000 + "a`'"  # 24 KiB: a why may hold 64, a traceback 512
    started = time.perf_counter()
    assert imports.explain(text) is None
    took = time.perf_counter() - started
    assert took < 0.25, f"looking at {len(text):,} characters of an error took {took:.2f} s"


def test_the_stale_import_detector_imports_nothing_and_reads_no_file_it_did_not_import(tmp_path):
    """Attack: a failure's text (which a node's error, so a client, may choose) names a module
    nobody imported, a file that is not a module's, and a real module's name: the detector
    only compares files of modules this process already imported, so nothing is imported,
    nothing else is looked at, and nothing is said."""
    planted = tmp_path / "planted_redteam_module.py"
    planted.write_text("raise SystemExit('imported')\n")
    imports = Imports()
    before = set(sys.modules)
    text = (
        f"<module 'planted_redteam_module' from '{planted}'> `planted_redteam_module:X` "
        f'File "{planted}", line 1 File "/etc/shadow.py" `os.path:join` '
        "Can't get attribute 'X' on <module 'planted_redteam_module'>"
    )
    assert imports.explain(text) is None
    assert "planted_redteam_module" not in sys.modules and set(sys.modules) == before
    assert imports.changed(text) == []


class SlowSum(Node):
    """Says it started, waits (at most 10 s) for a file, then reads all of its input."""

    def __init__(self, started: str, go: str) -> None:
        self.started, self.go = started, go

    def forward(self, x):
        Path(self.started).write_text(str(os.getpid()))
        until = time.monotonic() + 10
        while not os.path.exists(self.go) and time.monotonic() < until:
            time.sleep(0.01)
        return float(np.asarray(x).sum())


@in_memory
def test_a_segment_truncated_between_requests_is_checked_again_never_read_past_its_end(processes, folder):
    """Attack: the worker keeps a client's segment mapped between calls; the client shrinks
    the file (a read past a file's end is a SIGBUS) and sends the same spans again, as input
    and as the spare of the answer. The cached mapping is checked against the file each time:
    the request is refused, the answer is never written into the short spare, the worker
    serves on."""
    w = worker(processes, folder)
    raw = greeted(w.endpoint, folder)
    pool = client_pool.pool(folder)
    x = np.arange(1 << 17, dtype=np.float64)  # 1 MiB
    try:
        for seg in [pool.lease(2 << 20), pool.lease(2 << 20)]:  # the input's segment and a spare
            seg.lent = False
            pool.settle(seg)
        lending = client_pool.Lending(pool)
        first = decode(lending.send(work_of(Scale(2.0), x), raw.key))
        assert first.spare
        answer = raw.ask(encode(first))  # now the worker has both mapped
        assert isinstance(answer, Mounted) and answer.files == first.spare, answer
        assert isinstance(decode(lending.receive(answer)), Done)
        for name in (*first.files, *first.spare):
            os.truncate(folder / name, 4096)
        again = raw.ask(encode(first))
        assert isinstance(again, Refusal) and "reads up to byte" in again.why, again
        lending.end(answered=False)

        # the input whole, the spare short: the answer goes to a new file
        lending = client_pool.Lending(pool)
        second = decode(lending.send(work_of(Scale(2.0), x), raw.key))
        spare = f"{me()}{secrets.token_hex(12)}-0"
        with open(os.open(folder / spare, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600), "r+b") as out:
            os.posix_fallocate(out.fileno(), 0, 4 << 20)
        raw.ask(
            encode(sealed(Mounted(second.files, header=second.header, spans=second.spans, spare=(spare,)), raw.key))
        )
        os.truncate(folder / spare, 4096)  # mapped by the worker at 4 MiB, now one page
        answer = raw.ask(
            encode(sealed(Mounted(second.files, header=second.header, spans=second.spans, spare=(spare,)), raw.key))
        )
        assert isinstance(answer, Mounted) and spare not in answer.files, answer
        assert os.stat(folder / spare).st_size == 4096
        done = decode(lending.receive(answer))
        np.testing.assert_array_equal(done.output, x * 2.0)
        del done
        lending.end(answered=True)
        assert w.alive
    finally:
        raw.close()
        tidy(folder, pool)


@in_memory
@pytest.mark.xfail(
    strict=True,
    reason=(
        "a client that shrinks its own input segment while a node reads it kills the worker with "
        "SIGBUS (worker/attachments.py `Attachments.take` hands the node views of a MAP_SHARED mapping of a file "
        "the client may still truncate), and with it every other client's work. The mount is one "
        "user's, so a client could also `kill` the worker; but a bug in one client is enough. Fix: "
        "none cheap with named tmpfs files (seals are for memfd only): pass memfds sealed with "
        "F_SEAL_SHRINK over a unix socket instead of names, or copy the input out of a segment the "
        "worker does not trust; else say in docs/security.md that a mount client can stop the worker, "
        "and remove this test"
    ),
)
def test_a_segment_truncated_while_a_node_reads_it_does_not_kill_the_worker(processes, folder, tmp_path):
    started, go = tmp_path / "started", tmp_path / "go"
    w = worker(processes, folder)
    raw = greeted(w.endpoint, folder)
    pool = client_pool.pool(folder)
    try:
        lending = client_pool.Lending(pool)
        sent = lending.send(work_of(SlowSum(str(started), str(go)), np.ones(1 << 17)), raw.key)
        raw.send(sent)
        wait_until(started.exists, 10, "the node starting")
        os.truncate(folder / decode(sent).files[0], 0)
        go.touch()
        wait_until(lambda: raw.sock.poll(0) or not w.alive, 10, "an answer, or the worker's end")
        assert w.alive, f"the worker died: {w.popen.wait(5)}"
        assert isinstance(raw.answer(), Mounted)
        lending.end(answered=True)
    finally:
        raw.close()
        tidy(folder, pool)
