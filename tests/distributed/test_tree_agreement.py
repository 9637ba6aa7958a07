"""Ranks agree on the state's structure before any data is written (torch gloo, 2 processes).

A rank saving an array where another saves a dict, or lists of different
lengths, must fail on every rank *before* a byte of data is written
(counted at the library's ``save.chunk_written`` hook point), with a
message that says which rank holds what at which key path.
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


def _states(rank: int) -> dict[str, tuple[Any, Any]]:
    t = torch.ones(256)
    big = torch.arange(1 << 16, dtype=torch.float32)  # data that would be written first
    return {
        "kinds": ({"w": big, "a": torch.ones(4)}, {"w": big, "a": {"x": torch.ones(4)}}),
        "lengths": ({"w": big, "l": [t, t, t]}, {"w": big, "l": [t, t]}),
        "async_kinds": ({"w": big, "a": 3}, {"w": big, "a": torch.ones(2)}),
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
    for case, per_rank in _states(ctx.rank).items():
        state = per_rank[ctx.rank]
        target = Path(ctx.tmp) / case / "ck"
        target.parent.mkdir(parents=True, exist_ok=True)
        written[0] = 0
        try:
            if case.startswith("async"):
                ss.save_async(target, state).result()
            else:
                ss.save(target, state)
            out[case] = {"raised": None}
        except ss.CheckpointError as exc:
            out[case] = {"raised": type(exc).__name__, "message": str(exc)}
        out[case]["chunks_written"] = written[0]
        out[case]["left"] = sorted(os.listdir(target.parent))
        dist.barrier()
    dist.destroy_process_group()
    return out


@pytest.mark.timeout(300)
def test_ranks_agree_on_the_tree_before_writing(tmp_path: Path) -> None:
    results = launch(THIS, "worker", 2, tmp_path, timeout_s=150)
    views = {
        "kinds": ("'a'", "different kinds", "rank 0 holds an array (float32[4])",
                  "rank 1 holds a dict"),
        "lengths": ("'l'", "lists of different lengths", "rank 0 holds a list of 3",
                    "rank 1 holds a list of 2"),
        "async_kinds": ("'a'", "different kinds", "rank 0 holds a value of kind int",
                        "rank 1 holds an array (float32[2])"),
    }
    for r in results:
        for case, expect in views.items():
            v = r.value[case]
            assert v["raised"] == "DistributedError", (r.rank, case, v)
            for text in expect:
                assert text in v["message"], (r.rank, case, text, v["message"])
            assert "nothing was written" in v["message"], v["message"]
            assert v["message"].count("nothing was committed") == 1, v["message"]
            assert v["chunks_written"] == 0, (r.rank, case, v)
            assert v["left"] == [], (r.rank, case, v)
