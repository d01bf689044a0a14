"""The repeated call: what does not change between forwards of one graph is worked out once.

- A graph's plan (grouped, compiled, wired) is made once and kept on the graph, per set of
  hosts that run in this process; a forward with a store and cached steps still plans
  afresh (what is recalled changes the plan).
- A host that runs in this process (``Worker.inprocess()``) is no second plan: its steps
  are the walk's own, tagged with the host, and say what a trip to a host says (``ran``
  with ``host``, ``left``, then ``kept``), and keep a cached step whether anyone watches or not.
- The client packs a group's steps once per packer, and again when the codec registry
  changes (what a network-mode artifact carries).
- A process running pieces (a worker) compiles each shape once; what it keeps is a function
  of the shape alone, so one client's piece never runs on another's nodes.
- A worker with one job keeps a recipe's steps (each node in its guard) between calls and
  swaps only the job they report to; a recipe built with other nodes, or a placement,
  makes its own (``fabric.worker.prepared``).

Then each of these, attacked on real workers: a node run alone (``engine.run_lone``, for a
piece of one node, unwatched, keeping nothing) fails and answers exactly as the walk does,
whatever it raises or returns and whatever shape its recipe has; what a graph keeps of a
forward (its trip, the listing its hosts were checked on) never serves another broker, a copy
of the graph or another store.
"""

from __future__ import annotations

import copy
import gc
import os
import pickle
import re
import socket
import threading
import time
import weakref

import fabric_nodes
import msgpack
import pytest
from by_hand import PATIENCE, WAIT, by_digest, final, full, spec_of
from conftest import WORKER
from fabric_nodes import Add, Boom, Count, Pid, Raiser, Sleep, Wrap
from peers import within

from somatize import Broker, FolderStore, Node, NodeFailed, Overdue, SomatizeError, UnknownHost, Worker, codec
from somatize.codec import forget
from somatize.engine import Piece, _plan_of, lone_step, run_lone, run_piece
from somatize.fabric.pieces import piece_of
from somatize.fabric.worker.loop import WorkerLoop
from somatize.fabric.worker.prepared import Prepared
from somatize.fabric.worker.slots import Abandoned, Job
from somatize.graph import Step, as_graph
from somatize.packing import Catalog, Packer
from somatize.plan import Join, Remote, Run, make
from somatize.wire import Bye, Done, Hello, Ready, Recipe, Refusal, Runtime, Work, limits, recipe_digest
from somatize.wiring import _piece_plans


@pytest.fixture
def unused_tcp_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Collect(list):
    def __call__(self, fact):
        self.append(fact)

    def kinds(self):
        return [(f["fact"], f.get("host")) for f in self]


class Thread(Node):
    """Says which thread ran it."""

    def forward(self, x):
        return threading.get_ident()


# -- a graph's plan is made once ----------------------------------------------------------


def test_a_graph_is_planned_once_and_its_plan_depends_on_the_hosts_that_run_here():
    g = Add(1).named("a") >> Add(2).named("b").at("w1")
    here, nowhere = frozenset({"w1"}), frozenset()
    assert _plan_of(g, nowhere) is _plan_of(g, nowhere)
    assert _plan_of(g, here) is _plan_of(g, here)
    assert [type(op) for op in _plan_of(g, nowhere).ops] == [Run, Remote]
    assert [type(op) for op in _plan_of(g, here).ops] == [Run, Run]
    with Broker.embedded({"w1": Worker.inprocess()}) as broker:
        assert broker.here() == here
        assert g.forward(1, broker=broker) == g.forward(1, broker=broker) == 4


def test_a_graph_run_wholly_here_never_asks_the_broker(unused_tcp_port):
    # nobody listens there: asking it anything would wait, then raise Unreachable
    with Broker.at(f"tcp://127.0.0.1:{unused_tcp_port}", patience=2.0) as broker:
        started = time.monotonic()
        assert (Add(1).named("a") >> Add(1).named("b")).forward(1, broker=broker) == 3
        assert time.monotonic() - started < 1.0


@pytest.mark.pure
def test_a_forward_with_a_store_still_plans_for_what_it_recalls(tmp_path):
    calls = tmp_path / "calls"
    store = FolderStore(tmp_path / "store")
    g = Count(str(calls)).named("count").cached().frozen() >> Add(1).named("add")
    first, second = Collect(), Collect()
    assert list(g.forward(1, store=store, watching=first)) == [2, 3, 4]
    assert list(g.forward(1, store=store, watching=second)) == [2, 3, 4]
    assert [k for k, _ in first.kinds()] == ["ran", "kept", "ran", "finished"]
    assert [k for k, _ in second.kinds()] == ["recalled", "ran", "finished"]
    assert calls.read_text() == "x\n"


# -- an InProcess host's steps are the walk's own --------------------------------------------


@pytest.mark.pure
def test_an_inprocess_group_compiles_to_tagged_local_steps_closed_by_its_last():
    g = Add(1).named("a").at("w1") >> Add(1).named("b").at("w1") >> Add(1).named("c")
    ops = make(g, here=frozenset({"w1"})).ops
    assert [(type(op), op.host) for op in ops] == [(Run, "w1"), (Run, "w1"), (Run, None)]
    assert ops[0].opens != 0 and ops[1].opens == ops[2].opens == 0  # timed from the group's first
    assert ops[0].closes is None and ops[1].closes.host == "w1" and ops[1].closes.steps == (0, 1)
    parallel = make(Add(1).named("a").at("w1") & Add(2).named("b").at("w1"), here=frozenset({"w1"})).ops
    assert [type(op) for op in parallel] == [Run, Run, Join]
    assert parallel[0].opens == parallel[1].opens != 0  # either branch may start first
    assert parallel[-1].closes is not None and parallel[-1].closes.steps == (0, 1)
    assert make(g).remotes and not make(g, here=frozenset({"w1"})).remotes


