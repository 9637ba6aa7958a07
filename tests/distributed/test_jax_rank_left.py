"""A JAX process whose own code raised inside ``with CheckpointManager(...)`` is
named, with its error, by the other process's failed collective (two real
processes, CPU, loopback only): process 1 records why it left in the
coordination service before closing; process 0, waiting in its next collective,
times out and its error says "process 1 left first: its with CheckpointManager(...) block raised
ValueError: ...".
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

if not os.environ.get("STATESTREAM_TEST_WORKER"):
    pytest.importorskip("jax")

THIS = os.path.abspath(__file__)
ENV = {"XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu"}
LAUNCH_TIMEOUT_S = 180
#: short, so the wait ends soon; the assertions are on messages, not durations
TIMEOUT_S = 20
pytestmark = pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)


def worker(ctx: Context) -> dict[str, Any]:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{ctx.port}", num_processes=ctx.world,
        process_id=ctx.rank, initialization_timeout=90, shutdown_timeout_seconds=30,
    )
    import statestream as ss

    root = Path(ctx.args["dir"])
    coll = ss.JaxCollective(timeout_s=TIMEOUT_S)
    outcome = "ok"
    try:
        with ss.CheckpointManager(root / "ck", async_save=False, collective=coll) as mgr:
            mgr.save(1, {"w": np.full(100, ctx.rank, np.float32)})
            if ctx.rank == 1:
                raise ValueError("process 1's training step failed (injected)")
            # (the next statestream collective; not mgr.save(2): JAX pairs collective
            # calls by number, so its first all-gather would meet process 1's close's)
            coll.barrier("step 2")
    except Exception as exc:  # noqa: BLE001 - compared in the test
        outcome = f"{type(exc).__name__}: {exc}"
    done = root / "process0-done"
    if ctx.rank == 0:
        done.touch()
    else:  # stay until process 0 has its error (JAX's shutdown waits for both anyway)
        while not done.exists():
            time.sleep(0.05)
    # Both leave JAX's coordination service together: the launcher ends a process with
    # os._exit, so process 0 leaving first took the service down while process 1 still
    # ran, and its error poller aborted it (exit -6, seen once under load in CI)
    jax.distributed.shutdown()
    return {"outcome": outcome}


def test_the_other_process_names_the_process_that_left_and_why(tmp_path: Path) -> None:
    got = [r.value for r in launch(THIS, "worker", 2, tmp_path, env=ENV,
                                   timeout_s=LAUNCH_TIMEOUT_S,
                                   args={"dir": str(tmp_path)})]
    assert got[1]["outcome"].startswith(
        "ValueError: process 1's training step failed (injected)"), got
    msg = got[0]["outcome"]
    assert msg.split(":")[0] in ("CollectiveTimeoutError", "DistributedError"), got
    assert (f"Process 1 left first: its with CheckpointManager({str(tmp_path / 'ck')!r}) "
            "block raised ValueError: process 1's training step failed (injected)") in msg, got
