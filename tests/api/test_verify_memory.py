"""``verify`` reads a chunk larger than the memory budget through a small scratch
buffer, step by step, never the whole chunk (it has no destination to read into).

Measured with tracemalloc, as tests/api/test_compression_memory.py does: it sees the
numpy scratch buffers.
"""

from __future__ import annotations

import pathlib
import re
import tracemalloc

import numpy as np
import pytest

import statestream as ss
from statestream.engine import IOOptions
from statestream.engine._read import _CHECK_STEP

MiB = 1 << 20
_BUDGET = 32 * MiB
_THREADS = 2
_SLACK = 1 * MiB


def _saved(tmp_path: pathlib.Path) -> pathlib.Path:
    """128 MiB in two 64 MiB chunks (the default chunk size), twice the budget each."""
    path = tmp_path / "ck"
    w = np.arange(32 * MiB, dtype=np.float32)
    ss.save(path, {"w": w}, io=IOOptions(num_threads=1))  # one data file
    assert ss.metadata(path).tree["w"].num_chunks == 2
    files = list((path / "data").iterdir())
    assert len(files) == 1 and files[0].stat().st_size == 128 * MiB  # w from byte 0
    return path


def _verify_peak(path: pathlib.Path) -> tuple[int, ss.VerifyReport]:
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        rep = ss.verify(path, memory=ss.MemoryOptions(memory_budget_bytes=_BUDGET),
                        io=IOOptions(num_threads=_THREADS))
        return tracemalloc.get_traced_memory()[1] - base, rep
    finally:
        tracemalloc.stop()


def test_verify_of_chunks_larger_than_the_budget_stays_small(tmp_path: pathlib.Path) -> None:
    path = _saved(tmp_path)
    peak, rep = _verify_peak(path)
    assert rep.ok and rep.checked_bytes == 128 * MiB
    allowed = _THREADS * _CHECK_STEP + _SLACK  # within the 32 MiB budget
    assert peak <= allowed, f"peak {peak / MiB:.1f} MiB > {allowed / MiB:.1f} MiB"


@pytest.mark.parametrize("at", [5, 64 * MiB - 1, 64 * MiB + 9 * MiB + 3])
def test_verify_in_steps_still_finds_a_flipped_byte(tmp_path: pathlib.Path, at: int) -> None:
    path = _saved(tmp_path)
    with open(next((path / "data").iterdir()), "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x10]))
    _, rep = _verify_peak(path)
    assert not rep.ok
    assert any("'w'" in p and "checksum mismatch" in p for p in rep.problems), rep.problems
    # the block that holds the byte, not the step or the chunk (reads span blocks)
    (lo, hi), = [map(int, re.findall(r"bytes \[(\d+), (\d+)\)", p)[0])
                 for p in rep.problems if "checksum mismatch" in p]
    assert lo <= at < hi and hi - lo <= 2 * MiB, rep.problems
