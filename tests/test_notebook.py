"""docs/examples/quickstart.ipynb runs, top to bottom, in a real Jupyter kernel.

The kernel is this interpreter (a kernelspec made for the test, found first through
JUPYTER_PATH), working in a temporary folder. Any cell that raises fails the test; so does
a traceback printed on the side, or a worker process still alive after the last cell.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

nbclient = pytest.importorskip("nbclient", reason="running the notebook needs nbclient (the dev extra)")
pytest.importorskip("ipykernel", reason="running the notebook needs ipykernel (the dev extra)")
nbformat = pytest.importorskip("nbformat", reason="running the notebook needs nbformat (the dev extra)")

NOTEBOOK = Path(__file__).resolve().parent.parent / "docs" / "examples" / "quickstart.ipynb"
KERNEL = "somatize-test"
CELL_TIMEOUT = 60  # seconds, per cell

# Run after the notebook's own cells, in the same kernel: whose kernel it was, and who is left.
AFTERWARDS = """
import os, sys, time

def children():
    mine = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone while we looked, or not a process
        if fields[1] == str(os.getpid()):
            mine.append((pid, fields[0]))
    return mine

left = children() if os.path.isdir("/proc") else []
deadline = time.monotonic() + 10
while left and time.monotonic() < deadline:
    time.sleep(0.1)
    left = children()
print(sys.executable)
assert not left, f"processes the notebook started are still there: {left}"
"""


@pytest.fixture
def kernel(tmp_path, monkeypatch):
    """A kernelspec whose kernel is this very interpreter, found before any other."""
    spec = tmp_path / "jupyter" / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "somatize tests",
                "language": "python",
            }
        )
    )
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    return KERNEL


@pytest.mark.timeout(300)
def test_the_quickstart_notebook_runs_in_a_kernel(kernel, tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    assert all(not cell.get("outputs") for cell in nb.cells if cell.cell_type == "code"), (
        "the notebook is stored with outputs: clear them before committing"
    )
    assert nb.cells[-1].cell_type == "code" and nb.cells[-1].source.strip() == "broker.close()"
    nb.cells.append(nbformat.v4.new_code_cell(AFTERWARDS))
    work = tmp_path / "work"
    work.mkdir()

    client = nbclient.NotebookClient(
        nb, kernel_name=kernel, timeout=CELL_TIMEOUT, resources={"metadata": {"path": str(work)}}
    )
    client.execute()  # raises CellExecutionError, naming the cell, when one fails

    outputs = [(cell, out) for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs]
    printed = "".join(out.get("text", "") for _, out in outputs if out.output_type == "stream")
    assert "Traceback" not in printed, printed
    assert printed.rstrip().endswith(sys.executable)  # the kernel was this interpreter

    # the live view started beside the training, and was stopped before the end
    assert "open http://127.0.0.1:" in printed and "#token=" in printed, printed

    # live facts reached print, from both workers; the second forward recalled `embed`
    assert "'host': 'w1'" in printed and "'host': 'w2'" in printed
    assert "'fact': 'recalled', 'node': 'embed'" in printed

    # the fleet, read back from the store, and its picture
    shown = {cell.source.strip(): out for cell, out in outputs if out.output_type == "execute_result"}
    fleet = shown["fleet(store, run=recorder.run)"]["data"]["text/plain"]
    assert "'w1'" in fleet and "'w2'" in fleet and "slices" in fleet
    picture = shown["machines(store, run=recorder.run)"]["data"]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "per host" in picture["text/plain"]
    else:
        assert "image/png" in picture, f"the fleet was not drawn as a figure: {sorted(picture)}"
    assert (work / ".somatize").is_dir()  # the store landed in the notebook's folder
