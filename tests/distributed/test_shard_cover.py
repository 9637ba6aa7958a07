"""The ranks' pieces of a sharded array must cover it exactly once, checked while planning
(torch gloo, 2 processes).

A DTensor saved at a key path by one rank only, as a DTensor on one rank and a plain
tensor on the other, or with Shard(0) on one rank and Shard(1) on the other, used to be
written by every rank and refused only at the commit ("array 1's chunks cover 8 of its
16 elements", no key path, no rank). Now every rank raises the same DistributedError
before a byte of data is written (counted at the ``save.chunk_written`` hook point),
naming the key path, the part held by no rank or in two boxes, and who holds what. Plain
tensors on some ranks only, and replicated DTensors, still save.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _launch import Context, launch  # noqa: E402
from _workers import require_gloo  # noqa: E402

torch, dist = require_gloo()

THIS = os.path.abspath(__file__)


def _states(rank: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    full = torch.arange(16.0).reshape(4, 4)
    rows, cols = (distribute_tensor(full, mesh, [p]) for p in (Shard(0), Shard(1)))
    big = torch.arange(1 << 16, dtype=torch.float32)  # data that would be written first
    mine = {"extra": rows} if rank == 1 else {}
    return {
        "on_one_rank": {"w": big, "b": torch.ones(2), **mine},
        # the same again: a plan kept from an earlier save is never one that failed
        "on_one_rank_again": {"w": big, "b": torch.ones(2), **mine},
        "dtensor_and_plain": {"w": big, "a": rows if rank == 0 else torch.zeros(4, 4)},
        "shard0_and_shard1": {"w": big, "a": rows if rank == 0 else cols},
        # these hold every element once: saved as before
        "fine": {"w": big, "rows": rows, "cols": cols,
                 "rep": distribute_tensor(full, mesh, [Replicate()]),
                 **({"only1": torch.arange(3)} if rank == 1 else {})},
    }


def worker(ctx: Context) -> Any:
    import datetime

    import torch.distributed as dist

    import statestream as ss
    from statestream import _hooks

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ctx.port}", rank=ctx.rank,
                            world_size=ctx.world, timeout=datetime.timedelta(seconds=60))
    written = [0]
    _hooks.register("save.chunk_written", lambda: written.__setitem__(0, written[0] + 1))
    out: dict[str, Any] = {}
    for case, state in _states(ctx.rank).items():
        target = Path(ctx.tmp) / case / "ck"
        target.parent.mkdir(parents=True, exist_ok=True)
        written[0] = 0
        try:
            ss.save(target, state)
            got = ss.load(target)
            out[case] = {"raised": None, "loaded": {k: v.tolist() for k, v in got.items()
                                                    if k != "w"}}
        except ss.CheckpointError as exc:
            out[case] = {"raised": type(exc).__name__, "message": str(exc)}
        out[case]["chunks_written"] = written[0]
        out[case]["left"] = sorted(os.listdir(target.parent))
        dist.barrier()
    dist.destroy_process_group()
    return out


@pytest.mark.timeout(300)
def test_pieces_that_miss_or_overlap_are_refused_before_writing(tmp_path: Path) -> None:
    results = launch(THIS, "worker", 2, tmp_path, timeout_s=150)
    views = {
        "on_one_rank": ("rows 0-1 of key path 'extra' (float32[4, 4]) are held by no rank "
                        "(8 of its 16 elements are); rank 1 holds rows 2-3; rank 0 has no "
                        "such key path",),
        "dtensor_and_plain": ("rows 0-1 of key path 'a' (float32[4, 4]) are held by ranks 0 "
                              "and 1 with different boxes; rank 0 holds rows 0-1; rank 1 "
                              "holds the whole array",),
        "shard0_and_shard1": ("elements [0:2, 2:4] of key path 'a' (float32[4, 4]) are held "
                              "by ranks 0 and 1 with different boxes; rank 0 holds rows 0-1; "
                              "rank 1 holds columns 2-3",),
    }
    views["on_one_rank_again"] = views["on_one_rank"]
    for r in results:
        for case, expect in views.items():
            v = r.value[case]
            assert v["raised"] == "DistributedError", (r.rank, case, v)
            assert v["message"].startswith("rank 0 failed during planning: "), v["message"]
            for text in expect:
                assert text in v["message"], (r.rank, case, text, v["message"])
            assert v["message"].endswith("nothing was written; nothing was committed")
            assert v["chunks_written"] == 0, (r.rank, case, v)
            assert v["left"] == [], (r.rank, case, v)
        fine = r.value["fine"]
        assert fine["raised"] is None, fine
        full = [[4.0 * i + j for j in range(4)] for i in range(4)]
        assert fine["loaded"] == {"rows": full, "cols": full, "rep": full, "only1": [0, 1, 2]}
