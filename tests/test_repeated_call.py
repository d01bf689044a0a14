"""The repeated call: what does not change between forwards of one graph is worked out once.

- A graph's plan (grouped, compiled, wired) is made once and kept on the graph, per set of
  hosts that run in this process; a forward with a store and cached steps still plans
  afresh (what is recalled changes the plan).
- A host that runs in this process (``Worker.inprocess()``) is no second plan: its steps
  are the walk's own, tagged with the host, and say what a trip to a host says (``ran``
  with ``host``, ``left``, then ``kept``).
- The client packs a group's steps once per packer, and again when the codec registry
  changes (what a network-mode artifact carries).
- A process running pieces (a worker) compiles each shape once; what it keeps is a function
  of the shape alone, so one client's piece never runs on another's nodes.
- A worker with one job keeps a recipe's steps (each node in its guard) between calls and
  swaps only the job they report to; a recipe built with other nodes, or a placement,
  makes its own (``fabric.worker.prepared``).
"""

from __future__ import annotations

import copy
import gc
import pickle
import socket
import threading
import time
import weakref

import fabric_nodes
import pytest
from conftest import WORKER
from fabric_nodes import Add, Boom, Count, Sleep

from somatize import Broker, FolderStore, Node, NodeFailed, Overdue, UnknownHost, Worker, codec
from somatize.codec import forget
from somatize.engine import Piece, _plan_of, lone_step, run_lone, run_piece
from somatize.fabric.pieces import piece_of
from somatize.fabric.worker.loop import WorkerLoop
from somatize.fabric.worker.prepared import Prepared
from somatize.fabric.worker.slots import Abandoned, Job
from somatize.graph import Step, as_graph
from somatize.packing import Catalog, Packer
from somatize.plan import Join, Remote, Run, make
from somatize.wire import Recipe, Work
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
