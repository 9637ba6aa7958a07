"""CUDA tensors: device-to-host copies through reused pinned buffers on a side stream.

Skipped without a GPU. On a machine with one, ``benchmarks/cuda_check.py`` runs
these tests and measures device-to-host bandwidth in one go.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import statestream as ss  # noqa: E402
from statestream.engine import pinned_pool  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

MiB = 1 << 20


def _cuda_state() -> dict[str, object]:
    g = torch.Generator(device="cuda").manual_seed(0)
    big = torch.randn(1024, 1024, device="cuda", generator=g)
    return {
        "big": big,
        "bf16": torch.randn(300, 77, device="cuda", generator=g).to(torch.bfloat16),
        "strided": big[:, ::3],  # non-contiguous: copied on the side stream first
        "scalar": torch.tensor(3.5, device="cuda"),
        "ints": torch.arange(1000, device="cuda", dtype=torch.int64),
        "step": 7,
    }


def _host(state: dict[str, object]) -> dict[str, object]:
    return {k: (v.cpu().clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}


def _assert_same(got: dict[str, object], want: dict[str, object]) -> None:
    assert got.keys() == want.keys()
    for k, w in want.items():
        g = got[k]
        if isinstance(w, torch.Tensor):
            assert isinstance(g, torch.Tensor), k
            assert g.dtype == w.dtype and tuple(g.shape) == tuple(w.shape), k
            assert torch.equal(g.cpu(), w), k
        else:
            assert g == w, k


def test_pinned_pool_hands_out_page_locked_memory() -> None:
    buf = pinned_pool().take(4 * MiB)
    try:
        assert torch.from_numpy(buf).is_pinned()
    finally:
        pinned_pool().give(buf)


@pytest.mark.parametrize("budget", [None, 2 * MiB], ids=["fits", "streams"])
def test_sync_save_round_trip(tmp_path: os.PathLike[str], budget: int | None) -> None:
    state = _cuda_state()
    want = _host(state)
    path = os.path.join(tmp_path, "c")
    ss.save(path, state, memory=ss.MemoryOptions(memory_budget_bytes=budget),
            io=ss.IOOptions(max_chunk_bytes=MiB))
    assert ss.verify(path).ok
    target = {k: (v if isinstance(v, torch.Tensor) else None) for k, v in state.items()}
    got = ss.load(path, target=target)
    assert got["big"].device.type == "cuda"
    _assert_same(got, want)
    assert pinned_pool().lent_bytes == 0


@pytest.mark.parametrize("budget", [None, 2 * MiB], ids=["fits", "streams"])
def test_async_save_keeps_values_from_before_mutation(tmp_path: os.PathLike[str],
                                                      budget: int | None) -> None:
    state = _cuda_state()
    want = _host(state)
    path = os.path.join(tmp_path, "c")
    h = ss.save_async(path, state, memory=ss.MemoryOptions(memory_budget_bytes=budget),
                      io=ss.IOOptions(max_chunk_bytes=MiB))
    for v in state.values():  # queued on the current stream right after the call
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            v.add_(1)
    h.result(timeout=120)
    _assert_same(ss.load(path), want)


def test_copies_wait_for_work_queued_on_the_callers_stream(tmp_path: os.PathLike[str]) -> None:
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        x = torch.ones(2048, 2048, device="cuda")
        for _ in range(20):  # long enough to be still running when the save starts
            x = x @ torch.eye(2048, device="cuda") + 1
        h = ss.save_async(os.path.join(tmp_path, "c"), {"x": x})
    h.result(timeout=120)
    torch.cuda.synchronize()
    np.testing.assert_array_equal(ss.load(os.path.join(tmp_path, "c"))["x"], x.cpu().numpy())


def test_lazy_save_with_guarded_optimizer_on_cuda(tmp_path: os.PathLike[str]) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 10)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step() -> None:
        loss = model(torch.randn(32, 256, device="cuda")).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()

    step()
    state = {"model": model.state_dict(), "opt": opt.state_dict()}
    want = {k: v.cpu().clone() for k, v in model.state_dict().items()}
    path = os.path.join(tmp_path, "c")
    h = ss.save_async(path, state, lazy=True)
    ss.guard_optimizer(opt, h)
    step()  # mutates every parameter once the guard lets it
    h.result(timeout=120)
    got = ss.load(path)["model"]
    for k, w in want.items():
        assert torch.equal(torch.as_tensor(np.asarray(got[k])), w), k


def test_second_async_save_reuses_pinned_buffers(tmp_path: os.PathLike[str]) -> None:
    ss.release_staging()
    pool = pinned_pool()
    state = _cuda_state()
    ss.save_async(os.path.join(tmp_path, "a"), state).result(timeout=120)
    allocated = pool.allocations
    assert pool.idle_bytes > 0
    ss.save_async(os.path.join(tmp_path, "b"), state).result(timeout=120)
    assert pool.allocations == allocated
    assert pool.reuses > 0


def test_in_place_load_writes_the_gpu_targets_themselves(tmp_path: os.PathLike[str]) -> None:
    """A GPU target cannot be read into; in_place copies the checked values into it."""
    path = os.path.join(tmp_path, "c")
    ss.save(path, {"w": torch.arange(12.0).reshape(4, 3), "h": torch.ones(5)})
    target = {"w": torch.zeros(4, 3, device="cuda"),
              "h": torch.zeros(5, device="cuda", dtype=torch.bfloat16)}
    out = ss.load(path, target, in_place=True)
    assert out["w"] is target["w"] and out["h"] is target["h"]
    assert torch.equal(target["w"].cpu(), torch.arange(12.0).reshape(4, 3))
    assert torch.equal(target["h"].cpu(), torch.ones(5, dtype=torch.bfloat16))
