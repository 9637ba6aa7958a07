"""Loading into FSDP2 models built on the meta device (gloo, 2 real processes).

A DTensor target on the meta device gives a layout only: its shard is loaded
onto the mesh's device, never left on meta (which silently dropped the
values). A module target whose parameters are on meta gets them by
``load_state_dict(..., assign=True)`` (copying into a meta tensor does nothing).
"""

from __future__ import annotations

import datetime
import os
import sys
from typing import Any

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _launch import Context, launch  # noqa: E402
from _workers import require_gloo  # noqa: E402

torch, dist = require_gloo()
pytest.importorskip("torch.distributed.fsdp")

THIS = os.path.abspath(__file__)


def _net() -> Any:
    import torch

    # 5 output rows: an uneven split over 2 ranks
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 5))


def _meta_fsdp() -> Any:
    import torch
    from torch.distributed.fsdp import fully_shard

    with torch.device("meta"):
        model = _net()
    fully_shard(model)
    return model


def worker(ctx: Context) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    import statestream as ss

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ctx.port}", rank=ctx.rank,
                            world_size=ctx.world, timeout=datetime.timedelta(seconds=90))
    torch.manual_seed(0)
    src = _net()
    fully_shard(src)
    ck = os.path.join(ctx.tmp, "ck")
    ss.save(ck, {"model": src})
    want = {k: v.full_tensor() for k, v in src.state_dict().items()}
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(7))
    out: dict[str, Any] = {}

    got = ss.load(ck, target={"model": _meta_fsdp().state_dict()})["model"]
    out["dict_types"] = sorted({f"{type(v).__name__}/{v.to_local().device}" for v in got.values()})
    out["dict_equal"] = all(torch.equal(got[k].full_tensor(), w) for k, w in want.items())

    model = _meta_fsdp()
    ss.load(ck, target={"model": model})
    sd = model.state_dict()
    out["module_types"] = sorted({f"{type(v).__name__}/{v.to_local().device}" for v in sd.values()})
    out["module_equal"] = all(torch.equal(sd[k].full_tensor(), w) for k, w in want.items())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # it trains, as a loaded model
    y = model(x)
    out["forward_equal"] = bool(torch.equal(y, src(x)))
    y.square().mean().backward()
    opt.step()
    out["trained"] = not all(torch.equal(model.state_dict()[k].full_tensor(), w)
                             for k, w in want.items())
    out["params_are_dtensors"] = all(isinstance(p, DTensor) for p in model.parameters())
    dist.destroy_process_group()
    return out


def test_meta_fsdp2_targets_are_loaded_not_left_on_meta(tmp_path: Any) -> None:
    for r in launch(THIS, "worker", 2, tmp_path, timeout_s=180):
        v = r.value
        assert v["dict_types"] == ["DTensor/cpu"], v
        assert v["dict_equal"], v
        assert v["module_types"] == ["DTensor/cpu"], v
        assert v["module_equal"] and v["forward_equal"], v
        assert v["trained"] and v["params_are_dtensors"], v
