"""Tensors as a built-in frame kind: the "X" node, no copy on the way out, at most one on the
way in, views when asked for, every dtype through every path (encode/decode, the written
form, the wire), malformed nodes refused before anything is allocated, and what stores hold
from before (SMZT bytes under "torch.Tensor") still read."""

from __future__ import annotations

import contextlib
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from conftest import BROKER, WORKER, env_with_tests  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from reliability_support import wait_until  # noqa: E402

import somatize  # noqa: E402
import somatize.torch as smt  # noqa: E402
from somatize import Broker, FolderStore, Node, Opaque, Unreadable, Unwritable, Worker, codec  # noqa: E402
from somatize.codec import build, check, decode, dumps, encode, forget, kinds_in, loads, readable_kinds  # noqa: E402
from somatize.codec.tensors import ITEMSIZE  # noqa: E402
from somatize.wire import Done, NodeSpec, Recipe, Work  # noqa: E402
from somatize.wire import decode as wire_decode  # noqa: E402
from somatize.wire import encode as wire_encode  # noqa: E402

HERE_ROOT = str(Path(somatize.__file__).resolve().parents[1])
HERE = sys.modules[__name__]


class Echo(Node):
    def forward(self, x):
        return x


class Describe(Node):
    """What the worker received: each tensor's type, dtype, shape, device, and whether it
    is a leaf that needs no grad."""

    def forward(self, xs):
        return [
            (type(x).__name__, str(x.dtype), list(x.shape), x.device.type, x.is_leaf and not x.requires_grad)
            for x in xs
        ]


def same(a, b) -> bool:
    """Exactly equal: same dtype, shape, and the very same bytes (NaN payloads included)."""
    if type(a) is not torch.Tensor or a.dtype != b.dtype or a.shape != b.shape:
        return False

    def flat(t):
        fresh = torch.empty(t.shape, dtype=t.dtype)  # C order, conj resolved, on the CPU
        return fresh.copy_(t.detach()).reshape(-1).view(torch.uint8)

    return torch.equal(flat(a), flat(b))


def address(buffer) -> int:
    return np.frombuffer(buffer, np.uint8).__array_interface__["data"][0]


def read_only(frames):
    return [bytes(f) for f in frames]  # as a ZeroMQ frame or a file read gives them


def writable(frames):
    return [bytearray(f) for f in frames]  # as a private mapping gives them


def leaf_on_cpu(t) -> bool:
    return type(t) is torch.Tensor and t.device.type == "cpu" and t.is_leaf and not t.requires_grad


NAMES = [name for name in ITEMSIZE if isinstance(getattr(torch, name, None), torch.dtype)]


def random_tensor(dtype, shape, seed=0):
    """Any bit pattern of ``dtype`` (bools 0 / 1), so NaN payloads and float8 cross too."""
    gen = np.random.default_rng(seed)
    count = int(np.prod(shape)) if shape else 1
    if not count:
        return torch.empty(shape, dtype=dtype)
    raw = gen.integers(0, 256, count * dtype.itemsize, dtype=np.uint8)
    if dtype is torch.bool:
        raw &= 1
    return torch.from_numpy(raw).view(dtype).reshape(shape)


def shapes_of(dtype):
    base = random_tensor(dtype, (6, 8), seed=1)
    return {
        "0-d": random_tensor(dtype, ()),
        "empty": random_tensor(dtype, (0, 3)),
        "contiguous": random_tensor(dtype, (3, 5)),
        "transposed": base.t(),
        "strided": base[::2, 1::3],
        "view of a larger one": base[2:4],  # contiguous, at an offset into its storage
        "expanded": random_tensor(dtype, (1, 4)).expand(3, 4),
    }


CASES = [(name, kind) for name in NAMES for kind in shapes_of(torch.float32)]


def through_frames(v, frames=lambda f: f, **options):
    descriptor, out = encode(v)
    return decode(descriptor, frames(out), **options)


