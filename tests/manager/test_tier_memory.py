"""The local tier's persistence copy stays within the manager's memory budget: each file
copied at once reads through its share of it, not a fixed 16 MiB.

Measured in a fresh process (VmHWM, as tests/interop/test_convert_memory.py does).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

MiB = 1 << 20

_CHILD = r"""
import json, sys
import numpy as np
import statestream as ss
root, budget = sys.argv[1], int(sys.argv[2])
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
state = {"w": np.ones((256 << 20) // 4, np.float32)}  # the caller's memory, touched
mgr = ss.CheckpointManager(root + "/dir", local_tier=root + "/tier", async_save=False,
                           memory=ss.MemoryOptions(memory_budget_bytes=budget))
before = hwm()
mgr.save(1, state)
mgr.wait()
growth = hwm() - before
assert mgr.persisted_steps() == [1]
mgr.close()
print(json.dumps({"growth_bytes": growth}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_persistence_copy_stays_within_the_budget(tmp_path: Path) -> None:
    budget = 8 * MiB
    r = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path), str(budget)],
                       capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stderr
    growth = int(json.loads(r.stdout.strip().splitlines()[-1])["growth_bytes"])
    # the budget, plus an 8 MiB aligned bounce buffer per local data file (four files,
    # docs/storage.md); the copy took 16 MiB per file whatever the budget (+99 MiB)
    bound = budget + 4 * 8 * MiB + 24 * MiB
    assert growth < bound, f"peak RSS grew by {growth / MiB:.0f} MiB saving and persisting"
