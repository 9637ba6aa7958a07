"""statestream's objects do not keep torch.distributed's groups, or rank 0's store server,
alive after ``destroy_process_group()``.

A closed CheckpointManager that is still referenced (a variable of the training
function, a reference cycle waiting for the collector) held its collective, which held
statestream's gloo group and the rendezvous store, so their threads ran on into the
interpreter's exit. There a gloo thread that lets go of finished work holding Python
tensors aborts the process ("terminate called without an active exception") after a job
that succeeded: seen about once in 20 runs of the FSDP2 example of
docs/integrations.md on a loaded machine (a core dump showed pt_gloo_runloop destroying
an all-gather's work while the main thread finalized).
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
_KEPT: list[Any] = []


def _thread_names() -> list[str]:
    out = []
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                out.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return out


def worker_release(ctx: Context) -> dict[str, Any]:
    import datetime
    import gc

    import torch
    import torch.distributed as dist

    import statestream as ss
    from statestream.errors import DistributedError

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ctx.port}",
                            rank=ctx.rank, world_size=ctx.world,
                            timeout=datetime.timedelta(seconds=60))
    mgr = ss.CheckpointManager(os.path.join(ctx.tmp, "ck"), async_save=False)
    mgr.save(1, {"w": torch.full((64,), float(ctx.rank))})
    mgr.close()
    _KEPT.append(mgr)  # closed, and still referenced
    coll = mgr._coll
    during = _thread_names()
    dist.destroy_process_group()
    gc.collect()
    after = _thread_names()
    try:
        coll.barrier("after destroy")
        used = "no error"
    except DistributedError as exc:
        used = str(exc)
    return {"during": during, "after": after, "used": used}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")
def test_destroying_the_process_group_ends_its_threads(tmp_path: Path) -> None:
    results = launch(THIS, "worker_release", 2, tmp_path, timeout_s=120)
    for r in results:
        v = r.value
        assert "pt_gloo_runloop" in v["during"], v  # the names this check relies on
        assert "pt_gloo_runloop" not in v["after"] and "gloo_tcp_loop" not in v["after"], v
        assert "destroyed" in v["used"], v
    assert "pt_tcpstore_uv" in results[0].value["during"]
    assert "pt_tcpstore_uv" not in results[0].value["after"]  # rank 0 hosted the store
