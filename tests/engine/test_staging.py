"""The staging pool: exact-size reuse, its memory ceiling, and its use by save_async."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

import statestream as ss
from statestream.engine import MemoryOptions, StagingPool, host_pool


def test_exact_size_reuse_and_counts() -> None:
    p = StagingPool(capacity=1 << 20)
    a = p.take(1000)
    b = p.take(2000)
    assert (a.nbytes, b.nbytes, a.dtype) == (1000, 2000, np.uint8)
    assert p.lent_bytes == 3000 and p.idle_bytes == 0
    p.give(a)
    p.give(b)
    assert p.idle_bytes == 3000 and p.lent_bytes == 0
    assert p.take(2000) is b
    assert p.take(1000) is a
    c = p.take(1500)  # no buffer of that size: a new one
    assert c is not a and c is not b
    assert (p.allocations, p.reuses) == (3, 2)


def test_take_many_reuses_idle_buffers_and_gives_back_on_failure() -> None:
    p = StagingPool(capacity=1 << 20)
    a, b = p.take(1000), p.take(3000)
    p.give(a)
    p.give(b)
    got = p.take_many([1000, 500, 3000])
    assert got[0] is a and got[2] is b and got[1].nbytes == 500
    assert p.lent_bytes == 4500 and p.idle_bytes == 0
    for buf in got:
        p.give(buf)

    calls = [0]

    def fails(n: int) -> np.ndarray:
        calls[0] += 1
        raise MemoryError("no memory for the second buffer")

    q = StagingPool(capacity=1 << 20, allocate=fails)
    q.give(np.empty(100, np.uint8))
    q.give(np.empty(300, np.uint8))
    with pytest.raises(MemoryError):
        q.take_many([100, 200, 300])  # the idle 100 and 300 go back
    assert calls[0] == 1
    assert q.lent_bytes == 0 and q.idle_bytes == 400


def test_never_holds_more_than_capacity() -> None:
    p = StagingPool(capacity=10_000)
    bufs = [p.take(3000) for _ in range(3)]
    for b in bufs:
        p.give(b)
    assert p.idle_bytes == 9000
    # A new size evicts the oldest idle buffers until idle + lent + new fits.
    d = p.take(4000)
    assert p.idle_bytes + p.lent_bytes <= 10_000
    assert p.idle_bytes == 6000
    assert p.take(3000) is bufs[2] or p.idle_bytes == 3000
    p.give(d)
    assert p.idle_bytes + p.lent_bytes <= 10_000


def test_oversized_buffer_is_not_kept_and_keep_false_drops() -> None:
    p = StagingPool(capacity=1000)
    big = p.take(5000)  # allowed (a single chunk may exceed the budget) ...
    p.give(big)
    assert p.idle_bytes == 0  # ... but never retained
    small = p.take(100)
    p.give(small, keep=False)
    assert p.idle_bytes == 0 and p.lent_bytes == 0


def test_shrinking_capacity_and_release() -> None:
    p = StagingPool(capacity=1 << 20)
    for b in [p.take(1000) for _ in range(4)]:
        p.give(b)
    p.set_capacity(2500)
    assert p.idle_bytes == 2000
    assert p.release() == 2000
    assert p.idle_bytes == 0


def test_thread_safe_under_contention() -> None:
    p = StagingPool(capacity=64 * 1024)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(500):
                n = int(rng.choice([512, 1024, 4096]))
                b = p.take(n)
                b[:] = seed  # a buffer is never lent to two takers at once
                assert (b == seed).all()
                p.give(b)
        except BaseException as exc:
            errors.append(exc)

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors
    assert p.lent_bytes == 0
    assert p.idle_bytes <= 64 * 1024


def _state(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "a": rng.standard_normal((512, 256)).astype(np.float32),
        "b": rng.integers(0, 1 << 30, size=(3, 1000), dtype=np.int64),
        "c": rng.standard_normal(7),
    }


def test_second_save_reuses_every_buffer_and_data_stays_right(tmp_path: os.PathLike[str]) -> None:
    ss.release_staging()
    pool = host_pool()
    s1 = _state(1)
    h1 = ss.save_async(os.path.join(tmp_path, "one"), s1)
    h1.result()
    h1._settled.wait()  # the pool is warmed after the commit
    allocated = pool.allocations
    assert pool.idle_bytes == sum(v.nbytes for v in s1.values())
    s2 = _state(2)  # same shapes, other values: copied into the same buffers
    h = ss.save_async(os.path.join(tmp_path, "two"), s2)
    for v in s2.values():  # mutate right after the blocking phase
        v += 1
    h.result()
    assert pool.allocations == allocated
    got1 = ss.load(os.path.join(tmp_path, "one"))
    got2 = ss.load(os.path.join(tmp_path, "two"))
    for k, v in s1.items():
        np.testing.assert_array_equal(got1[k], v)
    for k, v in _state(2).items():
        np.testing.assert_array_equal(got2[k], v)
    assert ss.verify(os.path.join(tmp_path, "two")).ok


@pytest.mark.parametrize("lazy", [False, True])
def test_state_larger_than_the_budget_stages_at_most_the_budget(
        tmp_path: os.PathLike[str], lazy: bool) -> None:
    # The snapshot races the writers: copies (from the last chunk backwards) stop
    # when the budget is full, and the writers read the rest from the state.
    ss.release_staging()
    pool = host_pool()
    pool.peak_lent_bytes = 0
    allocations0, reuses0 = pool.allocations, pool.reuses  # counters are per process
    state = {f"w{i}": np.full((256, 1024), i, np.float32) for i in range(8)}  # 8 x 1 MiB
    mem = MemoryOptions(memory_budget_bytes=3 << 20)
    io = ss.IOOptions(max_chunk_bytes=1 << 20)
    h = ss.save_async(os.path.join(tmp_path, "s"), state, lazy=lazy, memory=mem, io=io)
    h.wait_snapshot()
    for v in state.values():  # the snapshot is complete: changes are not saved
        v += 100
    h.result()
    allocations, reuses = pool.allocations - allocations0, pool.reuses - reuses0
    assert allocations + reuses <= 3  # at most a budget's worth was copied
    assert pool.peak_lent_bytes <= 3 << 20
    assert pool.idle_bytes <= 3 << 20 and pool.lent_bytes == 0
    got = ss.load(os.path.join(tmp_path, "s"))
    for i in range(8):
        np.testing.assert_array_equal(got[f"w{i}"], np.full((256, 1024), i, np.float32))


def test_keep_staging_false_and_release_staging(tmp_path: os.PathLike[str]) -> None:
    ss.release_staging()
    pool = host_pool()
    state = _state(3)
    ss.save_async(os.path.join(tmp_path, "a"), state,
                  memory=MemoryOptions(keep_staging=False)).result()
    assert pool.idle_bytes == 0 and pool.lent_bytes == 0
    h = ss.save_async(os.path.join(tmp_path, "b"), state)
    h.result()
    # Warmed after the commit: whether the race's copies were kept depends on how
    # fast the writers went (on a loaded machine a writer once read every chunk
    # from the state before a copy thread began, and nothing was idle yet).
    assert h._settled.wait(60)
    kept = pool.idle_bytes
    assert kept > 0
    assert ss.release_staging() == kept
    assert pool.idle_bytes == 0


def test_failed_save_returns_no_buffer_and_leaks_no_accounting(
        tmp_path: os.PathLike[str]) -> None:
    ss.release_staging()
    pool = host_pool()
    os.makedirs(os.path.join(tmp_path, "exists"))
    with pytest.raises(ss.CheckpointExistsError):
        ss.save_async(os.path.join(tmp_path, "exists"), _state(4))
    assert pool.lent_bytes == 0


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_lower_thread_priority_changes_only_the_calling_thread() -> None:
    from statestream.engine import lower_thread_priority

    before = _nice()
    seen: list[int] = []

    def run() -> None:
        lower_thread_priority(5)
        seen.append(_nice())

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert seen == [min(19, before + 5)]
    assert _nice() == before


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_background_writers_run_at_raised_niceness(tmp_path: os.PathLike[str],
                                                   lazy: bool) -> None:
    main = _nice()
    if main >= 19:
        pytest.skip("this process already runs at the lowest priority")
    seen: list[int] = []
    state = {f"w{i}": np.ones(1 << 18) for i in range(4)}
    warm = ss.save_async(os.path.join(tmp_path, "w"), state, lazy=lazy)
    warm.result()
    warm._settled.wait()  # staging is warm: an eager snapshot copies it all first
    h = ss.save_async(os.path.join(tmp_path, "c"), state, lazy=lazy,
                      progress=lambda done, total: seen.append(_nice()),
                      io=ss.IOOptions(background_nice=7))
    h.result()
    if lazy:  # writes racing the lazy snapshot (a step may wait for them) do not yield
        assert seen and set(seen) <= {main, min(19, main + 7)}, (main, seen)
    else:
        assert seen and all(n == min(19, main + 7) for n in seen), (main, seen)
    seen.clear()
    h = ss.save_async(os.path.join(tmp_path, "d"), state, lazy=lazy,
                      progress=lambda done, total: seen.append(_nice()),
                      io=ss.IOOptions(background_nice=0))
    h.result()
    assert seen and all(n == main for n in seen)
    assert _nice() == main


@pytest.mark.parametrize("budget", [None, 5 << 20])
def test_cold_snapshot_is_torn_free_when_the_state_changes_right_after(
        tmp_path: os.PathLike[str], budget: int | None) -> None:
    # A first save in a process races its writers (they write part of the state
    # straight from it): whatever save_async returns after must hold the values
    # of the call, however the state changes afterwards.
    ss.release_staging()
    pool = host_pool()
    pool.peak_lent_bytes = 0
    state = {f"w{i}": np.full((256, 1024), i, np.float32) for i in range(16)}  # 16 x 1 MiB
    mem = MemoryOptions(memory_budget_bytes=budget)
    h = ss.save_async(os.path.join(tmp_path, "s"), state, memory=mem,
                      io=ss.IOOptions(max_chunk_bytes=1 << 20))
    for v in state.values():
        v *= -1
        v -= 7
    h.result()
    assert pool.peak_lent_bytes <= mem.resolved()
    got = ss.load(os.path.join(tmp_path, "s"))
    for i in range(16):
        np.testing.assert_array_equal(got[f"w{i}"], np.full((256, 1024), i, np.float32))
    h._settled.wait()
    # After the commit the pool holds mapped buffers for the next save (within budget).
    assert 0 < pool.idle_bytes <= mem.resolved() and pool.lent_bytes == 0


def test_first_save_copies_into_fresh_staging_and_the_pool_keeps_every_buffer(
        tmp_path: os.PathLike[str]) -> None:
    # A cold snapshot races the writers: copy threads take fresh host buffers
    # (statestream._memory: no huge-page advice, faster than the writes), the
    # writers write the rest from the state. After the commit the pool holds one
    # buffer per chunk -- those the race used and the warm-up's -- and the next
    # save allocates none.
    from statestream import _hooks

    ss.release_staging()
    pool = host_pool()
    a0 = pool.allocations
    release = threading.Event()
    _hooks.register("save.planned", lambda: release.wait(30))  # hold the background phase
    _hooks.register("save.chunk_written", lambda: time.sleep(0.2))  # slow writers
    try:
        state = {f"w{i}": np.full((2048, 1024), i, np.float32) for i in range(6)}
        h = ss.save_async(os.path.join(tmp_path, "s"), state,
                          io=ss.IOOptions(max_chunk_bytes=8 << 20, num_threads=2))
        # the copy threads, from the last chunk, copied what the writers had not
        # reached (a writer takes up to 16 MiB at once) into fresh buffers, each once
        assert a0 + 1 <= pool.allocations <= a0 + 6
        for v in state.values():
            v += 100  # after the blocking phase: the checkpoint keeps the old values
        release.set()
        h.result()
        h._settled.wait()
    finally:
        release.set()
        _hooks.clear()
    assert pool.allocations == a0 + 6 and pool.lent_bytes == 0
    assert pool.idle_bytes == sum(v.nbytes for v in state.values())
    assert pool.can_serve([8 << 20] * 6)
    got = ss.load(os.path.join(tmp_path, "s"))
    for i in range(6):
        np.testing.assert_array_equal(got[f"w{i}"], np.full((2048, 1024), i, np.float32))
    h2 = ss.save_async(os.path.join(tmp_path, "t"), state,
                       io=ss.IOOptions(max_chunk_bytes=8 << 20))
    h2.result()
    assert pool.allocations == a0 + 6  # every buffer reused
    got = ss.load(os.path.join(tmp_path, "t"))
    for i in range(6):
        np.testing.assert_array_equal(got[f"w{i}"], state[f"w{i}"])


def test_the_next_save_stops_the_warm_up_instead_of_waiting_for_it(
        tmp_path: os.PathLike[str]) -> None:
    # After a commit the save's thread maps staging buffers for the next save. A next
    # save that comes first does not wait for all of them: the warm-up stops, the new
    # save uses what is mapped and races the writers for the rest (data unchanged).
    from statestream import _hooks

    ss.release_staging()
    pool = host_pool()
    slow = pool._allocate
    warming = threading.Event()
    allocated: list[int] = []

    warmer: list[int] = []  # the thread that warms up

    def allocate(n: int) -> np.ndarray:
        if warmer and threading.get_ident() == warmer[0]:
            allocated.append(n)
            time.sleep(0.2)  # a slow fault-in
            return slow(n)
        if not warming.is_set():
            # the first save's copy threads get no fresh buffer (they leave the
            # chunk to the writers), so its warm-up has all 8 buffers to map
            raise MemoryError
        return slow(n)  # the second save's copy threads

    def warm_begins() -> None:
        warmer.append(threading.get_ident())
        warming.set()

    pool._allocate = allocate
    _hooks.register("async.warming", warm_begins)
    try:
        state = {f"w{i}": np.full((256, 1024), i, np.float32) for i in range(8)}
        io = ss.IOOptions(max_chunk_bytes=1 << 20)
        h = ss.save_async(os.path.join(tmp_path, "s"), state, io=io)
        h.result()
        assert warming.wait(30)
        h2 = ss.save_async(os.path.join(tmp_path, "t"), state, io=io)
        assert h._settled.is_set()
        first = len(allocated)  # the first save's warm-up is over
        h2.result()
        h2._settled.wait()
    finally:
        pool._allocate = slow
        _hooks.clear()
        ss.release_staging()
    assert 1 <= first <= 2  # it stopped after the buffer it was mapping (of 8)
    got = ss.load(os.path.join(tmp_path, "t"))
    for i in range(8):
        np.testing.assert_array_equal(got[f"w{i}"], state[f"w{i}"])


def test_take_within_allocates_only_what_the_capacity_holds() -> None:
    from statestream.engine._staging import StagingPool

    pool = StagingPool(capacity=10 << 20)
    a = pool.take_within(8 << 20)
    assert a is not None and pool.lent_bytes == 8 << 20
    assert pool.take_within(4 << 20) is None  # 12 MiB would be lent
    assert pool.lent_bytes == 8 << 20 and pool.allocations == 1
    pool.give(a)
    assert pool.take_within(8 << 20) is a  # idle, reused
    pool.give(a)
    b = pool.take_within(4 << 20)  # the idle 8 MiB buffer makes room
    assert b is not None and pool.idle_bytes == 0 and pool.lent_bytes == 4 << 20
    assert pool.take_within(11 << 20) is None  # never more than the capacity


def test_take_some_takes_idle_then_fresh_within_the_capacity_under_one_lock() -> None:
    pool = StagingPool(capacity=10_000)
    idle = pool.take(1000)
    pool.give(idle)
    got = pool.take_some([1000, 3000, 4000, 5000], fresh=True)
    assert got[0] is idle  # idle first
    assert got[1] is not None and got[2] is not None and got[3] is None  # 13,000 > cap
    assert pool.lent_bytes == 8000 and pool.allocations == 3
    for b in got[:3]:
        assert b is not None
        pool.give(b)
    only_idle = pool.take_some([4000, 4000, 1000], fresh=False)
    assert only_idle[0] is not None and only_idle[1] is None and only_idle[2] is not None
    assert pool.allocations == 3 and pool.lent_bytes == 5000


def test_take_some_counts_no_failed_allocation_and_gives_back_when_interrupted() -> None:
    calls: list[int] = []

    def alloc(n: int) -> np.ndarray:
        calls.append(n)
        if n == 2000:
            raise MemoryError
        if n == 3000:
            raise KeyboardInterrupt
        return np.empty(n, np.uint8)

    pool = StagingPool(capacity=1 << 20, allocate=alloc)
    got = pool.take_some([1000, 2000, 1500], fresh=True)
    assert got[0] is not None and got[1] is None and got[2] is None  # the rest untried
    assert calls == [1000, 2000] and pool.lent_bytes == 1000
    pool.give(got[0])
    with pytest.raises(KeyboardInterrupt):
        pool.take_some([1000, 500, 3000, 700], fresh=True)
    assert pool.lent_bytes == 0  # the idle 1000 and the fresh 500 came back
    assert pool.idle_bytes == 1500


def test_reserve_frees_idle_buffers_and_waits_for_lent_ones_only_while_told() -> None:
    # a load's scratch reserved beside the staging: idle buffers make room (oldest
    # first), lent ones are waited for (a save in flight) or, told not to, gone past
    pool = StagingPool(capacity=10 << 20)
    old, new = pool.take(4 << 20), pool.take(4 << 20)
    pool.give(old)
    pool.give(new)
    pool.reserve(4 << 20, 10 << 20, lambda: True)
    assert pool.reserved_bytes == 4 << 20 and pool.idle_bytes == 4 << 20
    assert pool.take_idle(4 << 20) is new  # the least recently used one went
    assert pool.take_within(4 << 20) is None  # reserved bytes count against the save
    assert not pool.try_reserve(4 << 20, 10 << 20)  # 4 lent + 4 reserved + 4
    got = threading.Event()
    t = threading.Thread(target=lambda: (pool.reserve(4 << 20, 10 << 20, lambda: True),
                                         got.set()))
    t.start()
    deadline = time.monotonic() + 60
    while not pool.waiting and time.monotonic() < deadline:
        time.sleep(0.001)
    assert pool.waiting == 1 and not got.is_set()
    pool.give(new)  # a staged copy written: room for it
    t.join(60)
    assert got.is_set() and pool.reserved_bytes == 8 << 20
    pool.unreserve(8 << 20)
    pool.take(8 << 20)
    pool.reserve(4 << 20, 10 << 20, lambda: False)  # no save in flight: goes past
    assert pool.reserved_bytes == 4 << 20 and pool.lent_bytes == 8 << 20
