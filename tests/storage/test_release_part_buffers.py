"""ss.release_staging() (release_part_buffers) while a save to an object store is in
flight: the part buffers its writers hold are dropped when they give them back, not
kept for the next save. Before 2026-12-06 a release while a save_async to S3 was
writing was undone: the writers' part buffers went back into the pool as they finished.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import statestream as ss
from statestream import _hooks
from statestream.storage import S3Options, S3Storage, release_part_buffers, set_backend
from statestream.storage import _object_write as ow

MiB = 1 << 20


def test_a_save_in_flight_when_a_release_came_keeps_no_part_buffer() -> None:
    release_part_buffers()
    since = ow.parts_epoch()  # a save begins
    lent = ow._take_part(MiB)
    ow._give_part(ow._take_part(2 * MiB), since)
    assert release_part_buffers() == 2 * MiB
    ow._give_part(lent, since)  # held by a writer when the release came
    ow._give_part(ow._take_part(3 * MiB), since)  # taken after it, by the same save
    assert release_part_buffers() == 0
    ow._give_part(ow._take_part(MiB), ow.parts_epoch())  # a save begun after it keeps
    assert release_part_buffers() == MiB


@pytest.fixture
def s3(s3_server: dict[str, Any]) -> Iterator[str]:
    st = S3Storage(S3Options(endpoint=s3_server["endpoint"], region="us-east-1",
                             access_key_id=s3_server["aws_access_key_id"],
                             secret_access_key=s3_server["aws_secret_access_key"],
                             part_bytes=5 * MiB))
    set_backend("s3", st)
    try:
        yield f"s3://{s3_server['bucket']}/parts-{uuid.uuid4().hex[:8]}"
    finally:
        set_backend("s3", None)
        _hooks.clear()
        ss.release_staging()


def _state() -> dict[str, np.ndarray]:
    # small arrays: their bytes pass through the writer's own part buffers
    return {f"w{i}": np.full(300_000, i, np.float32) for i in range(8)}


def test_release_while_a_save_async_writes_to_s3_is_not_undone(s3: str) -> None:
    h = ss.save_async(s3 + "-a", _state())
    h.result()
    assert h._settled.wait(30)
    assert release_part_buffers() > 0  # an undisturbed save keeps its part buffers
    calls = [0]

    def written() -> None:  # the second save's first chunk written: release meanwhile
        calls[0] += 1
        if calls[0] == 1:
            ss.release_staging()

    _hooks.register("save.chunk_written", written)
    h = ss.save_async(s3 + "-b", _state())
    h.result()
    assert h._settled.wait(30)
    assert calls[0] >= 1
    assert release_part_buffers() == 0
    got = ss.load(s3 + "-b")
    for k, v in _state().items():
        np.testing.assert_array_equal(got[k], v)
