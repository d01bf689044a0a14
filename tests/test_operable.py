"""Operable on a real cluster (issue 14): logs that say what happened, errors that point the
right way, allow-lists that fail closed and loudly, stale code that says so.

Each test is a stumble a newcomer met, played with real broker and worker processes, real
CURVE keys and real signals; it fails on the code before the fix.
"""

from __future__ import annotations

import importlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import zmq
from conftest import BROKER, WORKER, env_with_tests
from fabric_nodes import Add, Count, Sleep
from reliability_support import key_ring, wait_until

from brokers import keyed_broker
from somatize import Broken, Broker, NodeFailed, Refused, Unreachable, Worker
from somatize.errors import KeysRefused
from somatize.fabric.curve import Keys, read_public

PATIENCE = 2.0


# -- helpers ------------------------------------------------------------------------------


def logged(process, text: str, seconds: float = 10.0) -> str:
    """Wait until ``process``'s stderr holds ``text``; return the stderr."""
    wait_until(
        lambda: text in process.stderr(),
        seconds,
        f"{text!r} in the log of {process.argv[2:4]}:\n{process.stderr()[-2000:]}",
    )
    return process.stderr()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def short(path: Path) -> str:
    return read_public(path).decode()[:8]


def run(argv: list[str], **options) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=30, env=env_with_tests(), **options)


def one_sentence(done: subprocess.CompletedProcess) -> None:
    """Exit code 2 and what went wrong on stderr, never a traceback."""
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip(), "nothing said on stderr"


@pytest.fixture
def ring(tmp_path):
    """A broker's pair; clients alice and bob (allowed), a stranger; worker w1 (allowed to offer)."""
    return key_ring(tmp_path, clients=("alice", "bob"), workers=("w1",), others=("stranger",))


def client(ring, endpoint: str, who: str = "alice", server: str = "broker") -> Broker:
    return Broker.at(endpoint, keys=Keys.client(ring[who + "_secret"], server=ring[server]), patience=PATIENCE)


# -- logs an operator reads ---------------------------------------------------------------


def test_the_broker_logs_start_dial_in_refusal_reload_leaving_and_stop(ring, processes):
    broker = keyed_broker(processes, ring, patience=PATIENCE)
    said = logged(broker, "listening on")
    assert (
        f"somatize broker: listening on {broker.endpoint} with CURVE keys: 2 client keys from {ring['allow']}" in said
    )
    assert f"1 worker key from {ring['workers']}" in said

    worker = processes(
        [
            *WORKER,
            "--broker",
            broker.endpoint,
            "--offer",
            "w1",
            "--key",
            str(ring["w1_secret"]),
            "--broker-key",
            str(ring["broker"]),
            "--patience",
            str(PATIENCE),
        ],
        env=env_with_tests(),
        announce=None,
    )
    logged(broker, f"host `w1` dialed in (key {short(ring['w1'])}, project mode)")
    logged(worker, "took this worker's offer of `w1`")

    with client(ring, broker.endpoint, "stranger") as b, pytest.raises(KeysRefused):
        b.hosts()
    logged(broker, f"refused key {short(ring['stranger'])}…")

    broker.signal(signal.SIGHUP)
    logged(broker, "reloaded the allow-list: 2 client keys")

    worker.signal(signal.SIGTERM)
    logged(worker, "stopping: told to by SIGTERM")
    logged(broker, f"host `w1` left (key {short(ring['w1'])}): it said Bye")
    assert worker.popen.wait(10) == 0

    broker.signal(signal.SIGTERM)
    logged(broker, "somatize broker: stopping: told to by SIGTERM")
    assert "\x00" not in broker.stderr()


def test_a_dialed_worker_logs_losing_its_broker_and_reaching_it_again(processes):
    url = f"tcp://127.0.0.1:{free_port()}"
    first = processes([*BROKER, "--listen", url, "--announce"], env=env_with_tests())
    worker = processes(
        [*WORKER, "--broker", url, "--offer", "w1", "--patience", str(PATIENCE)], env=env_with_tests(), announce=None
    )
    logged(first, "host `w1` dialed in (connection ")  # a keyless offer is named by its connection
    first.signal(signal.SIGKILL)
    logged(worker, f"lost the broker at {url}; dialing again")
    second = processes([*BROKER, "--listen", url, "--announce"], env=env_with_tests())
    logged(worker, f"reached the broker at {url} again; offering `w1`")
    logged(second, "host `w1` dialed in")


