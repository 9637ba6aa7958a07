"""Arrays whose chunks are copies (non-contiguous, byte-swapped) stay within the memory
budget: their chunks are planned at most a quarter of the budget, since each is copied
whole (by the writer of ss.save, or by a snapshot's direct read in save_async).

Measured in a fresh process (VmHWM). Before, such chunks were the default 64 MiB
whatever the budget: a transposed 512 MiB array under 32 MiB grew peak RSS by 88 MiB
saved, 226 MiB saved with save_async (every writer thread copied 64 MiB chunks).

A transposed torch tensor too: its chunks were copied by ``.contiguous()``, whose freed
memory stayed in the C library's per-thread heaps of the writer threads (512 MiB under
32 MiB, two writer threads: +202 MiB saved, +250 with save_async); they are copied into
memory NumPy allocates now (under +64).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import statestream as ss

MiB = 1 << 20
_BUDGET = 32 * MiB
_THREADS = 2

_CHILD = r"""
import json, sys
import numpy as np
import statestream as ss
path, mode, budget, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
lib = sys.argv[5]
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
base = np.arange(64 << 20, dtype=np.int32).reshape(4096, 16384)
state = {"t": base.T, "s": base[:2048].astype(">i4")}  # 256 MiB transposed, 128 MiB swapped
if lib == "torch":
    import torch
    del state, base
    # 512 MiB transposed (the heaps' growth shows at this size: +358 MiB before)
    state = {"t": torch.arange(128 << 20, dtype=torch.int32).reshape(4096, 32768).t()}
ss.save(path + "-first", {"x": np.ones(8)})
before = hwm()
io, mem = ss.IOOptions(num_threads=threads), ss.MemoryOptions(memory_budget_bytes=budget)
if mode == "sync":
    ss.save(path, state, io=io, memory=mem)
else:
    ss.save_async(path, state, io=io, memory=mem, lazy=mode == "lazy").result()
growth = hwm() - before
got = ss.load(path)
for k in state:
    assert np.array_equal(np.asarray(got[k]), np.asarray(state[k])), k
print(json.dumps({"growth": growth}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@pytest.mark.parametrize("mode", ["sync", "async", "lazy"])
@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_copied_chunks_stay_within_the_budget(tmp_path: Path, mode: str, lib: str) -> None:
    if lib == "torch":
        pytest.importorskip("torch")
    r = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path / "ck"), mode, str(_BUDGET),
                        str(_THREADS), lib], capture_output=True, text=True, timeout=600,
                       check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    growth = json.loads(r.stdout.strip().splitlines()[-1])["growth"]
    # the budget, one 8 MiB bounce buffer per data file, slack for the interpreter
    bound = _BUDGET + _THREADS * 8 * MiB + 16 * MiB
    assert growth < bound, f"{lib} {mode}: peak RSS grew by {growth / MiB:.0f} MiB"


def test_copied_chunks_are_planned_within_a_quarter_of_the_budget(tmp_path: Path) -> None:
    a = np.arange(1 << 20, dtype=np.float32).reshape(1024, 1024)
    mem = ss.MemoryOptions(memory_budget_bytes=8 * MiB)
    for save in (ss.save, lambda p, s, **kw: ss.save_async(p, s, **kw).result()):
        path = tmp_path / f"c{id(save)}"
        save(path, {"t": a.T, "c": a}, memory=mem, io=ss.IOOptions(max_chunk_bytes=4 * MiB))
        md = ss.metadata(path)
        # 4 MiB copied in chunks of at most 2 MiB; contiguous: the usual one chunk
        assert md.tree["t"].num_chunks == 2 and md.tree["c"].num_chunks == 1, md.tree
        np.testing.assert_array_equal(ss.load(path)["t"], a.T)


_SMALL_BUDGET = 4 * MiB
_WRITERS = 4

