"""A cached node's key follows the code that runs, not only its class statement (issue 39).

Each test writes a tiny project in a temporary folder, runs a cached forward in a fresh
process against one FolderStore, edits a file as a researcher would, and runs again in
another fresh process: what comes back, and whether it `ran` or was `recalled`, says
whether the key saw the edit. Every one of these recalled the old value before.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

DRIVER = """\
import json, sys
from somatize import FolderStore
from feature import Plus

facts = []
step = Plus().named("plus").cached().frozen()
out = step.forward(10, store=FolderStore(sys.argv[1]), watching=facts.append)
print(json.dumps({"out": out, "facts": [f["fact"] for f in facts], "key": step.identity}))
"""

RAN = ["ran", "kept", "finished"]
RECALLED = ["recalled", "finished"]


def run(
    folder: Path,
    *,
    bytecode: bool = False,
    argv: tuple[str, ...] = ("run.py",),
    stdin: str | None = None,
    env: dict[str, str] | None = None,
) -> dict:
    """Run the driver in a fresh process in ``folder`` against ``folder/store``; its last
    stdout line is JSON. Bytecode is written only when asked (Python's own .pyc rule)."""
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(folder)]), **(env or {})}
    environment.pop("PYTHONDONTWRITEBYTECODE", None)
    if not bytecode:
        environment["PYTHONDONTWRITEBYTECODE"] = "1"
    done = subprocess.run(
        [sys.executable, *argv, str(folder / "store")],
        cwd=folder,
        env=environment,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["stderr"] = done.stderr
    return result


def project(folder: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (folder / name).write_text(text)
    (folder / "run.py").write_text(DRIVER)


def edited(folder: Path, name: str, old: str, new: str) -> None:
    path = folder / name
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))


# -- functions the class holds, written elsewhere ---------------------------------------------


def test_a_forward_assigned_from_another_module_runs_again_when_that_module_is_edited(tmp_path):
    project(
        tmp_path,
        {
            "impl.py": "def forward(self, x):\n    return x + 1\n",
            "feature.py": "import impl\nfrom somatize import Node\n\n\nclass Plus(Node):\n    forward = impl.forward\n",
        },
    )
    first = run(tmp_path)
    assert (first["out"], first["facts"]) == (11, RAN)
    assert run(tmp_path)["facts"] == RECALLED

    edited(tmp_path, "impl.py", "x + 1", "x * 11")
    after = run(tmp_path)
    assert (after["out"], after["facts"]) == (110, RAN)  # not the 11 the old code made
    assert run(tmp_path)["facts"] == RECALLED
    assert "has no source" not in after["stderr"]


def test_a_forward_assigned_from_a_function_of_the_same_file_runs_again_when_it_is_edited(tmp_path):
    project(
        tmp_path,
        {
            "feature.py": "from somatize import Node\n\n\ndef _forward(self, x):\n    return x + 1\n\n\n"
            "class Plus(Node):\n    forward = _forward\n",
        },
    )
    assert run(tmp_path)["facts"] == RAN
    assert run(tmp_path)["facts"] == RECALLED

    edited(tmp_path, "feature.py", "x + 1", "x * 11")
    after = run(tmp_path)
    assert (after["out"], after["facts"]) == (110, RAN)


def test_a_helper_forward_calls_by_name_runs_again_when_it_is_edited_and_layout_does_not_count(tmp_path):
    project(
        tmp_path,
        {
            "helpers.py": "def grow(x):\n    return step(x)\n\n\ndef step(x):\n    return x + 1\n",
            "feature.py": "from helpers import grow\nfrom somatize import Node\n\n\nclass Plus(Node):\n"
            "    def forward(self, x):\n        return grow(x)\n",
        },
    )
    assert run(tmp_path)["facts"] == RAN
    edited(tmp_path, "helpers.py", "    return x + 1\n", "    # a note\n    return x+1\n")
    assert run(tmp_path)["facts"] == RECALLED  # a comment and spacing: the same code

    edited(tmp_path, "helpers.py", "x+1", "x*11")  # a helper of the helper
    after = run(tmp_path)
    assert (after["out"], after["facts"]) == (110, RAN)


# -- a .pyc older than its file ---------------------------------------------------------------


