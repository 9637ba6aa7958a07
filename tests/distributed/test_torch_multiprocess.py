"""Multi-process save/load with torch.distributed (gloo, real processes, loopback only).

Each launch of N processes runs many checks in one go (imports and process
group setup dominate on a small machine); every check's outcome is reported
back per rank and asserted here, in the pytest process:

* ``main`` (N = 2 and 4): per-rank state next to replicated state, DTensors on
  1-D and 2-D meshes (same and different placements, uneven and empty
  shards), an FSDP2 model + Adam round trip, a large Shard(0) array for
  N -> M, and failures (a bad leaf, a failed write, disagreeing shapes, a bad
  load target) that must raise on every rank, naming the culprit.
* ``load`` (4 -> 2 and 2 -> 4): load the other world size's checkpoints into
  DTensor / FSDP2 targets, measuring the bytes each process reads.
* ``timeout`` (2): a rank that never calls save makes the other one fail with
  CollectiveTimeoutError instead of hanging.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback
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
from statestream.api._load import open_checkpoint  # noqa: E402

THIS = os.path.abspath(__file__)
LAUNCH_TIMEOUT_S = 150
N_SHARED = 16
SHARED_NUMEL = 16384  # 64 KiB of float32 each
BIG_SHAPE = (4096, 256)  # 4 MiB of float32


# ----------------------------------------------------------------------------
# worker side (runs in the child processes)
# ----------------------------------------------------------------------------


def _init(ctx: Context, timeout_s: float = 90.0) -> None:
    init_gloo(ctx, timeout_s)


def _run_checks(ctx: Context, checks: list[tuple[str, Any]]) -> dict[str, Any]:
    """Run each check on every rank; record its value or traceback; keep ranks in step."""
    import torch.distributed as dist

    out: dict[str, Any] = {}
    t0 = time.monotonic()
    for name, fn in checks:
        t = time.monotonic()
        try:
            out[name] = {"ok": True, "value": fn()}
        except BaseException:  # noqa: BLE001
            tb = traceback.format_exc()
            print(f"[rank {ctx.rank}] check {name} failed:\n{tb}", file=sys.stderr, flush=True)
            out[name] = {"ok": False, "error": tb}
        dist.barrier()
        out[name]["seconds"] = round(time.monotonic() - t, 2)  # for reports only
    out["_total_seconds"] = round(time.monotonic() - t0, 2)
    return out


def _full(shape: tuple[int, ...], dtype: Any, salt: float = 0.0) -> Any:
    import torch

    t = torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape) + salt
    return t.to(dtype)


# The DTensor layouts: name -> (shape, dtype name, saved placements, reshard placements)
def _layouts_1d(world: int) -> dict[str, tuple[tuple[int, ...], str, str, str]]:
    return {
        "rows": ((10, 6), "float32", "S0", "S1"),      # 10 rows over 4: 3,3,3,1
        "cols": ((6, 10), "float32", "S1", "S0"),
        "rep": ((5,), "float64", "R", "S0"),
        "odd": ((7, 3), "int64", "S0", "R"),
        "bf": ((9, 4), "bfloat16", "S0", "S1"),
        "tiny": ((world - 1, 2), "float32", "S0", "S1"),  # the last rank's shard is empty
        "scalar": ((), "float32", "R", "R"),
    }


_LAYOUTS_2D = {
    # name -> (shape, saved placements, reshard placements on the 2x2 mesh, 1-D placement)
    "a": ((5, 7), "S0,R", "R,S1", "S0"),
    "b": ((6, 5), "R,S1", "S0,S1", "S1"),
    "c": ((5, 7), "S0,S1", "R,R", "R"),
    "d": ((7, 5), "S1,S0", "S0,R", "S0"),
    "e": ((6, 4), "R,R", "S1,S0", "S1"),
    "f": ((5, 3), "S0,S0", "S1,R", "S0"),
}


def _placements(spec: str) -> list[Any]:
    from torch.distributed.tensor import Replicate, Shard

    return [Replicate() if p == "R" else Shard(int(p[1:])) for p in spec.split(",")]


def _dtype(name: str) -> Any:
    import torch

    return getattr(torch, name)


def _check_dtensor(name: str, got: Any, want_full: Any, placements: list[Any],
                   problems: list[str]) -> None:
    from torch.distributed.tensor import DTensor

    if not isinstance(got, DTensor):
        problems.append(f"{name}: got {type(got).__name__}, want DTensor")
        return
    if list(got.placements) != list(placements):
        problems.append(f"{name}: placements {got.placements}, want {placements}")
    full = got.full_tensor()
    if full.dtype != want_full.dtype or not bool((full == want_full).all()):
        problems.append(f"{name}: values differ ({full.dtype} vs {want_full.dtype})")


def _build_fsdp(seed: int) -> tuple[Any, Any]:
    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    # 5 output rows: uneven over 2 and 4 ranks (rank 3 holds an empty shard)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5))
    fully_shard(model[0])
    fully_shard(model[2])
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, opt


def _train_step(model: Any, opt: Any, rank: int, seed: int) -> None:
    import torch

    g = torch.Generator().manual_seed(1000 * seed + rank)
    x = torch.randn(4, 8, generator=g)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _full_of(v: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return v.full_tensor() if isinstance(v, DTensor) else v


def _fsdp_snapshot(model: Any, opt: Any) -> dict[str, Any]:
    """Full (unsharded) parameters and optimizer state as nested lists."""
    params = {n: _full_of(p.detach()).tolist() for n, p in model.named_parameters()}
    state = {
        str(i): {k: _full_of(v).tolist() if hasattr(v, "shape") else v for k, v in s.items()}
        for i, s in opt.state_dict()["state"].items()
    }
    groups = [{k: v for k, v in g.items() if k != "params"}
              for g in opt.state_dict()["param_groups"]]
    groups = json.loads(json.dumps(groups, default=repr))
    return {"params": params, "state": state, "groups": groups}


def _compare_snapshots(got: dict[str, Any], want: dict[str, Any], problems: list[str]) -> None:
    for n, v in want["params"].items():
        if n not in got["params"]:
            problems.append(f"param {n} missing")
        elif not np.array_equal(np.asarray(got["params"][n]), np.asarray(v)):
            problems.append(f"param {n} differs")
    if set(got["state"]) != set(want["state"]):
        problems.append(f"optimizer state keys {sorted(got['state'])} != {sorted(want['state'])}")
    for i, s in want["state"].items():
        for k, v in s.items():
            g = got["state"].get(i, {}).get(k)
            if g is None or not np.array_equal(np.asarray(g), np.asarray(v)):
                problems.append(f"optimizer state {i}/{k} differs")
    if got["groups"] != want["groups"]:
        problems.append(f"param_groups differ: {got['groups']} vs {want['groups']}")


def worker_main(ctx: Context) -> dict[str, Any]:
    """Everything that runs on one world size (see module docstring)."""
    _init(ctx)
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    import statestream as ss

    rank, world = ctx.rank, ctx.world
    root = Path(ctx.args["dir"])
    mesh = init_device_mesh("cpu", (world,))

    def mixed() -> Any:
        state = {
            f"stage{rank}": {"w": _full((3, 4), torch.float32, 100.0 * rank), "id": rank,
                             "name": f"stage-{rank}"},
            "shared": {f"t{i}": torch.full((SHARED_NUMEL,), float(i)) for i in range(N_SHARED)},
            "plain": {"lr": 0.5, "tag": "run", "vec": torch.arange(7), "flag": True,
                      "none": None, "blob": b"\x00\x01"},
            "step": 3,
        }
        ss.save(root / "mixed", state)
        return True

    def dtensor_1d() -> Any:
        layouts = _layouts_1d(world)
        fulls = {k: _full(sh, _dtype(dt), 0.25 if "float" in dt else 0) for k, (sh, dt, _, _) in
                 layouts.items()}
        state = {"dt": {k: distribute_tensor(fulls[k], mesh, _placements(p))
                        for k, (_, _, p, _) in layouts.items()}}
        ss.save(root / "dt1d", state)
        problems: list[str] = []
        for which in (2, 3):  # same placements, then resharded
            like = {"dt": {k: distribute_tensor(torch.zeros_like(fulls[k]), mesh,
                                                _placements(v[which]))
                           for k, v in layouts.items()}}
            out = ss.load(root / "dt1d", target=like)
            for k, v in layouts.items():
                _check_dtensor(f"{k}[{v[which]}]", out["dt"][k], fulls[k], _placements(v[which]),
                               problems)
        # dtype of the target wins: float32 rows into a float64 Shard(0) DTensor
        like64 = {"dt": {"rows": distribute_tensor(torch.zeros(10, 6, dtype=torch.float64), mesh,
                                                   _placements("S0"))}}
        out = ss.load(root / "dt1d", target=like64)
        _check_dtensor("rows->float64", out["dt"]["rows"], fulls["rows"].double(),
                       _placements("S0"), problems)
        # a plain tensor target on a process of the job reads the whole array
        out = ss.load(root / "dt1d", target={"dt": {"cols": torch.zeros(6, 10)}})
        if not torch.equal(out["dt"]["cols"], fulls["cols"]):
            problems.append("cols into a plain tensor differs")
        return problems

    def dtensor_2d() -> Any:
        if world != 4:
            return "skipped"
        mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        fulls = {k: _full(sh, torch.float32, 0.5) for k, (sh, _, _, _) in _LAYOUTS_2D.items()}
        state = {"m": {k: distribute_tensor(fulls[k], mesh2, _placements(p))
                       for k, (_, p, _, _) in _LAYOUTS_2D.items()}}
        ss.save(root / "dt2d", state)
        problems: list[str] = []
        for which, m in ((1, mesh2), (2, mesh2), (3, mesh)):
            like = {"m": {k: distribute_tensor(torch.zeros_like(fulls[k]), m,
                                               _placements(v[which]))
                          for k, v in _LAYOUTS_2D.items()}}
            out = ss.load(root / "dt2d", target=like)
            for k, v in _LAYOUTS_2D.items():
                _check_dtensor(f"{k}[{v[which]}]", out["m"][k], fulls[k], _placements(v[which]),
                               problems)
        return problems

    def fsdp() -> Any:
        model, opt = _build_fsdp(0)
        _train_step(model, opt, rank, 1)
        ref = _fsdp_snapshot(model, opt)
        ss.save(root / "fsdp", {"model": model, "optim": opt, "step": 1})
        # a fresh model + optimizer (different init, one step so Adam has state)
        model2, opt2 = _build_fsdp(123)
        _train_step(model2, opt2, rank, 7)
        out = ss.load(root / "fsdp", target={"model": model2, "optim": opt2, "step": 0})
        problems: list[str] = []
        if out["model"] is not model2 or out["optim"] is not opt2 or out["step"] != 1:
            problems.append(f"load returned {type(out['model'])}, {type(out['optim'])}, "
                            f"step {out['step']!r}")
        _compare_snapshots(_fsdp_snapshot(model2, opt2), ref, problems)
        # both train on identically after the load
        _train_step(model, opt, rank, 9)
        _train_step(model2, opt2, rank, 9)
        _compare_snapshots(_fsdp_snapshot(model2, opt2), _fsdp_snapshot(model, opt), problems)
        return {"problems": problems, "ref": ref if rank == 0 else None}

    def big() -> Any:
        full = _full(BIG_SHAPE, torch.float32)
        ss.save(root / "big", {"big": distribute_tensor(full, mesh, _placements("S0"))})
        calls: list[tuple[int, int]] = []
        like = {"big": distribute_tensor(torch.zeros(BIG_SHAPE), mesh, _placements("S0"))}
        out = ss.load(root / "big", target=like, progress=lambda d, t: calls.append((d, t)))
        local = out["big"].to_local()
        rows = (BIG_SHAPE[0] + world - 1) // world
        ok = torch.equal(local, full[rank * rows:rank * rows + local.shape[0]])
        return {"last": calls[-1] if calls else None, "local_bytes": local.numel() * 4, "ok": ok}

    def fail_walk() -> Any:
        target = root / "fail_walk" / "ck"
        target.parent.mkdir(exist_ok=True)
        state = {"w": torch.ones(3), "x": (lambda: 0) if rank == world - 1 else 1}
        return _expect_distributed_error(lambda: ss.save(target, state))

    def fail_write() -> Any:
        import statestream.engine._job as multi

        target = root / "fail_write" / "ck"
        target.parent.mkdir(exist_ok=True)
        orig = multi.StreamWriter
        if rank == world - 1:
            class Broken(orig):  # type: ignore[misc, valid-type]
                def close(self) -> Any:
                    super().close()
                    raise OSError(28, "No space left on device (injected)")

            multi.StreamWriter = Broken
        try:
            return _expect_distributed_error(
                lambda: ss.save(target, {"w": torch.ones(1000) * rank, "r": torch.ones(64)}))
        finally:
            multi.StreamWriter = orig

    def fail_plan() -> Any:
        target = root / "fail_plan" / "ck"
        target.parent.mkdir(exist_ok=True)
        shape = (4,) if rank == world - 1 else (3,)
        return _expect_distributed_error(lambda: ss.save(target, {"w": torch.ones(shape)}))

    def fail_load() -> Any:
        n = 8 if rank == world - 1 else 7
        return _expect_distributed_error(
            lambda: ss.load(root / "mixed", target={"plain": {"vec": torch.zeros(n)}}))

    def any_true() -> Any:
        from statestream.distributed import TorchCollective

        coll = TorchCollective()
        return [coll.any_true(False), coll.any_true(rank == world - 1), coll.any_true(True),
                coll.any_true(rank == 0)]

    def gather() -> Any:
        from statestream.distributed import TorchCollective

        coll = TorchCollective()
        small = coll.all_gather_object({"rank": rank, "t": (1, 2)})
        # one rank's object over the first round's 16 KiB block: a second round
        big = coll.all_gather_object("x" * (40_000 + rank) if rank == world - 1 else rank)
        every = coll.all_gather_object([rank] * (5_000 + 7 * rank))  # all over, uneven
        # to one rank: the first round to all, the rest to the last rank alone
        dst = world - 1
        to_one = [coll.gather_object({"rank": rank}, dst),
                  coll.gather_object("y" * (30_000 + rank) if rank == 0 else rank, dst),
                  coll.gather_object([rank] * (6_000 + rank), dst)]
        return {"small": [[d["rank"], list(d["t"]), type(d["t"]).__name__] for d in small],
                "big": [len(b) if isinstance(b, str) else b for b in big],
                "every": [len(e) == 5_000 + 7 * r and set(e) == {r} for r, e in enumerate(every)],
                "to_one": None if rank != dst else [
                    [d["rank"] for d in to_one[0]],
                    [len(b) if isinstance(b, str) else b for b in to_one[1]],
                    [len(e) == 6_000 + r and set(e) == {r} for r, e in enumerate(to_one[2])]],
                "to_one_elsewhere": [x is None for x in to_one] if rank != dst else None}

    def sparse() -> Any:
        # only rank 0 has arrays to write; the others hold an empty stage
        state = {"a": torch.arange(4.0), f"stage{rank}": {"x": torch.ones(2)} if rank == 0 else {}}
        ss.save(root / "sparse", state)
        return True

    def overwrite() -> Any:
        ids = []
        for gen in (1, 2):
            ss.save(root / "ow", {"gen": gen, "w": torch.full((8,), float(gen))},
                    overwrite=gen > 1)
            ids.append(ss.metadata(root / "ow").meta.get("save_id"))
        out = ss.load(root / "ow")
        again = _expect_distributed_error(lambda: ss.save(root / "ow", {"gen": 3}))
        return {"gen": out["gen"], "w": out["w"].tolist(), "again": again, "ids": ids}

    def tied() -> Any:
        # the same memory under two keys (tied weights), per rank, replicated and a
        # DTensor: each stored once (an alias leaf), loaded tied
        w = _full((3, 4), torch.float32, 100.0 * rank)
        v = torch.arange(6.0)
        dt = distribute_tensor(_full((8, 2), torch.float32), mesh, _placements("S0"))
        ss.save(root / "tied", {f"stage{rank}": {"w": w, "w2": w}, "shared": {"v": v, "v2": v},
                                "dt": {"a": dt, "b": dt}})
        a = distribute_tensor(torch.zeros(8, 2), mesh, _placements("S0"))
        out = ss.load(root / "tied", target={"dt": {"a": a, "b": a}}, in_place=True)
        return (out["dt"]["a"] is a and out["dt"]["b"] is a
                and torch.equal(a.full_tensor(), _full((8, 2), torch.float32)))

    def fsdp_fresh_optimizer() -> Any:
        # An optimizer that never stepped has no state to take placements from.
        model, opt = _build_fsdp(77)
        ss.load(root / "fsdp", target={"model": model, "optim": opt})
        from torch.distributed.tensor import DTensor

        kinds = sorted({type(v).__name__ for s in opt.state_dict()["state"].values()
                        for k, v in s.items() if k != "step"})
        try:
            _train_step(model, opt, rank, 4)
            step = None
        except Exception as exc:  # noqa: BLE001
            step = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        return {"kinds": kinds, "dtensor": kinds == [DTensor.__name__], "step_error": step}

    def plans() -> Any:
        # The plan of a save is kept for the next save of the same structure: only the
        # plain values and the bytes change (engine/_plans.py).
        from statestream import _hooks
        from statestream.engine._plans import forget_plans

        reused: list[int] = []
        _hooks.register("save.plan_reused", lambda: reused.append(1))

        def state(step: int, extra: bool = False) -> Any:
            own: dict[str, Any] = {"w": torch.full((6,), float(step * 10 + rank))}
            if extra:
                own["extra"] = torch.ones(3)
            return {"step": step, "name": f"run-{step}", f"r{rank}": own, "lr": step / 4,
                    "shared": {"v": torch.arange(8.0) + step}}

        out: dict[str, Any] = {"reused": []}
        for i, (step, extra, forget) in enumerate([
                (1, False, False), (2, False, False), (3, rank == 1, False),
                (4, rank == 1, rank == world - 1), (5, rank == 1, False)]):
            if forget:  # one process lost what it kept (restarted): nobody may reuse
                forget_plans()
            before = len(reused)
            ss.save(root / f"plans{i}", state(step, extra))
            out["reused"].append(len(reused) - before)
        _hooks.clear()
        from statestream.engine import _plans

        # rank 0 planned alone: only it keeps the whole tree; the others their own part
        kept = list(_plans._KEPT.values())[-1]
        out["kept"] = [len(kept.arrays), sorted(kept.index), kept.total_bytes,
                       [[list(map(list, b)) for b in bx] for bx in kept.mine]]
        got = ss.load(root / "plans4")
        out["loaded"] = [got["step"], got["name"], got["lr"], got["shared"]["v"].tolist(),
                         got[f"r{rank}"]["w"].tolist(), sorted(got[f"r{rank}"])]

        class NoGather:
            """A collective without gather_object: every rank plans (all-gather)."""

            def __init__(self, c: Any) -> None:
                self._c = c

            def __getattr__(self, name: str) -> Any:
                if name == "gather_object":
                    raise AttributeError(name)
                return getattr(self._c, name)

            def fork(self, channel: str) -> Any:
                return NoGather(self._c.fork(channel))

        forget_plans()
        ss.save(root / "plans_nogather", state(6, rank == 1),
                collective=NoGather(ss.TorchCollective()))
        got = ss.load(root / "plans_nogather")
        out["no_gather"] = [got["step"], got[f"r{rank}"]["w"].tolist(), sorted(got[f"r{rank}"])]
        return out

    return _run_checks(ctx, [
        ("plans", plans), ("mixed", mixed), ("dtensor_1d", dtensor_1d), ("dtensor_2d", dtensor_2d),
        ("fsdp", fsdp), ("big", big), ("fail_walk", fail_walk), ("fail_write", fail_write),
        ("fail_plan", fail_plan), ("fail_load", fail_load), ("sparse", sparse),
        ("overwrite", overwrite), ("tied", tied), ("any_true", any_true), ("gather", gather),
        ("fsdp_fresh_optimizer", fsdp_fresh_optimizer),  # last: may leave ranks uneven
    ])


def _expect_distributed_error(fn: Any) -> dict[str, Any]:
    import statestream as ss

    try:
        fn()
    except Exception as exc:  # noqa: BLE001
        return {
            "type": type(exc).__name__,
            "distributed": isinstance(exc, ss.DistributedError),
            "message": str(exc),
            "cause": type(exc.__cause__).__name__ if exc.__cause__ is not None else None,
        }
    return {"type": None, "distributed": False, "message": "no error raised", "cause": None}


def worker_load(ctx: Context) -> dict[str, Any]:
    """Load checkpoints written by another world size into this one's layouts."""
    _init(ctx)
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    import statestream as ss

    rank, world = ctx.rank, ctx.world
    src = Path(ctx.args["src"])
    saved_world = ctx.args["saved_world"]
    mesh = init_device_mesh("cpu", (world,))

    def big() -> Any:
        full = _full(BIG_SHAPE, torch.float32)
        calls: list[tuple[int, int]] = []
        like = {"big": distribute_tensor(torch.zeros(BIG_SHAPE), mesh, _placements("S0"))}
        out = ss.load(src / "big", target=like, progress=lambda d, t: calls.append((d, t)))
        local = out["big"].to_local()
        rows = (BIG_SHAPE[0] + world - 1) // world
        ok = torch.equal(local, full[rank * rows:rank * rows + local.shape[0]])
        return {"last": calls[-1] if calls else None, "local_bytes": local.numel() * 4, "ok": ok}

    def dtensor_1d() -> Any:
        layouts = _layouts_1d(saved_world)
        problems: list[str] = []
        for which in (2, 3):
            fulls = {k: _full(sh, _dtype(dt), 0.25 if "float" in dt else 0)
                     for k, (sh, dt, _, _) in layouts.items()}
            like = {"dt": {k: distribute_tensor(torch.zeros_like(fulls[k]), mesh,
                                                _placements(v[which]))
                           for k, v in layouts.items()}}
            out = ss.load(src / "dt1d", target=like)
            for k, v in layouts.items():
                _check_dtensor(f"{k}[{v[which]}]", out["dt"][k], fulls[k], _placements(v[which]),
                               problems)
        return problems

    def fsdp() -> Any:
        model, opt = _build_fsdp(321)
        _train_step(model, opt, rank, 3)
        out = ss.load(src / "fsdp", target={"model": model, "optim": opt})
        problems: list[str] = []
        if out["model"] is not model or out["optim"] is not opt:
            problems.append("stateful targets were not returned")
        return {"problems": problems, "got": _fsdp_snapshot(model, opt)}

    return _run_checks(ctx, [("big", big), ("dtensor_1d", dtensor_1d), ("fsdp", fsdp)])


