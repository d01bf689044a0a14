"""somatize.torch: the tensor codec, `.on(device)`, the Trainer and its vocabulary, the
progress view, and the example that sells it (a frozen, cached embedding on a spawned
worker and a head trained here)."""

from __future__ import annotations

import collections
import io
import re
import struct
import subprocess
import sys
import textwrap
import threading

import pytest

torch = pytest.importorskip("torch")

import numpy as np  # noqa: E402
from conftest import WORKER  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import somatize.torch as smt  # noqa: E402
from somatize import (  # noqa: E402
    Broker,
    FolderStore,
    Node,
    PlanError,
    Unreadable,
    Unsettled,
    Unwritable,
    Worker,
    codecs_registered,
)
from somatize.codec import decode, dumps, loads, written_parts  # noqa: E402
from somatize.torch import Trainer, progress  # noqa: E402

HERE = sys.modules[__name__]


# -- nodes (sent to network-mode workers by value, with send=[HERE]) ------------------------


class Echo(Node):
    def forward(self, x):
        return x


class Double(Node):
    def forward(self, x):
        return x * 2


class Weighted(Node, torch.nn.Module):
    """Its output requires grad wherever it runs."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.full((3,), 2.0))

    def forward(self, x):
        return x * self.w


class Where(Node):
    """Says where and what its input is, for `.on(device)`."""

    def forward(self, x):
        return describe(x)


def describe(v):
    if isinstance(v, torch.Tensor):
        return (v.device.type, str(v.dtype), tuple(v.shape))
    if isinstance(v, dict):
        return {k: describe(w) for k, w in v.items()}
    if isinstance(v, (list, tuple)):
        return (type(v).__name__, [describe(w) for w in v])
    return v


class Embed(Node, torch.nn.Module):
    """A frozen embedding with fixed random weights: token ids -> their mean embedding."""

    def __init__(self, vocab: int, dim: int, seed: int) -> None:
        super().__init__()
        self.table = torch.nn.Embedding(vocab, dim)
        with torch.no_grad():
            self.table.weight.copy_(torch.randn(vocab, dim, generator=torch.Generator().manual_seed(seed)))

    def forward(self, tokens):
        return self.table(tokens).mean(dim=1)


class Head(Node, torch.nn.Module):
    """What trains: a linear layer. Remembers what it was handed."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(dim, 1)
        self.seen: list[tuple[bool, bool, str]] = []

    def forward(self, x):
        self.seen.append((x.is_leaf, x.requires_grad, threading.current_thread().name))
        return self.linear(x).squeeze(-1)


class Counted(Node, torch.nn.Module):
    """Trainable, and counts its calls where a test can see them."""

    calls: list[int] = []

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(2, 1)

    def forward(self, x):
        Counted.calls.append(1)
        return self.linear(x).squeeze(-1)


class Scaled(Node):
    """Holds a parameter as an attribute without being a module."""

    def __init__(self) -> None:
        self.w = torch.nn.Parameter(torch.ones(()))

    def forward(self, x):
        return x * self.w


class Other(Node):
    def forward(self, x):
        return x.sum(dim=-1)


class Pick(Node):
    def forward(self, both):
        return both[0] + 0.0 * both[1]


