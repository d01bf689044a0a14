"""The record: one entry per forward, written when it ends, and the readers with their prices;
a study's trials read back from one scan; the fleet per host as the workers measured it.

The questionnaire of CU20 is here line by line (the test names are its lines). Costs are
proven by counting: ``CountingStore`` wraps a real ``FolderStore`` and counts the calls.
"""

from __future__ import annotations

import ast
import json
import os
import re
import sys
import threading
import time

import fabric_nodes
import pytest
from conftest import WORKER

from somatize import Broker, FolderStore, Node, NodeFailed, NotAWatcher, Worker, fact
from somatize.errors import BadName, Missing
from somatize.facts import CLOSING, ENGINE, elsewhere
from somatize.record import (
    Recorder,
    best,
    curve,
    curve_costs,
    facts,
    fleet,
    forwards,
    latest,
    machines,
    nodes,
    report,
    runs,
    scores,
    self_report,
    trials,
)


class CountingStore:
    """A real FolderStore, with every call counted."""

    def __init__(self, inner: FolderStore) -> None:
        self.inner = inner
        self.reset()

    def reset(self) -> None:
        self.puts = self.scans = self.fetches = 0

    def put(self, name, record, blob=None):
        self.puts += 1
        return self.inner.put(name, record, blob)

    def scan(self, prefix):
        self.scans += 1
        return self.inner.scan(prefix)

    def fetch(self, name):
        self.fetches += 1
        return self.inner.fetch(name)


class Collect(list):
    def __call__(self, f):
        self.append(f)


class Add(Node):
    def __init__(self, n: int = 1) -> None:
        self.n = n

    def forward(self, x):
        return x + self.n


class Nap(Node):
    def forward(self, x):
        time.sleep(0.001)
        return x


class Boom(Node):
    def forward(self, x):
        raise ValueError("boom")


@pytest.fixture
def store(tmp_path):
    return FolderStore(tmp_path / "store")


@pytest.fixture
def counting(tmp_path):
    return CountingStore(FolderStore(tmp_path / "counted"))


def chain():
    return Add(1).named("a") >> Add(2).named("b") >> Add(3).named("c")


def names(store, run):
    return [name for name, _ in store.scan(f"run/{run}/")]


# -- the vocabulary ----------------------------------------------------------------------


def test_a_recorder_closed_says_its_run_ended_and_how_and_a_later_forward_goes_on(store):
    """`close` (or leaving `with`) writes the run's end, ok or broke, in an entry that is no
    forward's; the fact `ended` does the same; a forward after it is numbered on."""
    with Recorder(store, run="r") as rec:
        chain().forward(1, watching=rec)
    assert store.record("run/r/end") == {"run": "r", "how": "ok", "forwards": "1"}
    with pytest.raises(RuntimeError), Recorder(store, run="r") as rec:
        chain().forward(1, watching=rec)
        raise RuntimeError("the loop around it broke")
    assert store.record("run/r/end")["how"] == "broke"
    rec = Recorder(store, run="r")
    rec({"fact": "ended", "how": "ok"})
    chain().forward(2, watching=rec)
    assert store.record("run/r/end") == {"run": "r", "how": "ok", "forwards": "2"}
    assert [row["forward"] for row in forwards(store, run="r")] == [0, 1, 2]
    with pytest.raises(ValueError, match="ok"):
        rec.close(how="done")


def test_a_node_that_ran_says_which_one_how_long_and_where_and_nothing_about_a_device_nobody_declared(store):
    seen = Collect()
    with Broker.embedded({"w1": Worker.inprocess()}) as broker:
        g = fabric_nodes.Add(1).named("here") >> fabric_nodes.Add(1).named("there").at("w1")
        assert g.forward(1, broker=broker, watching=[seen, Recorder(store, run="r")]) == 3
    ran = [f for f in seen if f["fact"] == "ran"]
    assert [f["node"] for f in ran] == ["here", "there"]
    assert set(ran[0]) == {"fact", "node", "took_us"}  # ran here: no host
    assert set(ran[1]) == {"fact", "node", "took_us", "host"} and ran[1]["host"] == "w1"
    assert not any("device" in f for f in seen)
    assert [f for f in facts(store, run="r", forward=0) if f["fact"] == "ran"] == ran


@pytest.mark.pure
def test_a_duration_is_whole_microseconds_and_not_a_float(store):
    g = Nap().named("a") & Nap().named("b")
    g.forward(1, watching=Recorder(store, run="r"))
    timed = [f for f in facts(store, run="r", forward=0) if "took_us" in f]
    assert {f["fact"] for f in timed} == {"ran", "finished"}
    assert all(re.fullmatch(r"[0-9]+", f["took_us"]) for f in timed)
    assert int(timed[-1]["took_us"]) >= 1000  # a millisecond nap is a thousand of them
    assert isinstance(forwards(store, run="r")[0]["took_us"], int)


def test_what_happened_elsewhere_comes_out_as_a_host_field_and_not_as_a_tree(store):
    with Broker.embedded({"w1": Worker.inprocess()}) as broker:
        g = fabric_nodes.Add(1).named("a").at("w1") >> fabric_nodes.Add(1).named("b").at("w1")
        g.forward(1, broker=broker, watching=Recorder(store, run="r"))
    written = facts(store, run="r", forward=0)
    assert all(isinstance(v, str) for f in written for v in f.values())  # flat: text only
    assert [(f["fact"], f.get("host")) for f in written] == [
        ("ran", "w1"),
        ("ran", "w1"),
        ("left", "w1"),
        ("finished", None),
    ]


@pytest.mark.pure
def test_a_fact_that_crossed_two_machines_keeps_its_route_in_order(store):
    deep = elsewhere(elsewhere(fact("ran", node="deep", took_us=5), "w2"), "w1")
    assert deep == {"fact": "ran", "node": "deep", "took_us": "5", "host": "w1/w2"}
    rec = Recorder(store, run="r")
    rec(deep)
    rec(elsewhere(fact("left", host="w2", took_us=9), "w1"))  # w1's trip to w2, seen from here
    rec(fact("left", host="w1", took_us=20))
    rec(fact("finished", took_us=30))
    assert facts(store, run="r", forward=0)[:2] == [deep, {"fact": "left", "host": "w1/w2", "took_us": "9"}]
    assert fleet(store, run="r") == {
        "w1": {"slices": 1, "took_us": 0, "waiting_us": 20},
        "w1/w2": {"slices": 1, "took_us": 5, "waiting_us": 4},
    }


@pytest.mark.pure
def test_the_two_facts_that_end_a_run_say_so_and_a_node_failing_is_not_one_of_them(store):
    assert CLOSING == {"finished", "broke"} and "failed" in ENGINE and "failed" not in CLOSING
    rec = Recorder(store, run="r")
    with pytest.raises(NodeFailed):
        (Add().named("a") >> Boom().named("boom")).forward(1, watching=rec)
    assert [f["fact"] for f in facts(store, run="r", forward=0)] == ["ran", "failed", "broke"]
    assert names(store, "r") == ["run/r/0"]  # `failed` closed nothing: one record