def through_the_wire(v, frames=lambda f: f):
    """``v`` as a Work's input and a Done's output and produced value, and back."""
    spec = NodeSpec("echo", False, "project", "tests:Echo")
    work = wire_decode(frames(wire_encode(Work(ref=1, recipe=Recipe((spec,), ("step", 0)), input=v))))
    done = wire_decode(frames(wire_encode(Done(1, v, {0: v}, 5))))
    return work.input, done.output, done.produced[0]


# -- every dtype through every path --------------------------------------------------------


@pytest.mark.parametrize("name, kind", CASES, ids=[f"{n}-{k}" for n, k in CASES])
@pytest.mark.pure
def test_every_dtype_and_layout_round_trips_exactly_through_every_path(name, kind):
    t = shapes_of(getattr(torch, name))[kind]
    backs = [
        through_frames(t),
        through_frames(t, read_only),
        through_frames(t, writable),
        through_frames(t, read_only, views=True),
        loads(dumps(t)),
        loads(bytearray(dumps(t))),
        *through_the_wire(t, read_only),
        *through_the_wire(t, writable),
    ]
    for back in backs:
        assert same(back, t) and leaf_on_cpu(back), name
    assert encode(t)[0][:3] == ["X", name, list(t.shape)]


@contextlib.contextmanager
def through(path: str, processes, tmp_path):
    """A broker whose host `w1` is reached by ``path``: Direct, Mount on /dev/shm (answers
    copied out, or handed over as views), or Relayed through a standalone broker."""
    if path == "relayed":
        hub = processes([*BROKER, "--listen", "tcp://127.0.0.1:0", "--announce"])
        processes(
            [*WORKER, "--broker", hub.endpoint, "--offer", "w1", "--mode", "network"],
            env=env_with_tests(),
            announce=None,
        )
        with Broker.at(hub.endpoint, send={"w1": [HERE]}) as broker:
            wait_until(lambda: broker.knows("w1"), 30, "the dialing worker reaching the broker")
            yield broker
        return
    options: dict = {"mount": False}
    if path in ("mount", "views"):
        if not os.path.isdir("/dev/shm"):
            pytest.skip("needs /dev/shm")
        options["mount"] = tempfile.mkdtemp(prefix="somatize-test-", dir="/dev/shm")
        options["views"] = path == "views"
    try:
        with Broker.embedded({"w1": Worker.spawn(WORKER, mode="network", send=[HERE], **options)}) as broker:
            yield broker
    finally:
        if options["mount"]:
            shutil.rmtree(options["mount"])


@pytest.mark.parametrize("path", ["direct", "mount", "views", "relayed"])
def test_every_dtype_and_layout_crosses_every_path_and_back_exactly(path, processes, tmp_path):
    sent = [t for name in NAMES for t in shapes_of(getattr(torch, name)).values()]
    sent.append(torch.randn(4, requires_grad=True) * 2)
    with through(path, processes, tmp_path) as broker:
        back = Echo().named("echo").at("w1").forward(sent, broker=broker)
        seen = Describe().named("describe").at("w1").forward(sent, broker=broker)
        assert len(back) == len(sent)
        for b, t in zip(back, sent, strict=False):
            assert same(b, t) and leaf_on_cpu(b), t.dtype
        del back
    assert seen == [("Tensor", str(t.dtype), list(t.shape), "cpu", True) for t in sent]


@pytest.mark.pure
def test_complex_conjugates_and_negative_views_are_resolved_on_the_way_out():
    z = torch.randn(5, dtype=torch.complex128)
    for v in (z.conj(), torch.randn(4, dtype=torch.complex64).conj().t(), z._neg_view()):
        assert same(loads(dumps(v)), v.resolve_conj().resolve_neg())
        assert same(through_frames(v, read_only), v.resolve_conj().resolve_neg())


@pytest.mark.pure
def test_a_tensor_that_required_grad_comes_back_a_leaf_without_its_graph():
    w = torch.randn(3, requires_grad=True)
    for v in (w, w * 2, torch.nn.Parameter(torch.ones(2)), (w * 3)[1:]):
        for back in (through_frames(v), through_frames(v, read_only), loads(dumps(v)), *through_the_wire(v)):
            assert leaf_on_cpu(back) and back.grad_fn is None
            assert torch.equal(back, v.detach())


