"""A project-mode worker that imported a module before it was edited refuses to run it.

The client computes a cached node's key from the code it has; a project-mode worker runs
the code it imported. Started before an edit and not restarted, it would run the old code,
and the client would keep what that made under the new code's key, for every machine that
shares the store. So a project-mode spec carries the client's digest of the class's code,
and the worker refuses a class whose code it digests otherwise, before anything runs.

Real processes: a listening worker importing from a folder of ours, and a fresh client
process for each look (so each one imports the module as it is on disk then).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest
from conftest import WORKER
from packing_nodes import Add

import somatize
from somatize import Refused
from somatize.code_identity import code_digest
from somatize.errors import ProtocolError
from somatize.packing import Catalog, Packer
from somatize.wire import NodeSpec, Recipe, Work, decode, encode

MODULE = "stale_worker_nodes"

NODE = """\
from somatize import Node


class Forward(Node):
    def forward(self, x):
        return x + {step}
"""

# One client process: forwards each job to the worker at argv[1], with the store at argv[2],
# and says, for each, what came back and whether anything is kept under the job's key.
CLIENT = """\
import json, sys
sys.path.insert(0, sys.argv[3])
from stale_worker_nodes import Forward
from somatize import Broker, FolderStore, Refused, Worker
from somatize.keys import cache_name, output_key, value_key

store = FolderStore(sys.argv[2])
said = []
with Broker.embedded({"w1": Worker.at(sys.argv[1], mode="project")}) as broker:
    for job in json.loads(sys.argv[4]):
        step = Forward().named("forward").at("w1").frozen()
        if job["cached"]:
            step = step.cached(version=job.get("version"))
        key = output_key(step.identity, value_key(job["x"]))
        try:
            said.append({"result": step.forward(job["x"], broker=broker, store=store)})
        except Refused as exc:
            said.append({"refused": str(exc)})
        said[-1]["kept"] = cache_name(key) in store
