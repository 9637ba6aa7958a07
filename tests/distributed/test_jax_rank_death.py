"""A JAX process SIGKILLed during a save (two real processes, CPU, loopback only).

JAX notices a dead process only after its heartbeat timeout (100 s by default)
and then terminates every process; statestream's own heartbeats let the
survivor stop waiting after ``dead_after_s`` and name the dead process.

* mid-save: process 1 dies while writing; process 0 names it, not itself, and
  nothing is committed;
* right after the commit: process 1 dies after process 0 committed, before it
  confirmed; process 0 returns normally (with a warning) and the checkpoint loads.

(Process 0 runs JAX's coordination service: when it dies, JAX terminates the
other processes at once, so there is no survivor to report anything.)
"""

from __future__ import annotations

import os
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _launch import Context, launch  # noqa: E402

if not os.environ.get("STATESTREAM_TEST_WORKER"):
    pytest.importorskip("jax")

import statestream as ss  # noqa: E402
from statestream.format import COMMIT_NAME  # noqa: E402

THIS = os.path.abspath(__file__)
ENV = {"XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu"}
LAUNCH_TIMEOUT_S = 120
pytestmark = pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)


def _state(rank: int) -> dict[str, Any]:
    return {"shared": np.arange(4096, dtype=np.float32),
            "own": {f"p{rank}": np.full(2048, float(rank), np.float32)}, "step": 7}


class _KillAtCall:
    """Delegates to a collective; SIGKILLs this process on entering all_gather number ``n``,
    once ``path`` is committed (so: after the commit, before this process confirms it)."""

    def __init__(self, inner: Any, n: int | None, path: Path) -> None:
        self.inner, self.n, self.path, self.calls = inner, n, path, 0

    @property
    def rank(self) -> int:
        return int(self.inner.rank)

    @property
    def world_size(self) -> int:
        return int(self.inner.world_size)

    def barrier(self, name: str) -> None:
        self.inner.barrier(name)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return self.inner.broadcast_object(obj, src)

    def fork(self, channel: str) -> Any:
        return _KillAtCall(self.inner.fork(channel), self.n, self.path)

    def gather_object(self, obj: Any, dst: int = 0) -> Any:
        # (every process must take the same path as process 0's plain collective)
        return self.inner.gather_object(obj, dst)

    def all_gather_object(self, obj: Any) -> list[Any]:
        self.calls += 1
        if self.calls == self.n:
            deadline = time.monotonic() + 60
            while not (self.path / COMMIT_NAME).exists() and time.monotonic() < deadline:
                time.sleep(0.02)
            os.kill(os.getpid(), signal.SIGKILL)
        return list(self.inner.all_gather_object(obj))


def worker(ctx: Context) -> dict[str, Any]:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{ctx.port}", num_processes=ctx.world,
        process_id=ctx.rank, initialization_timeout=90, shutdown_timeout_seconds=30,
    )
    import statestream as ss
    from statestream.testing import faults

    root = Path(ctx.args["dir"])
    coll: Any = ss.JaxCollective(timeout_s=60, dead_after_s=3)
    if ctx.args["case"] == "mid_save" and ctx.rank == 1:
        faults.kill_at("save.chunk_written")
    if ctx.args["case"] == "after_commit" and ctx.rank == 1:
        # count the all-gathers of one whole save, then die at the last one of the next
        counter = _KillAtCall(coll, None, root / "ck")
        ss.save(root / "warmup", _state(ctx.rank), collective=counter)
        coll = _KillAtCall(coll, counter.calls, root / "ck")
    elif ctx.args["case"] == "after_commit":
        ss.save(root / "warmup", _state(ctx.rank), collective=coll)
    if ctx.args["case"] == "after_commit":
        # the next save takes the warm-up's collective calls, not a kept plan's fewer
        from statestream.engine._plans import forget_plans

        forget_plans()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            ss.save(root / "ck", _state(ctx.rank), collective=coll)
        except Exception as exc:  # noqa: BLE001
            return {"ok": False, "type": type(exc).__name__, "message": str(exc),
                    "distributed": isinstance(exc, ss.DistributedError)}
    return {"ok": True, "warnings": [str(w.message) for w in caught
                                     if issubclass(w.category, RuntimeWarning)]}


def _run(tmp: Path, case: str) -> Any:
    res = launch(THIS, "worker", 2, tmp, args={"dir": str(tmp), "case": case}, env=ENV,
                 timeout_s=LAUNCH_TIMEOUT_S, check=False)
    assert res[1].returncode == -9 and res[1].value is None, (res[1].error, res[1].stderr)
    assert res[0].returncode == 0 and res[0].value is not None, (res[0].error, res[0].stderr)
    return res[0].value


def test_survivor_names_the_process_killed_mid_save(tmp_path: Path) -> None:
    v = _run(tmp_path, "mid_save")
    assert not v["ok"] and v["distributed"], v
    msg = v["message"]
    assert "process 1 died or disconnected" in msg and "seen from process 0" in msg, msg
    assert "process 0 died" not in msg and not msg.startswith("process 0:"), msg
    assert "nothing was committed" in msg, msg
    with pytest.raises(ss.CheckpointNotFoundError):
        ss.load(tmp_path / "ck", collective=ss.SingleProcess())


def test_process_killed_right_after_the_commit_leaves_a_successful_save(tmp_path: Path) -> None:
    v = _run(tmp_path, "after_commit")
    assert v["ok"], v
    assert any("process 1 died or disconnected" in w for w in v["warnings"]), v
    out = ss.load(tmp_path / "ck", collective=ss.SingleProcess())
    assert out["step"] == 7
    for r in range(2):
        np.testing.assert_array_equal(out["own"][f"p{r}"], np.full(2048, float(r), np.float32))
    assert ss.verify(tmp_path / "ck").ok