def test_an_inprocess_group_says_what_a_trip_says_and_keeps_after_left(tmp_path):
    store = FolderStore(tmp_path / "store")
    seen = Collect()
    g = Add(1).named("a").frozen().at("w1") >> Add(1).named("b").at("w1").cached().frozen()
    with Broker.embedded({"w1": Worker.inprocess()}) as broker:
        assert g.forward(1, broker=broker, store=store, watching=seen) == 3
        again = Collect()
        assert g.forward(1, broker=broker, store=store, watching=again) == 3
    assert seen.kinds() == [("ran", "w1"), ("ran", "w1"), ("left", "w1"), ("kept", None), ("finished", None)]
    left = seen[2]
    assert left["took_us"].isdigit() and left["worked_us"] == left["took_us"]
    assert again.kinds() == [("recalled", None), ("finished", None)]


def test_an_inprocess_parallel_group_runs_its_branches_and_closes_once():
    seen = Collect()
    g = Add(1).named("start") >> (Add(1).named("a").at("w1") & Add(2).named("b").at("w1")) >> Thread().named("end")
    with Broker.embedded({"w1": Worker.inprocess()}) as broker:
        assert g.forward(0, broker=broker, watching=seen) == threading.get_ident()
        assert (Add(1).named("a").at("w1") & Add(2).named("b").at("w1")).forward(0, broker=broker) == (1, 2)
    kinds = seen.kinds()
    assert kinds[0] == ("ran", None) and kinds[-2:] == [("ran", None), ("finished", None)]
    assert sorted(kinds[1:3]) == [("ran", "w1"), ("ran", "w1")] and kinds[3] == ("left", "w1")


def test_an_inprocess_failure_names_the_node_and_the_host():
    seen = Collect()
    g = Add().named("a").at("w1") >> Boom().named("boom").at("w1")
    with Broker.embedded({"w1": Worker.inprocess()}) as broker:
        with pytest.raises(NodeFailed, match=r"node `boom` on `w1` raised ValueError: remote trouble") as info:
            g.forward(1, broker=broker, watching=seen)
        assert Add().named("a").at("w1").forward(1, broker=broker) == 2  # nothing left half-open
    assert info.value.node == "boom" and info.value.host == "w1"
    assert isinstance(info.value.__cause__, ValueError)
    assert seen.kinds() == [("ran", "w1"), ("failed", "w1"), ("broke", None)]
    assert seen[-1]["error"] == "node `boom` on `w1` raised ValueError: remote trouble"


def test_an_inprocess_group_checks_the_deadline_between_its_steps():
    g = Sleep(0.3).named("slow").at("w1") >> Add(1).named("next").at("w1")
    with Broker.embedded({"w1": Worker.inprocess()}) as broker:
        with pytest.raises(Overdue, match=r"before `next` could start in this process"):
            g.forward(1, broker=broker, deadline=0.1)


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


# -- the client packs a group once -----------------------------------------------------------


def test_a_group_is_packed_once_and_again_when_the_codec_registry_changes():
    class Reading:
        def __init__(self, hz):
            self.hz = hz

    g = Add(1).named("a").at("w1")
    with Broker.embedded({"w1": Worker.spawn(WORKER, mode="network", send=[fabric_nodes])}) as broker:
        for x in range(5):
            assert g.forward(x, broker=broker) == x + 1
        packer = broker._channels.packers["w1"]
        assert packer.pickles == 1
        (memo,) = [op.__dict__["_memo"] for op in _plan_of(g, frozenset()).remotes]
        assert [ref() for ref, _, _ in memo.values()] == [packer]
        codec("tests.repeated.Reading", Reading, dump=lambda r: str(r.hz).encode(), load=lambda b: Reading(float(b)))
        try:
            assert g.forward(10, broker=broker) == 11
            assert packer.pickles == 2  # the artifact carries the registry: packed anew, once
            assert g.forward(11, broker=broker) == 12
            assert packer.pickles == 2
        finally:
            forget("tests.repeated.Reading")
    del broker, packer
    gc.collect()
    assert [ref() for ref, _, _ in memo.values()] == [None]  # a closed broker's packer is not kept


def test_a_graph_that_ran_pickles_without_what_this_process_kept_on_it():
    g = Add(1).named("a").at("w1") >> Add(2).named("b")
    with Broker.embedded({"w1": Worker.spawn(WORKER, mode="network", send=[fabric_nodes])}) as broker:
        assert g.forward(1, broker=broker) == 4
        assert any(k.startswith("_somatize_") for k in g.__dict__)  # its plan, what was checked
        for copied in (pickle.loads(pickle.dumps(g)), copy.deepcopy(g)):
            assert not any(k.startswith("_somatize_") for k in copied.__dict__)
            assert copied.forward(1, broker=broker) == 4


# -- a worker compiles each shape once ------------------------------------------------------


def _piece(steps, shape, value):
    return Piece("", tuple(steps), shape, value, {})


