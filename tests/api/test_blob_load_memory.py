"""A large ``bytes`` leaf (or pickle leaf) loads with no memory beyond the value returned.

Before, its bytes were read into a fresh array and then copied into the ``bytes``
object (a pickle leaf's into a ``bytes`` copy, then unpickled): twice the leaf's size.
Now a local checkpoint's bytes leaf is read from a private mapping of its file
(checked chunk by chunk like any mapped array) and copied once into the value; a
pickle leaf is read (never mapped: what is unpickled must be what was checked) and
unpickled straight from that buffer, without a bytes copy. Measured with tracemalloc (it sees NumPy
buffers and Python objects, not file mappings), as tests/api/test_verify_memory.py does.
"""

from __future__ import annotations

import array
import pathlib
import tracemalloc
from typing import Any

import numpy as np

import statestream as ss

MiB = 1 << 20
_SIZE = 64 * MiB
_SLACK = 4 * MiB


def _load_peak(path: pathlib.Path, **kwargs: Any) -> tuple[int, dict[str, Any]]:
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        got = ss.load(path, memory=ss.MemoryOptions(memory_budget_bytes=32 * MiB), **kwargs)
        return tracemalloc.get_traced_memory()[1] - base, got
    finally:
        tracemalloc.stop()


def test_a_bytes_leaf_loads_with_one_copy(tmp_path: pathlib.Path) -> None:
    value = np.random.default_rng(0).integers(0, 256, _SIZE, dtype=np.uint8).tobytes()
    ss.save(tmp_path / "b", {"b": value, "n": np.arange(3)})
    peak, got = _load_peak(tmp_path / "b")
    assert got["b"] == value
    assert peak < _SIZE + _SLACK, f"peak {peak / MiB:.0f} MiB for a {_SIZE // MiB} MiB leaf"
    # read instead of mapped (map_files=False): the leaf is read, then copied (twice)
    peak, got = _load_peak(tmp_path / "b", io=ss.IOOptions(map_files=False))
    assert got["b"] == value and peak < 2 * _SIZE + _SLACK


def test_a_pickle_leaf_is_unpickled_from_the_checked_buffer(tmp_path: pathlib.Path) -> None:
    value = array.array("b", bytes(_SIZE))  # no walker knows it: pickled whole
    ss.save(tmp_path / "p", {"p": value}, pickle_paths=["p"])
    assert ss.metadata(tmp_path / "p").tree["p"].kind == "pickle"
    peak, got = _load_peak(tmp_path / "p", allow_pickle=True)
    assert got["p"] == value
    # the buffer read, and what unpickling makes (the array's bytes, then the array);
    # before, a bytes copy of the buffer came first (260 MiB here)
    assert peak < 3 * _SIZE + 2 * _SLACK, f"peak {peak / MiB:.0f} MiB, {_SIZE // MiB} MiB pickle"
