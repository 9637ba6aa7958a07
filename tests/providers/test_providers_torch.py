"""Tests for statestream.providers.torch (TorchProvider)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from statestream.errors import TargetMismatchError, UnsupportedTypeError
from statestream.format import dtype_from_name
from statestream.providers import (
    PreparedArray,
    TorchProvider,
    array_provider_for,
    box_slices,
    provider_by_kind,
    target_provider_for,
)
from statestream.providers.torch import _NAMES

torch = pytest.importorskip("torch")

P = TorchProvider()
PATH = ("model", "layer/0", "w")
WHERE = "model/layer~10/w"


def raw_bytes(t: torch.Tensor) -> bytes:
    """C-order little-endian bytes of a tensor's values (x86/ARM hosts are LE)."""
    t = t.detach().resolve_conj().resolve_neg().reshape(-1)
    t = t.clone(memory_format=torch.contiguous_format)  # fresh strides
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def check_chunks(prep: PreparedArray, t: torch.Tensor) -> None:
    shape = tuple(t.shape)
    assert prep.chunk((0,) * len(shape), shape).tobytes() == raw_bytes(t)
    if len(shape) >= 1 and shape[0] > 1:
        rows = prep.chunk((1,) + (0,) * (len(shape) - 1), (shape[0] - 1,) + shape[1:])
        assert rows.tobytes() == raw_bytes(t[1:])
        if len(shape) > 1 and shape[1] > 1:
            box = ((0, 1) + (0,) * (len(shape) - 2), (shape[0], shape[1] - 1) + shape[2:])
            assert prep.chunk(*box).tobytes() == raw_bytes(t[box_slices(*box)])


BASE = torch.arange(24, dtype=torch.float32).reshape(4, 6) * 1.5


@pytest.mark.parametrize(
    ("name", "t", "copies"),
    [
        ("contiguous", BASE, False),
        ("transposed", BASE.t(), True),
        ("strided", BASE[::2, ::3], True),
        ("column slice", BASE[:, 1:4], True),
        ("row slice", BASE[1:3], False),
        ("expanded", torch.ones(1, 3).expand(4, 3), True),
        ("0-d", torch.tensor(3.25, dtype=torch.float64), False),
        ("empty", torch.zeros(0, 3), False),
        ("requires grad", torch.ones(2, 2, requires_grad=True), False),
        ("parameter", torch.nn.Parameter(torch.arange(4.0)), False),
        ("bfloat16", torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), False),
        ("conj view", torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64).conj(), False),
        ("neg view", torch.tensor([1 + 2j, 3j], dtype=torch.complex128).conj().imag, False),
        ("one element, odd stride", torch.arange(4.0)[::2][:1], False),
        ("size-1 neg view", torch.tensor([1 + 2j], dtype=torch.complex128).conj().imag, False),
    ],
)
def test_prepare_bytes(name: str, t: torch.Tensor, copies: bool) -> None:
    prep = P.prepare(t, PATH)
    assert prep.kind == "torch"
    assert prep.shape == tuple(t.shape)
    assert prep.copies is copies
    assert prep.nbytes == t.numel() * t.element_size()
    check_chunks(prep, t)


def test_conj_view_saves_conjugated_values() -> None:
    t = torch.tensor([1 + 2j], dtype=torch.complex64)
    got = np.frombuffer(P.prepare(t.conj(), PATH).chunk((0,), (1,)).tobytes(), np.complex64)
    assert got.tolist() == [1 - 2j]


TORCH_NAMES = [n for n in _NAMES if hasattr(torch, n)]


@pytest.mark.parametrize("name", TORCH_NAMES)
def test_every_dtype_round_trips(name: str) -> None:
    dt = getattr(torch, name)
    src = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    t = (src > 5) if dt == torch.bool else src.to(dt)
    prep = P.prepare(t, PATH)
    assert prep.dtype == name
    data = prep.chunk((0, 0), (3, 4))
    assert data.nbytes == t.numel() * t.element_size()
    dest = P.restore(name, (3, 4), None, PATH)
    ((start, buf),) = dest.boxes
    assert start == (0, 0) and buf.dtype == dtype_from_name(name) and buf.shape == (3, 4)
    buf.reshape(-1).view(np.uint8)[...] = data
    out = dest.finish()
    assert out.dtype == dt and out.device.type == "cpu" and tuple(out.shape) == (3, 4)
    assert raw_bytes(out) == raw_bytes(t)