# -- written down ------------------------------------------------------------------------


@pytest.mark.pure
def test_nothing_is_written_until_the_forward_is_over(store):
    inside: list[list[str]] = []

    class Peek(Node):
        def forward(self, x):
            inside.append(names(store, "r"))
            return x

    rec = Recorder(store, run="r")
    g = Add().named("a") >> Peek().named("peek")
    g.forward(1, watching=rec)
    g.forward(1, watching=rec)
    assert inside == [[], ["run/r/0"]]  # the open forward never has a record
    assert names(store, "r") == ["run/r/0", "run/r/1"]


@pytest.mark.pure
def test_a_scan_says_how_it_went_without_reading_a_single_blob(counting):
    rec = Recorder(counting, run="r", summarising=["loss"])
    for step in range(3):
        chain().forward(step, watching=rec)
        rec(fact("loss", value=1 / (step + 1)))
    counting.reset()
    rows = forwards(counting, run="r")
    assert (counting.scans, counting.fetches) == (1, 0)
    assert [row["forward"] for row in rows] == [0, 1, 2]
    assert [row["state"] for row in rows] == ["ok"] * 3
    assert [row["nodes"] for row in rows] == [3] * 3
    assert [row["facts"] for row in rows] == [5] * 3  # three ran, finished, loss
    assert all(isinstance(row["took_us"], int) and row["took_us"] >= 0 for row in rows)
    assert [row["loss.value"] for row in rows] == [1.0, 0.5, 1 / 3]


@pytest.mark.pure
def test_the_detail_is_in_the_blob_in_the_order_it_arrived(store):
    seen = Collect()
    chain().forward(1, watching=[seen, Recorder(store, run="r")])
    assert facts(store, run="r", forward=0) == list(seen)
    lines = bytes(store.fetch("run/r/0")).decode("utf-8").splitlines()
    assert [json.loads(line) for line in lines] == list(seen)  # JSON lines, readable as is
    assert [f["fact"] for f in seen] == ["ran", "ran", "ran", "finished"]


@pytest.mark.pure
def test_each_forward_is_its_own_record_numbered_from_zero(store):
    rec = Recorder(store, run="r")
    for step in range(12):
        chain().forward(step, watching=rec)
    with pytest.raises(NodeFailed):
        Boom().named("boom").forward(1, watching=rec)
    assert [row["forward"] for row in forwards(store, run="r")] == list(range(13))
    assert sorted(int(n.rsplit("/", 1)[1]) for n in names(store, "r")) == list(range(13))
    assert store.record("run/r/10")["forward"] == "10"


@pytest.mark.pure
def test_one_that_broke_says_so_where_a_scan_can_see_it(counting):
    rec = Recorder(counting, run="r")
    chain().forward(1, watching=rec)
    with pytest.raises(NodeFailed):
        (Add().named("a") >> Boom().named("boom")).forward(1, watching=rec)
    counting.reset()
    rows = forwards(counting, run="r")
    assert (counting.scans, counting.fetches) == (1, 0)
    assert [row["state"] for row in rows] == ["ok", "broke"]
    assert "boom" in rows[1]["error"] and "error" not in rows[0]
    assert rows[1]["nodes"] == 1  # `a` ran; `boom` failed


@pytest.mark.pure
def test_a_run_can_be_given_the_name_it_already_has_and_gets_one_if_not(store):
    for _ in range(2):
        rec = Recorder(store, run="tuesday")
        chain().forward(1, watching=rec)
        chain().forward(2, watching=rec)
    assert [row["forward"] for row in forwards(store, run="tuesday")] == [0, 1, 2, 3]

    unnamed, other = Recorder(store), Recorder(store)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d-\d\d-\d\d-[0-9a-f]{4}", unnamed.run)
    assert unnamed.run != other.run
    chain().forward(1, watching=unnamed)
    assert runs(store) == sorted(["tuesday", unnamed.run])

    for bad in ["", "a/b", ".hidden", "x.rec", "sp ace", 3]:
        with pytest.raises(BadName):
            Recorder(store, run=bad)


@pytest.mark.pure
def test_what_level_2_says_lands_in_the_forward_it_belongs_to_rewriting_it(store):
    rec = Recorder(store, run="r", summarising=["loss"])
    chain().forward(1, watching=rec)
    assert "loss.value" not in store.record("run/r/0")
    rec(fact("loss", value=0.25))
    assert store.record("run/r/0")["loss.value"] == "0.25"
    rec(fact("updated", step=1))  # not summarised: in the blob only
    assert "updated.step" not in store.record("run/r/0")
    assert facts(store, run="r", forward=0)[-2:] == [
        {"fact": "loss", "value": "0.25"},
        {"fact": "updated", "step": "1"},
    ]
    assert names(store, "r") == ["run/r/0"]


@pytest.mark.pure
def test_and_the_next_forward_still_starts_a_new_record(store):
    rec = Recorder(store, run="r", summarising=["loss"])
    chain().forward(1, watching=rec)
    rec(fact("loss", value=0.25))
    chain().forward(2, watching=rec)
    assert names(store, "r") == ["run/r/0", "run/r/1"]
    assert "loss.value" not in store.record("run/r/1")
    rec(fact("loss", value=0.5))
    # a loss lands in the forward it belongs to: no curve is off by one
    assert curve(store, run="r") == [(0, 0.25), (1, 0.5)]
    assert [f["fact"] for f in facts(store, run="r", forward=1)] == ["ran", "ran", "ran", "finished", "loss"]


@pytest.mark.pure
def test_rewriting_says_the_same_thing_about_the_same_facts(tmp_path):
    first = FolderStore(tmp_path / "first")
    rec = Recorder(first, run="r", summarising=["loss"])
    chain().forward(1, watching=rec)
    before = first.record("run/r/0")
    rec(fact("loss", value=0.3))
    rec(fact("loss", value=0.2))  # said twice in one forward: the last wins
    after = first.record("run/r/0")
    assert after == {**before, "facts": "6", "loss.value": "0.2"}

    # the same facts, told to another recorder, write the very same entry
    again = FolderStore(tmp_path / "again")
    replay = Recorder(again, run="r", summarising=["loss"])
    for f in facts(first, run="r", forward=0):
        replay(f)
    assert again.entry("run/r/0") == first.entry("run/r/0")


@pytest.mark.pure
def test_a_fact_said_before_any_forward_closed_waits_for_the_first(store):
    rec = Recorder(store, run="r", summarising=["said"])
    rec({"fact": "said", "kind": "load", "load1": "0.50"})  # fact()'s own `kind` is taken
    chain().forward(1, watching=rec)
    written = facts(store, run="r", forward=0)
    assert written[0] == {"fact": "said", "kind": "load", "load1": "0.50"}
    assert store.record("run/r/0")["said.load1"] == "0.50"


