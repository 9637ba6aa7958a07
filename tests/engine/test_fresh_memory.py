"""Large buffers statestream fills come without huge-page advice (statestream._memory).

NumPy advises ``MADV_HUGEPAGE`` on its large buffers; on this machine faulting
such memory in stalled in compaction (1 GiB read: 0.35-1.66 s against 0.25-0.33 s
without the advice). The checks read the kernel's own record of the advice: the
``hg`` flag in ``/proc/self/smaps``'s ``VmFlags`` of the mapping. They run in a
fresh process whose setup allocates with NumPy's advice off, so no range was
advised before the operations checked (freed memory NumPy advised keeps the flag
when the allocator hands it out again) and NumPy's advice is on while they run.
"""

from __future__ import annotations

import json
import subprocess
import sys
import weakref
from pathlib import Path

import numpy as np
import pytest

from statestream._memory import MAP_MIN_BYTES, fresh_bytes

torch = pytest.importorskip("torch")

_CHILD = r"""
import json, sys
from pathlib import Path
import numpy as np
import torch
import statestream as ss
from statestream._memory import MAP_MIN_BYTES, fresh_bytes
from statestream.engine._staging import StagingPool

switch = np._core.multiarray._set_madvise_hugepage
out = {}

def flags(address):
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(hex(address))

def advised(arr):
    # the middle: NumPy advises from the first page boundary after malloc's header
    return "hg" in flags(arr.ctypes.data + arr.nbytes // 2)

d = Path(sys.argv[1])
switch(False)  # the setup leaves no advised range behind
w = np.arange(3 * MAP_MIN_BYTES // 4, dtype=np.float32)  # 3 x the threshold
ss.save(d / "a", {"w": w})
lin = torch.nn.Linear(1024, 2048, bias=False)
opt = torch.optim.Adam(lin.parameters())
lin(torch.ones(1, 1024)).sum().backward()
opt.step()
ss.save(d / "o", {"opt": opt})
fresh_opt = torch.optim.Adam(lin.parameters())
target = {"w": torch.zeros(w.shape)}
switch(True)  # NumPy's default from here on

b = fresh_bytes(MAP_MIN_BYTES + 12345)
out["fresh_bytes"] = advised(b)
out["aligned"] = b.ctypes.data % 4096 == 0
got = ss.load(d / "a", io=ss.IOOptions(map_files=False))["w"]
out["numpy load"] = advised(got)
out["numpy equal"] = bool(np.array_equal(got, w))
got = ss.load(d / "a", target=target, io=ss.IOOptions(map_files=False))["w"]
out["torch load"] = advised(got.numpy())
ss.load(d / "o", target={"opt": fresh_opt})  # kept state: read, not mapped
m = fresh_opt.state_dict()["state"][0]["exp_avg"]
out["optimizer load"] = advised(m.numpy())
out["optimizer equal"] = bool(torch.equal(m, opt.state_dict()["state"][0]["exp_avg"]))
pool = StagingPool(capacity=64 << 20)
out["staging"] = advised(pool.take(2 * MAP_MIN_BYTES))
out["control: np.empty"] = advised(np.empty(2 * MAP_MIN_BYTES, np.uint8))
print(json.dumps(out))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
def test_large_buffers_and_load_destinations_carry_no_huge_page_advice(tmp_path: Path) -> None:
    if not hasattr(np._core.multiarray, "_set_madvise_hugepage"):
        pytest.skip("this NumPy has no huge-page switch")
    r = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path)], capture_output=True,
                       text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    if not out.pop("control: np.empty"):
        pytest.skip("this kernel records no huge-page advice, so the check cannot fail")
    assert out.pop("aligned") and out.pop("numpy equal") and out.pop("optimizer equal")
    assert not any(out.values()), f"advised: {[k for k, v in out.items() if v]}"


def test_fresh_bytes_are_writable_and_small_ones_plain() -> None:
    b = fresh_bytes(MAP_MIN_BYTES + 12345)
    assert b.nbytes == MAP_MIN_BYTES + 12345 and b.dtype == np.uint8
    assert b.ctypes.data % 4096 == 0 and b.flags.writeable
    b[:] = 7  # every page can be written
    assert int(b[-1]) == 7
    small = fresh_bytes(1000)
    assert small.nbytes == 1000 and small.flags.writeable


def test_fresh_bytes_live_while_any_view_or_tensor_does() -> None:
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