def test_restore_casts_to_target_dtype_and_keeps_parameter() -> None:
    like = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64), requires_grad=False)
    dest = P.restore("float32", (3,), like, PATH)
    dest.boxes[0][1][...] = [1.0, 2.0, 3.0]
    out = dest.finish()
    assert isinstance(out, torch.nn.Parameter) and not out.requires_grad
    assert out.dtype == torch.float64 and out.tolist() == [1.0, 2.0, 3.0]
    like = torch.nn.Parameter(torch.zeros(3))
    out = P.restore("float32", (3,), like, PATH).finish()
    assert isinstance(out, torch.nn.Parameter) and out.requires_grad


def test_restore_plain_tensor_target() -> None:
    dest = P.restore("int32", (2, 2), torch.zeros(2, 2, dtype=torch.int64), PATH)
    dest.boxes[0][1][...] = [[1, 2], [3, 4]]
    out = dest.finish()
    assert type(out) is torch.Tensor and out.dtype == torch.int64
    assert out.tolist() == [[1, 2], [3, 4]]


def test_meta_target_gives_shape_and_dtype_and_the_data_on_the_cpu() -> None:
    # a meta tensor holds no data: moving the loaded values there dropped them
    # (moves to real devices: tests/providers/test_cuda.py)
    like = torch.empty(2, dtype=torch.float64, device="meta")
    dest = P.restore("float32", (2,), like, PATH)
    dest.boxes[0][1][...] = [1.5, -2.0]
    out = dest.finish()
    assert out.device.type == "cpu" and out.dtype == torch.float64
    assert out.tolist() == [1.5, -2.0]
    like = torch.nn.Parameter(torch.empty(2, device="meta"), requires_grad=False)
    dest = P.restore("float32", (2,), like, PATH)
    dest.boxes[0][1][...] = [3.0, 4.0]
    out = dest.finish()
    assert isinstance(out, torch.nn.Parameter) and not out.requires_grad
    assert out.device.type == "cpu" and out.tolist() == [3.0, 4.0]


def test_restore_scalar_and_empty() -> None:
    dest = P.restore("float64", (), None, PATH)
    dest.boxes[0][1][...] = 2.5
    out = dest.finish()
    assert out.dim() == 0 and out.item() == 2.5
    out = P.restore("float32", (0, 5), None, PATH).finish()
    assert tuple(out.shape) == (0, 5) and out.dtype == torch.float32


def test_restore_dtype_torch_lacks() -> None:
    with pytest.raises(TargetMismatchError, match=r"key path 'model/layer~10/w'.*float8_e3m4"):
        P.restore("float8_e3m4", (2,), None, PATH)


def _quantized() -> torch.Tensor:
    return torch.quantize_per_tensor(torch.rand(3), 0.1, 0, torch.quint8)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: torch.eye(3).to_sparse(), "layout"),
        pytest.param(lambda: torch.eye(3).to_sparse_csr(), "layout",
                     marks=pytest.mark.filterwarnings("ignore:Sparse CSR")),
        pytest.param(_quantized, "quantized",
                     marks=pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")),
        (lambda: torch.empty(3, device="meta"), "meta device"),
        pytest.param(lambda: torch.zeros(2, dtype=torch.complex32), "dtype",
                     marks=pytest.mark.filterwarnings("ignore:ComplexHalf")),
        (lambda: torch.zeros(2, dtype=torch.uint8).view(torch.bits8), "dtype"),
    ],
)
def test_unsupported_tensors_name_key_path(make: object, match: str) -> None:
    t = make()  # type: ignore[operator]
    with pytest.raises(UnsupportedTypeError, match=match) as ei:
        P.prepare(t, PATH)
    assert f"key path '{WHERE}'" in str(ei.value)
    assert isinstance(ei.value, TypeError)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize("layout", ["strided", "jagged"])
