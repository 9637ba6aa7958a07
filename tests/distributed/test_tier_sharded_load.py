"""Loads with sharded targets from node-local tiers fetch only what each node reads.

Two real processes (torch.distributed gloo, loopback), each with its own local
directory standing for its node's disk (``node0``, ``node1``), save DTensors
sharded ``Shard(0)`` and per-rank arrays through a manager's local tier. A load
into targets of the same layout reads, on each node, exactly the files that
node's process wrote: no file moves between the nodes, and each node's copy
stays partial (``ss.verify`` says so). A later load without a target completes
the copies as before. A node that lost its disk gets a committed copy holding
the manifest and only the files its process reads.
"""

from __future__ import annotations

import os
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _launch import Context, launch  # noqa: E402
from _workers import (
    init_gloo,  # noqa: E402
    require_gloo,  # noqa: E402
)

torch, dist = require_gloo()

import statestream as ss  # noqa: E402

THIS = os.path.abspath(__file__)
WORLD = 2
ROWS, COLS = 512, 768  # 1.5 MiB of float32: large enough to be loaded mapped


def _full(step: int) -> Any:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) + step


def _frozen() -> Any:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) * 0.25


def _per_rank(step: int, rank: int) -> np.ndarray:
    return np.full((64, 64), rank * 1000 + step, dtype=np.int64)


def _init(ctx: Context) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    init_gloo(ctx)
    return init_device_mesh("cpu", (ctx.world,))


def _state(mesh: Any, step: int, rank: int) -> dict[str, Any]:
    from torch.distributed.tensor import Shard, distribute_tensor

    return {"model": {"w": distribute_tensor(_full(step), mesh, [Shard(0)]),
                      "frozen": distribute_tensor(_frozen(), mesh, [Shard(0)])},
            "per_rank": {f"rank{rank}": _per_rank(step, rank)},
            "step": step}


def _target(mesh: Any, rank: int) -> dict[str, Any]:
    from torch.distributed.tensor import Shard, distribute_tensor

    zeros = torch.zeros(ROWS, COLS)
    return {"model": {"w": distribute_tensor(zeros, mesh, [Shard(0)]),
                      "frozen": distribute_tensor(zeros.clone(), mesh, [Shard(0)])},
            "per_rank": {f"rank{rank}": np.zeros((64, 64), dtype=np.int64)},
            "step": 0}


def _check_target(got: dict[str, Any], step: int, rank: int) -> None:
    assert got["step"] == step
    torch.testing.assert_close(got["model"]["w"].full_tensor(), _full(step), rtol=0, atol=0)
    torch.testing.assert_close(got["model"]["frozen"].full_tensor(), _frozen(), rtol=0, atol=0)
    np.testing.assert_array_equal(got["per_rank"][f"rank{rank}"], _per_rank(step, rank))


def _check_whole(got: dict[str, Any], step: int) -> None:
    assert got["step"] == step
    np.testing.assert_array_equal(got["model"]["w"], _full(step).numpy())
    np.testing.assert_array_equal(got["model"]["frozen"], _frozen().numpy())
    for r in range(WORLD):
        np.testing.assert_array_equal(got["per_rank"][f"rank{r}"], _per_rank(step, r))


def _files(local: str) -> dict[str, dict[str, int]]:
    """step directory -> data file -> size, in one node's tier."""
    out: dict[str, dict[str, int]] = {}
    for s in sorted(os.listdir(local)):
        data = os.path.join(local, s, "data")
        if s.startswith("step_") and "." not in s and os.path.isdir(data):
            out[s] = {n: os.path.getsize(os.path.join(data, n)) for n in sorted(os.listdir(data))}
    return out


def sharded_worker(ctx: Context) -> dict[str, Any]:
    mesh = _init(ctx)
    a = ctx.args
    local = os.path.join(a["root"], f"node{ctx.rank}")
    out: dict[str, Any] = {}
    with ss.CheckpointManager(os.path.join(a["root"], "persist"), local_tier=local,
                              incremental=a["incremental"], replicate_to_peers=a["peers"],
                              io=ss.IOOptions(max_chunk_bytes=256 << 10)) as mgr:
        if a["save"]:
            for step in (1, 2):
                mgr.save(step, _state(mesh, step, ctx.rank))
            mgr.wait()
        out["before"] = _files(local)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _check_target(mgr.load(target=_target(mesh, ctx.rank)), 2, ctx.rank)
        # a copy taken for damaged would load from the persistent directory, warning
        out["warnings"] = [str(w.message) for w in caught]
        out["after_target"] = _files(local)
        out["verify_after_target"] = ss.verify(os.path.join(local, "step_0000000002")).ok
        _check_whole(mgr.load(), 2)
        out["after_all"] = _files(local)
        out["verify_after_all"] = ss.verify(os.path.join(local, "step_0000000002")).ok
    return out


def _own(files: dict[str, int], rank: int) -> bool:
    return bool(files) and all(n.startswith(f"r{rank}-") for n in files)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("incremental", [False, True])
def test_a_sharded_load_fetches_nothing_a_node_does_not_read(tmp_path: Path,
                                                              incremental: bool) -> None:
    root = str(tmp_path / "job")
    res = launch(THIS, "sharded_worker", WORLD, tmp_path, timeout_s=240,
                 args={"root": root, "incremental": incremental, "peers": False, "save": True})
    for r in res:
        v = r.value
        assert v["warnings"] == [], v  # loaded from the node's own copy
        assert v["after_target"] == v["before"], v  # nothing moved
        for files in v["after_target"].values():
            assert _own(files, r.rank), v
        if incremental:  # step 2 refers to step 1 for 'frozen': step 1's own files serve
            assert set(v["before"]) == {"step_0000000001", "step_0000000002"}, v
        assert v["verify_after_target"] is False  # a partial copy is not taken for whole
        # a load without a target completes the copies (and every step referred to)
        assert v["verify_after_all"] is True
        completed = ["step_0000000001", "step_0000000002"] if incremental else [
            "step_0000000002"]
        for s in completed:
            assert {n[:3] for n in v["after_all"][s]} == {"r0-", "r1-"}, v


@pytest.mark.timeout(300)
def test_a_lost_node_gets_a_partial_copy_for_a_sharded_load(tmp_path: Path) -> None:
    root = str(tmp_path / "job")
    launch(THIS, "sharded_worker", WORLD, tmp_path, timeout_s=240,
           args={"root": root, "incremental": False, "peers": True, "save": True})
    shutil.rmtree(os.path.join(root, "node1"))  # node 1 lost its disk
    shutil.rmtree(os.path.join(root, "persist"))  # and the persistent copy is gone too
    res = launch(THIS, "sharded_worker", WORLD, tmp_path, timeout_s=240, tag="restore",
                 args={"root": root, "incremental": False, "peers": True, "save": False})
    v = res[1].value
    assert v["before"] == {} and v["warnings"] == [], v
    # a committed copy of the loaded step with the files node 1 reads (its own), no more
    assert list(v["after_target"]) == ["step_0000000002"], v
    assert _own(v["after_target"]["step_0000000002"], 1), v
    assert v["verify_after_target"] is False
    assert v["verify_after_all"] is True
    assert res[0].value["after_target"] == res[0].value["before"]  # node 0 fetched nothing
