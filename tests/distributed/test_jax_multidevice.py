"""Sharded jax.Array save/load on 8 host devices, and across frameworks with torch DTensors.

The JAX parts run in a subprocess started with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (JAX in the pytest
process may already be initialised with one device). The cross-framework
parts chain three launches: JAX saves sharded arrays -> 2 torch processes
(gloo) load them as DTensors and save DTensors -> JAX loads those as sharded
arrays. Workers report problems back; assertions are made here.
"""

from __future__ import annotations

import math
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _launch import Context, launch  # noqa: E402

if not os.environ.get("STATESTREAM_TEST_WORKER"):
    pytest.importorskip("jax")

import statestream as ss  # noqa: E402
from statestream.api._load import open_checkpoint  # noqa: E402

THIS = os.path.abspath(__file__)
JAX_ENV = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
LAUNCH_TIMEOUT_S = 120

# name -> (shape, dtype, saved mesh, saved spec, reshard mesh, reshard spec)
# meshes: A = 4x2 ("a", "b"), B = 2x4 ("x", "y"), D = 8 ("d",), S = one device
LAYOUTS: dict[str, tuple[tuple[int, ...], str, str, tuple[Any, ...], str, tuple[Any, ...]]] = {
    "sharded": ((16, 12), "float32", "A", ("a", "b"), "B", ("x", "y")),
    "partial_a": ((8, 6), "float32", "A", ("a", None), "B", ("y", "x")),  # replicated over b
    "partial_b": ((6, 10), "float32", "A", (None, "b"), "A", ()),  # sharded -> replicated
    "transposed": ((12, 8), "float32", "A", ("b", "a"), "D", (None, "d")),
    "replicated": ((8, 3), "float32", "A", (), "A", ("a",)),  # replicated -> sharded
    "bf16": ((8, 4), "bfloat16", "A", ("a",), "D", ("d",)),
    "ints": ((4, 6), "int32", "B", ("x", None), "S", ()),
    "vector": ((16,), "float32", "D", ("d",), "B", (("x", "y"),)),
    "scalar": ((), "float32", "A", (), "B", ()),
}

# Saved from torch on 2 ranks: name -> (shape, dtype, placement, JAX target mesh, spec, JAX dtype)
TORCH_LAYOUTS: dict[str, tuple[tuple[int, ...], str, str, str, tuple[Any, ...], str]] = {
    "rows": ((9, 6), "float32", "S0", "A", (None, "b"), "float32"),  # uneven: 5 + 4 rows
    "cols": ((8, 12), "float32", "S1", "A", ("a", "b"), "float32"),
    "rep": ((8,), "float32", "R", "D", ("d",), "float32"),
    "bf": ((8, 4), "bfloat16", "S0", "A", ("a", "b"), "bfloat16"),
    "i64": ((6, 4), "int64", "S1", "A", (None, "a"), "int32"),
}

# JAX-saved arrays loaded into torch DTensors on 2 ranks: name -> placement
TORCH_TARGETS = {"sharded": "S0", "partial_a": "S1", "replicated": "R", "bf16": "S0",
                 "ints": "S1", "vector": "S0", "transposed": "S1"}