@pytest.mark.pure
def test_pieces_of_one_shape_share_a_compiled_plan_and_run_their_own_nodes():
    shape = ("seq", (("step", 0), ("step", 1)))
    mine = [Step(Add(1), name="a"), Step(Add(10), name="b")]
    theirs = [Step(Add(100), name="a"), Step(Add(1000), name="b")]
    assert run_piece(_piece(mine, shape, 0)).output == 11
    template = _piece_plans[shape][0]
    assert run_piece(_piece(theirs, shape, 0)).output == 1100  # same shape, their own nodes
    assert run_piece(_piece(mine, shape, 1)).output == 12
    assert _piece_plans[shape][0] is template


@pytest.mark.pure
def test_a_piece_whose_shape_uses_more_steps_than_it_has_is_refused():
    shape = ("seq", (("step", 0), ("step", 1), ("step", 2)))
    run_piece(_piece([Step(Add(1))] * 3, shape, 0))
    with pytest.raises(ValueError, match="a piece of 2 steps has a shape that uses 3"):
        run_piece(_piece([Step(Add(1))] * 2, shape, 0))


@pytest.mark.pure
def test_a_shape_that_cannot_be_kept_is_still_run():
    shape = ("seq", [("step", 0), ("step", 1)])  # a list inside: not hashable, not kept
    assert run_piece(_piece([Step(Add(1)), Step(Add(2))], shape, 0)).output == 3
    assert as_graph(Add(1)).forward(1) == 2


def _work(recipe, value, **fields):
    return Work(1, recipe, value, watched=False, **fields)


@pytest.mark.pure
def test_a_recipe_run_again_keeps_its_steps_and_swaps_their_job():
    a, b = Add(1).named("a"), Add(10).named("b")
    recipe = Recipe(
        tuple(Packer("project").spec(s) for s in (a, b, a)), ("seq", (("step", 0), ("step", 1), ("step", 2)))
    )
    nodes = [a.node, b.node, a.node]
    prepared = Prepared(Catalog("project"))
    first, second = Job("a"), Job("a")
    steps = prepared.steps(_work(recipe, 0), nodes, first)
    assert run_piece(piece_of(_work(recipe, 0), steps)).output == 12
    assert steps[0].node is steps[2].node  # one guard per node and name
    again = prepared.steps(_work(recipe, 5), nodes, second)
    assert again is steps and all(s.node.job is second for s in again)
    assert run_piece(piece_of(_work(recipe, 5), again)).output == 17
    second.abandoned = True  # the job it reports to now decides: its peer was revoked
    with pytest.raises(NodeFailed) as failed:
        run_piece(piece_of(_work(recipe, 5), again))
    assert isinstance(failed.value.__cause__, Abandoned)


@pytest.mark.pure
def test_a_recipe_built_with_other_nodes_or_placed_gets_steps_of_its_own():
    a = Add(1).named("a")
    recipe = Recipe((Packer("project").spec(a),), ("step", 0))
    prepared = Prepared(Catalog("project"), most=2)
    steps = prepared.steps(_work(recipe, 0), [a.node], Job("a"))
    other = Add(100)  # the catalog built it anew (provisioned again, its class replaced)
    fresh = prepared.steps(_work(recipe, 0), [other], Job("a"))
    assert fresh is not steps and run_piece(piece_of(_work(recipe, 0), fresh)).output == 100
    placed = prepared.steps(_work(recipe, 0, placement={0: "cpu"}), [other], Job("a"))
    assert placed is not fresh and placed[0].device == "cpu"
    assert prepared.steps(_work(recipe, 0), [other], Job("a")) is fresh  # the placed one was not kept
    in_a_slot = prepared.steps(_work(recipe, 0), [other], Job("b"), keep=False)  # beside another: its own
    assert in_a_slot is not fresh and fresh[0].node.job.node == "a"
    # another recipe of the same specs (another peer's) is another entry; the oldest goes
    theirs = Recipe(recipe.nodes, recipe.shape)
    assert prepared.steps(_work(theirs, 0), [other], Job("a")) is not fresh
    prepared.steps(_work(Recipe(recipe.nodes, recipe.shape), 0), [other], Job("a"))
    assert len(prepared) == 2


@pytest.mark.pure
def test_kept_steps_let_their_nodes_go_when_the_catalog_does():
    catalog = Catalog("project", built=1)
    one, two = (Packer("project").spec(Add(n).named("a")) for n in (1, 2))
    prepared = Prepared(catalog)
    node = catalog.build(one)
    steps = prepared.steps(_work(Recipe((one,), ("step", 0)), 0), [node], Job("a"))
    gone = weakref.ref(node)
    del node, steps
    newer = catalog.build(two)  # room for it: the catalog lets `one`'s node go
    assert catalog.dropped == 1
    prepared.steps(_work(Recipe((two,), ("step", 0)), 0), [newer], Job("a"))
    gc.collect()
    assert gone() is None and len(prepared) == 1


# -- a worker runs a lone node without a walk -----------------------------------------------


@pytest.mark.pure
def test_a_lone_step_is_found_only_for_a_piece_that_is_that_step_alone():
    a, b = Step(Add(1), name="a"), Step(Add(2), name="b")
    assert lone_step((a,), ("step", 0)) is a
    assert lone_step((a, b), ("seq", (("step", 0), ("step", 1)))) is None  # two steps: the walk
    assert lone_step((a,), ("seq", (("step", 0), ("step", 0)))) is None  # one step, run twice
    assert run_lone(a, 1) == run_piece(_piece([a], ("step", 0), 1)).output == 2


