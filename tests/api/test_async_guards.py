"""``guard_optimizer`` in real PyTorch training loops: what a guarded step waits for.

Every test runs the real library; the snapshot is slowed or held at its own
hook points (``async.snapshot_chunk``, ``save.chunk_written``) so that the step
would race the copies if the guard waited for too little. Timeouts only guard
against hangs.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import statestream as ss
from statestream import _hooks

torch = pytest.importorskip("torch")

_WAIT_S = 240


@pytest.fixture
def hooks() -> Iterator[None]:
    _hooks.clear()
    yield
    _hooks.clear()


def _linear_and_sgd() -> tuple[Any, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    return model, opt


@pytest.mark.timeout(300)
def test_guard_after_its_hook_was_removed_registers_a_new_one(tmp_path, hooks) -> None:
    # guard_optimizer returns the hook's removable handle ("removing it ends the
    # guarding"); guarding the same optimizer for a later save must guard again,
    # not add the save to the removed hook.
    model, opt = _linear_and_sgd()
    first = ss.save_async(tmp_path / "a", {"m": model.state_dict()}, lazy=True)
    ss.guard_optimizer(opt, first).remove()
    first.result(timeout=_WAIT_S)
    assert len(opt._optimizer_step_pre_hooks) == 0

    def slow_snapshot() -> None:
        time.sleep(0.01)  # the step below runs while chunks are still being copied

    _hooks.register("async.snapshot_chunk", slow_snapshot)
    state = {"m": model.state_dict()}
    want = {k: v.clone() for k, v in state["m"].items()}
    h = ss.save_async(tmp_path / "b", state, lazy=True,
                      io=ss.IOOptions(max_chunk_bytes=16 << 10))
    ss.guard_optimizer(opt, h)
    assert len(opt._optimizer_step_pre_hooks) == 1
    opt.step()  # guarded: waits for the copies
    h.result(timeout=_WAIT_S)
    got = ss.load(tmp_path / "b")
    for k, v in want.items():
        np.testing.assert_array_equal(got["m"][k], v.numpy(), err_msg=k)
    assert not torch.equal(model.weight, want["weight"])  # it did step
