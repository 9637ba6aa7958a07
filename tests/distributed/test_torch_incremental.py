"""Incremental saves across processes (2 real processes, torch.distributed gloo):
each rank hashes the chunks it writes and refers to the base's equal chunks; the
checkpoint loads resharded on the same processes and whole in this one; an
incremental manager run keeps what its kept steps refer to, and one with
incremental=2 makes the same full saves on both ranks."""

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
SHAPE = (1024, 64)
CHUNK = 32 << 10


def _frozen() -> Any:
    import torch

    return torch.arange(SHAPE[0] * SHAPE[1], dtype=torch.float32).reshape(SHAPE) * 0.5


def _trained(step: int) -> Any:
    import torch

    return torch.full((256, 32), float(step))


def worker(ctx: Context) -> dict[str, Any]:  # runs in the child processes
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
        io = ss.IOOptions(max_chunk_bytes=CHUNK)
        d = ctx.args["dir"]

        def state(step: int) -> dict[str, Any]:
            return {"frozen": distribute_tensor(_frozen(), mesh, [Shard(0)]),
                    "trained": distribute_tensor(_trained(step), mesh, [Shard(0)]),
                    "rep": torch.ones(1000), "step": step}

        ss.save(os.path.join(d, "s1"), state(1), io=io, hashes=True)
        ss.save(os.path.join(d, "s2"), state(2), io=io, base=os.path.join(d, "s1"))
        h = ss.save_async(os.path.join(d, "s3"), state(3), io=io, base=os.path.join(d, "s2"))
        h.result()
        try:  # s1 holds what s2 and s3 refer to: replacing it is refused on every rank
            ss.save(os.path.join(d, "s1"), state(9), io=io, overwrite=True)
            refused = ""
        except ss.CheckpointError as exc:
            refused = str(exc)
        target = {"frozen": distribute_tensor(torch.zeros(SHAPE), mesh, [Shard(1)]),
                  "trained": distribute_tensor(torch.zeros(256, 32), mesh, [Shard(1)])}
        out = ss.load(os.path.join(d, "s3"), target, items=["frozen", "trained"])
        cols = slice(ctx.rank * SHAPE[1] // ctx.world, (ctx.rank + 1) * SHAPE[1] // ctx.world)
        tcols = slice(ctx.rank * 32 // ctx.world, (ctx.rank + 1) * 32 // ctx.world)
        ok = (bool(torch.equal(out["frozen"].to_local(), _frozen()[:, cols]))
              and bool(torch.equal(out["trained"].to_local(), _trained(3)[:, tcols])))
        with ss.CheckpointManager(os.path.join(d, "run"), incremental=True, async_save=False,
                                  keep_policy=ss.KeepLatest(1), io=io) as mgr:
            for step in (1, 2, 3):
                mgr.save(step, state(step))
            steps = mgr.steps()
            got = mgr.load()
        # incremental=2: both ranks take rank 0's reading of the base's depth
        with ss.CheckpointManager(os.path.join(d, "chain"), incremental=2, async_save=False,
                                  io=io) as mgr:
            for step in range(1, 8):
                mgr.save(step, state(step))
        return {"reshard_ok": ok, "steps": steps, "step": got["step"], "refused": refused}
    finally:
        dist.destroy_process_group()


def _files_bytes(ck: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in (ck / "data").iterdir()}


def test_two_process_incremental_saves(tmp_path: Path) -> None:
    res = launch(THIS, "worker", 2, tmp_path, args={"dir": str(tmp_path)}, timeout_s=170)
    assert [r.value["reshard_ok"] for r in res] == [True, True]
    for r in res:
        assert "is the base of the incremental checkpoint(s) s2, s3" in r.value["refused"], r.value
    assert res[0].value["steps"] == [3]  # rank 0 deletes (the others may list before it did)
    assert [r.value["step"] for r in res] == [3, 3]
    trained_bytes = 256 * 32 * 4
    for name in ("s2", "s3"):
        ck = tmp_path / name
        # each rank wrote only its half of the changed array; the rest are references
        sizes = _files_bytes(ck)
        assert sum(sizes.values()) == trained_bytes, sizes
        assert {n[:3] for n, s in sizes.items() if s} == {"r0-", "r1-"}
        doc = json.loads((ck / "manifest.json").read_bytes())
        assert doc["bases"] == ["s1"] and doc["meta"]["world_size"] == 2
        frozen = doc["arrays"][doc["tree"]["c"][doc["tree"]["k"].index("frozen")]["a"]]
        assert all(c[7]["ref"] == 0 for c in frozen["chunks"])
        assert ss.verify(ck).ok
    out = ss.load(tmp_path / "s3")
    np.testing.assert_array_equal(out["frozen"], _frozen().numpy())
    np.testing.assert_array_equal(out["trained"], _trained(3).numpy())
    assert out["step"] == 3 and out["rep"].all()
    # the manager run: step 3 kept, step 1 retired (holds 'frozen'), step 2 deleted
    run = tmp_path / "run"
    assert sorted(p.name for p in run.glob("step_*")) == ["step_0000000001", "step_0000000003"]
    np.testing.assert_array_equal(ss.load(run / "step_0000000003")["frozen"], _frozen().numpy())
    # incremental=2 on two ranks: every third save is full, each step whole
    chain = [tmp_path / "chain" / f"step_{s:010d}" for s in range(1, 8)]
    assert [s for s, ck in enumerate(chain, 1) if not ss.metadata(ck).bases] == [1, 4, 7]
    for s, ck in enumerate(chain, 1):
        out = ss.load(ck)
        np.testing.assert_array_equal(out["frozen"], _frozen().numpy())
        np.testing.assert_array_equal(out["trained"], _trained(s).numpy())
