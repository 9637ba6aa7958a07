"""StatestreamTrainer under torch.distributed (2 real processes, gloo, DDP on the CPU):
every rank takes part in each save, each process's generator states are kept under
its rank, and a run interrupted and resumed equals transformers' own Trainer doing
the same, bit for bit."""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _launch import Context, launch  # noqa: E402

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")
if not dist.is_available() or not dist.is_gloo_available():  # pragma: no cover
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

import statestream as ss  # noqa: E402

THIS = os.path.abspath(__file__)
INTEGRATIONS = os.path.join(os.path.dirname(THIS), os.pardir, "integrations")

pytestmark = pytest.mark.timeout(300)


def worker(ctx: Context) -> dict[str, Any]:  # runs in the child processes
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    sys.path.insert(0, INTEGRATIONS)
    from test_transformers import StopAt, make, weights
    from transformers import Trainer

    from statestream.integrations.transformers import StatestreamTrainer

    torch.set_num_threads(1)
    cls = StatestreamTrainer if ctx.args["ours"] else Trainer
    out = ctx.args["out"]
    if ctx.args["phase"] == "first":  # 7 of 10 steps (5 per epoch with 2 x 4 per step)
        _, trainer = make(cls, out, callbacks=[StopAt(7)])
        trainer.train()
        return {"step": trainer.state.global_step}
    model, trainer = make(cls, out, seed=1)
    trainer.train(resume_from_checkpoint=True)
    path = os.path.join(ctx.tmp, f"weights-{ctx.rank}.pt")
    torch.save(weights(model), path)
    return {"step": trainer.state.global_step, "weights": path}


def _run(tmp_path, ours: bool) -> list[Any]:
    out = str(tmp_path / ("ss" if ours else "hf"))
    first = launch(THIS, "worker", 2, tmp_path, args={"ours": ours, "out": out,
                                                       "phase": "first"}, timeout_s=240,
                   tag=f"first-{ours}")
    assert [r.value["step"] for r in first] == [7, 7]
    if ours:
        assert sorted(os.listdir(out)) == ["checkpoint-3", "checkpoint-6"]
        tree = ss.metadata(os.path.join(out, "checkpoint-6", "statestream")).tree
        assert sorted(tree["rng"]) == ["rank0", "rank1"]  # each process's generators
        assert ss.verify(os.path.join(out, "checkpoint-6", "statestream")).ok
    second = launch(THIS, "worker", 2, tmp_path, args={"ours": ours, "out": out,
                                                        "phase": "resume"}, timeout_s=240,
                    tag=f"resume-{ours}")
    assert [r.value["step"] for r in second] == [10, 10]
    return [torch.load(r.value["weights"]) for r in second]


def test_ddp_resume_equals_the_trainers_own(tmp_path):
    ours = _run(tmp_path, True)
    theirs = _run(tmp_path, False)
    for got in (ours[0], ours[1]):
        assert got.keys() == theirs[0].keys()
        for k in got:
            assert torch.equal(got[k], theirs[0][k]), k
