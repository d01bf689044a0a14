"""docs/deployment.md's runbook runs as written, on four machines made of namespaces.

The page marks each block of its runbook with the machine it runs on: a fenced block whose
info string is ``sh runbook:MACHINE`` (a shell block), ``sh runbook:MACHINE install`` (the
software installed; see below) or ``python runbook:MACHINE``. This test takes those blocks in
the page's order and runs each on its machine (``head``, ``gpu1``, ``gpu2``, ``laptop``; see
``runbook_support.Cluster``): shell blocks with ``bash -e -o pipefail``, Python blocks with
the machine's Python, in a folder holding the repository's ``brokers/`` and ``workers/`` as a
clone would. The units' ``ExecStart=`` lines run as the service user the page makes, the
SLURM script runs on the compute node, and the last block, from the laptop, sends work
Direct to ``gpu1`` and Relayed to ``gpu2``, records it and reads ``fleet`` back. A block that
fails fails the test, naming the block and what it said; so does a step the page leaves out.

Only what cannot be the same here is replaced: ``sudo``, ``systemctl``, ``journalctl``,
``scp``, ``ssh``, ``sbatch`` and ``srun`` are stand-ins (``runbook_support``), and the
``install`` blocks (``pip install`` needs a package index the namespaces cannot reach) become
a ``/opt/somatize/venv/bin/python`` that is this test's Python. Needs root, ``ip``,
``nsenter``, ``unshare``, ``setpriv`` and overlayfs; skipped with the reason otherwise.
Everything is removed after, pass or fail: namespaces, processes, the users (they exist only
in each machine's overlay of ``/etc``), files.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from runbook_support import BASE_AT, MACHINES, PYTHON_AT, Cluster

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "deployment.md"
BLOCK = re.compile(r"^```(sh|python) runbook:(\w+)( install)?\n(.*?)^```\n", re.S | re.M)

pytestmark = [pytest.mark.slow, pytest.mark.skipif(sys.platform != "linux", reason="network namespaces are Linux's")]

# What an `install` block does here: a virtual environment whose Python finds this checkout's
# somatize (as `pip install .` would have it find an installed copy), and the two commands
# that installing somatize puts next to it.
# Made from the interpreter itself (bound where the service user can reach it), it sees that
# interpreter's packages and, through the .pth, the checkout and the packages of this test's
# environment (a virtual environment of its own on a CI machine).
_PACKAGES = f"{PYTHON_AT}/{os.path.relpath(sysconfig.get_path('purelib'), sys.prefix)}"
INSTALLED = f"""
{BASE_AT}/bin/python3 -m venv --without-pip --system-site-packages /opt/somatize/venv
purelib="$(/opt/somatize/venv/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
printf '%s\\n%s\\n' {ROOT} {_PACKAGES} > "$purelib/somatize-checkout.pth"
for program in broker worker; do
    printf '#!/bin/sh\\nexec /opt/somatize/venv/bin/python -m somatize.%s "$@"\\n' $program > /opt/somatize/venv/bin/somatize-$program
    chmod 755 /opt/somatize/venv/bin/somatize-$program
