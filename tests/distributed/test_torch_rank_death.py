"""A rank SIGKILLed during a torch.distributed save (gloo, real processes, loopback only).

* mid-save: the survivors raise at once and name the rank that died, never
  themselves (rank 1 of 3, and rank 0, which also hosts the rendezvous store);
  nothing is committed;
* right after rank 0 committed: the others return normally (the checkpoint is
  committed and loads), with a warning naming rank 0;
* rank 0 killed before its commit, with an older checkpoint at the path that
  differs only in a plain value: the survivors must not take the old one for
  theirs, so they fail, and the old checkpoint is intact.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _launch import Context, launch  # noqa: E402
from _workers import require_gloo  # noqa: E402

torch, dist = require_gloo()

import statestream as ss  # noqa: E402

THIS = os.path.abspath(__file__)
LAUNCH_TIMEOUT_S = 120
pytestmark = pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)


def _state(rank: int, step: int) -> dict[str, Any]:
    import torch

    return {"shared": torch.arange(4096, dtype=torch.float32),
            "own": {f"r{rank}": torch.full((2048,), float(rank))}, "step": step}


def worker_kill(ctx: Context) -> dict[str, Any]:
    """Rank ``victim`` is SIGKILLed at fault point ``point``; the others report what they saw."""
    import datetime

    import torch
    import torch.distributed as dist

    import statestream as ss
    from statestream.testing import faults

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ctx.port}", rank=ctx.rank,
                            world_size=ctx.world, timeout=datetime.timedelta(seconds=60))
    path = Path(ctx.args["path"])
    coll = ss.TorchCollective(timeout_s=60)
    if ctx.args.get("old_step") is not None:  # an older checkpoint at the path
        ss.save(path, _state(ctx.rank, ctx.args["old_step"]), collective=coll)
    if ctx.rank == ctx.args["victim"]:
        faults.kill_at(ctx.args["point"])
    if ctx.rank == ctx.args.get("late_rank"):  # reaches the failed collective late
        faults.on(ctx.args["point"], lambda: time.sleep(ctx.args["late_s"]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            ss.save(path, _state(ctx.rank, 7), collective=coll, overwrite=True)
        except Exception as exc:  # noqa: BLE001
            return {"ok": False, "type": type(exc).__name__, "message": str(exc),
                    "distributed": isinstance(exc, ss.DistributedError)}
    return {"ok": True, "warnings": [str(w.message) for w in caught
                                     if issubclass(w.category, RuntimeWarning)]}


def _run(tmp: Path, world: int, victim: int, point: str,
         old_step: int | None = None, **extra: Any) -> list[Any]:
    res = launch(THIS, "worker_kill", world, tmp,
                 args={"path": str(tmp / "ck"), "victim": victim, "point": point,
                       "old_step": old_step, **extra},
                 timeout_s=LAUNCH_TIMEOUT_S, check=False)
    assert res[victim].returncode == -9 and res[victim].value is None, res[victim]
    for r in res:
        if r.rank != victim:
            assert r.returncode == 0 and r.value is not None, (r.rank, r.error, r.stderr)
    return [r.value for r in res]


def _assert_names_the_dead(values: list[Any], victim: int) -> None:
    for rank, v in enumerate(values):
        if rank == victim:
            continue
        assert not v["ok"] and v["distributed"], (rank, v)
        msg = v["message"]
        assert f"rank {victim} died or disconnected" in msg, (rank, msg)
        assert f"seen from rank {rank}" in msg, (rank, msg)
        assert f"rank {rank} died" not in msg and not msg.startswith(f"rank {rank}:"), msg
        assert "nothing was committed" in msg, msg


@pytest.mark.parametrize(("world", "victim"), [(3, 1), (2, 0)])
def test_survivors_name_the_rank_killed_mid_save(tmp_path: Path, world: int,
                                                 victim: int) -> None:
    values = _run(tmp_path, world, victim, "save.chunk_written")
    _assert_names_the_dead(values, victim)
    with pytest.raises(ss.CheckpointNotFoundError):
        ss.load(tmp_path / "ck", collective=ss.SingleProcess())


def test_a_late_survivor_names_the_dead_rank_after_rank0_found_it(tmp_path: Path) -> None:
    """Rank 2 reaches the failed collective seconds after rank 0 (which hosts the store)
    has found rank 1 dead and returned: it must still blame rank 1, not rank 0."""
    values = _run(tmp_path, 3, 1, "save.chunk_written", late_rank=2, late_s=3.0)
    _assert_names_the_dead(values, 1)


def test_rank0_killed_right_after_commit_is_a_successful_save(tmp_path: Path) -> None:
    values = _run(tmp_path, 3, 0, "commit.renamed")
    for rank in (1, 2):
        v = values[rank]
        assert v["ok"], (rank, v)
        assert any("committed" in w and "rank 0 died or disconnected" in w
                   for w in v["warnings"]), v
    out = ss.load(tmp_path / "ck", collective=ss.SingleProcess())
    assert out["step"] == 7
    np.testing.assert_array_equal(out["shared"], np.arange(4096, dtype=np.float32))
    for r in range(3):
        np.testing.assert_array_equal(out["own"][f"r{r}"], np.full(2048, float(r), np.float32))
    assert ss.verify(tmp_path / "ck").ok


def test_an_older_checkpoint_is_not_taken_for_the_uncommitted_save(tmp_path: Path) -> None:
    # the same arrays (same files, sizes and checksums), only "step" differs
    values = _run(tmp_path, 2, 0, "commit.marker_written", old_step=3)
    _assert_names_the_dead(values, 0)
    out = ss.load(tmp_path / "ck", collective=ss.SingleProcess())
    assert out["step"] == 3


def worker_reinit(ctx: Context) -> dict[str, Any]:
    """Save, destroy the process group, init it again on the same port, save again."""
    import datetime
    import threading

    import torch.distributed as dist

    import statestream as ss

    def beats() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "statestream-torch-heartbeat"]

    out: dict[str, Any] = {}
    for gen in range(2):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ctx.port}",
                                rank=ctx.rank, world_size=ctx.world,
                                timeout=datetime.timedelta(seconds=60))
        ss.save(Path(ctx.args["dir"]) / f"ck{gen}", _state(ctx.rank, gen))
        out[f"beating{gen}"] = len(beats())
        dist.destroy_process_group()
        for t in beats():  # the heartbeat of a destroyed group stops by itself
            t.join(timeout=30)
        out[f"after_destroy{gen}"] = len(beats())
        # rank 0's store server must be gone (nothing may keep it) before anyone
        # connects to the port again: rank 0 binds it anew
        gone = Path(ctx.tmp) / f"rank0-destroyed-{gen}"
        if ctx.rank == 0:
            gone.touch()
        deadline = time.monotonic() + 60
        while not gone.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    return out


def test_save_after_the_process_group_is_initialised_again(tmp_path: Path) -> None:
    res = launch(THIS, "worker_reinit", 2, tmp_path, args={"dir": str(tmp_path)},
                 timeout_s=LAUNCH_TIMEOUT_S)
    for r in res:
        assert r.value == {"beating0": 1, "after_destroy0": 0,
                           "beating1": 1, "after_destroy1": 0}, r.value
    for gen in range(2):
        assert ss.load(tmp_path / f"ck{gen}", collective=ss.SingleProcess())["step"] == gen


def worker_die_in_broadcast(ctx: Context) -> dict[str, Any]:
    """Rank 1 dies entering the save's first broadcast (between two collectives). Rank 0
    finds it dead and raises, but stays alive until rank 2 has raised too (as a job
    that logs or cleans up would): rank 2 waits on rank 0 alone in a broadcast."""
    import datetime
    import signal

    import torch.distributed as dist

    import statestream as ss
    from statestream.distributed import _torch

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ctx.port}", rank=ctx.rank,
                            world_size=ctx.world, timeout=datetime.timedelta(seconds=60))
    if ctx.rank == 1:
        def die(self: Any, obj: Any, src: int = 0) -> Any:
            os.kill(os.getpid(), signal.SIGKILL)

        _torch.TorchCollective.broadcast_object = die  # type: ignore[method-assign]
    raised = Path(ctx.tmp) / "rank2-raised"
    out: dict[str, Any] = {"ok": True}
    try:
        ss.save(Path(ctx.args["path"]), _state(ctx.rank, 7),
                collective=ss.TorchCollective(timeout_s=60))
    except Exception as exc:  # noqa: BLE001
        out = {"ok": False, "type": type(exc).__name__, "message": str(exc),
               "distributed": isinstance(exc, ss.DistributedError)}
    if ctx.rank == 2:
        raised.touch()
    deadline = time.monotonic() + 45
    while ctx.rank == 0 and not raised.exists() and time.monotonic() < deadline:
        time.sleep(0.1)  # rank 2 used to wait for this process to exit, then blame it
    return out


def test_a_rank_that_dies_between_collectives_is_named_by_a_broadcasts_receivers(
        tmp_path: Path) -> None:
    res = launch(THIS, "worker_die_in_broadcast", 3, tmp_path,
                 args={"path": str(tmp_path / "ck")}, timeout_s=LAUNCH_TIMEOUT_S, check=False)
    assert res[1].returncode == -9, res[1]
    for r in (res[0], res[2]):
        assert r.returncode == 0 and r.value is not None, (r.rank, r.error, r.stderr)
        v, msg = r.value, r.value.get("message", "")
        assert not v["ok"] and v["distributed"], (r.rank, v)
        assert "rank 1 died or disconnected during broadcast" in msg, (r.rank, msg)
        assert f"seen from rank {r.rank}" in msg and "rank 0 died" not in msg, (r.rank, msg)
    assert not (tmp_path / "ck").exists()
