"""The order in which a racing snapshot's copy threads take chunks."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

import statestream as ss
from statestream import _hooks
from statestream.engine._snapshot import copy_order
from statestream.plan import ArraySpec, StreamPlanner

MiB = 1 << 20


def _llama_items() -> list:
    # A Llama-like state's parameters (hidden 1024, 16 layers, vocab 32000: 1.01 GiB
    # of fp32) laid out as a save lays them out: 4 files, chunks up to 64 MiB.
    shapes = [(32000, 1024)]
    for _ in range(16):
        shapes += [(1024,), (1024, 1024), (1024, 1024), (1024, 1024), (1024, 1024),
                   (1024,), (2816, 1024), (2816, 1024), (1024, 2816)]
    shapes += [(1024,), (32000, 1024)]
    sp = StreamPlanner(file_prefix="data/r0", max_files=4, max_chunk_bytes=64 * MiB)
    return [sp.add(i, ArraySpec(s, 4)) for i, s in enumerate(shapes)]


def _left_per_file(items: list, order: list, budget: int) -> list[int]:
    # The race: copy threads take chunks in ``order`` until one does not fit the
    # budget; each file's writer writes the rest from the state while the call blocks.
    copied, used = set(), 0
    for it in order:
        if used + it.nbytes > budget:
            break
        used += it.nbytes
        copied.add((it.array, it.chunk))
    left = [0] * 4
    for its in items:
        for it in its:
            if (it.array, it.chunk) not in copied:
                left[it.file] += it.nbytes
    return left


@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.75])
def test_copies_leave_every_writer_about_the_same_bytes(fraction: float) -> None:
    items = _llama_items()
    total = sum(it.nbytes for its in items for it in its)
    order = copy_order(items)
    assert sorted((it.array, it.chunk) for it in order) == sorted(
        (it.array, it.chunk) for its in items for it in its)  # every chunk once
    left = _left_per_file(items, order, int(fraction * total))
    # Balanced to within one of the small chunks (taking the last chunk first left
    # the writer behind the embedding's 64 MiB chunks 53-67 MiB more than the others).
    assert max(left) - min(left) <= 16 * MiB, [n // MiB for n in left]
    backwards = [it for its in reversed(items) for it in reversed(its)]
    old = _left_per_file(items, backwards, int(fraction * total))
    assert max(left) < max(old)  # the blocking phase ends with the slowest writer


def test_each_file_is_taken_from_the_back() -> None:
    # Within a file the copies go from its last chunk towards its first, so they meet
    # its writer, which goes from the first chunk on.
    items = _llama_items()
    seen: dict[int, list[int]] = {}
    for it in copy_order(items):
        seen.setdefault(it.file, []).append(it.offset)
    for offsets in seen.values():
        assert offsets == sorted(offsets, reverse=True)


def test_a_writer_done_with_its_share_leaves_the_disk_to_the_others(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Two data files of four 8 MiB chunks; the budget stages the back half of each.
    # Writer 1 is done with its two chunks from the state once the copy threads
    # staged its other two; writer 0 is slow on its own (0.8 s more). Writer 1's
    # staged copies can wait: until the snapshot is complete (save_async returns) it
    # writes nothing more, so the disk is writer 0's alone. (Before, it went straight
    # on to its staged copies: all four chunks before the return.) Writer 1 waits for
    # the copies rather than for a fixed time: on a loaded machine they once took
    # longer than the 0.3 s it waited, and it wrote a third chunk from the state.
    from statestream.engine import _ledger

    real_copy = _ledger.StagingLedger.race_copy
    staged_1 = threading.Semaphore(0)

    def race_copy(self, item, charged, check) -> bool:  # type: ignore[no-untyped-def]
        kept = real_copy(self, item, charged, check)
        if kept and item.file == 1:
            staged_1.release()
        return kept

    monkeypatch.setattr(_ledger.StagingLedger, "race_copy", race_copy)
    ss.release_staging()
    state = {f"a{i}": np.full((2048, 1024), i, np.float32) for i in range(8)}  # 8 x 8 MiB
    batches: list[tuple[str, float]] = []  # one chunk each here (handed over one by one)
    one_went_on = threading.Event()

    def hold_one() -> None:
        for _ in range(2):
            assert staged_1.acquire(timeout=60)
        one_went_on.set()

    def hold_zero() -> None:
        assert one_went_on.wait(60)
        time.sleep(0.8)

    first = {"statestream-write-0": hold_zero, "statestream-write-1": hold_one}

    def written() -> None:
        name = threading.current_thread().name
        batches.append((name, time.perf_counter()))
        first.pop(name, lambda: None)()  # before the batch's chunks count as written

    _hooks.register("save.chunk_written", written)
    try:
        h = ss.save_async(os.path.join(tmp_path, "s"), state,
                          memory=ss.MemoryOptions(memory_budget_bytes=32 * MiB),
                          io=ss.IOOptions(max_chunk_bytes=8 * MiB, num_threads=2))
        returned = time.perf_counter()
        for v in state.values():
            v += 100  # after the snapshot: not saved
        h.result()
    finally:
        _hooks.clear()
    ones = [t for n, t in batches if n == "statestream-write-1"]
    assert len(ones) == 4, batches
    assert sum(t < returned for t in ones) == 2, batches  # its chunks from the state only
    got = ss.load(os.path.join(tmp_path, "s"))
    for i in range(8):
        np.testing.assert_array_equal(got[f"a{i}"], np.full((2048, 1024), i, np.float32))


def test_a_writer_holding_its_copies_stops_when_the_snapshot_fails(tmp_path) -> None:
    # Writer 1 holds its staged copies, waiting for the snapshot; a copy thread then
    # fails. The save fails at once, the waiting writer stops, nothing is committed.
    ss.release_staging()
    state = {f"a{i}": np.full((2048, 1024), i, np.float32) for i in range(8)}
    first = {"statestream-write-0": 3.0, "statestream-write-1": 0.1}
    events = []

    def copy_event() -> None:
        events.append(1)
        if len(events) == 8:  # the copy threads' last chunk: after writer 1 waits
            time.sleep(0.5)
            raise RuntimeError("a copy failed")

    _hooks.register("save.chunk_written",
                    lambda: time.sleep(first.pop(threading.current_thread().name, 0.0)))
    _hooks.register("async.snapshot_chunk", copy_event)
    path = os.path.join(tmp_path, "s")
    t0 = time.perf_counter()
    try:
        with pytest.raises(Exception, match="a copy failed"):
            h = ss.save_async(path, state, memory=ss.MemoryOptions(memory_budget_bytes=32 * MiB),
                              io=ss.IOOptions(max_chunk_bytes=8 * MiB, num_threads=2))
            h.result()
    finally:
        _hooks.clear()
    assert time.perf_counter() - t0 < 10
    assert not os.path.exists(path)
    assert not any(t.name.startswith("statestream-write") for t in threading.enumerate())