done
"""


@dataclass
class Block:
    number: int
    language: str
    machine: str
    install: bool
    text: str

    def describe(self) -> str:
        return f"block {self.number} ({self.language} on {self.machine}{', install' if self.install else ''})"


def runbook(page: str) -> list[Block]:
    found = [
        Block(i + 1, lang, machine, bool(install), text)
        for i, (lang, machine, install, text) in enumerate(BLOCK.findall(page))
    ]
    unknown = sorted({b.machine for b in found} - set(MACHINES))
    assert not unknown, f"the runbook names machines this test does not make: {unknown}"
    return found


def run_runbook(cluster: Cluster, blocks: list[Block]) -> list[str]:
    """Each block on its machine, in order; what each said, or the failure of the first that fails."""
    said = []
    for block in blocks:
        if block.language == "python":
            script = cluster.workdir(block.machine) / f"block{block.number}.py"
            script.write_text(block.text)
            done = cluster.run(block.machine, ["python3", script.name], timeout=180)
        else:
            text = INSTALLED if block.install else block.text
            done = cluster.run(block.machine, ["bash", "-e", "-o", "pipefail", "-c", text], timeout=120)
        said.append(f"{block.describe()}:\n{done.stdout}{done.stderr}")
        if done.returncode != 0:
            # what the units said (their journal) and the batch jobs (their output files)
            kept = [*sorted(cluster.root.glob("state/*/*.log")), *sorted(cluster.root.glob("work/*/*.out"))]
            logs = "".join(
                f"\n--- {path.parent.name}/{path.name}:\n{path.read_text(errors='replace')[-2000:]}" for path in kept
            )
            pytest.fail(
                f"{block.describe()} of {PAGE.name} failed with exit code {done.returncode}:\n"
                f"{block.text}\n--- it said:\n{done.stdout[-3000:]}{done.stderr[-3000:]}{logs}",
                pytrace=False,
            )
    return said


@pytest.fixture
def cluster():
    if os.geteuid() != 0:
        pytest.skip("making network namespaces, overlays and users needs root")
    missing = [tool for tool in ("ip", "nsenter", "unshare", "setpriv", "mount") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} to make the machines")
    made = Cluster(Path(tempfile.mkdtemp(prefix="somatize-runbook-", dir="/var/tmp")), ROOT)
    try:
        made.build()
    except (RuntimeError, OSError) as exc:
        made.remove()
        pytest.skip(f"cannot make the runbook's machines here: {exc}")
    try:
        yield made
    finally:
        made.remove()


def test_the_page_marks_a_runbook_for_every_machine():
    blocks = runbook(PAGE.read_text())
    assert {b.machine for b in blocks} >= {"head", "gpu1", "laptop"}
    assert blocks[-1].language == "python" and blocks[-1].machine == "laptop"
    # the recipes the runbook installs are the repository's own
    text = "".join(b.text for b in blocks)
    for recipe in (
        "brokers/somatize-broker.service",
        "workers/somatize-worker.service",
        "workers/somatize-workers.sbatch",
    ):
        assert recipe in text, f"the runbook never uses {recipe}"
    # what the test puts in place of an install block is what the block installs
    for block in (b for b in blocks if b.install):
        assert "python3 -m venv /opt/somatize/venv" in block.text and "pip install" in block.text, block.text


@pytest.mark.timeout(600)
def test_the_runbook_runs_as_written(cluster):
    said = run_runbook(cluster, runbook(PAGE.read_text()))
    last = said[-1]
    print("\n" + last[-3000:])
    # the topology made the paths: the laptop has no route to gpu2, so its work was relayed
    probe = cluster.run(
        "laptop",
        [
            "python3",
            "-c",
            (
                "import socket, sys\n"
                "s = socket.socket(); s.settimeout(2)\n"
                "try:\n    s.connect(('10.210.3.2', 7000)); print('connected')\n"
                "except OSError as exc:\n    print(type(exc).__name__)\n"
            ),
        ],
        timeout=30,
    )
    assert "connected" not in probe.stdout
    assert "'host': 'gpu1'" in last and "'host': 'gpu2'" in last
    # the units still serve, nothing the page did ended them, and they run as the service
    # user the page made, not as root
    for machine, name in (("head", "somatize-broker"), ("gpu1", "somatize-worker")):
        state = cluster.run(machine, ["systemctl", "is-active", name], timeout=30)
        assert state.returncode == 0, f"{name} on {machine} ended:\n{cluster.log(machine, name)}"
        pid = int((cluster.root / "state" / machine / f"{name}.pid").read_text())
        assert os.stat(f"/proc/{pid}").st_uid != 0, f"{name} on {machine} runs as root"


# -- the SLURM script carries its settings -------------------------------------------------------

SBATCH = ROOT / "workers" / "somatize-workers.sbatch"
# A Python that imports somatize when asked to, and otherwise prints what it was given.
STUB_PYTHON = """#!/bin/sh
if [ "$1" = "-c" ]; then exit {imports}; fi
printf '%s\\n' "$0" "$@"
"""
STUB_SRUN = """#!/bin/sh
while [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do shift; done
exec "$@"
"""


def submitted(tmp_path: Path, imports: bool = True, **settings: str):
    """The sbatch script run as a job would run it, with a stand-in srun and a stub Python."""
    if shutil.which("hostname") is None:
        pytest.skip("the SLURM script names each worker with `hostname -s`, and there is no `hostname` here")
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    python = venv / "bin" / "python"
    python.write_text(STUB_PYTHON.format(imports=0 if imports else 1))
    python.chmod(0o755)
    tools = tmp_path / "tools"
    tools.mkdir(exist_ok=True)
    (tools / "srun").write_text(STUB_SRUN)
    (tools / "srun").chmod(0o755)
    env = {"PATH": f"{tools}{os.pathsep}/usr/bin:/bin", "HOME": str(tmp_path), "VIRTUAL_ENV": str(venv), **settings}
    return subprocess.run(["bash", str(SBATCH)], env=env, capture_output=True, text=True, timeout=30, check=False)


def test_the_slurm_script_uses_the_submitting_environments_python_and_carries_the_store(tmp_path):
    done = submitted(tmp_path, SOMATIZE_STORE="/shared/somatize/store", SOMATIZE_REPORTING="5")
    assert done.returncode == 0, done.stderr
    argv = done.stdout.split("\n")
    assert argv[0] == str(tmp_path / "venv" / "bin" / "python")  # the active venv's, not python3's
    assert argv[argv.index("--store") + 1] == "/shared/somatize/store"
    assert argv[argv.index("--reporting") + 1] == "5"
    assert argv[argv.index("--key") + 1] == f"{tmp_path}/.somatize/keys/slurm.key_secret"

    without = submitted(tmp_path)
    assert without.returncode == 0, without.stderr
    assert "--store" not in without.stdout.split("\n")


def test_the_slurm_script_says_when_its_python_has_no_somatize(tmp_path):
    done = submitted(tmp_path, imports=False)
    assert done.returncode == 2
    assert "cannot import somatize" in done.stderr and "SOMATIZE_PYTHON=" in done.stderr
    assert done.stdout == ""  # no worker was started
