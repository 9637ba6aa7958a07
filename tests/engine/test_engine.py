"""Tests for statestream.engine: ByteBudget, StreamWriter and read_requests."""

from __future__ import annotations

import random
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from statestream.engine import (
    ByteBudget,
    IOOptions,
    MemoryOptions,
    StreamWriter,
    default_memory_budget_bytes,
    read_requests,
)
from statestream.errors import CheckpointCorruptError, ChecksumMismatchError, TruncatedFileError
from statestream.format import COMMIT_NAME, ArrayEntry, FileEntry, checksum, dtype_name
from statestream.plan import (
    ArraySpec,
    ReadPiece,
    StreamPlanner,
    Wanted,
    WriteItem,
    plan_load,
    plan_verify,
)
from statestream.storage import LocalStorage

# ----------------------------------------------------------------------------- options


def test_options_validate() -> None:
    assert IOOptions().read_threads() >= 1 and IOOptions().write_threads() >= 4
    for bad in ({"num_threads": 0}, {"max_chunk_bytes": 0}, {"max_request_bytes": -1}):
        with pytest.raises(ValueError, match="must be positive"):
            IOOptions(**bad)


def test_memory_options_resolve() -> None:
    assert MemoryOptions(memory_budget_bytes=123).resolved() == 123
    assert MemoryOptions(memory_budget_bytes=1).resolved() == 1
    d = default_memory_budget_bytes()
    assert MemoryOptions().resolved() == d and 0 < d <= 4 << 30


# ----------------------------------------------------------------------------- ByteBudget


def test_budget_basics() -> None:
    b = ByteBudget(100)
    assert b.acquire(60) == 60 and b.in_use == 60
    assert b.try_acquire(50) is None and b.in_use == 60
    assert b.try_acquire(40) == 40 and b.in_use == 100
    b.release(100)
    assert b.in_use == 0 and b.peak == 100
    assert b.acquire(0) == 0 and b.try_acquire(-5) == 0
    b.release(0)
    assert b.in_use == 0


def test_oversize_request_takes_whole_budget() -> None:
    b = ByteBudget(10)
    assert b.acquire(1000) == 10 and b.in_use == 10
    assert b.try_acquire(1) is None
    b.release(10)
    assert b.try_acquire(1000) == 10
    b.release(10)


@pytest.mark.timeout(60)
def test_oversize_request_waits_for_empty_pool_then_progresses() -> None:
    b = ByteBudget(10)
    assert b.acquire(3) == 3
    got: list[int] = []
    t = threading.Thread(target=lambda: got.append(b.acquire(1 << 40)))
    t.start()
    b.release(3)
    t.join(30)
    assert not t.is_alive() and got == [10]
    b.release(10)
    assert b.in_use == 0


@pytest.mark.timeout(60)
def test_waiter_is_woken_by_release() -> None:
    b = ByteBudget(4)
    b.acquire(4)
    acquired = threading.Event()

    def waiter() -> None:
        b.acquire(2)
        acquired.set()

    t = threading.Thread(target=waiter)
    t.start()
    assert not acquired.is_set()  # the pool is full until the release below
    b.release(4)
    t.join(30)
    assert acquired.is_set() and b.in_use == 2


@pytest.mark.timeout(60)
def test_budget_never_exceeds_capacity_under_contention() -> None:
    cap = 100
    b = ByteBudget(cap)
    lock = threading.Lock()
    live = 0
    max_live = 0
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        nonlocal live, max_live
        rng = random.Random(seed)
        try:
            for _ in range(300):
                want = rng.randint(1, 150)
                got = b.acquire(want) if rng.random() < 0.7 else b.try_acquire(want)
                if got is None:
                    continue
                assert got == min(want, cap)
                with lock:
                    live += got
                    max_live = max(max_live, live)
                    assert live <= cap
                with lock:
                    live -= got
                b.release(got)
        except BaseException as exc:  # surface failures from the thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(50)
    assert not any(t.is_alive() for t in threads), "deadlock"
    assert errors == []
    assert b.in_use == 0
    assert 0 < max_live <= cap and b.peak <= cap


# ----------------------------------------------------------------------------- write + read


def make_arrays() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [
        rng.standard_normal((37, 5)).astype(np.float32),
        np.arange(1000, dtype=np.int64),
        np.asfortranarray(rng.integers(0, 255, (9, 11), dtype=np.uint8)),
        np.array(3.5, dtype=np.float64),
        np.zeros((0, 4), np.float16),
        rng.standard_normal(300).astype(">f8"),
    ]