print(json.dumps(said))
"""


def quiet_env() -> dict:
    env = dict(os.environ)
    # every process here runs the somatize under test, whatever the folder it starts in
    root = str(Path(somatize.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH", "")]))
    # no bytecode files: an edit within the second of a .pyc would be read from the old one
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


@pytest.fixture
def project(tmp_path):
    folder = tmp_path / "project"
    folder.mkdir()
    return folder


def write_node(folder: Path, step: int) -> None:
    path = folder / f"{MODULE}.py"
    before = path.stat().st_mtime_ns if path.exists() else 0
    path.write_text(NODE.format(step=step))
    # an edit is always later than what was imported, whatever the clock's grain
    later = max(time.time_ns(), before + 2_000_000_000)
    os.utime(path, ns=(later, later))


def start_worker(processes, folder: Path):
    argv = [*WORKER, "--listen", "127.0.0.1:0", "--announce", "--mode", "project", "--project", str(folder)]
    return processes(argv, env=quiet_env())


def client(worker, folder: Path, store: Path, *jobs: dict) -> list[dict]:
    done = subprocess.run(
        [sys.executable, "-c", CLIENT, worker.endpoint, str(store), str(folder), json.dumps(list(jobs))],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env=quiet_env(),
        cwd=str(folder.parent),
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def kept_names(store: Path) -> set[str]:
    return {p.relative_to(store).as_posix() for p in store.rglob("*") if p.is_file()}


def test_a_worker_started_before_an_edit_refuses_and_nothing_is_kept_under_the_new_key(processes, project, tmp_path):
    store = tmp_path / "store"
    write_node(project, 1)
    worker = start_worker(processes, project)
    assert client(worker, project, store, {"x": 10, "cached": True}) == [{"result": 11, "kept": True}]
    before = kept_names(store)

    write_node(project, 2)  # the worker is not restarted: it holds the `x + 1` import
    (refused,) = client(worker, project, store, {"x": 10, "cached": True})
    assert refused["kept"] is False  # nothing under the key the new code names
    why = refused["refused"]
    assert "`forward` is `stale_worker_nodes:Forward`" in why
    assert "imported `stale_worker_nodes` before its file was edited (restart the worker)" in why
    assert "This worker holds an older import of `stale_worker_nodes`: its file" in why  # which file
    assert kept_names(store) == before
    assert worker.alive  # a refusal, not the end of the worker

    worker.stop()
    worker = start_worker(processes, project)
    assert client(worker, project, store, {"x": 10, "cached": True}) == [{"result": 12, "kept": True}]
    assert client(worker, project, store, {"x": 30, "cached": False}) == [{"result": 32, "kept": False}]


def test_a_version_names_the_key_and_the_worker_still_has_to_run_the_clients_code(processes, project, tmp_path):
    # `.cached(version=...)` replaces the digest in the key only: a version bumped for an
    # edit that changes results must not be filled by a worker still on the old code
    store = tmp_path / "store"
    write_node(project, 1)
    worker = start_worker(processes, project)
    assert client(worker, project, store, {"x": 10, "cached": True, "version": "v1"}) == [{"result": 11, "kept": True}]

    write_node(project, 2)
    recalled, same_version, bumped = client(
        worker,
        project,
        store,
        {"x": 10, "cached": True, "version": "v1"},  # the key the user kept on purpose: recalled
        {"x": 20, "cached": True, "version": "v1"},  # not in the store: to the stale worker
        {"x": 10, "cached": True, "version": "v2"},
    )
    assert recalled == {"result": 11, "kept": True}  # the promise a version makes: no trip
    for answer in (same_version, bumped):
        assert "older import of `stale_worker_nodes`" in answer["refused"]
        assert answer["kept"] is False

    worker.stop()
    worker = start_worker(processes, project)
    assert client(worker, project, store, {"x": 10, "cached": True, "version": "v2"}) == [{"result": 12, "kept": True}]


# -- without processes: the catalog and the wire ----------------------------------------


def test_the_catalog_refuses_other_code_before_building_and_compares_on_every_build():
    assert Packer("project").spec(Add(2).named("add")).code == ""  # uncached: kept nowhere, not compared
    spec = Packer("project").spec(Add(2).named("add").cached())
    assert spec.code == code_digest(Add)
    catalog = Catalog("project")
    other = dataclasses.replace(spec, code="code:" + "0" * 32)
    with pytest.raises(
        Refused, match=r"`add` is `packing_nodes:Add`, and this worker's code for that class is not the client's"
    ):
        catalog.build(other)
    assert catalog.build(spec).forward(1) == 3
    with pytest.raises(Refused, match=r"imported `packing_nodes` before its file was edited \(restart the worker\)"):
        catalog.build(other)  # built already, for a client with this code: still compared
    said_nothing = dataclasses.replace(spec, code="")
    assert catalog.build(said_nothing) is catalog.build(spec)  # "" says nothing: not compared


def test_the_code_crosses_the_wire_and_is_held_to_its_form():
    spec = Packer("project").spec(Add(2).named("add").cached())

    def work(node: NodeSpec) -> Work:
        return Work(1, Recipe((node,), ("step", 0)), 1)

    frames = encode(work(spec))
    assert decode(frames).recipe.nodes[0].code == spec.code
    header = msgpack.unpackb(frames[0])
    header["recipe"]["nodes"][0]["code"] = "code:" + "Z" * 32  # a peer's junk: its fault
    with pytest.raises(ProtocolError, match=r"`Work.recipe.nodes\[0\].code`"):
        decode([msgpack.packb(header), *frames[1:]])
    for bad in ("code:XYZ", "sha256:" + "0" * 64, "code:" + "0" * 33):
        with pytest.raises(ValueError, match=r"`Work.recipe.nodes\[0\].code`"):
            encode(work(dataclasses.replace(spec, code=bad)))
    with pytest.raises(TypeError, match=r"\.code"):
        encode(work(dataclasses.replace(spec, code=None)))
    network = NodeSpec("n", False, "network", "sha256:" + "0" * 64, code=spec.code)
    with pytest.raises(ValueError, match="in project mode"):
        encode(work(network))


def test_a_class_replaced_in_place_is_packed_again_with_its_new_digest(tmp_path, monkeypatch):
    # IPython's autoreload puts new code into the class the client already has: the key
    # follows it, and so must the spec the piece's memo keeps, or a stale worker would match
    # the old digest and its output be kept under the new key
    from somatize.engine import Piece
    from somatize.fabric.pieces import specs_of

    name = "stale_worker_inplace"
    path = tmp_path / f"{name}.py"
    path.write_text(NODE.format(step=1).replace("Forward", "InPlace"))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    module = __import__(name)
    try:
        cls = module.InPlace
        packer = Packer("project")
        step = cls().named("p").cached()
        piece = Piece("w1", (step,), ("step", 0), 10, {}, memo={})
        first = specs_of(piece, packer)
        assert specs_of(piece, packer) is first  # unchanged: packed once
        path.write_text(NODE.format(step=2).replace("Forward", "InPlace"))
        edited = importlib.util.spec_from_file_location(name + "_edited", path)
        fresh = importlib.util.module_from_spec(edited)
        edited.loader.exec_module(fresh)
        cls.forward.__code__ = fresh.InPlace.forward.__code__  # what autoreload does
        again = specs_of(piece, packer)
        assert again[0].code == code_digest(cls) != first[0].code
    finally:
        sys.modules.pop(name, None)
