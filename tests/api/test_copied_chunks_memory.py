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
