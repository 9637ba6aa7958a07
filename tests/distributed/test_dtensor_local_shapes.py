"""DTensors whose local tensors do not match their placements (torch gloo, 2 processes).

``DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=...)`` trusts the
caller: a local tensor smaller than the shard torch's placements give the rank (2 rows
where rows 0-2 of 6 are its shard) was saved as it was, its chunks short, and the
checkpoint committed with a manifest claiming bytes no data file held: the load then
failed with "TruncatedFileError: ... needs bytes [0, 36) of data/r0-0.bin, which has
only 24 bytes". Now the walk refuses it, on every rank, naming the key path, the local
shape and the shard's shape, and nothing is committed. So is one larger along a dim no
placement shards (3 columns where the global shape has 2: one was dropped unseen); one
larger along a sharded dim is a padded shard, whose real part is saved (as before).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _launch import Context, launch  # noqa: E402
from _workers import init_gloo, require_gloo  # noqa: E402

torch, dist = require_gloo()

THIS = os.path.abspath(__file__)


def _states(rank: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (2,))

    def local(rows: int) -> Any:
        return torch.arange(3.0 * rows).reshape(rows, 3) + 100 * rank

    def dt(rows: int, global_rows: int) -> Any:
        return DTensor.from_local(local(rows), mesh, [Shard(0)], run_check=False,
                                  shape=torch.Size((global_rows, 3)), stride=(3, 1))

    return {
        # torch gives each rank 3 of the 6 rows; each passes 2
        "short_on_both": {"w": dt(2, 6)},
        # 5 rows: torch gives rank 0 rows 0-2, rank 1 rows 3-4; rank 0 passes 2, rank 1 3
        "short_on_rank_0": {"w": dt(2 + rank, 5)},
        # 3 columns where the global shape says 2: part of it would be dropped unseen
        "wide": {"w": DTensor.from_local(local(3), mesh, [Shard(0)], run_check=False,
                                         shape=torch.Size((6, 2)), stride=(2, 1))},
        # a padded shard: 3 rows on each rank, rank 1's last one padding
        "padded": {"w": dt(3, 5)},
    }


def worker(ctx: Context) -> Any:
    import statestream as ss

    init_gloo(ctx)
    out: dict[str, Any] = {}
    for case, state in _states(ctx.rank).items():
        target = Path(ctx.tmp) / case / "ck"
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            ss.save(target, state)
            out[case] = {"raised": None, "loaded": ss.load(target)["w"].tolist()}
        except ss.CheckpointError as exc:
            out[case] = {"raised": type(exc).__name__, "message": str(exc)}
        out[case]["left"] = sorted(os.listdir(target.parent))
        dist.barrier()
    dist.destroy_process_group()
    return out


@pytest.mark.timeout(300)
def test_a_local_tensor_smaller_than_its_shard_is_refused(tmp_path: Path) -> None:
    results = launch(THIS, "worker", 2, tmp_path, timeout_s=150)
    for r in results:
        for case, ranks in (("short_on_both", (0, 1)), ("short_on_rank_0", (0,))):
            v = r.value[case]
            assert v["raised"] == "DistributedError", (r.rank, case, v)
            for rank in ranks:
                assert f"rank {rank} failed during walking the state: " in v["message"], v
            assert "rank 1 failed" in v["message"] if ranks == (0, 1) else (
                "rank 1 failed" not in v["message"]), v["message"]
            assert ("DTensor at key path 'w' (global shape [" in v["message"]
                    and "has a local tensor of shape [2, 3] on this rank, but its placements "
                    "give this rank a shard of shape [3, 3]" in v["message"]), v["message"]
            assert v["message"].endswith("nothing was committed"), v["message"]
            assert v["left"] == [], (r.rank, case, v)
        wide = r.value["wide"]
        assert wide["raised"] == "DistributedError", wide
        assert ("has a local tensor of shape [3, 3] on this rank, but its placements give "
                "this rank a shard of shape [3, 2]" in wide["message"]), wide["message"]
        assert wide["left"] == [], wide
        padded = r.value["padded"]
        assert padded["raised"] is None, padded
        want = [[float(i * 3 + j) for j in range(3)] for i in range(3)]
        want += [[100.0 + i * 3 + j for j in range(3)] for i in range(2)]
        assert padded["loaded"] == want