@pytest.mark.pure
def test_a_lone_step_fails_as_the_walk_says_it_fails():
    step = Step(Boom(), name="boom")
    with pytest.raises(NodeFailed) as walked:
        run_piece(_piece([step], ("step", 0), 1))
    with pytest.raises(NodeFailed) as alone:
        run_lone(step, 1)
    for failed in (walked.value, alone.value):
        assert str(failed) == "node `boom` raised ValueError: remote trouble"
        assert (failed.node, failed.error, failed.host) == ("boom", "ValueError", None)
        assert isinstance(failed.__cause__, ValueError)


@pytest.mark.pure
def test_kept_steps_say_which_step_a_recipe_is_alone():
    a, b = Add(1).named("a"), Add(10).named("b")
    one = Recipe((Packer("project").spec(a),), ("step", 0))
    two = Recipe(tuple(Packer("project").spec(s) for s in (a, b)), ("seq", (("step", 0), ("step", 1))))
    prepared = Prepared(Catalog("project"))
    steps, lone = prepared.prepare(_work(one, 0), [a.node], Job("a"))
    assert lone is steps[0] and lone.node.node is a.node  # in its guard
    assert prepared.prepare(_work(one, 0), [a.node], Job("a")) == (steps, lone)  # kept, with its step
    assert prepared.prepare(_work(two, 0), [a.node, b.node], Job("a"))[1] is None
    assert prepared.prepare(_work(one, 0), [a.node], Job("a"), keep=False)[1] is None  # in a slot: the walk
    assert prepared.prepare(_work(one, 0, placement={0: "cpu"}), [a.node], Job("a"))[1] is None


def test_a_worker_runs_a_lone_node_directly_only_when_nobody_watches_and_nothing_is_kept(monkeypatch, tmp_path):
    import somatize.fabric.worker.running as worker_running

    walks, alone = [], []
    monkeypatch.setattr(
        worker_running, "run_piece", lambda piece, watch=None: walks.append(1) or run_piece(piece, watch)
    )
    monkeypatch.setattr(worker_running, "run_lone", lambda step, value: alone.append(1) or run_lone(step, value))
    loop = WorkerLoop(mode="project")
    endpoint = loop.bind("tcp://127.0.0.1:0")
    serving = threading.Thread(target=loop.serve, daemon=True)
    serving.start()
    try:
        add, boom = Add(1).named("add").at("w1"), Boom().named("boom").at("w1")
        with Broker.embedded({"w1": Worker.at(endpoint, mode="project")}) as broker:
            assert [add.forward(i, broker=broker) for i in range(3)] == [1, 2, 3]
            assert (len(alone), len(walks)) == (3, 0)
            seen = Collect()
            assert add.forward(5, broker=broker, watching=seen) == 6  # watched: the walk, and its facts
            assert (len(alone), len(walks)) == (3, 1) and ("ran", "w1") in seen.kinds()
            cached = Add(2).named("cached").at("w1").cached().frozen()
            assert cached.forward(1, broker=broker, store=FolderStore(tmp_path)) == 3  # a key to keep: the walk
            assert (len(alone), len(walks)) == (3, 2)
            failures = []
            for watching in (None, Collect()):  # alone, then walked: the same failure
                with pytest.raises(NodeFailed) as failed:
                    boom.forward(1, broker=broker, watching=watching)
                failures.append(failed.value)
            assert (len(alone), len(walks)) == (4, 3)
            for failure in failures:
                assert str(failure).splitlines()[0] == "node `boom` on `w1` raised ValueError: remote trouble"
                assert (failure.node, failure.error, failure.host) == ("boom", "ValueError", "w1")
                assert 'raise ValueError("remote trouble")' in failure.remote_traceback
    finally:
        loop.stopping.set()
        serving.join(10)
    assert not serving.is_alive()


def test_a_step_found_packable_is_remembered_by_identity_and_forgotten_with_it():
    with Broker.embedded({"w1": Worker.spawn(WORKER, mode="network", send=[fabric_nodes])}) as broker:
        step = Add(1).named("a").at("w1")
        assert step.forward(1, broker=broker) == 2
        assert [ref() for ref in broker._packable.values()] == [step.steps[0]]
        equal = Add(1).named("a").at("w1")  # equal, not the same: packed (checked) for itself
        assert equal.forward(1, broker=broker) == 2 and len(broker._packable) == 2
        del step
        gc.collect()
        assert [ref() for ref in broker._packable.values()] == [equal.steps[0]]


def test_a_one_trip_forward_keeps_its_trip_and_its_host_check_stands_on_the_broker_s_listing(monkeypatch):
    import somatize.plan as plan_module

    node = Add(1).named("a").at("w1")
    asked = []
    real = plan_module._check_hosts
    monkeypatch.setattr(plan_module, "_check_hosts", lambda *a, **k: asked.append(1) or real(*a, **k))
    with Broker.embedded({"w1": Worker.spawn(WORKER, mode="network", send=[fabric_nodes])}) as broker:
        assert [node.forward(i, broker=broker) for i in range(3)] == [1, 2, 3]
        trip = node.__dict__["_somatize_trips"][frozenset()]
        assert trip[0] == "w1" and trip[1] == node.steps and trip[3] is not None
        assert len(asked) == 1  # the first forward's, on the listing it made: not again
        listing = broker.listed()
        assert node.__dict__["_somatize_listed"] is listing
        broker._rendezvous.hosts(refresh=True)  # listed anew: the hosts are asked again, once
        assert broker.listed() is not listing
        assert node.forward(5, broker=broker) == 6 and node.forward(6, broker=broker) == 7
        assert len(asked) == 2
        elsewhere = Add(1).named("b").at("w2")
        with pytest.raises(UnknownHost):  # a host it does not know is still refused, every time
            elsewhere.forward(1, broker=broker)
        with pytest.raises(UnknownHost):
            elsewhere.forward(1, broker=broker)


