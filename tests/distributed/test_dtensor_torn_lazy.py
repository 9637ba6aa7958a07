"""A DTensor changed in place during a lazy snapshot fails the save on every rank
(torch gloo, real processes).

An in-place op on a DTensor itself (``dt.add_()``, an FSDP2 optimizer step on its
parameters) bumps the DTensor's version counter only, not its local shard's, which
is all the snapshot read: the save committed the changed bytes under checksums
taken of other ones, a checkpoint that failed its own verification.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _launch import Context, launch  # noqa: E402
from _workers import require_gloo  # noqa: E402

torch, dist = require_gloo()

THIS = os.path.abspath(__file__)


def worker(ctx: Context) -> Any:
    from _workers import init_gloo
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import statestream as ss
    from statestream import _hooks

    init_gloo(ctx)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    out: dict[str, Any] = {}
    for case in ctx.args:
        w = distribute_tensor(torch.zeros(64, 32), mesh, [Shard(0)])
        p = torch.nn.Parameter(distribute_tensor(torch.zeros(16, 8), mesh, [Shard(1)]))
        release = threading.Event()
        _hooks.register("async.race_begins", functools.partial(release.wait, 60))  # none copied
        path = Path(ctx.tmp) / case
        h = ss.save_async(path, {"w": w, "p": p, "n": torch.zeros(4)}, lazy=True)
        if ctx.rank == 1:  # no wait_snapshot: the user's error, which the save must catch
            with torch.no_grad():
                if case == "dtensor_add":
                    w.add_(1.0)
                else:
                    p.mul_(2.0).add_(1.0)
        release.set()
        try:
            h.result(timeout=120)
            out[case] = {"raised": None}
        except ss.CheckpointError as exc:
            out[case] = {"raised": type(exc).__name__, "message": str(exc)}
        _hooks.clear()
        dist.barrier()
        out[case]["committed"] = path.exists()
    dist.destroy_process_group()
    return out


@pytest.mark.timeout(300)
def test_a_dtensor_changed_in_place_during_a_lazy_snapshot_fails_the_save(
        tmp_path: Path) -> None:
    cases = {"dtensor_add": "'w'", "parameter_mul": "'p'"}
    results = launch(THIS, "worker", 2, tmp_path, args=list(cases), timeout_s=200)
    for r in results:
        for case, key in cases.items():
            v = r.value[case]
            assert v["raised"] is not None, (r.rank, case, v)
            assert "modified before it was copied" in v["message"], (r.rank, case, v)
            assert key in v["message"], (r.rank, case, v)
            assert not v["committed"], (r.rank, case, v)
