"""The walk in one process: waves, facts, failures, and the cache over a real FolderStore."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
from fabric_nodes import Add, Sleep

from somatize import FolderStore, Node, NodeFailed, codec
from somatize.codec import dumps, forget, loads
from somatize.keys import PREFIX


class Meet(Node):
    """Waits for the other branch at a barrier: only passes if both run at once."""

    def __init__(self, barrier: threading.Barrier) -> None:
        self.barrier = barrier

    def forward(self, x):
        self.barrier.wait()
        return x


class Boom(Node):
    def forward(self, x):
        raise ValueError("the input was odd")


class Counted(Node):
    def __init__(self, calls: list) -> None:
        self.calls = calls

    def forward(self, x):
        self.calls.append(x)
        return np.arange(4, dtype=np.float32) * x


class Collect(list):
    def __call__(self, fact):
        self.append(fact)

    def kinds(self):
        return [f["fact"] for f in self]


# -- waves --------------------------------------------------------------------------------


@pytest.mark.pure
def test_branches_of_a_wave_run_at_the_same_time():
    barrier = threading.Barrier(2, timeout=5)  # raises BrokenBarrierError if run one after the other
    g = Meet(barrier).named("left") & Meet(barrier).named("right")
    assert g.forward(1) == (1, 1)


def test_two_sleeping_branches_take_the_time_of_one():
    g = Sleep(0.3).named("a") & Sleep(0.3).named("b")
    started = time.perf_counter()
    g.forward(0)
    assert time.perf_counter() - started < 0.55  # serially it would be 0.6 at least


@pytest.mark.pure
def test_a_long_chain_runs_in_order():
    g = Add(1).named("n0")
    for i in range(1, 200):
        g = g >> Add(1).named(f"n{i}")
    assert g.forward(0) == 200


# -- facts --------------------------------------------------------------------------------


@pytest.mark.pure
def test_facts_are_dicts_of_text_with_whole_microseconds():
    seen = Collect()
    (Add().named("a") >> Add().named("b")).forward(1, watching=seen)
    assert seen.kinds() == ["ran", "ran", "finished"]
    for f in seen:
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in f.items())
    assert [f["node"] for f in seen[:2]] == ["a", "b"]
    assert all(f["took_us"].isdigit() for f in seen)
    assert "host" not in seen[0] and "device" not in seen[0]  # local, nothing undeclared


@pytest.mark.pure
def test_an_unnamed_node_is_called_by_its_class_in_facts():
    seen = Collect()
    (Add() >> Add()).forward(1, watching=seen)
    assert seen[0]["node"] == "Add"


@pytest.mark.pure
def test_print_shows_exactly_what_a_watcher_is_handed(capsys):
    seen = Collect()
    (Add().named("a") & Add(2).named("b")).forward(1, watching=[print, seen])
    printed = capsys.readouterr().out.splitlines()
    assert printed == [repr(f) for f in seen]


@pytest.mark.pure
def test_a_list_of_watchers_is_each_told_everything():
    one, two = Collect(), Collect()
    Add().named("a").forward(1, watching=[one, two])
    assert one == two and one.kinds() == ["ran", "finished"]


@pytest.mark.pure
def test_a_failing_node_says_failed_then_broke_and_raises_with_its_name():
    seen = Collect()
    g = Add().named("first") >> Boom().named("boom") >> Add().named("never")
    with pytest.raises(NodeFailed, match="node `boom` raised ValueError: the input was odd") as info:
        g.forward(1, watching=seen)
    assert seen.kinds() == ["ran", "failed", "broke"]
    assert seen[1]["node"] == "boom" and "ValueError" in seen[1]["error"]
    assert "boom" in seen[2]["error"]
    assert isinstance(info.value.__cause__, ValueError)
    assert info.value.node == "boom" and info.value.host is None


@pytest.mark.pure
def test_a_failing_branch_lets_the_other_finish_and_starts_nothing_after():
    seen = Collect()
    log: list = []

    class Note(Node):
        def forward(self, x):
            log.append("after")
            return x

    g = (Sleep(0.1).named("slow") & Boom().named("boom")) >> Note().named("after")
    with pytest.raises(NodeFailed):
        g.forward(1, watching=seen)
    assert log == []
    assert sorted(seen.kinds()) == ["broke", "failed", "ran"]
    assert seen.kinds()[-1] == "broke"


@pytest.mark.pure
def test_a_watcher_that_raises_does_not_break_the_forward(capsys):
    def grumpy(fact):
        raise RuntimeError("no")

    seen = Collect()
    assert (Add() >> Add()).forward(1, watching=[grumpy, seen]) == 3
    assert seen.kinds() == ["ran", "ran", "finished"]
    assert capsys.readouterr().err.count("grumpy") == 1  # reported once


# -- the cache ----------------------------------------------------------------------------


@pytest.mark.pure
def test_a_cached_frozen_node_is_kept_then_recalled(tmp_path):
    store = FolderStore(tmp_path)
    calls: list = []
    g = Add().named("prep").frozen() >> Counted(calls).named("embed").cached().frozen() >> Add(1).named("head")
    first, second = Collect(), Collect()
    out1 = g.forward(2, store=store, watching=first)
    out2 = g.forward(2, store=store, watching=second)
    np.testing.assert_array_equal(out1, out2)
    assert calls == [3]
    assert first.kinds() == ["ran", "ran", "kept", "ran", "finished"]
    kept = first[2]
    assert kept["node"] == "embed" and kept["key"].startswith(PREFIX)
    # the second forward does not run embed nor what fed only it
    assert second.kinds() == ["recalled", "ran", "finished"]
    assert second[0] == {"fact": "recalled", "node": "embed", "key": kept["key"]}
    assert [name for name, _ in store.scan("cache/")] == ["cache/" + kept["key"]]


@pytest.mark.pure
def test_a_kept_entry_of_another_kind_than_its_record_says_is_a_miss_and_runs_again(tmp_path, capfd):
    store = FolderStore(tmp_path)
    calls: list = []
    g = Counted(calls).named("embed").cached().frozen()
    first = Collect()
    expected = g.forward(2, store=store, watching=first)
    key = first[1]["key"]
    name = "cache/" + key
    assert store.record(name)["type"] == "ndarray"
    store.put(name, store.record(name), dumps("forged"))  # the record still says ndarray
    capfd.readouterr()
    second = Collect()
    np.testing.assert_array_equal(g.forward(2, store=store, watching=second), expected)
    assert calls == [2, 2]  # recomputed, not recalled
    assert second.kinds() == ["ran", "kept", "finished"]
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "`embed`" in err[0] and key in err[0] and "`str`" in err[0] and "`ndarray`" in err[0]
    third = Collect()
    g.forward(2, store=store, watching=third)  # what was kept again is what is recalled
    assert third.kinds() == ["recalled", "finished"] and calls == [2, 2]


@pytest.mark.pure
def test_bytes_likes_kept_come_back_as_bytes_and_are_recalled(tmp_path):
    class Raw(Node):
        def forward(self, x):
            return bytearray(b"abc")

    store = FolderStore(tmp_path)
    g = Raw().named("raw").cached().frozen()
    g.forward(1, store=store)
    seen = Collect()
    assert g.forward(1, store=store, watching=seen) == b"abc"
    assert seen.kinds() == ["recalled", "finished"]


@pytest.mark.pure
def test_another_input_is_another_key(tmp_path):
    store = FolderStore(tmp_path)
    calls: list = []
    g = Counted(calls).named("embed").cached().frozen()
    g.forward(1, store=store)
    g.forward(2, store=store)
    g.forward(1, store=store)
    assert calls == [1, 2]


@pytest.mark.pure
def test_changing_a_constructor_argument_changes_the_key(tmp_path):
    store = FolderStore(tmp_path)
    assert Add(1).named("a").cached().frozen().forward(1, store=store) == 2
    assert Add(5).named("a").cached().frozen().forward(1, store=store) == 6


@pytest.mark.pure
def test_a_hit_in_one_branch_leaves_the_other_running(tmp_path):
    store = FolderStore(tmp_path)
    calls: list = []
    g = Add().named("prep").frozen() >> (Counted(calls).named("embed").cached().frozen() & Add(100).named("side"))
    g.forward(1, store=store)
    seen = Collect()
    out = g.forward(1, store=store, watching=seen)
    assert calls == [2]
    assert sorted(seen.kinds()) == ["finished", "ran", "ran", "recalled"]  # prep and side ran
    assert out[1] == 102


@pytest.mark.pure
def test_a_value_that_cannot_be_written_down_is_computed_not_kept(tmp_path, capsys):
    class Reading:
        def __init__(self, hz):
            self.hz = hz

    class Sense(Node):
        def forward(self, x):
            return Reading(x)

    store = FolderStore(tmp_path)
    g = Sense().named("sense").cached().frozen()
    seen = Collect()
    assert g.forward(50.0, store=store, watching=seen).hz == 50.0
    assert g.forward(50.0, store=store).hz == 50.0
    assert seen.kinds() == ["ran", "finished"]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "`sense`" in err[0] and "Reading" in err[0] and "codec(" in err[0]
    assert list(store.scan("cache/")) == []


@pytest.mark.pure
def test_a_codec_makes_the_same_value_keepable(tmp_path):
    class Reading:
        def __init__(self, hz):
            self.hz = hz

    class Sense(Node):
        def forward(self, x):
            return Reading(x)

    codec("tests.Reading", Reading, dump=lambda r: json.dumps(r.hz).encode(), load=lambda b: Reading(json.loads(b)))
    try:
        store = FolderStore(tmp_path)
        g = Sense().named("sense").cached().frozen()
        g.forward(50.0, store=store)
        seen = Collect()
        assert g.forward(50.0, store=store, watching=seen).hz == 50.0
        assert seen.kinds() == ["recalled", "finished"]
    finally:
        forget("tests.Reading")


@pytest.mark.pure
def test_an_unwritable_input_runs_everything_and_says_so(tmp_path, capsys):
    class Thing:
        pass

    class Id(Node):
        def forward(self, x):
            return 1

    g = Id().named("id").cached().frozen()
    assert g.forward(Thing(), store=FolderStore(tmp_path)) == 1
    assert "input of this forward cannot be written down" in capsys.readouterr().err


SCRIPT = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    from somatize import FolderStore, Node

    class Tokenize(Node):
        def forward(self, text):
            return text.split()

    class Embed(Node):
        def forward(self, words):
            return np.array([len(w) for w in words], dtype=np.int64)

    g = Tokenize().named("tokenize").frozen() >> Embed().named("embed").cached().frozen()
    facts = []
    out = g.forward("a bb ccc", store=FolderStore(sys.argv[1]), watching=facts.append)
    print(json.dumps({"out": out.tolist(), "facts": facts}))
    """
)