# -- the lone run, attacked: whatever runs alone answers and fails as the walk does ---------------


FAILURES = ["value", "exit", "interrupt", "generator", "bad str", "unwritable", "too deep", "itself"]


def _failure(call):
    try:
        call()
    except SomatizeError as exc:
        return exc
    raise AssertionError("the call did not fail")


@pytest.mark.parametrize("how", FAILURES)
def test_a_lone_node_fails_on_a_worker_exactly_as_the_walk_says_it_fails(spawned, how):
    """Attack: a node alone, unwatched (run by ``run_lone``), that raises an Exception,
    SystemExit, KeyboardInterrupt, GeneratorExit, an exception whose ``str`` raises, or that
    returns something unwritable or nested past the wire's limits. The same node, watched on
    the same worker, takes the walk: both answers have to be the same failure (type, first
    line, node, error, host), each traceback holding the node's own frame."""
    node = Raiser(how).named("raiser").at("w1")
    with Broker.embedded({"w1": Worker.at(spawned.endpoint, mode="project")}, patience=PATIENCE) as broker:
        alone = within(WAIT, lambda: _failure(lambda: node.forward(1, broker=broker)))
        walked = within(WAIT, lambda: _failure(lambda: node.forward(1, broker=broker, watching=lambda fact: None)))
        again = within(WAIT, lambda: _failure(lambda: node.forward(2, broker=broker)))  # its steps kept now
        assert Add(1).named("after").at("w1").forward(1, broker=broker) == 2  # the worker serves on
    for failure in (alone, walked, again):
        assert type(failure) is type(alone)
        assert str(failure).splitlines()[0] == str(alone).splitlines()[0]
        if isinstance(alone, NodeFailed):
            assert (failure.node, failure.error, failure.host) == (alone.node, alone.error, alone.host)
            assert bool(failure.remote_traceback) == bool(alone.remote_traceback)
            if how not in ("unwritable", "too deep", "itself"):  # a node that raised: its frame is there
                assert failure.remote_traceback and "_fail_here" in failure.remote_traceback
    if how in ("value", "exit", "interrupt", "generator"):
        expected = {
            "value": "ValueError",
            "exit": "SystemExit",
            "interrupt": "KeyboardInterrupt",
            "generator": "GeneratorExit",
        }[how]
        assert isinstance(alone, NodeFailed) and alone.error == expected and alone.node == "raiser"
        assert str(alone).startswith(f"node `raiser` on `w1` raised {expected}")


def test_the_worker_takes_the_lone_run_for_every_kind_of_failure_and_the_walk_when_watched(serving, monkeypatch):
    """Attack, counted: the comparison above is only worth something if the unwatched call
    really ran alone. On a loop in this process, ``run_lone`` is counted for each failure
    kind unwatched, and ``run_piece`` for each watched; the answers agree as above. Here the
    header limit is lowered, so an output over it is cheap to make."""
    import somatize.fabric.worker.running as worker_running

    walks, alone = [], []
    monkeypatch.setattr(
        worker_running, "run_piece", lambda piece, watch=None: walks.append(1) or run_piece(piece, watch)
    )
    monkeypatch.setattr(worker_running, "run_lone", lambda step, value: alone.append(1) or run_lone(step, value))
    # lowered on both sides (one process): a header of a few thousand short strings is over it
    monkeypatch.setattr(limits, "MAX_HEADER", 64 << 10)
    _, endpoint, _ = serving()
    with Broker.embedded({"w1": Worker.at(endpoint, mode="project")}, patience=PATIENCE) as broker:
        for how in ("exit", "interrupt", "generator", "too deep", "over the header limit"):
            node = Raiser(how).named("raiser").at("w1")
            before = (len(alone), len(walks))
            a = within(WAIT, lambda: _failure(lambda: node.forward(1, broker=broker)))
            assert (len(alone), len(walks)) == (before[0] + 1, before[1]), how
            w = within(WAIT, lambda: _failure(lambda: node.forward(1, broker=broker, watching=lambda f: None)))
            assert (len(alone), len(walks)) == (before[0] + 1, before[1] + 1), how
            # a watched Done carries what its work said: a header over the limit is that much longer
            first = [re.sub(r"[\d,]+ bytes", "N bytes", str(e).splitlines()[0]) for e in (a, w)]
            assert type(a) is type(w) and first[0] == first[1], first


SHAPES = [
    ("step", 0),
    ("seq", (("step", 0),)),
    ("seq", (("seq", (("step", 0),)),)),
    ("par", (("step", 0),)),
    ("seq", (("step", 0), ("step", 0))),
    ("par", (("step", 0), ("step", 0))),
    ("seq", (("par", (("step", 0), ("step", 0))), ("step", 0))),
]


