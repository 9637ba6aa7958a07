"""A conversion streams: peak RSS grows by far less than the state it converts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import statestream as ss

st_numpy = pytest.importorskip("safetensors.numpy")


# VmHWM (this process's peak RSS since exec), not ru_maxrss: a child's ru_maxrss starts
# at its parent's peak, which would hide the growth being measured
_CHILD = r"""
import json, sys
import statestream as ss
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
src, dst, budget = sys.argv[1], sys.argv[2], int(sys.argv[3])
ss.metadata(src)  # imports and first-touch costs happen before the baseline
before = hwm()
ss.convert(src, dst, memory=ss.MemoryOptions(memory_budget_bytes=budget))
print(json.dumps({"growth_bytes": hwm() - before}))
"""


def _convert_in_child(src: Path, dst: Path, budget: int) -> int:
    r = subprocess.run([sys.executable, "-c", _CHILD, str(src), str(dst), str(budget)],
                       capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stderr
    return int(json.loads(r.stdout.strip().splitlines()[-1])["growth_bytes"])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@pytest.mark.parametrize("state_bytes,budget,bound", [
    (200 << 20, 16 << 20, 32 << 20),
    # issue 11's figure: 768 MB of safetensors under a 64 MiB budget grows peak RSS < 350 MB
    (768_000_000, 64 << 20, 350_000_000),
])
def test_convert_streams_under_the_budget(tmp_path: Path, state_bytes: int, budget: int,
                                          bound: int) -> None:
    rows = state_bytes // 8 // 4096  # 8 float32 tensors of rows x 1024
    tensors = {f"layer{i}.weight": np.full((rows, 1024), i, np.float32) for i in range(8)}
    st_numpy.save_file(tensors, tmp_path / "in.safetensors")
    del tensors
    total = 8 * rows * 4096
    growth = _convert_in_child(tmp_path / "in.safetensors", tmp_path / "ck", budget)
    assert growth < bound, f"peak RSS grew by {growth} bytes converting {total} bytes"
    (tmp_path / "in.safetensors").unlink()  # keep the disk use of the test down
    growth = _convert_in_child(tmp_path / "ck", tmp_path / "out.safetensors", budget)
    assert growth < bound, f"peak RSS grew by {growth} bytes converting {total} bytes"
    md = ss.metadata(tmp_path / "out.safetensors")
    assert md.total_bytes == total
    w = ss.load(tmp_path / "out.safetensors", items=["layer7.weight"])["layer7.weight"]
    assert w.shape == (rows, 1024) and (w == 7).all()
