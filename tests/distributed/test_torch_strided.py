"""FSDP2 on top of tensor parallelism: ``_StridedShard`` DTensors (torch gloo, 4 processes).

``fully_shard`` over a module that ``parallelize_module`` sharded on the same dim
marks the FSDP mesh dim ``_StridedShard(dim, split_factor=tp)``. Such a model and
its AdamW state must save and load (same layout, into a 1-D FSDP2 model, as NumPy
on one process), and DTensors whose ``_StridedShard`` local rows are *not* one
block of the global array (``[Shard(0), _StridedShard(0, sf=2)]``: rank 0 holds
rows 0 and 2) must save and load by the rows they really hold. Every check
compares with torch's own ``full_tensor()``.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _launch import Context, launch  # noqa: E402
from _workers import require_gloo  # noqa: E402

torch, dist = require_gloo()
pytest.importorskip("torch.distributed.tensor.parallel")

THIS = os.path.abspath(__file__)


def _build(mesh2: Any, seed: int, tp: bool = True) -> tuple[Any, Any]:
    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(seed)
    # 10 rows over tp=2 then dp=2 (3 + 2 per TP half); 7 rows of the second layer
    model = nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 7))
    if tp:
        parallelize_module(model, mesh2["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(model, mesh=mesh2["dp"])
    else:
        fully_shard(model)  # 1-D over all 4 ranks
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model: Any, opt: Any) -> float:
    import torch

    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(3))
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.item())


def _full_state(model: Any, opt: Any) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    def full(v: Any) -> Any:
        return (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()

    out = {n: full(p) for n, p in model.named_parameters()}
    for i, s in opt.state_dict()["state"].items():
        out.update({f"{i}/{k}": full(v) for k, v in s.items()})
    return out


def _same(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    import torch

    return sorted(k for k in a.keys() | b.keys()
                  if k not in a or k not in b or not torch.equal(a[k], b[k]))


def _fsdp_tp(root: Path, rank: int) -> dict[str, Any]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import statestream as ss

    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model, opt = _build(mesh2, 0)
    _step(model, opt)
    placements = sorted({str(p.placements) for p in model.parameters()})
    ref = _full_state(model, opt)
    ss.save(root / "fsdp_tp", {"model": model, "optim": opt, "step": 1})
    want_loss = _step(model, opt)
    # a fresh model and an optimizer that never stepped, same layout
    model2, opt2 = _build(mesh2, 1)
    ss.load(root / "fsdp_tp", target={"model": model2, "optim": opt2})
    same_layout = _same(_full_state(model2, opt2), ref)
    loss_after = _step(model2, opt2)
    # the same checkpoint into a 1-D FSDP2 model (no tensor parallelism)
    model3, _ = _build(mesh2, 2, tp=False)
    ss.load(root / "fsdp_tp", target={"model": model3}, items=["model"])
    one_d = _same({n: v for n, v in _full_state(model3, opt2).items() if "/" not in n},
                  {n: v for n, v in ref.items() if "/" not in n})
    as_numpy: list[str] = []
    if rank == 0:
        out = ss.load(root / "fsdp_tp", collective=ss.SingleProcess())
        as_numpy = sorted(n for n, p in model.named_parameters()
                          if not torch.equal(torch.from_numpy(out["model"][n]), ref[n]))
    return {"placements": placements, "same_layout": same_layout, "one_d": one_d,
            "as_numpy": as_numpy, "losses_equal": want_loss == loss_after}


def _scattered_rows(root: Path) -> dict[str, Any]:
    """Local rows that are several blocks of the global array, saved and loaded."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    import statestream as ss

    mesh2 = init_device_mesh("cpu", (2, 2))
    layouts = {  # name -> (shape, placements)
        "rows": ((8, 3), [Shard(0), _StridedShard(0, split_factor=2)]),
        "uneven": ((7, 5), [Shard(0), _StridedShard(0, split_factor=2)]),
        "cols": ((3, 9), [_StridedShard(1, split_factor=3), Shard(1)]),
        "mixed": ((6, 10), [Shard(1), _StridedShard(0, split_factor=2)]),
        # one row over 4 ranks: three hold an empty part (in place: still the target)
        "one_row": ((1, 4), [Shard(0), Shard(0)]),
    }
    fulls = {k: torch.arange(float(np.prod(s))).reshape(s) for k, (s, _) in layouts.items()}
    # src_data_rank=None: every rank cuts its part itself (torch's scatter of a
    # _StridedShard wants even sizes)
    ss.save(root / "scattered", {k: distribute_tensor(fulls[k], mesh2, p, src_data_rank=None)
                                 for k, (_, p) in layouts.items()})
    bad = []
    for pl in ([Replicate(), Replicate()], [Shard(1), Shard(0)]):
        out = ss.load(root / "scattered", target={
            k: distribute_tensor(torch.zeros(s), mesh2, pl) for k, (s, _) in layouts.items()})
        bad += [f"{k} into {pl}" for k in layouts if not torch.equal(out[k].full_tensor(),
                                                                     fulls[k])]
    # plain-sharded data into strided targets, fresh and in place
    ss.save(root / "plain", {k: distribute_tensor(fulls[k], mesh2, [Shard(0), Replicate()])
                             for k in layouts})
    for in_place in (False, True):
        like = {k: distribute_tensor(torch.zeros(s), mesh2, p, src_data_rank=None)
                for k, (s, p) in layouts.items()}
        out = ss.load(root / "plain", target=like, in_place=in_place)
        # each rank's part, compared with torch's own cut (its full_tensor() of an
        # uneven _StridedShard is wrong in torch 2.13: "cols" comes back reordered)
        bad += [f"{k} as {p} (in_place={in_place})" for k, (_, p) in layouts.items()
                if not torch.equal(out[k].to_local(), distribute_tensor(
                    fulls[k], mesh2, p, src_data_rank=None).to_local())
                or list(out[k].placements) != p or (in_place and out[k] is not like[k])]
    return {"bad": bad}


