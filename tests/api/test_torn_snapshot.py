"""A lazy snapshot that races an unguarded in-place change is never committed silently.

The snapshot thread is held after its first chunk (a real hook point of the
library, ``async.snapshot_chunk``) while the caller runs ``optimizer.step()``
with no guard: every tensor copied after that was changed before its copy,
so the save must fail naming them. With the optimizer guarded (by hand or by
a lazy ``CheckpointManager``), the same race commits the values from before
the step. Timeouts only guard against hangs.
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


def _model_and_opt() -> tuple[Any, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def backward() -> None:
        opt.zero_grad()
        model(torch.randn(16, 64)).square().mean().backward()

    backward()
    opt.step()  # optimizer state exists
    backward()  # grads for the next step
    return model, opt


def _values(state: dict[str, Any]) -> dict[str, np.ndarray]:
    out = {f"model/{k}": v.detach().clone().numpy() for k, v in state["model"].items()}
    for i, st in state["optim"]["state"].items():
        for k, v in st.items():
            out[f"optim/state/{i}/{k}"] = v.clone().numpy()
    return out


def _at(tree: Any, key: str) -> Any:
    node = tree
    for part in key.split("/"):
        node = node[part] if part in node else node[int(part)]
    return node


@pytest.mark.timeout(300)
def test_unguarded_step_during_lazy_snapshot_fails_naming_key_paths(tmp_path, hooks) -> None:
    model, opt = _model_and_opt()
    release = threading.Event()
    first = [True]

    def hold_after_first_chunk() -> None:
        if first[0]:
            first[0] = False
            assert release.wait(_WAIT_S)

    # Held before anything is copied or written (the snapshot races the writers).
    _hooks.register("async.race_begins", hold_after_first_chunk)
    path = tmp_path / "torn"
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    h = ss.save_async(path, state, lazy=True)
    opt.step()  # no guard: changes tensors the snapshot has not copied yet
    release.set()
    with pytest.raises(ss.CheckpointError) as ei:
        h.result(timeout=_WAIT_S)
    msg = str(ei.value)
    assert "modified before it was copied" in msg, msg
    assert "'optim/state/0/exp_avg'" in msg and "'model/2.weight'" in msg, msg
    assert "guard_optimizer" in msg
    assert not path.exists()  # nothing committed


@pytest.mark.timeout(300)
def test_lazy_save_without_changes_is_not_torn(tmp_path, hooks) -> None:
    model, opt = _model_and_opt()
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    want = _values(state)
    h = ss.save_async(tmp_path / "ok", state, lazy=True)
    h.wait_snapshot(timeout=_WAIT_S)
    opt.step()  # after the snapshot: allowed
    h.result(timeout=_WAIT_S)
    got = ss.load(tmp_path / "ok")
    for k, v in want.items():
        np.testing.assert_array_equal(_at(got, k), v, err_msg=k)


@pytest.mark.timeout(300)
def test_lazy_manager_guards_the_optimizers_it_is_given(tmp_path, hooks) -> None:
    model, opt = _model_and_opt()

    def slow_snapshot() -> None:
        time.sleep(0.02)  # the step below runs while chunks are still being copied

    _hooks.register("async.snapshot_chunk", slow_snapshot)
    with ss.CheckpointManager(tmp_path / "ckpts", lazy=True) as mgr:
        state = {"model": model, "optim": opt}
        want = _values({"model": model.state_dict(), "optim": opt.state_dict()})
        assert mgr.save(1, state)
        opt.step()  # not guarded by the caller: the manager guarded it
        mgr.wait()
        got = mgr.load(1)
    now = _values({"model": model.state_dict(), "optim": opt.state_dict()})
    assert not np.array_equal(now["model/2.weight"], want["model/2.weight"])  # it did step
    for k, v in want.items():
        np.testing.assert_array_equal(_at(got, k), v, err_msg=k)


_REBIND = """
import sys, numpy as np, torch, statestream as ss
from statestream import _hooks
gate = __import__("threading").Event()
_hooks.register("async.snapshot_chunk", lambda: gate.wait(60))  # the snapshot waits after a chunk
p = torch.nn.Parameter(torch.zeros(4 << 20))
m = torch.nn.Linear(256, 256)
want = {k: v.detach().clone() for k, v in m.named_parameters()}
h = ss.save_async(sys.argv[1], {"p": p, "m": dict(m.named_parameters())}, lazy=True,
                  io=ss.IOOptions(max_chunk_bytes=1 << 20))
p.data = torch.ones(4 << 20)  # the same Parameter, other memory: the old is released
m.double()                    # likewise for every parameter of the module
junk = [torch.full((4 << 20,), 7.0) for _ in range(4)]  # may reuse what was released
gate.set()
h.result()
out = ss.load(sys.argv[1])
assert np.all(out["p"] == 0), sorted(set(np.unique(out["p"]).tolist()))[:4]
for k, v in want.items():
    assert np.array_equal(out["m"][k], v.numpy()), k
print("OK")
"""


def test_a_lazy_snapshot_keeps_memory_a_rebound_tensor_let_go(tmp_path) -> None:
    # p.data = other (and module.double()) give the saved tensor objects other memory
    # and release the old, which the snapshot had not read yet: it read freed memory
    # (a segfault, or bytes that were never in the state committed). In a child process:
    # without the fix it crashes.
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", _REBIND, str(tmp_path / "c")],
                       capture_output=True, text=True, timeout=_WAIT_S)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), (r.returncode, r.stderr[-2000:])


@pytest.mark.timeout(300)
def test_an_in_place_load_during_a_lazy_snapshot_fails_it(tmp_path, hooks) -> None:
    # ss.load(..., in_place=True) writes the tensors' bytes through a pointer; it moves
    # their version counters as copy_() would, so the snapshot sees the change. Before,
    # a torn snapshot was committed (and then failed its own checksums when loaded).
    ones = {"a": torch.ones(1000), "b": torch.ones(10, 10)}
    ss.save(tmp_path / "ones", ones)
    release = threading.Event()
    first = [True]

    def hold() -> None:
        if first[0]:
            first[0] = False
            assert release.wait(_WAIT_S)

    _hooks.register("async.race_begins", hold)  # before anything is copied or written
    state = {"a": torch.zeros(1000), "b": torch.zeros(10, 10)}
    h = ss.save_async(tmp_path / "snap", state, lazy=True)
    ss.load(tmp_path / "ones", state, in_place=True)  # no wait_snapshot: the user's error
    release.set()
    with pytest.raises(ss.CheckpointError, match="modified before it was copied") as ei:
        h.result(timeout=_WAIT_S)
    assert "'a'" in str(ei.value) and "'b'" in str(ei.value)
    assert not (tmp_path / "snap").exists()  # nothing committed