def test_a_stale_pyc_does_not_give_the_code_it_runs_the_key_of_the_source(tmp_path):
    project(
        tmp_path,
        {
            "feature.py": "from somatize import Node\n\n\nclass Plus(Node):\n    def forward(self, x):\n"
            "        return x + 1\n",
        },
    )
    first = run(tmp_path, bytecode=True)
    assert (first["out"], first["facts"]) == (11, RAN)
    (pyc,) = (tmp_path / "__pycache__").glob("feature.*.pyc")

    # an edit within the second the .pyc was written, at the same size: Python's check (the
    # source's mtime and size, recorded in the .pyc) passes, and it runs the old bytecode
    source = tmp_path / "feature.py"
    size = source.stat().st_size
    edited(tmp_path, "feature.py", "x + 1", "x + 2")
    assert source.stat().st_size == size
    recorded = int.from_bytes(pyc.read_bytes()[8:12], "little")
    os.utime(source, (recorded, recorded))
    stale = run(tmp_path, bytecode=True)
    assert stale["out"] == 11  # what the stale bytecode computes...
    assert stale["facts"] == RAN

    pyc.unlink()  # compiled afresh: the source's code runs, and must not recall the stale 11
    fresh = run(tmp_path, bytecode=True)
    assert (fresh["out"], fresh["facts"]) == (12, RAN)
    # the stale bytecode's 11 was kept under a key of its own, not the source's, and said so
    assert len({first["key"], stale["key"], fresh["key"]}) == 3
    assert "`feature.Plus` has no source to read (the code it runs is not what its file holds now" in stale["stderr"]
    assert "has no source" not in fresh["stderr"]
    assert run(tmp_path, bytecode=True)["facts"] == RECALLED  # its .pyc is fresh now


# -- only the globals the code loads ----------------------------------------------------------

IMPORTS_INSIDE = """\
{top}from somatize import Node


class Plus(Node):
    def forward(self, x):
        import json
        return json.loads(json.dumps(x)) + 1
"""


def test_an_import_inside_forward_keys_the_same_whether_the_module_imports_it_too(tmp_path):
    project(tmp_path, {"feature.py": IMPORTS_INSIDE.format(top="import json\n")})
    with_global = run(tmp_path)
    assert (with_global["out"], with_global["facts"]) == (11, RAN)

    (tmp_path / "feature.py").write_text(IMPORTS_INSIDE.format(top=""))
    without = run(tmp_path)
    assert (without["out"], without["facts"]) == (11, RECALLED)
    assert without["key"] == with_global["key"]


def test_a_module_the_code_loads_as_a_global_is_part_of_the_key_by_its_name(tmp_path):
    body = (
        "import {module} as coder\nfrom somatize import Node\n\n\nclass Plus(Node):\n"
        "    def forward(self, x):\n        return len(coder.dumps(x)) + 9\n"
    )
    project(tmp_path, {"feature.py": body.format(module="json")})
    assert run(tmp_path)["facts"] == RAN
    (tmp_path / "feature.py").write_text(body.format(module="pickle"))  # the class's text is the same
    after = run(tmp_path)
    assert after["facts"] == RAN and after["out"] != 11


# -- a notebook ---------------------------------------------------------------------------------

SHELL = """\
import json, sys
from IPython.core.interactiveshell import InteractiveShell
from traitlets.config import Config

config = Config()
config.HistoryManager.enabled = False
shell = InteractiveShell.instance(config=config)
answers = []
for cell in json.loads(sys.stdin.read()):
    shell.run_cell(cell).raise_error()
    if "answer" in shell.user_ns:
        answers.append(shell.user_ns.pop("answer"))
print(json.dumps({"answers": answers}))
"""

SETUP = "from somatize import FolderStore, Node\nimport sys\nstore = FolderStore(sys.argv[1])"
RUN_CELL = (
    "facts = []\nstep = Plus().named('plus').cached().frozen()\n"
    "out = step.forward(10, store=store, watching=facts.append)\n"
    "answer = {'out': out, 'facts': [f['fact'] for f in facts], 'key': step.identity}"
)


def test_a_helper_cell_run_again_with_an_edit_runs_the_node_again_in_the_same_kernel(tmp_path, monkeypatch):
    pytest.importorskip("IPython", reason="a notebook's cells need IPython (the dev extra)")
    (tmp_path / "shell.py").write_text(SHELL)
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    helper = "def grow(x):\n    return x + 1"
    cells = [
        SETUP,
        helper,
        "class Plus(Node):\n    def forward(self, x):\n        return grow(x)",
        RUN_CELL,
        RUN_CELL,
        helper.replace("x + 1", "x * 11"),
        RUN_CELL,
    ]
    answers = run(tmp_path, argv=("shell.py",), stdin=json.dumps(cells))["answers"]
    assert [(a["out"], a["facts"]) for a in answers] == [(11, RAN), (11, RECALLED), (110, RAN)]


def test_a_notebook_keys_an_import_inside_forward_the_same_with_or_without_it_at_the_top(tmp_path, monkeypatch):
    pytest.importorskip("IPython", reason="a notebook's cells need IPython (the dev extra)")
    (tmp_path / "shell.py").write_text(SHELL)
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    node = "class Plus(Node):\n    def forward(self, x):\n        import json\n        return json.loads(json.dumps(x)) + 1"
    one_day = run(tmp_path, argv=("shell.py",), stdin=json.dumps([SETUP, "import json", node, RUN_CELL]))
    next_day = run(tmp_path, argv=("shell.py",), stdin=json.dumps([SETUP, node, RUN_CELL]))
    (first,), (second,) = one_day["answers"], next_day["answers"]
    assert (first["out"], first["facts"]) == (11, RAN)
    assert (second["out"], second["facts"]) == (11, RECALLED)
    assert "has no source" not in one_day["stderr"] + next_day["stderr"]
