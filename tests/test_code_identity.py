"""A cached node's key changes when its code does (issue 21).

The identity a key is made from is the node's name, class, plain constructor arguments and
a digest of its code: the source of its class and of its bases outside somatize. These
tests edit real files between real processes that share one FolderStore, as a researcher
fixing a feature extractor would, and look at what comes back and whether it `ran` or was
`recalled`.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from somatize import FolderStore, Node
from somatize.codec import dumps, written_parts
from somatize.keys import cache_name, output_key, value_key

ROOT = Path(__file__).resolve().parent.parent

FEATURE = """\
from somatize import Node


class Plus(Node):
    \"\"\"Adds to what it is given.\"\"\"

    def forward(self, x):
        return x + 1
"""

AS_FEATURE = FEATURE.replace("class Plus", "class Feature")

# Runs the cached node of feature.py on 10 against the store named on the command line.
DRIVER = """\
import json, sys
from somatize import FolderStore
from feature import Plus

facts = []
step = Plus().named("plus").cached({version}).frozen()
out = step.forward(10, store=FolderStore(sys.argv[1]), watching=facts.append)
print(json.dumps({{"out": out, "facts": [f["fact"] for f in facts]}}))
"""


def run(tmp_path: Path, argv: list[str], *, seed: str = "0", stdin: str | None = None) -> dict:
    """Run ``argv`` (after the interpreter) in a fresh process in ``tmp_path``; its last
    stdout line is JSON. Bytecode is not written: an edit that keeps a file's size within
    the second it was last written would otherwise run the old .pyc, Python's own rule."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path)]),
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONHASHSEED": seed,
    }
    done = subprocess.run(
        [sys.executable, *argv],
        cwd=tmp_path,
        env=env,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["stderr"] = done.stderr
    return result


def said(result: dict) -> list[str]:
    return [line for line in result["stderr"].splitlines() if "has no source" in line]


# -- the researcher's edit ------------------------------------------------------------------


def test_an_edited_forward_runs_again_in_the_next_process(tmp_path):
    (tmp_path / "feature.py").write_text(FEATURE)
    (tmp_path / "run.py").write_text(DRIVER.format(version=""))
    store = str(tmp_path / "store")

    first = run(tmp_path, ["run.py", store])
    assert (first["out"], first["facts"]) == (11, ["ran", "kept", "finished"])
    again = run(tmp_path, ["run.py", store])  # the same code, another process: recalled
    assert (again["out"], again["facts"]) == (11, ["recalled", "finished"])

    (tmp_path / "feature.py").write_text(FEATURE.replace("x + 1", "x + 2"))
    edited = run(tmp_path, ["run.py", store])
    assert edited["out"] == 12
    assert edited["facts"] == ["ran", "kept", "finished"]  # ran, never recalled
    assert run(tmp_path, ["run.py", store])["facts"] == ["recalled", "finished"]
    assert not said(first) and not said(edited)  # read from the file: nothing to say


def test_a_class_in_main_is_read_from_the_script(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(FEATURE + DRIVER.format(version="").replace("from feature import Plus\n", ""))
    store = str(tmp_path / "store")

    assert run(tmp_path, ["job.py", store])["facts"] == ["ran", "kept", "finished"]
    assert run(tmp_path, ["job.py", store])["facts"] == ["recalled", "finished"]
    script.write_text(script.read_text().replace("x + 1", "x - 1"))
    edited = run(tmp_path, ["job.py", store])
    assert (edited["out"], edited["facts"]) == (9, ["ran", "kept", "finished"])
    assert not said(edited)


def test_a_version_keeps_the_key_across_an_edit_until_it_changes(tmp_path):
    (tmp_path / "feature.py").write_text(FEATURE)
    (tmp_path / "run.py").write_text(DRIVER.format(version='version="1"'))
    store = str(tmp_path / "store")
    assert run(tmp_path, ["run.py", store])["facts"] == ["ran", "kept", "finished"]

    # the user's promise: this edit does not change results, so the key stays
    (tmp_path / "feature.py").write_text(FEATURE.replace("x + 1", "1 + x"))
    kept = run(tmp_path, ["run.py", store])
    assert (kept["out"], kept["facts"]) == (11, ["recalled", "finished"])

    (tmp_path / "run.py").write_text(DRIVER.format(version='version="2"'))
    bumped = run(tmp_path, ["run.py", store])
    assert (bumped["out"], bumped["facts"]) == (11, ["ran", "kept", "finished"])


def test_an_entry_kept_before_code_was_in_the_key_is_never_recalled(tmp_path):
    # What today's code made, kept under the key a node had when its identity was its name,
    # class and arguments only: the edited node must not get it back.
    store = FolderStore(tmp_path / "store")
    (tmp_path / "feature.py").write_text(FEATURE.replace("x + 1", "x + 2"))
    (tmp_path / "run.py").write_text(DRIVER.format(version=""))
    arguments = hashlib.sha256(dumps([[], {}])).hexdigest()[:32]
    before = output_key(f"plus|feature.Plus|{arguments}", value_key(10))
    store.put(cache_name(before), {"node": "plus", "type": "int"}, written_parts(11))

    now = run(tmp_path, ["run.py", str(tmp_path / "store")])
    assert (now["out"], now["facts"]) == (12, ["ran", "kept", "finished"])


# -- what counts as an edit -----------------------------------------------------------------


def identity(tmp_path: Path, label: str, files: dict[str, str]) -> str:
    """The identity of ``cid_feature.Feature`` when the files are ``files``: each version is
    its own folder, imported afresh under the same module names."""
    folder = tmp_path / label
    folder.mkdir()
    for name, text in files.items():
        (folder / name).write_bytes(text.encode())
    names = [name.removesuffix(".py") for name in files]
    sys.path.insert(0, str(folder))
    importlib.invalidate_caches()
    try:
        for name in names:
            sys.modules.pop(name, None)
        module = importlib.import_module("cid_feature")
        return module.Feature().named("feature").cached().identity
    finally:
        sys.path.remove(str(folder))
        for name in names:
            sys.modules.pop(name, None)


BEFORE = """\
from somatize import Node


class Feature(Node):
    \"\"\"Scales what it is given.\"\"\"

    factor = 3

    def forward(self, x):
        return [v * self.factor for v in x]
"""

KEPT = {
    "a comment": BEFORE.replace("return [", "# one pass\n        return [  # a list\n            "),
    "blank lines": BEFORE.replace("\n\n", "\n\n\n\n"),
    "spacing within a line": BEFORE.replace("v * self.factor", "v*self.factor").replace("factor = 3", "factor=3"),
    "line endings": BEFORE.replace("\n", "\r\n"),
    "tabs for indentation": BEFORE.replace("        ", "\t\t").replace("    ", "\t"),
    "what comes after the class": BEFORE + "\n\nLIMIT = 4  # not the class's\n",
}

CHANGED = {
    "the forward": BEFORE.replace("v * self.factor", "v * self.factor + 1"),
    "a class attribute": BEFORE.replace("factor = 3", "factor = 4"),
    "the docstring": BEFORE.replace("Scales", "Multiplies"),
    "a new method": BEFORE + "\n    def extra(self):\n        return 0\n",
    "a decorated method": BEFORE.replace(
        "    def forward", "    @staticmethod\n    def helper():\n        pass\n\n    def forward"
    ),
}


@pytest.mark.parametrize("edit", list(KEPT))
@pytest.mark.pure
def test_comments_and_layout_do_not_change_the_key(tmp_path, edit):
    assert identity(tmp_path, "before", {"cid_feature.py": BEFORE}) == identity(
        tmp_path, "after", {"cid_feature.py": KEPT[edit]}
    )


@pytest.mark.parametrize("edit", list(CHANGED))
@pytest.mark.pure
def test_every_other_edit_of_the_class_changes_the_key(tmp_path, edit):
    before = identity(tmp_path, "before", {"cid_feature.py": BEFORE})
    assert before != identity(tmp_path, "after", {"cid_feature.py": CHANGED[edit]})


BASE = """\
class Scaling:
    factor = 3

    def scale(self, x):
        return x * self.factor
"""

ON_BASE = """\
from cid_base import Scaling
from somatize import Node


class Feature(Scaling, Node):
    def forward(self, x):
        return self.scale(x)
"""


@pytest.mark.pure
def test_a_base_class_outside_somatize_is_part_of_the_code(tmp_path):
    before = identity(tmp_path, "before", {"cid_base.py": BASE, "cid_feature.py": ON_BASE})
    same = identity(tmp_path, "same", {"cid_base.py": BASE + "\n# a note\n", "cid_feature.py": ON_BASE})
    edited = identity(
        tmp_path, "edited", {"cid_base.py": BASE.replace("x * self", "x + self"), "cid_feature.py": ON_BASE}
    )
    assert before == same
    assert before != edited


@pytest.mark.pure
def test_a_helper_called_by_name_is_part_of_the_code_and_one_reached_as_an_attribute_is_not(tmp_path):
    # said in the docs: a function of the project that forward loads as a global is followed
    # (issue 39); what it reaches as an attribute of a module is not
    helper = "def scale(x):\n    return x * 3\n"
    feature = (
        "from cid_helper import scale\nfrom somatize import Node\n\n\nclass Feature(Node):\n"
        "    def forward(self, x):\n        return scale(x)\n"
    )
    before = identity(tmp_path, "before", {"cid_helper.py": helper, "cid_feature.py": feature})
    after = identity(tmp_path, "after", {"cid_helper.py": helper.replace("3", "4"), "cid_feature.py": feature})
    assert before != after
    dotted = (
        "import cid_helper\nfrom somatize import Node\n\n\nclass Feature(Node):\n"
        "    def forward(self, x):\n        return cid_helper.scale(x)\n"
    )
    before = identity(tmp_path, "dotted-before", {"cid_helper.py": helper, "cid_feature.py": dotted})
    after = identity(tmp_path, "dotted-after", {"cid_helper.py": helper.replace("3", "4"), "cid_feature.py": dotted})
    assert before == after


@pytest.mark.pure
def test_the_version_replaces_the_code_in_the_identity():
    class Doubled(Node):
        def forward(self, x):
            return 2 * x

    step = Doubled().named("doubled")
    assert step.cached(version="7").identity.endswith("|version:7")
    assert step.cached().identity.split("|")[-1].startswith("code:")
    assert repr(step.cached(version="7")) == "Doubled().named('doubled').cached(version='7')"
    with pytest.raises(TypeError, match=r"`.cached\(version=...\)` takes a non-empty string"):
        step.cached(version=7)  # type: ignore[arg-type]


def test_a_method_replaced_in_place_is_read_again(tmp_path):
    # IPython's autoreload puts a reloaded module's code into the classes already made, so a
    # graph built before the edit holds the new code: its key must follow.
    autoreload = pytest.importorskip("IPython.extensions.autoreload")
    (tmp_path / "cid_reloaded.py").write_text(AS_FEATURE)
    sys.path.insert(0, str(tmp_path))
    importlib.invalidate_caches()
    try:
        module = importlib.import_module("cid_reloaded")
        step = module.Feature().named("feature").cached()
        before = step.identity
        (tmp_path / "cid_reloaded.py").write_text(AS_FEATURE.replace("x + 1", "x + 22"))
        autoreload.superreload(module)
        assert step.node.forward(1) == 23  # the very same step runs the new code...
        assert step.identity != before  # ...under a new key
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("cid_reloaded", None)


@pytest.mark.pure
def test_an_edit_after_the_import_does_not_give_old_code_the_new_key(tmp_path):
    # A process imported the module, then the file was edited and not reloaded: the process
    # still runs the old code, so its key is the old code's, not the file's.
    (tmp_path / "cid_stale.py").write_text(AS_FEATURE)
    sys.path.insert(0, str(tmp_path))
    importlib.invalidate_caches()
    try:
        module = importlib.import_module("cid_stale")
        (tmp_path / "cid_stale.py").write_text(AS_FEATURE.replace("x + 1", "x + 222"))
        old = module.Feature().named("feature").cached().identity  # asked first after the edit
        sys.modules.pop("cid_stale")
        fresh = importlib.import_module("cid_stale").Feature().named("feature").cached().identity
        imported = identity(tmp_path, "as-imported", {"cid_feature.py": AS_FEATURE})
        assert old.split("|")[-1] == imported.split("|")[-1] != fresh.split("|")[-1]
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("cid_stale", None)


# -- where there is no source ---------------------------------------------------------------

TYPED_AT_C = """\
import json, sys
from somatize import FolderStore, Node

class Plus(Node):
    def forward(self, x):
        return x + 1

Made = type("Made", (Node,), {"forward": lambda self, x: x * 2})

facts = []
g = Plus().named("plus").frozen() >> Made().named("made").cached().frozen()
for _ in range(2):
    out = g.forward(10, store=FolderStore(sys.argv[1]), watching=facts.append)
print(json.dumps({"out": out, "facts": [f["fact"] for f in facts]}))
"""


def test_a_class_typed_at_the_command_line_is_keyed_by_its_bytecode(tmp_path):
    store = str(tmp_path / "store")
    first = run(tmp_path, ["-c", TYPED_AT_C, store], seed="1")
    second = run(tmp_path, ["-c", TYPED_AT_C, store], seed="2")  # another hash seed: same key
    assert first["out"] == second["out"] == 22
    assert first["facts"] == ["ran", "ran", "kept", "finished", "recalled", "finished"]
    assert second["facts"] == ["recalled", "finished"] * 2
    for result in (first, second):  # one line for each class, once in a process
        lines = said(result)
        assert len(lines) == 2, result["stderr"]
        assert any("`__main__.Plus` has no source" in line for line in lines)
        assert any("`__main__.Made` has no source" in line for line in lines)
        assert all('.cached(version="...")' in line for line in lines)

    edited = run(tmp_path, ["-c", TYPED_AT_C.replace("x * 2", "x * 3"), store])
    assert (edited["out"], edited["facts"][:3]) == (33, ["ran", "ran", "kept"])


PICKLER = """\
import sys, cloudpickle
from somatize import Node

class Plus(Node):
    def forward(self, x):
        return x + 1

open(sys.argv[1], "wb").write(cloudpickle.dumps(Plus))
print("{}")
"""

UNPICKLER = """\
import json, pickle, sys
from somatize import FolderStore

Plus = pickle.loads(open(sys.argv[1], "rb").read())
facts = []
out = Plus().named("plus").cached().frozen().forward(10, store=FolderStore(sys.argv[2]), watching=facts.append)
print(json.dumps({"out": out, "facts": [f["fact"] for f in facts]}))
"""


def test_a_class_rebuilt_by_cloudpickle_is_keyed_by_its_bytecode(tmp_path):
    (tmp_path / "pickler.py").write_text(PICKLER)
    (tmp_path / "unpickler.py").write_text(UNPICKLER)
    run(tmp_path, ["pickler.py", str(tmp_path / "plus.pkl")])
    store = str(tmp_path / "store")
    first = run(tmp_path, ["unpickler.py", str(tmp_path / "plus.pkl"), store], seed="1")
    second = run(tmp_path, ["unpickler.py", str(tmp_path / "plus.pkl"), store], seed="2")
    assert first["facts"] == ["ran", "kept", "finished"]
    assert (second["out"], second["facts"]) == (11, ["recalled", "finished"])
    for result in (first, second):
        lines = said(result)
        assert len(lines) == 1 and "cloudpickle" in lines[0], result["stderr"]


# -- a notebook -------------------------------------------------------------------------------

SHELL = """\
import json, sys
from IPython.core.interactiveshell import InteractiveShell
from traitlets.config import Config

config = Config()
config.HistoryManager.enabled = False
shell = InteractiveShell.instance(config=config)
for cell in json.loads(sys.stdin.read()):
    shell.run_cell(cell).raise_error()
print(json.dumps(shell.user_ns["answer"]))
"""

CELLS = [
    "from somatize import FolderStore, Node\nimport sys\nstore = FolderStore(sys.argv[1])",
    "class Plus(Node):\n    def forward(self, x):\n        return x + 1",
    "facts = []\nout = Plus().named('plus').cached().frozen().forward(10, store=store, watching=facts.append)\n"
    "answer = {'out': out, 'facts': [f['fact'] for f in facts]}",
]


def test_a_class_in_a_notebook_cell_is_read_from_the_cell(tmp_path, monkeypatch):
    pytest.importorskip("IPython", reason="a notebook's cells need IPython (the dev extra)")
    (tmp_path / "shell.py").write_text(SHELL)
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    store = str(tmp_path / "store")
    ran = run(tmp_path, ["shell.py", store], stdin=json.dumps(CELLS))
    again = run(tmp_path, ["shell.py", store], stdin=json.dumps(["# first\n", *CELLS]))  # other cell numbers
    fixed = [cell.replace("x + 1", "x + 2") for cell in CELLS]
    edited = run(tmp_path, ["shell.py", store], stdin=json.dumps(fixed))
    assert ran["facts"] == ["ran", "kept", "finished"]
    assert (again["out"], again["facts"]) == (11, ["recalled", "finished"])
    assert (edited["out"], edited["facts"]) == (12, ["ran", "kept", "finished"])
    assert not said(ran) and not said(edited)
