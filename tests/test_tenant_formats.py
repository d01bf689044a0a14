"""Formats that belong to their tenant (issue 38): on a worker two tenants share, nothing one
tenant sends may change how the other's bytes of a kind are read.

The play: one worker process, two tenants, each a client process of its own. Tenant A has a
package installed (on the worker too) whose import registers the kind `tenant.Reading` as
``[hz, gain]``; tenant B's notebook registers its own codec for the same kind, written
``[gain, hz]``, which travels with B's node. Each sends ``Reading(hz=50, gain=2)`` to a node
that answers its ``hz``. Before this was mended, B's answer came back 2.0 without a word, in
both orders: the worker read B's bytes with A's codec (A first: the kind counted as "the
worker's own"; B first: unpickling A's node imported the package, which replaced B's codec
before anything was judged). Now each tenant gets 50.0 or a ``Refused`` naming the kind,
never another tenant's reading of its bytes; a refused artifact leaves the worker's registry
as it was, so the tenant that came first keeps its answers.

Real processes throughout: a ``python -m somatize.worker`` (network mode, and project mode
for the same clash between two installed packages), and each tenant's client run as a
script of its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import WORKER

import somatize

SOMATIZE_ROOT = str(Path(somatize.__file__).resolve().parents[1])
KIND = "tenant.Reading"

# Tenant A's installed package: its import registers the kind, written [hz, gain].
PACKAGE_A = """
import json
from dataclasses import dataclass

from somatize import Node, codec


@dataclass
class Reading:
    hz: float
    gain: float


codec("tenant.Reading", Reading, dump=lambda r: json.dumps([r.hz, r.gain]).encode(),
      load=lambda raw: Reading(*json.loads(raw)))


class Rate(Node):
    def forward(self, r):
        return float(r.hz)


class Ping(Node):
    def forward(self, x):
        return x
"""

# Another installed package, for the project-mode play: the same kind written [gain, hz].
PACKAGE_C = """
import json
from dataclasses import dataclass

from somatize import Node, codec


@dataclass
class Reading:
    hz: float
    gain: float


codec("tenant.Reading", Reading, dump=lambda r: json.dumps([r.gain, r.hz]).encode(),
      load=lambda raw: Reading(*reversed(json.loads(raw))))


class Rate(Node):
    def forward(self, r):
        return float(r.hz)


class Ping(Node):
    def forward(self, x):
        return x
"""

# A tenant's client: one call, its answer (or its error) as one line of JSON.
CLIENT = """
import json, sys
from dataclasses import dataclass

from somatize import Broker, Node, SomatizeError, Worker, codec

which, endpoint, mode, ping = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "ping"
if which == "a":
    from tenant_a_pkg import Ping, Rate, Reading
elif which == "c":
    from tenant_c_pkg import Ping, Rate, Reading
elif which == "e":  # tenant E's notebook: a node that imports A's package as it runs
    class Lazy(Node):
        def forward(self, x):
            import tenant_a_pkg  # noqa: F401 - registers the kind, in A's format
            return x

    Ping = Lazy
else:  # tenant B's notebook: its own Reading, its own codec for the kind, written [gain, hz]
    @dataclass
    class Reading:
        hz: float
        gain: float

    codec("tenant.Reading", Reading, dump=lambda r: json.dumps([r.gain, r.hz]).encode(),
          load=lambda raw: Reading(*reversed(json.loads(raw))))

    class Rate(Node):
        def forward(self, r):
            return float(r.hz)

with Broker.embedded({"w1": Worker.at(endpoint, mode=mode)}, patience=10.0) as broker:
    try:
        if ping:  # plain data only: a project-mode worker imports the package for it
            got = {"value": Ping().named("ping").at("w1").forward(1.0, broker=broker)}
        else:
            got = {"value": Rate().named("rate").at("w1").forward(Reading(hz=50.0, gain=2.0), broker=broker)}
    except SomatizeError as exc:
        got = {"error": type(exc).__name__, "message": str(exc)}