def test_a_worker_whose_key_the_broker_refuses_says_so_and_so_does_the_broker(ring, processes):
    broker = keyed_broker(processes, ring, patience=PATIENCE)
    worker = processes(
        [
            *WORKER,
            "--broker",
            broker.endpoint,
            "--offer",
            "w9",
            "--key",
            str(ring["stranger_secret"]),
            "--broker-key",
            str(ring["broker"]),
            "--patience",
            str(PATIENCE),
        ],
        env=env_with_tests(),
        announce=None,
    )
    logged(worker, f"the broker at {broker.endpoint} refused this worker's CURVE handshake")
    assert "--allow-workers" in worker.stderr()
    logged(broker, f"refused key {short(ring['stranger'])}…")
    assert worker.alive  # it keeps dialing: the operator may add its key and reload


def test_log_level_warning_keeps_only_trouble(processes):
    broker = processes(
        [*BROKER, "--listen", "tcp://127.0.0.1:0", "--announce", "--log-level", "warning"], env=env_with_tests()
    )
    broker.signal(signal.SIGTERM)
    assert broker.popen.wait(10) == 0
    said = broker.stderr()
    assert "listening on" not in said and "stopping" not in said, said


@pytest.mark.parametrize("server", ["broker", "worker"])
def test_a_refusal_names_the_connection_as_text_never_its_raw_route(processes, server):
    argv = [*BROKER, "--listen", "tcp://127.0.0.1:0"] if server == "broker" else [*WORKER, "--listen", "127.0.0.1:0"]
    process = processes([*argv, "--announce", "--log-level", "info"], env=env_with_tests())
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.linger = 0
    try:
        raw.connect(process.endpoint)
        raw.send_multipart([b"\x00\x01 not a header", b"\x00"])
        assert raw.poll(5000), f"the {server} did not answer the junk"
    finally:
        raw.close()
    said = logged(process, "refused connection ")
    line = next(line for line in said.splitlines() if "refused connection" in line)
    route = line.split("refused connection ", 1)[1].split(":", 1)[0]
    assert all(c in "0123456789abcdef" for c in route), line  # the route in hex, NUL and all
    assert "\x00" not in said


# -- errors that point the right way ------------------------------------------------------


def test_a_refused_key_a_missing_key_and_a_wrong_broker_key_each_say_which(ring, processes):
    broker = keyed_broker(processes, ring, patience=PATIENCE)
    with client(ring, broker.endpoint, "stranger") as b, pytest.raises(KeysRefused) as info:
        b.hosts()
    assert "not in its allow folder" in str(info.value) and short(ring["stranger"]) in str(info.value)
    with Broker.at(broker.endpoint, patience=PATIENCE) as b, pytest.raises(KeysRefused) as info:
        b.hosts()
    assert "This client has no keys" in str(info.value)
    with client(ring, broker.endpoint, "alice", server="bob") as b, pytest.raises(KeysRefused) as info:
        b.hosts()
    assert "is not its own" in str(info.value) and "broker.key" in str(info.value)
    with client(ring, broker.endpoint) as b:  # and the right keys still get in
        assert b.hosts() == []


def test_nobody_there_and_a_broker_that_went_away_are_told_apart(processes):
    with Broker.at(f"tcp://127.0.0.1:{free_port()}", patience=0.5) as b, pytest.raises(Unreachable) as info:
        b.hosts()
    assert "nobody answered" in str(info.value) and "is a broker running there" in str(info.value)
    broker = processes([*BROKER, "--listen", "tcp://127.0.0.1:0", "--announce"], env=env_with_tests())
    with Broker.at(broker.endpoint, patience=0.5) as b:
        assert not b.knows("w1")
        broker.signal(signal.SIGKILL)
        broker.stop()
        with pytest.raises(Unreachable) as info:
            b.knows("w1")
    assert f"the broker at {broker.endpoint} went away" in str(info.value)


