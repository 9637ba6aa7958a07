"""The common restore in one step (``ArrayProvider.restore_flat`` + ``LoadPlan.whole``):
an array held whole by one raw chunk is read straight into its fresh buffer or into the
target's own memory. Every other case (a cast, a Parameter, a tied array loaded twice,
a non-contiguous target) takes the general path, and both give the same values."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import statestream as ss
from statestream.errors import ChecksumMismatchError
from statestream.format import ArrayEntry, ChunkEntry
from statestream.plan import LoadPlan, ReadPiece, Wanted

torch = pytest.importorskip("torch")


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(6, 5, generator=g), "b": torch.arange(7, dtype=torch.int64),
            "h": torch.randn(4, 3, generator=g).to(torch.bfloat16)}


def test_torch_targets_get_fresh_tensors_and_stay_unchanged(tmp_path: Path) -> None:
    src = _state()
    ss.save(tmp_path / "c", src)
    like = {k: torch.zeros_like(v) for k, v in src.items()}
    out = ss.load(tmp_path / "c", like)
    for k, v in src.items():
        assert type(out[k]) is torch.Tensor and out[k].dtype == v.dtype
        assert torch.equal(out[k], v)
        assert out[k].data_ptr() != like[k].data_ptr()
        assert not like[k].any()  # the target was only a description
    # the fresh tensors own writable memory of their own
    out["w"] += 1
    assert torch.equal(out["w"], src["w"] + 1)


def test_in_place_fills_the_targets_own_memory(tmp_path: Path) -> None:
    src = _state()
    ss.save(tmp_path / "c", src)
    like = {k: torch.zeros_like(v) for k, v in src.items()}
    ptrs = {k: v.data_ptr() for k, v in like.items()}
    out = ss.load(tmp_path / "c", like, in_place=True)
    for k, v in src.items():
        assert out[k] is like[k] and like[k].data_ptr() == ptrs[k]
        assert torch.equal(like[k], v)


def test_parameters_casts_and_strided_targets_take_the_general_path(tmp_path: Path) -> None:
    src = _state()
    ss.save(tmp_path / "c", src)
    p = torch.nn.Parameter(torch.zeros(6, 5), requires_grad=False)
    strided = torch.zeros(5, 6).t()  # (6, 5), not contiguous
    cast = torch.zeros(7, dtype=torch.float64)
    out = ss.load(tmp_path / "c", {"w": p, "b": cast, "h": torch.zeros(4, 3)})
    assert isinstance(out["w"], torch.nn.Parameter) and not out["w"].requires_grad
    assert torch.equal(out["w"].detach(), src["w"])
    assert out["b"].dtype == torch.float64 and torch.equal(out["b"], src["b"].double())
    assert out["h"].dtype == torch.float32 and torch.equal(out["h"], src["h"].float())
    got = ss.load(tmp_path / "c", {"w": strided}, items=["w"], in_place=True)
    assert torch.equal(got["w"], src["w"])
    got = ss.load(tmp_path / "c", {"w": p}, items=["w"], in_place=True)
    assert got["w"] is p and torch.equal(p.detach(), src["w"])


def test_a_tied_array_loads_into_two_separate_targets(tmp_path: Path) -> None:
    t = torch.arange(12.0).reshape(3, 4)
    ss.save(tmp_path / "c", {"a": t, "b": t})
    for in_place in (False, True):
        x, y = torch.zeros(3, 4), torch.zeros(3, 4)
        got = ss.load(tmp_path / "c", {"a": x, "b": y}, in_place=in_place)
        assert torch.equal(got["a"], t) and torch.equal(got["b"], t)
        assert got["a"].data_ptr() != got["b"].data_ptr()
        assert (got["a"] is x) == in_place and (got["b"] is y) == in_place


def test_numpy_targets_and_no_target(tmp_path: Path) -> None:
    src = {"a": np.arange(10, dtype=np.float32).reshape(2, 5), "s": np.int64(3)}
    ss.save(tmp_path / "c", src)
    plain = ss.load(tmp_path / "c")
    np.testing.assert_array_equal(plain["a"], src["a"])
    assert isinstance(plain["s"], np.int64) and plain["s"] == 3  # a scalar stays one
    like = np.zeros((2, 5), np.float32)
    out = ss.load(tmp_path / "c", {"a": like, "s": None}, in_place=True)
    assert out["a"] is like and np.array_equal(like, src["a"])
    out = ss.load(tmp_path / "c", {"a": np.zeros((2, 5), np.float64), "s": None})
    assert out["a"].dtype == np.float64 and np.array_equal(out["a"], src["a"])


def test_a_corrupt_chunk_is_caught_and_named(tmp_path: Path) -> None:
    src = _state()
    ss.save(tmp_path / "c", src)
    data = sorted((tmp_path / "c" / "data").iterdir())[0]
    raw = bytearray(data.read_bytes())
    raw[0] ^= 0xFF  # the first array's first byte
    data.write_bytes(bytes(raw))
    for in_place in (False, True):
        like = {k: torch.zeros_like(v) for k, v in src.items()}
        with pytest.raises(ChecksumMismatchError, match="key path '(w|b|h)'"):
            ss.load(tmp_path / "c", like, in_place=in_place)


def test_load_plan_shares_a_whole_read_with_a_later_box() -> None:
    c = ChunkEntry(0, 64, 24, 7, (0,), (6,))
    entry = ArrayEntry("float32", (6,), (c,))
    plan = LoadPlan([entry])
    flat = np.zeros(24, np.uint8)
    plan.whole(0, c, np.dtype(np.float32), flat)
    second = np.zeros(4, np.float32)
    plan.add(Wanted(0, (2,), second))
    reqs = plan.requests()
    assert len(reqs) == 1 and len(reqs[0].pieces) == 1
    piece = reqs[0].pieces[0]
    assert piece.direct is flat and (piece.offset, piece.nbytes) == (64, 24)
    assert len(piece.scatter) == 1 and piece.scatter[0][0] is not None


def test_plain_targets_take_the_one_step_path(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    src = _state()
    ss.save(tmp_path / "c", src)
    seen: list[tuple[int, bool]] = []
    whole = LoadPlan.whole

    def counting(self: LoadPlan, array: int, *args: object, mapped: bool = False) -> ReadPiece:
        seen.append((array, mapped))
        return whole(self, array, *args, mapped=mapped)  # type: ignore[arg-type]

    monkeypatch.setattr(LoadPlan, "whole", counting)
    for in_place in (False, True):  # allocating loads map the file bytes; in place reads
        seen.clear()
        ss.load(tmp_path / "c", {k: torch.zeros_like(v) for k, v in src.items()},
                in_place=in_place)
        assert sorted(seen) == [(0, not in_place), (1, not in_place), (2, not in_place)]
    seen.clear()
    ss.load(tmp_path / "c")
    assert sorted(seen) == [(0, True), (1, True), (2, True)]
    seen.clear()
    ss.load(tmp_path / "c", io=ss.IOOptions(map_files=False))
    assert sorted(seen) == [(0, False), (1, False), (2, False)]
    seen.clear()
    ss.load(tmp_path / "c", {"w": torch.zeros(6, 5, dtype=torch.float64)}, items=["w"])
    assert seen == []  # a cast: the general path
