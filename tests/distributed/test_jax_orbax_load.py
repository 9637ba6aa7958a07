"""An Orbax checkpoint loaded by two real JAX processes into sharded targets.

Every process opens the checkpoint on its own (one rank's ``ss.metadata`` does not wait
for the other: orbax's handler, not its Checkpointer, whose restore is a barrier) and
reads, through tensorstore, only the storage chunks that hold its own shards.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _launch import Context, launch  # noqa: E402

if not os.environ.get("STATESTREAM_TEST_WORKER"):
    pytest.importorskip("jax")
    pytest.importorskip("orbax.checkpoint")

THIS = os.path.abspath(__file__)
ENV = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
ROWS, COLS = 64, 32  # stored in chunks of at most 1 KiB (orbax picks their shape)


def _state() -> dict[str, Any]:
    w = np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS)
    return {"w": w, "b": np.arange(16, dtype=np.int32), "step": 12, "name": "run"}


def worker_orbax(ctx: Context) -> dict[str, Any]:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{ctx.port}", num_processes=ctx.world,
        process_id=ctx.rank, initialization_timeout=90, shutdown_timeout_seconds=30,
    )
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    import statestream as ss
    from statestream.interop import _orbax

    reads: list[tuple[Any, ...]] = []  # (key path, where the block starts) of each read
    plain = _orbax._OrbaxReader.read_into

    def counted(self: Any, name: str, offset: int, buffers: Any) -> None:
        block = self._blocks.get(name)
        if block is not None:
            reads.append((self._leaves[block[0]].path, tuple(block[1])))
        plain(self, name, offset, buffers)

    _orbax._OrbaxReader.read_into = counted  # type: ignore[method-assign]
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("p", "q"))
    rows = NamedSharding(mesh, PartitionSpec("p", None))  # a process: half of the rows
    target = {"w": jax.ShapeDtypeStruct((ROWS, COLS), jnp.float32, sharding=rows),
              "b": jax.ShapeDtypeStruct((16,), jnp.int32,
                                        sharding=NamedSharding(mesh, PartitionSpec())),
              "step": 0, "name": ""}
    if ctx.rank == 0:  # one rank alone: orbax's Checkpointer waited here for the other
        assert ss.metadata(ctx.args["dir"]).format == "orbax"
    out = ss.load(ctx.args["dir"], target=target)
    want = _state()
    shards_ok = all(
        np.array_equal(np.asarray(s.data), want["w"][s.index]) for s in out["w"].addressable_shards)
    b_ok = all(np.array_equal(np.asarray(s.data), want["b"]) for s in out["b"].addressable_shards)
    # both leave JAX's coordination service together (the launcher ends a process with
    # os._exit: process 0 leaving first aborted process 1 once under load)
    jax.distributed.shutdown()
    return {"shards_ok": shards_ok, "b_ok": b_ok, "step": out["step"], "name": out["name"],
            "w_blocks": sorted({start for path, start in reads if path == ("w",)}),
            "rows": sorted({s.index[0].start or 0 for s in out["w"].addressable_shards})}


def test_two_jax_processes_read_their_own_rows_of_an_orbax_checkpoint(tmp_path: Path) -> None:
    import orbax.checkpoint as ocp

    state = _state()
    args = {"w": ocp.SaveArgs(chunk_byte_size=1024), "b": ocp.SaveArgs(),
            "step": ocp.SaveArgs(), "name": ocp.SaveArgs()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ocp.PyTreeCheckpointer().save(tmp_path / "o",
                                      args=ocp.args.PyTreeSave(state, save_args=args))
    from statestream.interop import open_foreign

    f = open_foreign(tmp_path / "o")
    assert f is not None
    f.reader.close()
    starts = sorted(list(c.start) for a in f.manifest.arrays if a.shape == (ROWS, COLS)
                    for c in a.chunks)
    assert len({r for r, _ in starts}) >= 2  # w is stored in several chunks, down the rows
    res = launch(THIS, "worker_orbax", 2, tmp_path, args={"dir": str(tmp_path / "o")},
                 env=ENV, timeout_s=120)
    seen = []
    for r in res:
        v = r.value
        assert v["shards_ok"] and v["b_ok"], v
        assert (v["step"], v["name"]) == (12, "run"), v
        # a process holds 32 of the 64 rows: it reads the chunks of those rows, no others
        mine = [x for x in starts if v["rows"][0] <= x[0] < v["rows"][0] + ROWS // 2]
        assert v["w_blocks"] == mine, (v["w_blocks"], v["rows"], starts)
        seen.append({tuple(x) for x in v["w_blocks"]})
    assert seen[0] | seen[1] == {tuple(x) for x in starts} and not seen[0] & seen[1]
