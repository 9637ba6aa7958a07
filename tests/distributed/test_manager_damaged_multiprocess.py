"""A damaged newest step, found by one rank only, makes every rank go back to the same
step (2 gloo processes, loopback only).

Rank 1 alone reads the damaged bytes (each rank loads only its own arrays), so
rank 0 sees no damage itself: it learns of it from the agreement
(``DistributedError.failed_types``), and both ranks load the step before.
"""

from __future__ import annotations

import glob
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _launch import Context, launch  # noqa: E402
from _workers import require_gloo  # noqa: E402

torch, dist = require_gloo()

THIS = os.path.abspath(__file__)
pytestmark = pytest.mark.timeout(300)


def _value(rank: int, step: int) -> float:
    return 10.0 * rank + step


def worker(ctx: Context) -> dict[str, Any]:
    import datetime
    import warnings

    import torch
    import torch.distributed as dist

    import statestream as ss

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ctx.port}", rank=ctx.rank,
                            world_size=ctx.world, timeout=datetime.timedelta(seconds=60))
    coll = ss.TorchCollective(timeout_s=60)
    mine = f"r{ctx.rank}"
    with ss.CheckpointManager(ctx.args["dir"], async_save=False, collective=coll) as mgr:
        if ctx.args["phase"] == "save":
            for s in (1, 2):
                mgr.save(s, {"own": {mine: torch.full((2048,), _value(ctx.rank, s))},
                             "step": s})
            return {}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = mgr.load(target={"own": {mine: torch.zeros(2048)}, "step": 0})
    return {"step": out["step"], "value": float(out["own"][mine][0]),
            "warnings": [str(w.message) for w in caught
                         if issubclass(w.category, RuntimeWarning)]}


def _file_holding(step_dir: Path, value: float) -> str:
    pattern = np.full(16, value, np.float32).tobytes()
    (hit,) = [f for f in glob.glob(str(step_dir / "data" / "*"))
              if pattern in Path(f).read_bytes()]
    return hit


def test_every_rank_goes_back_to_the_same_step(tmp_path: Path) -> None:
    d = tmp_path / "run"
    launch(THIS, "worker", 2, tmp_path, args={"dir": str(d), "phase": "save"}, timeout_s=180)
    f = _file_holding(d / "step_0000000002", _value(1, 2))
    data = bytearray(Path(f).read_bytes())
    at = data.index(np.full(16, _value(1, 2), np.float32).tobytes()) + 8
    data[at] ^= 1
    Path(f).write_bytes(bytes(data))
    res = launch(THIS, "worker", 2, tmp_path / "load", args={"dir": str(d), "phase": "load"},
                 timeout_s=180)
    for r in res:
        v = r.value
        assert v["step"] == 1 and v["value"] == _value(r.rank, 1), (r.rank, v)
        assert len(v["warnings"]) == 1, v
        assert "step 2 in" in v["warnings"][0] and "loading step 1" in v["warnings"][0]
        assert "rank 1 failed" in v["warnings"][0] and "ChecksumMismatchError" in v["warnings"][0]