@pytest.mark.parametrize("how", ["save", "save_async", "lazy"])
def test_a_nested_tensor_is_refused_by_a_save(tmp_path: Any, layout: str, how: str) -> None:
    """A nested tensor (torch's default layout for one is strided) is refused as such,
    naming its key path; a strided one failed with torch's own RuntimeError ('Internal
    error: NestedTensorImpl doesn't support sizes') from reading its shape, alone or
    under two keys, and nothing said which value it was."""
    import statestream as ss

    nt = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)],
                                    layout=getattr(torch, layout))
    for i, state in enumerate([{"model": {"w": nt}}, {"model": {"w": nt}, "tied": nt}]):
        with pytest.raises(UnsupportedTypeError, match="key path 'model/w' is a nested tensor"):
            if how == "save":
                ss.save(tmp_path / f"c{i}", state)
            else:
                ss.save_async(tmp_path / f"c{i}", state, lazy=how == "lazy").result()
    with pytest.raises(UnsupportedTypeError, match=f"key path '{WHERE}' is a nested tensor"):
        P.prepare(nt, PATH)


def test_handles_and_registry() -> None:
    t = torch.zeros(2, 3)
    assert P.handles(t) and P.handles(torch.nn.Parameter(t))
    assert not P.handles(np.zeros(2))
    assert P.is_target(t) and P.target_shape(t) == (2, 3)
    assert isinstance(array_provider_for(t), TorchProvider)
    assert isinstance(target_provider_for(t), TorchProvider)
    assert isinstance(provider_by_kind("torch"), TorchProvider)


@pytest.mark.parametrize("make", [
    lambda: torch.arange(12, dtype=torch.float32).reshape(3, 4),      # the fast path
    lambda: torch.nn.Parameter(torch.ones(5, dtype=torch.bfloat16)),  # a parameter
    lambda: torch.arange(24.0).reshape(4, 6)[1:3],                    # a view
    lambda: torch.arange(24.0).reshape(4, 6).t(),                     # not contiguous
    lambda: torch.tensor(3.5),                                        # 0-d
    lambda: torch.zeros(0, 3),                                        # empty
    lambda: torch.arange(6, dtype=torch.int16)[::2],                  # strided
], ids=["dense", "parameter", "view", "transposed", "scalar", "empty", "strided"])
def test_alias_and_prepare_matches_alias_key_and_prepare(make) -> None:
    p = TorchProvider()
    t = make()
    key, prepared = p.alias_and_prepare(t, ("w",))
    want = p.prepare(t, ("w",))
    assert key == p.alias_key(t)
    assert (prepared.kind, prepared.dtype, prepared.shape, prepared.copies) == \
        (want.kind, want.dtype, want.shape, want.copies)
    if math.prod(want.shape):
        whole = (0,) * len(want.shape)
        assert bytes(prepared.chunk(whole, want.shape)) == bytes(want.chunk(whole, want.shape))
        if want.shape and want.shape[0] > 1:  # a row block
            rows = (1,) + want.shape[1:]
            assert bytes(prepared.chunk(whole, rows)) == bytes(want.chunk(whole, rows))


def _torch_cut(shape: tuple[int, ...], mesh_shape: list[int], coord: list[int],
               placements: list) -> list[list[int]]:
    """Per dim, the global indices ``coord`` holds, cut by torch's own placements."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    idx = [torch.arange(n) for n in shape]
    for k, pl in enumerate(placements):
        if isinstance(pl, Replicate):
            continue
        one_d = (_StridedShard(0, split_factor=pl.split_factor)
                 if isinstance(pl, _StridedShard) else Shard(0))
        idx[pl.dim] = one_d._split_tensor(idx[pl.dim], mesh_shape[k], with_padding=False)[0][
            coord[k]]
    return [t.tolist() for t in idx]


def test_dtensor_layouts_hold_the_indices_torch_gives_each_rank() -> None:
    """FSDP2 + TP's _StridedShard (and Shard, Replicate) over uneven sizes: the runs of
    global indices a mesh coordinate holds are those torch's own cut gives it, in order."""
    import itertools
    import random

    placement_types = pytest.importorskip("torch.distributed.tensor.placement_types")
    from torch.distributed.tensor import Replicate, Shard

    from statestream.providers._dtensor import held_runs

    strided = placement_types._StridedShard
    rng = random.Random(0)
    for _ in range(150):
        shape = tuple(rng.randint(0, 11) for _ in range(rng.randint(1, 2)))
        mesh_shape = [rng.randint(1, 4) for _ in range(rng.randint(1, 3))]
        pls = [rng.choice([Replicate(), Shard(d), strided(d, split_factor=rng.randint(1, 4))])
               for d in (rng.randrange(len(shape)) for _ in mesh_shape)]
        for coord in itertools.product(*[range(m) for m in mesh_shape]):
            runs = held_runs(shape, mesh_shape, list(coord), pls)
            got = [[i for a, b in r for i in range(a, b)] for r in runs]
            assert got == _torch_cut(shape, mesh_shape, list(coord), pls), (shape, pls, coord)