def expected(name: str, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """The deterministic contents of every test array (exact in every dtype used)."""
    salt = sum(map(ord, name)) % 17
    x = (np.arange(math.prod(shape), dtype=np.float64).reshape(shape) % 97) + salt
    if "float" in dtype:
        x = x + 0.5
    if dtype == "bfloat16":
        import ml_dtypes

        return x.astype(ml_dtypes.bfloat16)
    return x.astype(dtype)


# ----------------------------------------------------------------------------
# workers
# ----------------------------------------------------------------------------


def _checks(checks: list[tuple[str, Any]], barrier: Any = None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, fn in checks:
        try:
            out[name] = {"ok": True, "value": fn()}
        except BaseException:  # noqa: BLE001
            tb = traceback.format_exc()
            print(f"check {name} failed:\n{tb}", file=sys.stderr, flush=True)
            out[name] = {"ok": False, "error": tb}
        if barrier is not None:
            barrier()
    return out


def _meshes() -> dict[str, Any]:
    import jax
    from jax.sharding import Mesh

    devs = jax.devices()
    assert len(devs) == 8, f"want 8 host devices, have {len(devs)}"
    return {
        "A": Mesh(np.array(devs).reshape(4, 2), ("a", "b")),
        "B": Mesh(np.array(devs).reshape(2, 4), ("x", "y")),
        "D": Mesh(np.array(devs), ("d",)),
        "S": devs[3],
    }


def _sharding(meshes: dict[str, Any], mesh: str, spec: tuple[Any, ...]) -> Any:
    from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

    if mesh == "S":
        return SingleDeviceSharding(meshes["S"])
    return NamedSharding(meshes[mesh], PartitionSpec(*spec))


def _check_jax(name: str, got: Any, want: np.ndarray, sharding: Any, problems: list[str]) -> None:
    import jax

    if not isinstance(got, jax.Array):
        problems.append(f"{name}: got {type(got).__name__}, want jax.Array")
        return
    if got.shape != want.shape or np.dtype(got.dtype) != want.dtype:
        problems.append(f"{name}: {got.shape} {got.dtype}, want {want.shape} {want.dtype}")
        return
    if sharding is not None and not got.sharding.is_equivalent_to(sharding, got.ndim):
        problems.append(f"{name}: sharding {got.sharding}, want {sharding}")
    for sh in got.addressable_shards:
        if not np.array_equal(np.asarray(sh.data), want[sh.index]):
            problems.append(f"{name}: shard on device {sh.device.id} at {sh.index} differs")
            return
    if not np.array_equal(np.asarray(got), want):
        problems.append(f"{name}: gathered values differ")


def worker_jax_main(ctx: Context) -> dict[str, Any]:
    """Save sharded arrays, load them back in many layouts (one process, 8 devices)."""
    import jax

    import statestream as ss

    meshes = _meshes()
    root = Path(ctx.args["dir"])
    want = {k: expected(k, v[0], v[1]) for k, v in LAYOUTS.items()}
    saved_sh = {k: _sharding(meshes, v[2], v[3]) for k, v in LAYOUTS.items()}
    other_sh = {k: _sharding(meshes, v[4], v[5]) for k, v in LAYOUTS.items()}

    def save() -> Any:
        params = {k: jax.device_put(want[k], saved_sh[k]) for k in LAYOUTS}
        ss.save(root / "jax", {"params": params, "step": 5, "note": "eight devices"})
        return [len(a.addressable_shards) for a in params.values()]

    def load_with(shardings: dict[str, Any], concrete: bool) -> list[str]:
        def like(k: str) -> Any:
            if concrete:
                return jax.device_put(np.zeros_like(want[k]), shardings[k])
            return jax.ShapeDtypeStruct(want[k].shape, want[k].dtype, sharding=shardings[k])

        out = ss.load(root / "jax", target={"params": {k: like(k) for k in LAYOUTS}, "step": 0})
        problems: list[str] = []
        if out["step"] != 5:
            problems.append(f"step {out['step']!r}")
        for k in LAYOUTS:
            _check_jax(k, out["params"][k], want[k], shardings[k], problems)
        return problems

    def cast() -> list[str]:
        import ml_dtypes

        sds = jax.ShapeDtypeStruct((16, 12), ml_dtypes.bfloat16, sharding=other_sh["sharded"])
        out = ss.load(root / "jax", target={"params": {"sharded": sds}})
        problems: list[str] = []
        _check_jax("sharded->bf16", out["params"]["sharded"],
                   want["sharded"].astype(ml_dtypes.bfloat16), other_sh["sharded"], problems)
        if set(out) != {"params"} or set(out["params"]) != {"sharded"}:
            problems.append(f"partial target loaded {sorted(out)} / {sorted(out['params'])}")
        return problems

    def as_numpy() -> list[str]:
        out = ss.load(root / "jax")
        problems = []
        for k in LAYOUTS:
            got = out["params"][k]
            if not isinstance(got, np.ndarray) or not np.array_equal(got, want[k]):
                problems.append(f"{k}: {type(got).__name__} differs")
        if out["note"] != "eight devices":
            problems.append("note differs")
        return problems

    return _checks([
        ("save", save),
        ("same", lambda: load_with(saved_sh, False)),
        ("reshard", lambda: load_with(other_sh, False)),
        ("concrete", lambda: load_with(other_sh, True)),
        ("cast", cast),
        ("numpy", as_numpy),
        ("host_memory", lambda: _load_into_host_memory(root / "jax", want, other_sh)),
        ("indivisible", lambda: _load_into_indivisible_sharding(root / "jax", meshes)),
    ])


def _load_into_indivisible_sharding(path: Path, meshes: dict[str, Any]) -> str:
    """A target sharding that cannot lay out the saved shape (6 columns over 8
    devices): the error says which key path, as a TargetMismatchError."""
    import jax

    import statestream as ss

    sds = jax.ShapeDtypeStruct((4, 6), np.int32, sharding=_sharding(meshes, "D", (None, "d")))
    try:
        ss.load(path, target={"params": {"ints": sds}})
    except ss.TargetMismatchError as exc:
        return str(exc)
    return "no error"


def _load_into_host_memory(path: Path, want: dict[str, np.ndarray],
                           shardings: dict[str, Any]) -> list[str]:
    """Targets in host memory (a host-offloaded optimizer state: memory_kind
    "pinned_host") load there, every shard of a sharded array too."""
    import jax

    import statestream as ss

    host = {k: s.with_memory_kind("pinned_host") for k, s in shardings.items()}
    like = {k: jax.ShapeDtypeStruct(want[k].shape, want[k].dtype, sharding=host[k])
            for k in LAYOUTS}
    out = ss.load(path, target={"params": like})
    problems: list[str] = []
    for k in LAYOUTS:
        got = out["params"][k]
        _check_jax(k, got, want[k], host[k], problems)
        kinds = {sh.data.sharding.memory_kind for sh in got.addressable_shards}
        if got.sharding.memory_kind != "pinned_host" or kinds != {"pinned_host"}:
            problems.append(f"{k}: memory kind {got.sharding.memory_kind}, shards in {kinds}")
    return problems


def worker_torch_cross(ctx: Context) -> dict[str, Any]:
    """2 gloo ranks: load the JAX checkpoint into DTensors; save DTensors for JAX."""
    import datetime

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    import statestream as ss

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ctx.port}", rank=ctx.rank,
                            world_size=ctx.world, timeout=datetime.timedelta(seconds=90))
    mesh = init_device_mesh("cpu", (ctx.world,))

    def pl(p: str) -> list[Any]:
        return [Replicate()] if p == "R" else [Shard(int(p[1:]))]

    def to_torch(a: np.ndarray) -> Any:
        if a.dtype.name == "bfloat16":
            return torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16)
        return torch.from_numpy(np.ascontiguousarray(a))

    def load_jax() -> list[str]:
        problems: list[str] = []
        fulls = {k: to_torch(expected(k, LAYOUTS[k][0], LAYOUTS[k][1])) for k in TORCH_TARGETS}
        like = {"params": {k: distribute_tensor(torch.zeros_like(fulls[k]), mesh, pl(p))
                           for k, p in TORCH_TARGETS.items()}}
        out = ss.load(Path(ctx.args["jax_dir"]) / "jax", target=like)
        for k, p in TORCH_TARGETS.items():
            got = out["params"][k]
            if not isinstance(got, DTensor) or list(got.placements) != pl(p):
                problems.append(f"{k}: {type(got).__name__} {getattr(got, 'placements', '')}")
                continue
            full = got.full_tensor()
            if full.dtype != fulls[k].dtype or not torch.equal(full, fulls[k]):
                problems.append(f"{k}: values differ")
        return problems

    def save_torch() -> bool:
        state = {"t": {k: distribute_tensor(to_torch(expected(k, v[0], v[1])), mesh, pl(v[2]))
                       for k, v in TORCH_LAYOUTS.items()}, "epoch": 2}
        ss.save(Path(ctx.args["out"]) / "torch", state)
        return True

    return _checks([("load_jax", load_jax), ("save_torch", save_torch)], barrier=dist.barrier)


