"""ss.release_staging() while a save_async is in flight or warming up on its thread.

A release frees what the pools hold idle, and what a save in flight holds once it
gives it back; the warm-up a save runs after its commit (mapping buffers for the
next save) stops. Before 2026-12-06 a save whose ``result()`` had returned went on
warming after the caller released the staging: a whole budget's worth was mapped
again behind the caller's back.
"""

from __future__ import annotations

import os
import threading

import numpy as np

import statestream as ss
from statestream import _hooks
from statestream.engine import StagingPool, host_pool


def _state() -> dict[str, np.ndarray]:
    return {f"w{i}": np.full((256, 1024), i, np.float32) for i in range(4)}


def test_a_save_in_flight_when_a_release_came_keeps_no_buffer() -> None:
    p = StagingPool(capacity=1 << 20)
    since = p.epoch  # a save begins
    lent = p.take(1000)
    p.give(p.take(2000), since=since)
    assert p.release() == 2000
    p.give(lent, since=since)  # lent out when the release came
    p.give(p.take(3000), since=since)  # lent after it, by the same save
    assert p.idle_bytes == 0 and p.lent_bytes == 0
    p.give(p.take(1000), since=p.epoch)  # a save begun after it keeps as before
    assert p.idle_bytes == 1000


def test_a_warm_up_begun_before_a_release_stops() -> None:
    p = StagingPool(capacity=1 << 20)
    since = p.epoch
    p.release()
    assert p.warm([1000, 2000], since=since) == 0
    assert p.idle_bytes == 0
    # one begun after it maps as before
    assert p.warm([1000, 2000], since=p.epoch) == 3000
    assert p.idle_bytes == 3000
    p.release()


def test_release_after_result_is_not_undone_by_the_warm_up(
        tmp_path: os.PathLike[str]) -> None:
    ss.release_staging()
    pool = host_pool()
    released = threading.Event()
    # the save's thread reaches its warm-up only once the caller has released
    _hooks.register("async.warming", lambda: released.wait(30) and None)
    try:
        h = ss.save_async(os.path.join(tmp_path, "a"), _state())
        h.result()
        ss.release_staging()
        released.set()
        assert h._settled.wait(30)
        assert pool.idle_bytes == 0 and pool.lent_bytes == 0
    finally:
        released.set()
        _hooks.clear()
        ss.release_staging()


def test_release_while_the_save_copies_frees_its_buffers_once_written(
        tmp_path: os.PathLike[str]) -> None:
    ss.release_staging()
    pool = host_pool()
    io = ss.IOOptions(max_chunk_bytes=1 << 20)
    path = os.path.join(tmp_path, "b")
    ss.save_async(os.path.join(tmp_path, "a"), _state(), io=io).result()  # staging warm
    calls = [0]

    def copying() -> None:  # the second save's first chunk copy: release meanwhile
        calls[0] += 1
        if calls[0] == 1:
            ss.release_staging()

    _hooks.register("async.snapshot_chunk", copying)
    try:
        h = ss.save_async(path, _state(), io=io)
        h.result()
        assert h._settled.wait(30)
        assert calls[0] >= 1
        assert pool.idle_bytes == 0 and pool.lent_bytes == 0
    finally:
        _hooks.clear()
        ss.release_staging()
    got = ss.load(path)
    for k, v in _state().items():
        np.testing.assert_array_equal(got[k], v)
