"""Shared helpers for the hostile-checkpoint tests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import statestream as ss
from statestream.format import encode_commit


def small_state() -> dict[str, Any]:
    return {"params": {"w": np.arange(12, dtype=np.float32).reshape(3, 4)},
            "step": 7, "name": "run"}


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    c = tmp_path / "ckpt"
    ss.save(c, small_state())
    return c


def read_doc(c: Path) -> Any:
    return json.loads((c / "manifest.json").read_bytes())


def write_doc(c: Path, doc: Any) -> None:
    """Rewrite the manifest and re-seal it (COMMITTED's size and CRC match)."""
    data = json.dumps(doc, separators=(",", ":")).encode()
    (c / "manifest.json").write_bytes(data)
    (c / "COMMITTED").write_bytes(encode_commit(data))


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "statestream", *args], capture_output=True,
                          text=True, timeout=timeout, check=False)
