"""One host name served by many workers (a pool), and many inputs through a graph:
``Graph.map`` and ``Graph.submit`` over real spawned and dialed workers."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time
from pathlib import Path

import mapping_nodes
import pytest
from conftest import BROKER, WORKER, env_with_tests

from somatize import Broken, Broker, FolderStore, NodeFailed, Worker
from somatize.broker import read_hosts
from somatize.fabric.hosts import Pool, expand, pool_of
from somatize.record import Recorder, fleet, forwards


def pool(processes: int = 3, **options) -> Pool:
    return Worker.spawn(WORKER, mode="network", send=[mapping_nodes], mount=False, processes=processes, **options)


def runs(log: Path) -> list[tuple[int, int]]:
    """Each run a node noted: (input, pid)."""
    if not log.exists():
        return []
    return [(int(x), int(pid)) for x, pid in (line.split() for line in log.read_text().splitlines())]


def wait_for(fact, seconds: float = 30.0) -> None:
    until = time.monotonic() + seconds
    while not fact():
        if time.monotonic() > until:
            raise AssertionError("waited 30 s for a fact that never came")
        time.sleep(0.01)


# -- declaring a pool ---------------------------------------------------------------------


def test_a_pool_is_its_members_as_hosts_of_their_own():
    declared = pool(4)
    assert isinstance(declared, Pool) and len(declared) == 4
    hosts = expand({"cpu": declared, "w1": Worker.inprocess()})
    assert sorted(hosts) == ["cpu#0", "cpu#1", "cpu#2", "cpu#3", "w1"]
    assert pool_of("cpu#3") == ("cpu", 3) and pool_of("cpu") is None and pool_of("cpu#03") is None
    assert pool_of("#3") is None and pool_of("cpu#") is None and pool_of("a#b#7") == ("a#b", 7)
    at = Worker.at(["127.0.0.1:7001", "127.0.0.1:7002"])
    assert [w.address for w in at.members] == ["127.0.0.1:7001", "127.0.0.1:7002"]
    for bad in (0, -1, True, 1.5, "4", 10_001):
        with pytest.raises(TypeError, match="processes="):
            pool(bad)
    with pytest.raises(ValueError, match="declared twice"):
        expand({"cpu": pool(2), "cpu#1": Worker.inprocess()})
    with pytest.raises(ValueError, match="cannot look like a member"):
        expand({"cpu#1": pool(2)})


def test_a_host_table_declares_a_pool_with_processes(tmp_path):
    table = tmp_path / "hosts.toml"
    table.write_text(f"[hosts.cpu]\nspawn = {WORKER!r}\nprocesses = 3\n".replace("'", '"'))
    assert sorted(read_hosts(table)) == ["cpu#0", "cpu#1", "cpu#2"]
    table.write_text('[hosts.cpu]\naddress = ["127.0.0.1:7001", "127.0.0.1:7002"]\n')
    assert sorted(read_hosts(table)) == ["cpu#0", "cpu#1"]
    table.write_text('[hosts.cpu]\naddress = "127.0.0.1:7001"\nprocesses = 2\n')
    with pytest.raises(ValueError, match="give `address` a list"):
        read_hosts(table)
    table.write_text(f"[hosts.cpu]\nspawn = {WORKER!r}\nprocesses = 0\n".replace("'", '"'))
    with pytest.raises(ValueError, match=r"\[hosts.cpu\].*processes="):
        read_hosts(table)


# -- map ------------------------------------------------------------------------------------


def test_map_spreads_a_pool_and_answers_in_input_order(tmp_path):
    log = tmp_path / "runs"
    graph = mapping_nodes.Who(0.05, str(log)).named("who").at("cpu")
    store = FolderStore(tmp_path / "store")
    rec = Recorder(store, run="mapped")
    with Broker.embedded({"cpu": pool(3)}) as broker:
        assert broker.members("cpu") == ("cpu#0", "cpu#1", "cpu#2") and broker.knows("cpu")
        out = list(graph.map(range(30), broker=broker, watching=rec))
    assert [x for x, _ in out] == list(range(30))
    ran = runs(log)
    assert sorted(x for x, _ in ran) == list(range(30))  # each input once
    assert len({pid for _, pid in ran}) == 3  # every member worked
    # the record: one forward per input, each fact with its input's index; fleet per member
    assert len(forwards(store, run="mapped")) == 30
    assert set(fleet(store, run="mapped")) == {"cpu#0", "cpu#1", "cpu#2"}
    assert sum(row["slices"] for row in fleet(store, run="mapped").values()) == 30


def test_map_takes_inputs_lazily_and_closing_it_hands_out_no_more(tmp_path):
    pulled = []

    def inputs():
        for i in range(10_000):
            pulled.append(i)
            yield i

    graph = mapping_nodes.Who().named("who").at("cpu")
    with Broker.embedded({"cpu": pool(2)}) as broker:
        mapping = graph.map(inputs(), broker=broker)
        first = [next(mapping) for _ in range(5)]
        assert [x for x, _ in first] == [0, 1, 2, 3, 4]
        assert len(pulled) <= 5 + 2 * 2  # as many as it yielded, and two per member: one running, one next
        mapping.close()
        held = len(pulled)
        with pytest.raises(StopIteration):
            next(mapping)
        assert len(pulled) == held
        # as they finish: (index, output), every input once
        done = dict(graph.map(range(12), broker=broker, ordered=False))
        assert sorted(done) == list(range(12)) and all(done[i][0] == i for i in done)


def test_a_nodes_exception_comes_in_its_turn_and_is_not_run_again(tmp_path):
    graph = mapping_nodes.FailsOn((3,)).named("picky").at("cpu")
    with Broker.embedded({"cpu": pool(2)}) as broker:
        got = []
        with pytest.raises(NodeFailed, match="no good: 3"):
            for value in graph.map(range(8), broker=broker):
                got.append(value)
        assert got == [0, 10, 20]
        facts = []
        returned = list(graph.map(range(8), broker=broker, errors="return", watching=facts.append))
    assert [v for v in returned if not isinstance(v, NodeFailed)] == [0, 10, 20, 40, 50, 60, 70]
    assert isinstance(returned[3], NodeFailed)
    failed = [f for f in facts if f["fact"] == "failed"]
    assert [f["item"] for f in failed] == ["3"]  # once: a node's own answer is never retried
    with pytest.raises(ValueError, match="errors="):
        graph.map([1], errors="ignore")
    with pytest.raises(TypeError, match="retries="):
        graph.map([1], retries=-1)


def test_a_member_killed_mid_map_loses_no_input(tmp_path):
    log = tmp_path / "runs"
    graph = mapping_nodes.Who(0.02, str(log)).named("who").at("cpu")
    with Broker.embedded({"cpu": pool(3)}, patience=1.0) as broker:
        answers = []
        killed = None
        for x, pid in graph.map(range(150), broker=broker):
            answers.append(x)
            if len(answers) == 30:
                killed = pid
                os.kill(pid, signal.SIGKILL)
        assert answers == list(range(150))
    ran = runs(log)
    counted = {x: sum(1 for y, _ in ran if y == x) for x in range(150)}
    assert set(counted.values()) <= {1, 2}  # a lost input ran again once, at most
    assert all(counted[x] >= 1 for x in range(150))
    assert killed in {pid for _, pid in ran}


def test_retries_0_says_which_input_was_lost(tmp_path):
    started, until = tmp_path / "started", tmp_path / "until"
    graph = mapping_nodes.Hold(str(started), str(until)).named("hold").at("cpu")
    with Broker.embedded({"cpu": pool(1)}, patience=1.0) as broker:
        mapping = graph.map([7], broker=broker, retries=0, errors="return")
        wait_for(started.exists)
        os.kill(int(started.read_text()), signal.SIGKILL)
        [lost] = list(mapping)
        assert isinstance(lost, Broken) and "hold" in str(lost)
        until.touch()
        assert graph.map([8], broker=broker).__next__() == 8  # the member is started again


def test_submit_is_a_future_of_a_forward():
    graph = mapping_nodes.FailsOn((2,)).named("picky").at("cpu")
    with Broker.embedded({"cpu": pool(2)}) as broker:
        futures = [graph.submit(x, broker=broker) for x in range(4)]
        assert isinstance(futures[0], concurrent.futures.Future)
        assert [f.result(timeout=60) for f in (futures[0], futures[1], futures[3])] == [0, 10, 30]
        with pytest.raises(NodeFailed):
            futures[2].result(timeout=60)


# -- a pool over a standalone broker: dialed members, and another client's work ----------------


def test_dialed_workers_offering_members_are_one_pool_and_busy_members_are_passed(tmp_path, processes):
    hub = processes([*BROKER, "--listen", "tcp://127.0.0.1:0", "--announce"], env=env_with_tests())
    for k in range(2):
        processes(
            [*WORKER, "--broker", hub.endpoint, "--offer", f"cpu#{k}", "--mode", "network"],
            announce=None,
            env=env_with_tests(),
        )
    started, until = tmp_path / "started", tmp_path / "until"
    log = tmp_path / "runs"
    with (
        Broker.at(hub.endpoint, send={"cpu": [mapping_nodes]}) as other,
        Broker.at(hub.endpoint, send={"cpu": [mapping_nodes]}) as mine,
    ):
        wait_for(lambda: mine.members("cpu", refresh=True) == ("cpu#0", "cpu#1"))
        # another client holds cpu#0 with work of its own
        held = mapping_nodes.Hold(str(started), str(until)).named("hold").at("cpu#0").submit(1, broker=other)
        wait_for(started.exists)
        busy_pid = int(started.read_text())
        try:
            graph = mapping_nodes.Who(0.0, str(log)).named("who").at("cpu")
            out = list(graph.map(range(10), broker=mine, in_flight=2))
        finally:
            until.touch()
        assert held.result(timeout=60) == 1
    assert [x for x, _ in out] == list(range(10))
    assert busy_pid not in {pid for _, pid in runs(log)}  # all went to the free member
    assert len(runs(log)) == 10


def test_a_dialed_member_stopped_mid_map_loses_no_input(tmp_path, processes):
    """A member's worker told to stop (SIGTERM, as systemd or SLURM stop one) while the map
    runs: the broker lets its name go, and what it held runs again on the other member."""
    hub = processes([*BROKER, "--listen", "tcp://127.0.0.1:0", "--announce"], env=env_with_tests())
    members = [
        processes(
            [*WORKER, "--broker", hub.endpoint, "--offer", f"cpu#{k}", "--mode", "network"],
            announce=None,
            env=env_with_tests(),
        )
        for k in range(2)
    ]
    log = tmp_path / "runs"
    graph = mapping_nodes.Who(0.02, str(log)).named("who").at("cpu")
    with Broker.at(hub.endpoint, send={"cpu": [mapping_nodes]}, patience=1.0) as broker:
        wait_for(lambda: broker.members("cpu", refresh=True) == ("cpu#0", "cpu#1"))
        answers, stopped = [], None
        for x, pid in graph.map(range(80), broker=broker, in_flight=2, deadline=30):
            answers.append((x, pid))
            if len(answers) == 20:
                stopped = pid
                os.kill(pid, signal.SIGTERM)
        assert [x for x, _ in answers] == list(range(80))
    assert stopped in {m.pid for m in members}
    wait_for(lambda: not next(m for m in members if m.pid == stopped).alive)
    late = [pid for _, pid in answers[25:]]
    assert late and stopped not in late[-10:]  # the last inputs all ran on the member left
    counted = {x: sum(1 for y, _ in runs(log) if y == x) for x in range(80)}
    assert set(counted.values()) <= {1, 2} and all(counted[x] >= 1 for x in range(80))


def test_an_input_that_cannot_be_written_down_is_refused_naming_its_index():
    from somatize import Unwritable

    class Opaque:
        """No codec knows it: it cannot leave this process."""

    graph = mapping_nodes.FailsOn(()).named("picky").at("cpu")
    with Broker.embedded({"cpu": pool(2)}) as broker:
        out = list(graph.map([1, Opaque(), 3], broker=broker, errors="return"))
        assert out[0] == 10 and out[2] == 30
        assert isinstance(out[1], Unwritable) and str(out[1]).startswith("input 1 of the map: ")
        assert "`Opaque`" in str(out[1]) and "codec(" in str(out[1])
        with pytest.raises(Unwritable, match="input 2 of the map"):
            list(graph.map([1, 2, Opaque()], broker=broker))


def test_progress_counts_what_is_done_and_what_failed():
    import io

    from tqdm import tqdm

    graph = mapping_nodes.FailsOn((1, 4)).named("picky").at("cpu")
    shown = io.StringIO()
    bar = tqdm(file=shown, mininterval=0)
    with Broker.embedded({"cpu": pool(2)}) as broker:
        out = list(graph.map(range(6), broker=broker, errors="return", progress=bar))
    assert [isinstance(v, NodeFailed) for v in out] == [False, True, False, False, True, False]
    assert bar.n == 6 and "failed=2" in shown.getvalue() and "running=0" in shown.getvalue()  # the last: none left
    with pytest.raises(TypeError, match="progress="):
        graph.map([1], progress="yes")


def test_store_and_a_deadline_per_input_work_as_in_forward(tmp_path):
    from somatize import Overdue

    log = tmp_path / "runs"
    store = FolderStore(tmp_path / "store")
    cached = mapping_nodes.Who(0.0, str(log)).named("who").at("cpu").cached().frozen()
    with Broker.embedded({"cpu": pool(2)}) as broker:
        first = list(cached.map(range(6), broker=broker, store=store))
        again = list(cached.map(range(6), broker=broker, store=store))
        assert again == first and len(runs(log)) == 6  # the second map recalls each input
        started, until = tmp_path / "started", tmp_path / "until"
        held = mapping_nodes.Hold(str(started), str(until)).named("hold").at("cpu")
        try:
            [late] = list(held.map([1], broker=broker, deadline=0.5, errors="return"))
        finally:
            until.touch()
        assert isinstance(late, Overdue)  # a deadline is the input's own: never run again


def test_a_pool_of_ten_thousand_members_is_listed_without_starting_them():
    declared = pool(10_000)
    with Broker.embedded({"cpu": declared}) as broker:
        members = broker.members("cpu")
        assert len(members) == 10_000 and members[:2] == ("cpu#0", "cpu#1") and members[-1] == "cpu#9999"
        assert broker.knows("cpu") and not broker.knows("cpu#10000")