class _WithExtra(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2, bias=False)
        self.register_module("skip", None)  # a child slot holding nothing
        self.register_buffer("scratch", torch.zeros(1), persistent=False)

    def get_extra_state(self) -> Any:
        return {"v": 1}

    def set_extra_state(self, state: Any) -> None:
        pass


def _torch_refuses(module: Any, state: dict[str, Any]) -> tuple[list[str], list[str]]:
    """What torch's own load_state_dict reports (on a copy of ``module``)."""
    import copy

    got = copy.deepcopy(module).load_state_dict(dict(state), strict=False)
    return sorted(got.missing_keys), sorted(got.unexpected_keys)


@pytest.mark.parametrize("case", ["bn-old", "extra", "bias", "child-name", "nothing-child",
                                  "non-persistent", "deep", "instance-norm"])
def test_refused_keys_are_the_ones_torch_refuses(case: str) -> None:
    """A module's refused keys, told from the module alone, are exactly those its
    own load_state_dict reports (a BatchNorm's num_batches_tracked, filled in for a
    state without torch's metadata, is not one)."""
    seq = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    module: Any = {"bn-old": seq, "deep": seq, "instance-norm": torch.nn.InstanceNorm1d(2)
                   }.get(case, _WithExtra())
    state = dict(module.state_dict())
    if case == "bn-old":
        del state["1.num_batches_tracked"], state["1.running_var"]
    elif case == "extra":
        del state["_extra_state"]
    elif case == "bias":
        state["lin.bias"] = torch.zeros(2)  # Linear(bias=False): no place for it
    elif case == "child-name":
        state["lin"] = torch.zeros(2)
    elif case == "nothing-child":
        state["skip.weight"] = torch.zeros(2)  # torch skips a None child's keys
    elif case == "non-persistent":
        state["scratch"] = torch.zeros(1)
    elif case == "deep":
        state["0.inner.weight"] = state["2.weight"] = torch.zeros(2)
    elif case == "instance-norm":  # running stats it does not track: refused
        state["running_mean"] = torch.zeros(2)
        with pytest.raises(RuntimeError, match='Unexpected running stats.*"running_mean"'):
            _torch_refuses(module, state)
        assert P.refused_keys(module, [], list(state)) == ([], ["running_mean"])
        return
    missing, unexpected = P.refused_keys(module, list(module.state_dict()), list(state))
    assert (sorted(missing), sorted(unexpected)) == _torch_refuses(module, state)


def test_refused_keys_leave_custom_loading_and_optimizers_to_decide() -> None:
    lin = torch.nn.Linear(2, 2)
    lin.register_load_state_dict_pre_hook(lambda *a: None)
    assert P.refused_keys(lin, ["weight", "bias"], ["w", "b"]) == ([], [])
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    assert P.refused_keys(opt, ["state", "param_groups"], ["param_groups"]) == ([], [])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "bool", "complex64", "int8"])
def test_copy_into_writes_the_chunks_bytes(dtype: str) -> None:
    """A non-contiguous CPU tensor's ``copy_into`` (a snapshot copies its chunks
    straight into staging buffers with it) writes the bytes ``chunk`` returns; a
    contiguous one has none (its chunks are views)."""
    t = (torch.arange(48).reshape(6, 8) % 3).to(getattr(torch, dtype))
    assert P.prepare(t, PATH).copy_into is None
    prepared = P.prepare(t.t(), PATH)
    assert prepared.copies and prepared.copy_into is not None
    for start, shape in [((0, 0), (8, 6)), ((2, 1), (3, 4))]:
        want = prepared.chunk(start, shape)
        out = np.full(want.nbytes, 0xAB, dtype=np.uint8)
        prepared.copy_into(start, shape, out)
        assert bytes(out) == bytes(want)