@pytest.mark.parametrize("shape", SHAPES, ids=[repr(s)[:40] for s in SHAPES])
def test_a_one_node_recipe_of_any_shape_answers_what_the_walk_answers(spawned, raws, shape):
    """Attack from a raw client: a recipe of one node whose shape is not ``("step", 0)``
    (the node run twice in a row, in parallel, a tuple of one...). Only a shape that is that
    node from input to output may run alone; whatever runs, the output has to be what the
    walk (watched, on the same worker) and ``run_piece`` here give, sent in full or by digest."""
    recipe = Recipe((spec_of(Wrap(), "wrap"),), shape)
    digest = recipe_digest(recipe).digest
    expected = run_piece(Piece("", (Step(Wrap(), name="wrap"),), shape, 10, {})).output
    raw = raws(spawned.endpoint)
    raw.send_frames(full(1, recipe, 10))
    answers = [final(raw, 1)]
    raw.send_frames(full(2, recipe, 10, watched=True))
    answers.append(final(raw, 2))
    raw.send_frames(by_digest(3, digest, 10))  # the express way in: recalled, then run
    answers.append(final(raw, 3))
    raw.send_frames(by_digest(4, digest, 10, watched=True))
    answers.append(final(raw, 4))
    raw.send_frames(by_digest(5, digest, 10))  # its steps kept now
    answers.append(final(raw, 5))
    for answer in answers:
        assert type(answer) is Done and answer.output == expected and answer.produced == {}, (shape, answer)


def _header(frames: list[bytes]) -> dict:
    return msgpack.unpackb(frames[0], strict_map_key=False)


@pytest.mark.parametrize(
    "shape, extra",
    [
        (["step", 1], False),
        (["step", -1], False),
        (["seq", [["step", 0], ["step", 1]]], False),
        (["par", []], False),
        (["step", True], False),
        (["loop", 0], False),
        (["step", 0], True),
        (["step", 1], True),
    ],
    ids=[
        "step 1",
        "step -1",
        "seq naming 1",
        "empty par",
        "step True",
        "unknown",
        "a second node never used",
        "the first node never used",
    ],
)
def test_a_recipe_whose_shape_does_not_fit_its_nodes_is_refused_alike_watched_or_not(spawned, raws, shape, extra):
    """Attack from a raw client: a header written by hand, a recipe whose shape names a step
    it does not have, or of two nodes whose shape runs one alone (the lone run's shape, with
    a node to spare). Refused (naming the work) the same way unwatched (which would run
    alone) and watched, nothing run, and the worker serves on."""
    recipe = Recipe((spec_of(Add(1), "inc"),), ("step", 0))
    spare = msgpack.unpackb(full(9, Recipe((spec_of(Add(100), "spare"),), ("step", 0)), 0)[0], strict_map_key=False)[
        "recipe"
    ]["nodes"][0]
    raw = raws(spawned.endpoint)
    refusals = []
    for ref, watched in ((1, False), (2, True)):
        header = _header(full(ref, recipe, 10, watched=watched))
        header["recipe"]["shape"] = shape
        if extra:
            header["recipe"]["nodes"].append(spare)
        raw.send_frames([msgpack.packb(header)])
        refused = final(raw, ref)
        assert isinstance(refused, Refusal) and refused.ref == ref, refused
        refusals.append(refused.why)
    assert refusals[0] == refusals[1]
    raw.send_frames(full(3, recipe, 10))
    assert final(raw, 3).output == 11


@pytest.mark.parametrize("cache", [False, True], ids=["not cached", "cached"])
def test_keys_naming_the_one_step_take_the_walk_and_keep_what_the_walk_keeps(spawned, raws, cache):
    """Attack: a one-node recipe with ``keys`` naming step 0 (something to keep): it may not run
    alone. Unwatched and watched answer the same output, and the same ``produced`` (the
    output under step 0 when the step is cached, nothing when it is not)."""
    recipe = Recipe((spec_of(Add(1), "inc", cache=cache),), ("step", 0))
    key = "sha256:" + "1" * 64
    raw = raws(spawned.endpoint)
    answers = []
    for ref, watched in ((1, False), (2, True)):
        raw.send_frames(full(ref, recipe, 10, watched=watched, keys={0: key}))
        answers.append(final(raw, ref))
    for answer in answers:
        assert type(answer) is Done and answer.output == 11, answer
        assert answer.produced == ({0: 11} if cache else {}), answer


@pytest.mark.pure
def test_an_abandoned_job_stops_its_lone_node_before_it_runs(tmp_path):
    """Attack: revocation. A recipe's kept steps are guarded; once the job they report to is
    abandoned (its peer's key revoked), the lone run must refuse to run the node, as the walk
    does, and the node must not run at all."""
    counted = tmp_path / "count.txt"
    node = Count(str(counted))
    recipe = Recipe((Packer("project").spec(node.named("count").steps[0]),), ("step", 0))
    prepared = Prepared(Catalog("project"))
    work = Work(1, recipe, 0, watched=False)
    first = Job("count")
    steps, lone = prepared.prepare(work, [node], first)
    assert lone is steps[0]
    assert list(run_lone(lone, 0)) == [0, 1, 2] and counted.read_text() == "x\n"
    second = Job("count")
    again, lone_again = prepared.prepare(work, [node], second)  # kept: the guard swaps its job
    assert lone_again is lone
    second.abandoned = True
    with pytest.raises(NodeFailed) as alone:
        run_lone(lone_again, 0)
    with pytest.raises(NodeFailed) as walked:
        run_piece(piece_of(work, again))
    for failed in (alone.value, walked.value):
        assert isinstance(failed.__cause__, Abandoned) and failed.node == "count"
    assert str(alone.value) == str(walked.value)
    assert counted.read_text() == "x\n"  # ran once, before it was abandoned


