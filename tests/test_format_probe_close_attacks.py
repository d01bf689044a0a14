"""Attacks on what the session of 2026-12-03 built (c710832..1118a08): the codec formats a
network worker holds, the registry snapshot the channel checks kinds with, the handshake
probe, a broker closed under a waiting call, and an in-process host's group when nobody
watches.

Real processes, real sockets, real files; nothing of somatize is mocked. Every wait is
bounded. Thirteen of these failed on their first run and were mended after: eight codecs
that write other bytes were judged the same format (a global that is a function, a dict or
a module; a global read only by nested code; a captured function's own closure; a
``functools.partial``; a callable object; the methods of the type the codec builds), so
a second client's values were read the first client's way without a word
(``packing/formats.py`` now writes a codec down whole, or lets its bytes decide); two
identical codecs were refused; the probe could be held past its timeout by a trickling
peer, and read an abstract ``ipc://@name`` as a file.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from conftest import WORKER, env_with_tests
from fabric_nodes import Add

import somatize
from somatize import Broker, SomatizeError, Worker

# == 1. carried codec formats ===================================================================
#
# Each client process registers one kind per variant (register, pack a fresh node, forget),
# so each artifact carries exactly one codec. Process "a" and process "c" write the same
# format (the same source, run twice: another client, a cell run again); process "b" writes
# another one. A worker process provisions a, then b (must be refused: its values would be
# read the first way), then c (must be held: the same format).


# The somatize under test (a worktree's, when it is first on the path), for the scripts here,
# which run without the tests' folder on theirs
SOMATIZE_ROOT = str(Path(somatize.__file__).resolve().parents[1])


# == 3. the handshake probe =====================================================================


# == 4. Broker.close() ends a waiting call ========================================================


# == 5. an in-process host's group, watched or not ===============================================


def test_an_inprocess_host_keeps_a_cached_step_when_nobody_watches(tmp_path):
    """Nobody watches: the group of the in-process host is neither timed nor said, but the
    cached step in the middle of it must still be kept once the group closes, and recalled
    next time without running."""
    from fabric_nodes import Count

    from somatize.store import FolderStore

    calls = tmp_path / "calls"
    store = FolderStore(tmp_path / "store")
    g = (
        Add(1).named("pre").at("w1").frozen()
        >> Count(str(calls)).named("count").at("w1").cached().frozen()
        >> Add(1).named("post").at("w1")
    )
    with Broker.embedded({"w1": Worker.inprocess()}) as broker:
        first = g.forward(5, broker=broker, store=store)
        second = g.forward(5, broker=broker, store=store)
        seen: list = []
        third = g.forward(5, broker=broker, store=store, watching=seen.append)
    assert list(first) == list(second) == list(third) == [7, 8, 9]
    assert calls.read_text() == "x\n", "the cached step ran again: it was not kept unwatched"
    kinds = [f["fact"] for f in seen]
    assert "recalled" in kinds and not [f for f in seen if f["fact"] == "ran" and f.get("node") == "count"]


def test_left_facts_name_each_inprocess_host_in_order_when_watched():
    g = (
        Add(1).named("a").at("w1")
        >> Add(1).named("b").at("w1")
        >> Add(1).named("c").at("w2")
        >> Add(1).named("local")
        >> Add(1).named("d").at("w1")
    )
    with Broker.embedded({"w1": Worker.inprocess(), "w2": Worker.inprocess()}) as broker:
        assert g.forward(0, broker=broker) == 5  # unwatched first: nothing left behind for the next
        seen: list = []
        assert g.forward(0, broker=broker, watching=seen.append) == 5
    left = [f for f in seen if f["fact"] == "left"]
    assert [f["host"] for f in left] == ["w1", "w2", "w1"], seen
    assert all(f["took_us"].isdigit() for f in left)
    ran = [(f["node"], f.get("host")) for f in seen if f["fact"] == "ran"]
    assert ran == [("a", "w1"), ("b", "w1"), ("c", "w2"), ("local", None), ("d", "w1")], ran
    # each `left` comes right after its group's last `ran`
    order = [(f["fact"], f.get("node") or f.get("host")) for f in seen if f["fact"] in ("ran", "left")]
    assert order[:4] == [("ran", "a"), ("ran", "b"), ("left", "w1"), ("ran", "c")], order


def test_a_cached_step_first_in_a_parallel_inprocess_group_is_kept_unwatched(tmp_path):
    from fabric_nodes import Count

    from somatize.store import FolderStore

    store = FolderStore(tmp_path / "store")
    calls_a, calls_b = tmp_path / "a", tmp_path / "b"
    g = (
        Count(str(calls_a)).named("ca").at("w1").cached().frozen()
        & Count(str(calls_b)).named("cb").at("w2").cached().frozen()
    )
    with Broker.embedded({"w1": Worker.inprocess(), "w2": Worker.inprocess()}) as broker:
        for _ in range(2):
            out = g.forward(1, broker=broker, store=store)
    assert [list(x) for x in out] == [[1, 2, 3], [1, 2, 3]]
    assert calls_a.read_text() == "x\n" and calls_b.read_text() == "x\n"


# == 2. the registry snapshot and the client's kind check ========================================


class _Unread:
    def __init__(self, v: float) -> None:
        self.v = v


class _Other(_Unread):
    pass


def test_kinds_are_checked_against_the_registry_they_were_written_with_under_churn(processes):
    """Two threads register and forget codecs (one the worker cannot read, one unrelated) as
    fast as they can while calls run on a project-mode worker: a plain call is never refused
    (no false refusal), and a value of the unreadable kind is always refused here, by the
    client, before it is sent (the worker stays up and serves)."""
    from somatize.codec import codec, forget

    worker = processes([*WORKER, "--listen", "127.0.0.1:0", "--announce", "--mode", "project"], env=env_with_tests())
    stop = threading.Event()

    def churn(kind: str, type_: type) -> None:
        while not stop.is_set():
            codec(kind, type_, dump=lambda u: repr(u.v).encode(), load=lambda b: type_(float(b)))
            forget(kind)

    threads = [
        threading.Thread(target=churn, args=k, daemon=True)
        for k in (("atk.session.unread", _Unread), ("atk.session.other", _Other))
    ]
    refused_plain, sent_unread = [], []
    try:
        with Broker.embedded({"w1": Worker.at(worker.endpoint, mode="project")}, patience=5.0) as broker:
            for t in threads:
                t.start()
            until = time.monotonic() + 4
            while time.monotonic() < until:
                try:
                    assert Add(1).named("a").at("w1").forward(1, broker=broker) == 2
                except SomatizeError as exc:
                    refused_plain.append(str(exc))
                try:
                    Add(1).named("u").at("w1").forward(_Unread(1.0), broker=broker)
                    sent_unread.append("returned")
                except SomatizeError as exc:
                    text = str(exc)
                    told = "cannot read values of kind `atk.session.unread`"
                    if told in text and "nothing was sent" in text:
                        continue  # refused here, before a byte was sent
                    if "`atk.session.unread`" not in text and "_Unread" in text:
                        continue  # forgotten before it was written: nothing to send
                    sent_unread.append(text)
    finally:
        stop.set()
        for t in threads:
            t.join(5)
        forget("atk.session.unread")
        forget("atk.session.other")
    assert not refused_plain, refused_plain[:3]
    assert not sent_unread, sent_unread[:3]
    assert worker.alive
