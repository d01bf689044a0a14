"""A name in a shared store held by something a store never writes (issue 39, item 1).

A colleague in the store's group (`nobody`, with ``setpriv``) puts, where an entry belongs,
each of: a folder, a link to a file, to a folder, to nothing, a FIFO, a socket, a sparse file
of a TiB; or a file where a folder belongs. The name is *blocked*: every read of this user's
treats it as missing and says so in one line, once; a write refuses it with ``Blocked`` (a
``StoreError``) or replaces what is no entry; nothing follows a link, hangs, or leaks a
descriptor (counted in /proc/self/fd). A cached forward whose entry is blocked computes, and
says so once, however often it runs: a folder planted over a cache entry used to leak one
descriptor per recall until ``open()`` failed with EMFILE.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
from computing_nodes import Counted
from shared_names_support import KINDS, descriptors, open_to_others, plant, plant_args

from somatize import FolderStore, folders
from somatize.errors import Missing, StoreError
from somatize.folders import Blocked

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def shared():
    """A store folder others may enter and, where `open_to_others` says, write in."""
    base = Path(tempfile.mkdtemp(prefix="somatize-names-"))
    base.chmod(0o755)
    yield base / "store"
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def elsewhere(tmp_path):
    """What a planted link points at: a secret entry only this user may read."""
    secret = FolderStore(tmp_path / "elsewhere")
    secret.put("secret", {"v": "theirs"}, b"secret")
    return secret


@pytest.mark.parametrize("kind", KINDS)
def test_a_name_held_by_anything_else_reads_as_missing_and_leaks_nothing(
    shared, elsewhere, python_for_nobody, kind, capfd
):
    store = FolderStore(shared)
    store.put("run/a/0", {"v": "0"}, b"blob")
    open_to_others(store.path, store.path / "run", store.path / "run" / "a")
    plant(python_for_nobody, plant_args(kind, store.path / "run" / "a" / "1.rec", elsewhere.path))
    folders.forget_told()
    before = descriptors()
    for _ in range(30):  # a training loop's reads, or a page read again and again
        for read in (store.record, store.fetch, store.stamp, store.entry):
            with pytest.raises(Missing):
                read("run/a/1")
        assert "run/a/1" not in store
        assert list(store.scan("run/")) == [("run/a/0", {"v": "0"})]
        # names() reads listings alone (no entry opened): a regular file is listed, whatever its length
        assert store.names("run/") == ["run/a/0"] + (["run/a/1"] if kind == "sparse" else [])
    assert descriptors() == before
    said = capfd.readouterr().err.splitlines()
    assert len(said) == 1 and f"{store.path}/run/a/1.rec" in said[0], said  # one line, naming it, once

    with pytest.raises(Blocked, match="run/a/1.rec"):  # nobody can create a name held by something else
        store.create("run/a/1", {"v": "mine"})
    if kind == "folder":
        with pytest.raises(Blocked, match="run/a/1.rec is a folder"):
            store.put("run/a/1", {"v": "mine"})
    else:  # what is no entry is replaced whole, never followed
        store.put("run/a/1", {"v": "mine"})
        assert store.record("run/a/1") == {"v": "mine"}
    store.delete("run/a/1")  # a folder is left as it is; a file or a link goes, never what it names
    assert descriptors() == before
    assert elsewhere.entry("secret") == ({"v": "theirs"}, b"secret")
    assert store.entry("run/a/0") == ({"v": "0"}, b"blob")


@pytest.mark.parametrize("kind", ["file", "fifo", "socket", "link-folder"])
def test_a_name_held_where_a_folder_belongs_blocks_what_is_below_it(shared, elsewhere, python_for_nobody, kind, capfd):
    """A file (or anything else) at `run/b`, where the folder of `run/b/0` belongs: reads say
    missing, a write says ``Blocked`` (it said "Not a directory" in a ``StoreError`` before,
    which a study took for a broken store)."""
    store = FolderStore(shared)
    store.put("run/a/0", {"v": "0"})
    open_to_others(store.path, store.path / "run")
    args = (
        ["file", str(store.path / "run" / "b"), b"not a folder".hex()]
        if kind == "file"
        else plant_args(kind, store.path / "run" / "b", elsewhere.path)
    )
    plant(python_for_nobody, args)
    folders.forget_told()
    before = descriptors()
    for _ in range(10):
        with pytest.raises(Missing):
            store.record("run/b/0")
        assert list(store.scan("run/b/")) == [] and list(store.scan("run/")) == [("run/a/0", {"v": "0"})]
        for write in (store.put, store.create):
            with pytest.raises(Blocked, match="run/b is "):
                write("run/b/0", {"v": "mine"})
    assert descriptors() == before
    assert isinstance(Blocked("x", "y"), StoreError)  # callers that caught StoreError still do
    assert elsewhere.entry("secret") == ({"v": "theirs"}, b"secret")


def test_a_folder_planted_over_a_cache_entry_leaks_no_descriptor_per_recall(shared, python_for_nobody, tmp_path, capfd):
    """Attack: `mkdir` over a cache entry's file. Every recall leaked one descriptor (5 -> 255,
    then EMFILE, and a training loop died). Now the entry is blocked: the node runs every
    forward (nothing can be kept there), one line says so once, and no descriptor is left."""
    tally = tmp_path / "tally"
    graph = Counted(str(tally), 0.0).named("embed").frozen().cached()
    facts: list = []
    graph.forward(10, store=FolderStore(tmp_path / "probe"), watching=facts.append)
    key = next(f["key"] for f in facts if f["fact"] == "kept")
    store = FolderStore(shared)
    open_to_others(store.path, store.path / "cache")
    plant(python_for_nobody, ["folder", str(store.path / "cache" / f"{key}.rec")])
    folders.forget_told()
    capfd.readouterr()
    before = descriptors()
    for _ in range(40):
        assert graph.forward(10, store=store) == 20
    assert descriptors() == before
    said = capfd.readouterr().err.splitlines()
    assert said and all(key in line for line in said), said
    assert len(said) <= 2, said  # the read says it once, the keep says it once: not once a forward
    assert len(tally.read_text().splitlines()) == 41  # the probe's run, and one a forward


def test_open_regular_closes_what_it_opened_whatever_it_meets(shared, elsewhere, python_for_nobody):
    """The primitive itself: for each kind, `open_regular` raises ``Blocked`` and leaves no
    descriptor; a regular file longer than the bound is blocked by its length alone."""
    store = FolderStore(shared)
    open_to_others(store.path)
    plant(python_for_nobody, *[plant_args(kind, store.path / kind, elsewhere.path) for kind in KINDS])
    before = descriptors()
    with folders.Descent(store.path) as descent:
        root = descent.at([])
        for kind in KINDS:
            with pytest.raises(Blocked) as raised:
                folders.open_regular(root, kind, kind, limit=1 << 30)
            assert raised.value.where == kind
            assert folders.read_at(store.path, [], kind, 1 << 30) is None
        assert folders.held_by(root, "sparse") == "a file" and folders.held_by(root, "nothing") is None
    assert descriptors() == before


def test_a_folder_full_of_planted_names_says_a_burst_of_lines_not_one_each(shared, elsewhere, python_for_nobody, capfd):
    """Each blocked name is said once, and all of them together at most `_BURST` lines at
    once: a writer who plants a thousand links does not flood the runner's log."""
    store = FolderStore(shared)
    store.put("run/0", {"v": "0"})
    open_to_others(store.path, store.path / "run")
    plant(
        python_for_nobody,
        *[plant_args("link-file", store.path / "run" / f"{n}.rec", elsewhere.path) for n in range(1, 200)],
    )
    folders.forget_told()
    capfd.readouterr()
    for _ in range(3):
        assert list(store.scan("run/")) == [("run/0", {"v": "0"})]
    said = capfd.readouterr().err.splitlines()
    assert 1 <= len(said) <= 20 + 3, len(said)  # a burst (folders._BURST), and the refill of a second or so
    assert len(set(said)) == len(said)  # never the same name twice
