"""What a snapshot promises about order: a tensor is reported copied (a guarded step
may then change it) only after the check that its copy is not torn; and a change made
by another thread while save_async (not lazy) copies the state fails the save.

The snapshot is held at points of the library (its own hooks) and at the moment it
reports arrays ready (``SaveHandle.arrays_ready``, wrapped here), so the guarded step
runs exactly in the window under test. Timeouts only guard against hangs.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest

import statestream as ss
from statestream import _hooks
from statestream.engine import SaveHandle
from statestream.testing import faults

torch = pytest.importorskip("torch")

_WAIT_S = 120


@pytest.fixture
def hooks() -> Iterator[None]:
    _hooks.clear()
    yield
    _hooks.clear()


def test_a_guarded_step_right_after_a_copy_does_not_fail_the_save(
        tmp_path: Path, hooks: None, monkeypatch: pytest.MonkeyPatch) -> None:
    # The copy thread reported a chunk's array ready, then checked the array's version
    # counter: a guarded step let through by the report bumped it in between, and the
    # save failed as torn although the copy held the values from before the step.
    big = torch.zeros(10 << 20 >> 2)  # 10 MiB in 1 MiB chunks, written from the front
    w = torch.nn.Parameter(torch.ones(1000))  # the last chunk: copied first, from the back
    w.grad = torch.ones(1000)
    opt = torch.optim.SGD([w], lr=1.0)
    stepped = threading.Event()
    real = SaveHandle.arrays_ready

    def arrays_ready(self: SaveHandle, indices: Sequence[int]) -> None:
        real(self, indices)
        if 1 in indices:  # w: let the guarded step run before the copy thread goes on
            assert stepped.wait(_WAIT_S)

    monkeypatch.setattr(SaveHandle, "arrays_ready", arrays_ready)
    first = [True]

    def hold_the_writer() -> None:  # after its first batch: w is left to the copy
        if first[0]:
            first[0] = False
            assert stepped.wait(_WAIT_S)

    _hooks.register("save.chunk_written", hold_the_writer)
    path = tmp_path / "c"
    h = ss.save_async(path, {"big": big, "w": w}, lazy=True,
                      io=ss.IOOptions(num_threads=1, max_chunk_bytes=1 << 20))
    ss.guard_optimizer(opt, h)
    opt.step()  # waits for w's copy only
    stepped.set()
    h.result(timeout=_WAIT_S)
    assert np.all(w.detach().numpy() == 0.0)  # it did step
    np.testing.assert_array_equal(ss.load(path)["w"], np.ones(1000, dtype=np.float32))


def test_a_change_from_another_thread_during_the_blocking_phase_fails_the_save(
        tmp_path: Path, hooks: None) -> None:
    # save_async without lazy copies the state before it returns, but nothing stopped
    # another thread (an EMA updater, a second training thread) from changing it then:
    # chunks copied before the change and after it were committed as one checkpoint.
    big = torch.zeros(20 << 20 >> 2)  # 20 MiB: the writer's first batch is 16 MiB of it
    w = torch.zeros(4 << 20 >> 2)  # 4 chunks at the end: copied first, from the back
    mutated = threading.Event()

    def change_from_another_thread() -> None:  # before w's second chunk is copied
        t = threading.Thread(target=lambda: w.add_(1.0))
        t.start()
        t.join()
        mutated.set()

    faults.on("async.snapshot_chunk", change_from_another_thread, nth=2)
    first = [True]

    def hold_the_writer() -> None:  # the copies of w happen meanwhile
        if first[0]:
            first[0] = False
            assert mutated.wait(_WAIT_S)

    _hooks.register("save.chunk_written", hold_the_writer)
    path = tmp_path / "c"
    with pytest.raises(ss.CheckpointError, match="changed in place") as ei:
        ss.save_async(path, {"big": big, "w": w},
                      io=ss.IOOptions(num_threads=1, max_chunk_bytes=1 << 20))
    assert "'w'" in str(ei.value) and "'big'" not in str(ei.value)
    assert not path.exists()  # nothing committed