def test_a_worker_with_more_than_one_job_never_runs_a_node_alone(serving, monkeypatch):
    """Attack: with ``jobs=2`` pieces run in slots, each made for itself: the lone run (which
    needs steps kept across calls) must never be taken, express calls included."""
    import somatize.fabric.worker.running as worker_running

    alone, walks = [], []
    monkeypatch.setattr(worker_running, "run_lone", lambda step, value: alone.append(1) or run_lone(step, value))
    monkeypatch.setattr(
        worker_running, "run_piece", lambda piece, watch=None: walks.append(1) or run_piece(piece, watch)
    )
    _, endpoint, _ = serving(jobs=2)
    node = Add(1).named("inc").at("w1")
    with Broker.embedded({"w1": Worker.at(endpoint, mode="project")}, patience=PATIENCE) as broker:
        assert [node.forward(i, broker=broker) for i in range(10)] == list(range(1, 11))
        with pytest.raises(NodeFailed, match="raised SystemExit"):
            Raiser("exit").named("raiser").at("w1").forward(1, broker=broker)
    assert alone == [] and len(walks) == 11


def test_works_queued_back_to_back_are_each_answered_in_order_and_a_bye_between_is_honoured(spawned, raws):
    """Attack on the loop's return to its poll after each lone run: forty Works by digest
    sent back to back (no wait between), a Bye after the twentieth, then twenty more. Each of
    the first twenty is answered once, in order, with its own value; a Bye ends the session,
    so each after it is refused as from a stranger (naming its ref, in order). Then a Hello
    brings the peer back."""
    recipe = Recipe((spec_of(Add(1), "inc"),), ("step", 0))
    digest = recipe_digest(recipe).digest
    raw = raws(spawned.endpoint)
    raw.send_frames(full(1, recipe, 0))
    assert final(raw, 1).output == 1
    for ref in range(2, 22):
        raw.send_frames(by_digest(ref, digest, ref * 10))
    raw.send(Bye())
    for ref in range(22, 42):
        raw.send_frames(by_digest(ref, digest, ref * 10))
    got = [raw.answer(WAIT) for _ in range(40)]
    assert [(type(m), m.ref) for m in got[:20]] == [(Done, ref) for ref in range(2, 22)], got[:20]
    assert [m.output for m in got[:20]] == [ref * 10 + 1 for ref in range(2, 22)]
    assert all(isinstance(m, Refusal) and m.hello for m in got[20:]), got[20:]
    assert [m.ref for m in got[20:]] == list(range(22, 42))
    assert raw.answer(0.2) is None  # nothing more: no work answered twice
    assert isinstance(raw.ask(Hello(Runtime.here(mode="project"))), Ready)
    raw.send_frames(full(50, recipe, 5))
    assert final(raw, 50).output == 6


def test_a_stop_between_queued_works_is_honoured_and_what_was_answered_is_a_prefix(serving, raws):
    """Attack: twenty slow Works queued back to back on a loop that runs each alone; the loop
    is stopped once the first answer is out. It has to stop within a bound (not run the
    queue out), and the answers it gave are the first ones, in order, each once."""
    loop, endpoint, thread = serving()
    # shorter than the stand-in's wait (`STAND_IN_AFTER`): each runs where it arrived
    recipe = Recipe((spec_of(Sleep(0.004), "nap"),), ("step", 0))
    digest = recipe_digest(recipe).digest
    raw = raws(endpoint)
    raw.send_frames(full(1, recipe, 1))
    assert final(raw, 1).output == 1
    n = 400
    for ref in range(2, 2 + n):
        raw.send_frames(by_digest(ref, digest, ref))
    first = raw.answer(WAIT)
    assert isinstance(first, (Done, Refusal)) and first.ref == 2, first
    stopped = time.monotonic()
    loop.stopping.set()
    thread.join(WAIT)
    assert not thread.is_alive()
    assert time.monotonic() - stopped < 1.0, "the stop waited for the queue (1.6 s of it)"
    got = [first]
    while (msg := raw.answer(0.2)) is not None:
        got.append(msg)
    # a piece that ran long (a busy machine) has its neighbours refused as busy: still one
    # answer each, in the order sent
    assert all(isinstance(m, Done) or (isinstance(m, Refusal) and m.why.startswith("busy:")) for m in got), got
    refs = [m.ref for m in got]
    assert refs == list(range(2, 2 + len(refs))), refs
    assert all(m.output == m.ref for m in got if isinstance(m, Done))
    assert len(refs) < n, "the stop was not honoured: the whole queue ran"


# -- what a graph keeps of a forward (its trip, the listing its hosts were checked on), attacked -


