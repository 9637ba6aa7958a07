"""A rank whose own code raised inside ``with CheckpointManager(...)`` is named, with
its error, by the other ranks' failed collectives (2 gloo processes, loopback only).

The leaving rank records why in the rendezvous store before closing; rank 0, still
saving, fails in its next collective (a timeout, or a peer gone) and its error says
"rank 1 left first: its with CheckpointManager(...) block raised ValueError: ...".
When every rank leaves alike (Ctrl-C under torchrun), the async save in flight still
commits, and the next manager does not read the records left by the last one.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _launch import Context, launch  # noqa: E402
from _workers import init_gloo, require_gloo  # noqa: E402

torch, dist = require_gloo()

THIS = os.path.abspath(__file__)
#: short, so the waits end soon; the assertions are on messages, not durations
TIMEOUT_S = 20
pytestmark = pytest.mark.timeout(300)


def _state(rank: int, step: int) -> dict[str, Any]:
    return {"w": np.full(1000, 10 * rank + step, np.float32)}


def _outcome(fn: Any) -> str:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - compared in the test
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def _one_leaves(ctx: Context, ck: Path, coll: Any) -> str:
    import statestream as ss

    def run() -> None:
        with ss.CheckpointManager(ck, async_save=True, collective=coll) as mgr:
            mgr.save(1, _state(ctx.rank, 1))
            if ctx.rank == 1:
                raise ValueError("rank 1's training step failed (injected)")
            mgr.save(2, _state(ctx.rank, 2))
            mgr.save(3, _state(ctx.rank, 3))
    return _outcome(run)


def _all_leave(ctx: Context, ck: Path, coll: Any) -> dict[str, Any]:
    from torch.distributed.distributed_c10d import _get_default_store

    import statestream as ss

    out: dict[str, Any] = {}

    def run() -> None:
        with ss.CheckpointManager(ck, async_save=True, collective=coll) as mgr:
            mgr.save(1, _state(ctx.rank, 1))
            raise RuntimeError(f"stop on rank {ctx.rank}")
    out["first"] = _outcome(run)
    coll.barrier("recorded")
    store = _get_default_store()
    out["recorded"] = [store.check([f"statestream/left/{r}"]) for r in range(ctx.world)]
    coll.barrier("read")
    mgr = ss.CheckpointManager(ck, async_save=False, collective=coll)
    out["steps"] = mgr.steps()
    done = ck.parent / "rank0-done"
    if ctx.rank == 0:  # rank 1 stays alive but never saves: a plain timeout, nobody left
        out["second"] = _outcome(lambda: mgr.save(2, _state(0, 2)))
        done.touch()
    else:
        while not done.exists():
            time.sleep(0.05)
    return out


def worker(ctx: Context) -> dict[str, Any]:
    import statestream as ss

    init_gloo(ctx)
    ck = Path(ctx.args["root"]) / "ck"
    coll = ss.TorchCollective(timeout_s=TIMEOUT_S)
    if ctx.args["case"] == "one":
        return {"outcome": _one_leaves(ctx, ck, coll)}
    return _all_leave(ctx, ck, coll)


def test_the_others_name_the_rank_that_left_and_why(tmp_path: Path) -> None:
    got = [r.value for r in launch(THIS, "worker", 2, tmp_path, timeout_s=240,
                                   args={"case": "one", "root": str(tmp_path)})]
    assert got[1]["outcome"].startswith(
        "ValueError: rank 1's training step failed (injected)"), got
    rank0 = got[0]["outcome"]
    assert rank0.split(":")[0] in ("CollectiveTimeoutError", "DistributedError"), got
    assert (f"Rank 1 left first: its with CheckpointManager({str(tmp_path / 'ck')!r}) block "
            "raised ValueError: rank 1's training step failed (injected)") in rank0, got


def test_every_rank_leaving_alike_commits_and_leaves_no_stale_record(tmp_path: Path) -> None:
    got = [r.value for r in launch(THIS, "worker", 2, tmp_path, timeout_s=240,
                                   args={"case": "all", "root": str(tmp_path)})]
    for rank, out in enumerate(got):
        assert out["first"] == f"RuntimeError: stop on rank {rank}", got
        assert out["recorded"] == [True, True], got
        assert out["steps"] == [1], got  # the async save in flight committed
    second = got[0]["second"]
    assert second.startswith("CollectiveTimeoutError: rank 0 waited more than"), got
    assert "left first" not in second, got