# -- from Python -------------------------------------------------------------------------


@pytest.mark.pure
def test_a_fact_is_a_dict_of_text_and_what_is_printed_is_what_is_written(store, capsys):
    g = chain()
    g.forward(1, watching=[print, Recorder(store, run="r")])
    printed = [ast.literal_eval(line) for line in capsys.readouterr().out.splitlines()]
    assert printed == facts(store, run="r", forward=0)
    assert all(type(k) is str and type(v) is str for f in printed for k, v in f.items())
    # the seed's two lines, as written
    x = 1
    g.forward(x, watching=print)
    g.forward(x, watching=Recorder(store))
    assert len(runs(store)) == 2


@pytest.mark.pure
def test_a_list_of_watchers_is_told_and_something_that_is_not_callable_is_refused(store):
    chain().forward(1, watching=[Recorder(store, run="one"), Recorder(store, run="two")])
    assert facts(store, run="one", forward=0) == facts(store, run="two", forward=0)
    with pytest.raises(NotAWatcher):
        chain().forward(1, watching=[Recorder(store, run="three"), "not callable"])
    with pytest.raises(NotAWatcher):
        chain().forward(1, watching=store)  # a store is where a recorder writes, not a watcher
    assert runs(store) == ["one", "two"]  # refused before anything ran


@pytest.mark.pure
def test_a_recorder_refuses_what_is_not_a_fact(store):
    rec = Recorder(store, run="r")
    with pytest.raises(TypeError, match="fact"):
        rec({"fact": "loss", "value": 0.25})
    with pytest.raises(TypeError, match="fact"):
        rec({"value": "0.25"})
    with pytest.raises(TypeError):
        rec("ran")
    with pytest.raises(TypeError, match="summarising"):
        Recorder(store, summarising="loss")
    with pytest.raises(ValueError, match="summarising"):
        Recorder(store, summarising=["loss.value"])
    with pytest.raises(TypeError, match="store"):
        Recorder("./somewhere")
    assert names(store, "r") == []


@pytest.mark.pure
def test_a_recorder_nobody_named_is_still_findable(store):
    rec = Recorder(store)
    chain().forward(1, watching=rec)
    assert runs(store) == [rec.run]
    assert [row["forward"] for row in forwards(store, run=rec.run)] == [0]


def test_what_ran_on_a_real_worker_comes_back_saying_which_host(store):
    rec = Recorder(store, run="remote")
    spawned = Worker.spawn(WORKER, mode="network", send=[fabric_nodes])
    with Broker.embedded({"w1": spawned}) as broker:
        g = fabric_nodes.Add(1).named("local") >> fabric_nodes.Add(2).named("far").at("w1")
        assert g.forward(0, broker=broker, watching=rec) == 3
    ran = {f["node"]: f for f in facts(store, run="remote", forward=0) if f["fact"] == "ran"}
    assert ran["far"]["host"] == "w1" and "host" not in ran["local"]
    (left,) = [f for f in facts(store, run="remote", forward=0) if f["fact"] == "left"]
    measured = int(left.get("worked_us", ran["far"]["took_us"]))  # the worker's, when it said it
    w1 = fleet(store, run="remote")["w1"]
    assert w1["slices"] == 1 and w1["took_us"] == measured >= int(ran["far"]["took_us"])
    assert w1["waiting_us"] == max(0, int(left["took_us"]) - measured)
    assert {row["node"]: row.get("host") for row in nodes(store, run="remote")} == {"local": None, "far": "w1"}


# -- facts from several threads at once --------------------------------------------------

WIDTH = 12


def wide():
    g = Nap().named("n0")
    for i in range(1, WIDTH):
        g = g & Nap().named(f"n{i}")
    return g


@pytest.mark.pure
def test_facts_from_the_threads_of_a_wave_land_whole_in_their_forward(store):
    rec = Recorder(store, run="r")
    g = wide()
    for _ in range(20):
        g.forward(1, watching=rec)
    rows = forwards(store, run="r")
    assert [row["forward"] for row in rows] == list(range(20))
    assert {(row["facts"], row["nodes"]) for row in rows} == {(WIDTH + 1, WIDTH)}
    for row in rows:
        kinds = [f["fact"] for f in facts(store, run="r", forward=row["forward"])]
        assert kinds == ["ran"] * WIDTH + ["finished"]


