"""What the gloo workers of these tests share: joining the process group and
comparing a loaded tree with the expected one (imported by the workers, which
run as separate processes with this directory on ``sys.path``)."""

from __future__ import annotations

import datetime
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from _launch import Context


def init_gloo(ctx: Context, timeout_s: float = 60.0) -> None:
    """Join the job's gloo process group on loopback (one torch thread per process:
    the machine is small and the ranks share it)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ctx.port}", rank=ctx.rank,
                            world_size=ctx.world,
                            timeout=datetime.timedelta(seconds=timeout_s))


def assert_tree_equal(got: Any, want: Any, path: str = "") -> None:
    """``got`` holds exactly ``want``: the same dict keys, equal arrays of the same
    dtype, equal other values; a failure names the key path."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), (path, got.keys())
        for k in want:
            assert_tree_equal(got[k], want[k], f"{path}/{k}")
    elif isinstance(want, np.ndarray):
        np.testing.assert_array_equal(got, want, err_msg=path)
        assert got.dtype == want.dtype, path
    else:
        assert got == want, path


def require_gloo() -> tuple[Any, Any]:
    """``torch`` and ``torch.distributed``; skips the calling test module where either
    is missing or has no gloo backend (called at module level, before the tests)."""
    import pytest

    torch = pytest.importorskip("torch")
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():  # pragma: no cover
        pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)
    return torch, dist


def kill_all_ranks_at(ctx: Context, point: str, nth: int) -> Callable[[], None]:
    """SIGKILL every rank the ``nth`` time it reaches ``point`` (a point of a background
    thread: ``tier.persist``), once every rank has reached it and every rank's training
    thread has called the returned ``saved()``, after which it runs no collective.

    Killed at once, a rank whose training thread was still in a collective (the keep
    policy's agreement after a save, the next save) got "Connection reset by peer"
    from the rank killed first and exited 1 (its error written) before its own
    background thread, niced and slow on a loaded machine, reached the point: the
    test expected -9 from every rank. Marker files in the launch's directory say
    who is where; a kill waits for all of them (polling the disk, no time limit:
    the launch's timeout bounds a rank that never gets there).
    """
    from statestream.testing import faults

    run_dir = Path(ctx.tmp)

    def mark(kind: str) -> None:
        (run_dir / f"{kind}-{ctx.rank}").touch()

    def everyone(kind: str) -> bool:
        return all((run_dir / f"{kind}-{r}").exists() for r in range(ctx.world))

    def kill() -> None:
        mark("reached")
        while not (everyone("reached") and everyone("saved")):
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)

    faults.on(point, kill, nth=nth)
    return lambda: mark("saved")
