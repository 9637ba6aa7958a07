"""JAX processes whose statestream collectives pair across different operations (two
real processes, CPU, loopback only). JaxCollective keys its calls by a counter, so
process 0's ``mgr.save(2)`` met process 1's ``close()`` (its keep policy's
agreement) and failed with "TypeError: 'NoneType' object is not subscriptable" in
``gather_each``. Every process now raises DistributedError naming each one's phase.
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
#: short, so a wait that should not happen ends soon; the assertions are on messages
TIMEOUT_S = 20
pytestmark = pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)


def _outcome(fn: Any) -> str:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - compared in the test
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def worker(ctx: Context) -> dict[str, Any]:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{ctx.port}", num_processes=ctx.world,
        process_id=ctx.rank, initialization_timeout=90, shutdown_timeout_seconds=30,
    )
    import statestream as ss
    from statestream.distributed import agree, any_of, gather_each, share_from_0

    root = Path(ctx.args["dir"])
    coll = ss.JaxCollective(timeout_s=TIMEOUT_S)
    mine = f"phase {ctx.rank}"
    out: dict[str, Any] = {
        "agree": _outcome(lambda: agree(coll, mine, None)),
        "gather_each": _outcome(lambda: gather_each(coll, mine, lambda: ctx.rank)),
        "share_from_0": _outcome(lambda: share_from_0(coll, mine, lambda: [1, 2])),
        "any_of": _outcome(lambda: any_of(coll, mine, ctx.rank == 1)),
        "mixed": _outcome([lambda: gather_each(coll, mine, lambda: 5),
                           lambda: agree(coll, mine, ValueError("x"))][ctx.rank]),
        "same": str(gather_each(coll, "the same phase", lambda: ctx.rank)),
    }
    mgr = ss.CheckpointManager(root / "ck", async_save=False, collective=coll)
    mgr.save(1, {"w": np.full(100, ctx.rank, np.float32)})
    # a raw all-gather of process 0's flag met process 1's envelope, and any() of it
    # said "preempted" on process 0
    out["preemption"] = _outcome([lambda: mgr.reached_preemption(2),
                                  lambda: mgr.save(2, {"w": np.zeros(100, np.float32)})
                                  ][ctx.rank])
    out["manager"] = _outcome([lambda: mgr.save(2, {"w": np.zeros(100, np.float32)}),
                               mgr.close][ctx.rank])
    done = root / "process0-done"
    if ctx.rank == 0:
        out["listed"] = sorted(p.name for p in (root / "ck").iterdir())
        done.touch()
    else:  # stay until process 0 has its error (JAX's shutdown waits for both anyway)
        while not done.exists():
            time.sleep(0.05)
    # Both leave JAX's coordination service together: the launcher ends a process with
    # os._exit, so process 0 leaving first took the service down while process 1 still
    # ran, and its error poller aborted it (exit -6, seen once under load in CI)
    jax.distributed.shutdown()
    return out


def test_processes_in_different_phases_raise_naming_both_on_every_process(
        tmp_path: Path) -> None:
    got = [r.value for r in launch(THIS, "worker", 2, tmp_path, env=ENV,
                                   timeout_s=LAUNCH_TIMEOUT_S, args={"dir": str(tmp_path)})]
    for case in ("agree", "gather_each", "share_from_0", "any_of", "mixed"):
        for rank in (0, 1):
            msg = got[rank][case]
            assert msg.startswith("DistributedError: "), (case, got)
            assert ("ranks out of step: the ranks called different operations at the same "
                    "point: rank 0 was in 'phase 0', rank 1 in 'phase 1'") in msg, (case, got)
            assert ("rank 1 failed during 'phase 1': ValueError: x; ranks out of step"
                    in msg) == (case == "mixed"), (case, got)
    for rank in (0, 1):
        assert got[rank]["same"] == "[0, 1]", got
        msg = got[rank]["manager"]
        assert msg.startswith("DistributedError: ranks out of step"), got
        assert ("rank 0 was in 'deciding whether to save step 2', "
                "rank 1 in 'applying the keep policy'") in msg, got
    for rank in (0, 1):
        msg = got[rank]["preemption"]
        assert msg.startswith("DistributedError: ranks out of step"), got
        assert ("rank 0 was in 'checking for a preemption at step 2', "
                "rank 1 in 'deciding whether to save step 2'") in msg, got
    assert got[0]["manager"].endswith("nothing was changed"), got
    assert got[1]["manager"].endswith("the keep policy was not applied"), got
    assert [n for n in got[0]["listed"] if n.startswith("step_")] == ["step_0000000001"], got
