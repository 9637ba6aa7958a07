"""A global JAX array on a mesh of one process's devices (two real JAX processes, two
CPU devices each).

Every process passes the same state, as each runs the same code, but an array whose
mesh holds only process 0's devices has no addressable shard on process 1. Its save
there read the array whole and failed on every process with JAX's "Fetching value for
`jax.Array` that spans non-addressable (non process local) devices is not possible"
(no key path), and a load into such a sharding failed on process 1 with "If the Array
has no addressable shards, `dtype` must be provided". Now process 1 holds none of it
(process 0 writes it all, as for a DTensor on a sub-mesh) and its load builds the
array with no local shard; the loaded values equal the saved ones.
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

THIS = os.path.abspath(__file__)
ENV = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
FULL = np.arange(24, dtype=np.float32).reshape(4, 6) + 0.5


def _shards(arr: Any) -> list[Any]:
    """(index as lists, equal to FULL there) for each shard this process holds."""
    out = []
    for s in arr.addressable_shards:
        same = bool(np.array_equal(np.asarray(s.data), FULL[s.index]))
        out.append([[[sl.start, sl.stop] for sl in s.index], same])
    return out


def worker(ctx: Context) -> dict[str, Any]:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{ctx.port}", num_processes=ctx.world,
        process_id=ctx.rank, initialization_timeout=90, shutdown_timeout_seconds=30,
    )
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import statestream as ss

    root = Path(ctx.tmp)
    devs = jax.devices()
    first = Mesh(np.array([d for d in devs if d.process_index == 0]), ("a",))
    every = Mesh(np.array(devs).reshape(2, 2), ("p", "q"))

    def make(mesh: Any, spec: Any) -> Any:
        return jax.make_array_from_callback(FULL.shape, NamedSharding(mesh, spec),
                                            lambda i: FULL[i], dtype=np.float32)

    out: dict[str, Any] = {}
    try:
        ss.save(root / "ck", {"first": make(first, P("a")), "every": make(every, P("q"))})
        out["numpy"] = bool(np.array_equal(ss.load(root / "ck")["first"], FULL))
        like = {"first": jax.ShapeDtypeStruct(FULL.shape, np.float32,
                                              sharding=NamedSharding(every, P("p", "q")))}
        out["onto_every"] = _shards(ss.load(root / "ck", target=like)["first"])
        like = {"every": jax.ShapeDtypeStruct(FULL.shape, np.float32,
                                              sharding=NamedSharding(first, P(None, "a")))}
        got = ss.load(root / "ck", target=like, items=["every"])["every"]
        out["onto_first"] = {"shape": list(got.shape), "shards": _shards(got)}
        # one device of process 0: process 1 reads none of it
        from jax.sharding import SingleDeviceSharding

        calls: list[Any] = []
        like = {"first": jax.ShapeDtypeStruct(FULL.shape, np.float32,
                                              sharding=SingleDeviceSharding(devs[0]))}
        got = ss.load(root / "ck", target=like, items=["first"],
                      progress=lambda done, total: calls.append(total))["first"]
        out["one_device"] = {"shards": _shards(got), "read": max(calls, default=0)}
        # a lazy save takes a private copy of each array first (on its own devices)
        handle = ss.save_async(root / "lazy", {"first": make(first, P("a"))}, lazy=True)
        handle.result()
        out["lazy"] = bool(np.array_equal(ss.load(root / "lazy")["first"], FULL))
    except ss.CheckpointError as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    jax.distributed.shutdown()
    return out


@pytest.mark.timeout(240)
def test_an_array_on_one_process_devices_saves_and_loads(tmp_path: Path) -> None:
    res = launch(THIS, "worker", 2, tmp_path, env=ENV, timeout_s=150)
    for r in res:
        assert "error" not in r.value, (r.rank, r.value["error"])
        assert r.value["numpy"] is True
        # the 2x2 mesh: each process holds one row of devices, two quarters of the array
        assert len(r.value["onto_every"]) == 2 and all(ok for _, ok in r.value["onto_every"])
        assert r.value["onto_first"]["shape"] == [4, 6]
        assert r.value["lazy"] is True
    # process 0 holds both column halves; process 1 none of the array
    assert [ok for _, ok in res[0].value["onto_first"]["shards"]] == [True, True]
    assert res[1].value["onto_first"]["shards"] == []
    assert res[0].value["one_device"]["shards"] == [[[[None, None], [None, None]], True]]
    assert res[0].value["one_device"]["read"] >= FULL.nbytes
    assert res[1].value["one_device"] == {"shards": [], "read": 0}
