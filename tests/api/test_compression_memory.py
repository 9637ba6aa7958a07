"""Compressed saves and loads stay within the memory budget: compression and
decompression buffers are charged to it, in sync, async and lazy saves alike
(issue 14: "streamed under the memory budget").

Measured with tracemalloc, which sees numpy buffers (staging, shuffled planes,
scratch) and the compressors' output bytes. What a save holds outside the budget
by design is the local writer's page-aligned bounce buffer, one per data file
(docs/storage.md); the allowance below counts it.
"""

from __future__ import annotations

import pathlib
import tracemalloc
from collections.abc import Callable
from typing import TypeVar

import numpy as np
import pytest

import statestream as ss
from statestream.engine import IOOptions
from statestream.engine._read import fit_requests
from statestream.plan import ReadPiece, ReadRequest
from statestream.storage._local_write import _BOUNCE
from statestream.testing import assert_tree_equal

_BUDGET = 4 << 20
_THREADS = 2  # so two data files, two bounce buffers
_SLACK = 1 << 20  # bookkeeping: records, manifest text, events
_T = TypeVar("_T")


def _state() -> dict[str, np.ndarray]:
    """48 MiB of float32 that compresses to about half (low mantissa bytes zeroed),
    so compressed output piles up if nothing bounds it."""
    rng = np.random.default_rng(0)
    out = {}
    for i in range(48):
        a = rng.standard_normal(256 * 1024).astype(np.float32)
        a.view(np.uint32)[...] &= 0xFFFF0000
        out[f"w{i}"] = a
    return out


def _peak(fn: Callable[[], _T]) -> tuple[int, _T]:
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        result = fn()
        return tracemalloc.get_traced_memory()[1] - base, result
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("mode", ["sync", "async", "lazy"])
def test_compressed_save_stays_within_the_budget(tmp_path: pathlib.Path, mode: str) -> None:
    state = _state()
    mem = ss.MemoryOptions(memory_budget_bytes=_BUDGET, keep_staging=False)
    io = IOOptions(max_chunk_bytes=256 << 10, num_threads=_THREADS)
    path = tmp_path / "c"

    def save() -> None:
        if mode == "sync":
            ss.save(path, state, compression="zstd", memory=mem, io=io)
        else:
            ss.save_async(path, state, compression="zstd", memory=mem, io=io,
                          lazy=mode == "lazy").result()

    peak, _ = _peak(save)
    allowed = _BUDGET + _THREADS * _BOUNCE + _SLACK
    assert peak <= allowed, f"{mode}: peak {peak / 2**20:.1f} MiB > {allowed / 2**20:.1f} MiB"
    assert ss.metadata(path).tree["w0"].codec == "zstd"
    assert_tree_equal(ss.load(path), state)


def test_compressed_load_stays_within_the_budget(tmp_path: pathlib.Path) -> None:
    state = _state()
    path = tmp_path / "c"
    ss.save(path, state, compression="zstd", io=IOOptions(max_chunk_bytes=256 << 10))
    mem = ss.MemoryOptions(memory_budget_bytes=_BUDGET)
    peak, loaded = _peak(lambda: ss.load(path, memory=mem, io=IOOptions(num_threads=4)))
    result = sum(a.nbytes for a in state.values())
    assert peak - result <= _BUDGET + _SLACK, f"scratch {(peak - result) / 2**20:.1f} MiB"
    assert_tree_equal(loaded, state)


def test_verify_of_a_compressed_checkpoint_stays_within_the_budget(
        tmp_path: pathlib.Path) -> None:
    state = _state()
    path = tmp_path / "c"
    ss.save(path, state, compression="zstd", io=IOOptions(max_chunk_bytes=256 << 10))
    mem = ss.MemoryOptions(memory_budget_bytes=_BUDGET)
    peak, report = _peak(lambda: ss.verify(path, memory=mem, io=IOOptions(num_threads=4)))
    assert peak <= _BUDGET + _SLACK, f"verify peak {peak / 2**20:.1f} MiB"
    assert report.ok


def _piece(offset: int, nbytes: int) -> ReadPiece:
    return ReadPiece(0, offset, 0, offset, nbytes, 0, (nbytes,), np.dtype("uint8"))


def test_requests_are_split_to_a_threads_share_of_the_budget() -> None:
    # four 100-byte pieces with 10-byte gaps, read into scratch: 430 bytes in one request
    pieces = [_piece(o, 100) for o in (0, 110, 220, 330)]
    req = ReadRequest(0, 0, 430, list(pieces))
    assert fit_requests([req], 430) == [req]
    got = fit_requests([req], 250)  # 100 + 10 + 100 fits, the third piece does not
    assert [(r.offset, r.nbytes, len(r.pieces)) for r in got] == [(0, 210, 2), (220, 210, 2)]
    assert [p for r in got for p in r.pieces] == pieces
    # a piece larger than the limit stays a request of its own
    got = fit_requests([req], 50)
    assert [(r.offset, r.nbytes) for r in got] == [(0, 100), (110, 100), (220, 100), (330, 100)]
    # pieces read in place take no scratch: never split
    direct = [_piece(o, 100) for o in (0, 100)]
    for p in direct:
        p.direct = np.empty(100, dtype=np.uint8)
    whole = ReadRequest(0, 0, 200, direct)
    assert fit_requests([whole], 1) == [whole]
