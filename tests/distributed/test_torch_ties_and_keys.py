"""Tied tensors and mapping keys across processes (torch gloo, real processes).

Each process walks its own state: whether a value is tied to another (the same
memory, stored once as an alias) and which keys a mapping has are found per
process, and the plan must unite them into one checkpoint or say, before a byte
of data is written (counted at the ``save.chunk_written`` hook point), which
rank holds what at which key path.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _launch import Context, launch  # noqa: E402
from _workers import require_gloo  # noqa: E402

torch, dist = require_gloo()

THIS = os.path.abspath(__file__)


def _tie_disagrees(rank: int) -> Any:
    x = torch.arange(4.0)
    return {"a": x, "b": x if rank == 0 else x.clone()}


def _tie_targets_differ(rank: int) -> Any:
    x, y = torch.zeros(4), torch.ones(4)
    return {"a": x, "b": y, "c": x if rank == 0 else y}


def _mesh() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


def _tied_dtensor(rank: int) -> Any:
    # 2 rows over 3 ranks: rank 2's shard is empty (no memory to tell a tie by)
    from torch.distributed.tensor import Shard, distribute_tensor

    w = distribute_tensor(torch.arange(4.0).reshape(2, 2), _mesh(), [Shard(0)])
    return {"a": w, "b": w}


def _tied_model(seed: int) -> tuple[Any, Any]:
    """An FSDP2 model whose head shares the embedding's weight (2 rows: one rank of 3
    holds an empty shard of it), and its Adam."""
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(2, 4)
            self.head = nn.Linear(4, 2, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, x: Any) -> Any:
            return self.head(self.emb(x))

    torch.manual_seed(seed)
    model = Tied()
    fully_shard(model, mesh=_mesh())
    return model, torch.optim.Adam(model.parameters())


def _tied_fsdp(rank: int) -> Any:
    model, opt = _tied_model(0)
    model(torch.tensor([0, 1])).sum().backward()
    opt.step()
    return {"model": model, "optim": opt}


def _reload_tied_fsdp(path: Path, saved: Any) -> Any:
    """Load into a fresh tied model and optimizer: still tied, the saved values."""
    import statestream as ss

    model, opt = _tied_model(3)
    ss.load(path, target={"model": model, "optim": opt})
    old_model, old_opt = saved["model"], saved["optim"]
    exp_avg = [s["exp_avg"].full_tensor() for s in (opt.state[model.emb.weight],
                                                     old_opt.state[old_model.emb.weight])]
    return {"tied": model.emb.weight is model.head.weight,
            "weight": torch.equal(model.emb.weight.full_tensor(),
                                  old_model.emb.weight.full_tensor()),
            "exp_avg": torch.equal(*exp_avg)}


#: case name -> the state each rank saves (built inside the worker)
CASES: dict[str, Callable[[int], Any]] = {
    "tie_disagrees": _tie_disagrees,
    "tie_targets_differ": _tie_targets_differ,
    "tied_dtensor": _tied_dtensor,
    # the same structure again: saved with the plan kept from the first save
    "tied_dtensor_again": _tied_dtensor,
    "tied_fsdp": _tied_fsdp,
    # int 0 and str "0" share a key path's display form ('a/0'), not an array
    "int_and_str_keys": lambda rank: {"a": {0: torch.ones(2), "0": torch.zeros(2)}},
    "int_and_str_shapes": lambda rank: {"a": {0: torch.ones(2), "0": torch.zeros(3)}},
    "int_and_str_values": lambda rank: {"a": {0: 1, "0": 2}, "t": torch.ones(1)},
    "int_or_str_key": lambda rank: {"w": torch.arange(1 << 16, dtype=torch.float32),
                                    "a": {0 if rank == 0 else "0": torch.ones(2)}},
}
#: case name -> what the worker returns of a saved case (default: the tree ``load``
#: returns, as plain data)
RELOADS: dict[str, Callable[[Path, Any], Any]] = {"tied_fsdp": _reload_tied_fsdp}


def _plain(value: Any) -> Any:
    """A loaded tree as JSON: dict items as [key, type, value] (int and str keys kept
    apart), arrays as lists."""
    if isinstance(value, dict):
        return [[k, type(k).__name__, _plain(v)] for k, v in value.items()]
    if hasattr(value, "full_tensor"):
        value = value.full_tensor()
    if hasattr(value, "tolist"):
        return value.tolist()
    return value


def worker(ctx: Context) -> Any:
    from _workers import init_gloo

    import statestream as ss
    from statestream import _hooks

    init_gloo(ctx)
    written, reused = [0], [0]
    _hooks.register("save.chunk_written", lambda: written.__setitem__(0, written[0] + 1))
    _hooks.register("save.plan_reused", lambda: reused.__setitem__(0, reused[0] + 1))
    out: dict[str, Any] = {}
    for case in ctx.args:
        state = CASES[case](ctx.rank)
        target = Path(ctx.tmp) / case / "ck"
        target.parent.mkdir(parents=True, exist_ok=True)
        written[0] = reused[0] = 0
        try:
            ss.save(target, state)
            reload = RELOADS.get(case, lambda path, _: _plain(ss.load(path)))
            out[case] = {"raised": None, "loaded": reload(target, state),
                         "arrays": ss.metadata(target).num_arrays}
        except ss.CheckpointError as exc:
            out[case] = {"raised": type(exc).__name__, "message": str(exc)}
        out[case]["chunks_written"] = written[0]
        out[case]["plan_reused"] = reused[0]
        out[case]["left"] = sorted(os.listdir(target.parent))
        dist.barrier()
    dist.destroy_process_group()
    return out


def _refused(results: Any, case: str, *words: str) -> None:
    """Every rank raised the same planning error, naming ``words``, and wrote nothing."""
    for r in results:
        v = r.value[case]
        assert v["raised"] == "DistributedError", (r.rank, case, v)
        assert v["message"].startswith("rank 0 failed during planning: "), v["message"]
        for text in words:
            assert text in v["message"], (r.rank, case, text, v["message"])
        assert v["message"].endswith("nothing was written; nothing was committed")
        assert v["chunks_written"] == 0, (r.rank, case, v)
        assert v["left"] == [], (r.rank, case, v)


@pytest.mark.timeout(300)
def test_a_tie_on_one_rank_only_is_refused_naming_both_views(tmp_path: Path) -> None:
    results = launch(THIS, "worker", 2, tmp_path, args=["tie_disagrees", "tie_targets_differ"],
                     timeout_s=150)
    _refused(results, "tie_disagrees", "different kinds of value at key path 'b'",
             "rank 0 holds the same array as 'a' (tied: float32[4])",
             "rank 1 holds an array (float32[4])")
    # 'c' tied to 'a' on rank 0 and to 'b' on rank 1: rank 0's tie was taken silently
    _refused(results, "tie_targets_differ", "ties to different arrays at key path 'c': "
             "rank 0 holds the same array as 'a' (tied: float32[4]); rank 1 holds the same "
             "array as 'b' (tied: float32[4])")


@pytest.mark.timeout(300)
def test_an_int_key_and_its_str_twin_are_two_entries_across_processes(tmp_path: Path) -> None:
    cases = ["int_and_str_keys", "int_and_str_shapes", "int_and_str_values", "int_or_str_key"]
    results = launch(THIS, "worker", 2, tmp_path, args=cases, timeout_s=150)
    want = {
        "int_and_str_keys": [["a", "str", [[0, "int", [1.0, 1.0]], ["0", "str", [0.0, 0.0]]]]],
        "int_and_str_shapes": [["a", "str", [[0, "int", [1.0, 1.0]],
                                             ["0", "str", [0.0, 0.0, 0.0]]]]],
        "int_and_str_values": [["a", "str", [[0, "int", 1], ["0", "str", 2]]],
                               ["t", "str", [1.0]]],
    }
    for r in results:
        for case, tree in want.items():
            v = r.value[case]
            assert v["raised"] is None, (r.rank, case, v)
            assert v["loaded"] == tree, (r.rank, case, v)
    _refused(results, "int_or_str_key",
             "processes saved keys of different types at key path 'a': rank 0 holds the int "
             "key 0; rank 1 holds the str key '0'")


@pytest.mark.timeout(300)
def test_tied_tensors_with_an_empty_shard_on_some_rank_are_stored_once(tmp_path: Path) -> None:
    # 3 ranks, 2 rows: rank 2 holds no element of the tied weight, so only the others
    # can see the tie; every rank must agree on one alias (it failed at planning with
    # "different kinds of value at key path 'b'")
    results = launch(THIS, "worker", 3, tmp_path,
                     args=["tied_dtensor", "tied_dtensor_again", "tied_fsdp"], timeout_s=200)
    rows = [[0.0, 1.0], [2.0, 3.0]]
    for r in results:
        for case in ("tied_dtensor", "tied_dtensor_again"):
            v = r.value[case]
            assert v["raised"] is None, (r.rank, case, v)
            assert v["loaded"] == [["a", "str", rows], ["b", "str", rows]], (r.rank, case, v)
            assert v["arrays"] == 1, (r.rank, case, v)  # stored once: 'b' is an alias of 'a'
        assert r.value["tied_dtensor_again"]["plan_reused"] == 1
        v = r.value["tied_fsdp"]
        assert v["raised"] is None, (r.rank, v)
        assert v["loaded"] == {"tied": True, "weight": True, "exp_avg": True}, (r.rank, v)
        assert v["arrays"] == 4, (r.rank, v)  # the weight once; Adam's step, m and v
