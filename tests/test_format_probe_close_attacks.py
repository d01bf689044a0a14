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
