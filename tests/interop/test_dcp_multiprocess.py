"""A DCP checkpoint written by 2 real gloo processes (DTensor shards) is read whole and exact."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "distributed"))
from _launch import Context, launch  # noqa: E402

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():  # pragma: no cover
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

import statestream as ss  # noqa: E402

THIS = os.path.abspath(__file__)


def _full() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    return {"rows": torch.randn(10, 6, generator=g),
            "cols": torch.randn(4, 9, generator=g).to(torch.bfloat16),
            "rep": torch.arange(5, dtype=torch.int64)}


def worker_save(ctx: Context) -> str:
    import datetime
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ctx.port}", rank=ctx.rank,
                            world_size=ctx.world, timeout=datetime.timedelta(seconds=90))
    mesh = init_device_mesh("cpu", (ctx.world,))
    full = _full()
    state = {"model": {"rows": distribute_tensor(full["rows"], mesh, [Shard(0)]),
                       "cols": distribute_tensor(full["cols"], mesh, [Shard(1)]),
                       "rep": distribute_tensor(full["rep"], mesh, [Replicate()])},
             "step": 11}
    dcp.save(state, checkpoint_id=ctx.args["dir"])
    dist.barrier()
    dist.destroy_process_group()
    return "ok"


@pytest.mark.timeout(300)
def test_sharded_dcp_reads_whole_and_exact(tmp_path: Path) -> None:
    d = tmp_path / "dcp"
    launch(THIS, "worker_save", 2, tmp_path, args={"dir": str(d)}, timeout_s=150)
    full = _full()
    md = ss.metadata(d)
    assert md.tree["model"]["rows"].num_chunks >= 2  # one box per rank
    out = ss.load(d, target={"model": {k: torch.zeros_like(v) for k, v in full.items()},
                             "step": 0})
    for k, v in full.items():
        assert torch.equal(out["model"][k], v), k
    assert out["step"] == 11
    ss.convert(d, tmp_path / "ck")
    back = ss.load(tmp_path / "ck", target={"model": {"cols": torch.zeros(4, 9,
                                                                         dtype=torch.bfloat16)}})
    assert torch.equal(back["model"]["cols"], full["cols"])


def worker_load_dtensors(ctx: Context) -> str:
    """Each rank loads foreign checkpoints into DTensor targets with other placements."""
    import datetime
    import warnings

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ctx.port}", rank=ctx.rank,
                            world_size=ctx.world, timeout=datetime.timedelta(seconds=90))
    mesh = init_device_mesh("cpu", (ctx.world,))
    full = _full()
    places = {"rows": [Shard(1)], "cols": [Shard(0)], "rep": [Replicate()]}
    for path, wrap in ctx.args["paths"]:
        target = {k: distribute_tensor(torch.zeros_like(v), mesh, places[k])
                  for k, v in full.items()}
        out = ss.load(path, target={"model": target, "step": 0} if wrap else target)
        got = out["model"] if wrap else out
        for k, v in full.items():
            assert list(got[k].placements) == places[k], (path, k)
            assert torch.equal(got[k].full_tensor(), v), (path, k)
    dist.barrier()
    dist.destroy_process_group()
    return "ok"


@pytest.mark.timeout(300)
def test_foreign_checkpoints_load_into_resharded_dtensors(tmp_path: Path) -> None:
    """safetensors (one file) and a DCP saved as Shard(0)/Shard(1) load into DTensors
    placed differently (resharding), each rank reading its own shard."""
    from safetensors.torch import save_file

    d = tmp_path / "dcp"
    launch(THIS, "worker_save", 2, tmp_path, args={"dir": str(d)}, timeout_s=150)
    save_file(_full(), tmp_path / "m.safetensors")
    paths = [(str(tmp_path / "m.safetensors"), False), (str(d), True)]
    res = launch(THIS, "worker_load_dtensors", 2, tmp_path, args={"paths": paths},
                 timeout_s=150, tag="load-dtensors")
    assert len(res) == 2