def run_script(path, store):
    done = subprocess.run([sys.executable, str(path), str(store)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_cached_prefix_is_recalled_in_a_fresh_process(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    first = run_script(script, tmp_path / "store")
    second = run_script(script, tmp_path / "store")
    assert first["out"] == second["out"] == [1, 2, 3]
    assert [f["fact"] for f in first["facts"]] == ["ran", "ran", "kept", "finished"]
    assert [f["fact"] for f in second["facts"]] == ["recalled", "finished"]
    assert not any(f["fact"] == "ran" for f in second["facts"])


WRITER = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    from somatize import FolderStore, Node

    class Big(Node):
        def forward(self, x):
            return np.full(200_000, x, dtype=np.float64)

    start = float(sys.argv[2])
    while time.time() < start:
        time.sleep(0.001)
    out = Big().named("big").cached().frozen().forward(7.0, store=FolderStore(sys.argv[1]))
    assert out.shape == (200_000,) and float(out[0]) == 7.0
    """
)


def test_eight_processes_keeping_one_key_at_once_leave_one_readable_entry(tmp_path):
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    start = time.time() + 1.5
    procs = [
        subprocess.Popen([sys.executable, str(script), str(tmp_path / "store"), str(start)], stderr=subprocess.PIPE)
        for _ in range(8)
    ]
    try:
        for p in procs:
            assert p.wait(timeout=60) == 0, p.stderr.read().decode()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            p.stderr.close()
    store = FolderStore(tmp_path / "store")
    entries = list(store.scan("cache/"))
    assert len(entries) == 1
    value = loads(store.fetch(entries[0][0]))
    np.testing.assert_array_equal(value, np.full(200_000, 7.0))
    assert not [p for p in (tmp_path / "store").rglob("*") if ".tmp" in p.name]