def test_a_table_entry_without_the_workers_key_says_so(ring, processes, tmp_path):
    worker = processes(
        [
            *WORKER,
            "--listen",
            "127.0.0.1:0",
            "--announce",
            "--key",
            str(ring["w1_secret"]),
            "--allow",
            str(ring["allow"]),
        ],
        env=env_with_tests(),
    )
    table = tmp_path / "hosts.toml"
    table.write_text(f'[hosts.gpu1]\naddress = "{worker.endpoint}"\n')  # no `key =`
    broker = processes(
        [*BROKER, "--listen", "tcp://127.0.0.1:0", "--announce", "--hosts", str(table)], env=env_with_tests()
    )
    with Broker.at(broker.endpoint, patience=PATIENCE) as b, pytest.raises(KeysRefused) as info:
        Add(1).named("a").at("gpu1").forward(1, broker=b)
    assert "gives no `key =` for `gpu1`" in str(info.value), info.value
    assert "[hosts.gpu1]" in str(info.value)


def test_a_missing_key_file_in_the_table_says_so(tmp_path):
    table = tmp_path / "hosts.toml"
    table.write_text('[hosts.gpu1]\naddress = "10.0.0.4:7000"\nkey = "keys/gpu1.key"\n')
    done = run([*BROKER, "--hosts", str(table)])
    one_sentence(done)
    assert '[hosts.gpu1] key = "keys/gpu1.key", and there is no such file' in done.stderr
    assert str(tmp_path / "keys" / "gpu1.key") in done.stderr


def test_a_broker_that_went_away_mid_work_is_named_even_when_it_is_back_at_once(processes, tmp_path):
    url = f"tcp://127.0.0.1:{free_port()}"
    first = processes([*BROKER, "--listen", url, "--announce", "--patience", str(PATIENCE)], env=env_with_tests())
    processes(
        [*WORKER, "--broker", url, "--offer", "gpu2", "--patience", str(PATIENCE)], env=env_with_tests(), announce=None
    )
    with Broker.at(url, patience=PATIENCE) as b:
        wait_until(lambda: b.knows("gpu2"), 20, "gpu2 dialing in")
    started = tmp_path / "started"
    box: dict = {}

    def forward() -> None:
        with Broker.at(url, patience=PATIENCE) as b:
            try:
                (Count(str(started)).named("count").at("gpu2") >> Sleep(30).named("sleepy").at("gpu2")).forward(
                    0, broker=b
                )
            except Exception as exc:  # noqa: BLE001 - the test reads it
                box["error"] = exc

    thread = threading.Thread(target=forward, daemon=True)
    thread.start()
    wait_until(started.exists, 20, "the work starting on gpu2")
    first.signal(signal.SIGKILL)
    first.stop()
    processes([*BROKER, "--listen", url, "--announce", "--patience", str(PATIENCE)], env=env_with_tests())
    thread.join(30)
    assert not thread.is_alive()
    said = str(box.get("error"))
    assert isinstance(box.get("error"), Broken), box
    assert f"the broker at {url} went away" in said, said
    assert "the worker for `gpu2` went away" not in said and "spawned" not in said, said


def test_a_dialed_worker_that_went_away_is_named_and_not_promised_a_restart(processes, tmp_path):
    broker = processes(
        [*BROKER, "--listen", "tcp://127.0.0.1:0", "--announce", "--patience", str(PATIENCE)], env=env_with_tests()
    )
    worker = processes(
        [*WORKER, "--broker", broker.endpoint, "--offer", "gpu2", "--patience", str(PATIENCE)],
        env=env_with_tests(),
        announce=None,
    )
    started = tmp_path / "started"
    with Broker.at(broker.endpoint, patience=PATIENCE) as b:
        wait_until(lambda: b.knows("gpu2"), 20, "gpu2 dialing in")
        box: dict = {}

        def forward() -> None:
            try:
                (Count(str(started)).named("count").at("gpu2") >> Sleep(30).named("sleepy").at("gpu2")).forward(
                    0, broker=b
                )
            except Exception as exc:  # noqa: BLE001 - the test reads it
                box["error"] = exc

        thread = threading.Thread(target=forward, daemon=True)
        thread.start()
        wait_until(started.exists, 20, "the work starting on gpu2")
        worker.signal(signal.SIGKILL)
        thread.join(30)
        assert not thread.is_alive()
    said = str(box.get("error"))
    assert isinstance(box.get("error"), Broken), box
    assert "the worker serving `gpu2` went away" in said and "restart that worker where it runs" in said, said
    assert "spawned" not in said, said


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_a_standalone_worker_that_went_away_is_not_promised_a_restart(processes, tmp_path, signum):
    """Killed or stopped, noticed by a dropped connection or by a silence: one sentence. It
    used to carry how the client noticed, in words that changed with the timing."""
    worker = processes([*WORKER, "--listen", "127.0.0.1:0", "--announce"], env=env_with_tests())
    started = tmp_path / "started"
    box: dict = {}
    broker = Broker.embedded({"gpu1": Worker.at(worker.endpoint)}, patience=PATIENCE)

    def forward() -> None:
        try:
            (Count(str(started)).named("count").at("gpu1") >> Sleep(30).named("sleepy").at("gpu1")).forward(
                0, broker=broker
            )
        except Exception as exc:  # noqa: BLE001 - the test reads it
            box["error"] = exc

    try:
        thread = threading.Thread(target=forward, daemon=True)
        thread.start()
        wait_until(started.exists, 20, "the work starting on gpu1")
        worker.signal(signum)
        thread.join(30)
        assert not thread.is_alive()
    finally:
        broker.close()
    said = str(box.get("error"))
    assert isinstance(box.get("error"), Broken), box
    assert said == (
        "the worker for `gpu1` went away while running `count`, `sleepy`. Nothing was kept from it; "
        "a worker the broker spawned is started again on the next forward, one that listens on its "
        "own machine must be restarted there (`systemctl status somatize-worker`)."
    ), said
    assert "a spawned worker is started again" not in said, said


