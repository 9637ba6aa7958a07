"""``IOOptions(drop_behind=True)``: a load lets the page cache drop what it read in,
and only that; every byte is still checked.

Residency is observed with ``mincore`` (storage/_pagecache.py) on the test's own
files; a file is made cold with ``posix_fadvise(DONTNEED)`` on it alone. Where the
file system keeps no droppable page cache (tmpfs), the tests skip.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import statestream as ss
from statestream.errors import ChecksumMismatchError
from statestream.storage._compose import PAGE
from statestream.storage._pagecache import cold_ranges, drop_cached

pytestmark = pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="needs posix_fadvise")

DROP = ss.IOOptions(drop_behind=True)


def _data_files(ckpt: Path) -> list[Path]:
    return sorted(p for p in (ckpt / "data").iterdir() if p.is_file())


def _evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # dirty pages are not dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _cache(path: Path, start: int = 0, end: int | None = None) -> None:
    with open(path, "rb") as f:
        f.seek(start)
        f.read(None if end is None else end - start)


def _cold_bytes(path: Path) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        return sum(b - a for a, b in cold_ranges(fd, 0, os.fstat(fd).st_size))
    finally:
        os.close(fd)


def _need_droppable(path: Path) -> None:
    _evict(path)
    if _cold_bytes(path) < os.path.getsize(path) // 2:
        pytest.skip("this file system keeps its pages (no droppable page cache)")


def _saved_cold(tmp_path: Path) -> tuple[dict[str, np.ndarray], Path, list[Path]]:
    """:func:`_state` saved to ``tmp_path/ck``; its data files, none of them cached."""
    state = _state()
    ckpt = tmp_path / "ck"
    ss.save(ckpt, state)
    files = _data_files(ckpt)
    for f in files:
        _need_droppable(f)
    return state, ckpt, files


def _zeros(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: np.zeros_like(v) for k, v in state.items()}


def _state() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    big = {f"big{i}": rng.standard_normal(3 << 20).astype(np.float32) for i in range(3)}
    small = {f"small{i}": rng.standard_normal(300 + i).astype(np.float32) for i in range(200)}
    return {**big, **small}


def test_cold_ranges_and_drop_on_a_plain_file(tmp_path: Path) -> None:
    f = tmp_path / "blob"
    f.write_bytes(os.urandom(64 * PAGE))
    _need_droppable(f)
    fd = os.open(f, os.O_RDONLY)
    try:
        assert cold_ranges(fd, 0, 64 * PAGE) == [(0, 64 * PAGE)]
        os.pread(fd, 16 * PAGE, 8 * PAGE)  # pages 8..23 come in
        assert cold_ranges(fd, 0, 64 * PAGE) == [(0, 8 * PAGE), (24 * PAGE, 64 * PAGE)]
        # an unaligned range is widened to its pages
        assert cold_ranges(fd, 8 * PAGE + 5, 100) == []
        assert cold_ranges(fd, 5, 10) == [(0, PAGE)]
        # dropping only what lies wholly inside [lo, hi): page 8 is shared with lo - 1
        drop_cached(fd, [(0, 64 * PAGE)], 8 * PAGE + 1, 20 * PAGE)
        assert cold_ranges(fd, 8 * PAGE, 16 * PAGE) == [(9 * PAGE, 20 * PAGE)]
    finally:
        os.close(fd)


def test_in_place_load_drops_what_it_read_in(tmp_path: Path) -> None:
    state, ckpt, files = _saved_cold(tmp_path)
    target = _zeros(state)
    out = ss.load(ckpt, target=target, in_place=True, io=DROP)
    for k, v in state.items():
        assert out[k] is target[k]
        np.testing.assert_array_equal(target[k], v)
    for f in files:  # read, copied, checked, let go
        assert _cold_bytes(f) >= os.path.getsize(f) - PAGE, f


def test_pages_cached_before_the_load_stay(tmp_path: Path) -> None:
    state, ckpt, files = _saved_cold(tmp_path)
    for f in files:
        _cache(f, 0, os.path.getsize(f) // 2)  # the first half is in the page cache
    target = _zeros(state)
    ss.load(ckpt, target=target, in_place=True, io=DROP)
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            half = os.path.getsize(f) // 2 // PAGE * PAGE
            assert cold_ranges(fd, 0, half) == [], f  # still cached
        finally:
            os.close(fd)
    for k, v in state.items():
        np.testing.assert_array_equal(target[k], v)


def test_default_keeps_the_page_cache(tmp_path: Path) -> None:
    state, ckpt, files = _saved_cold(tmp_path)
    target = _zeros(state)
    ss.load(ckpt, target=target, in_place=True)
    assert all(_cold_bytes(f) < os.path.getsize(f) // 4 for f in files)


def test_allocating_load_keeps_mapped_arrays(tmp_path: Path) -> None:
    state, ckpt, files = _saved_cold(tmp_path)
    out = ss.load(ckpt, io=DROP)
    for k, v in state.items():
        np.testing.assert_array_equal(out[k], v)
    # every array is a mapping of the page cache: those pages stay (in use)
    total = sum(os.path.getsize(f) for f in files)
    cold = sum(_cold_bytes(f) for f in files)
    assert cold <= total // 20  # padding and the pages between arrays at most


def test_allocating_load_without_mappings_drops_what_it_read(tmp_path: Path) -> None:
    state, ckpt, files = _saved_cold(tmp_path)
    out = ss.load(ckpt, io=ss.IOOptions(drop_behind=True, map_files=False))
    for k, v in state.items():
        np.testing.assert_array_equal(out[k], v)
    for f in files:  # read into fresh memory, checked, let go
        assert _cold_bytes(f) >= os.path.getsize(f) - PAGE, f


def test_a_corrupt_chunk_is_still_caught(tmp_path: Path) -> None:
    state = _state()
    ckpt = tmp_path / "ck"
    ss.save(ckpt, state)
    f = max(_data_files(ckpt), key=os.path.getsize)
    with open(f, "r+b") as fh:  # a byte inside a large array's chunk
        fh.seek(os.path.getsize(f) // 2)
        b = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([b[0] ^ 0xFF]))
    _need_droppable(f)
    target = _zeros(state)
    with pytest.raises(ChecksumMismatchError, match="checksum mismatch"):
        ss.load(ckpt, target=target, in_place=True, io=DROP)


def test_cold_ranges_are_asked_window_by_window(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A large file is asked about a window at a time (bounded memory), and runs that
    cross a window's edge come back whole."""
    import statestream.storage._pagecache as pc

    f = tmp_path / "blob"
    f.write_bytes(os.urandom(40 * PAGE))
    _need_droppable(f)
    monkeypatch.setattr(pc, "_WINDOW", 8 * PAGE)
    fd = os.open(f, os.O_RDONLY)
    try:
        os.pread(fd, 4 * PAGE, 6 * PAGE)  # pages 6..9 cached, across the first edge
        assert cold_ranges(fd, 0, 40 * PAGE) == [(0, 6 * PAGE), (10 * PAGE, 40 * PAGE)]
        assert cold_ranges(fd, 3 * PAGE + 7, 30 * PAGE) == [(3 * PAGE, 6 * PAGE),
                                                            (10 * PAGE, 34 * PAGE)]
    finally:
        os.close(fd)