def worker_jax_from_torch(ctx: Context) -> dict[str, Any]:
    """Load the torch DTensor checkpoint as sharded jax arrays on 8 devices."""
    import jax

    import statestream as ss

    meshes = _meshes()

    def load() -> list[str]:
        problems: list[str] = []
        like = {}
        wants = {}
        for k, (shape, dtype, _, mesh, spec, jdtype) in TORCH_LAYOUTS.items():
            wants[k] = expected(k, shape, dtype).astype(expected(k, (), jdtype).dtype)
            like[k] = jax.ShapeDtypeStruct(shape, wants[k].dtype,
                                           sharding=_sharding(meshes, mesh, spec))
        out = ss.load(Path(ctx.args["torch_dir"]), target={"t": like, "epoch": 0})
        if out["epoch"] != 2:
            problems.append(f"epoch {out['epoch']!r}")
        for k in TORCH_LAYOUTS:
            _check_jax(k, out["t"][k], wants[k], like[k].sharding, problems)
        return problems

    return _checks([("load", load)])


# ----------------------------------------------------------------------------
# pytest side
# ----------------------------------------------------------------------------


def _values(res: list[Any], check: str) -> list[Any]:
    bad = [f"--- rank {r.rank} ---\n{r.value[check]['error']}" for r in res
           if not r.value[check]["ok"]]
    if bad:
        pytest.fail(f"check {check!r} failed:\n" + "\n".join(bad), pytrace=False)
    return [r.value[check]["value"] for r in res]