@pytest.mark.pure
def test_tensors_inside_containers_and_beside_arrays():
    value = {"x": [torch.ones(2, dtype=torch.bfloat16), np.arange(3)], "y": (torch.tensor(True),)}
    back = loads(dumps(value))
    assert same(back["x"][0], value["x"][0]) and np.array_equal(back["x"][1], value["x"][1])
    assert same(back["y"][0], value["y"][0])
    assert kinds_in(encode(value)[0]) == {"plain", "numpy.ndarray", "torch.Tensor"}


@st.composite
def tensors(draw):
    dtype = getattr(torch, draw(st.sampled_from(NAMES)))
    shape = draw(st.lists(st.integers(0, 5), min_size=0, max_size=4))
    t = random_tensor(dtype, shape, seed=draw(st.integers(0, 2**16)))
    if t.dim() >= 2 and draw(st.booleans()):
        t = t.transpose(0, -1)
    if t.dim() >= 1 and t.shape[0] > 1 and draw(st.booleans()):
        t = t[::2]
    return t


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tensors(), st.sampled_from(["as is", "read-only", "writable", "read-only views"]))
@pytest.mark.pure
def test_any_tensor_round_trips_exactly(t, how):
    frames = {"as is": lambda f: f, "read-only": read_only, "writable": writable, "read-only views": read_only}[how]
    back = through_frames(t, frames, views=how.endswith("views"))
    assert same(back, t) and leaf_on_cpu(back)


# -- copies ----------------------------------------------------------------------------------


@pytest.mark.pure
def test_a_contiguous_cpu_tensor_goes_out_as_a_view_of_its_own_memory():
    big = torch.randn(64, 1024)
    for t in (big, big[10:20], big[5], torch.randn(300, dtype=torch.bfloat16), torch.tensor(2.5)):
        descriptor, frames = encode(t)
        (frame,) = frames
        assert address(frame) == t.data_ptr() and len(frame) == t.numel() * t.element_size()
        header, *rest = wire_encode(Done(1, t, {}, 0))
        assert address(rest[0]) == t.data_ptr()
        t.view(-1)[0] = 7  # the frame is that memory: what is sent is what the tensor holds then
        assert (
            np.frombuffer(frame, np.uint8)[: t.element_size()].tobytes()
            == t.view(-1)[:1].view(torch.uint8).numpy().tobytes()
        )


@pytest.mark.pure
def test_a_tensor_that_is_not_contiguous_is_copied_once():
    t = torch.randn(8, 6).t()
    (frame,) = encode(t)[1]
    assert not np.shares_memory(np.frombuffer(frame, np.uint8), t.numpy())
    assert len(frame) == t.numel() * 4


@pytest.mark.pure
def test_a_writable_frame_is_used_in_place_and_a_read_only_one_copied_once():
    t = torch.arange(1000, dtype=torch.float64)
    descriptor, frames = encode(t)
    mine = bytearray(frames[0])
    back = decode(descriptor, [mine])
    assert back.data_ptr() == address(mine)  # no copy
    back[0] = -1.0
    assert np.frombuffer(mine, np.float64)[0] == -1.0  # it is that memory
    sent = bytes(frames[0])
    copied = decode(descriptor, [sent])
    assert copied.data_ptr() != address(sent)  # one copy, writable as any tensor
    copied[0] = 5.0
    assert np.frombuffer(sent, np.float64)[0] == 0.0


@pytest.mark.pure
def test_a_frame_whose_elements_are_not_aligned_is_copied_rather_than_viewed():
    t = torch.arange(4, dtype=torch.float64)
    descriptor, frames = encode(t)
    room = bytearray(len(frames[0]) + 1)
    room[1:] = bytes(frames[0])
    odd = memoryview(room)[1:]  # writable, one byte past an 8-byte boundary (or worse)
    for options in ({}, {"views": True}):
        back = decode(descriptor, [odd], **options)
        assert torch.equal(back, t) and back.data_ptr() % 8 == 0
        assert back.data_ptr() != address(odd)