print(json.dumps(got))
"""


@pytest.fixture
def installed(tmp_path):
    """A folder holding tenant A's package (and another), put on a process's path as its
    installation."""
    site = tmp_path / "site"
    for name, text in (("tenant_a_pkg", PACKAGE_A), ("tenant_c_pkg", PACKAGE_C)):
        (site / name).mkdir(parents=True)
        (site / name / "__init__.py").write_text(textwrap.dedent(text))
    return site


def _env(*paths: Path | str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join([*map(str, paths), SOMATIZE_ROOT])
    return env


def _call(
    tmp_path: Path, which: str, endpoint: str, installed: Path, mode: str = "network", ping: bool = False
) -> dict:
    """Tenant ``which`` calls its node on the worker once, from a process of its own (with
    ``ping``, its package's node of plain data)."""
    folder = tmp_path / f"tenant_{which}"
    folder.mkdir(exist_ok=True)
    script = folder / "notebook.py"
    script.write_text(textwrap.dedent(CLIENT))
    paths = [installed] if which in ("a", "c") else []  # B's notebook has no package installed
    proc = subprocess.run(
        [sys.executable, str(script), which, endpoint, mode, "ping" if ping else "reading"],
        cwd=folder,
        env=_env(*paths),
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _worker(processes, installed: Path, mode: str):
    return processes([*WORKER, "--listen", "127.0.0.1:0", "--announce", "--mode", mode], env=_env(installed))


def _right_or_refused(got: dict, who: str) -> None:
    """The one promise: a tenant's own reading of its bytes, or a refusal naming the kind."""
    if "value" in got:
        assert got["value"] == 50.0, f"tenant {who}'s Reading(hz=50, gain=2) was read in another tenant's format: {got}"
    else:
        assert got["error"] == "Refused" and f"`{KIND}`" in got["message"], got
        assert "another format" in got["message"] and "new kind" in got["message"], got


def test_a_tenants_codec_never_reads_another_tenants_bytes_a_first(tmp_path, processes, installed):
    """A (the installed package) first, then B (its notebook's codec): B is refused naming
    the kind, or reads its own value; A keeps its answers after."""
    worker = _worker(processes, installed, "network")
    first = _call(tmp_path, "a", worker.endpoint, installed)
    assert first == {"value": 50.0}, first
    second = _call(tmp_path, "b", worker.endpoint, installed)
    _right_or_refused(second, "B")
    again = _call(tmp_path, "a", worker.endpoint, installed)
    assert again == {"value": 50.0}, again
    assert worker.alive


def test_a_tenants_codec_never_reads_another_tenants_bytes_b_first(tmp_path, processes, installed):
    """B first, then A, whose node's unpickling imports the package that registers the kind:
    A is refused naming it, or reads its own; the refusal leaves the registry as it was, so
    B's next call is still read B's way, and A's next still never B's."""
    worker = _worker(processes, installed, "network")
    first = _call(tmp_path, "b", worker.endpoint, installed)
    assert first == {"value": 50.0}, first
    second = _call(tmp_path, "a", worker.endpoint, installed)
    _right_or_refused(second, "A")
    again = _call(tmp_path, "b", worker.endpoint, installed)
    assert again == {"value": 50.0}, f"after A's artifact was opened, B's bytes read otherwise: {again}"
    _right_or_refused(_call(tmp_path, "a", worker.endpoint, installed), "A")
    assert worker.alive


def test_two_installed_packages_never_read_each_others_bytes(tmp_path, processes, installed):
    """The same clash with no codec carried by value: tenants A and C both have a package
    installed (on the worker too) that registers the kind at import, in two formats. A
    first; then C, whose node's unpickling imports its package, which registers the kind
    again, written [gain, hz]. C is refused naming the kind (that registration never
    reaches a reader), and A's bytes are still read A's way."""
    worker = _worker(processes, installed, "network")
    assert _call(tmp_path, "a", worker.endpoint, installed) == {"value": 50.0}
    _right_or_refused(_call(tmp_path, "c", worker.endpoint, installed), "C")
    again = _call(tmp_path, "a", worker.endpoint, installed)
    assert again == {"value": 50.0}, f"after C's package was imported, A's bytes read otherwise: {again}"
    _right_or_refused(_call(tmp_path, "c", worker.endpoint, installed), "C")
    assert worker.alive


def test_a_node_importing_a_package_as_it_runs_never_changes_another_tenants_format(tmp_path, processes, installed):
    """B's codec first; then tenant E's node imports A's package as it runs (a lazy import
    in ``forward``), which registers the kind in A's format. E's node fails naming the kind;
    B's bytes are still read B's way."""
    worker = _worker(processes, installed, "network")
    assert _call(tmp_path, "b", worker.endpoint, installed) == {"value": 50.0}
    lazy = _call(tmp_path, "e", worker.endpoint, installed, ping=True)
    if "value" not in lazy:
        assert f"`{KIND}`" in lazy["message"] and "another format" in lazy["message"], lazy
    again = _call(tmp_path, "b", worker.endpoint, installed)
    assert again == {"value": 50.0}, f"after E's node imported a package, B's bytes read otherwise: {again}"
    assert worker.alive


# -- a refused artifact changes nothing the worker reads --------------------------------------

# Tenant D's installed package: its import registers a new kind first, then the shared one
# in A's format; its node is what D sends.
PACKAGE_D = """
import json, os
from dataclasses import dataclass

from somatize import Node, codec

with open(os.environ["TENANT_D_LOG"], "a") as log:  # each time it is imported
    log.write("imported\\n")


@dataclass
class Extra:
    n: int


codec("tenant.Extra", Extra, dump=lambda e: str(e.n).encode(), load=lambda raw: Extra(int(raw)))


@dataclass
class Reading:
    hz: float
    gain: float


codec("tenant.Reading", Reading, dump=lambda r: json.dumps([r.hz, r.gain]).encode(),
      load=lambda raw: Reading(*json.loads(raw)))


class Rate(Node):
    def forward(self, r):
        return float(r.hz)
"""

# A client writing its node's artifact to a folder, as a network-mode worker would get it.
PACK = """
import json, sys
from dataclasses import dataclass
from pathlib import Path

from somatize import Node, codec
from somatize.packing import Packer

which, out = sys.argv[1], Path(sys.argv[2])
if which == "d":
    from tenant_d_pkg import Rate
else:  # B's notebook, as in the calls above; "b2": a third format, and a second kind
    @dataclass
    class Reading:
        hz: float
        gain: float

    if which == "b":
        codec("tenant.Reading", Reading, dump=lambda r: json.dumps([r.gain, r.hz]).encode(),
              load=lambda raw: Reading(*reversed(json.loads(raw))))
    else:
        codec("tenant.Reading", Reading, dump=lambda r: json.dumps({"hz": r.hz, "gain": r.gain}).encode(),
              load=lambda raw: Reading(**json.loads(raw)))
        @dataclass
        class Other:
            n: int

        codec("tenant.AOther", Other, dump=lambda o: str(o.n).encode(), load=lambda raw: Other(int(raw)))

    class Rate(Node):
        def forward(self, r):
            return float(r.hz)

packer = Packer("network")
node = Rate().named("rate")
spec = packer.spec(node)
out.mkdir(parents=True)
(out / "artifact").write_bytes(packer.artifact(spec.target))
(out / "digest").write_text(spec.target)
"""

# The worker's side, a Catalog as `python -m somatize.worker --mode network` holds one.
OPEN = """
import json, sys
from pathlib import Path

from somatize.codec import codecs_registered, registry
from somatize.codec.registered import for_kind
from somatize.errors import Refused
from somatize.packing import Catalog

catalog = Catalog("network")
got = {}

def provision(folder):
    folder = Path(folder)
    try:
        catalog.provision((folder / "digest").read_text(), (folder / "artifact").read_bytes())
        return "held"
    except Refused as exc:
        return "refused: " + str(exc)

got["first"] = provision(sys.argv[1])
before = registry()
got["kinds_before"] = codecs_registered()
for name, folder in zip(("second", "second_again", "third"), sys.argv[2:]):
    got[name] = provision(folder)
    got[name + "_kinds"] = codecs_registered()
    got[name + "_same_registry"] = all(x is y for a, b in zip(before, registry()) for x, y in zip(a, b)) and len(before) == len(registry())
got["package_left_imported"] = "tenant_d_pkg" in sys.modules
got["reads_b"] = for_kind("tenant.Reading").load(b"[2.0, 50.0]").hz  # B's bytes of Reading(hz=50, gain=2)
print(json.dumps(got))
"""


def test_a_refused_artifact_leaves_the_registry_as_it_was(tmp_path, installed):
    """B's codec first; then D's node, whose unpickling imports a package that registers a
    new kind and then the shared kind in another format; then an artifact carrying a new
    kind beside the shared one in a third format. Both later artifacts are refused naming
    the shared kind, and the registry is exactly as B's artifact left it: no kind gained,
    the same codec objects, B's bytes read B's way, D's package not left half imported; D's
    artifact sent again is refused without being unpickled again."""
    (installed / "tenant_d_pkg").mkdir()
    (installed / "tenant_d_pkg" / "__init__.py").write_text(textwrap.dedent(PACKAGE_D))
    for which, paths in (("b", ()), ("d", (installed,)), ("b2", ())):
        folder = tmp_path / f"client_{which}"
        folder.mkdir()
        (folder / "pack.py").write_text(textwrap.dedent(PACK))
        env = {**_env(*paths), "TENANT_D_LOG": str(tmp_path / "imports_of_d_by_its_client.txt")}
        proc = subprocess.run(
            [sys.executable, str(folder / "pack.py"), which, str(tmp_path / which)],
            cwd=folder,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
    worker = tmp_path / "worker"
    worker.mkdir()
    (worker / "open.py").write_text(textwrap.dedent(OPEN))
    log = tmp_path / "imports_of_d.txt"
    env = {**_env(installed), "TENANT_D_LOG": str(log)}
    proc = subprocess.run(
        [sys.executable, str(worker / "open.py"), *(str(tmp_path / w) for w in ("b", "d", "d", "b2"))],
        cwd=worker,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout)
    assert got["first"] == "held", got
    assert got["kinds_before"] == [KIND], got
    assert got["second"].startswith("refused: ") and f"`{KIND}`" in got["second"], got
    assert got["second_kinds"] == [KIND] and got["second_same_registry"], got
    assert not got["package_left_imported"], got
    # sent again while the worker reads the kind the same way: refused the same, unopened
    assert got["second_again"] == got["second"] and got["second_again_same_registry"], got
    assert log.read_text().splitlines() == ["imported"], "the refused artifact was opened again"
    assert got["third"].startswith("refused: ") and f"`{KIND}`" in got["third"], got
    assert got["third_kinds"] == [KIND] and got["third_same_registry"], got
    assert got["reads_b"] == 50.0, got


def test_putting_the_registry_back_restores_kinds_and_types_as_they_were():
    """What a refusal uses to undo an opening: a kind registered since is forgotten, one
    replaced is as it was, and a type another kind took since is written with its old kind
    again; kinds nobody touched are left alone."""
    from somatize.codec import codec, forget, registered

    class T:
        pass

    class U:
        pass

    kinds = ("tests.tenant.k0", "tests.tenant.k1", "tests.tenant.k2", "tests.tenant.k3")
    try:
        codec(kinds[0], T, dump=lambda t: b"0", load=lambda raw: T())
        codec(kinds[3], U, dump=lambda u: b"3", load=lambda raw: U())
        before = registered.registered_now()
        k0, k3 = registered.for_kind(kinds[0]), registered.for_kind(kinds[3])
        codec(kinds[1], T, dump=lambda t: b"1", load=lambda raw: T())  # T is now written as k1
        codec(kinds[2], U, dump=lambda u: b"2", load=lambda raw: U())
        codec(kinds[0], T, dump=lambda t: b"again", load=lambda raw: T())  # k0 replaced
        assert registered.for_type(T).kind == kinds[0] and registered.for_type(T) is not k0
        put = registered._put_back(before)
        assert put == (kinds[0], kinds[1], kinds[2])
        assert registered.for_kind(kinds[0]) is k0 and registered.for_type(T) is k0
        assert registered.for_kind(kinds[3]) is k3 and registered.for_type(U) is k3
        assert kinds[1] not in registered.codecs_registered() and kinds[2] not in registered.codecs_registered()
        assert registered._put_back(registered.registered_now()) == ()
    finally:
        for kind in kinds:
            forget(kind)