def source_for(arrays: list[np.ndarray]) -> Any:
    def source(it: WriteItem) -> np.ndarray:
        a = arrays[it.array]
        part = a[tuple(slice(s, s + n) for s, n in zip(it.start, it.shape))] if a.ndim else a
        return np.ascontiguousarray(part.astype(part.dtype.newbyteorder("<"))).reshape(-1).view(
            np.uint8)

    return source


def needs_copy(a: np.ndarray) -> bool:
    return not a.flags.c_contiguous or a.dtype.byteorder == ">"


def save_arrays(path: Path, arrays: list[np.ndarray], *, threads: int, budget: ByteBudget,
                progress: Any = None) -> tuple[list[FileEntry], list[ArrayEntry], list[str]]:
    """Write arrays with the streaming writer (three files); ``threads`` is for reads."""
    st = LocalStorage()
    planner = StreamPlanner(file_prefix="data/r0", max_files=3, max_chunk_bytes=256,
                            block_bytes=256)
    txn = st.begin_write(str(path), overwrite=False)
    writer = StreamWriter(txn, planner.file_name, source_for(arrays), budget=budget,
                          progress=progress)
    for ai, a in enumerate(arrays):
        writer.submit(planner.add(ai, ArraySpec(a.shape, a.itemsize, needs_copy(a))))
    written = writer.close()
    files = writer.files()
    txn.write_bytes(COMMIT_NAME, b"x")
    txn.commit()
    entries = []
    for ai, a in enumerate(arrays):
        chunks = tuple(written[(ai, ci)] for ci, (_, _, nb) in enumerate(planner.chunks[ai])
                       if nb)
        name = dtype_name(a.dtype)
        assert name is not None
        entries.append(ArrayEntry(name, a.shape, chunks))
    return files, entries, [f.name for f in files]


def describe(p: ReadPiece) -> str:
    return f"array at key path 'arr/{p.array}'"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("threads", [1, 4])
@pytest.mark.parametrize("budget_bytes", [1, 1 << 20])
def test_round_trip(tmp_path: Path, threads: int, budget_bytes: int) -> None:
    arrays = make_arrays()
    wbudget = ByteBudget(budget_bytes)
    files, entries, names = save_arrays(tmp_path / "c", arrays, threads=threads, budget=wbudget)
    assert wbudget.in_use == 0 and wbudget.peak <= budget_bytes
    assert len(files) == 3
    # checksums are of the little-endian C-order chunk bytes
    for ai, e in enumerate(entries):
        for c in e.chunks:
            box = tuple(slice(s, s + n) for s, n in zip(c.start, c.shape))
            part = arrays[ai][box] if arrays[ai].ndim else arrays[ai]
            assert c.checksum == checksum(part.astype(part.dtype.newbyteorder("<")).tobytes())
    # read back: whole arrays (direct) and a cut box (scatter) with a tiny budget
    dests = [np.empty(a.shape, a.dtype.newbyteorder("<")) for a in arrays]
    wanted = [Wanted(i, (0,) * a.ndim, d) for i, (a, d) in enumerate(zip(arrays, dests))]
    part = np.empty((10, 3), np.float32)
    wanted.append(Wanted(0, (20, 1), part))
    rbudget = ByteBudget(budget_bytes)
    reader = LocalStorage().open_read(str(tmp_path / "c"))
    try:
        reqs = plan_load(entries, wanted, max_request_bytes=300)
        assert len(reqs) > 3
        read_requests(reader, names, reqs, options=IOOptions(num_threads=threads),
                      budget=rbudget, describe=describe)
    finally:
        reader.close()
    assert rbudget.in_use == 0 and rbudget.peak <= budget_bytes
    for a, d in zip(arrays, dests):
        np.testing.assert_array_equal(d, a)
    np.testing.assert_array_equal(part, arrays[0][20:30, 1:4])


