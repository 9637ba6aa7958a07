"""A two-process job (gloo, loopback) that starts while its object store is down.

S3 is moto behind an :class:`OutageProxy` in the pytest process, down when the
job starts. Each process has its own local tier (its node's disk). Checked: the
manager opens on every rank with the same warning (rank 0 could not take the
lease); steps 1 and 2 commit to the local tiers; ``wait()`` raises on every
rank; once the store is back (the pytest process brings it up when both ranks
have saved), ``wait()`` takes the lease on rank 0 and persists both steps as
ordinary committed checkpoints, which a manager without a local tier loads.
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "distributed"))
from _emulators import OutageProxy  # noqa: E402
from _launch import Context, launch  # noqa: E402

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():  # pragma: no cover
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

import statestream as ss  # noqa: E402

THIS = os.path.abspath(__file__)


def _state(step: int, rank: int) -> dict[str, Any]:
    return {"own": {f"r{rank}": np.full(20_000, 10 * rank + step, dtype=np.float32)},
            "step": step}


def worker(ctx: Context) -> dict[str, Any]:
    import warnings

    from statestream.storage import S3Options, S3Storage, set_backend

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ctx.port}", rank=ctx.rank,
                            world_size=ctx.world, timeout=datetime.timedelta(seconds=90))
    a = ctx.args
    set_backend("s3", S3Storage(S3Options(
        endpoint=a["endpoint"], region="us-east-1", access_key_id=a["key"],
        secret_access_key=a["secret"], timeout_s=5, max_retries=1, retry_timeout_s=3)))
    out: dict[str, Any] = {}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        mgr = ss.CheckpointManager(a["url"], local_tier=os.path.join(a["root"], f"node{ctx.rank}"),
                                   async_save=False, collective=ss.TorchCollective(timeout_s=60))
        for step in (1, 2):
            out[f"saved{step}"] = mgr.save(step, _state(step, ctx.rank))
        try:
            mgr.wait()
            out["wait"] = "ok"
        except ss.DistributedError as exc:
            out["wait"] = sorted(set(exc.failed_types))
    out["deferred"] = any("opens without its lease" in str(w.message) for w in seen)
    out["unpersisted"] = mgr.unpersisted_steps()
    Path(a["root"], f"saved-{ctx.rank}").touch()
    while not Path(a["root"], "store-is-back").exists():
        time.sleep(0.05)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the failures, reported once
        mgr.wait()
    out["persisted"] = mgr.persisted_steps()
    mgr.close()
    return out


@pytest.mark.timeout(240)
def test_a_job_that_starts_during_an_outage_persists_once_the_store_is_back(
        tmp_path: Path, s3_server: dict[str, Any]) -> None:
    proxy = OutageProxy(int(s3_server["endpoint"].rsplit(":", 1)[1]))
    url = f"s3://{s3_server['bucket']}/job-{uuid.uuid4().hex[:8]}"
    root = tmp_path / "job"
    root.mkdir()
    stop = threading.Event()

    def bring_back() -> None:  # once both ranks saved through the outage
        while not stop.is_set():
            if all((root / f"saved-{r}").exists() for r in range(2)):
                proxy.down.clear()
                (root / "store-is-back").touch()
                return
            time.sleep(0.05)

    watcher = threading.Thread(target=bring_back, daemon=True)
    proxy.down.set()
    watcher.start()
    try:
        res = launch(THIS, "worker", 2, tmp_path,
                     args={"url": url, "root": str(root),
                           "endpoint": f"http://127.0.0.1:{proxy.port}",
                           "key": s3_server["aws_access_key_id"],
                           "secret": s3_server["aws_secret_access_key"]}, timeout_s=200)
    finally:
        stop.set()
        proxy.close()
    for r in res:
        assert r.value["deferred"], r.value  # every rank was told
        assert r.value["saved1"] and r.value["saved2"], r.value
        assert r.value["wait"] != "ok", r.value  # the store was down: wait() raised
        assert r.value["unpersisted"] == [1, 2], r.value
        assert r.value["persisted"] == [1, 2], r.value
    from statestream.storage import S3Options, S3Storage, set_backend

    set_backend("s3", S3Storage(S3Options(
        endpoint=s3_server["endpoint"], region="us-east-1",
        access_key_id=s3_server["aws_access_key_id"],
        secret_access_key=s3_server["aws_secret_access_key"])))
    try:
        with ss.CheckpointManager(url, async_save=False) as after:  # the lease was released
            assert after.steps() == [1, 2]
            got = after.load()
        assert got["step"] == 2
        for rank in range(2):
            want = _state(2, rank)["own"][f"r{rank}"]
            np.testing.assert_array_equal(got["own"][f"r{rank}"], want)
    finally:
        set_backend("s3", None)
