"""What the gloo workers of these tests share: joining the process group and
comparing a loaded tree with the expected one (imported by the workers, which
run as separate processes with this directory on ``sys.path``)."""

from __future__ import annotations

import datetime
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
