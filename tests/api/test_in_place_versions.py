"""An in-place load writes torch tensors' bytes through a pointer; it moves the version
counter of each tensor it writes, as ``t.copy_()`` would, once its walk is over and
before any byte is read. Autograd then refuses a graph that saved the old values, and
a lazy snapshot sees the change (tests/api/test_torn_snapshot.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import statestream as ss
import statestream.api._load as load_mod
from statestream.errors import MissingKeyError

torch = pytest.importorskip("torch")


def test_each_tensor_written_in_place_gets_a_new_version_before_the_reads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    state = {"t": torch.randn(6, 5), "p": torch.nn.Parameter(torch.randn(20)),
             "big": torch.randn(300, 4), "model": model}
    ss.save(tmp_path / "c", state, io=ss.IOOptions(max_chunk_bytes=1024))  # "big": 5 chunks
    target = {"t": torch.zeros(6, 5), "p": torch.nn.Parameter(torch.zeros(20)),
              "big": torch.zeros(300, 4), "model": torch.nn.Linear(4, 3)}
    tensors = {"t": target["t"], "p": target["p"], "big": target["big"],
               "model.weight": target["model"].weight, "model.bias": target["model"].bias}
    before = {k: v._version for k, v in tensors.items()}
    seen: list[dict[str, int]] = []
    read = load_mod.read_requests

    def reading(*args: Any, **kwargs: Any) -> Any:
        seen.append({k: v._version for k, v in tensors.items()})
        return read(*args, **kwargs)

    monkeypatch.setattr(load_mod, "read_requests", reading)
    ss.load(tmp_path / "c", {k: target[k] for k in ("t", "p", "big")})  # a copy: not written
    assert seen[-1] == before and {k: v._version for k, v in tensors.items()} == before
    ss.load(tmp_path / "c", target, in_place=True)
    # moved before a byte was read (a module's load_state_dict moves them again, after)
    assert all(seen[-1][k] > before[k] for k in tensors), (before, seen[-1])
    assert torch.equal(target["big"], state["big"])
    assert torch.equal(target["model"].weight.detach(), model.weight.detach())


def test_autograd_refuses_a_graph_whose_leaf_was_loaded_in_place(tmp_path: Path) -> None:
    ss.save(tmp_path / "x", {"x": torch.full((3,), 5.0)})
    x = torch.full((3,), 2.0, requires_grad=True)
    y = (x * x).sum()
    ss.load(tmp_path / "x", {"x": x}, in_place=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()  # was: silently grad 2 * 5, from values the graph never saw


def test_a_load_refused_by_its_walk_moves_no_version(tmp_path: Path) -> None:
    ss.save(tmp_path / "c", {"a": torch.ones(3)})
    a = torch.zeros(3)
    with pytest.raises(MissingKeyError):
        ss.load(tmp_path / "c", {"a": a, "b": torch.zeros(3)}, in_place=True)
    assert a._version == 0 and not a.any()