def test_one_graph_with_two_brokers_in_turn_is_refused_by_the_one_that_does_not_know_its_host(spawned):
    """Attack on ``plan.check``'s skip (a graph's hosts checked once per listing, remembered
    on the graph) and on the kept trip: one graph forwarded through a broker that knows its
    host and one that does not, in turn, the second's listing made anew in between, then
    both at once from threads. The one that does not know it refuses every time
    (UnknownHost); the other serves every time."""
    knows = Broker.embedded({"w1": Worker.at(spawned.endpoint, mode="project")}, patience=PATIENCE)
    blind = Broker.embedded({"w2": Worker.at(spawned.endpoint, mode="project")}, patience=PATIENCE)
    one = Add(1).named("inc").at("w1")
    two = Add(1).named("a").at("w2") >> Add(1).named("b").at("w1")
    try:
        for round_ in range(4):
            assert one.forward(round_, broker=knows) == round_ + 1
            with pytest.raises(UnknownHost, match="`w1`"):
                one.forward(round_, broker=blind)
            with pytest.raises(UnknownHost, match="`w1`"):
                two.forward(round_, broker=blind)
            with pytest.raises(UnknownHost, match="`w2`"):
                two.forward(round_, broker=knows)
            if round_ == 1:
                blind._rendezvous.hosts(refresh=True)
                knows._rendezvous.hosts(refresh=True)
        assert one.forward(10, broker=knows, watching=lambda fact: None) == 11  # the walk agrees
        with pytest.raises(UnknownHost):
            one.forward(10, broker=blind, watching=lambda fact: None)
        # both at once, from threads: the token the graph keeps is written by either in turn
        wrong: list = []

        def hammer(broker: Broker, known: bool) -> None:
            for i in range(40):
                try:
                    out = one.forward(i, broker=broker)
                    if not known or out != i + 1:
                        wrong.append((known, i, out))
                except UnknownHost:
                    if known:
                        wrong.append((known, i, "UnknownHost"))
                except BaseException as exc:  # noqa: BLE001 - said on the test's thread
                    wrong.append((known, i, exc))

        threads = [
            threading.Thread(target=hammer, args=(b, k), daemon=True)
            for b, k in ((knows, True), (blind, False), (knows, True), (blind, False))
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(WAIT)
        assert not any(thread.is_alive() for thread in threads)
        assert not wrong, wrong[:5]
    finally:
        knows.close()
        blind.close()


def test_one_graph_with_brokers_that_run_its_host_here_and_elsewhere_goes_where_each_says(spawned):
    """Attack on the trip kept per set of hosts run here (``planned.trip_of``): the same graph
    through a broker that runs its host in this process and one that sends it to a worker,
    in turn. Each forward runs where its own broker says: here, or in the worker's process."""
    here = Broker.embedded({"w1": Worker.inprocess()}, patience=PATIENCE)
    there = Broker.embedded({"w1": Worker.at(spawned.endpoint, mode="project")}, patience=PATIENCE)
    node = Pid().named("pid").at("w1")
    try:
        for _ in range(3):
            assert node.forward(0, broker=here) == os.getpid()
            assert node.forward(0, broker=there) == spawned.pid
        assert node.forward(0, broker=here, watching=lambda fact: None) == os.getpid()
    finally:
        here.close()
        there.close()


@pytest.mark.parametrize("copied", ["pickled", "deep copy", "shallow copy"])
def test_a_copy_of_a_graph_checked_on_one_broker_is_checked_again_on_another(spawned, copied):
    """Attack: what a graph keeps of a forward (its trip, the listing its hosts were checked
    on) must not travel with a copy of it: a copy forwarded through a broker that does not
    know its host is refused, and one through the broker that does is served."""
    knows = Broker.embedded({"w1": Worker.at(spawned.endpoint, mode="project")}, patience=PATIENCE)
    blind = Broker.embedded({"w2": Worker.at(spawned.endpoint, mode="project")}, patience=PATIENCE)
    node = Add(1).named("inc").at("w1")
    try:
        assert node.forward(1, broker=knows) == 2
        assert "_somatize_listed" in node.__dict__ and "_somatize_trips" in node.__dict__
        twin = {
            "pickled": lambda g: pickle.loads(pickle.dumps(g)),
            "deep copy": copy.deepcopy,
            "shallow copy": copy.copy,
        }[copied](node)
        assert not any(k.startswith("_somatize_") for k in twin.__dict__), sorted(twin.__dict__)
        with pytest.raises(UnknownHost):
            twin.forward(1, broker=blind)
        assert twin.forward(2, broker=knows) == 3
    finally:
        knows.close()
        blind.close()


def test_a_graph_with_a_cached_step_never_takes_the_kept_trip_and_each_store_is_its_own(spawned, tmp_path):
    """Attack on the trip kept on the graph: a graph whose step is cached (forwarded with a
    store) must take the walk every time, never a trip worked out for it, so each store keeps
    and recalls for itself: a second, empty store runs the node again; the first recalls it.
    Beside it, the same node uncached goes as one trip, its trip kept, store or not."""
    calls = tmp_path / "calls"
    first, second = FolderStore(tmp_path / "first"), FolderStore(tmp_path / "second")
    node = Count(str(calls)).named("count").at("w1").cached().frozen()
    plain = Count(str(tmp_path / "plain")).named("count").at("w1")
    with Broker.embedded({"w1": Worker.at(spawned.endpoint, mode="project")}, patience=PATIENCE) as broker:
        assert list(node.forward(1, broker=broker, store=first)) == [1, 2, 3]  # ran, and kept
        assert calls.read_text() == "x\n"
        facts: list = []
        assert list(node.forward(1, broker=broker, store=first, watching=facts.append)) == [1, 2, 3]
        assert [f["fact"] for f in facts] == ["recalled", "finished"]
        assert list(node.forward(1, broker=broker, store=first)) == [1, 2, 3]  # recalled again
        assert calls.read_text() == "x\n"
        assert list(node.forward(1, broker=broker, store=second)) == [1, 2, 3]  # another store: runs
        assert calls.read_text() == "x\nx\n"
        assert not node.__dict__.get("_somatize_trips")
        for store in (None, first, None):
            assert list(plain.forward(2, broker=broker, store=store)) == [2, 3, 4]
        assert (tmp_path / "plain").read_text() == "x\nx\nx\n"
        assert plain.__dict__["_somatize_trips"]
