"""The record: one entry per forward, written when it ends, and the readers with their prices.

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

import pytest

import fabric_nodes
from conftest import WORKER
from somatize import Broker, FolderStore, Node, NodeFailed, NotAWatcher, Worker, fact
from somatize.errors import BadName, Missing
from somatize.facts import CLOSING, ENGINE, elsewhere
from somatize.record import (
    Recorder,
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
    self_report,
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


def test_the_two_facts_that_end_a_run_say_so_and_a_node_failing_is_not_one_of_them(store):
    assert CLOSING == {"finished", "broke"} and "failed" in ENGINE and "failed" not in CLOSING
    rec = Recorder(store, run="r")
    with pytest.raises(NodeFailed):
        (Add().named("a") >> Boom().named("boom")).forward(1, watching=rec)
    assert [f["fact"] for f in facts(store, run="r", forward=0)] == ["ran", "failed", "broke"]
    assert names(store, "r") == ["run/r/0"]  # `failed` closed nothing: one record


# -- written down ------------------------------------------------------------------------


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


def test_the_detail_is_in_the_blob_in_the_order_it_arrived(store):
    seen = Collect()
    chain().forward(1, watching=[seen, Recorder(store, run="r")])
    assert facts(store, run="r", forward=0) == list(seen)
    lines = bytes(store.fetch("run/r/0")).decode("utf-8").splitlines()
    assert [json.loads(line) for line in lines] == list(seen)  # JSON lines, readable as is
    assert [f["fact"] for f in seen] == ["ran", "ran", "ran", "finished"]


def test_each_forward_is_its_own_record_numbered_from_zero(store):
    rec = Recorder(store, run="r")
    for step in range(12):
        chain().forward(step, watching=rec)
    with pytest.raises(NodeFailed):
        Boom().named("boom").forward(1, watching=rec)
    assert [row["forward"] for row in forwards(store, run="r")] == list(range(13))
    assert sorted(int(n.rsplit("/", 1)[1]) for n in names(store, "r")) == list(range(13))
    assert store.record("run/r/10")["forward"] == "10"


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


def test_a_fact_said_before_any_forward_closed_waits_for_the_first(store):
    rec = Recorder(store, run="r", summarising=["said"])
    rec({"fact": "said", "kind": "load", "load1": "0.50"})  # fact()'s own `kind` is taken
    chain().forward(1, watching=rec)
    written = facts(store, run="r", forward=0)
    assert written[0] == {"fact": "said", "kind": "load", "load1": "0.50"}
    assert store.record("run/r/0")["said.load1"] == "0.50"


# -- from Python -------------------------------------------------------------------------


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


def test_a_list_of_watchers_is_told_and_something_that_is_not_callable_is_refused(store):
    chain().forward(1, watching=[Recorder(store, run="one"), Recorder(store, run="two")])
    assert facts(store, run="one", forward=0) == facts(store, run="two", forward=0)
    with pytest.raises(NotAWatcher):
        chain().forward(1, watching=[Recorder(store, run="three"), "not callable"])
    with pytest.raises(NotAWatcher):
        chain().forward(1, watching=store)  # a store is where a recorder writes, not a watcher
    assert runs(store) == ["one", "two"]  # refused before anything ran


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
    w1 = fleet(store, run="remote")["w1"]
    assert w1["slices"] == 1 and w1["took_us"] == int(ran["far"]["took_us"]) and w1["waiting_us"] >= 0
    assert {row["node"]: row.get("host") for row in nodes(store, run="remote")} == {"local": None, "far": "w1"}


# -- facts from several threads at once --------------------------------------------------

WIDTH = 12


def wide():
    g = Nap().named("n0")
    for i in range(1, WIDTH):
        g = g & Nap().named(f"n{i}")
    return g


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


def test_runs_is_one_scan_and_sorted(counting):
    for run in ["b", "a", "c"]:
        record_run(counting, run, 1)
    report(counting, "w1", {"kind": "load"})  # a machine's report is not a run
    counting.reset()
    assert runs(counting) == ["a", "b", "c"]
    assert (counting.scans, counting.fetches) == (1, 0)


def test_curve_answers_from_one_scan_when_the_kind_was_summarised(counting):
    record_run(counting, "r", 5)
    counting.reset()
    assert curve_costs(counting, run="r") == {"scans": 1, "fetches": 0, "summarised": True, "forwards": 5}
    assert (counting.scans, counting.fetches) == (1, 0)
    counting.reset()
    assert curve(counting, run="r") == [(step, 1 / (step + 1)) for step in range(5)]
    assert (counting.scans, counting.fetches) == (1, 0)


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


def test_a_curve_of_text_says_which_forward_is_not_a_number(store):
    rec = Recorder(store, run="r", summarising=["loss"])
    chain().forward(1, watching=rec)
    rec(fact("loss", value="plenty"))
    with pytest.raises(ValueError, match="forward 0"):
        curve(store, run="r")
    assert forwards(store, run="r")[0]["loss.value"] == "plenty"


def test_facts_of_one_forward_are_one_fetch(counting):
    record_run(counting, "r", 3)
    counting.reset()
    written = facts(counting, run="r", forward=1)
    assert (counting.scans, counting.fetches) == (0, 1)
    assert [f["fact"] for f in written] == ["ran", "ran", "ran", "finished", "loss"]
    with pytest.raises(Missing):
        facts(counting, run="r", forward=7)


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
        [*WORKER, "--listen", "127.0.0.1:0", "--announce", "--store", str(store.path), "--reporting", "0.2",
         "--machine", "gpu-box-1"],
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