def worker_timeout(ctx: Context) -> dict[str, Any]:
    """Rank 1 never calls save; rank 0 must fail with CollectiveTimeoutError."""
    _init(ctx)
    import torch

    import statestream as ss

    coll = ss.TorchCollective(timeout_s=3)  # creating it is collective: every rank does
    done = Path(ctx.tmp) / "rank0-done"
    if ctx.rank == 1:
        deadline = time.monotonic() + 60
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        return {"skipped_save": True}
    t0 = time.monotonic()
    try:
        res = _expect_distributed_error(
            lambda: ss.save(Path(ctx.args["dir"]) / "ck", {"w": torch.ones(3)}, collective=coll))
    finally:
        done.touch()
    res["elapsed_s"] = time.monotonic() - t0
    res["timeout_error"] = res["type"] == "CollectiveTimeoutError"
    return res


# ----------------------------------------------------------------------------
# pytest side
# ----------------------------------------------------------------------------


class _Runs:
    def __init__(self, factory: pytest.TempPathFactory) -> None:
        self.factory = factory
        self.main: dict[int, tuple[Path, list[Any]]] = {}
        self.load: dict[tuple[int, int], list[Any]] = {}

        self.failed: dict[Any, BaseException] = {}

    def _once(self, key: Any, fn: Any) -> Any:
        # a launch that failed is not retried by every test that needs it
        if key in self.failed:
            raise self.failed[key]
        try:
            return fn()
        except BaseException as exc:
            self.failed[key] = exc
            raise

    def get_main(self, world: int) -> tuple[Path, list[Any]]:
        if world not in self.main:
            def run() -> tuple[Path, list[Any]]:
                tmp = self.factory.mktemp(f"torch-main-{world}")
                res = launch(THIS, "worker_main", world, tmp, args={"dir": str(tmp)},
                             timeout_s=LAUNCH_TIMEOUT_S)
                return tmp, [r.value for r in res]

            self.main[world] = self._once(("main", world), run)
        return self.main[world]

    def get_load(self, saved: int, world: int) -> list[Any]:
        if (saved, world) not in self.load:
            src, _ = self.get_main(saved)

            def run() -> list[Any]:
                tmp = self.factory.mktemp(f"torch-load-{saved}-{world}")
                res = launch(THIS, "worker_load", world, tmp,
                             args={"src": str(src), "saved_world": saved},
                             timeout_s=LAUNCH_TIMEOUT_S)
                return [r.value for r in res]

            self.load[(saved, world)] = self._once(("load", saved, world), run)
        return self.load[(saved, world)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> _Runs:
    return _Runs(tmp_path_factory)


def _values(per_rank: list[Any], check: str) -> list[Any]:
    """The check's value on every rank, failing with the ranks' tracebacks if any failed."""
    bad = [f"--- rank {r} ---\n{v[check]['error']}" for r, v in enumerate(per_rank)
           if not v[check]["ok"]]
    if bad:
        pytest.fail(f"check {check!r} failed:\n" + "\n".join(bad), pytrace=False)
    return [v[check]["value"] for v in per_rank]


def _array_index(m: Any) -> dict[str, int]:
    """Key path -> array index of every array leaf of a manifest."""
    out: dict[str, int] = {}

    def walk(node: Any, path: tuple[Any, ...]) -> None:
        if node.array is not None:
            out["/".join(str(k) for k in path)] = node.array
            return
        kids = node.children or []
        keys = node.keys if node.keys is not None else list(range(len(kids)))
        if node.kind == "stateful":
            keys = [None] * len(kids)
        for k, c in zip(keys, kids):
            walk(c, path if k is None else path + (k,))

    walk(m.tree, ())
    return out


def _manifest(path: Path) -> Any:
    reader, m = open_checkpoint(path)
    reader.close()
    return m


WORLDS = [2, 4]
timeout_mark = pytest.mark.timeout(2 * LAUNCH_TIMEOUT_S + 60)


@timeout_mark
@pytest.mark.parametrize("world", WORLDS)
def test_stage_and_replicated_state_load_in_one_process(runs: _Runs, world: int) -> None:
    tmp, per_rank = runs.get_main(world)
    assert _values(per_rank, "mixed") == [True] * world
    out = ss.load(tmp / "mixed", collective=ss.SingleProcess())
    assert sorted(k for k in out if k.startswith("stage")) == [f"stage{r}" for r in range(world)]
    for r in range(world):
        st = out[f"stage{r}"]
        np.testing.assert_array_equal(
            st["w"], np.arange(12, dtype=np.float32).reshape(3, 4) + 100.0 * r)
        assert st["id"] == r and st["name"] == f"stage-{r}"
    for i in range(N_SHARED):
        np.testing.assert_array_equal(out["shared"][f"t{i}"], np.full(SHARED_NUMEL, float(i),
                                                                      np.float32))
    assert out["plain"]["lr"] == 0.5 and out["plain"]["tag"] == "run"
    assert out["plain"]["flag"] is True and out["plain"]["none"] is None
    assert out["plain"]["blob"] == b"\x00\x01"
    np.testing.assert_array_equal(out["plain"]["vec"], np.arange(7))
    assert out["step"] == 3
    assert ss.verify(tmp / "mixed").ok


@timeout_mark
@pytest.mark.parametrize("world", WORLDS)
def test_replicated_chunks_written_once_and_spread(runs: _Runs, world: int) -> None:
    tmp, per_rank = runs.get_main(world)
    _values(per_rank, "mixed")
    m = _manifest(tmp / "mixed")
    index = _array_index(m)
    writer_of: dict[str, int] = {}
    for key, ai in index.items():
        a = m.arrays[ai]
        # exactly once: the chunks tile the array without any box written twice
        assert sum(c.nbytes for c in a.chunks) == a.nbytes, key
        if key.startswith("shared/"):
            assert len(a.chunks) == 1, key
            name = m.files[a.chunks[0].file].name
            writer_of[key] = int(name.split("/r")[1].split("-")[0])
        if key.startswith("stage"):
            r = int(key.split("/")[0][len("stage"):])
            assert all(m.files[c.file].name.startswith(f"data/r{r}-") for c in a.chunks), key
    counts = [sum(1 for w in writer_of.values() if w == r) for r in range(world)]
    assert len(writer_of) == N_SHARED and max(counts) - min(counts) <= 1, counts
    per_rank_bytes = [0] * world
    for name, size in ss.metadata(tmp / "mixed").files:
        per_rank_bytes[int(name.split("/r")[1].split("-")[0])] += size
    share = N_SHARED * SHARED_NUMEL * 4 / world
    assert max(per_rank_bytes) <= 1.1 * share + 8192, per_rank_bytes
    assert min(per_rank_bytes) >= 0.9 * share, per_rank_bytes


@timeout_mark
@pytest.mark.parametrize("world", WORLDS)
def test_dtensor_1d_roundtrip_reshard_and_numpy(runs: _Runs, world: int) -> None:
    tmp, per_rank = runs.get_main(world)
    for problems in _values(per_rank, "dtensor_1d"):
        assert problems == []
    out = ss.load(tmp / "dt1d", collective=ss.SingleProcess())
    for k, (shape, dt, _, _) in _layouts_1d(world).items():
        want = _full(shape, _dtype(dt), 0.25 if "float" in dt else 0)
        got = out["dt"][k]
        assert got.shape == shape and str(got.dtype) == dt, k
        np.testing.assert_array_equal(got.astype(np.float64), want.double().numpy(), err_msg=k)
    m = _manifest(tmp / "dt1d")
    for key, ai in _array_index(m).items():  # shards tile, replicas once
        assert sum(c.nbytes for c in m.arrays[ai].chunks) == m.arrays[ai].nbytes, key


@timeout_mark
def test_dtensor_2d_mesh_roundtrip_and_reshard(runs: _Runs) -> None:
    tmp, per_rank = runs.get_main(4)
    for problems in _values(per_rank, "dtensor_2d"):
        assert problems == []
    out = ss.load(tmp / "dt2d", collective=ss.SingleProcess())
    for k, (shape, _, _, _) in _LAYOUTS_2D.items():
        np.testing.assert_array_equal(out["m"][k], _full(shape, torch.float32, 0.5).numpy())
    m = _manifest(tmp / "dt2d")
    for key, ai in _array_index(m).items():
        assert sum(c.nbytes for c in m.arrays[ai].chunks) == m.arrays[ai].nbytes, key


@timeout_mark
@pytest.mark.parametrize("world", WORLDS)
def test_fsdp2_model_and_optimizer_roundtrip(runs: _Runs, world: int) -> None:
    _, per_rank = runs.get_main(world)
    for v in _values(per_rank, "fsdp"):
        assert v["problems"] == []


@timeout_mark
@pytest.mark.parametrize("world", WORLDS)
def test_fsdp2_checkpoint_loads_as_numpy_in_one_process(runs: _Runs, world: int) -> None:
    tmp, per_rank = runs.get_main(world)
    ref = _values(per_rank, "fsdp")[0]["ref"]
    out = ss.load(tmp / "fsdp", collective=ss.SingleProcess())
    assert out["step"] == 1
    assert set(out["model"]) == set(ref["params"])
    for n, v in ref["params"].items():
        np.testing.assert_array_equal(out["model"][n], np.asarray(v, np.float32), err_msg=n)
    state = {str(k): v for k, v in out["optim"]["state"].items()}
    assert set(state) == set(ref["state"])
    for i, s in ref["state"].items():
        for k, v in s.items():
            np.testing.assert_array_equal(np.asarray(state[i][k]), np.asarray(v),
                                          err_msg=f"{i}/{k}")
    assert out["optim"]["param_groups"][0]["lr"] == pytest.approx(1e-2)


@timeout_mark
@pytest.mark.parametrize(("saved", "world"), [(4, 2), (2, 4)], ids=["4to2", "2to4"])
def test_fsdp2_reshard_load(runs: _Runs, saved: int, world: int) -> None:
    ref = _values(runs.get_main(saved)[1], "fsdp")[0]["ref"]
    problems: list[str] = []
    for v in _values(runs.get_load(saved, world), "fsdp"):
        problems += v["problems"]
        _compare_snapshots(v["got"], ref, problems)
    assert problems == []


@timeout_mark
@pytest.mark.parametrize(("saved", "world"), [(4, 2), (2, 4)], ids=["4to2", "2to4"])
def test_dtensor_n_to_m(runs: _Runs, saved: int, world: int) -> None:
    for problems in _values(runs.get_load(saved, world), "dtensor_1d"):
        assert problems == []


@timeout_mark
@pytest.mark.parametrize(("saved", "world"), [(4, 4), (2, 2), (4, 2), (2, 4)],
                         ids=["4to4", "2to2", "4to2", "2to4"])
def test_each_process_reads_only_its_shard(runs: _Runs, saved: int, world: int) -> None:
    if saved == world:
        values = _values(runs.get_main(world)[1], "big")
    else:
        values = _values(runs.get_load(saved, world), "big")
    for rank, v in enumerate(values):
        assert v["ok"], f"rank {rank}: wrong values"
        done, total = v["last"]
        assert done == total
        assert total <= 1.1 * v["local_bytes"] + 64 * 1024, (rank, total, v["local_bytes"])


@timeout_mark
@pytest.mark.parametrize("world", WORLDS)
def test_tied_tensors_stored_once_across_processes(runs: _Runs, world: int) -> None:
    tmp, per_rank = runs.get_main(world)
    assert _values(per_rank, "tied") == [True] * world
    m = _manifest(tmp / "tied")
    assert len(m.arrays) == world + 2  # one w per rank, v, dt: no second copies
    out = ss.load(tmp / "tied", collective=ss.SingleProcess())
    for r in range(world):
        want = np.arange(12, dtype=np.float32).reshape(3, 4) + 100.0 * r
        np.testing.assert_array_equal(out[f"stage{r}"]["w"], want)
        assert out[f"stage{r}"]["w2"] is out[f"stage{r}"]["w"]
    np.testing.assert_array_equal(out["shared"]["v2"], np.arange(6.0, dtype=np.float32))
    np.testing.assert_array_equal(out["dt"]["b"], _full((8, 2), torch.float32).numpy())
    assert ss.verify(tmp / "tied").ok


def _assert_nothing_committed(parent: Path) -> None:
    with pytest.raises(ss.CheckpointNotFoundError):
        ss.load(parent / "ck", collective=ss.SingleProcess())
    assert sorted(os.listdir(parent)) == [], "a failed save left files behind"


@timeout_mark
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", ["fail_walk", "fail_write"])
def test_save_failure_on_one_rank_raises_on_all(runs: _Runs, world: int, case: str) -> None:
    tmp, per_rank = runs.get_main(world)
    culprit = world - 1
    for rank, v in enumerate(_values(per_rank, case)):
        assert v["distributed"], (rank, v)
        assert f"rank {culprit}" in v["message"], (rank, v["message"])
        assert "nothing was committed" in v["message"]
        if case == "fail_walk":
            assert "UnsupportedTypeError" in v["message"] or rank == culprit, v
            assert "x" in v["message"], v["message"]  # the key path
        if case == "fail_write":
            assert "injected" in v["message"], v["message"]
    _assert_nothing_committed(tmp / case)


@timeout_mark
@pytest.mark.parametrize("world", WORLDS)
def test_ranks_disagreeing_on_a_shape_fail_together(runs: _Runs, world: int) -> None:
    tmp, per_rank = runs.get_main(world)
    for rank, v in enumerate(_values(per_rank, "fail_plan")):
        assert v["distributed"], (rank, v)
        assert "'w'" in v["message"] and "planning" in v["message"], v["message"]
    _assert_nothing_committed(tmp / "fail_plan")


@timeout_mark
@pytest.mark.parametrize("world", WORLDS)
def test_load_failure_on_one_rank_raises_on_all(runs: _Runs, world: int) -> None:
    _, per_rank = runs.get_main(world)
    culprit = world - 1
    for rank, v in enumerate(_values(per_rank, "fail_load")):
        assert v["distributed"], (rank, v)
        assert f"rank {culprit}" in v["message"] and "plain/vec" in v["message"], v["message"]
        assert "nothing was committed" not in v["message"], v["message"]
        if rank == culprit:
            assert v["cause"] == "TargetMismatchError", v


@timeout_mark
@pytest.mark.parametrize("world", WORLDS)
def test_any_true_is_the_same_on_every_rank(runs: _Runs, world: int) -> None:
    # agree's fast path: one all-reduce says whether any rank failed
    _, per_rank = runs.get_main(world)
    assert _values(per_rank, "any_true") == [[False, True, True, True]] * world


@timeout_mark
@pytest.mark.parametrize("world", WORLDS)
def test_a_save_of_the_same_structure_reuses_the_plan(runs: _Runs, world: int) -> None:
    _, per_rank = runs.get_main(world)
    got = _values(per_rank, "plans")
    # saves 2 and 5 reuse (only values changed); 1 is the first, 3 changes the structure
    # on rank 1, and before 4 the last rank forgot its plans: every rank agrees anew
    assert [g["reused"] for g in got] == [[0, 1, 0, 0, 1]] * world
    for rank, g in enumerate(got):
        own = ["extra", "w"] if rank == 1 else ["w"]
        assert g["loaded"] == [5, "run-5", 1.25, [float(x + 5) for x in range(8)],
                               [float(50 + rank)] * 6, own], (rank, g)
    for rank, g in enumerate(got):  # planned by every rank alike, without gather_object
        own = ["extra", "w"] if rank == 1 else ["w"]
        assert g["no_gather"] == [6, [float(60 + rank)] * 6, own], (rank, g["no_gather"])
    # the plan of the last save: every rank's w, rank 1's extra, the shared v
    arrays = world + 2
    total = (6 * world + 3 + 8) * 4
    keys = sorted(["shared/v"] + [f"r{r}/w" for r in range(world)] + ["r1/extra"])
    assert got[0]["kept"][:3] == [arrays, keys, total]
    for rank, g in enumerate(got[1:], 1):
        own_keys = sorted([f"r{rank}/w", "shared/v"] + (["r1/extra"] if rank == 1 else []))
        assert g["kept"][:3] == [0, own_keys, total], (rank, g["kept"])
    # every rank writes its own arrays, and one of them the shared v
    written = [sum(len(bx) for bx in g["kept"][3]) for g in got]
    assert sum(written) == arrays
    assert all(n >= (2 if rank == 1 else 1) for rank, n in enumerate(written)), written


@timeout_mark
@pytest.mark.parametrize("world", WORLDS)
def test_object_gather_in_one_or_two_rounds(runs: _Runs, world: int) -> None:
    _, per_rank = runs.get_main(world)
    want = {"small": [[r, [1, 2], "tuple"] for r in range(world)],
            "big": [*range(world - 1), 40_000 + world - 1],
            "every": [True] * world}
    got = _values(per_rank, "gather")
    assert [{k: g[k] for k in want} for g in got] == [want] * world
    # gather_object: everything on the last rank, nothing elsewhere
    assert got[-1]["to_one"] == [list(range(world)), [30_000, *range(1, world)], [True] * world]
    assert [g["to_one_elsewhere"] for g in got[:-1]] == [[True] * 3] * (world - 1)


@timeout_mark
@pytest.mark.parametrize("world", WORLDS)
def test_ranks_without_arrays_to_write(runs: _Runs, world: int) -> None:
    tmp, per_rank = runs.get_main(world)
    _values(per_rank, "sparse")
    out = ss.load(tmp / "sparse", collective=ss.SingleProcess())
    np.testing.assert_array_equal(out["a"], np.arange(4.0, dtype=np.float32))
    np.testing.assert_array_equal(out["stage0"]["x"], np.ones(2, np.float32))
    assert all(out[f"stage{r}"] == {} for r in range(1, world))
    assert {n.split("-")[0] for n, _ in ss.metadata(tmp / "sparse").files} == {"data/r0"}


@timeout_mark
@pytest.mark.parametrize("world", WORLDS)
def test_collective_overwrite_and_exists_error(runs: _Runs, world: int) -> None:
    tmp, per_rank = runs.get_main(world)
    for rank, v in enumerate(_values(per_rank, "overwrite")):
        assert v["gen"] == 2 and v["w"] == [2.0] * 8, v
        assert v["again"]["distributed"], v["again"]
        assert "rank 0" in v["again"]["message"] and "starting the save" in v["again"]["message"]
        if rank == 0:
            assert v["again"]["cause"] == "CheckpointExistsError", v["again"]
    assert ss.load(tmp / "ow", collective=ss.SingleProcess())["gen"] == 2
    assert sorted(p.name for p in tmp.iterdir() if p.name.startswith(".ow")) == []
    # each save names itself in its manifest: one random id, the same on every rank
    ids = [v["ids"] for v in _values(per_rank, "overwrite")]
    assert all(i == ids[0] for i in ids), ids
    assert all(len(x) == 32 and int(x, 16) >= 0 for x in ids[0]) and ids[0][0] != ids[0][1]
    assert ss.metadata(tmp / "ow").meta["save_id"] == ids[0][1]
    # a conversion is a save of its own: it does not carry the source's id
    copy = ss.convert(tmp / "ow", tmp / f"ow-copy{world}")
    assert "save_id" not in ss.metadata(copy).meta


@timeout_mark
@pytest.mark.parametrize("world", WORLDS)
def test_fsdp2_load_into_optimizer_that_never_stepped(runs: _Runs, world: int) -> None:
    """A fresh Adam has no state; the loaded state must still match the parameters."""
    values = _values(runs.get_main(world)[1], "fsdp_fresh_optimizer")
    bad = [v for v in values if not v["dtensor"] or v["step_error"]]
    assert not bad, bad[0]


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)
def test_rank_that_never_saves_makes_others_time_out(tmp_path: Path) -> None:
    res = launch(THIS, "worker_timeout", 2, tmp_path, args={"dir": str(tmp_path / "out")},
                 timeout_s=90)
    v = res[0].value
    assert v["timeout_error"] and v["distributed"], v
    assert "rank 0" in v["message"], v["message"]
    # the message names the rank that never came (from the arrival marks)
    assert "rank 1 never reached a statestream collective" in v["message"], v["message"]
    assert res[1].value == {"skipped_save": True}
    with pytest.raises(ss.CheckpointNotFoundError):
        ss.load(tmp_path / "out" / "ck", collective=ss.SingleProcess())
    assert not (tmp_path / "out").exists() or os.listdir(tmp_path / "out") == []