def _partial_target(root: Path) -> str:
    """A Partial target would hold the whole array on every rank (a sum of N copies):
    refused, naming the key path, like a Partial DTensor to save."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    import statestream as ss

    mesh = init_device_mesh("cpu", (4,))
    ss.save(root / "for_partial", {"w": torch.arange(6.0)})
    like = {"w": DTensor.from_local(torch.zeros(6), mesh, [Partial()])}
    try:
        out = ss.load(root / "for_partial", target=like)
    except ss.DistributedError as exc:
        return str(exc)
    return f"loaded; its full tensor is {out['w'].full_tensor().tolist()}"


def worker(ctx: Context) -> dict[str, Any]:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ctx.port}", rank=ctx.rank,
                            world_size=ctx.world, timeout=datetime.timedelta(seconds=90))
    out: dict[str, Any] = {}
    checks = {"fsdp_tp": lambda: _fsdp_tp(Path(ctx.tmp), ctx.rank),
              "scattered": lambda: _scattered_rows(Path(ctx.tmp)),
              "partial_target": lambda: _partial_target(Path(ctx.tmp))}
    for name, fn in checks.items():
        try:
            out[name] = {"ok": True, "value": fn()}
        except Exception:  # noqa: BLE001 - reported to the pytest process
            out[name] = {"ok": False, "error": traceback.format_exc()}
        dist.barrier()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("strided")
    return [r.value for r in launch(THIS, "worker", 4, tmp, timeout_s=240)]


def _values(results: list[dict[str, Any]], name: str) -> list[Any]:
    for rank, r in enumerate(results):
        assert r[name]["ok"], f"rank {rank}:\n{r[name].get('error')}"
    return [r[name]["value"] for r in results]


def test_fsdp2_with_tensor_parallel_saves_and_loads(results: list[dict[str, Any]]) -> None:
    for v in _values(results, "fsdp_tp"):
        assert any("_StridedShard" in p for p in v["placements"]), v["placements"]
        assert v["same_layout"] == [] and v["one_d"] == [] and v["as_numpy"] == []
        assert v["losses_equal"]


def test_strided_shard_rows_that_are_not_one_block(results: list[dict[str, Any]]) -> None:
    for v in _values(results, "scattered"):
        assert v["bad"] == []


def test_partial_target_is_refused(results: list[dict[str, Any]]) -> None:
    for v in _values(results, "partial_target"):
        assert "key path 'w' has placement P(sum)" in v, v