def test_every_command_turns_a_bad_argument_or_file_into_one_sentence(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    one_sentence(run([sys.executable, "-m", "somatize", "keys", str(blocker / "keys"), "w1"]))
    one_sentence(run([*BROKER, "--patience", "nan"]))
    one_sentence(run([*WORKER, "--jobs", "0"]))
    one_sentence(run([*WORKER, "--listen", "127.0.0.1:0", "--store", str(blocker / "store")]))
    one_sentence(run([*WORKER, "--listen", "127.0.0.1:0", "--reporting", "-1"]))
    one_sentence(run([sys.executable, "-m", "somatize", "study", "--store", str(blocker), "s"]))


# -- allow-lists that fail closed and loudly ----------------------------------------------


def test_a_malformed_key_refuses_the_start_and_names_the_file(ring):
    (ring["allow"] / "broken.key").write_text("not a certificate\n")
    done = run(
        [*BROKER, "--listen", "tcp://127.0.0.1:0", "--key", str(ring["broker_secret"]), "--allow", str(ring["allow"])]
    )
    one_sentence(done)
    assert "broken.key" in done.stderr and "not a CURVE public key" in done.stderr


def test_a_reload_with_a_malformed_key_keeps_the_old_list_whole_and_says_so(ring, processes):
    broker = keyed_broker(processes, ring, patience=PATIENCE)
    with client(ring, broker.endpoint, "bob") as b:
        assert b.hosts() == []
    (ring["allow"] / "bob.key").unlink()  # bob taken out, and a broken file put in at once
    (ring["allow"] / "broken.key").write_text("not a certificate\n")
    broker.signal(signal.SIGHUP)
    said = logged(broker, "the allow-list was not reloaded, the old one stays")
    assert "broken.key" in said and "2 client keys" in said
    with client(ring, broker.endpoint, "bob") as b:  # the old list, whole: bob still in
        assert b.hosts() == []
    (ring["allow"] / "broken.key").unlink()
    broker.signal(signal.SIGHUP)
    logged(broker, "reloaded the allow-list: 1 client key from")
    with client(ring, broker.endpoint, "bob") as b, pytest.raises(KeysRefused):
        b.hosts()
    with client(ring, broker.endpoint, "alice") as b:
        assert b.hosts() == []


def test_an_empty_allow_list_says_nobody_can_get_in(ring, processes):
    for path in ring["allow"].iterdir():
        path.unlink()
    broker = processes(
        [
            *BROKER,
            "--listen",
            "tcp://127.0.0.1:0",
            "--announce",
            "--key",
            str(ring["broker_secret"]),
            "--allow",
            str(ring["allow"]),
        ],
        env=env_with_tests(),
    )
    logged(broker, "0 client keys")
    assert "nobody can get in" in broker.stderr()


def test_a_worker_reload_says_what_it_took_or_why_not(ring, processes):
    worker = processes(
        [
            *WORKER,
            "--listen",
            "127.0.0.1:0",
            "--announce",
            "--log-level",
            "info",
            "--key",
            str(ring["w1_secret"]),
            "--allow",
            str(ring["allow"]),
        ],
        env=env_with_tests(),
    )
    logged(worker, "with CURVE keys: 2 client keys")
    (ring["allow"] / "broken.key").write_text("not a certificate\n")
    worker.signal(signal.SIGHUP)
    logged(worker, "the allow-list was not reloaded, the old one stays")
    assert "broken.key" in worker.stderr()
    (ring["allow"] / "broken.key").unlink()
    (ring["allow"] / "bob.key").unlink()
    worker.signal(signal.SIGHUP)
    logged(worker, "reloaded the allow-list: 1 client key")


# -- stale code says so -------------------------------------------------------------------

OLD = """
from somatize import Node

class Once(Node):
    def forward(self, x):
        return x + 1
"""
NEW = (
    OLD
    + """

class Twice(Node):
    def forward(self, x):
        return x + 2
"""
)


@pytest.fixture
def project(tmp_path):
    """A package of nodes the worker imports from ``--project``; a test updates it later."""
    name = f"opsstale_{os.getpid()}_{time.monotonic_ns()}"
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / f"{name}.py").write_text(OLD)
    sys.path.insert(0, str(folder))
    try:
        yield name, folder / f"{name}.py"
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop(name, None)


