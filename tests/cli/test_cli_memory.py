"""The CLI's long commands stay within a bounded amount of memory beyond what they must
read, and their progress moves while one large array is worked on."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import statestream as ss

MiB = 1 << 20

# VmHWM (this process's peak RSS since exec), not ru_maxrss: a child's ru_maxrss starts
# at its parent's peak, which would hide the growth being measured
_CHILD = r"""
import json, sys
import statestream as ss
from statestream.cli import main
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
argv = sys.argv[1:]
ss.metadata(argv[1])  # imports and first-touch costs happen before the baseline
before = hwm()
rc = main(argv)
print(json.dumps({"rc": rc, "growth_bytes": hwm() - before}))
"""


def _cli_growth(*argv: str) -> tuple[int, int]:
    r = subprocess.run([sys.executable, "-c", _CHILD, *argv], capture_output=True, text=True,
                       timeout=600, check=False)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    return int(out["rc"]), int(out["growth_bytes"])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_diff_of_a_large_array_compares_it_in_blocks(tmp_path: Path) -> None:
    """Two 128 MiB float32 arrays: what diff must hold is the two arrays it reads (256
    MiB); comparing them whole as float64 took about ten times that (1.4 GB)."""
    n = (128 * MiB) // 4
    a = np.full(n, 1.5, np.float32)
    ss.save(tmp_path / "a", {"w": a})
    a[-3:] = 4.0
    ss.save(tmp_path / "b", {"w": a})
    del a
    rc, growth = _cli_growth("diff", str(tmp_path / "a"), str(tmp_path / "b"))
    assert rc == 1
    bound = 2 * 128 * MiB + 96 * MiB
    assert growth < bound, f"peak RSS grew by {growth / MiB:.0f} MiB diffing 2 x 128 MiB"


def test_diff_progress_moves_within_one_array(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from statestream.cli import _diff

    w = np.arange(10_000, dtype=np.float32)
    ss.save(tmp_path / "a", {"w": w, "step": 1})
    ss.save(tmp_path / "b", {"w": w + 1, "step": 1})
    calls: list[tuple[int, int]] = []

    @contextlib.contextmanager
    def bar(label: str, total: int | None = None) -> Iterator[object]:
        yield lambda done, tot: calls.append((done, tot))

    monkeypatch.setattr(_diff, "progress_bar", bar)
    monkeypatch.setattr(_diff, "BLOCK_ELEMENTS", 1000)
    out = _diff.diff(str(tmp_path / "a"), str(tmp_path / "b"),
                     _diff.argparse.Namespace(atol=0.0, rtol=0.0, allow_pickle=False))
    assert [c["key"] for c in out["changed"]] == ["w"]
    assert out["changed"][0]["max_abs_diff"] == 1.0
    assert len(calls) == 10  # one report per block of the one array
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)
    assert calls[-1] == (80_000, 80_000)


def test_diff_in_blocks_keeps_nan_and_tolerance(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A NaN difference in an early block is still NaN after later, finite blocks; a
    difference beyond the tolerance in one block makes the whole array differ."""
    from statestream.cli import _diff

    a = np.zeros(5000, np.float64)
    b = a.copy()
    b[10] = np.nan
    b[4000] = 2.0
    monkeypatch.setattr(_diff, "BLOCK_ELEMENTS", 1000)
    ok, big = _diff._largest(a, b, 0.0, 0.0)
    assert not ok and big is not None and np.isnan(big)
    ok, big = _diff._largest(a, np.where(np.arange(5000) == 4999, 0.5, 0.0), 1.0, 0.0)
    assert ok and big == 0.5


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_memory_budget_bounds_what_diff_and_convert_hold(tmp_path: Path) -> None:
    """64 arrays of 2 MiB per side: diff reads 64 MiB per side at a time by default, half
    of --memory-budget per side with it; convert and verify take the option too."""
    state = {f"w{i}": np.full((2 * MiB) // 4, i, np.float32) for i in range(64)}
    ss.save(tmp_path / "a", state)
    state["w63"][0] = -1.0
    ss.save(tmp_path / "b", state)
    del state
    args = ("diff", str(tmp_path / "a"), str(tmp_path / "b"))
    rc, default = _cli_growth(*args)
    assert rc == 1
    rc, budgeted = _cli_growth(*args, "--memory-budget", "8MiB")
    assert rc == 1
    assert default > 96 * MiB, f"default diff grew by {default / MiB:.0f} MiB"
    assert budgeted < 40 * MiB, f"diff --memory-budget 8MiB grew by {budgeted / MiB:.0f} MiB"
    rc, _ = _cli_growth("convert", str(tmp_path / "a"), str(tmp_path / "a.safetensors"),
                        "--memory-budget", "4MiB")
    assert rc == 0
    rc, _ = _cli_growth("verify", str(tmp_path / "a"), "--memory-budget", "4MiB")
    assert rc == 0
    out = ss.load(tmp_path / "a.safetensors")
    assert float(out["w63"][0]) == 63.0 and len(out) == 64
