"""The graph and the plan: declarations, composition, up-front checks, grouping by host."""

from __future__ import annotations

import dataclasses

import pytest

from somatize import (
    DuplicateName,
    Nameless,
    Node,
    NoStore,
    NotAWatcher,
    Parallel,
    Sequence,
    Step,
    UnknownHost,
    Unsettled,
)
from somatize.plan import Join, Remote, Run, make


class Add(Node):
    def __init__(self, n: int = 1) -> None:
        self.n = n

    def forward(self, x):
        return x + self.n


class Double(Node):
    def forward(self, x):
        return x * 2


class Spy(Node):
    """Records that it ran, so a test can prove it never did."""

    def __init__(self, log: list) -> None:
        self.log = log

    def forward(self, x):
        self.log.append(x)
        return x


class FakeBroker:
    """Only what the plan asks of a broker: which hosts it knows. Nothing is sent."""

    def __init__(self, *hosts: str) -> None:
        self._hosts = set(hosts)

    def knows(self, host: str) -> bool:
        return host in self._hosts

    def hosts(self):
        return sorted(self._hosts)


# -- declarations ------------------------------------------------------------------------


@pytest.mark.pure
def test_suffixes_return_declarations_holding_the_same_node():
    node = Add(3)
    step = node.named("add").at("w1").on("cpu").cached().frozen()
    assert isinstance(step, Step)
    assert step.node is node  # never a copy: weights stay where they are
    assert (step.name, step.host, step.device, step.cache, step.freeze) == ("add", "w1", "cpu", True, True)
    assert node.forward(1) == 4  # the node's own forward is untouched


@pytest.mark.pure
def test_a_suffix_leaves_the_declaration_it_came_from_alone():
    plain = Add().named("a")
    cached = plain.cached()
    assert plain.cache is False and cached.cache is True
    with pytest.raises(dataclasses.FrozenInstanceError):
        plain.name = "b"  # declarations are immutable


@pytest.mark.pure
def test_suffix_arguments_must_be_words():
    with pytest.raises(TypeError, match=r"\.named\(\)"):
        Add().named("")
    with pytest.raises(TypeError, match=r"\.at\(\)"):
        Add().at(7)


@pytest.mark.pure
def test_composition_shapes():
    a, b, c = Add(1), Double(), Add(10)
    seq = a >> b >> c
    assert isinstance(seq, Sequence) and len(seq.parts) == 3
    par = a & b & c
    assert isinstance(par, Parallel) and len(par.parts) == 3
    nested = a & (b & c)
    assert len(nested.parts) == 2 and isinstance(nested.parts[1], Parallel)


@pytest.mark.pure
def test_sequence_and_parallel_compute():
    assert (Add(1) >> Double()).forward(3) == 8
    assert (Add(1) & Double()).forward(3) == (4, 6)
    assert (Add(1) & Double() & Add(10)).forward(3) == (4, 6, 13)
    assert (Add(1) & (Double() & Add(10))).forward(3) == (4, (6, 13))
    assert (Add(1) >> (Add(1) & Double()) >> Sum()).forward(1) == 3 + 4


class Sum(Node):
    def forward(self, pair):
        return sum(pair)


@pytest.mark.pure
def test_a_lone_declared_node_runs_as_a_one_node_graph():
    assert Double().named("d").forward(21) == 42
    assert Step(Double()).forward(4) == 8


@pytest.mark.pure
def test_composites_take_placement_for_all_their_steps():
    g = (Add().named("a") >> Double().named("b")).at("w1").frozen()
    assert [s.host for s in g.steps] == ["w1", "w1"]
    assert all(s.freeze for s in g.steps)


@pytest.mark.pure
def test_only_nodes_and_graphs_compose():
    with pytest.raises(TypeError, match="Node"):
        Add() >> (lambda x: x)


# -- checks, before anything runs ---------------------------------------------------------


@pytest.mark.pure
def test_unsettled_is_raised_before_any_node_runs(tmp_path):
    from somatize import FolderStore

    log: list = []
    g = Spy(log).named("spy").frozen() >> Add().named("add") >> Double().named("d").cached().frozen()
    with pytest.raises(Unsettled, match=r"`add` upstream of it is not frozen.*\.frozen\(\)"):
        g.forward(1, store=FolderStore(tmp_path))
    assert log == []


