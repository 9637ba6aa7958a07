"""A save that fails while its data objects are going up as multipart uploads aborts
them: an unfinished upload is never visible (no listing shows it, gc cannot find it), but
the store keeps its parts, and bills them, until it is completed or aborted. Against
moto's S3 server, which lists unfinished uploads as S3 does."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import statestream as ss
from statestream.storage import S3Options, S3Storage, set_backend


@pytest.fixture
def storage(s3_server: dict[str, Any]) -> Iterator[S3Storage]:
    st = S3Storage(S3Options(endpoint=s3_server["endpoint"], region="us-east-1",
                             access_key_id=s3_server["aws_access_key_id"],
                             secret_access_key=s3_server["aws_secret_access_key"],
                             part_bytes=5 << 20))
    set_backend("s3", st)
    try:
        yield st
    finally:
        set_backend("s3", None)


class _Stop(Exception):
    pass


@pytest.mark.parametrize("how", ["sync", "async", "lazy"])
def test_a_failed_save_leaves_no_unfinished_multipart_upload(
        s3_server: dict[str, Any], storage: S3Storage, how: str) -> None:
    """The writers' abort dropped obstore's writer unclosed, which leaves the upload open:
    every failed save of a data object larger than a part left its parts on the store."""
    prefix = f"mpu-{uuid.uuid4().hex[:8]}"
    url = f"s3://{s3_server['bucket']}/{prefix}/ck"

    def progress(done: int, total: int) -> None:
        if done > 12 << 20:  # two parts are up, the third is filling
            raise _Stop("stopped by the test")

    state = {"w": np.ones((2048, 1024))}  # 16 MiB: one data object, four parts
    io = ss.IOOptions(max_chunk_bytes=256 << 10, num_threads=1)
    with pytest.raises(_Stop):
        if how == "sync":
            ss.save(url, state, progress=progress, io=io)
        else:
            ss.save_async(url, state, lazy=how == "lazy", progress=progress,
                          io=io).result(timeout=60)
    uploads = s3_server["client"].list_multipart_uploads(Bucket=s3_server["bucket"],
                                                         Prefix=prefix)
    assert [u["Key"] for u in uploads.get("Uploads", [])] == []
    assert not storage.is_committed(url)
    ss.save(url, state)  # and the path takes a save as before
    assert ss.load(url)["w"].shape == (2048, 1024)
