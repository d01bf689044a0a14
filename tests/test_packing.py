"""Packing: how a node travels to a worker (project: a name; network: an artifact) and how
the worker turns it back into a node, holding one format per codec kind an artifact carries
(``packing/formats.py``): a codec that writes other bytes for a kind it holds is refused, however
it differs, and the same codec from another process is held. Real cloudpickle, real
subprocesses, no mocks."""

from __future__ import annotations

import dataclasses
import gc
import importlib
import json
import os
import pickle
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import cloudpickle
import packing_nodes
import pytest
from packing_nodes import Add, Outer, Slow

import somatize
from somatize import Node, NodeFailed, PlanError, Refused, codec
from somatize.code_identity import code_digest
from somatize.packing import ARTIFACT_FORMAT, Catalog, Packer, digest_of
from somatize.wire import NodeSpec

codec_module = importlib.import_module("somatize.codec")


def project(target, *args, label="n", **kwargs):
    return NodeSpec(label=label, cache=False, source="project", target=target, args=args, kwargs=kwargs)


def network(digest, label="n"):
    return NodeSpec(label=label, cache=False, source="network", target=digest)


class Evil:
    """Unpickling one creates a file: proof that something was unpickled."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


# The somatize under test (a worktree's, when it is first on the path), for the scripts here,
# which run without the tests' folder on theirs
SOMATIZE_ROOT = str(Path(somatize.__file__).resolve().parents[1])


def run_script(folder: Path, name: str, code: str, *args: str) -> subprocess.CompletedProcess:
    """Run ``code`` as ``__main__`` from its own file in ``folder`` (which is also its cwd)."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / name
    script.write_text(textwrap.dedent(code))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = SOMATIZE_ROOT  # the somatize under test, and nothing of the tests
    return subprocess.run(
        [sys.executable, str(script), *args],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


# -- modes -------------------------------------------------------------------------------


@pytest.mark.pure
def test_modes_are_checked_with_a_sentence():
    for bad in ("Project", "pickle", None, 3):
        with pytest.raises(ValueError, match='"project".*"network"'):
            Packer(bad)
        with pytest.raises(ValueError, match='"project".*"network"'):
            Catalog(bad)
    assert Packer("project").mode == "project"
    assert Catalog("network").mode == "network"


@pytest.mark.pure
def test_send_is_for_network_mode_and_takes_importable_modules():
    with pytest.raises(ValueError, match="network mode"):
        Packer("project", send=[packing_nodes])
    with pytest.raises(ValueError, match="no_such_module_for_send"):
        Packer("network", send=["no_such_module_for_send"])
    with pytest.raises(TypeError, match="modules or their names"):
        Packer("network", send=[3])
    assert Packer("network", send=["packing_nodes"]).send == (packing_nodes,)
    assert Packer("network", send=packing_nodes).send == (packing_nodes,)


# -- project mode ------------------------------------------------------------------------


@pytest.mark.pure
def test_project_spec_is_a_name_and_plain_arguments():
    spec = Packer("project").spec(Add(2, scale=3).named("add").cached())
    assert spec == NodeSpec(
        label="add",
        cache=True,
        source="project",
        target="packing_nodes:Add",
        args=(2,),
        kwargs={"scale": 3},
        code=code_digest(Add),  # the worker checks that it runs this code
    )
    assert Packer("project").spec(Outer.Inner()).target == "packing_nodes:Outer.Inner"
    assert Packer("project").spec(Add(1)).label == "Add"


@pytest.mark.pure
def test_project_catalog_builds_what_the_client_has():
    spec = Packer("project").spec(Add(2, scale=3).named("add"))
    node = Catalog("project").build(spec)
    assert type(node) is Add
    assert node.forward(1) == Add(2, scale=3).forward(1) == 9
    assert Catalog("project").build(Packer("project").spec(Outer.Inner())).forward(4) == -4


@pytest.mark.pure
def test_project_instances_are_built_once_per_class_and_arguments():
    catalog = Catalog("project")
    a = catalog.build(project("packing_nodes:Add", 2, scale=3))
    assert catalog.build(project("packing_nodes:Add", 2, scale=3, label="other")) is a
    assert catalog.build(project("packing_nodes:Add", 5, scale=3)) is not a
    assert catalog.build(project("packing_nodes:Add", 2)) is not a
    assert Catalog("project").build(project("packing_nodes:Add", 2, scale=3)) is not a


@pytest.mark.pure
def test_a_spec_built_again_is_checked_once_and_its_code_every_time(monkeypatch):
    """A recipe a worker keeps comes back with the same spec objects on every Work that
    names it by digest: its name and arguments are checked and written down once (a memo
    that holds only small arguments, and only so many), its code on every Work."""
    from somatize.packing import catalog as catalog_module

    original_split, original_dumps = catalog_module._split_target, catalog_module.dumps
    catalog = Catalog("project")
    spec = Packer("project").spec(Add(2, scale=3).named("add"))
    split, written = [], []
    monkeypatch.setattr(catalog_module, "_split_target", lambda *a: (split.append(a), original_split(*a))[1])
    monkeypatch.setattr(catalog_module, "dumps", lambda *a: (written.append(a), original_dumps(*a))[1])
    node = catalog.build(spec)
    assert catalog.build(spec) is node and catalog.build(spec) is node and len(catalog._keys) == 1
    assert len(split) == 1 and len(written) == 1, "a spec built again was checked and written down again"
    big = project("packing_nodes:Add", "x" * (catalog_module._MEMO_ARGS + 1))
    catalog.build(big)
    assert len(catalog._keys) == 1, "a spec with big arguments was kept in the memo"
    for n in range(catalog_module._MEMO_SPECS + 5):
        catalog.build(project("packing_nodes:Add", n % 3, label=f"n{n}"))
    assert len(catalog._keys) <= catalog_module._MEMO_SPECS
    # the same name and arguments, another client's code: refused, though its node is built
    changed = dataclasses.replace(spec, code="code:" + "0" * 32)
    with pytest.raises(Refused, match="this worker's code for that class is not the client's"):
        catalog.build(changed)
    with pytest.raises(Refused, match="this worker's code for that class is not the client's"):
        catalog.build(changed)  # and again, now that its key is remembered


@pytest.mark.pure
def test_project_instances_are_built_once_under_concurrency():
    catalog = Catalog("project")
    before = Slow.built
    got = []

    def build():
        got.append(catalog.build(project("packing_nodes:Slow", "t")))

    threads = [threading.Thread(target=build) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert Slow.built == before + 1
    assert len(got) == 8 and all(n is got[0] for n in got)


@pytest.mark.pure
def test_project_refuses_main_and_local_classes_on_the_client():
    class Local(Node):
        def forward(self, x):
            return x

    script = type("Script", (Node,), {"__module__": "__main__", "forward": lambda self, x: x})
    for node, where in ((Local(), "inside a function"), (script(), "__main__")):
        with pytest.raises(PlanError) as err:
            Packer("project").spec(node.named("mine"))
        text = str(err.value)
        assert "`mine`" in text and where in text
        assert 'mode="network"' in text and "importable module" in text


@pytest.mark.pure
def test_project_refuses_a_class_its_name_does_not_lead_back_to():
    ghost = type("Ghost", (Node,), {"__module__": "packing_nodes", "forward": lambda self, x: x})
    with pytest.raises(PlanError, match="does not lead back"):
        Packer("project").spec(ghost())


@pytest.mark.pure
def test_a_node_packed_again_unchanged_gets_the_same_spec_and_a_changed_one_a_new_one(monkeypatch):
    """Packing is done once per node, label and arguments: packed again (a graph made anew
    for every call), the node gets the very same spec, so its recipe's digest is found,
    not computed. A node given other arguments, a cached node whose class's code changed,
    and a class its module no longer holds under its name are packed anew (the last
    refused, as when first packed)."""
    import packing_nodes

    packer = Packer("project")
    node = packing_nodes.Add(5)
    first = packer.spec(node.named("a"))
    assert packer.spec(node.named("a")) is first and packer.spec(node.named("b")) is not first
    other = packing_nodes.Add(6)
    assert packer.spec(other.named("a")).args == (6,)
    cached = packer.spec(node.named("a").cached())
    assert cached is packer.spec(node.named("a").cached()) and cached.code
    # a project-mode spec is the node's name, arguments and code: every client's packer,
    # for every host, finds the one made (a new client reaching a fleet packs nothing again)
    assert Packer("project").spec(node.named("a")) is first
    assert Packer("network").spec(node.named("a")) is not Packer("network").spec(node.named("a"))
    monkeypatch.setattr(packing_nodes, "Add", type("Add", (Node,), {"__module__": "packing_nodes"}))
    with pytest.raises(PlanError, match="does not lead back"):
        packer.spec(node.named("a"))
    with pytest.raises(PlanError, match="does not lead back"):
        Packer("project").spec(node.named("a"))


@pytest.mark.pure
def test_project_refuses_arguments_that_cannot_be_written_down():
    class Model:
        pass

    with pytest.raises(PlanError) as err:
        Packer("project").spec(Add(Model()).named("add"))
    text = str(err.value)
    assert "`add`" in text and "positional argument 0" in text and "`Model`" in text
    assert 'mode="network"' in text
    with pytest.raises(PlanError, match="keyword argument `scale`.*`lock`"):
        Packer("project").spec(Add(1, scale=threading.Lock()))


@pytest.mark.parametrize(
    "target, make_args",
    [
        ("os:system", lambda p: (f"touch {p}",)),
        ("builtins:eval", lambda p: (f"open({str(p)!r}, 'w')",)),
        ("builtins:exec", lambda p: (f"open({str(p)!r}, 'w')",)),
        ("subprocess:Popen", lambda p: (["touch", str(p)],)),
        ("packing_nodes:Touch", lambda p: (str(p),)),
        ("packing_nodes:touch", lambda p: (str(p),)),
        ("pathlib:Path.touch", lambda p: (str(p),)),
    ],
)
@pytest.mark.pure
def test_project_catalog_calls_nothing_that_is_not_a_node(tmp_path, target, make_args):
    sentinel = tmp_path / "sentinel"
    for mode in ("project", "network"):
        with pytest.raises(Refused, match="not a subclass of `somatize.Node`"):
            Catalog(mode).build(project(target, *make_args(sentinel)))
    assert not sentinel.exists()


@pytest.mark.pure
def test_project_catalog_refuses_bad_names_with_a_sentence():
    catalog = Catalog("project")
    with pytest.raises(Refused, match="cannot import `no_such_module_xyz`.*install"):
        catalog.build(project("no_such_module_xyz:Thing"))
    with pytest.raises(Refused, match="has no `Nope`"):
        catalog.build(project("packing_nodes:Nope"))
    for bad in ("packing_nodes.Add", "a:b:c", "os;rm:X", "packing_nodes:Outer.<locals>.X", "", 7):
        with pytest.raises(Refused, match="package.module:Qualname"):
            catalog.build(project(bad))
    with pytest.raises(Refused, match="raised TypeError"):
        catalog.build(project("packing_nodes:Add"))  # missing its argument


@pytest.mark.pure
def test_project_catalog_never_unpickles(tmp_path):
    sentinel = tmp_path / "sentinel"
    evil = pickle.dumps(Evil(sentinel))
    catalog = Catalog("project")
    with pytest.raises(Refused, match="project mode and does not accept code by value"):
        catalog.provision(digest_of(evil), evil)
    with pytest.raises(Refused, match="project mode"):
        catalog.missing([network(digest_of(evil))])
    with pytest.raises(Refused, match="project mode"):
        catalog.build(network(digest_of(evil)))
    assert not sentinel.exists()
    assert catalog.missing([project("packing_nodes:Add", 1)]) == ()


# -- network mode, in one process --------------------------------------------------------


@pytest.mark.pure
def test_network_catalog_refuses_bytes_that_do_not_match_their_digest(tmp_path):
    sentinel = tmp_path / "sentinel"
    evil = pickle.dumps(Evil(sentinel))
    other = digest_of(b"something else")
    catalog = Catalog("network")
    with pytest.raises(Refused, match="hashes to"):
        catalog.provision(other, evil)
    for bad in ("sha256:xyz", "md5:" + "0" * 32, other.upper(), None):
        with pytest.raises(Refused, match="64 lowercase hex"):
            catalog.provision(bad, evil)
    assert not sentinel.exists()
    assert catalog.missing([network(other)]) == (other,)


@pytest.mark.pure
def test_network_catalog_refuses_what_is_not_an_artifact():
    catalog = Catalog("network")
    not_a_node = {"format": ARTIFACT_FORMAT, "node": 3, "codecs": []}
    bad_codecs = {"format": ARTIFACT_FORMAT, "node": Add(1), "codecs": [("k", 3)]}
    for payload, why in (
        ([1, 2], "not a somatize artifact"),
        ({"format": "other"}, "not a somatize artifact"),
        (not_a_node, "carries a `int` where a `somatize.Node` belongs"),
        (bad_codecs, "carries its codecs in a shape"),
    ):
        data = cloudpickle.dumps(payload)
        with pytest.raises(Refused, match=why):
            catalog.provision(digest_of(data), data)
    assert catalog.missing([network(digest_of(cloudpickle.dumps(not_a_node)))])
    with pytest.raises(Refused, match="could not be unpickled"):
        catalog.provision(digest_of(b"not a pickle"), b"not a pickle")


@pytest.mark.pure
def test_network_round_trip_in_one_process():
    packer = Packer("network")
    step = Add(2, scale=3).named("add").cached()
    spec = packer.spec(step)
    assert spec.source == "network" and spec.label == "add" and spec.cache
    assert spec.args == () and spec.kwargs == {}
    assert spec.target.startswith("sha256:") and len(spec.target) == 71
    artifact = packer.artifact(spec.target)
    assert digest_of(artifact) == spec.target

    catalog = Catalog("network")
    assert catalog.missing([spec, spec, project("packing_nodes:Add", 1)]) == (spec.target,)
    with pytest.raises(Refused, match="does not hold"):
        catalog.build(spec)
    catalog.provision(spec.target, memoryview(artifact))
    assert catalog.missing([spec]) == ()
    node = catalog.build(spec)
    assert node is catalog.build(spec)
    assert node.forward(1) == 9
    # a network-mode catalog can import too
    assert catalog.build(project("packing_nodes:Add", 1)).forward(1) == 2


@pytest.mark.pure
def test_network_catalog_holds_a_bounded_number_of_artifacts():
    packer = Packer("network")
    nodes = [Add(i) for i in range(3)]  # the packer keeps an artifact while its node lives
    specs = [packer.spec(n) for n in nodes]
    catalog = Catalog("network", held=2)
    for s in specs:
        catalog.provision(s.target, packer.artifact(s.target))
    assert catalog.missing(specs) == (specs[0].target,)


@pytest.mark.pure
def test_network_catalog_holds_a_bounded_number_of_artifact_bytes():
    packer = Packer("network")
    nodes = [Add(i) for i in range(3)]
    specs = [packer.spec(n) for n in nodes]
    sizes = [len(packer.artifact(s.target)) for s in specs]
    catalog = Catalog("network", held_bytes=sizes[1] + sizes[2])
    for s in specs:
        catalog.provision(s.target, packer.artifact(s.target))
    assert catalog.missing(specs) == (specs[0].target,)
    assert catalog.held_bytes == sizes[1] + sizes[2]
    alone = Catalog("network", held_bytes=1)  # the newest is kept, whatever its size
    alone.provision(specs[0].target, packer.artifact(specs[0].target))
    assert alone.missing(specs[:1]) == ()


@pytest.mark.pure
def test_project_instances_are_bounded_by_the_bytes_of_their_arguments():
    catalog = Catalog("project", built_bytes=5000)
    specs = [project("packing_nodes:Add", str(i) * 2000) for i in range(3)]
    first = catalog.build(specs[0])
    for spec in specs[1:]:
        catalog.build(spec)
    assert catalog.built_bytes <= 5000
    assert catalog.build(specs[0]) is not first  # dropped, so built again
    assert catalog.build(specs[0]) is catalog.build(specs[0])


@pytest.mark.pure
def test_project_refuses_main_modules_on_both_sides():
    script = type("Script", (Node,), {"__module__": "tool.__main__", "forward": lambda self, x: x})
    with pytest.raises(PlanError, match=r"`tool.__main__`"):
        Packer("project").spec(script().named("tool"))
    catalog = Catalog("project")
    for target in ("unittest.__main__:TestProgram", "__main__:Node"):
        with pytest.raises(Refused, match=r"a `__main__` module, which a project-mode worker does not import"):
            catalog.build(project(target, label="main"))
    assert "unittest.__main__" not in sys.modules  # refused before anything was imported


@pytest.mark.pure
def test_what_an_import_or_a_constructor_raises_fails_the_node_not_the_worker(tmp_path, monkeypatch):
    (tmp_path / "quits_at_import.py").write_text("raise SystemExit(2)\n")
    (tmp_path / "quits_when_built.py").write_text(
        textwrap.dedent("""
        from somatize import Node
        class Interrupts(Node):
            def __init__(self):
                raise KeyboardInterrupt("from a constructor")
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    catalog = Catalog("project")
    with pytest.raises(NodeFailed, match=r"SystemExit: 2, while importing `quits_at_import`") as info:
        catalog.build(project("quits_at_import:Anything", label="quits"))
    assert info.value.node == "quits" and info.value.error == "SystemExit"
    with pytest.raises(NodeFailed, match=r"KeyboardInterrupt: from a constructor, while building `built`") as info:
        catalog.build(project("quits_when_built:Interrupts", label="built"))
    assert info.value.node == "built" and info.value.error == "KeyboardInterrupt"
    assert catalog.build(project("packing_nodes:Add", 1)).forward(1) == 2


class Exits:
    """Unpickling one raises SystemExit."""

    def __reduce__(self):
        return (sys.exit, (3,))


@pytest.mark.pure
def test_an_artifact_that_exits_when_unpickled_is_refused():
    payload = cloudpickle.dumps(Exits())
    with pytest.raises(Refused, match=r"could not be unpickled here \(SystemExit: 3\)"):
        Catalog("network").provision(digest_of(payload), payload)


@pytest.mark.pure
def test_a_node_is_pickled_once_and_again_after_a_new_codec():
    packer = Packer("network")
    node = Add(1)
    first = packer.spec(node.named("a")).target
    for _ in range(20):
        assert packer.spec(node.named("a")).target == first
        assert packer.spec(node.named("b").cached()).target == first
    assert packer.pickles == 1
    packer.spec(Add(1))
    assert packer.pickles == 2

    class Extra:
        pass

    codec("tests.packing.Extra", Extra, dump=lambda e: b"", load=lambda b: Extra())
    try:
        second = packer.spec(node).target
        assert packer.pickles == 3
        assert second != first
        with pytest.raises(KeyError):
            packer.artifact(first)
        assert packer.spec(node).target == second and packer.pickles == 3
    finally:
        codec_module.forget("tests.packing.Extra")


@pytest.mark.pure
def test_an_artifact_is_let_go_with_its_node():
    packer = Packer("network")
    node = Add(7)
    digest = packer.spec(node).target
    assert packer.artifact(digest)
    del node
    gc.collect()
    with pytest.raises(KeyError):
        packer.artifact(digest)


@pytest.mark.pure
def test_send_is_undone_even_when_pickling_fails():
    class Holds(Node):
        def __init__(self):
            self.lock = threading.Lock()

    with pytest.raises(PlanError, match="cannot be sent to a network-mode worker"):
        Packer("network", send=[packing_nodes]).spec(Holds().named("holds"))
    assert "packing_nodes" not in cloudpickle.list_registry_pickle_by_value()
    Packer("network", send=["packing_nodes"]).spec(Add(1))
    assert "packing_nodes" not in cloudpickle.list_registry_pickle_by_value()


# -- network mode, across processes ------------------------------------------------------

MAKE = """
    import dataclasses, json, sys
    from pathlib import Path
    from somatize import Node, codec
    from somatize.packing import Packer

    @dataclasses.dataclass
    class Reading:
        value: float
        unit: str

    codec(
        "tests.Reading",
        Reading,
        dump=lambda r: json.dumps(dataclasses.asdict(r)).encode(),
        load=lambda raw: Reading(**json.loads(raw)),
    )

    class Scale(Node):
        def __init__(self, k):
            self.k = k
        def forward(self, xs):
            return [x * self.k for x in xs]

    class Measure(Node):
        def __init__(self, unit):
            self.unit = unit
        def forward(self, xs):
            return Reading(float(sum(xs)), self.unit)

    out = Path(sys.argv[1])
    packer = Packer("network")
    manifest = {}
    for name, node in (("scale", Scale(3)), ("measure", Measure("cm"))):
        spec = packer.spec(node.named(name))
        (out / spec.target[7:]).write_bytes(packer.artifact(spec.target))
        manifest[name] = spec.target
    (out / "manifest.json").write_text(json.dumps(manifest))
"""

USE = """
    import importlib.util, json, sys
    from pathlib import Path
    from somatize.codec import codecs_registered, dumps, loads
    from somatize.packing import Catalog
    from somatize.wire import NodeSpec

    assert importlib.util.find_spec("make") is None, "this process must not see the first one"
    assert "tests.Reading" not in codecs_registered()
    where = Path(sys.argv[1])
    manifest = json.loads((where / "manifest.json").read_text())
    catalog = Catalog("network")
    specs = {
        n: NodeSpec(label=n, cache=False, source="network", target=d) for n, d in manifest.items()
    }
    assert catalog.missing(specs.values()) == tuple(manifest.values())
    for spec in specs.values():
        catalog.provision(spec.target, (where / spec.target[7:]).read_bytes())
    assert catalog.missing(specs.values()) == ()
    scaled = catalog.build(specs["scale"]).forward([1, 2, 3])
    reading = catalog.build(specs["measure"]).forward(scaled)
    back = loads(dumps(reading))
    print(json.dumps({
        "scaled": scaled,
        "class": type(reading).__name__,
        "value": back.value,
        "unit": back.unit,
        "same_type": type(back) is type(reading),
        "kinds": codecs_registered(),
    }))
"""


def test_a_main_class_and_its_codec_travel_to_a_process_that_cannot_import_them(tmp_path):
    ok(run_script(tmp_path / "client", "make.py", MAKE, str(tmp_path)))
    got = json.loads(ok(run_script(tmp_path / "worker", "use.py", USE, str(tmp_path))))
    assert got["scaled"] == [3, 6, 9]
    assert got["class"] == "Reading" and got["value"] == 18.0 and got["unit"] == "cm"
    assert got["same_type"] and "tests.Reading" in got["kinds"]


SHIPPED = """
    from somatize import Node

    def triple(x):
        return 3 * x

    class Triple(Node):
        def forward(self, x):
            return triple(x) + 1
"""

MAKE_SENT = """
    import json, sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parent / "lib"))
    import cloudpickle
    import shipped_nodes_for_packing as shipped
    from somatize.packing import Packer

    out = Path(sys.argv[1])
    manifest = {}
    for name, packer in (
        ("sent", Packer("network", send=[shipped])),
        ("named", Packer("network", send=["shipped_nodes_for_packing"])),
        ("by_reference", Packer("network")),
    ):
        node = shipped.Triple()  # a packer keeps an artifact while its node lives
        spec = packer.spec(node.named(name))
        (out / spec.target[7:]).write_bytes(packer.artifact(spec.target))
        manifest[name] = spec.target
    assert not cloudpickle.list_registry_pickle_by_value()
    (out / "manifest.json").write_text(json.dumps(manifest))
"""

USE_SENT = """
    import importlib.util, json, sys
    from pathlib import Path
    from somatize.errors import Refused
    from somatize.packing import Catalog
    from somatize.wire import NodeSpec

    assert importlib.util.find_spec("shipped_nodes_for_packing") is None
    where = Path(sys.argv[1])
    manifest = json.loads((where / "manifest.json").read_text())
    got = {}
    for name, digest in manifest.items():
        catalog = Catalog("network")
        try:
            catalog.provision(digest, (where / digest[7:]).read_bytes())
        except Refused as exc:
            got[name] = "refused: " + str(exc)
            continue
        spec = NodeSpec(label=name, cache=False, source="network", target=digest)
        got[name] = catalog.build(spec).forward(4)
    print(json.dumps(got))
"""


def test_send_makes_a_module_travel_by_value(tmp_path):
    lib = tmp_path / "client" / "lib"
    lib.mkdir(parents=True)
    (lib / "shipped_nodes_for_packing.py").write_text(textwrap.dedent(SHIPPED))
    ok(run_script(tmp_path / "client", "make_sent.py", MAKE_SENT, str(tmp_path)))
    got = json.loads(ok(run_script(tmp_path / "worker", "use_sent.py", USE_SENT, str(tmp_path))))
    assert got["sent"] == 13 and got["named"] == 13
    refused = got["by_reference"]
    assert refused.startswith("refused: ")
    assert "`shipped_nodes_for_packing`" in refused and "send=[...]" in refused


MAKE_FORMAT = """
    import dataclasses, json, sys
    from pathlib import Path
    from somatize import Node, codec
    from somatize.packing import Packer

    SCALE = float(sys.argv[2])  # the format: the value is written times SCALE

    @dataclasses.dataclass
    class Reading:
        value: float

    codec("tests.Reading", Reading, dump=lambda r: json.dumps(r.value * SCALE).encode(),
          load=lambda raw: Reading(json.loads(raw) / SCALE))

    class Measure(Node):
        def forward(self, xs):
            return Reading(float(sum(xs)))

    out = Path(sys.argv[1])
    out.mkdir()
    packer = Packer("network")
    node = Measure().named("measure")
    spec = packer.spec(node)
    (out / "artifact").write_bytes(packer.artifact(spec.target))
    (out / "digest").write_text(spec.target)
"""

USE_FORMAT = """
    import json, sys
    from pathlib import Path
    from somatize.codec import codecs_registered
    from somatize.errors import Refused
    from somatize.packing import Catalog

    catalog = Catalog("network")
    got = {}
    for where in map(Path, sys.argv[1:]):
        try:
            catalog.provision((where / "digest").read_text(), (where / "artifact").read_bytes())
            got[where.name] = "held"
        except Refused as exc:
            got[where.name] = "refused: " + str(exc)
    got["kinds"] = codecs_registered()
    print(json.dumps(got))
"""


def test_a_network_worker_refuses_a_kind_it_already_reads_in_another_format(tmp_path):
    """Three clients, three processes, one kind: two register it the same way (their bytes
    differ: each pickles its own ``__main__`` class), the third writes it in another format.
    A worker reads one format per kind while it runs, so it holds the first two and refuses
    the third with the kind and the way out, rather than read its values the first way."""
    for name, scale in (("first", "1"), ("same", "1"), ("other", "4")):
        ok(run_script(tmp_path / f"client_{name}", "make.py", MAKE_FORMAT, str(tmp_path / name), scale))
    first, same = ((tmp_path / n / "artifact").read_bytes() for n in ("first", "same"))
    assert first != same  # two processes' pickles of one codec: the format decides, not the bytes
    got = json.loads(
        ok(
            run_script(
                tmp_path / "worker", "use.py", USE_FORMAT, *(str(tmp_path / n) for n in ("first", "same", "other"))
            )
        )
    )
    assert got["first"] == "held" and got["same"] == "held"
    assert got["other"].startswith("refused: ")
    assert "`tests.Reading`" in got["other"] and "another format" in got["other"]
    assert "new kind" in got["other"] and "restart the worker" in got["other"]
    assert got["kinds"] == ["tests.Reading"]


def _format(codec_parts) -> str:
    """What a worker writes down for a codec ``(type, dump, load)`` that arrived pickled."""
    from somatize.packing.formats import format_of

    blob = cloudpickle.dumps(codec_parts)
    return format_of(blob, *pickle.loads(blob))


@pytest.mark.pure
def test_a_codec_holding_an_object_with_a_c_base_is_judged_by_its_bytes():
    """A ``dict`` subclass keeps its items where no attribute shows them: two codecs whose
    tables differ must not be written down alike (their bytes decide, and they differ)."""

    class Table(dict):
        pass

    def made(scale: float):
        table = Table(scale=scale)
        table.name = "scales"  # an attribute too: what it shows is the same in both
        return (float, lambda v: repr(v * table["scale"]).encode(), lambda b: float(b) / table["scale"])

    assert _format(made(1.0)) != _format(made(4.0))
    assert _format(made(1.0)) == _format(made(1.0))  # one process's pickles: the same bytes


SCALE_FOR_FORMAT = 2.0


@pytest.mark.pure
def test_a_codec_is_written_down_by_the_globals_it_reads_not_by_attribute_names():
    """``r.SCALE_FOR_FORMAT`` is an attribute, not the module's global of that name: changing
    the global does not change the codec that only reads the attribute; changing a global
    the codec does read does."""
    global SCALE_FOR_FORMAT

    class Holder:
        SCALE_FOR_FORMAT = 3.0

    by_attribute = (float, lambda v: repr(v * Holder.SCALE_FOR_FORMAT).encode(), lambda b: float(b))
    by_global = (float, lambda v: repr(v * SCALE_FOR_FORMAT).encode(), lambda b: float(b))
    before = _format(by_attribute), _format(by_global)
    try:
        SCALE_FOR_FORMAT = 5.0
        after = _format(by_attribute), _format(by_global)
    finally:
        SCALE_FOR_FORMAT = 2.0
    assert before[0] == after[0]
    assert before[1] != after[1]


@pytest.mark.pure
def test_a_subclass_of_a_plain_type_is_not_written_as_its_plain_value():
    """A ``str`` subclass may answer its methods otherwise: two codecs holding the same text
    in two classes of one name whose ``upper`` differs are not the same codec."""

    def shouting(mark: str):
        class Shouting(str):
            def upper(self):
                return mark + str.upper(self)

        return Shouting

    def made(sep):
        return (float, lambda v: (repr(v) + sep.upper()).encode(), lambda b: float(b.decode().rstrip("X!?")))

    assert _format(made(shouting("!")("x"))) != _format(made(shouting("?")("x")))


# -- a codec's format, as many clients write it: one format per kind on a network worker -------
#
# Each client process registers one kind per variant (register, pack a fresh node, forget),
# so each artifact carries exactly one codec. Process "a" and process "c" write the same
# format (the same source, run twice: another client, a cell run again); process "b" writes
# another one. A worker process provisions a, then b (must be refused: its values would be
# read the first way), then c (must be held: the same format).


MAKE_VARIANTS = r"""
import dataclasses, functools, json, marshal, pickle, struct, sys
from pathlib import Path
from somatize import Node, codec
from somatize.codec import forget
from somatize.packing import Packer

OUT, WHICH = Path(sys.argv[1]), sys.argv[2]
S = 1.0 if WHICH in ("a", "c") else 4.0        # the format: values written times S

@dataclasses.dataclass
class Reading:
    value: float

class Measure(Node):
    def forward(self, x):
        return Reading(float(x))

# -- the variants: (dump, load, type) ---------------------------------------------------------
def closure_value():
    s = S
    return (lambda r: json.dumps(r.value * s).encode(), lambda raw: Reading(json.loads(raw) / s), Reading)

def default_value():
    return (lambda r, s=S: json.dumps(r.value * s).encode(), lambda raw, s=S: Reading(json.loads(raw) / s), Reading)

SCALE = S
def plain_global():
    return (lambda r: json.dumps(r.value * SCALE).encode(), lambda raw: Reading(json.loads(raw) / SCALE), Reading)

if S == 1.0:
    def helper(v): return v
    def unhelper(v): return v
else:
    def helper(v): return v * 4.0
    def unhelper(v): return v / 4.0
def global_function():
    # a helper function the codec calls, edited between the two clients (a cell run again)
    return (lambda r: json.dumps(helper(r.value)).encode(), lambda raw: Reading(unhelper(json.loads(raw))), Reading)

FACTOR = S
def global_in_nested_code():
    # FACTOR is read by a nested function's code, not by dump's own
    return (lambda r: json.dumps((lambda: r.value * FACTOR)()).encode(),
            lambda raw: Reading((lambda v: v / FACTOR)(json.loads(raw))), Reading)

CONF = {"scale": S}
def global_dict():
    return (lambda r: json.dumps(r.value * CONF["scale"]).encode(),
            lambda raw: Reading(json.loads(raw) / CONF["scale"]), Reading)

enc = marshal if S == 1.0 else pickle
def global_module():
    return (lambda r: enc.dumps(r.value), lambda raw: Reading(enc.loads(raw)), Reading)

def closure_function_with_closure():
    s = S
    def times(v): return v * s
    def over(v): return v / s
    return (lambda r: json.dumps(times(r.value)).encode(), lambda raw: Reading(over(json.loads(raw))), Reading)

def _dump(r, scale): return json.dumps(r.value * scale).encode()
def _load(raw, scale): return Reading(json.loads(raw) / scale)
def partial_args():
    return (functools.partial(_dump, scale=S), functools.partial(_load, scale=S), Reading)

class Dumper:
    def __init__(self, scale): self.scale = scale
    def __call__(self, r): return json.dumps(r.value * self.scale).encode()
class Loader:
    def __init__(self, scale): self.scale = scale
    def __call__(self, raw): return Reading(json.loads(raw) / self.scale)
def callable_instance():
    return (Dumper(S), Loader(S), Reading)

class Scaler:
    def __init__(self, scale): self.scale = scale
    def dump(self, r): return json.dumps(r.value * self.scale).encode()
    def load(self, raw): return Reading(json.loads(raw) / self.scale)
def bound_method_state():
    scaler = Scaler(S)
    return (scaler.dump, scaler.load, Reading)

if S == 1.0:
    @dataclasses.dataclass
    class Gauge:
        value: float
        def encoded(self): return json.dumps(self.value).encode()
        @classmethod
        def decoded(cls, raw): return cls(json.loads(raw))
else:
    @dataclasses.dataclass
    class Gauge:
        value: float
        def encoded(self): return json.dumps(self.value * 4.0).encode()
        @classmethod
        def decoded(cls, raw): return cls(json.loads(raw) / 4.0)
def type_method():
    # the codec calls the type's own methods, whose code differs
    return (lambda g: g.encoded(), lambda raw: Gauge.decoded(raw), Gauge)

def struct_format():
    # a format string with "<" (little-endian): same codec in a and c
    return (lambda r: struct.pack("<d", r.value * S), lambda raw: Reading(struct.unpack("<d", raw)[0] / S), Reading)

VARIANTS = [closure_value, default_value, plain_global, global_function, global_in_nested_code,
            global_dict, global_module, closure_function_with_closure, partial_args,
            callable_instance, bound_method_state, type_method, struct_format]

written = {}
for make in VARIANTS:
    name = make.__name__
    dump, load, type_ = make()
    kind = f"atk.{name}"
    codec(kind, type_, dump=dump, load=load)
    try:
        packer = Packer("network")
        node = Measure().named("m")
        spec = packer.spec(node)
        folder = OUT / name
        folder.mkdir(parents=True)
        (folder / "artifact").write_bytes(packer.artifact(spec.target))
        (folder / "digest").write_text(spec.target)
        written[name] = dump(type_(2.5)).hex()
    finally:
        forget(kind)
(OUT / "written.json").write_text(json.dumps(written))
"""


USE_VARIANTS = r"""
import json, sys
from pathlib import Path
from somatize.errors import Refused
from somatize.packing import Catalog

root = Path(sys.argv[1])
catalog = Catalog("network")
names = json.loads((root / "a" / "written.json").read_text())
got = {}
for name in names:
    for which in ("a", "b", "c"):
        folder = root / which / name
        try:
            catalog.provision((folder / "digest").read_text(), (folder / "artifact").read_bytes())
            got[f"{name}/{which}"] = "held"
        except Refused as exc:
            got[f"{name}/{which}"] = "refused: " + str(exc)
# what b's client wrote for Reading(2.5), read with the codec this worker now holds
from somatize.codec.registered import for_kind
theirs = json.loads((root / "b" / "written.json").read_text())
for name in names:
    try:
        got[f"{name}/read_b"] = repr(getattr(for_kind(f"atk.{name}").load(bytes.fromhex(theirs[name])), "value", None))
    except Exception as exc:
        got[f"{name}/read_b"] = type(exc).__name__
print(json.dumps(got))
"""


def _script(folder: Path, name: str, code: str, *args: str) -> str:
    """What ``run_script`` printed, once it exited 0."""
    proc = run_script(folder, name, code, *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="module")
def formats(tmp_path_factory):
    """What a worker said to each variant's three artifacts, and what each client wrote."""
    root = tmp_path_factory.mktemp("formats")
    threads = [
        threading.Thread(target=_script, args=(root / f"client_{w}", "make.py", MAKE_VARIANTS, str(root / w), w))
        for w in "abc"
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    for w in "abc":
        assert (root / w / "written.json").exists(), f"client {w} wrote nothing"
    said = json.loads(_script(root / "worker", "use.py", USE_VARIANTS, str(root)))
    written = {w: json.loads((root / w / "written.json").read_text()) for w in "abc"}
    written["root"] = str(root)
    return said, written


def _formats_root(formats) -> Path:
    return Path(formats[1]["root"])


VARIANTS = [
    "closure_value",
    "default_value",
    "plain_global",
    "global_function",
    "global_in_nested_code",
    "global_dict",
    "global_module",
    "closure_function_with_closure",
    "partial_args",
    "callable_instance",
    "bound_method_state",
    "type_method",
    "struct_format",
]


DIFFERENT = VARIANTS


@pytest.mark.parametrize("variant", DIFFERENT)
def test_a_codec_writing_other_bytes_for_a_kind_is_refused(formats, variant):
    """Client b's codec writes other bytes than client a's for the same value: a worker that
    holds a's must refuse b's artifact, naming the kind and the way out."""
    said, written = formats
    assert written["a"][variant] != written["b"][variant], "the attack's two formats must differ"
    assert said[f"{variant}/a"] == "held", said[f"{variant}/a"]
    got = said[f"{variant}/b"]
    assert got.startswith("refused: "), (
        f"{variant}: b's format was held; b's Reading(2.5) reads here as {said[f'{variant}/read_b']}"
    )
    assert f"`atk.{variant}`" in got and "another format" in got and "restart the worker" in got


SAME = VARIANTS


@pytest.mark.parametrize("variant", SAME)
def test_the_same_codec_from_another_process_is_held(formats, variant):
    said, written = formats
    assert written["a"][variant] == written["c"][variant]
    assert said[f"{variant}/a"] == "held", said[f"{variant}/a"]
    assert said[f"{variant}/c"] == "held", f"{variant}: the same codec was refused: {said[f'{variant}/c']}"


EDGES = r"""
import json, sys, threading
from pathlib import Path
import cloudpickle
from somatize import codec
from somatize.codec.registered import for_kind
from somatize.errors import Refused
from somatize.packing import ARTIFACT_FORMAT, Catalog, digest_of

root, case = Path(sys.argv[1]), sys.argv[2]
kind = "atk.closure_value"

def artifact(which):
    folder = root / which / "closure_value"
    return (folder / "digest").read_text(), (folder / "artifact").read_bytes()

def attempt(catalog, which):
    try:
        catalog.provision(*artifact(which))
        return "held"
    except Refused as exc:
        return "refused: " + str(exc)

catalog = Catalog("network")
got = {}
if case == "own":
    # the worker's own installation registered the kind in a third format: both are refused
    own_dump = lambda r: b"own"
    codec(kind, float, dump=own_dump, load=lambda raw: 0.0)
    got["a"], got["b"] = attempt(catalog, "a"), attempt(catalog, "b")
    got["own_kept"] = for_kind(kind).dump is own_dump
elif case == "race":
    # two artifacts of one kind in two formats provisioned at once, from two threads
    start = threading.Barrier(2)
    def run(which):
        start.wait(10)
        got[which] = attempt(catalog, which)
    threads = [threading.Thread(target=run, args=(w,)) for w in "ab"]
    for t in threads: t.start()
    for t in threads: t.join(30)
    a_load = for_kind(kind).load
    got["reads_as"] = a_load(b"10.0").value   # a divides by 1, b by 4
elif case == "unloadable":
    # an earlier artifact's codec for the kind cannot be loaded here: skipped, not remembered
    node = cloudpickle.loads(artifact("a")[1])["node"]
    bad = cloudpickle.dumps({"format": ARTIFACT_FORMAT, "node": node, "codecs": [(kind, b"not a pickle")]})
    got["bad"] = "held" if catalog.provision(digest_of(bad), bad) is None else "?"
    got["registered_after_bad"] = kind in __import__("somatize.codec", fromlist=["x"]).codecs_registered()
    got["b"], got["a"] = attempt(catalog, "b"), attempt(catalog, "a")
print(json.dumps(got))
"""


def test_the_workers_own_codec_refuses_both_carried_formats_and_stays(formats, tmp_path):
    """The worker's own code registered the kind in a format neither client writes: each
    client's values would be read the worker's way, so both are refused, naming the kind and
    who registered the format the worker reads (issue 38: once this was taken in silence)."""
    root = _formats_root(formats)
    got = json.loads(_script(tmp_path, "edge.py", EDGES, str(root), "own"))
    for which in "ab":
        assert got[which].startswith("refused: "), got
        assert "`atk.closure_value`" in got[which] and "this worker's own code" in got[which], got
    assert got["own_kept"] is True


def test_two_formats_provisioned_at_once_from_two_threads_one_is_refused(formats, tmp_path):
    root = _formats_root(formats)
    for _ in range(3):
        got = json.loads(_script(tmp_path, "edge.py", EDGES, str(root), "race"))
        states = sorted(v.split(":")[0] for k, v in got.items() if k in "ab")
        assert states == ["held", "refused"], got
        winner = "a" if got["a"] == "held" else "b"
        assert got["reads_as"] == (10.0 if winner == "a" else 2.5), got


def test_a_codec_that_cannot_be_loaded_is_skipped_and_the_next_format_sets_the_kind(formats, tmp_path):
    root = _formats_root(formats)
    got = json.loads(_script(tmp_path, "edge.py", EDGES, str(root), "unloadable"))
    assert got["bad"] == "held" and got["registered_after_bad"] is False, got
    assert got["b"] == "held", got
    assert got["a"].startswith("refused: ") and "another format" in got["a"], got
