"""``in_place=True`` writes every writable target, not only those it can read straight into.

A target that the reads cannot fill directly (non-contiguous, a negative or conjugate view,
another dtype) came back as a new tensor or array while the target kept its old values: a
caller who loads into ``model.state_dict()`` and drops the result (as with ``dcp.load``)
silently kept the old weights. Such targets now get the loaded values copied in once every
array was read and checked, and the load returns the targets themselves.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import statestream as ss

torch = pytest.importorskip("torch")


def _saved(tmp_path, state):
    path = tmp_path / "ck"
    ss.save(path, state)
    return path


def test_non_contiguous_and_view_targets_are_written(tmp_path) -> None:
    want = {"t": torch.arange(12.0).reshape(4, 3), "neg": torch.arange(4.0) + 1,
            "conj": torch.tensor([1 + 2j, 3 - 4j]), "n": np.arange(6.0).reshape(2, 3),
            "step": torch.arange(5, dtype=torch.int64)}
    path = _saved(tmp_path, want)
    target = {"t": torch.zeros(3, 4).t(), "neg": torch.zeros(4)._neg_view(),
              "conj": torch.zeros(2, dtype=torch.complex64).conj(),
              "n": np.zeros((3, 2)).T, "step": torch.zeros(10, dtype=torch.int64)[::2]}
    assert not target["t"].is_contiguous() and not target["n"].flags.c_contiguous
    out = ss.load(path, target, in_place=True)
    for k in target:
        assert out[k] is target[k], k
    assert torch.equal(target["t"], want["t"])
    assert torch.equal(target["neg"], want["neg"])
    assert torch.equal(target["conj"], want["conj"])
    assert np.array_equal(target["n"], want["n"])
    assert torch.equal(target["step"], want["step"])


def test_parameters_that_need_grad_are_written_through_a_view(tmp_path) -> None:
    lin = torch.nn.Linear(3, 4)
    path = _saved(tmp_path, {"w": torch.arange(12.0).reshape(4, 3)})
    w = lin.weight
    target = {"w": torch.nn.Parameter(torch.zeros(3, 4)).t()}  # a non-leaf view of a leaf
    out = ss.load(path, {"w": w}, in_place=True)
    assert out["w"] is w and w.requires_grad
    assert torch.equal(w.detach(), torch.arange(12.0).reshape(4, 3))
    out = ss.load(path, target, in_place=True)
    assert out["w"] is target["w"]
    assert torch.equal(target["w"].detach(), torch.arange(12.0).reshape(4, 3))


def test_another_dtype_is_cast_then_copied_and_overflow_is_refused(tmp_path) -> None:
    path = _saved(tmp_path, {"x": torch.arange(6.0), "big": torch.tensor([2**40])})
    x = torch.zeros(6, dtype=torch.bfloat16)
    out = ss.load(path, {"x": x}, items=["x"], in_place=True)
    assert out["x"] is x and torch.equal(x, torch.arange(6.0).bfloat16())
    small = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ss.TargetMismatchError, match="big"):
        ss.load(path, {"big": small}, items=["big"], in_place=True)
    assert torch.equal(small, torch.zeros(1, dtype=torch.int32))  # refused before the copy


def test_targets_that_cannot_be_written_get_new_values(tmp_path) -> None:
    path = _saved(tmp_path, {"ro": np.arange(4.0), "exp": torch.arange(4.0),
                             "meta": torch.arange(4.0)})
    ro = np.zeros(4)
    ro.flags.writeable = False
    exp = torch.zeros(1).expand(4)  # four elements on one memory location
    meta = torch.empty(4, device="meta")
    out = ss.load(path, {"ro": ro, "exp": exp, "meta": meta}, in_place=True)
    assert out["ro"] is not ro and np.array_equal(out["ro"], np.arange(4.0))
    assert not ro.any()
    assert out["exp"] is not exp and torch.equal(out["exp"], torch.arange(4.0))
    assert not exp.any()
    assert out["meta"] is not meta and torch.equal(out["meta"], torch.arange(4.0))


def test_a_corrupt_chunk_leaves_copied_targets_untouched(tmp_path) -> None:
    path = _saved(tmp_path, {"a": torch.arange(1000.0), "b": torch.arange(1000.0) * 2})
    data = sorted((path / "data").iterdir())
    raw = bytearray(data[0].read_bytes())
    raw[-10] ^= 0xFF  # a flipped byte in the last array's bytes
    data[0].write_bytes(bytes(raw))
    target = {"a": torch.zeros(2000)[::2], "b": torch.zeros(2000)[::2]}
    with pytest.raises(ss.CheckpointCorruptError):
        ss.load(path, target, in_place=True)
    assert not target["a"].any() and not target["b"].any()  # the copies come after the checks


def test_without_in_place_targets_are_never_written(tmp_path) -> None:
    path = _saved(tmp_path, {"t": torch.arange(6.0).reshape(2, 3)})
    t = torch.zeros(3, 2).t()
    out = ss.load(path, {"t": t})
    assert out["t"] is not t and not t.any()


def test_a_copied_target_gets_a_new_version_before_the_copy(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A lazy snapshot checks the version after its own copy: a version moved only after
    the write (``copy_`` moves it then) would let a snapshot torn by the load pass."""
    path = _saved(tmp_path, {"t": torch.arange(6.0).reshape(2, 3)})
    t = torch.zeros(3, 2).t()
    before = t._version
    seen: list[int] = []
    copy = torch.Tensor.copy_

    def spying(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self is t:
            seen.append(self._version)
        return copy(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "copy_", spying)
    assert ss.load(path, {"t": t}, in_place=True)["t"] is t
    assert seen and seen[0] > before, (before, seen)
