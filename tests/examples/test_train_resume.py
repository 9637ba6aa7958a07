"""The exact-resume demo (``make demo``) passes, at a smaller size."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_resume.py"

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")


@pytest.mark.timeout(420)
def test_train_resume_demo_is_bitwise_exact(tmp_path):
    pytest.importorskip("torch")
    work = tmp_path / "run"
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--steps", "24", "--save-every", "4",
         "--workdir", str(work), "--timeout", "300"],
        capture_output=True, text=True, timeout=400,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "final check: PASS" in r.stdout, out[-4000:]
    assert "SIGKILL" in r.stdout and "resumed in a new process from step" in r.stdout
    assert "MISMATCH" not in r.stdout
    # the kept files: committed steps only, and the final state of the resumed run
    steps = sorted(p.name for p in (work / "ckpt").iterdir() if p.name.startswith("step_"))
    assert steps == ["step_0000000016", "step_0000000020", "step_0000000024"]
    assert not [p for p in (work / "ckpt").iterdir() if p.name.startswith(".step_")]
    assert (work / "final" / "COMMITTED").exists()