@pytest.mark.parametrize("mode", ["network", "project"])
def test_a_worker_holding_an_older_import_says_so_and_how_to_restart_it(processes, project, mode):
    name, path = project
    worker = processes(
        [*WORKER, "--listen", "127.0.0.1:0", "--announce", "--mode", mode, "--project", str(path.parent)],
        env=env_with_tests(),
    )
    module = importlib.import_module(name)
    with Broker.embedded({"w1": Worker.at(worker.endpoint, mode=mode)}, patience=PATIENCE) as broker:
        assert module.Once().named("once").at("w1").forward(1, broker=broker) == 2  # the worker imports it
        path.write_text(NEW)  # the package is updated; the worker keeps what it imported
        module = importlib.reload(module)
        with pytest.raises(Refused) as info:
            module.Twice().named("twice").at("w1").forward(1, broker=broker)
    said = str(info.value)
    assert f"This worker holds an older import of `{name}`" in said, said
    assert "systemctl restart somatize-worker" in said, said
    assert "older import" in worker.stderr()


def test_a_node_failing_in_code_changed_on_disk_says_the_worker_runs_the_old_code(processes, project):
    name, path = project
    worker = processes(
        [*WORKER, "--listen", "127.0.0.1:0", "--announce", "--project", str(path.parent)], env=env_with_tests()
    )
    module = importlib.import_module(name)
    with Broker.embedded({"w1": Worker.at(worker.endpoint)}, patience=PATIENCE) as broker:
        assert module.Once().named("once").at("w1").forward(1, broker=broker) == 2
        path.write_text(NEW)
        with pytest.raises(NodeFailed) as info:  # the old code's own failure, at run time
            module.Once().named("once").at("w1").forward("one", broker=broker)
    said = str(info.value)
    assert "TypeError" in said and f"This worker holds an older import of `{name}`" in said, said


@pytest.mark.pure
def test_what_a_peer_can_make_a_side_log_is_bounded_counted_and_escaped():
    """One budget for both sides (somatize.fabric.logs): a burst past LOUD lines is held back
    and counted, the count is said with the next line let through, and a peer's control
    characters never reach the log raw."""
    import logging

    from somatize.fabric.logs import LOUD, Limiter, Quiet

    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    logger = logging.getLogger("somatize.test.budget")
    logger.propagate = False
    logger.addHandler(Keep())
    logger.setLevel(logging.INFO)
    limiter = Limiter(logger, quiet=3600)
    said = [limiter.say(logging.INFO, "refused %s", f"peer\x00{n}") for n in range(LOUD + 5)]
    assert said == [True] * LOUD + [False] * 5 and limiter.held == 5
    assert len(seen) == LOUD and all("\\x00" in line and "\x00" not in line for line in seen)
    limiter._said.clear()  # the period is over
    assert limiter.say(logging.INFO, "again") and seen[-1] == "again (5 more such lines were not logged)"
    quiet = Quiet("refusals", loud=2, quiet=3600)
    assert [quiet.more() for _ in range(4)] == ["", "", None, None]
    quiet._said.clear()
    assert quiet.more() == " (2 more refusals were not logged)" and quiet.more() == ""