@pytest.mark.pure
def test_views_of_read_only_frames_when_asked_for():
    t = torch.arange(256, dtype=torch.int32)
    a = np.arange(256, dtype=np.int32)
    descriptor, frames = encode([t, a])
    sent = [bytes(f) for f in frames]
    tensor, array = decode(descriptor, sent, views=True)
    assert tensor.data_ptr() == address(sent[0])  # a view: not to be written to
    assert np.shares_memory(array, np.frombuffer(sent[1], np.uint8)) and not array.flags.writeable
    assert torch.equal(tensor, t) and np.array_equal(array, a) and leaf_on_cpu(tensor)
    default_tensor, default_array = decode(descriptor, sent)  # unchanged by default: copies
    assert default_tensor.data_ptr() != address(sent[0]) and default_array.flags.writeable
    checked = check(descriptor, sent)
    assert build(checked, views=True)[0].data_ptr() == address(sent[0])
    written = dumps([t, a])
    viewed = loads(written, views=True)
    assert np.shares_memory(viewed[1], np.frombuffer(written, np.uint8))


@pytest.mark.pure
def test_a_view_keeps_its_frame_alive_after_everything_else_lets_go():
    descriptor, frames = encode(torch.arange(100_000, dtype=torch.int64))
    sent = [bytes(f) for f in frames]
    view = decode(descriptor, sent, views=True)[10:]  # a view of the view
    del sent, frames
    import gc

    gc.collect()
    assert view[0].item() == 10 and view[-1].item() == 99_999


# -- malformed nodes ---------------------------------------------------------------------------


MALFORMED = {
    "huge shape": (["X", "float32", [2**40, 2**40], 0], [bytes(8)]),
    "overflowing shape": (["X", "float32", [0, 2**62, 2**62], 0], [b""]),
    "shape too big for its frame": (["X", "float32", [2**31], 0], [bytes(16)]),
    "frame too short": (["X", "float32", [4], 0], [bytes(12)]),
    "frame too long": (["X", "float32", [4], 0], [bytes(20)]),
    "unknown dtype": (["X", "object", [1], 0], [bytes(8)]),
    "quantized dtype": (["X", "qint8", [1], 0], [bytes(1)]),
    "numpy spelling": (["X", "<f4", [1], 0], [bytes(4)]),
    "dtype not a str": (["X", 4, [1], 0], [bytes(4)]),
    "bool byte 2": (["X", "bool", [3], 0], [b"\x01\x02\x00"]),
    "too many dimensions": (["X", "int8", [1] * 33, 0], [bytes(1)]),
    "negative size": (["X", "int8", [-1], 0], [bytes(1)]),
    "size that is a bool": (["X", "int8", [True], 0], [bytes(1)]),
    "size that is a float": (["X", "int8", [1.0], 0], [bytes(1)]),
    "shape not a list": (["X", "int8", 1, 0], [bytes(1)]),
    "missing frame": (["X", "int8", [1], 1], [bytes(1)]),
    "frame index not an int": (["X", "int8", [1], "0"], [bytes(1)]),
    "too few items": (["X", "int8", [1]], [bytes(1)]),
    "too many items": (["X", "int8", [1], 0, 0], [bytes(1)]),
    "one frame twice": (["L", ["X", "int8", [1], 0], ["X", "int8", [1], 0]], [bytes(1)]),
}


@pytest.mark.parametrize("descriptor, frames", MALFORMED.values(), ids=MALFORMED.keys())
@pytest.mark.pure
def test_malformed_tensor_nodes_are_refused_before_anything_is_allocated(descriptor, frames, monkeypatch):
    def no(*args, **kwargs):
        raise AssertionError("allocated before the node was checked")

    for name in ("empty", "frombuffer", "from_numpy", "zeros"):
        monkeypatch.setattr(torch, name, no)
    start = time.perf_counter()
    with pytest.raises(Unreadable):
        decode(descriptor, frames)
    with pytest.raises(Unreadable):
        decode(descriptor, [bytearray(f) for f in frames], views=True)
    with pytest.raises(Unreadable):  # and as a store would hand it over
        loads(written(descriptor, frames))
    assert time.perf_counter() - start < 0.5