@pytest.mark.pure
def test_unsettled_names_the_cached_node_itself():
    with pytest.raises(Unsettled, match="`d` is cached, but it is not frozen"):
        Double().named("d").cached().forward(1, store=None)


@pytest.mark.pure
def test_nameless_is_raised_before_any_node_runs(tmp_path):
    from somatize import FolderStore

    log: list = []
    g = Spy(log).frozen() >> Double().named("d").cached().frozen()
    with pytest.raises(Nameless, match=r"upstream of it has no name.*\.named"):
        g.forward(1, store=FolderStore(tmp_path))
    assert log == []
    with pytest.raises(Nameless, match="it has no name"):
        Double().cached().frozen().forward(1, store=FolderStore(tmp_path))


@pytest.mark.pure
def test_cached_without_a_store_is_refused_before_running():
    log: list = []
    g = Spy(log).named("s").frozen() >> Double().named("d").cached().frozen()
    with pytest.raises(NoStore, match="`d` is cached.*store="):
        g.forward(1)
    assert log == []


@pytest.mark.pure
def test_a_host_with_no_broker_is_named():
    log: list = []
    g = Spy(log).named("s") >> Double().named("d").at("gpu-box")
    with pytest.raises(UnknownHost, match=r"`gpu-box`.*no broker"):
        g.forward(1)
    assert log == []


@pytest.mark.pure
def test_a_host_the_broker_does_not_know_is_named():
    g = Double().named("d").at("w9")
    with pytest.raises(UnknownHost, match=r"does not know `w9` \(it knows: `w1`, `w2`\)"):
        g.forward(1, broker=FakeBroker("w1", "w2"))


@pytest.mark.pure
def test_a_watcher_that_cannot_be_called_is_refused_before_running():
    log: list = []
    g = Spy(log).named("s")
    with pytest.raises(NotAWatcher, match="entry 1"):
        g.forward(1, watching=[print, "print"])
    with pytest.raises(NotAWatcher):
        g.forward(1, watching=42)
    with pytest.raises(TypeError):  # NotAWatcher is a TypeError too
        g.forward(1, watching="print")
    assert log == []


@pytest.mark.pure
def test_two_different_nodes_with_one_name_are_refused():
    with pytest.raises(DuplicateName, match="`x`"):
        (Add().named("x") >> Double().named("x")).forward(1)
    same = Double().named("x")
    assert (same >> same).forward(1) == 4  # one node used twice is fine


# -- grouping -----------------------------------------------------------------------------


@pytest.mark.pure
def test_five_consecutive_nodes_on_one_host_are_one_remote_group():
    g = (
        Add().named("in")
        >> (
            Add().named("a").at("w1")
            >> Add().named("b").at("w1")
            >> Add().named("c").at("w1")
            >> Add().named("d").at("w1")
            >> Add().named("e").at("w1")
        )
        >> Double().named("out")
    )
    plan = make(g)
    assert [type(op) for op in plan.ops] == [Run, Remote, Run]
    (remote,) = plan.remotes
    assert remote.host == "w1"
    assert [plan.steps[i].name for i in remote.step_indices] == ["a", "b", "c", "d", "e"]


@pytest.mark.pure
def test_a_parallel_wholly_on_one_host_joins_the_group():
    g = Add().named("a").at("w1") >> (Add().named("b").at("w1") & Double().named("c").at("w1"))
    (remote,) = make(g).remotes
    assert len(remote.step_indices) == 3
    assert make(g).ops == (remote,)


@pytest.mark.pure
def test_a_change_of_host_splits_groups():
    g = Add().named("a").at("w1") >> Add().named("b").at("w2") >> Add().named("c").at("w1")
    assert [r.host for r in make(g).remotes] == ["w1", "w2", "w1"]


@pytest.mark.pure
def test_mixed_parallel_branches_group_separately():
    g = Add().named("a") >> (Add().named("b").at("w1") & Double().named("c").at("w2"))
    plan = make(g)
    assert sorted(r.host for r in plan.remotes) == ["w1", "w2"]
    assert isinstance(plan.ops[-1], Join)