@pytest.mark.timeout(60)
def test_progress_reaches_total(tmp_path: Path) -> None:
    arrays = make_arrays()
    wcalls: list[tuple[int, int]] = []
    lock = threading.Lock()

    def wprog(done: int, total: int) -> None:
        with lock:
            wcalls.append((done, total))

    _, entries, names = save_arrays(tmp_path / "c", arrays, threads=3, budget=ByteBudget(64),
                                    progress=wprog)
    total = sum(a.nbytes for a in arrays)
    assert wcalls and {t for _, t in wcalls} == {total}
    assert max(d for d, _ in wcalls) == total
    rcalls: list[tuple[int, int]] = []
    reqs = plan_verify(entries, max_request_bytes=100)
    reader = LocalStorage().open_read(str(tmp_path / "c"))
    try:
        read_requests(reader, names, reqs, options=IOOptions(num_threads=3),
                      budget=ByteBudget(1), describe=describe,
                      progress=lambda d, t: rcalls.append((d, t)))
    finally:
        reader.close()
    rtotal = sum(r.nbytes for r in reqs)
    assert max(d for d, _ in rcalls) == rtotal and {t for _, t in rcalls} == {rtotal}


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


@pytest.mark.timeout(60)
def test_corrupt_chunk_raises_naming_array_and_file(tmp_path: Path) -> None:
    arrays = make_arrays()
    _, entries, names = save_arrays(tmp_path / "c", arrays, threads=2, budget=ByteBudget(1))
    c = entries[1].chunks[2]
    flip_byte(tmp_path / "c" / names[c.file], c.offset + 5)
    dests = [np.empty(a.shape, a.dtype.newbyteorder("<")) for a in arrays]
    wanted = [Wanted(i, (0,) * a.ndim, d) for i, (a, d) in enumerate(zip(arrays, dests))]
    reader = LocalStorage().open_read(str(tmp_path / "c"))
    try:
        with pytest.raises(ChecksumMismatchError) as ei:
            read_requests(reader, names, plan_load(entries, wanted), options=IOOptions(),
                          budget=ByteBudget(1), describe=describe)
        msg = str(ei.value)
        assert "array at key path 'arr/1'" in msg and "chunk 2" in msg
        assert f"{tmp_path / 'c'}/{names[c.file]}" in msg
        assert f"[{c.offset}, {c.offset + c.nbytes})" in msg

        collected: list[CheckpointCorruptError] = []
        read_requests(reader, names, plan_load(entries, wanted), options=IOOptions(),
                      budget=ByteBudget(1), describe=describe, collect=collected)
    finally:
        reader.close()
    assert len(collected) == 1 and isinstance(collected[0], ChecksumMismatchError)
    assert "arr/1" in str(collected[0])
    for i in (0, 2, 3, 5):  # the undamaged arrays still load
        np.testing.assert_array_equal(dests[i], arrays[i])


@pytest.mark.timeout(60)
def test_truncated_file_raises_naming_array(tmp_path: Path) -> None:
    arrays = make_arrays()
    _, entries, names = save_arrays(tmp_path / "c", arrays, threads=2, budget=ByteBudget(1))
    last = names[-1]
    size = (tmp_path / "c" / last).stat().st_size
    with open(tmp_path / "c" / last, "r+b") as f:
        f.truncate(size - 10)
    reader = LocalStorage().open_read(str(tmp_path / "c"))
    try:
        with pytest.raises(TruncatedFileError, match=r"truncated \(affects array at key path"):
            read_requests(reader, names, plan_verify(entries), options=IOOptions(),
                          budget=ByteBudget(1), describe=describe)
        collected: list[CheckpointCorruptError] = []
        read_requests(reader, names, plan_verify(entries), options=IOOptions(),
                      budget=ByteBudget(1), describe=describe, collect=collected)
        assert len(collected) == 1 and isinstance(collected[0], TruncatedFileError)
    finally:
        reader.close()


@pytest.mark.timeout(60)
def test_write_failure_propagates_and_releases_budget(tmp_path: Path) -> None:
    arrays = make_arrays()
    good = source_for(arrays)

    def source(it: WriteItem) -> np.ndarray:
        if it.array == 1 and it.chunk == 3:
            raise RuntimeError("provider exploded")
        return good(it)  # type: ignore[no-any-return]

    budget = ByteBudget(1 << 20)
    planner = StreamPlanner(file_prefix="data/r0", max_files=3, max_chunk_bytes=256,
                            block_bytes=256)
    txn = LocalStorage().begin_write(str(tmp_path / "c"), overwrite=False)
    writer = StreamWriter(txn, planner.file_name, source, budget=budget)
    with pytest.raises(RuntimeError, match="provider exploded"):
        for ai, a in enumerate(arrays):
            writer.submit(planner.add(ai, ArraySpec(a.shape, a.itemsize, True)))
        writer.close()
    writer.abort()
    txn.abort()
    assert budget.in_use == 0
    assert list(tmp_path.iterdir()) == []