def token_data(n=256, length=12, vocab=16, seed=0, batch=32):
    """Batches of token ids, and as target the share of ids below vocab // 2."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (n, length), generator=gen)
    target = (tokens < vocab // 2).float().mean(dim=1)
    return [(tokens[i : i + batch], target[i : i + batch]) for i in range(0, n, batch)]


def mse(out, y):
    return torch.nn.functional.mse_loss(out, y)


class Collect(list):
    def __call__(self, fact):
        self.append(fact)

    def of(self, kind):
        return [f for f in self if f["fact"] == kind]


@pytest.fixture(scope="module")
def worker():
    """One spawned network-mode worker for the tests that cross a process."""
    with Broker.embedded({"w1": Worker.spawn(WORKER, mode="network", send=[HERE])}) as broker:
        yield broker


def same(a, b) -> bool:
    """Exactly equal: same dtype, shape, and the very same bytes (NaN payloads included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False

    def flat(t):
        fresh = torch.empty(t.shape, dtype=t.dtype)  # C-order strides, whatever t has
        return fresh.copy_(t.detach()).reshape(-1).view(torch.uint8)

    return torch.equal(flat(a), flat(b))


# -- the codec ---------------------------------------------------------------------------


def test_importing_registers_the_tensor_codec():
    assert "torch.Tensor" in codecs_registered()
    assert smt.torch is torch  # `import torch` in somatize/torch.py is the real one


def test_the_seed_examples_run_as_written(tmp_path):
    script = textwrap.dedent(
        """
        import json
        from dataclasses import dataclass, asdict

        from somatize import codec

        @dataclass
        class Reading:
            hz: float
            samples: list[float]

        codec(
            "myproject.Reading",
            Reading,
            dump=lambda one: json.dumps(asdict(one)).encode(),
            load=lambda raw: Reading(**json.loads(raw)),
        )

        from somatize import codecs_registered
        from somatize.codec import dumps, loads

        assert codecs_registered() == ["myproject.Reading"]
        assert loads(dumps(Reading(50.0, [0.1]))) == Reading(50.0, [0.1])

        import somatize.torch
        import torch

        assert codecs_registered() == ["myproject.Reading", "torch.Tensor"]
        t = torch.ones(3, requires_grad=True) * 2
        back = loads(dumps(t))
        assert back.is_leaf and not back.requires_grad and back.grad_fn is None
        print("ok")
        """
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


DENSE = [
    torch.tensor(3.5, dtype=torch.bfloat16),  # 0-d
    torch.empty(0, 3),  # empty
    torch.empty(2, 0, 5, dtype=torch.int16),
    torch.randn(5, 7).t(),  # transposed
    torch.arange(60, dtype=torch.int64).reshape(3, 4, 5)[:, ::2, 1::2],  # strided
    torch.randn(6, 4, dtype=torch.bfloat16)[::2].t(),
    torch.tensor([True, False, True]),
    torch.randn(4, dtype=torch.complex64).conj(),  # the conj bit is resolved
    torch.randn(3, 3, dtype=torch.float64).expand(2, 3, 3),  # stride 0
    torch.tensor([float("nan"), float("inf"), -0.0], dtype=torch.float16),
    torch.tensor([2**64 - 1, 0], dtype=torch.uint64),
]


@pytest.mark.parametrize("t", DENSE, ids=lambda t: f"{t.dtype}{tuple(t.shape)}")
def test_dense_tensors_round_trip_exactly(t):
    back = loads(dumps(t))
    assert same(back, t.resolve_conj())
    assert back.is_contiguous() and back.device.type == "cpu"
    assert back.is_leaf and not back.requires_grad


def test_bfloat16_and_a_non_contiguous_tensor_round_trip_through_a_store(tmp_path):
    store = FolderStore(tmp_path / "store")
    value = {"bf16": torch.randn(8, 3, dtype=torch.bfloat16), "strided": torch.randn(10, 6)[::3, 1:].t()}
    store.put("cache/one", {"what": "tensors"}, written_parts(value))
    back = loads(store.fetch("cache/one"))
    assert same(back["bf16"], value["bf16"]) and same(back["strided"], value["strided"])


def test_the_dump_copies_the_data_once_into_what_it_returns():
    t = torch.randn(1000)
    raw = smt.dump_tensor(t)
    assert isinstance(raw, memoryview) and raw.nbytes == 32 + 4000  # header of 32, then the data
    t[0] = 123.0
    assert smt.load_tensor(raw)[0] != 123.0  # a copy, not a view of the tensor


def test_the_written_form_is_the_documented_one():
    raw = bytes(smt.dump_tensor(torch.arange(6, dtype=torch.int32).reshape(2, 3)))
    assert raw[:8] == b"SMZT" + bytes([1, 2, 5, 0])
    assert raw[8:13] == b"int32"
    assert struct.unpack_from("<QQ", raw, 13) == (2, 3)
    assert raw[29:32] == bytes(3)  # zero padding to 32
    assert raw[32:] == np.arange(6, dtype="<i4").tobytes()


def test_a_tensor_that_required_grad_comes_back_as_a_leaf():
    for t in (
        torch.randn(3, requires_grad=True),
        torch.randn(3, requires_grad=True) * 2,
        torch.nn.Parameter(torch.ones(2)),
    ):
        back = loads(dumps(t))
        assert type(back) is torch.Tensor
        assert back.is_leaf and not back.requires_grad and back.grad_fn is None
        assert torch.equal(back, t.detach())


REFUSED = {
    "sparse_coo": (lambda: torch.randn(3).to_sparse(), "`t.to_dense()`"),
    "sparse_csr": (lambda: torch.randn(3, 3).to_sparse_csr(), "`t.to_dense()`"),
    "quantized": (lambda: torch.quantize_per_tensor(torch.randn(3), 0.1, 0, torch.qint8), "`t.dequantize()`"),
    "nested": (lambda: torch.nested.nested_tensor([torch.randn(2), torch.randn(3)]), "`t.unbind()`"),
    "meta": (lambda: torch.empty(3, device="meta"), "`meta` device"),
    "complex32": (lambda: torch.zeros(2, dtype=torch.complex32), "dtype `torch.complex32`"),
}


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch's: beta / deprecated / experimental
@pytest.mark.parametrize("make, says", REFUSED.values(), ids=REFUSED.keys())
def test_what_is_not_dense_is_refused_with_the_fix(make, says):
    t = make()
    with pytest.raises(Unwritable, match=re.escape(says)):
        smt.dump_tensor(t)
    with pytest.raises(Unwritable) as info:
        dumps(t)
    assert says in str(info.value)  # the codec's own sentence reaches the caller


WRITTEN = list(smt.DTYPES.values())


@st.composite
def tensors(draw):
    dtype = draw(st.sampled_from(WRITTEN))
    shape = draw(st.lists(st.integers(0, 5), min_size=0, max_size=4))
    count = int(np.prod(shape)) if shape else 1
    raw = draw(st.binary(min_size=count * dtype.itemsize, max_size=count * dtype.itemsize))
    if dtype is torch.bool:
        raw = bytes(b & 1 for b in raw)
    t = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    t = t.view(dtype).reshape(shape)
    if t.dim() >= 2 and draw(st.booleans()):
        t = t.transpose(0, -1)
    if t.dim() >= 1 and t.shape[0] > 1 and draw(st.booleans()):
        t = t[::2]
    return t


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tensors())
def test_any_dense_tensor_round_trips_exactly(t):
    assert same(loads(dumps(t)), t)
    assert same(smt.load_tensor(smt.dump_tensor(t)), t)


def written(name=b"float32", shape=(2,), data=None, version=1, pad=None, reserved=0):
    head = b"SMZT" + bytes([version, len(shape), len(name), reserved]) + name
    head += b"".join(struct.pack("<Q", n) for n in shape)
    head += pad if pad is not None else bytes(-len(head) % 16)
    return head + (data if data is not None else bytes(4 * int(np.prod(shape))))


MALFORMED = {
    "huge shape": written(shape=(2**40, 2**40), data=b""),
    "overflowing shape": written(shape=(0, 2**62, 2**62), data=b""),
    "too big for its data": written(shape=(2**31,), data=bytes(16)),
    "bad dtype": written(name=b"object"),
    "quantized dtype": written(name=b"qint8"),
    "unprintable dtype": written(name=b"\xff\x00"),
    "truncated data": written(shape=(4,), data=bytes(12)),
    "extra data": written(shape=(4,), data=bytes(20)),
    "truncated header": written(shape=(3, 3))[:14],
    "bad magic": b"SMZX" + written()[4:],
    "newer version": written(version=2),
    "reserved byte": written(reserved=1),
    "too many dimensions": written(shape=(1,) * 33, data=bytes(4)),
    "nonzero padding": written(name=b"int8", shape=(1,), pad=b"\x01" * 7, data=b"\x00"),
    "bool bytes": written(name=b"bool", shape=(2,), data=b"\x01\x02"),
    "empty": b"",
}


@pytest.mark.parametrize("raw", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_tensor_bytes_are_refused_before_anything_is_allocated(raw, monkeypatch):
    def no(*args, **kwargs):
        raise AssertionError("allocated before the header was checked")

    monkeypatch.setattr(torch, "empty", no)
    with pytest.raises(Unreadable):
        smt.load_tensor(raw)
    with pytest.raises(Unreadable):  # and through the codec layer, as bytes arrive
        decode(["C", "torch.Tensor", 0], [raw])


def written_before(descriptor, frames):
    """A written form as somatize wrote it before tensors were built in (SMZ1, the header,
    each frame on a 16-byte boundary): what a store may hold from then."""
    import msgpack

    header = msgpack.packb([descriptor, [len(f) for f in frames]], use_bin_type=True)
    out = b"SMZ1" + struct.pack("<I", len(header)) + header
    for f in frames:
        out += bytes(-len(out) % 16) + bytes(f)
    return out


def test_tensor_bytes_read_in_a_process_that_never_imported_somatize_torch(tmp_path):
    # Adapted when tensors became built in: today's bytes (the "X" node) need torch only,
    # and no codec; bytes written before ("C" nodes with SMZT frames) still summon
    # somatize.torch, which registers the codec that reads them.
    value = {"t": torch.randn(4, 3).t(), "b": torch.ones(2, dtype=torch.bfloat16)}
    (tmp_path / "written").write_bytes(dumps(value))
    old = written_before(
        ["D", "t", ["C", "torch.Tensor", 0], "b", ["C", "torch.Tensor", 1]],
        [smt.dump_tensor(value["t"]), smt.dump_tensor(value["b"])],
    )
    (tmp_path / "old").write_bytes(old)
    script = textwrap.dedent(
        """
        import sys
        from somatize.codec import codecs_registered, loads

        assert "somatize.torch" not in sys.modules and "torch" not in sys.modules
        assert codecs_registered() == []
        for name in ("written", "old"):
            value = loads(open(name, "rb").read())
            print(codecs_registered(), "somatize.torch" in sys.modules, type(value["t"]).__name__, value["t"].shape, value["b"].dtype)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "[] False Tensor torch.Size([3, 4]) torch.bfloat16",
        "['torch.Tensor'] True Tensor torch.Size([3, 4]) torch.bfloat16",
    ]


# -- across a worker -----------------------------------------------------------------------


def test_bfloat16_and_non_contiguous_tensors_cross_a_worker_exactly(worker):
    value = (torch.randn(5, 3, dtype=torch.bfloat16), torch.randn(8, 6)[::2, 1:].t(), torch.tensor(7, dtype=torch.int8))
    back = Echo().named("echo").at("w1").forward(value, broker=worker)
    assert all(same(b, v) for b, v in zip(back, value, strict=False))
    x = torch.randn(30, 20, dtype=torch.float64).t()
    assert same(Double().named("double").at("w1").forward(x, broker=worker), x * 2)


def test_a_tensor_that_required_grad_comes_back_from_a_worker_as_a_leaf(worker):
    seen = Collect()
    out = Weighted().named("weighted").at("w1").forward(torch.ones(3), broker=worker, watching=seen)
    assert [f["host"] for f in seen.of("ran")] == ["w1"]
    assert out.is_leaf and not out.requires_grad and out.grad_fn is None
    assert torch.equal(out, torch.full((3,), 2.0))


def test_a_node_on_a_device_receives_its_input_there(worker):
    x = {"a": torch.ones(2, dtype=torch.bfloat16), "b": [torch.zeros(3), (torch.arange(3), "text")]}
    assert Where().on("meta").forward(x) == {
        "a": ("meta", "torch.bfloat16", (2,)),
        "b": ("list", [("meta", "torch.float32", (3,)), ("tuple", [("meta", "torch.int64", (3,)), "text"])]),
    }
    assert Where().on("cpu").forward(torch.ones(2)) == ("cpu", "torch.float32", (2,))
    assert Where().named("where").on("cpu").at("w1").forward([torch.ones(1)], broker=worker) == (
        "list",
        [("cpu", "torch.float32", (1,))],
    )


def test_placing_keeps_namedtuples_and_packed_sequences_what_they_are():
    from torch.nn.utils.rnn import PackedSequence, pack_sequence

    Pair = collections.namedtuple("Pair", "x n")
    out = Echo().on("meta").forward(Pair(torch.ones(1), 3))
    assert type(out) is Pair and out.x.is_meta and out.n == 3
    packed = Echo().on("meta").forward(pack_sequence([torch.ones(3), torch.ones(2)]))
    assert type(packed) is PackedSequence and packed.data.is_meta
    assert packed.batch_sizes.device.type == "cpu"  # as PackedSequence.to keeps it


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_tensor_on_a_gpu_is_written_from_there_and_read_back_on_the_cpu():
    t = torch.randn(64, 32, device="cuda").t()
    back = loads(dumps(t))
    assert back.device.type == "cpu" and torch.equal(back, t.cpu())
    assert Where().on("cuda").forward(back)[0] == "cuda"


# -- the trainer: what it refuses ----------------------------------------------------------


def test_a_trainable_node_on_another_host_is_refused_before_anything_runs():
    Counted.calls.clear()
    head = Counted()
    g = Echo().named("first") >> head.named("head").at("w1")
    with Broker.embedded({"w1": Worker.inprocess()}) as broker:
        with pytest.raises(PlanError) as info:
            Trainer(g, objective=mse, optimizer=torch.optim.SGD(head.parameters(), lr=0.1), broker=broker)
    text = str(info.value)
    assert "`head`" in text and "`w1`" in text and ".frozen()" in text and "local" in text
    assert Counted.calls == []


def test_a_cached_trainable_node_is_refused_before_anything_runs(tmp_path):
    Counted.calls.clear()
    head = Counted()
    g = head.named("head").cached()
    with pytest.raises(Unsettled) as info:
        Trainer(g, objective=mse, optimizer=torch.optim.SGD(head.parameters(), lr=0.1), store=FolderStore(tmp_path))
    text = str(info.value)
    assert "`head`" in text and ".frozen()" in text and ".cached()" in text
    assert Counted.calls == []


def test_a_node_that_holds_its_parameters_as_attributes_counts_as_trainable(tmp_path):
    node = Scaled()
    with pytest.raises(Unsettled, match="`scaled` would train"):
        Trainer(
            node.named("scaled").cached(),
            objective=mse,
            optimizer=torch.optim.SGD([node.w], lr=0.1),
            store=FolderStore(tmp_path),
        )


def test_an_optimizer_holding_a_frozen_nodes_parameters_is_refused():
    Counted.calls.clear()
    embed, head = Embed(8, 4, 0), Head(4)
    g = embed.named("embed").frozen() >> head.named("head")
    everything = list(embed.parameters()) + list(head.parameters())
    with pytest.raises(PlanError, match=r"`embed` is declared `.frozen\(\)`, and the optimizer holds 1 of its"):
        Trainer(g, objective=mse, optimizer=torch.optim.SGD(everything, lr=0.1))


def test_the_refusals_are_checked_again_when_fit_starts():
    Counted.calls.clear()
    head = Counted()
    trainer = Trainer(
        head.named("head").frozen(),
        objective=mse,
        optimizer=torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1),
    )
    trainer.optimizer.add_param_group({"params": list(head.parameters())})
    with pytest.raises(PlanError):
        trainer.fit([(torch.zeros(1, 2), torch.zeros(1))])
    assert Counted.calls == []


def test_a_one_shot_iterator_is_refused_for_several_epochs_and_a_function_is_called_each_epoch():
    head = Head(2)
    trainer = Trainer(head.named("head"), objective=mse, optimizer=torch.optim.SGD(head.parameters(), lr=0.1))
    batches = [(torch.randn(4, 2), torch.randn(4))]
    with pytest.raises(TypeError, match="one-shot iterator"):
        trainer.fit(iter(batches), epochs=2)
    made = []

    def fresh():
        made.append(1)
        return iter(batches)

    assert len(trainer.fit(fresh, epochs=3)) == 3 and len(made) == 3
    assert len(trainer.fit(iter(batches))) == 1


# -- the trainer: what it says -------------------------------------------------------------


def test_a_loss_lands_in_the_forward_it_belongs_to(tmp_path):
    from somatize.record import Recorder, curve, facts, forwards

    store = FolderStore(tmp_path / "store")
    head = Head(2)
    g = Echo().named("first") >> head.named("head")
    recorder = Recorder(store, run="r", summarising=["loss"])
    trainer = Trainer(g, objective=mse, optimizer=torch.optim.SGD(head.parameters(), lr=0.1), watching=recorder)
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 2, generator=gen), torch.randn(4, generator=gen)) for _ in range(3)]
    losses = trainer.fit(batches, epochs=2)
    rows = forwards(store, run="r")
    assert [row["forward"] for row in rows] == list(range(6))
    assert [row["loss.step"] for row in rows] == list(range(6))
    assert [row["loss.epoch"] for row in rows] == [0, 0, 0, 1, 1, 1]
    assert [row["loss.value"] for row in rows] == [float(f"{v:.6g}") for v in losses]
    assert curve(store, run="r") == [(n, float(f"{v:.6g}")) for n, v in enumerate(losses)]
    # the loss comes after the forward closed, and the update after the loss
    assert [f["fact"] for f in facts(store, run="r", forward=1)] == ["ran", "ran", "finished", "loss", "updated"]
    # and the fit's end is the run's, in an entry of its own (no forward's facts)
    assert store.record("run/r/end") == {"run": "r", "how": "ok", "forwards": "6"}
    assert [f["fact"] for f in facts(store, run="r", forward=5)] == ["ran", "ran", "finished", "loss", "updated"]


def test_a_fit_that_raises_says_its_run_broke(tmp_path):
    from somatize.record import Recorder

    store = FolderStore(tmp_path / "store")
    head = Head(2)
    trainer = Trainer(
        head.named("head"),
        objective=mse,
        optimizer=torch.optim.SGD(head.parameters(), lr=0.1),
        watching=Recorder(store, run="r"),
    )
    with pytest.raises(TypeError):
        trainer.fit([(torch.randn(4, 2), torch.randn(4)), "not a pair"])
    assert store.record("run/r/end")["how"] == "broke"


def test_a_group_of_steps_moves_once_and_says_so_once():
    head = Head(2)
    seen = Collect()
    weights = []

    def snapshot(fact):
        if fact["fact"] == "loss":  # said before the update of its step
            weights.append(head.linear.weight.detach().clone())

    trainer = Trainer(
        head.named("head"),
        objective=mse,
        optimizer=torch.optim.SGD(head.parameters(), lr=0.1),
        watching=[seen, snapshot],
        accumulate=3,
    )
    batches = [(torch.randn(4, 2), torch.randn(4)) for _ in range(7)]
    trainer.fit(batches, epochs=2)
    weights.append(head.linear.weight.detach().clone())
    updated = seen.of("updated")
    # 7 steps an epoch in groups of 3: 3, 3 and the 1 left at the end of the epoch
    assert [(f["step"], f["steps"]) for f in updated] == [
        ("2", "3"),
        ("5", "3"),
        ("6", "1"),
        ("9", "3"),
        ("12", "3"),
        ("13", "1"),
    ]
    moved_after = {int(f["step"]) for f in updated}
    for step in range(14):
        changed = not torch.equal(weights[step], weights[step + 1])
        assert changed == (step in moved_after), step


def test_a_group_cut_short_moves_with_the_mean_gradient_of_its_steps():
    head = Head(1)
    with torch.no_grad():
        head.linear.weight.fill_(0.0)
        head.linear.bias.fill_(0.0)
    x, y = torch.ones(1, 1), torch.ones(1)
    trainer = Trainer(
        head.named("head"), objective=mse, optimizer=torch.optim.SGD(head.parameters(), lr=0.25), accumulate=4
    )
    trainer.fit([(x, y)])
    # d/dw (w*1 + b - 1)^2 at 0 is -2: one step of lr 0.25 takes w to 0.5, not 0.125
    assert head.linear.weight.item() == pytest.approx(0.5)


def test_training_works_when_the_head_is_in_a_parallel_branch():
    head = Head(2)
    g = Echo().named("first") >> (head.named("head") & Other().named("other")) >> Pick().named("pick")
    trainer = Trainer(g, objective=mse, optimizer=torch.optim.Adam(head.parameters(), lr=0.05))
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 2, generator=gen)
    y = x @ torch.tensor([1.5, -2.0]) + 0.5
    losses = trainer.fit([(x[i : i + 16], y[i : i + 16]) for i in range(0, 64, 16)], epochs=30)
    threads = {name for _, _, name in head.seen}
    assert threads and threading.current_thread().name not in threads  # it ran on the pool
    assert sum(losses[-4:]) < 0.1 * sum(losses[:4])


def test_a_cached_frozen_prefix_hands_the_head_a_leaf_and_the_head_still_learns(tmp_path):
    store = FolderStore(tmp_path / "store")
    embed, head = Embed(16, 32, 0), Head(32)
    g = embed.named("embed").cached().frozen() >> head.named("head")
    seen = Collect()
    before = head.linear.weight.detach().clone()
    trainer = Trainer(
        g, objective=mse, optimizer=torch.optim.Adam(head.parameters(), lr=0.05), store=store, watching=seen
    )
    trainer.fit(token_data(n=64), epochs=2)
    assert [f["node"] for f in seen.of("recalled")] == ["embed"] * 2  # the second epoch
    assert all(leaf and not grad for leaf, grad, _ in head.seen)  # recalled or not
    assert not torch.equal(before, head.linear.weight)
    assert embed.table.weight.grad is None and embed.table.weight.requires_grad  # given back


# -- the progress view ---------------------------------------------------------------------


def test_the_progress_view_shows_step_loss_and_throughput_and_closes_itself():
    pytest.importorskip("tqdm")
    head = Head(2)
    screen = io.StringIO()
    batches = [(torch.randn(4, 2), torch.randn(4)) for _ in range(5)]
    with progress(total=10, file=screen, mininterval=0) as bar:
        trainer = Trainer(
            head.named("head"), objective=mse, optimizer=torch.optim.SGD(head.parameters(), lr=0.1), watching=[bar]
        )
        losses = trainer.fit(batches, epochs=2)
        assert bar._closed  # it reached its total
    shown = screen.getvalue()
    assert "training" in shown and "10/10" in shown and "step/s" in shown
    assert f"loss={losses[-1]:.6g}" in shown and "epoch=1" in shown
    assert bar.updates == 10  # one move per step (accumulate=1)
    bar(dict(fact="loss", value="1"))  # told after closing: ignored
    bar.close()


def test_the_progress_view_says_how_to_get_tqdm_when_it_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    with pytest.raises(ImportError, match=r"pip install tqdm"):
        progress()


# -- the example that sells it -------------------------------------------------------------


def test_a_frozen_embedding_on_a_worker_is_kept_once_and_a_head_learns_here(tmp_path):
    from somatize.record import Recorder, curve, facts, forwards

    store = FolderStore(tmp_path / "store")
    head = Head(32)
    g = Embed(16, 32, seed=0).named("embed").at("w1").cached().frozen() >> head.named("head")
    batches = token_data()  # 256 samples in 8 batches
    epochs = 5
    with Broker.embedded({"w1": Worker.spawn(WORKER, mode="network", send=[HERE])}) as broker:
        trainer = Trainer(
            g,
            objective=mse,
            optimizer=torch.optim.Adam(head.parameters(), lr=0.05),
            watching=Recorder(store, run="example", summarising=["loss"]),
            broker=broker,
            store=store,
        )
        losses = trainer.fit(batches, epochs=epochs)
    per_epoch = len(batches)
    assert len(losses) == epochs * per_epoch
    for n in range(epochs * per_epoch):
        embed = [f for f in facts(store, run="example", forward=n) if f.get("node") == "embed"]
        if n < per_epoch:  # the first epoch runs it over there, and keeps what it made
            assert [(f["fact"], f.get("host")) for f in embed] == [("ran", "w1"), ("kept", None)]
        else:  # from then on it is recalled: no trip, no remote `ran`
            assert [f["fact"] for f in embed] == ["recalled"]
    first, last = np.mean(losses[:per_epoch]), np.mean(losses[-per_epoch:])
    assert last < 0.5 * first
    drawn = curve(store, run="example")
    assert [n for n, _ in drawn] == list(range(epochs * per_epoch))
    assert [v for _, v in drawn] == [float(f"{v:.6g}") for v in losses]
    assert all(row["state"] == "ok" for row in forwards(store, run="example"))


def test_no_grad_reaches_every_branch_of_a_wave():
    # grad mode is per thread; branches run on pool threads and must follow the caller's
    g = Weighted().named("left") & Weighted().named("right") & Weighted().named("third")
    x = torch.ones(3)
    with torch.no_grad():
        outs = g.forward(x)
    assert not any(out.requires_grad for out in outs)
    assert all(out.requires_grad for out in g.forward(x))
