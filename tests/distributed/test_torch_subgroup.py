"""Saves and loads on subgroups of a torch job (gloo, 4 real processes).

``TorchCollective(group=g)`` is created, and used, only on ``g``'s ranks: two
subgroups save at once, a subgroup without rank 0 saves synchronously and
asynchronously, and afterwards the job's next group (created by every rank, as
torch wants) still works. A rank outside ``g`` that creates one is told so.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _launch import Context, launch  # noqa: E402
from _workers import require_gloo  # noqa: E402

torch, dist = require_gloo()

THIS = os.path.abspath(__file__)


def _save_and_load(root: Path, name: str, group: Any, rank: int) -> dict[str, Any]:
    import torch

    import statestream as ss

    coll = ss.TorchCollective(group=group, timeout_s=60)
    state = {"w": torch.arange(4.0), f"own{rank}": torch.full((2,), float(rank)), "step": 5}
    ss.save(root / name, state, collective=coll)
    ss.save_async(root / f"{name}-async", state, collective=coll).result()
    out = {k: ss.load(root / p, collective=coll) for k, p in (("sync", name),
                                                                ("async", f"{name}-async"))}
    return {"collective": [coll.rank, coll.world_size],
            **{k: sorted(v) for k, v in out.items()},
            "values": {k: v.tolist() if hasattr(v, "tolist") else v
                       for k, v in out["sync"].items()}}


def worker(ctx: Context) -> dict[str, Any]:
    import datetime

    import torch
    import torch.distributed as dist

    import statestream as ss

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ctx.port}", rank=ctx.rank,
                            world_size=ctx.world, timeout=datetime.timedelta(seconds=60))
    rank, root = ctx.rank, Path(ctx.tmp)
    # every rank creates every group (torch's rule for new_group)
    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    odd = dist.new_group([1, 3])
    out: dict[str, Any] = {}
    # two subgroups at once, each its own checkpoint
    out["half"] = _save_and_load(root, f"half{rank // 2}", halves[rank // 2], rank)
    if rank in (1, 3):  # a subgroup without rank 0; ranks 0 and 2 do not take part
        out["odd"] = _save_and_load(root, "odd", odd, rank)
    else:
        try:
            ss.TorchCollective(group=odd)
            out["outsider"] = "created"
        except ss.InvalidOptionError as exc:
            out["outsider"] = str(exc)
    # the job's next group still works on every rank
    everyone = dist.new_group(list(range(ctx.world)))
    t = torch.ones(1)
    dist.all_reduce(t, group=everyone)
    out["after"] = float(t.item())
    return out


def test_subgroups_save_and_load_without_the_other_ranks(tmp_path: Path) -> None:
    res = {r.rank: r.value for r in launch(THIS, "worker", 4, tmp_path, timeout_s=120)}
    for rank, v in res.items():
        assert v["after"] == 4.0
        half = v["half"]
        assert half["collective"] == [rank % 2, 2]
        mates = sorted(f"own{r}" for r in (rank // 2 * 2, rank // 2 * 2 + 1))
        assert half["sync"] == half["async"] == sorted(["step", "w", *mates])
        assert half["values"][f"own{rank}"] == [float(rank)] * 2
    for rank in (1, 3):
        assert res[rank]["odd"]["collective"] == [rank // 2, 2]
        assert res[rank]["odd"]["sync"] == ["own1", "own3", "step", "w"]
    for rank in (0, 2):
        assert f"rank {rank} of the job" in res[rank]["outsider"]
        assert "not a member of the group" in res[rank]["outsider"]
