"""Incremental steps behind a local tier, SIGKILLed anywhere: nothing dangles, nothing lost.

A child process saves steps 1..8 (a frozen part that changes at steps 4 and 7,
a small part that changes every step) through ``local_tier=`` with
``incremental=True`` and keep policies on both tiers, and is SIGKILLed the
n-th time it reaches one of the engine's or the manager's hook points: in a
save, in its commit, as a persistence begins or ends, or while a keep policy
deletes. Then, in both tiers, every committed step must have every step it
refers to; a new manager must persist what was left, load every step it lists
exactly, and save on.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import statestream as ss

STATE_SRC = """
import numpy as np

def state_at(step):
    era = 0 if step < 4 else (4 if step < 7 else 7)
    g = np.random.default_rng(2000 + era)
    return {"frozen": g.standard_normal((256, 512)).astype(np.float32),
            "lora": np.full((8, 64), float(step), np.float32), "step": step}
"""
_ns: dict[str, Any] = {}
exec(STATE_SRC, _ns)
state_at = _ns["state_at"]

_CHILD = STATE_SRC + """
import sys
import statestream as ss
from statestream.testing import faults

persist, local, point, nth, mode = sys.argv[1:6]
faults.kill_at(point, nth=int(nth))
mgr = ss.CheckpointManager(persist, local_tier=local, incremental=True,
                           async_save=mode == "async", keep_policy=ss.KeepLatest(2),
                           local_keep_policy=ss.KeepLatest(1))
for step in range(1, 9):
    mgr.save(step, state_at(step))
mgr.close()
print("DONE", flush=True)
"""

# (hook point, n-th time, save mode): each reached in the 8 steps
CASES = [
    ("tier.persist", 3, "sync"),
    ("tier.persist", 6, "async"),
    ("tier.persisted", 4, "sync"),
    ("tier.persisted", 2, "async"),
    ("manager.step_deleted", 1, "sync"),
    ("manager.step_deleted", 3, "async"),
    ("commit.renamed", 5, "sync"),
    ("commit.renamed", 6, "async"),
    ("commit.manifest_written", 8, "async"),
    ("commit.marker_written", 3, "sync"),
    ("save.chunk_written", 7, "sync"),
    ("save.data_synced", 6, "async"),
]


def _committed(d: Path) -> list[int]:
    if not d.exists():
        return []
    return sorted(int(p.name[5:]) for p in d.glob("step_*")
                  if p.is_dir() and (p / "COMMITTED").exists())


def _bases(d: Path, step: int) -> list[int]:
    doc = json.loads((d / f"step_{step:010d}" / "manifest.json").read_bytes())
    return [int(b[5:]) for b in doc.get("bases", [])]


def _nothing_dangles(d: Path) -> None:
    have = set(_committed(d))
    for s in have:
        missing = set(_bases(d, s)) - have
        assert not missing, f"{d.name}/step {s} refers to missing steps {sorted(missing)}"


def _equal(got: dict[str, Any], step: int) -> None:
    want = state_at(step)
    for k in ("frozen", "lora"):
        np.testing.assert_array_equal(got[k], want[k], err_msg=f"step {step} {k}")
    assert got["step"] == step


@pytest.mark.timeout(180)
@pytest.mark.parametrize("point,nth,mode", CASES, ids=[f"{p}-{n}-{m}" for p, n, m in CASES])
def test_a_kill_anywhere_leaves_no_dangling_reference(tmp_path: Path, point: str, nth: int,
                                                      mode: str) -> None:
    persist, local = tmp_path / "persist", tmp_path / "local"
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(persist), str(local), point,
                           str(nth), mode], capture_output=True, text=True, timeout=150)
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stdout, proc.stderr)
    _nothing_dangles(persist)
    _nothing_dangles(local)
    before = set(_committed(local)) | set(_committed(persist))
    with ss.CheckpointManager(str(persist), local_tier=str(local), incremental=True,
                              keep_policy=ss.KeepLatest(2),
                              local_keep_policy=ss.KeepLatest(1)) as mgr:
        mgr.wait()  # what the killed manager left unpersisted is persisted now
        listed = mgr.steps()
        assert listed and max(listed) == max(before)
        for s in listed:
            _equal(mgr.load(s), s)
        last = max(listed)
        assert mgr.save(last + 1, state_at(last + 1))
        mgr.wait()
        assert mgr.persisted_steps()[-1] == last + 1
    _nothing_dangles(persist)
    _nothing_dangles(local)
    for s in _committed(persist):  # the persistent directory stands on its own
        _equal(ss.load(str(persist / f"step_{s:010d}")), s)