def test_compressed_and_incremental_checkpoints_load_with_drop_behind(tmp_path: Path) -> None:
    """Compressed chunks (read into scratch, decoded) and an incremental checkpoint's
    references into its base load exactly, and the base's pages are let go too."""
    state = _state()
    base, inc = tmp_path / "step-1", tmp_path / "step-2"
    ss.save(base, state, compression="zstd", hashes=True)
    changed = {**state, "small0": state["small0"] + 1}
    ss.save(inc, changed, base=base)
    assert ss.metadata(inc).bases  # it does refer to its base
    files = _data_files(base) + _data_files(inc)
    for f in files:
        _need_droppable(f)
    target = _zeros(changed)
    ss.load(inc, target=target, in_place=True, io=DROP)
    for k, v in changed.items():
        np.testing.assert_array_equal(target[k], v)
    for f in files:
        assert _cold_bytes(f) >= os.path.getsize(f) - PAGE, f


def test_a_large_piece_is_let_go_in_steps_not_per_block(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A large array has a checksum per ~1 MiB block of rows; the pages its in-place
    read brings in are let go every ``_DROP_STEP`` bytes, not once per block (one
    ``fadvise(DONTNEED)`` per block made a cold 3 GB in-place load 1.3x slower). The
    drops still cover the whole piece, back to back."""
    import statestream.engine._read as rd

    rows = np.random.default_rng(5).standard_normal((5 * 1024, 1024)).astype(np.float32)
    ckpt = tmp_path / "ck"
    ss.save(ckpt, {"w": rows})  # 20 MiB: 20 blocks of 256 rows
    calls: list[tuple[int, int]] = []
    real = rd._DropBehind.drop

    def spy(self: rd._DropBehind, name: str, lo: int, hi: int) -> None:
        calls.append((lo, hi))
        real(self, name, lo, hi)

    monkeypatch.setattr(rd._DropBehind, "drop", spy)
    target = {"w": np.zeros_like(rows)}
    ss.load(ckpt, target=target, in_place=True, io=DROP)
    np.testing.assert_array_equal(target["w"], rows)
    calls.sort()
    assert len(calls) == -(-rows.nbytes // rd._DROP_STEP)  # 3, not 20
    assert all(b - a == rd._DROP_STEP for a, b in calls[:-1])
    assert all(calls[i][1] == calls[i + 1][0] for i in range(len(calls) - 1))
    assert calls[-1][1] - calls[0][0] == rows.nbytes
