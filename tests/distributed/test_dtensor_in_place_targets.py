"""``in_place=True`` into DTensor targets fills the caller's DTensors (torch gloo, 2 processes).

The checkpoint holds an FSDP2 (``fully_shard``) ``nn.Linear(3, 5)``: 5 rows, so rank 0
holds rows 0-2 and rank 1 rows 3-4. Targets of other placements and dtypes were
already filled in place. A target whose local tensor had another shape than its
placements give the rank (``DTensor.from_local(..., run_check=False)``) was not: the
load returned a new DTensor in its place, so the caller's own tensor (a model's
parameter) silently kept its old values. Now a padded shard (larger along the sharded
dim) gets its real part filled (its padding left as it was) and the same object back,
of the saved dtype (read into it) or another (copied in); a local tensor too small for
its shard is refused on every rank, naming the key path and the checkpoint, before
anything is read.
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


def _filled(name: str, got: dict[str, Any], target: dict[str, Any], rows: int) -> Any:
    """What the test checks of one in-place load: the same objects came back, and the
    first ``rows`` rows of each local tensor as lists (the rest: what stayed)."""
    return {"name": name, "same": all(got[k] is target[k] for k in target),
            "local": {k: t.to_local().float().tolist() for k, t in target.items()},
            "rows": rows}


def worker(ctx: Context) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    import statestream as ss

    init_gloo(ctx)
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 5)
    whole = {k: v.detach().clone() for k, v in model.state_dict().items()}
    fully_shard(model, mesh=mesh)
    ck = str(Path(ctx.tmp) / "ck")
    ss.save(ck, {"model": model.state_dict()})
    out: dict[str, Any] = {"whole": {k: v.tolist() for k, v in whole.items()}, "cases": []}

    def padded(dtype: Any) -> dict[str, Any]:  # 3 rows on each rank: rank 1's last is padding
        return {k: DTensor.from_local(torch.full((3, *v.shape[1:]), -7.0, dtype=dtype), mesh,
                                      [Shard(0)], run_check=False, shape=v.shape,
                                      stride=v.stride()) for k, v in whole.items()}

    torch.manual_seed(1)
    other = torch.nn.Linear(3, 5)
    fully_shard(other, mesh=mesh)
    targets = {
        "fsdp": dict(other.state_dict()),
        "replicated": {k: distribute_tensor(torch.zeros_like(v), mesh, [Replicate()])
                       for k, v in whole.items()},
        "padded": padded(torch.float32),
        "padded_float64": padded(torch.float64),
    }
    for name, target in targets.items():
        got = ss.load(ck, {"model": target}, in_place=True)["model"]
        out["cases"].append(_filled(name, got, target, 3 if ctx.rank == 0 else 2))
    short = {k: DTensor.from_local(torch.full((1, *v.shape[1:]), -7.0), mesh, [Shard(0)],
                                   run_check=False, shape=v.shape, stride=v.stride())
             for k, v in whole.items()}
    try:
        ss.load(ck, {"model": short}, in_place=True)
        out["short"] = None
    except ss.CheckpointError as exc:
        out["short"] = str(exc)
    out["short_left"] = {k: t.to_local().tolist() for k, t in short.items()}
    dist.destroy_process_group()
    return out


@pytest.mark.timeout(300)
def test_in_place_fills_the_callers_dtensors_or_refuses(tmp_path: Path) -> None:
    results = launch(THIS, "worker", 2, tmp_path, timeout_s=200)
    for r in results:
        whole = r.value["whole"]
        first = 0 if r.rank == 0 else 3
        for case in r.value["cases"]:
            assert case["same"], (r.rank, case)
            for k, local in case["local"].items():
                rows = case["rows"]
                assert local[:rows] == whole[k][first:first + rows] or (
                    case["name"] == "replicated" and local == whole[k]), (r.rank, case, k)
                if case["name"].startswith("padded") and r.rank == 1:
                    assert local[rows:] == [[-7.0] * 3] if k == "weight" else [-7.0], local
        msg = r.value["short"]
        assert msg is not None, r.rank
        assert "TargetMismatchError: loading " in msg, msg
        assert "/ck: the target DTensor at key path " in msg, msg
        assert "'model/weight'" in msg or "'model/bias'" in msg, msg
        assert "has a local tensor of shape [1" in msg and "in_place=True cannot fill it" in msg
        assert all(v == [[-7.0] * 3] or v == [-7.0] for v in r.value["short_left"].values())