@pytest.mark.pure
def test_forwards_from_several_threads_into_one_recorder_each_keep_their_own_facts(store):
    rec = Recorder(store, run="r")
    g = wide()
    callers, each, losses = 4, 10, 40
    start = threading.Barrier(callers + 1)

    def call():
        start.wait()
        for _ in range(each):
            g.forward(1, watching=rec)

    def speak():
        start.wait()
        for step in range(losses):
            rec(fact("loss", value=step))
            time.sleep(0.001)

    threads = [threading.Thread(target=call) for _ in range(callers)] + [threading.Thread(target=speak)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    rows = forwards(store, run="r")
    assert [row["forward"] for row in rows] == list(range(callers * each))  # no number twice
    kinds_seen: list[str] = []
    for row in rows:
        written = facts(store, run="r", forward=row["forward"])
        assert len(written) == row["facts"]
        kinds = [f["fact"] for f in written]
        engine = [kind for kind in kinds if kind in ENGINE]
        assert engine == ["ran"] * WIDTH + ["finished"]  # its own forward's facts, whole
        assert row["nodes"] == WIDTH
        kinds_seen += kinds
    assert kinds_seen.count("ran") == callers * each * WIDTH
    assert kinds_seen.count("finished") == callers * each
    assert kinds_seen.count("loss") == losses


# -- reading back, and what it costs -----------------------------------------------------


def record_run(store, run, steps, *, summarising=("loss",)):
    rec = Recorder(store, run=run, summarising=list(summarising))
    for step in range(steps):
        chain().forward(step, watching=rec)
        rec(fact("loss", value=1 / (step + 1)))
    return rec


@pytest.mark.pure
def test_runs_is_one_scan_and_sorted(counting):
    for run in ["b", "a", "c"]:
        record_run(counting, run, 1)
    report(counting, "w1", {"kind": "load"})  # a machine's report is not a run
    counting.reset()
    assert runs(counting) == ["a", "b", "c"]
    assert (counting.scans, counting.fetches) == (1, 0)


@pytest.mark.pure
def test_curve_answers_from_one_scan_when_the_kind_was_summarised(counting):
    record_run(counting, "r", 5)
    counting.reset()
    assert curve_costs(counting, run="r") == {"scans": 1, "fetches": 0, "summarised": True, "forwards": 5}
    assert (counting.scans, counting.fetches) == (1, 0)
    counting.reset()
    assert curve(counting, run="r") == [(step, 1 / (step + 1)) for step in range(5)]
    assert (counting.scans, counting.fetches) == (1, 0)


@pytest.mark.pure
def test_without_a_summary_curve_still_answers_and_says_it_fetched(counting):
    record_run(counting, "r", 5, summarising=())
    counting.reset()
    assert curve_costs(counting, run="r") == {"scans": 1, "fetches": 5, "summarised": False, "forwards": 5}
    assert (counting.scans, counting.fetches) == (1, 0)  # telling the price is free
    counting.reset()
    assert curve(counting, run="r") == [(step, 1 / (step + 1)) for step in range(5)]
    assert (counting.scans, counting.fetches) == (1, 5)
    # another field of a kind that was summarised is in the record too, or absent: no fetch
    record_run(counting, "s", 2)
    counting.reset()
    assert curve(counting, run="s", field="missing") == []
    assert counting.fetches == 0


@pytest.mark.pure
def test_a_curve_of_text_says_which_forward_is_not_a_number(store, capfd):
    rec = Recorder(store, run="r", summarising=["loss"])
    chain().forward(1, watching=rec)
    rec(fact("loss", value="plenty"))
    chain().forward(2, watching=rec)
    rec(fact("loss", value=0.5))
    # the text is left off, said once naming the forward; the number is drawn
    assert curve(store, run="r") == [(1, 0.5)]
    assert curve(store, run="r") == [(1, 0.5)]
    err = capfd.readouterr().err
    assert err.count("run/r/0 is left out: its loss.value 'plenty' is not a number, so forward 0") == 1, err
    assert "facts(store, run='r', forward=0)" in err
    assert forwards(store, run="r")[0]["loss.value"] == "plenty"


@pytest.mark.pure
def test_facts_of_one_forward_are_one_fetch(counting):
    record_run(counting, "r", 3)
    counting.reset()
    written = facts(counting, run="r", forward=1)
    assert (counting.scans, counting.fetches) == (0, 1)
    assert [f["fact"] for f in written] == ["ran", "ran", "ran", "finished", "loss"]
    with pytest.raises(Missing):
        facts(counting, run="r", forward=7)


@pytest.mark.pure
def test_nodes_adds_up_who_spent_the_time_over_the_last_n(counting):
    rec = Recorder(counting, run="r")
    for step in range(4):
        rec(fact("ran", node="embed", took_us=10 * (step + 1), host="w1"))
        rec(fact("recalled", node="tokenize", key="sha256:ab"))
        if step == 3:
            rec(fact("failed", node="head", error="ValueError: no"))
            rec(fact("broke", error="node `head` raised", took_us=50))
        else:
            rec(fact("ran", node="head", took_us=1))
            rec(fact("finished", took_us=50))
    counting.reset()
    every = nodes(counting, run="r")
    assert (counting.scans, counting.fetches) == (1, 4)
    assert every == [
        {"node": "embed", "ran": 4, "took_us": 100, "recalled": 0, "failed": 0, "host": "w1"},
        {"node": "head", "ran": 3, "took_us": 3, "recalled": 0, "failed": 1},
        {"node": "tokenize", "ran": 0, "took_us": 0, "recalled": 4, "failed": 0},
    ]
    counting.reset()
    recent = nodes(counting, run="r", last=2)
    assert (counting.scans, counting.fetches) == (1, 2)
    assert recent[0] == {"node": "embed", "ran": 2, "took_us": 70, "recalled": 0, "failed": 0, "host": "w1"}
    assert nodes(counting, run="r", last=0) == []
    with pytest.raises(ValueError, match="last"):
        nodes(counting, run="r", last=-1)


@pytest.mark.pure
def test_fleet_waiting_is_the_round_trip_less_what_ran_there_never_below_zero(store):
    rec = Recorder(store, run="r")
    rec(fact("ran", node="local", took_us=7))
    rec(fact("ran", node="a", took_us=30, host="w1"))
    rec(fact("ran", node="b", took_us=20, host="w1"))
    rec(fact("left", host="w1", took_us=80))  # 80 - 50 = 30 waited
    rec(fact("ran", node="c", took_us=90, host="w2"))
    rec(fact("left", host="w2", took_us=60))  # clocks of two machines: clamp at 0
    rec(fact("finished", took_us=200))
    rec(fact("ran", node="a", took_us=10, host="w1"))
    rec(fact("left", host="w1", took_us=15))
    rec(fact("finished", took_us=20))
    assert fleet(store, run="r") == {
        "w1": {"slices": 2, "took_us": 60, "waiting_us": 35},
        "w2": {"slices": 1, "took_us": 90, "waiting_us": 0},
    }
    assert fleet(store, run="r", last=1) == {"w1": {"slices": 1, "took_us": 10, "waiting_us": 5}}


def fleet_run(store):
    rec = Recorder(store, run="cheap")
    rec(fact("ran", node="a", took_us=300, host="w1"))
    rec(fact("left", host="w1", took_us=400))
    rec(fact("ran", node="b", took_us=50, host="w2"))
    rec(fact("left", host="w2", took_us=250))
    rec(fact("finished", took_us=700))


@pytest.mark.pure
def test_machines_draws_the_fleet_as_text(store, capsys):
    fleet_run(store)
    chart = machines(store, run="cheap", as_text=True)
    assert isinstance(chart, str) and repr(chart) == str(chart)  # shows drawn, not quoted
    title, w1, w2 = chart.splitlines()
    assert "# ran there" in title
    assert w1.startswith("w1  ") and "slices 1  ran 300 us  waited 100 us" in w1
    assert w2.startswith("w2  ") and "slices 1  ran 50 us  waited 200 us" in w2
    assert (w1.count("#"), w1.count(".")) == (29, 10)  # 300 and 100 of 400, the longest
    assert (w2.count("#"), w2.count(".")) == (5, 20)
    assert machines(store, run="empty", as_text=True) == "nothing ran on another machine in run 'empty'"
    assert capsys.readouterr().out == ""  # never prints by itself


@pytest.mark.pure
def test_machines_as_text_prints_no_escape_sequence_a_record_holds(store):
    """Host and machine names come from facts other processes wrote: one holding an escape
    sequence reached the terminal that printed the chart."""
    rec = Recorder(store, run="hostile")
    rec(fact("ran", node="a", took_us=300, host="w\x1b[2J1"))
    rec(fact("said", host="w\x1b[2J1", machine="gpu\x1b]0;owned\x07box"))
    rec(fact("left", host="w\x1b[2J1", took_us=400))
    rec(fact("finished", took_us=700))
    chart = machines(store, run="hostile", as_text=True)
    assert "\x1b" not in chart and "\x07" not in chart
    assert "w?[2J1" in chart and "gpu?]0;owned?box" in chart


@pytest.mark.pure
def test_machines_without_matplotlib_is_a_text_chart(store, monkeypatch):
    fleet_run(store)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    assert machines(store, run="cheap") == machines(store, run="cheap", as_text=True)


def test_machines_draws_a_figure_when_matplotlib_is_there(store, capsys):
    figure_module = pytest.importorskip("matplotlib.figure")
    fleet_run(store)
    drawn = machines(store, run="cheap")
    assert isinstance(drawn, figure_module.Figure)
    (axes,) = drawn.axes
    assert [label.get_text() for label in axes.get_yticklabels()] == ["w1", "w2"]
    assert len(axes.patches) == 4  # ran and waited, per host
    assert capsys.readouterr().out == ""


# -- machines speaking for themselves ----------------------------------------------------


@pytest.mark.pure
def test_a_machine_reports_itself_and_latest_keeps_the_last(counting):
    report(counting, "w1", {"kind": "load", "slices": "1"})
    report(counting, "w1", {"kind": "load", "slices": "2"})
    report(counting, "w2", {"kind": "load", "slices": "5"})
    counting.reset()
    assert latest(counting) == {
        "w1": {"kind": "load", "slices": "2", "machine": "w1"},
        "w2": {"kind": "load", "slices": "5", "machine": "w2"},
    }
    assert (counting.scans, counting.fetches) == (1, 0)
    assert counting.inner.fetch("machine/w1") is None  # a record and no blob
    fleet_run(counting)
    assert fleet(counting, run="cheap")["w1"]["said"]["slices"] == "2"
    with pytest.raises(BadName):
        report(counting, "a/b", {})


@pytest.mark.pure
def test_a_worker_says_about_itself_in_plain_text():
    said = self_report(3)
    assert said["kind"] == "load" and said["slices"] == "3"
    assert said["pid"] == str(os.getpid()) and said["machine"]
    assert int(said["rss_bytes"]) > 1 << 20
    if hasattr(os, "getloadavg"):
        assert float(said["load1"]) >= 0 and {"load5", "load15"} <= set(said)
    assert all(type(v) is str for v in said.values())
    with pytest.raises(ValueError):
        self_report(-1)


# -- thousands of forwards ---------------------------------------------------------------

# 10,000 through a recorder is 20,000 fsynced puts (each loss rewrites its forward), about
# 20 s on a laptop disk: too slow for every run of the suite. Set SOMATIZE_RECORD_FORWARDS
# to 10000 to run the full figure; the costs asserted are the same at any size.
MANY = int(os.environ.get("SOMATIZE_RECORD_FORWARDS", "2000"))


def test_thousands_of_forwards_are_read_back_without_a_fetch(counting):
    rec = Recorder(counting, run="long", summarising=["loss"])
    for step in range(MANY):
        rec(fact("ran", node="step", took_us=100 + step))
        rec(fact("finished", took_us=120 + step))
        rec(fact("loss", value=1 / (step + 1)))
    counting.reset()
    started = time.perf_counter()
    rows = forwards(counting, run="long")
    read = time.perf_counter() - started
    assert (counting.scans, counting.fetches) == (1, 0)
    assert len(rows) == MANY and rows[-1]["took_us"] == 120 + MANY - 1
    counting.reset()
    started = time.perf_counter()
    points = curve(counting, run="long")
    drawn = time.perf_counter() - started
    assert (counting.scans, counting.fetches) == (1, 0)
    assert points[::997] == [(step, 1 / (step + 1)) for step in range(0, MANY, 997)]
    print(f"{MANY} forwards: forwards() {read:.3f} s, curve() {drawn:.3f} s, no fetch")


# -- workers that report ------------------------------------------------------------------


def test_a_worker_reports_to_the_store_on_its_clock_and_down_an_open_connection(tmp_path, processes):
    from conftest import env_with_tests
    from fabric_nodes import Add

    store = FolderStore(tmp_path / "store")
    worker = processes(
        [
            *WORKER,
            "--listen",
            "127.0.0.1:0",
            "--announce",
            "--store",
            str(store.path),
            "--reporting",
            "0.2",
            "--machine",
            "gpu-box-1",
        ],
        env=env_with_tests(),
    )
    deadline = time.monotonic() + 15
    while "gpu-box-1" not in latest(store):
        assert time.monotonic() < deadline, "the worker never reported"
        time.sleep(0.05)
    first = latest(store)["gpu-box-1"]
    assert first["kind"] == "load" and first["slices"] == "0" and first["machine"] != ""
    seen: list = []
    with Broker.embedded({"w1": Worker.at(worker.endpoint, mode="project")}) as broker:
        Add(1).named("a").at("w1").forward(1, broker=broker, watching=seen.append)
    said = [f for f in seen if f["fact"] == "said"]
    assert said and said[0]["kind"] == "load" and said[0]["host"] == "w1"
    while latest(store)["gpu-box-1"]["slices"] != "1":  # rewritten on the clock
        assert time.monotonic() < deadline, "the report was never rewritten"
        time.sleep(0.05)
    assert len([n for n, _ in store.scan("machine/")]) == 1  # one name per machine


# -- the layout ---------------------------------------------------------------------------


@pytest.mark.pure
def test_the_record_is_a_package_whose_modules_no_function_shadows():
    import importlib
    import pkgutil
    import types

    import somatize.record as record

    assert record.__all__ == sorted(record.__all__)
    for name in record.__all__:
        assert getattr(record, name).__module__.startswith("somatize.record."), name
    modules = {info.name for info in pkgutil.iter_modules(record.__path__)}
    assert modules == {"drawings", "readers", "recorder", "reports", "shapes", "studies"}
    for name in modules:
        assert isinstance(getattr(record, name), types.ModuleType), name  # `import somatize.record.x` is the module
        assert importlib.import_module(f"somatize.record.{name}") is getattr(record, name)
    # every name imported from somatize.record anywhere in the project is still there
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    used: set[str] = set()
    for folder, _, files in os.walk(root):
        if ".git" in folder or "egg-info" in folder:
            continue
        for file in files:
            if file.endswith((".py", ".md", ".ipynb")):
                with open(os.path.join(folder, file), encoding="utf-8", errors="replace") as handle:
                    text = handle.read()
                for found in re.findall(r"from (?:somatize|\.\.|)\.record import (\([^)]*\)|[^\n]*)", text):
                    found = found if found.startswith("(") else re.split(r'\\n|"|#', found)[0]
                    used |= set(re.findall(r"[A-Za-z_]\w*", found))
    assert used and used <= set(dir(record)), used - set(dir(record))


# -- items: how many a node handled ----------------------------------------------------------


class Gives(Node):
    def __init__(self, value) -> None:
        self.value = value

    def forward(self, x):
        return self.value


def items_said(value):
    seen = Collect()
    Gives(value).named("n").forward(0, watching=seen)
    (ran,) = [f for f in seen if f["fact"] == "ran"]
    return ran.get("items")


@pytest.mark.pure
def test_a_node_whose_output_is_a_batch_says_how_many_items_it_handled():
    import collections

    import numpy as np

    assert items_said([1, 2, 3]) == "3"
    assert items_said((1, 2)) == "2"
    assert items_said([]) == "0"
    assert items_said(np.zeros((32, 4))) == "32"  # an array's first dimension
    for not_a_batch in [
        7,
        2.5,
        "abc",
        b"abc",
        {"a": 1},
        np.float64(1.0),
        np.array(3.0),
        None,
        collections.namedtuple("Pair", "a b")(1, 2),
    ]:
        assert items_said(not_a_batch) is None, not_a_batch
    assert "items" not in ENGINE  # a field of `ran`, not a kind of its own


@pytest.mark.pure
def test_a_tensor_and_an_arrow_batch_say_their_rows():
    torch = pytest.importorskip("torch")
    arrow = pytest.importorskip("pyarrow")
    assert items_said(torch.zeros(16, 3)) == "16"
    assert items_said(torch.tensor(1.0)) is None
    batch = arrow.record_batch({"x": [1, 2, 3, 4, 5]})
    assert items_said(batch) == "5"
    assert items_said(arrow.Table.from_batches([batch, batch])) == "10"


@pytest.mark.pure
def test_nothing_is_counted_when_nobody_watches():
    counted: list[int] = []

    class Counted(list):
        def __len__(self):
            counted.append(1)
            return super().__len__()

    node = Gives(Counted([1, 2])).named("n")
    node.forward(0)
    assert counted == []
    node.forward(0, watching=Collect())
    assert counted == [1]


def test_items_come_back_from_a_worker_on_its_ran(store):
    rec = Recorder(store, run="r")
    with Broker.embedded({"w1": Worker.inprocess()}) as broker:
        g = fabric_nodes.Scale(2).named("scale").at("w1") >> fabric_nodes.Add(1).named("add")
        g.forward([1, 2, 3], broker=broker, watching=rec)
    ran = {f["node"]: f for f in facts(store, run="r", forward=0) if f["fact"] == "ran"}
    assert ran["scale"]["items"] == "3" and ran["scale"]["host"] == "w1"
    assert ran["add"]["items"] == "3"


@pytest.mark.pure
def test_nodes_shows_items_per_second_for_a_node_that_handled_batches(store):
    rec = Recorder(store, run="r")
    for _step in range(2):
        rec(fact("ran", node="embed", took_us=2000, items=32))
        rec(fact("ran", node="head", took_us=500))
        rec(fact("finished", took_us=3000))
    rec(fact("ran", node="embed", took_us=1000))  # a run that said no items counts no time here
    rec(fact("finished", took_us=1000))
    embed, head = nodes(store, run="r")
    assert embed == {
        "node": "embed",
        "ran": 3,
        "took_us": 5000,
        "recalled": 0,
        "failed": 0,
        "items": 64,
        "items_per_s": 16000.0,
    }
    assert "items" not in head and "items_per_s" not in head
    rec(fact("ran", node="instant", took_us=0, items=5))
    rec(fact("finished", took_us=1))
    assert [row for row in nodes(store, run="r", last=1) if row["node"] == "instant"][0]["items_per_s"] is None


# -- the fleet, as the workers measured it -------------------------------------------------


@pytest.mark.pure
def test_fleet_takes_a_trip_s_time_from_what_the_worker_measured(store):
    rec = Recorder(store, run="r")
    # two branches of 200 ms side by side on w1: 400 ms of nodes in 201 ms of the worker's
    rec(fact("ran", node="a", took_us=200_000, host="w1", items=8))
    rec(fact("ran", node="b", took_us=200_000, host="w1", items=8))
    rec(fact("left", host="w1", took_us=230_000, worked_us=201_000))
    rec(fact("ran", node="c", took_us=50, host="w2"))
    rec(fact("left", host="w2", took_us=80))  # a worker that did not say: the sum of its nodes
    rec(fact("finished", took_us=231_000))
    assert fleet(store, run="r") == {
        "w1": {"slices": 1, "took_us": 201_000, "waiting_us": 29_000, "items": 8, "items_per_s": 8 * 1e6 / 201_000},
        "w2": {"slices": 1, "took_us": 50, "waiting_us": 30},
    }


@pytest.mark.pure
def test_a_trip_that_never_came_back_still_counts_what_ran_there(store):
    rec = Recorder(store, run="r")
    rec(fact("ran", node="a", took_us=70, host="w1"))
    rec(fact("failed", node="b", host="w1", error="ValueError: no"))
    rec(fact("broke", took_us=100, error="node `b` on `w1` raised"))
    assert fleet(store, run="r") == {"w1": {"slices": 0, "took_us": 70, "waiting_us": 0}}


def test_two_parallel_branches_on_a_real_worker_count_once(store):
    rec = Recorder(store, run="r")
    spawned = Worker.spawn(WORKER, mode="network", send=[fabric_nodes])
    with Broker.embedded({"w1": spawned}) as broker:
        g = fabric_nodes.Sleep(0.2).named("a").at("w1") & fabric_nodes.Sleep(0.2).named("b").at("w1")
        g.forward(1, broker=broker, watching=rec)  # the first trip also starts the worker
        g.forward(1, broker=broker, watching=rec)
    left = [f for f in facts(store, run="r", forward=1) if f["fact"] == "left"]
    assert len(left) == 1 and "worked_us" in left[0]
    w1 = fleet(store, run="r", last=1)["w1"]
    assert 200_000 <= w1["took_us"] < 300_000  # not 400 ms: the branches ran side by side
    assert w1["took_us"] + w1["waiting_us"] == int(left[0]["took_us"])  # the wire and the queue


@pytest.mark.pure
def test_a_host_is_joined_to_its_machine_by_the_name_its_worker_said(store):
    rec = Recorder(store, run="r")
    rec(elsewhere(fact("said", **self_report(4, machine="gpu-box-1")), "w1"))
    rec(fact("ran", node="a", took_us=300, host="w1"))
    rec(fact("left", host="w1", took_us=400))
    rec(fact("ran", node="b", took_us=5, host="w2"))
    rec(fact("left", host="w2", took_us=9))
    rec(fact("finished", took_us=500))
    rows = fleet(store, run="r")
    assert rows["w1"]["machine"] == "gpu-box-1" and "machine" not in rows["w2"]
    assert rows["w1"]["said"]["slices"] == "4" and "fact" not in rows["w1"]["said"]  # told down the wire
    report(store, "gpu-box-1", {"kind": "load", "slices": "9"})
    report(store, "w1", {"kind": "load", "slices": "1"})  # the host's name loses to the machine's
    report(store, "w2", {"kind": "load", "slices": "2"})  # but serves a host that said nothing
    rows = fleet(store, run="r")
    assert rows["w1"]["said"] == {"kind": "load", "slices": "9", "machine": "gpu-box-1"}
    assert rows["w2"]["said"]["slices"] == "2"
    w1, w2 = machines(store, run="r", as_text=True).splitlines()[1:]
    assert w1.endswith("  on gpu-box-1") and "on " not in w2


@pytest.mark.pure
def test_a_worker_says_the_name_it_was_given():
    assert self_report(0, machine="gpu-box-1")["machine"] == "gpu-box-1"
    assert self_report(0)["machine"]  # this computer's name, without one
    with pytest.raises(ValueError, match="machine"):
        self_report(0, machine="")


def test_a_worker_started_with_a_machine_name_says_it_down_the_connection(tmp_path, processes):
    from conftest import env_with_tests

    store = FolderStore(tmp_path / "store")
    worker = processes(
        [*WORKER, "--listen", "127.0.0.1:0", "--announce", "--reporting", "0.01", "--machine", "gpu-box-1"],
        env=env_with_tests(),
    )
    rec = Recorder(store, run="r")
    with Broker.embedded({"w1": Worker.at(worker.endpoint, mode="project")}) as broker:
        for x in range(2):
            (fabric_nodes.Add(1).named("a").at("w1") >> fabric_nodes.Add(1).named("b")).forward(
                x, broker=broker, watching=rec
            )
    said = [f for n in range(2) for f in facts(store, run="r", forward=n) if f["fact"] == "said"]
    assert said and {f["machine"] for f in said} == {"gpu-box-1"}
    assert fleet(store, run="r")["w1"]["machine"] == "gpu-box-1"


# -- a study's trials ------------------------------------------------------------------------


def attempt(
    store, study, trial, number, *, state, config=None, score=None, took_us=None, runner="r1", error="", **said
):
    record = {
        "trial": str(trial),
        "attempt": str(number),
        "config": json.dumps(config if config is not None else {"lr": 0.1 * (trial + 1)}),
        "state": state,
        "score": "" if score is None else repr(float(score)),
        "took_us": "" if took_us is None else str(took_us),
        "runner": runner,
        "error": error,
        "loss.value": "0.5",
        **{f"said.{key}": str(value) for key, value in said.items()},
    }
    store.put(f"{study}/trial/{trial:06d}.{number:03d}", record, b'{"fact": "loss", "value": "0.5"}\n')


def define(store, study, direction="minimize"):
    store.put(f"{study}/study", {"name": study, "direction": direction, "trials": "40", "attempts": "3"})


def a_study(store, study="tune", direction="minimize"):
    define(store, study, direction)
    attempt(store, study, 0, 0, state="done", score=0.8, took_us=1200, epoch=3, loss=0.8)
    attempt(store, study, 1, 0, state="running", runner="r2")  # killed: abandoned by attempt 1
    attempt(store, study, 1, 1, state="done", score=0.4, took_us=900, runner="r1")
    attempt(store, study, 2, 0, state="failed", took_us=30, error="ValueError: lr too high")
    attempt(store, study, 3, 0, state="pruned", took_us=400, epoch=1, loss=2.5)
    attempt(store, study, 4, 0, state="done", score=0.5, took_us=1000)
    attempt(store, study, 5, 0, state="running", runner="r2", epoch=2)
    attempt(store, study, 6, 0, state="running")
    attempt(store, study, 6, 1, state="running")
    attempt(store, study, 6, 2, state="abandoned")  # out of attempts


@pytest.mark.pure
def test_trials_tells_each_trial_from_one_scan_and_no_fetch(counting):
    a_study(counting)
    attempt(counting, "other", 0, 0, state="done", score=0.0)  # another study is not read
    counting.reset()
    rows = trials(counting, study="tune")
    assert (counting.scans, counting.fetches) == (1, 0)
    assert [(r["trial"], r["state"], r["attempts"], r["score"]) for r in rows] == [
        (0, "done", 1, 0.8),
        (1, "done", 2, 0.4),
        (2, "failed", 1, None),
        (3, "pruned", 1, None),
        (4, "done", 1, 0.5),
        (5, "running", 1, None),
        (6, "abandoned", 3, None),
    ]
    first = rows[0]
    assert first == {
        "trial": 0,
        "state": "done",
        "score": 0.8,
        "attempts": 1,
        "took_us": 1200,
        "config": {"lr": 0.1},
        "said": {"epoch": 3.0, "loss": 0.8},
        "runner": "r1",
    }
    assert rows[1]["runner"] == "r1" and rows[1]["took_us"] == 900  # the attempt that counts
    assert rows[2]["error"] == "ValueError: lr too high" and "error" not in rows[0]
    assert rows[3]["said"] == {"epoch": 1.0, "loss": 2.5}
    assert rows[5]["took_us"] is None and rows[5]["said"] == {"epoch": 2.0}
    assert trials(counting, study="nothing-here") == []


@pytest.mark.pure
def test_one_scan_serves_the_rows_and_every_attempt(counting):
    """The view's study page reads its rows and its attempts (importances, timeline) from
    one scan: what that gives is what `trials` and `History.scan` give, each from its own."""
    from somatize.record.studies import trial_records, trials_of
    from somatize.study.history import History

    a_study(counting)
    counting.put("tune/trial/000007.000", {"state": "sleeping"})  # a record that fails its checks
    counting.reset()
    scanned = trial_records(counting, "tune")
    rows, history = trials_of(counting, "tune", scanned), History.of(counting, "tune", scanned)
    assert (counting.scans, counting.fetches) == (1, 0)
    alone = History.scan(counting, "tune")
    assert rows == trials(counting, study="tune")
    assert [(t.number, [(a.attempt, a.record, a.problem) for a in t.attempts]) for t in history] == [
        (t.number, [(a.attempt, a.record, a.problem) for a in t.attempts]) for t in alone
    ]
    assert len(history) == 8 and history.trials[7].attempts[0].problem  # left out, as a scan of its own does
    with pytest.raises(BadName):
        trial_records(counting, "../tune")


@pytest.mark.pure
def test_the_highest_attempt_counts_whatever_a_late_one_wrote(store):
    define(store, "tune")
    attempt(store, "tune", 0, 1, state="done", score=0.5, runner="r2")
    attempt(store, "tune", 0, 0, state="done", score=0.1, runner="r1")  # woke up after the takeover
    (row,) = trials(store, study="tune")
    assert (row["score"], row["runner"], row["attempts"]) == (0.5, "r2", 2)
    assert best(store, study="tune")["score"] == 0.5


@pytest.mark.pure
def test_best_is_the_best_done_trial_by_the_study_s_direction_from_one_scan(counting):
    a_study(counting)
    counting.reset()
    top = best(counting, study="tune")
    assert (counting.scans, counting.fetches) == (1, 0)
    assert top["trial"] == 1 and top["score"] == 0.4 and top["config"] == {"lr": 0.2}

    a_study(counting, "up", direction="maximize")
    assert best(counting, study="up")["trial"] == 0

    define(counting, "ties")
    for trial in range(3):
        attempt(counting, "ties", trial, 0, state="done", score=float("nan") if trial == 0 else 1.0)
    assert best(counting, study="ties")["trial"] == 1  # a NaN is no score; among equals, the first

    define(counting, "fresh")
    attempt(counting, "fresh", 0, 0, state="running")
    assert best(counting, study="fresh") is None


@pytest.mark.pure
def test_best_of_a_study_that_is_not_there_says_so(store, capfd):
    attempt(store, "orphan", 0, 0, state="done", score=1.0)
    with pytest.raises(Missing, match="no study 'orphan'"):
        best(store, study="orphan")
    # a direction that is neither: nothing is called best (not the worst, by a guess), said once
    define(store, "odd", direction="sideways")
    attempt(store, "odd", 0, 0, state="done", score=1.0)
    assert best(store, study="odd") is None and best(store, study="odd") is None
    assert "*" not in str(scores(store, study="odd", as_text=True)).splitlines()[-1]
    err = capfd.readouterr().err
    assert err.count("odd/study is left out: its direction 'sideways' is neither 'minimize' nor 'maximize'") == 1, err
    for bad in ["", "/abs", ".hidden", 3]:
        with pytest.raises(BadName):
            trials(store, study=bad)


@pytest.mark.pure
def test_a_record_that_is_not_what_a_trial_writes_is_named_and_left_out(store, capfd):
    define(store, "tune")
    attempt(store, "tune", 0, 0, state="done", score=1.0)
    store.put("tune/trial/000001.000", {"state": "done", "score": "lots", "config": "{}"})
    assert [row["trial"] for row in trials(store, study="tune")] == [0]
    assert "the record tune/trial/000001.000 is left out: its score 'lots' is not a number" in capfd.readouterr().err
    store.put("tune/trial/000002.000", {"state": "done", "score": "1.0", "config": "{lr: 1"})
    assert [row["trial"] for row in trials(store, study="tune")] == [0]
    assert "tune/trial/000002.000 is left out: its config is not JSON" in capfd.readouterr().err
    store.put("tune/trial/000001.000", {"state": "running"})  # nothing written yet but the claim
    assert trials(store, study="tune")[1] == {
        "trial": 1,
        "state": "running",
        "score": None,
        "attempts": 1,
        "took_us": None,
        "config": {},
        "said": {},
        "runner": "",
    }


def test_a_history_of_a_thousand_trials_is_one_scan(counting):
    define(counting, "long")
    for trial in range(1000):
        attempt(counting, "long", trial, 0, state="done", score=1000 - trial, took_us=trial)
    counting.reset()
    rows = trials(counting, study="long")
    assert (counting.scans, counting.fetches) == (1, 0)
    assert len(rows) == 1000 and rows[-1]["score"] == 1.0
    assert best(counting, study="long")["trial"] == 999
    assert (counting.scans, counting.fetches) == (2, 0)


@pytest.mark.pure
def test_scores_draws_each_trial_and_the_best_so_far_as_text(counting, capsys):
    a_study(counting)
    counting.reset()
    chart = scores(counting, study="tune", as_text=True)
    assert (counting.scans, counting.fetches) == (1, 0)
    assert repr(chart) == str(chart)  # shows drawn, not quoted
    title, *lines = chart.splitlines()
    assert title == "study 'tune' (minimize): score per trial, the best so far, * a new best"
    assert len(lines) == 7
    assert lines[0].split()[:3] == ["0", "done", "0.8"] and lines[0].count("#") == 40
    assert lines[0].endswith("best 0.8  *")
    assert lines[1].split()[:3] == ["1", "done", "0.4"] and lines[1].count("#") == 1
    assert lines[1].endswith("best 0.4  *")
    assert lines[2].split() == ["2", "failed", "-", "best", "0.4"]
    assert lines[4].split()[:3] == ["4", "done", "0.5"] and lines[4].endswith("best 0.4")  # no new best
    assert lines[6].split() == ["6", "abandoned", "-", "best", "0.4"]
    define(counting, "empty")
    assert scores(counting, study="empty", as_text=True) == "study 'empty' has no trials yet"
    assert capsys.readouterr().out == ""  # never prints by itself


@pytest.mark.pure
def test_one_diverged_trial_does_not_flatten_the_others_bars(store):
    """Scores from 0.93 to 0.978 were all drawn as full bars because one trial scored 0.48:
    the bars spanned every score. Now they span the scores but those far out."""
    define(store, "acc", "maximize")
    for trial, score in enumerate([0.95, 0.48, 0.93, 0.978, 0.94, 0.96]):
        attempt(store, "acc", trial, 0, state="done", score=score)
    title, *lines = scores(store, study="acc", as_text=True).splitlines()
    assert title.endswith("; bars span 0.93 to 0.978, < and > mark scores beyond")
    bars = {float(line.split()[2]): line.split()[3] for line in lines}
    assert bars[0.48] == "<"
    assert bars[0.93] == "#" and bars[0.978] == "#" * 40
    assert len(bars[0.93]) < len(bars[0.94]) < len(bars[0.95]) < len(bars[0.96]) < len(bars[0.978])


@pytest.mark.pure
def test_scores_without_matplotlib_is_the_text_chart(store, monkeypatch):
    a_study(store)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    assert scores(store, study="tune") == scores(store, study="tune", as_text=True)


def test_scores_draws_a_figure_when_matplotlib_is_there(store):
    figure_module = pytest.importorskip("matplotlib.figure")
    a_study(store, direction="maximize")
    drawn = scores(store, study="tune")
    assert isinstance(drawn, figure_module.Figure)
    (axes,) = drawn.axes
    points = axes.collections[0].get_offsets().tolist()
    assert points == [[0, 0.8], [1, 0.4], [4, 0.5]]  # the done trials' scores
    (line,) = axes.get_lines()
    assert list(line.get_ydata()) == [0.8] * 7  # maximizing: 0.8 stays the best
    assert "maximize" in axes.get_title()


@pytest.mark.pure
def test_a_machine_report_that_says_a_load_no_worker_says_is_named_and_left_out(store, capfd):
    """Attack: a writer files ``machine/box`` with a load of ``nan``, a count of ``²`` or
    another machine's name; ``latest`` leaves each out with one line, and keeps the rest."""
    report(store, "w1", {"kind": "load", "load1": "0.50", "slices": "3", "gpu": "A100"})
    for bad in ({"load1": "nan"}, {"slices": "\u00b2"}, {"pid": "-1"}):
        store.put("machine/box", {"kind": "load", "machine": "box", **bad})
        assert set(latest(store)) == {"w1"}
    store.put("machine/box", {"kind": "load", "machine": "w1"})
    assert set(latest(store)) == {"w1"}
    err = capfd.readouterr().err
    for said in (
        "its load1 'nan' is not a load",
        "its slices '\u00b2' is not a whole number",
        "its pid '-1' is not a whole number",
        "it says it is machine 'w1', but is filed under 'box'",
    ):
        assert err.count(f"machine/box is left out: {said}") == 1, err
