"""``guard_optimizer`` in real PyTorch training loops: what a guarded step waits for.

Every test runs the real library; the snapshot is slowed or held at its own
hook points (``async.snapshot_chunk``, ``save.chunk_written``) so that the step
would race the copies if the guard waited for too little. Timeouts only guard
against hangs.
"""

from __future__ import annotations

import threading
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


@pytest.mark.timeout(300)
def test_guarded_step_over_a_flat_parameter_waits_for_every_saved_view(tmp_path, hooks) -> None:
    # FSDP1/DeepSpeed style: the optimizer steps a flat parameter; the state saves
    # the views of it that the model uses. The first view starts where the flat
    # parameter does, the others do not: the guard must wait for all of them.
    torch.manual_seed(0)
    n = 4 << 20  # 16 MiB per view: the writer writes each view in its own batch
    flat = torch.nn.Parameter(torch.randn(4 * n))
    opt = torch.optim.SGD([flat], lr=0.1)
    flat.grad = torch.ones_like(flat)
    state = {"model": {f"w{i}": flat.detach()[i * n:(i + 1) * n] for i in range(4)}}
    want = {k: v.clone() for k, v in state["model"].items()}
    stepped = threading.Event()
    opt.register_step_post_hook(lambda o, a, k: stepped.set())
    writes = [0]

    def hold_second_write() -> None:
        # After w0 is written, hold the writer until the step has run: a guard that
        # waited for w0 only lets the step change w1..w3 before they are written.
        # A correct guard is still waiting, so the hold ends by its timeout.
        writes[0] += 1
        if writes[0] == 2:
            stepped.wait(2.0)

    ss.release_staging()  # a cold pool: the writer writes every chunk from the state
    _hooks.register("save.chunk_written", hold_second_write)
    h = ss.save_async(tmp_path / "flat", state, lazy=True,
                      io=ss.IOOptions(num_threads=1, max_chunk_bytes=4 << 20))
    ss.guard_optimizer(opt, h)
    opt.step()
    h.result(timeout=_WAIT_S)  # not torn: the step waited for every view
    got = ss.load(tmp_path / "flat")
    for k, v in want.items():
        np.testing.assert_array_equal(got["model"][k], v.numpy(), err_msg=k)
    assert not torch.equal(state["model"]["w3"], want["w3"])  # it did step


def _bn_model() -> tuple[Any, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.BatchNorm1d(256),
                                torch.nn.Linear(256, 4))
    return model, torch.optim.AdamW(model.parameters())


def _train_with_lazy_manager(tmp_path, model, run, opt, saved_model) -> dict[int, Any]:
    """Three steps, a lazy manager save after each; the next step's forward pass
    changes the BatchNorm buffers while the snapshot is slowed per chunk."""
    for _ in range(2):  # compiled: compile (and recompile) before the race
        run(torch.randn(16, 256))
    _hooks.register("async.snapshot_chunk", lambda: time.sleep(0.005))
    want: dict[int, Any] = {}
    with ss.CheckpointManager(tmp_path, lazy=True,
                              io=ss.IOOptions(max_chunk_bytes=64 << 10)) as mgr:
        for step in range(3):
            opt.zero_grad()
            run(torch.randn(16, 256)).square().mean().backward()
            opt.step()
            want[step] = {k: v.clone() for k, v in model.state_dict().items()}
            mgr.save(step, {"model": saved_model, "optim": opt})
        mgr.wait()
        got = {s: mgr.load(s)["model"] for s in want}
    return {s: (want[s], got[s]) for s in want}


@pytest.mark.timeout(300)
def test_a_lazy_manager_guards_the_forward_pass_that_changes_buffers(tmp_path, hooks) -> None:
    # BatchNorm's forward changes running_mean/var in place, which torch does not count
    # in the version counter: unguarded, the next forward raced the snapshot (the save
    # failed on num_batches_tracked, or committed torn running statistics silently)
    model, opt = _bn_model()
    for step, (want, got) in _train_with_lazy_manager(tmp_path, model, model, opt,
                                                      model).items():
        for k, v in want.items():
            np.testing.assert_array_equal(got[k], v.numpy(), err_msg=f"step {step} {k}")
    assert len(model._forward_pre_hooks) == 1  # one hook, however many saves


@pytest.mark.timeout(300)
def test_a_compiled_model_in_the_state_is_guarded_too(tmp_path, hooks) -> None:
    model, opt = _bn_model()
    compiled = torch.compile(model, backend="eager")
    for step, (want, got) in _train_with_lazy_manager(tmp_path, model, compiled, opt,
                                                      compiled).items():
        for k, v in want.items():
            np.testing.assert_array_equal(got[k], v.numpy(), err_msg=f"step {step} {k}")


def test_guard_module_without_buffers_and_what_is_not_a_module(tmp_path) -> None:
    h = ss.save_async(tmp_path / "c", {"x": np.zeros(4)}, lazy=True)
    assert ss.guard_module(torch.nn.Linear(2, 2), h) is None  # no buffers: nothing to wait for
    with pytest.raises(ss.UnsupportedTypeError, match="no provider knows its forward"):
        ss.guard_module(object(), h)
    bn = torch.nn.BatchNorm1d(2)
    first = ss.guard_module(bn, h)
    assert ss.guard_module(bn, h) is first  # one hook per module
    first.remove()
    assert ss.guard_module(bn, h) is not first and len(bn._forward_pre_hooks) == 1
    h.result(timeout=_WAIT_S)
