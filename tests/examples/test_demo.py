"""The tour of the basics (``make demo-basics``: examples/demo.py) runs to its end."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "demo.py"


@pytest.mark.timeout(300)
def test_the_basics_demo_runs_to_its_end(tmp_path: Path) -> None:
    """It stopped with a TypeError after verify (torch.from_numpy of the torch RNG
    state, which ``load`` returns as the torch tensor it was) and nothing ran it."""
    pytest.importorskip("torch")
    r = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                       timeout=280, env={**os.environ, "TMPDIR": str(tmp_path)})
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "resume is bit-exact" in r.stdout, out[-4000:]
    assert "(exit status 1)" in r.stdout  # verify found the flipped byte
    assert "load refused the damaged checkpoint: ChecksumMismatchError" in r.stdout
