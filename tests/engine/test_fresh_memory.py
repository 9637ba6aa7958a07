"""Large buffers statestream fills come without huge-page advice (statestream._memory).

NumPy advises ``MADV_HUGEPAGE`` on its large buffers; on this machine faulting
such memory in stalled in compaction (1 GiB read: 1.1-1.6 s against 0.24-0.27 s
without the advice). The checks read the kernel's own record of the advice:
the ``hg`` flag in ``/proc/self/smaps``'s ``VmFlags`` of the mapping.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import statestream as ss
from statestream._memory import MAP_MIN_BYTES, fresh_bytes

torch = pytest.importorskip("torch")


def _vm_flags(address: int) -> set[str]:
    """The VmFlags of the mapping of this process that holds ``address``."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "VmFlags:":
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


def _advised(arr: np.ndarray) -> bool:
    # the middle: NumPy advises from the first page boundary after malloc's header
    return "hg" in _vm_flags(arr.ctypes.data + arr.nbytes // 2)


def test_numpy_advises_huge_pages_so_the_check_can_fail() -> None:
    a = np.empty(MAP_MIN_BYTES * 2, np.uint8)
    if not _advised(a):
        pytest.skip("this NumPy or kernel gives no huge-page advice")


def test_fresh_bytes_are_plain_aligned_writable_pages() -> None:
    b = fresh_bytes(MAP_MIN_BYTES + 12345)
    assert b.nbytes == MAP_MIN_BYTES + 12345 and b.dtype == np.uint8
    assert b.ctypes.data % 4096 == 0 and b.flags.writeable
    assert not _advised(b)
    b[:] = 7  # every page can be written
    assert int(b[-1]) == 7
    small = fresh_bytes(1000)
    assert small.nbytes == 1000 and small.flags.writeable


def test_fresh_bytes_live_while_any_view_or_tensor_does() -> None:
    import weakref

    b = fresh_bytes(MAP_MIN_BYTES)
    freed: list[int] = []
    weakref.finalize(b.base, freed.append, 1)  # the allocation all views share
    view = b[4096:].view(np.float32)
    tensor = torch.from_numpy(b[:4096].view(np.int32))
    del b
    del view
    assert not freed
    tensor.fill_(3)
    assert int(tensor.sum()) == 3 * 1024
    del tensor
    assert freed == [1]


def test_numpys_advice_setting_is_restored_even_when_allocation_fails() -> None:
    get = getattr(np._core.multiarray, "_get_madvise_hugepage", None)
    if get is None:
        pytest.skip("this NumPy has no huge-page switch")
    before = get()
    fresh_bytes(MAP_MIN_BYTES)
    assert get() == before
    with pytest.raises(MemoryError):
        fresh_bytes(1 << 62)
    assert get() == before


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_loads_that_read_fill_unadvised_memory(tmp_path: Path, kind: str) -> None:
    w = np.arange(3 * MAP_MIN_BYTES // 4, dtype=np.float32)  # 3 x the threshold
    ss.save(tmp_path / "c", {"w": w})
    got = ss.load(tmp_path / "c", target=None if kind == "numpy" else {"w": torch.zeros(w.shape)},
                  io=ss.IOOptions(map_files=False))["w"]
    arr = got if kind == "numpy" else got.numpy()
    assert np.array_equal(arr, w)
    assert not _advised(arr), f"{kind} load destination carries MADV_HUGEPAGE"


def test_optimizer_state_loads_into_unadvised_memory(tmp_path: Path) -> None:
    # an object's kept state is read, not mapped (tests/api/test_mapped_loads.py)
    lin = torch.nn.Linear(1024, 2048, bias=False)
    opt = torch.optim.Adam(lin.parameters())
    lin(torch.ones(1, 1024)).sum().backward()
    opt.step()
    ss.save(tmp_path / "c", {"opt": opt})
    fresh = torch.optim.Adam(lin.parameters())
    ss.load(tmp_path / "c", target={"opt": fresh})
    moment = fresh.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(moment, opt.state_dict()["state"][0]["exp_avg"])
    assert not _advised(moment.numpy())


def test_staging_buffers_for_async_saves_are_unadvised() -> None:
    from statestream.engine._staging import StagingPool

    pool = StagingPool(capacity=64 << 20)
    big, mid = pool.take(MAP_MIN_BYTES * 2), pool.take(MAP_MIN_BYTES // 2)
    assert not _advised(big)
    assert big.ctypes.data % 4096 == 0 and mid.ctypes.data % 4096 == 0  # O_DIRECT-able
