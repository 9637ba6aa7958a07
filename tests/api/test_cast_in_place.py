"""In-place loads into a target of another dtype (fp32 saved, fp16/bf16/fp64 target)
read the saved array in pieces within the memory budget and cast each into the
target (api/_castfill.py), checking every value first: a refused one leaves the
target as it was.

Before, the whole array was read (or its file mapped) and cast into a full copy:
a 1 GiB float32 array under a 64 MiB budget grew peak memory by 0.5-1.5 GiB into
a float16 target, 2-3 GiB into a float64 one.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import statestream as ss
from statestream.api import _castfill
from statestream.errors import TargetMismatchError

MiB = 1 << 20
_BUDGET = 16 * MiB

_CHILD = r"""
import json, sys
import numpy as np
import statestream as ss
path, lib, budget = sys.argv[1], sys.argv[2], int(sys.argv[3])
if lib == "torch":
    import torch
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
saved = ss.load(path)["w"]
n = saved.shape
out = {}
for name in sys.argv[4:]:
    if lib == "numpy":
        tgt = np.ones(n, dtype=name)
    else:
        tgt = torch.ones(n, dtype=getattr(torch, name))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM from here
    before = status("VmRSS:")
    got = ss.load(path, {"w": tgt}, in_place=True,
                  memory=ss.MemoryOptions(memory_budget_bytes=budget))["w"]
    growth = status("VmHWM:") - before
    if lib == "numpy":
        same = got is tgt and np.array_equal(got, saved.astype(name))
    else:
        same = got is tgt and torch.equal(got, torch.from_numpy(saved).to(tgt.dtype))
    out[name] = [growth, bool(same)]
    del got, tgt
print(json.dumps(out))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_a_cast_in_place_load_stays_within_the_budget(tmp_path: Path, lib: str,
                                                      compression: str | None) -> None:
    if lib == "torch":
        pytest.importorskip("torch")
    w = (np.arange(32 << 20, dtype=np.float32) % 4099).reshape(8192, 4096) / 7  # 128 MiB
    if compression:
        w.view(np.uint32)[...] &= 0xFFFF0000  # compresses
    path = tmp_path / "ck"
    ss.save(path, {"w": w}, compression=compression)
    del w
    names = ["float16", "float64"] + (["bfloat16"] if lib == "torch" else [])
    r = subprocess.run([sys.executable, "-c", _CHILD, str(path), lib, str(_BUDGET), *names],
                       capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    for name, (growth, same) in got.items():
        assert same, f"{lib} {name}: not the saved values cast, or not the target itself"
        # the budget and slack; a whole cast copy is 64-256 MiB (and the mapped file)
        assert growth < _BUDGET + 32 * MiB, f"{lib} {name}: peak RSS +{growth / MiB:.0f} MiB"


@pytest.fixture
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every array takes the piecewise path, in pieces of at most 4 KiB."""
    monkeypatch.setattr(_castfill, "_MIN_BYTES", 0)
    monkeypatch.setattr(_castfill, "_MAX_PIECE", 4096)


def _save(tmp_path: Path, state: dict[str, Any], compression: str | None) -> Path:
    path = tmp_path / f"ck-{compression}"
    ss.save(path, state, compression=compression, io=ss.IOOptions(max_chunk_bytes=16 << 10))
    return path


@pytest.mark.usefixtures("small_pieces")
@pytest.mark.parametrize("compression", [None, "zstd"])
def test_numpy_targets_get_the_values_cast(tmp_path: Path, compression: str | None) -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((96, 70)).astype(np.float32)
    c = (rng.standard_normal((40, 33)) + 0j).astype(np.complex64)
    path = _save(tmp_path, {"w": w, "c": c, "i": np.arange(5000, dtype=np.int64)}, compression)
    wide = np.zeros((70, 96), dtype=np.float64).T  # not contiguous
    tgt = {"w": wide, "c": np.zeros((40, 33), np.float32), "i": np.zeros(5000, np.int16)}
    out = ss.load(path, tgt, in_place=True)
    assert all(out[k] is tgt[k] for k in tgt)
    np.testing.assert_array_equal(wide, w.astype(np.float64))
    np.testing.assert_array_equal(tgt["c"], c.real)
    np.testing.assert_array_equal(tgt["i"], np.arange(5000))


@pytest.mark.usefixtures("small_pieces")
@pytest.mark.parametrize("compression", [None, "zstd"])
def test_torch_targets_get_the_values_cast(tmp_path: Path, compression: str | None) -> None:
    torch = pytest.importorskip("torch")
    w = np.random.default_rng(1).standard_normal((64, 50)).astype(np.float32)
    path = _save(tmp_path, {"w": w, "v": w[:8]}, compression)
    p = torch.nn.Parameter(torch.zeros(64, 50, dtype=torch.bfloat16))
    t = torch.zeros(50, 8, dtype=torch.float64).t()  # not contiguous
    version = p._version
    out = ss.load(path, {"w": p, "v": t}, in_place=True)
    assert out["w"] is p and out["v"] is t and p.requires_grad
    assert p._version > version  # autograd sees the write
    assert torch.equal(p.detach(), torch.from_numpy(w).to(torch.bfloat16))
    assert torch.equal(t, torch.from_numpy(w[:8]).double())


@pytest.mark.usefixtures("small_pieces")
@pytest.mark.parametrize("compression", [None, "zstd"])
def test_a_refused_value_in_a_late_piece_leaves_the_targets_unchanged(
        tmp_path: Path, compression: str | None) -> None:
    w = np.ones(20000, dtype=np.float32)
    w[-1] = 1e6  # beyond float16
    i = np.zeros(20000, dtype=np.int64)
    i[-1] = 1 << 40
    path = _save(tmp_path, {"a": np.ones(20000, np.float32), "w": w}, compression)
    tgt = {"a": np.full(20000, 3, np.float64), "w": np.full(20000, 3, np.float16)}
    with pytest.raises(TargetMismatchError, match="'w'"):
        ss.load(path, tgt, in_place=True)
    assert (tgt["a"] == 3).all() and (tgt["w"] == 3).all()
    path = _save(tmp_path / "i", {"i": i}, compression)
    into = np.full(20000, 3, np.int32)
    with pytest.raises(TargetMismatchError, match=str(1 << 40)):
        ss.load(path, {"i": into}, in_place=True)
    assert (into == 3).all()