def test_checking_a_tensor_node_imports_nothing_and_reading_one_without_torch_says_what_to_install(tmp_path):
    (tmp_path / "written").write_bytes(dumps({"t": torch.ones(3, dtype=torch.bfloat16)}))
    script = textwrap.dedent(
        """
        import sys
        from somatize.codec import check, kinds_in, loads, readable_kinds
        from somatize.errors import Unreadable

        checked = check(["X", "float32", [2], 0], [bytes(8)])
        assert kinds_in(["X", "bfloat16", [3], 0]) == {"torch.Tensor"} == set(checked.kinds)
        assert "torch" not in sys.modules, "checking imported torch"
        sys.modules["torch"] = None  # as if it were not installed
        assert "torch.Tensor" not in readable_kinds()
        try:
            loads(open("written", "rb").read())
        except Unreadable as exc:
            print(exc)
        """
    )
    env = dict(os.environ, PYTHONPATH=HERE_ROOT)
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "torch is not installed here" in done.stdout and "pip install somatize[torch]" in done.stdout


@pytest.mark.pure
def test_a_peer_says_it_reads_tensors_when_torch_is_there():
    assert "torch.Tensor" in readable_kinds()


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch's: complex32 is experimental
@pytest.mark.pure
def test_what_is_not_dense_is_refused_with_the_fix():
    for t, says in (
        (torch.randn(3).to_sparse(), "`t.to_dense()`"),
        (torch.empty(3, device="meta"), "`meta` device"),
        (torch.zeros(2, dtype=torch.complex32), "dtype `torch.complex32`"),
    ):
        with pytest.raises(Unwritable, match="write") as info:
            encode(t)
        assert says in str(info.value)


# -- the registry and the store's older form --------------------------------------------------


def written(descriptor, frames) -> bytes:
    """The written form by hand (SMZ1, header, frames on 16-byte boundaries)."""
    header = msgpack.packb([descriptor, [len(f) for f in frames]], use_bin_type=True)
    out = b"SMZ1" + struct.pack("<I", len(header)) + header
    for f in frames:
        out += bytes(-len(out) % 16) + bytes(f)
    return out


@pytest.mark.pure
def test_a_tensor_kept_in_a_store_before_tensors_were_built_in_still_reads(tmp_path):
    store = FolderStore(tmp_path / "store")
    old = {"bf16": torch.randn(4, 3, dtype=torch.bfloat16), "strided": torch.randn(6, 5)[::2].t()}
    store.put(
        "cache/old",
        {"type": "dict"},
        written(
            ["D", "bf16", ["C", "torch.Tensor", 0], "strided", ["C", "torch.Tensor", 1]],
            [smt.dump_tensor(old["bf16"]), smt.dump_tensor(old["strided"])],
        ),
    )
    back = loads(store.fetch("cache/old"))
    assert same(back["bf16"], old["bf16"]) and same(back["strided"], old["strided"])
    assert leaf_on_cpu(back["bf16"])


@pytest.mark.pure
def test_an_opaque_tensor_crosses_through_the_registered_codec():
    t = torch.randn(3, 2)
    descriptor, frames = encode(Opaque(t))
    assert descriptor == ["O", "torch.Tensor", 0] and bytes(frames[0][:4]) == b"SMZT"
    assert same(decode(descriptor, frames).value, t)


class Scaled(torch.Tensor):
    """A tensor subclass of a project's own, with a codec of its own."""


@pytest.mark.pure
def test_a_codec_registered_for_a_tensor_subclass_comes_before_the_built_in_kind():
    name = "tests.tensor_frames.Scaled"
    codec(name, Scaled, dump=lambda t: b"scaled", load=lambda raw: raw.decode())
    try:
        value = torch.ones(2).as_subclass(Scaled)
        assert encode(value)[0] == ["C", name, 0]
        assert decode(*encode(value)) == "scaled"
        plain_subclass = torch.nn.Parameter(torch.ones(2))  # nobody registered it: a plain tensor
        assert encode(plain_subclass)[0][0] == "X" and type(loads(dumps(plain_subclass))) is torch.Tensor
    finally:
        forget(name)
