"""``ReadAhead``: the ranges a load's walk plans, read ahead on one thread.

Runs are checked on what the walk's thread queues (``_push``), the thread on a
recording reader; the page-cache effect on a real file through ``mincore``.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import statestream as ss
from statestream.errors import TruncatedFileError
from statestream.storage import ReadAhead
from statestream.storage._compose import PAGE
from statestream.storage._pagecache import cold_ranges, read_ahead

KIB = 1024


class _Recorder:
    """A reader that records what it is asked to read ahead."""

    def __init__(self, block: threading.Event | None = None,
                 fail: BaseException | None = None) -> None:
        self.calls: list[tuple[str, int, int]] = []
        self.entered = threading.Event()
        self._block, self._fail = block, fail

    def read_ahead(self, name: str, offset: int, nbytes: int) -> None:
        self.calls.append((name, offset, nbytes))
        self.entered.set()
        if self._block is not None:
            self._block.wait(10)
        if self._fail is not None:
            raise self._fail


def _runs(ra: ReadAhead) -> list[tuple[str, int, int]]:
    got: list[tuple[str, int, int]] = []
    ra._push = lambda name, run: got.append((name, run[0], run[1] - run[0]))  # type: ignore[method-assign]
    return got


def test_adjacent_small_ranges_make_runs_of_a_step() -> None:
    ra = ReadAhead(_Recorder(), step=256 * KIB, gap=4 * KIB, max_chunk=64 * KIB)  # type: ignore[arg-type]
    got = _runs(ra)
    off = 0
    for _ in range(20):  # 20 x 32 KiB, each 1 KiB after the last (padding)
        ra.add("a", off, 32 * KIB)
        off += 33 * KIB
    # a run is queued as soon as it spans a step: 8 ranges (263 KiB) each
    assert got == [("a", 0, 263 * KIB), ("a", 264 * KIB, 263 * KIB)]


def test_gaps_other_files_and_large_chunks() -> None:
    ra = ReadAhead(_Recorder(), step=1 << 20, gap=4 * KIB, max_chunk=64 * KIB)  # type: ignore[arg-type]
    got = _runs(ra)
    ra.add("a", 0, 16 * KIB)
    ra.add("b", 0, 16 * KIB)           # another file: a run of its own
    ra.add("a", 16 * KIB, 16 * KIB)    # joins a's run
    ra.add("a", 1 << 20, 128 * KIB)    # over max_chunk: not read ahead, run untouched
    ra.add("a", 100 * KIB, 8 * KIB)    # 68 KiB past a's end: queues a's run, starts anew
    assert got == [("a", 0, 32 * KIB)]
    ra.add("b", 64 * KIB, 8 * KIB)     # past the gap: queues b's run
    assert got[-1] == ("b", 0, 16 * KIB)
    ra.close()                         # what is still being gathered is dropped
    assert len(got) == 2


def test_the_thread_reads_ahead_and_close_waits_for_the_call_in_flight() -> None:
    release = threading.Event()
    rec = _Recorder(block=release)
    ra = ReadAhead(rec, step=64 * KIB, gap=0, max_chunk=64 * KIB)  # type: ignore[arg-type]
    ra.add("a", 0, 64 * KIB)       # a full run: the thread starts on it and blocks
    assert rec.entered.wait(10)
    ra.add("a", 64 * KIB, 64 * KIB)  # queued behind it
    ra.add("a", 128 * KIB, 64 * KIB)
    closer = threading.Thread(target=ra.close)
    closer.start()
    time.sleep(0.05)
    assert closer.is_alive()  # waiting for the call in flight
    release.set()
    closer.join(10)
    assert not closer.is_alive()
    assert rec.calls == [("a", 0, 64 * KIB)]  # the queued runs were dropped
    ra.add("a", 192 * KIB, 64 * KIB)  # after close: nothing
    assert rec.calls == [("a", 0, 64 * KIB)]
    assert not any(t.name == "statestream-readahead" for t in threading.enumerate())


def test_a_failing_hint_is_ignored() -> None:
    rec = _Recorder(fail=TruncatedFileError("gone"))
    ra = ReadAhead(rec, step=8 * KIB, gap=0, max_chunk=64 * KIB)  # type: ignore[arg-type]
    ra.add("a", 0, 8 * KIB)
    ra.add("a", 8 * KIB, 8 * KIB)
    deadline = time.monotonic() + 10
    while len(rec.calls) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    ra.close()
    assert len(rec.calls) == 2  # the thread went on after the first failure


def test_read_ahead_fills_the_page_cache(tmp_path: Path) -> None:
    f = tmp_path / "blob"
    f.write_bytes(os.urandom(256 * PAGE))
    fd = os.open(f, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if sum(b - a for a, b in cold_ranges(fd, 0, 256 * PAGE)) < 128 * PAGE:
            pytest.skip("this file system keeps its pages (no droppable page cache)")
        read_ahead(fd, 64 * PAGE, 64 * PAGE)
        deadline = time.monotonic() + 20  # the reads are queued, not waited for
        while time.monotonic() < deadline:
            cold = cold_ranges(fd, 64 * PAGE, 64 * PAGE)
            if not cold:
                break
            time.sleep(0.01)
        assert cold_ranges(fd, 64 * PAGE, 64 * PAGE) == []
        read_ahead(fd, 0, 0)  # nothing to do, no error
    finally:
        os.close(fd)
    read_ahead(fd, 0, PAGE)  # a closed descriptor: a hint, never an error


def _small_state() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(11)
    return {f"t{i:03d}": rng.standard_normal(500 + 37 * i).astype(np.float32)
            for i in range(300)}


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, int]]:
    from statestream.storage._local_read import _LocalReader

    calls: list[tuple[str, int, int]] = []
    real = _LocalReader.read_ahead

    def spy(self: _LocalReader, name: str, offset: int, nbytes: int) -> None:
        calls.append((name, offset, nbytes))
        real(self, name, offset, nbytes)

    monkeypatch.setattr(_LocalReader, "read_ahead", spy)
    return calls


@pytest.mark.parametrize("in_place", [False, True])
def test_a_load_reads_small_arrays_ahead(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         in_place: bool) -> None:
    import statestream.api._load as load_mod

    state = _small_state()
    ss.save(tmp_path / "ck", state)
    calls = _spy(monkeypatch)

    class Draining(ReadAhead):
        # A busy machine may not run the read-ahead thread before the walk ends, and the
        # end of the walk drops what is queued: let it drain, so the test sees the calls.
        def close(self) -> None:
            deadline = time.monotonic() + 30
            while self._queue and time.monotonic() < deadline:
                time.sleep(0.001)
            super().close()

    monkeypatch.setattr(load_mod, "ReadAhead",  # small steps: a 0.6 MB state makes runs
                        lambda reader: Draining(reader, step=64 * KIB))
    target = {k: np.zeros_like(v) for k, v in state.items()}
    out = ss.load(tmp_path / "ck", target=target, in_place=in_place)
    for k, v in state.items():
        np.testing.assert_array_equal(out[k], v)
    assert calls, "nothing was read ahead"
    sizes = {f.name: f.stat().st_size for f in (tmp_path / "ck" / "data").iterdir()}
    for name, offset, nbytes in calls:
        assert name.startswith("data/") and 0 <= offset and offset + nbytes <= sizes[name[5:]]


def test_no_read_ahead_with_drop_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = _small_state()
    ss.save(tmp_path / "ck", state)
    calls = _spy(monkeypatch)
    out = ss.load(tmp_path / "ck", io=ss.IOOptions(drop_behind=True))
    np.testing.assert_array_equal(out["t007"], state["t007"])
    assert calls == []  # drop-behind must see the page cache as the walk left it


def test_a_corrupt_small_array_is_still_caught(tmp_path: Path) -> None:
    state = _small_state()
    ss.save(tmp_path / "ck", state)
    f = next((tmp_path / "ck" / "data").iterdir())
    with open(f, "r+b") as fh:
        fh.seek(4096)
        b = fh.read(1)
        fh.seek(4096)
        fh.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(ss.ChecksumMismatchError):
        ss.load(tmp_path / "ck")