@pytest.fixture(scope="module")
def jax_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any]]:
    tmp = tmp_path_factory.mktemp("jax-8dev")
    res = launch(THIS, "worker_jax_main", 1, tmp, args={"dir": str(tmp)}, env=JAX_ENV,
                 timeout_s=LAUNCH_TIMEOUT_S)
    return tmp, res


@pytest.fixture(scope="module")
def cross_run(jax_run: tuple[Path, list[Any]], tmp_path_factory: pytest.TempPathFactory
              ) -> tuple[list[Any], list[Any] | None]:
    pytest.importorskip("torch")
    tmp = tmp_path_factory.mktemp("cross-torch")
    torch_res = launch(THIS, "worker_torch_cross", 2, tmp,
                       args={"jax_dir": str(jax_run[0]), "out": str(tmp)},
                       timeout_s=LAUNCH_TIMEOUT_S)
    jax_res = None
    if all(r.value["save_torch"]["ok"] for r in torch_res):
        jax_res = launch(THIS, "worker_jax_from_torch", 1, tmp,
                         args={"torch_dir": str(tmp / "torch")}, env=JAX_ENV,
                         timeout_s=LAUNCH_TIMEOUT_S, tag="jax-from-torch")
    return torch_res, jax_res


timeout = pytest.mark.timeout(3 * LAUNCH_TIMEOUT_S + 60)


@timeout
def test_save_sharded_and_partially_replicated(jax_run: tuple[Path, list[Any]]) -> None:
    tmp, res = jax_run
    assert _values(res, "save") == [[8] * len(LAYOUTS)]
    reader, m = open_checkpoint(tmp / "jax")
    reader.close()
    params = m.tree.child("params")
    assert params is not None
    distinct_boxes = {"sharded": 8, "partial_a": 4, "partial_b": 2, "transposed": 8,
                      "replicated": 1, "bf16": 4, "ints": 2, "vector": 8, "scalar": 1}
    for k, n in distinct_boxes.items():
        node = params.child(k)
        assert node is not None and node.array is not None
        a = m.arrays[node.array]
        # every distinct box written exactly once, replicas skipped
        assert len(a.chunks) == n, (k, len(a.chunks))
        assert sum(c.nbytes for c in a.chunks) == a.nbytes, k
    assert ss.verify(tmp / "jax").ok


@timeout
@pytest.mark.parametrize("case", ["same", "reshard", "concrete", "cast", "numpy", "host_memory"])
def test_load_sharded_jax(jax_run: tuple[Path, list[Any]], case: str) -> None:
    assert _values(jax_run[1], case) == [[]]


@timeout
def test_a_target_sharding_that_cannot_hold_the_array_names_its_key_path(
        jax_run: tuple[Path, list[Any]]) -> None:
    [msg] = _values(jax_run[1], "indivisible")
    assert "key path 'params/ints'" in msg and "int32[4, 6]" in msg, msg


@timeout
def test_jax_checkpoint_loads_as_numpy_in_pytest_process(jax_run: tuple[Path, list[Any]]) -> None:
    out = ss.load(jax_run[0] / "jax", collective=ss.SingleProcess())
    for k, v in LAYOUTS.items():
        got = out["params"][k]
        assert isinstance(got, np.ndarray), k
        np.testing.assert_array_equal(got, expected(k, v[0], v[1]), err_msg=k)
    assert out["step"] == 5


@timeout
def test_jax_sharded_into_torch_dtensors(cross_run: tuple[list[Any], Any]) -> None:
    for problems in _values(cross_run[0], "load_jax"):
        assert problems == []


@timeout
def test_torch_dtensors_into_sharded_jax(cross_run: tuple[list[Any], Any]) -> None:
    assert _values(cross_run[0], "save_torch") == [True, True]
    assert cross_run[1] is not None
    assert _values(cross_run[1], "load") == [[]]