_RACE_CHILD = r"""
import json, sys
import numpy as np
import statestream as ss
path, mode, lib = sys.argv[1], sys.argv[2], sys.argv[5]
budget, threads = int(sys.argv[3]), int(sys.argv[4])
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
base = np.arange(32 << 20, dtype=np.int32).reshape(4096, 8192)
if lib == "torch":  # (nothing freed before the save: its pages would be reused)
    import torch
    state = {"t": torch.from_numpy(base).t()}  # 128 MiB transposed
else:
    state = {"t": base.T, "s": base[::4].astype(">i4")}  # 128 MiB transposed, 32 swapped
ss.save(path + "-first", {"x": np.ones(8)})
before = hwm()
io, mem = ss.IOOptions(num_threads=threads), ss.MemoryOptions(memory_budget_bytes=budget)
ss.save_async(path, state, io=io, memory=mem, lazy=mode == "lazy").result()
growth = hwm() - before
got = ss.load(path)
for k in state:
    assert np.array_equal(np.asarray(got[k]), np.asarray(state[k])), k
print(json.dumps({"growth": growth}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@pytest.mark.parametrize("mode", ["async", "lazy"])
@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_racing_writers_copies_stay_within_a_small_budget(tmp_path: Path, mode: str,
                                                          lib: str) -> None:
    """A first save_async races its writers, which write the chunks not yet copied
    straight from the state: a copy of each chunk of a non-contiguous or byte-swapped
    array, batched up to 16 MiB per writer before the write, charged to nothing.
    Under a 4 MiB budget with four writers, 128 MiB transposed (+32 MiB byte-swapped)
    grew peak RSS by 40 MiB (save_async and lazy alike; ss.save: +13). The writers now
    charge those copies to their own share of the budget (snapshot_budgets)."""
    if lib == "torch":
        pytest.importorskip("torch")
    r = subprocess.run([sys.executable, "-c", _RACE_CHILD, str(tmp_path / "ck"), mode,
                        str(_SMALL_BUDGET), str(_WRITERS), lib], capture_output=True, text=True,
                       timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    growth = json.loads(r.stdout.strip().splitlines()[-1])["growth"]
    # the budget and slack for the interpreter and the threads (ss.save: +13 MiB)
    bound = _SMALL_BUDGET + 16 * MiB
    assert growth < bound, f"{lib} {mode}: peak RSS grew by {growth / MiB:.0f} MiB"


_WARM_CHILD = r"""
import json, sys
import numpy as np
import statestream as ss
path, budget, lib = sys.argv[1], int(sys.argv[2]), sys.argv[3]
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
base = np.arange(48 << 20, dtype=np.int32).reshape(4096, 12288)
if lib == "torch":
    import torch
    state = {"t": torch.from_numpy(base).t()}  # 192 MiB transposed
else:
    state = {"t": base.T}
io, mem = ss.IOOptions(num_threads=2), ss.MemoryOptions(memory_budget_bytes=budget)
ss.save(path + "-first", {"x": np.ones(8)})
before = hwm()
h = ss.save_async(path + "-1", state, io=io, memory=mem)
h.result()
h._settled.wait()  # the staging buffers for the next save are mapped
ss.save_async(path, state, io=io, memory=mem).result()  # copies it all at once
growth = hwm() - before
assert np.array_equal(np.asarray(ss.load(path)["t"]), np.asarray(state["t"]))
print(json.dumps({"growth": growth}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_warm_snapshot_copies_chunks_straight_into_staging(tmp_path: Path, lib: str) -> None:
    """A later save_async of a state within the budget copies every chunk into the
    staging buffers the last one left. A chunk whose copy is its own (transposed)
    was first copied out of the array into a temporary, then into the staging
    buffer: one temporary chunk (a quarter of the budget) per copy thread outside
    the budget. 192 MiB transposed under 256 MiB, two copy threads: +303 MiB peak
    RSS; now it goes straight into the staging buffer (+193)."""
    if lib == "torch":
        pytest.importorskip("torch")
    budget = 256 * MiB
    r = subprocess.run([sys.executable, "-c", _WARM_CHILD, str(tmp_path / "ck"), str(budget),
                        lib], capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    growth = json.loads(r.stdout.strip().splitlines()[-1])["growth"]
    # the budget, two 8 MiB bounce buffers, slack for the interpreter
    bound = budget + 2 * 8 * MiB + 16 * MiB
    assert growth < bound, f"{lib}: peak RSS grew by {growth / MiB:.0f} MiB"
