"""Item 4, memory: decoding a manifest costs a small multiple of its size.

It cost 11-15x (tracemalloc peak; about 12x in RSS). benchmarks/bench_manifest_memory.py
measures 3.5-4.0x now for the cases below at full size in the list form (format v1);
this test runs them smaller and bounds the peak at 5x, a margin for other Python
versions and allocators.

A table (format v3, many arrays) says the same in about half the text, so the same
decoded objects are a larger multiple of it: there the bound is on bytes, against the
list form of the same content (and MAX_ARRAYS bounds what any manifest can cost).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

_BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_manifest_memory.py"


def _measure(n_arrays: int, per: int, form: str = "v1") -> tuple[int, float, float]:
    ns: dict[str, object] = {}
    exec(compile(_BENCH.read_text(), str(_BENCH), "exec"), ns)  # noqa: S102 - our own script
    r = subprocess.run([sys.executable, "-c", str(ns["CHILD"]), str(n_arrays), str(per), form],
                       capture_output=True, text=True, timeout=600, check=True)
    size, peak, cur, _ = r.stdout.split()
    return int(size), int(peak) / int(size), int(cur) / int(size)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("n_arrays,per", [(20_000, 1), (150, 200), (1, 100_000)])
def test_decode_peak_memory_is_a_small_multiple(n_arrays: int, per: int) -> None:
    size, peak, kept = _measure(n_arrays, per, "v1")
    assert size > 1_000_000
    assert peak <= 5.0, f"decoding a {size}-byte manifest peaked at {peak:.2f}x its size"
    assert kept <= 3.5, f"the decoded manifest holds {kept:.2f}x its size"


@pytest.mark.timeout(600)
def test_a_table_costs_no_more_than_the_list_it_replaces() -> None:
    size, peak, kept = _measure(20_000, 1, "default")
    v1_size, v1_peak, v1_kept = _measure(20_000, 1, "v1")
    assert size < 0.7 * v1_size  # the table form was written
    assert peak * size <= 1.15 * v1_peak * v1_size, (
        f"the table peaked at {peak * size / 1e6:.1f} MB, the list at "
        f"{v1_peak * v1_size / 1e6:.1f} MB")
    assert kept * size <= 1.05 * v1_kept * v1_size


_EMPTY_LOAD = """
import sys, tracemalloc
import numpy as np, statestream as ss
n, path = int(sys.argv[1]), sys.argv[2]
ss.save(path, {f"a{i}": np.zeros((0, 3), np.float32) for i in range(n)})
tracemalloc.start()
out = ss.load(path)
cur, peak = tracemalloc.get_traced_memory()
assert len(out) == n and all(v.shape == (0, 3) for v in out.values())
print(peak / n, cur / n)
"""


@pytest.mark.timeout(600)
def test_a_load_of_empty_arrays_builds_no_read_plan_for_them(tmp_path: Path) -> None:
    """An empty array has nothing to read: a v3 table of them (~15 characters each)
    cost ~1,370 bytes per array at the peak of a load (a read plan, a destination of
    three array objects and a closure each); now ~760, the decoded manifest and the
    values themselves (docs/security.md)."""
    r = subprocess.run([sys.executable, "-c", _EMPTY_LOAD, "20000", str(tmp_path / "c")],
                       capture_output=True, text=True, timeout=600, check=True)
    peak, kept = map(float, r.stdout.split())
    assert peak <= 1000, f"a load of empty arrays peaked at {peak:.0f} bytes per array"
    assert kept <= 260, f"a loaded empty array holds {kept:.0f} bytes"
