"""Every ``python`` block of docs/integrations.md runs as it is written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "integrations.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", DOC.read_text(), flags=re.S | re.M)


def _needs(code: str) -> list[str]:
    mods = {"lightning": "lightning", "flax": "flax", "optax": "optax", "torch": "torch",
            "jax": "jax", "transformers": "transformers"}
    return [m for k, m in mods.items() if re.search(rf"^(import|from) {k}\b", code, re.M)]


def test_the_page_has_examples():
    assert len(BLOCKS) >= 3


@pytest.mark.timeout(300)
@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_doc_example_runs(tmp_path, index):
    code = BLOCKS[index]
    for mod in _needs(code):
        pytest.importorskip(mod)
    script = tmp_path / f"example_{index}.py"
    script.write_text(code)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                       text=True, timeout=280, env=env)
    assert r.returncode == 0, f"example {index} of {DOC.name} failed:\n{r.stderr[-4000:]}"
