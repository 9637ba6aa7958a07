"""A multi-process save with compression (2 real processes, torch.distributed gloo):
each rank compresses the chunks it writes in its own files; the checkpoint loads
resharded on the same processes and whole in this one."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _launch import Context, launch  # noqa: E402
from _workers import require_gloo  # noqa: E402

torch, dist = require_gloo()

import statestream as ss  # noqa: E402

THIS = os.path.abspath(__file__)
SHAPE = (2048, 96)


def _full() -> Any:
    import torch

    # few distinct values: every chunk compresses
    return (torch.arange(SHAPE[0] * SHAPE[1], dtype=torch.float32).reshape(SHAPE) % 37) * 0.25


def worker_save(ctx: Context) -> dict[str, Any]:  # runs in the child processes
    import datetime

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ctx.port}", rank=ctx.rank,
                            world_size=ctx.world, timeout=datetime.timedelta(seconds=60))
    try:
        mesh = init_device_mesh("cpu", (ctx.world,))
        state = {"w": distribute_tensor(_full(), mesh, [Shard(0)]),
                 "rep": torch.zeros(5000), "step": 3}
        path = os.path.join(ctx.args["dir"], "ckpt")
        ss.save(path, state, io=ss.IOOptions(max_chunk_bytes=128 << 10),
                compression={"w": "zstd", "rep": ss.Compression(level=3)})
        # reshard: load the row-sharded save as column shards
        target = {"w": distribute_tensor(torch.zeros(SHAPE), mesh, [Shard(1)])}
        out = ss.load(path, target, items=["w"])
        local = out["w"].to_local()
        want = _full()[:, ctx.rank * SHAPE[1] // ctx.world:(ctx.rank + 1) * SHAPE[1] // ctx.world]
        return {"reshard_ok": bool(torch.equal(local, want))}
    finally:
        dist.destroy_process_group()


def test_two_process_save_compresses_each_ranks_chunks(tmp_path: Path) -> None:
    res = launch(THIS, "worker_save", 2, tmp_path, args={"dir": str(tmp_path)}, timeout_s=150)
    assert [r.value["reshard_ok"] for r in res] == [True, True]
    ckpt = tmp_path / "ckpt"
    doc = json.loads((ckpt / "manifest.json").read_bytes())
    assert doc["version"] == 2 and doc["meta"]["world_size"] == 2
    w = doc["arrays"][doc["tree"]["c"][doc["tree"]["k"].index("w")]["a"]]
    files = {doc["files"][c[0]][0][:8] for c in w["chunks"]}
    assert files == {"data/r0-", "data/r1-"}  # both ranks wrote (and compressed) chunks
    assert all(c[7] == {"codec": "zstd", "shuffle": True} for c in w["chunks"])
    out = ss.load(ckpt)
    np.testing.assert_array_equal(out["w"], _full().numpy())
    assert out["step"] == 3 and not out["rep"].any()
    md = ss.metadata(ckpt)
    assert md.tree["w"].codec == "zstd" and md.tree["w"].stored_bytes < md.tree["w"].nbytes / 4
    assert ss.verify(ckpt).ok
