"""The deployment recipes in brokers/ and workers/ do what their READMEs say.

One test plays a small cluster on this machine, with a folder per machine: keys made with
`python -m somatize keys` as the READMEs say, a worker started from the systemd unit's own
`ExecStart=` (listening, found through the example host table: Direct), a broker started
from its unit's `ExecStart=`, the SLURM script itself run with a stand-in for `srun` (a
worker that dials in: Relayed), and a client sending work through both with CURVE keys.
Only what cannot be the same here is replaced: the install path becomes this Python, the
machines' `/etc/somatize` become temporary folders, and fixed ports become port 0.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import stat
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
from conftest import TESTS, env_with_tests
from fabric_nodes import Add

from somatize import Broker
from somatize.broker import read_hosts
from somatize.fabric.curve import Keys

ROOT = TESTS.parent
BROKERS = ROOT / "brokers"
WORKERS = ROOT / "workers"
BROKER_UNIT = BROKERS / "somatize-broker.service"
WORKER_UNIT = WORKERS / "somatize-worker.service"
SBATCH = WORKERS / "somatize-workers.sbatch"
HOSTS = BROKERS / "hosts.toml"
INSTALLED_PYTHON = "/opt/somatize/venv/bin/python"
PAGES = [BROKERS / "README.md", WORKERS / "README.md", ROOT / "docs" / "deployment.md", ROOT / "docs" / "security.md"]

# What `srun` does on each node, for one node: drop its options, run the command.
FAKE_SRUN = """#!/bin/bash
while [[ $# -gt 0 && $1 == -* ]]; do shift; done
exec "$@"
"""


# -- reading the recipes ----------------------------------------------------------------


def logical_lines(text: str) -> list[str]:
    """Lines with their backslash continuations joined, as systemd and the shell read them."""
    return re.sub(r"\\\n\s*", " ", text).splitlines()


def exec_start(unit: Path) -> list[str]:
    lines = [line for line in logical_lines(unit.read_text()) if line.startswith("ExecStart=")]
    assert len(lines) == 1, f"{unit.name} should have one ExecStart="
    return shlex.split(lines[0].removeprefix("ExecStart="))


def on_this_machine(argv: list[str], etc: Path) -> list[str]:
    """A unit's command for a machine whose /etc/somatize is ``etc``, on a port the kernel picks."""
    out = []
    for arg in argv:
        arg = arg.replace("%H", socket.gethostname())
        if arg == INSTALLED_PYTHON:
            arg = sys.executable
        elif arg.startswith("/etc/somatize"):
            arg = str(etc) + arg.removeprefix("/etc/somatize")
        elif arg.startswith("/var/lib/somatize"):  # the unit's StateDirectory
            arg = str(etc) + "/state" + arg.removeprefix("/var/lib/somatize")
        elif re.fullmatch(r"(tcp://)?0\.0\.0\.0:\d+", arg):
            arg = re.sub(r":\d+$", ":0", arg)
        out.append(arg)
    return [*out, "--announce"]


def keys(folder: Path, *names: str) -> None:
    """The READMEs' command for making key pairs."""
    done = subprocess.run(
        [sys.executable, "-m", "somatize", "keys", str(folder), *names], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr


def hand_out(public: Path, folder: Path, name: str | None = None) -> None:
    """Copy a public key where someone must recognise its owner (`scp` in the READMEs)."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(public, folder / (name or public.name))


def wait_for_host(broker: Broker, host: str, seconds: float = 20.0) -> None:
    until = time.monotonic() + seconds
    while not broker.knows(host):
        assert time.monotonic() < until, f"`{host}` never dialed in to the broker"
        time.sleep(0.1)


def short_hostname() -> str:
    return subprocess.run(["hostname", "-s"], capture_output=True, text=True, timeout=10).stdout.strip()


# -- the recipes, followed ---------------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_head_node_a_listening_worker_and_a_slurm_worker_serve_a_client(tmp_path, processes):
    if shutil.which("hostname") is None:
        pytest.skip("the SLURM script names each worker with `hostname -s`, and there is no `hostname` here")
    head, gpu1, home = tmp_path / "head" / "etc", tmp_path / "gpu1" / "etc", tmp_path / "home"
    mine = home / ".somatize" / "keys"
    node = short_hostname()
    table = tomllib.loads(HOSTS.read_text())["hosts"]
    assert node not in table, f"this machine's name `{node}` is a host in the example table"

    # keys, made where the READMEs make them
    keys(head / "keys", "broker")  # brokers/README.md: the broker's
    keys(gpu1 / "keys")  # workers/README.md: named after the machine, as the unit expects
    keys(mine, "me")  # brokers/README.md: yours
    keys(mine, "slurm")  # workers/README.md: the SLURM job's
    assert stat.S_IMODE(os.stat(mine / "me.key_secret").st_mode) == 0o600

    # ... and handed out, as the table in brokers/README.md says
    hand_out(mine / "me.key", head / "allow")
    hand_out(mine / "me.key", gpu1 / "allow")
    hand_out(head / "keys" / "broker.key", mine)
    hand_out(gpu1 / "keys" / f"{socket.gethostname()}.key", head / "keys", "gpu1.key")
    hand_out(mine / "slurm.key", head / "allow-workers")  # a worker key: it offers hosts
    keys(tmp_path / "gpu2", "gpu2")  # the example table's other machine, not started here
    hand_out(tmp_path / "gpu2" / "gpu2.key", head / "keys")

    # gpu1: the worker unit's command (project mode: it imports the tests' nodes by name)
    worker = processes(on_this_machine(exec_start(WORKER_UNIT), gpu1), env=env_with_tests())
    port = worker.endpoint.rsplit(":", 1)[1]
    assert worker.endpoint.startswith("tcp://0.0.0.0:")  # reachable from elsewhere, with keys

    # the head node: the example host table, with gpu1 where it really listens
    hosts = HOSTS.read_text().replace(table["gpu1"]["address"], f"127.0.0.1:{port}")
    (head / "hosts.toml").write_text(hosts)
    broker_process = processes(on_this_machine(exec_start(BROKER_UNIT), head))
    url = "tcp://127.0.0.1:" + broker_process.endpoint.rsplit(":", 1)[1]

    # a compute node: the SLURM script itself, with `srun` standing in for SLURM's
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "srun").chmod(0o755)
    env = env_with_tests()
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}",
        HOME=str(home),
        SOMATIZE_BROKER=url,
        SOMATIZE_PYTHON=sys.executable,
    )
    env.pop("SOMATIZE_KEYS", None)
    env.pop("SOMATIZE_MODE", None)
    slurm = processes(["bash", str(SBATCH)], env=env, announce=None)

    # the client, with its keys and the broker's public key
    me = Keys.client(mine / "me.key_secret", server=mine / "broker.key")
    with Broker.at(url, keys=me) as broker:
        wait_for_host(broker, node)
        assert broker.hosts() == sorted(["gpu1", "gpu2", node])
        seen = []
        g = Add(1).named("on-gpu1").at("gpu1") >> Add(10).named("on-node").at(node)
        assert g.forward(1, broker=broker, watching=seen.append) == 12
        ran = {f["node"]: f["host"] for f in seen if f["fact"] == "ran"}
        assert ran == {"on-gpu1": "gpu1", "on-node": node}
        # how each was reached (the client's own record of what the broker answered)
        assert broker._rendezvous.located["gpu1"].path == "direct"
        assert broker._rendezvous.located[node].path == "relayed"

    # the script exec'd all the way down: its process is the worker, and it got its settings
    cmdline = Path(f"/proc/{slurm.pid}/cmdline")
    if cmdline.exists():
        argv = cmdline.read_bytes().split(b"\0")
        assert [b"-m", b"somatize.worker"] == argv[1:3]
        assert argv[argv.index(b"--offer") + 1] == node.encode()
        assert argv[argv.index(b"--mode") + 1] == b"project"

    # brokers/README.md's check, run as written but for the head node's address
    check = re.search(r"```python\n(.*?)```", (BROKERS / "README.md").read_text(), re.S).group(1)
    script = tmp_path / "check.py"
    script.write_text(check.replace("tcp://head:5555", url))
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == repr(sorted(["gpu1", "gpu2", node]))

    for process in (slurm, worker, broker_process):
        assert process.stop() == 0, f"{process.argv} did not stop cleanly on SIGTERM"


def test_the_example_host_table_parses(tmp_path):
    table = tomllib.loads(HOSTS.read_text())["hosts"]
    (tmp_path / "hosts.toml").write_text(HOSTS.read_text())
    for entry in table.values():
        if "key" in entry:
            public = Path(entry["key"])
            keys(tmp_path / "made", public.stem)
            hand_out(tmp_path / "made" / public.name, tmp_path / public.parent)
    hosts = read_hosts(tmp_path / "hosts.toml")
    assert set(hosts) == set(table)
    for name, entry in table.items():
        worker = hosts[name]
        assert worker.mode == entry.get("mode", "project")
        assert worker.mount == entry.get("mount")
        assert bool(worker.server_key()) == ("key" in entry)
        assert worker.address == entry.get("address", "")


@pytest.mark.parametrize("unit", [BROKER_UNIT, WORKER_UNIT], ids=lambda p: p.name)
def test_the_systemd_units_verify(unit, tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed here")
    # the unit as installed, but with a Python that exists here (verify checks ExecStart's)
    here = tmp_path / unit.name
    here.write_text(unit.read_text().replace(INSTALLED_PYTHON, sys.executable))
    done = subprocess.run([analyze, "verify", "--man=no", str(here)], capture_output=True, text=True, timeout=60)
    about_it = [line for line in (done.stdout + done.stderr).splitlines() if unit.name in line]
    assert not about_it, "\n".join(about_it)
    if done.returncode != 0:
        pytest.skip(f"systemd-analyze cannot verify units here: {done.stderr.strip()[:300]}")


def test_the_units_run_the_documented_commands():
    for unit, program in ((BROKER_UNIT, "somatize.broker"), (WORKER_UNIT, "somatize.worker")):
        argv = exec_start(unit)
        assert argv[:3] == [INSTALLED_PYTHON, "-m", program]
        assert "--key" in argv and "--allow" in argv and "--insecure" not in argv
        text = unit.read_text()
        assert re.search(r"^Restart=always$", text, re.M)
        assert re.search(r"^User=somatize$", text, re.M)
        assert re.search(r"^ExecReload=/bin/kill -HUP \$MAINPID$", text, re.M)


def test_the_sbatch_script_is_valid_bash_and_srun_gets_only_joined_options():
    done = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    text = SBATCH.read_text()
    assert text.startswith("#!/bin/bash\n")
    assert os.access(SBATCH, os.X_OK)
    assert re.search(r"^#SBATCH --ntasks-per-node=1$", text, re.M)
    srun = next(line for line in logical_lines(text) if line.lstrip().startswith("exec srun "))
    options = srun.split("bash -c", 1)[0].split()[2:]
    # each option carries its value after `=`, so one stand-in (and a reader) can tell
    # srun's options from the command
    assert options and all(o.startswith("--") and "=" in o for o in options), options
    # `hostname -s` and the task's number must be read on each node, not once in the batch script
    on_each = text.split("bash -c '", 1)[1]
    assert 'name="$(hostname -s)"' in on_each and '--offer "$name"' in on_each
    assert 'name="$SOMATIZE_POOL#${SLURM_PROCID:-0}"' in on_each  # SOMATIZE_POOL=gpu: the members of one pool


def test_the_sbatch_script_offers_a_pools_members_with_somatize_pool(tmp_path):
    """Each task of a job with SOMATIZE_POOL=gpu offers `gpu#<task>`; without, its node's name."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "srun").chmod(0o755)
    fake_python = bin_dir / "python"  # says what it was asked to run, instead of a worker
    fake_python.write_text('#!/bin/bash\n[[ "$1" == -c ]] && exit 0\nprintf "%s\\n" "$@"\n')
    fake_python.chmod(0o755)
    for pool, task, offered in (("gpu", "3", "gpu#3"), ("", "3", socket.gethostname().split(".")[0])):
        env = {
            **os.environ,
            "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
            "SOMATIZE_PYTHON": str(fake_python),
            "SOMATIZE_POOL": pool,
            "SLURM_PROCID": task,
            "HOME": str(tmp_path),
        }
        done = subprocess.run(["bash", str(SBATCH)], env=env, capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
        argv = done.stdout.splitlines()
        assert argv[argv.index("--offer") + 1] == offered


# -- every flag the pages show exists -----------------------------------------------------

PROGRAMS = {
    "somatize.broker": "somatize.broker",
    "somatize-broker": "somatize.broker",
    "somatize.worker": "somatize.worker",
    "somatize-worker": "somatize.worker",
}
SHOWN = re.compile(r"(somatize[.-](?:broker|worker))\b([^`|#]*)")


def shown_flags() -> dict[str, set[tuple[str, str]]]:
    flags: dict[str, set[tuple[str, str]]] = {module: set() for module in set(PROGRAMS.values())}
    for page in [*PAGES, BROKER_UNIT, WORKER_UNIT, SBATCH, HOSTS]:
        if not page.exists():
            continue
        for line in logical_lines(page.read_text()):
            for program, rest in SHOWN.findall(line):
                for flag in re.findall(r"(?<![\w-])--[a-z][a-z-]*", rest):
                    flags[PROGRAMS[program]].add((flag, page.name))
    return flags


def test_every_flag_the_recipes_and_pages_show_exists():
    for module, used in shown_flags().items():
        done = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        known = set(re.findall(r"--[a-z][a-z-]*", done.stdout))
        unknown = sorted((flag, page) for flag, page in used if flag not in known)
        assert not unknown, f"{module} has no such options: {unknown}"
    assert shown_flags()["somatize.worker"], "no worker command found in the pages"
