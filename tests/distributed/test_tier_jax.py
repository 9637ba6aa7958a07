"""A manager's local tier with two real JAX processes (JaxCollective, CPU, loopback).

Each process has its own local directory (its node's disk). Node-local saves
and their persistence work through JAX's coordination service; moving files
between nodes needs a byte channel JAX does not have, so a load whose node
copy is incomplete reads the persistent directory, and peer copies are refused.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _launch import Context, launch  # noqa: E402

if not os.environ.get("STATESTREAM_TEST_WORKER"):
    pytest.importorskip("jax")

import statestream as ss  # noqa: E402

THIS = os.path.abspath(__file__)
ENV = {"XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu"}


def state_at(step: int, rank: int) -> dict[str, Any]:
    return {"shared": np.arange(50_000, dtype=np.float32) + step,
            "per_rank": {f"rank{rank}": np.full(1000, rank * 100 + step, dtype=np.int64)}}


def worker(ctx: Context) -> dict[str, Any]:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{ctx.port}",
                               num_processes=ctx.world, process_id=ctx.rank,
                               initialization_timeout=90, shutdown_timeout_seconds=30)
    import statestream as ss
    from statestream.distributed import JaxCollective, default_collective

    assert isinstance(default_collective(), JaxCollective)
    root = ctx.args["root"]
    persist, local = os.path.join(root, "persist"), os.path.join(root, f"node{ctx.rank}")
    out: dict[str, Any] = {}
    try:
        ss.CheckpointManager(persist, local_tier=local, replicate_to_peers=True)
    except ss.InvalidOptionError as exc:
        out["peers_refused"] = str(exc)
    with ss.CheckpointManager(persist, local_tier=local, async_save=False) as mgr:
        for step in (1, 2):
            mgr.save(step, state_at(step, ctx.rank))
        mgr.wait()
        out["persisted"] = mgr.persisted_steps()
        out["files"] = sorted(os.listdir(os.path.join(local, "step_0000000002", "data")))
        got = mgr.load()
        np.testing.assert_array_equal(got["shared"], state_at(2, 0)["shared"])
        for r in range(ctx.world):
            np.testing.assert_array_equal(got["per_rank"][f"rank{r}"],
                                          state_at(2, r)["per_rank"][f"rank{r}"])
    # Every process leaves together: the launcher ends a worker with os._exit, and rank 0
    # hosts the coordination service, whose loss aborts a rank still closing its manager.
    jax.distributed.shutdown()
    return out


@pytest.mark.timeout(240)
def test_local_tier_with_jax_processes(tmp_path: Path) -> None:
    root = str(tmp_path / "job")
    res = launch(THIS, "worker", 2, tmp_path, args={"root": root}, env=ENV, timeout_s=180)
    for r in res:
        assert "cannot carry bytes" in r.value["peers_refused"]
        assert r.value["persisted"] == [1, 2]
        assert r.value["files"] and all(f.startswith(f"r{r.rank}-") for f in r.value["files"])
    for step in (1, 2):
        got = ss.load(os.path.join(root, "persist", f"step_{step:010d}"))
        np.testing.assert_array_equal(got["shared"], state_at(step, 0)["shared"])
        assert sorted(got["per_rank"]) == ["rank0", "rank1"]
