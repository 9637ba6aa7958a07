"""Incremental saves on object storage (a real S3-compatible server, moto, loopback)."""

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
                             secret_access_key=s3_server["aws_secret_access_key"]))
    set_backend("s3", st)
    try:
        yield st
    finally:
        set_backend("s3", None)


@pytest.fixture
def base_url(s3_server: dict[str, Any]) -> str:
    return f"s3://{s3_server['bucket']}/t-{uuid.uuid4().hex[:8]}"


def _state(step: int) -> dict[str, Any]:
    return {"frozen": np.arange(200_000, dtype=np.float32).reshape(400, 500),
            "lora": np.full((8, 100), float(step), np.float32), "step": step}


def _stored_bytes(s3_server: dict[str, Any], url: str) -> int:
    """Bytes of the data objects under a checkpoint's URL (whatever the store's layout)."""
    bucket, _, prefix = url[len("s3://"):].partition("/")
    client = s3_server["client"]
    total = 0
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket,
                                                                  Prefix=prefix + "/"):
        for o in page.get("Contents", []):
            if "/data/" in o["Key"]:
                total += int(o["Size"])
    return total


def test_incremental_save_and_load_on_s3(storage: S3Storage, base_url: str,
                                         s3_server: dict[str, Any]) -> None:
    ss.save(f"{base_url}/s1", _state(1), hashes=True)
    ss.save(f"{base_url}/s2", _state(2), base=f"{base_url}/s1")
    lora = _state(2)["lora"].nbytes
    assert _stored_bytes(s3_server, f"{base_url}/s2") == lora
    assert ss.metadata(f"{base_url}/s2").bases == ["s1"]
    out = ss.load(f"{base_url}/s2")
    np.testing.assert_array_equal(out["frozen"], _state(2)["frozen"])
    np.testing.assert_array_equal(out["lora"], _state(2)["lora"])
    assert ss.verify(f"{base_url}/s2").ok
    with pytest.raises(ss.CheckpointError, match="not a sibling"):
        ss.save(f"{base_url}/other/s3", _state(3), base=f"{base_url}/s1")
    with pytest.raises(ss.CheckpointError, match=r"s1 is the base of .*checkpoint\(s\) s2 "):
        ss.save(f"{base_url}/s1", _state(3), overwrite=True)
    np.testing.assert_array_equal(ss.load(f"{base_url}/s2")["frozen"], _state(2)["frozen"])
    storage.delete(f"{base_url}/s1")
    with pytest.raises(ss.CheckpointError, match="base checkpoint s1"):
        ss.load(f"{base_url}/s2")


def test_incremental_manager_on_s3(storage: S3Storage, base_url: str) -> None:
    url = f"{base_url}/run"
    with ss.CheckpointManager(url, incremental=True, keep_policy=ss.KeepLatest(1)) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _state(step))
        mgr.wait()
        assert mgr.steps() == [3]
    names = sorted(storage.list(url))
    assert "step_0000000001" in names and "step_0000000002" not in names  # 1 holds 'frozen'
    with ss.CheckpointManager(url, incremental=True, keep_policy=ss.KeepLatest(1)) as mgr:
        assert mgr.steps() == [3]
        out = mgr.load()
        np.testing.assert_array_equal(out["frozen"], _state(3)["frozen"])
        assert out["step"] == 3


def test_damage_in_a_base_names_the_object_that_holds_it(storage: S3Storage, base_url: str,
                                                        s3_server: dict[str, Any]) -> None:
    """A checksum mismatch in a chunk that s2 refers to names s1's data object, under the
    root its commit marker names; it named 's2/../s1/data/r0-0.bin', a key without the
    root, with a '..' that no object store resolves: no such object exists."""
    ss.save(f"{base_url}/s1", _state(1), hashes=True)
    ss.save(f"{base_url}/s2", _state(2), base=f"{base_url}/s1")
    bucket, _, prefix = f"{base_url}/s1".removeprefix("s3://").partition("/")
    client = s3_server["client"]
    (key,) = [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix=prefix + "/")
              ["Contents"] if "/data/" in o["Key"]]
    raw = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    raw[100] ^= 0xFF
    client.put_object(Bucket=bucket, Key=key, Body=bytes(raw))
    real = f"s3://{bucket}/{key}"
    with pytest.raises(ss.ChecksumMismatchError) as err:
        ss.load(f"{base_url}/s2")
    assert real in str(err.value) and ".." not in str(err.value), err.value
    (problem,) = ss.verify(f"{base_url}/s2").problems
    assert real in problem and ".." not in problem, problem


def test_overwrite_and_base_directly_under_the_bucket(storage: S3Storage,
                                                      s3_server: dict[str, Any]) -> None:
    """overwrite=True of s3://bucket/name failed "'s3://bucket' must look like
    s3://bucket/prefix": looking for incremental siblings listed the bucket itself."""
    name = f"root-{uuid.uuid4().hex[:8]}"
    s1, s2 = f"s3://{s3_server['bucket']}/{name}", f"s3://{s3_server['bucket']}/{name}-inc"
    ss.save(s1, _state(0), hashes=True)
    ss.save(s1, _state(1), hashes=True, overwrite=True)
    ss.save_async(s1, _state(1), hashes=True, overwrite=True).result()
    ss.save(s2, _state(2), base=s1)
    assert {name, f"{name}-inc"} <= set(storage.list(f"s3://{s3_server['bucket']}"))
    with pytest.raises(ss.CheckpointError, match=rf"{name} is the base of .*\(s\) {name}-inc "):
        ss.save(s1, _state(3), overwrite=True)
    np.testing.assert_array_equal(ss.load(s2)["frozen"], _state(2)["frozen"])
    storage.delete(s2)
    storage.delete(s1)
