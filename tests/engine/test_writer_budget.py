"""An object store writer's own part buffers are charged to the save's memory budget:
the writers are as many as IOOptions asks while their buffers take at most half of it
(at least one), staging gets the rest, and the buffers kept between saves stay within
that share. (The integrated peak-RSS check is tests/storage/test_object_write_memory.py.)"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from statestream.engine import IOOptions, MemoryOptions
from statestream.engine._copy import _threads_and_piece
from statestream.engine._core import writers_share
from statestream.storage import LocalStorage, S3Options, S3Storage, release_part_buffers
from statestream.storage import _object_write as ow

MiB = 1 << 20


def _writers_and_capacity(storage: Any, io: IOOptions, memory: MemoryOptions) -> tuple[int, int]:
    """What a save job asks of writers_share (engine/_job.py)."""
    return writers_share(memory.resolved(), io.write_threads(),
                         storage.capabilities.writer_buffer_bytes)


def _s3(part: int) -> S3Storage:
    # never contacted: only its declared capabilities are read
    return S3Storage(S3Options(endpoint="http://127.0.0.1:9", region="us-east-1",
                               access_key_id="x", secret_access_key="y", part_bytes=part))


@pytest.mark.parametrize(("budget", "want"), [
    (32 * MiB, (1, 1)),                      # one writer's two parts take all of it
    (128 * MiB, (2, 64 * MiB)),
    (256 * MiB, (4, 128 * MiB)),
    (4096 * MiB, (4, 3968 * MiB)),           # the default budget keeps every thread
])
def test_object_store_writers_take_at_most_half_the_budget(budget: int,
                                                           want: tuple[int, int]) -> None:
    st = _s3(16 * MiB)
    assert st.capabilities.writer_buffer_bytes == 32 * MiB
    got = _writers_and_capacity(st, IOOptions(num_threads=4),
                                MemoryOptions(memory_budget_bytes=budget))
    assert got == want
    assert _s3(5 * MiB).capabilities.writer_buffer_bytes == 10 * MiB


def test_local_writers_are_not_charged() -> None:
    got = _writers_and_capacity(LocalStorage(), IOOptions(num_threads=4),
                                MemoryOptions(memory_budget_bytes=32 * MiB))
    assert got == (4, 32 * MiB) and LocalStorage().capabilities.writer_buffer_bytes == 0


def test_a_copy_to_a_store_shares_the_budget_the_same_way() -> None:
    assert _threads_and_piece(None, 4, 32 * MiB) == (4, 16 * MiB)
    assert _threads_and_piece(64 * MiB, 4, 0) == (4, 16 * MiB)
    assert _threads_and_piece(64 * MiB, 4, 32 * MiB) == (1, 16 * MiB)  # 32 MiB left, 16 max
    assert _threads_and_piece(32 * MiB, 4, 32 * MiB) == (1, 1 * MiB)  # the least piece
    assert _threads_and_piece(256 * MiB, 4, 32 * MiB) == (4, 16 * MiB)


def test_part_buffers_kept_between_saves_stay_within_their_share() -> None:
    release_part_buffers()
    try:
        ow.keep_part_buffers(32 * MiB)
        bufs = [ow._take_part(16 * MiB) for _ in range(3)]
        for b in bufs:
            ow._give_part(b)
        assert release_part_buffers() == 32 * MiB  # the third was dropped
        for b in bufs[:2]:
            ow._give_part(b)
        ow.keep_part_buffers(16 * MiB)  # a later save with a smaller share trims them
        assert release_part_buffers() == 16 * MiB
        assert isinstance(ow._take_part(MiB), np.ndarray)
    finally:
        ow.keep_part_buffers(8 * 16 * MiB)
        release_part_buffers()
