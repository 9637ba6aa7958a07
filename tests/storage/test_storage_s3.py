"""S3 storage against a real S3-compatible server (moto, loopback), plus faults."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import statestream as ss
from statestream.format import COMMIT_NAME, MANIFEST_NAME, encode_commit
from statestream.storage import S3Options, S3Storage, set_backend
from statestream.storage._object_config import split_object_url
from statestream.testing.storage import StorageTests


def _options(srv: dict[str, Any], **kw: Any) -> S3Options:
    base = dict(endpoint=srv["endpoint"], region="us-east-1",
                access_key_id=srv["aws_access_key_id"],
                secret_access_key=srv["aws_secret_access_key"])
    base.update(kw)
    return S3Options(**base)


@pytest.fixture
def storage(s3_server: dict[str, Any]) -> Iterator[S3Storage]:
    st = S3Storage(_options(s3_server))
    set_backend("s3", st)
    try:
        yield st
    finally:
        set_backend("s3", None)


@pytest.fixture
def base_url(s3_server: dict[str, Any]) -> str:
    return f"s3://{s3_server['bucket']}/t-{uuid.uuid4().hex[:8]}"


class TestS3Conformance(StorageTests):
    pass


def test_wrong_bucket_is_a_clear_error(storage: S3Storage) -> None:
    with pytest.raises(ss.StorageError, match="does not exist"):
        ss.save("s3://no-such-bucket-here/x", {"a": np.ones(3)})
    with pytest.raises(ss.StorageError, match="does not exist"):
        ss.load("s3://no-such-bucket-here/x")
    # the manager's first write is its lease: the store's NoSuchBucket is in the body of
    # the response, below its first line (it was CheckpointNotFoundError "not found")
    with pytest.raises(ss.StorageError,
                       match="the bucket s3://no-such-bucket-here does not exist") as ei:
        ss.CheckpointManager("s3://no-such-bucket-here/run")
    assert not isinstance(ei.value, ss.CheckpointNotFoundError)


def test_missing_credentials_are_a_clear_error(s3_server: dict[str, Any],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                "AWS_PROFILE", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    st = S3Storage(S3Options(endpoint=s3_server["endpoint"], region="us-east-1"))
    with pytest.raises(ss.StorageError) as ei:
        st.check_bucket(s3_server["bucket"])
    assert "testing-secret" not in str(ei.value)


def test_credentials_never_in_repr_or_errors(s3_server: dict[str, Any]) -> None:
    opts = _options(s3_server)
    assert "testing-secret" not in repr(opts)
    assert "testing-secret" not in repr(S3Storage(opts))


def test_server_stops_mid_save(s3_server: dict[str, Any], storage: S3Storage,
                               base_url: str) -> None:
    good = f"{base_url}/step1"
    ss.save(good, {"w": np.arange(1000.0)})
    srv = s3_server["server"]
    stopped = []

    def progress(done: int, total: int) -> None:
        if not stopped:
            stopped.append(True)
            srv.stop()

    try:
        with pytest.raises(ss.CheckpointError):
            ss.save(f"{base_url}/step2", {"w": np.ones((2000, 1000))}, progress=progress,
                    io=ss.IOOptions(max_chunk_bytes=1 << 20, num_threads=1))
    finally:
        if stopped:
            srv.start()  # same port, same in-process state
    assert not storage.is_committed(f"{base_url}/step2")
    np.testing.assert_array_equal(ss.load(good)["w"], np.arange(1000.0))


def test_manager_on_s3(storage: S3Storage, base_url: str) -> None:
    url = f"{base_url}/run"
    with ss.CheckpointManager(url, save_policy=ss.EveryNSteps(2),
                              keep_policy=ss.KeepLatest(2)) as mgr:
        for step in range(7):
            mgr.save(step, {"w": np.full(4, step, dtype=np.int64)}, metrics={"s": step})
        mgr.wait()
        assert mgr.steps() == [4, 6]
        assert int(mgr.load()["w"][0]) == 6
        assert mgr.step_info(6)["metrics"] == {"s": 6}
        with pytest.raises(ss.ManagerLockedError):
            ss.CheckpointManager(url)
    # the lock is released; uncommitted leftovers are cleaned at start
    txn = storage.begin_write(f"{url}/step_{9:010d}", overwrite=False)
    w = txn.create_file("data/r0-0.bin", 3)
    w.write_at([b"abc"], 0)
    w.finish()
    with ss.CheckpointManager(url) as mgr:
        assert mgr.steps() == [4, 6]
        assert mgr.latest_step() == 6


@pytest.mark.timeout(120)
def test_403_from_a_server_that_checks_credentials() -> None:
    """A second moto server with authentication on answers 403 to unknown keys."""
    import os
    import socket
    import subprocess
    import sys
    import time

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, INITIAL_NO_AUTH_ACTION_COUNT="0")
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    pytest.fail("moto server with authentication did not start")
                time.sleep(0.1)
        st = S3Storage(S3Options(endpoint=f"http://127.0.0.1:{port}", region="us-east-1",
                                 access_key_id="AKIAUNKNOWNKEY", secret_access_key="top-secret"))
        set_backend("s3", st)
        with pytest.raises(ss.StorageError, match="403") as ei:
            ss.save("s3://denied-bucket/p", {"a": np.ones(3)})
        assert "top-secret" not in str(ei.value)
        with pytest.raises(ss.StorageError, match="403"):
            ss.load("s3://denied-bucket/p")
    finally:
        set_backend("s3", None)
        proc.kill()
        proc.wait()


def _root_of(s3_server: dict[str, Any], url: str) -> tuple[str, str]:
    import json

    bucket, _, prefix = url[len("s3://"):].partition("/")
    marker = s3_server["client"].get_object(Bucket=bucket, Key=f"{prefix}/COMMITTED")
    return prefix, json.loads(marker["Body"].read())["root"]


def test_verify_reports_objects_the_manifest_does_not_list(
        s3_server: dict[str, Any], storage: S3Storage, base_url: str) -> None:
    """Issue 10 item 7 on S3: unlisted objects and longer data objects are reported."""
    url = f"{base_url}/ckpt"
    ss.save(url, {"a": np.arange(100.0), "b": {"c": np.ones((4, 4), np.float32)}})
    client, bucket = s3_server["client"], s3_server["bucket"]
    prefix, root = _root_of(s3_server, url)
    # another root under the prefix (an overwritten version being deleted) is gc's business
    client.put_object(Bucket=bucket, Key=f"{prefix}/{'0' * 32}/data/r0-0.bin", Body=b"old")
    rep = ss.verify(url)
    assert rep.ok, rep.problems
    planted = {f"{prefix}/{root}/data/notes.txt": "data/notes.txt",
               f"{prefix}/{root}/extra.bin": "/extra.bin",
               f"{prefix}/outside-root.bin": "/outside-root.bin",
               f"{prefix}/sub/x": "/sub/x"}
    for key in planted:
        client.put_object(Bucket=bucket, Key=key, Body=b"payload")
    rep = ss.verify(url)
    text = "\n".join(rep.problems)
    assert not rep.ok
    for needle in planted.values():
        assert needle in text and "not listed" in text, text
    assert "0" * 32 not in text
    np.testing.assert_array_equal(ss.load(url)["a"], np.arange(100.0))
    for key in planted:
        client.delete_object(Bucket=bucket, Key=key)
    assert ss.verify(url).ok
    # a data object longer than the manifest lists
    (data_key,) = [o["Key"] for o in client.list_objects_v2(
        Bucket=bucket, Prefix=f"{prefix}/{root}/data/")["Contents"]]
    body = client.get_object(Bucket=bucket, Key=data_key)["Body"].read()
    client.put_object(Bucket=bucket, Key=data_key, Body=body + b"\0" * 64)
    rep = ss.verify(url)
    assert not rep.ok and any(data_key.rsplit("/", 1)[-1] in p for p in rep.problems), rep


def test_a_checkpoint_overwritten_while_read_says_so(storage: S3Storage, base_url: str) -> None:
    """Another writer overwrites the checkpoint while it is read: the objects of the
    version being read are deleted. The reader says so (CheckpointGoneError, a
    TruncatedFileError, naming the object, 'overwritten ... load it again'), not 'not
    found' nor 'damaged'; verify raises it rather than report damage."""
    url = f"{base_url}/ckpt"
    state = {"w": np.ones((512, 1024))}
    ss.save(url, state, io=ss.IOOptions(max_chunk_bytes=256 << 10))
    reader = storage.open_read(url)  # has read the marker
    ss.save(url, state, overwrite=True, io=ss.IOOptions(max_chunk_bytes=256 << 10))
    with pytest.raises(ss.CheckpointGoneError, match="manifest.json is gone: .* overwritten"):
        reader.read_bytes("manifest.json", 1 << 20)
    overwritten = []

    def progress(done: int, total: int) -> None:
        if not overwritten:  # the manifest and sizes are read: overwrite the data now
            overwritten.append(True)
            ss.save(url, {"w": np.full(3, 2.0)}, overwrite=True)

    io = ss.IOOptions(num_threads=1, max_request_bytes=256 << 10)
    with pytest.raises(ss.CheckpointGoneError) as ei:
        ss.load(url, progress=progress, io=io)
    text = str(ei.value)
    assert "data/r0-" in text and "is gone" in text and "load it again" in text, text
    np.testing.assert_array_equal(ss.load(url)["w"], np.full(3, 2.0))
    ss.save(url, state, overwrite=True, io=ss.IOOptions(max_chunk_bytes=256 << 10))
    overwritten.clear()
    with pytest.raises(ss.CheckpointGoneError, match="data/r0-.* is gone"):
        ss.verify(url, progress=progress, io=io)  # raised, not reported as damage


def test_save_async_to_s3_never_uploads_the_live_state(storage: S3Storage, base_url: str) -> None:
    # obstore keeps reading a buffer it was given until its part is uploaded: the
    # writer's write_at returns only once the store is done with the caller's bytes
    # (copying what falls short of a whole part), so a snapshot that races the
    # writers may write from the state, and changing the state right after
    # save_async returns changes nothing saved.
    assert not storage.capabilities.retains_buffers
    state = {f"w{i}": np.full((512, 1024), i, np.float32) for i in range(6)}  # 6 x 2 MiB
    h = ss.save_async(f"{base_url}/a", state, io=ss.IOOptions(max_chunk_bytes=1 << 20))
    for v in state.values():
        v.fill(-1)
    h.result()
    got = ss.load(f"{base_url}/a")
    for i in range(6):
        np.testing.assert_array_equal(got[f"w{i}"], np.full((512, 1024), i, np.float32))


@pytest.mark.parametrize("lend", [False, True])
def test_writes_of_any_size_reach_the_object_and_leave_the_buffers_free(
        s3_server: dict[str, Any], base_url: str, lend: bool) -> None:
    """The writer hands obstore whole parts of the caller's bytes and copies the rest
    into its own part buffers: writes of every size, across and within parts, in one
    or many buffers, give the object byte for byte, and each buffer may be overwritten
    as soon as write_at returns. With ``lend``, every other call is a lend_at, whose
    buffers stay as they are until finish() and are uploaded from where they are."""
    part = 5 << 20  # S3's smallest part
    st = S3Storage(_options(s3_server, part_bytes=part, max_concurrency=2))
    rng = np.random.default_rng(7)
    sizes = [1, part - 1, 1, part, 3 * part + 17, 100, 2 * part, part // 2, part // 2 + 1,
             *rng.integers(1, 3 * part, 6).tolist()]
    want = bytearray()
    txn = st.begin_write(base_url, overwrite=False)
    w = txn.create_file("data/r0-0.bin", 0)
    pos = 0
    lent = []
    for i, n in enumerate(sizes):
        data = rng.integers(0, 256, n, dtype=np.uint8)
        bufs = np.array_split(data, 1 + i % 3)  # one, two or three buffers per call
        want += data.tobytes()
        if lend and i % 2:
            w.lend_at(bufs, pos)
            lent.append(data)
        else:
            w.write_at(bufs, pos)
            data[:] = 0  # the caller reuses its buffers at once
        pos += n
    w.write_at([np.frombuffer(b"tail", np.uint8)], pos + 10)  # a gap is zeros
    want += bytes(10) + b"tail"
    w.finish()
    txn.write_bytes(MANIFEST_NAME, b"{}")
    txn.write_bytes(COMMIT_NAME, encode_commit(b"{}"))
    txn.commit()
    r = st.open_read(base_url)
    try:
        got = bytearray(len(want))
        r.read_into("data/r0-0.bin", 0, [got])
    finally:
        r.close()
    assert got == want
    # the writer's own part buffers are kept for the next save, until release_staging()
    assert ss.release_staging() >= part
    assert ss.release_staging() == 0


def test_transfer_options_refuse_a_part_size_below_one(s3_server: dict[str, Any]) -> None:
    with pytest.raises(ss.StorageError, match="part_bytes must be a positive int"):
        _options(s3_server, part_bytes=0)
    with pytest.raises(ss.StorageError, match="max_concurrency must be a positive int"):
        _options(s3_server, max_concurrency=0)


_EXIT_WITHOUT_CLOSE = """
import json, sys
import numpy as np
import statestream as ss
from statestream.storage import S3Options, S3Storage, set_backend
from statestream.storage._object_config import split_object_url
set_backend("s3", S3Storage(S3Options(**json.loads(sys.argv[1]))))
mgr = ss.CheckpointManager(sys.argv[2], lease_ttl_s=600)
mgr.save(1, {"w": np.arange(4)})
print("SAVED", flush=True)
"""  # returns without mgr.close(): the interpreter's exit gives the lease up


def test_a_manager_never_closed_gives_its_lease_up_at_exit(s3_server: dict[str, Any],
                                                           storage: S3Storage,
                                                           base_url: str) -> None:
    import subprocess
    import sys

    opts = dict(endpoint=s3_server["endpoint"], region="us-east-1",
                access_key_id=s3_server["aws_access_key_id"],
                secret_access_key=s3_server["aws_secret_access_key"])
    url = f"{base_url}/run"
    r = subprocess.run([sys.executable, "-c", _EXIT_WITHOUT_CLOSE, json.dumps(opts), url],
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0 and "SAVED" in r.stdout, r.stderr[-3000:]
    with ss.CheckpointManager(url) as mgr:  # at once, not after the 600 s ttl
        assert mgr.steps() == [1]


def test_convert_to_a_statestream_checkpoint_on_s3(storage: S3Storage, base_url: str,
                                                   tmp_path: Any) -> None:
    """convert writes a statestream checkpoint to an object store (its writer's part
    buffers come out of the budget) and reads one back from it."""
    rng = np.random.default_rng(3)
    state = {"w": rng.standard_normal((300, 1000)).astype(np.float32), "step": 7,
             "b": np.arange(10)}
    ss.save(tmp_path / "local", state)
    ss.convert(tmp_path / "local", f"{base_url}/conv",
               memory=ss.MemoryOptions(memory_budget_bytes=64 << 20))
    got = ss.load(f"{base_url}/conv")
    np.testing.assert_array_equal(got["w"], state["w"])
    assert got["step"] == 7 and ss.verify(f"{base_url}/conv").ok
    ss.convert(f"{base_url}/conv", tmp_path / "back.safetensors")
    np.testing.assert_array_equal(ss.load(tmp_path / "back.safetensors")["w"], state["w"])


def test_damage_is_named_by_the_object_that_holds_it(s3_server: dict[str, Any],
                                                     storage: S3Storage, base_url: str) -> None:
    # the messages named s3://bucket/prefix/data/..., a key that does not exist: a
    # checkpoint's files live under the root its commit marker names
    import re

    client, bucket = s3_server["client"], s3_server["bucket"]
    url = f"{base_url}/ck"
    ss.save(url, {"a": np.arange(1000.0)})
    prefix = url.split(f"s3://{bucket}/", 1)[1]
    (key,) = [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"]
              if "/data/" in o["Key"]]
    body = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[10] ^= 1
    client.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    with pytest.raises(ss.ChecksumMismatchError) as ei:
        ss.load(url)
    named = re.search(r"s3://\S+/data/\S+\.bin", str(ei.value))
    assert named is not None and named.group(0) == f"s3://{bucket}/{key}", str(ei.value)
    client.put_object(Bucket=bucket, Key=key, Body=bytes(body[:50]))
    problems = ss.verify(url).problems
    assert any(f"s3://{bucket}/{key} is 50 bytes" in p for p in problems), problems


def _resetting_server_on_a_port_with(digits: str) -> tuple[Any, int]:
    """A listener that resets every connection, on a free port whose number holds
    ``digits``; (socket, port)."""
    import socket
    import struct
    import threading

    for port in range(int(digits) * 100, int(digits) * 100 + 100):
        sock = socket.socket()
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            sock.close()
            continue
        sock.listen(16)

        def reset(s: socket.socket = sock) -> None:
            while True:
                try:
                    client, _ = s.accept()
                except OSError:
                    return
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                client.close()

        threading.Thread(target=reset, daemon=True).start()
        return sock, port
    pytest.skip(f"no free port {digits}00-{digits}99 on loopback")


@pytest.mark.parametrize("key", ["run", "run-403-forbidden", "signature-404"])
def test_a_store_down_on_a_port_holding_403_is_not_access_denied(key: str) -> None:
    """The address, durations and key in a message are not its status: a store that
    resets connections on port 403xx was 'access denied (403)' (EACCES), so a manager
    with a local tier called its directory read-only (a flaky CI failure)."""
    import errno

    sock, port = _resetting_server_on_a_port_with("403")
    try:
        st = S3Storage(S3Options(endpoint=f"http://127.0.0.1:{port}", region="us-east-1",
                                 access_key_id="k", secret_access_key="s",
                                 timeout_s=2, max_retries=0))
        with pytest.raises(ss.StorageError) as ei:
            st.acquire_lease(f"s3://bkt/{key}/.lease", holder="me", ttl_s=30)
        assert ei.value.errno != errno.EACCES, ei.value
        assert not isinstance(ei.value, ss.StoragePermissionError)
        assert "access denied" not in str(ei.value)
        assert "credentials" not in str(ei.value) and "does not exist" not in str(ei.value)
        with pytest.raises(ss.StorageError) as ei:
            st.is_committed(f"s3://bkt/{key}")
        assert not isinstance(ei.value, (ss.StoragePermissionError, ss.CheckpointNotFoundError))
    finally:
        sock.close()


def test_gc_removes_only_what_a_save_writes(storage: S3Storage, base_url: str) -> None:
    """Any object at ``PARENT/<x>/<32 hex>/...`` counted as a leftover root of a
    "checkpoint" ``PARENT/<x>``: gc (and a manager opening on PARENT) deleted a
    committed checkpoint named by a uuid one level down, and other tools' files laid
    out under hex run ids (found by an exploratory run)."""
    import obstore

    from statestream.storage import Leftover, collect_garbage

    bucket, prefix = storage.split_url(base_url)
    store = storage._store(bucket)
    nested = f"{base_url}/exp1/{uuid.uuid4().hex}"
    ss.save(nested, {"w": np.arange(10)})
    mlflow = f"{prefix}/mlflow/{uuid.uuid4().hex}"
    obstore.put(store, f"{mlflow}/artifacts/model.pkl", b"not ours")
    mixed = f"{prefix}/mixed/{uuid.uuid4().hex}"  # shaped like a root, beside a notes file
    obstore.put(store, f"{mixed}/{MANIFEST_NAME}", b"{}")
    obstore.put(store, f"{prefix}/mixed/notes.txt", b"not ours")
    ss.save(f"{base_url}/ck", {"w": np.ones(3)})
    killed = f"{prefix}/ck/{uuid.uuid4().hex}"  # a killed save's root: gc removes it
    obstore.put(store, f"{killed}/data/r0-0.bin", b"\0" * 16)
    obstore.put(store, f"{killed}/{MANIFEST_NAME}", b"{}")

    removed = collect_garbage(storage, base_url, max_age_s=0)
    assert removed == [f"s3://{bucket}/{killed}"], removed
    left = {m["path"] for batch in obstore.list(store, prefix=prefix + "/") for m in batch}
    assert f"{mlflow}/artifacts/model.pkl" in left and f"{prefix}/mixed/notes.txt" in left
    assert f"{mixed}/{MANIFEST_NAME}" in left and not any(k.startswith(killed) for k in left)
    assert ss.load(nested)["w"].sum() == 45 and ss.load(f"{base_url}/ck")["w"].sum() == 3
    with pytest.raises(ss.StorageError, match="which no save writes"):
        storage.remove_leftover(Leftover(f"s3://{bucket}/{mlflow}", "mlflow", None, 0.0))
    assert f"{mlflow}/artifacts/model.pkl" in {
        m["path"] for batch in obstore.list(store, prefix=mlflow) for m in batch}


@pytest.mark.parametrize("segment", ["", ".", ".."])
@pytest.mark.parametrize("where", ["leading", "inner"])
def test_empty_dot_and_dotdot_segments_are_refused(storage: S3Storage, s3_server: dict[str, Any],
                                                   segment: str, where: str) -> None:
    """docs/storage.md, "S3 URLs": a leading empty segment (s3://bucket//t) was taken as
    s3://bucket/t (the prefix's leading '/' was stripped): a save went there."""
    key = f"t-{uuid.uuid4().hex[:8]}"
    url = (f"s3://{s3_server['bucket']}/{segment}/{key}" if where == "leading"
           else f"s3://{s3_server['bucket']}/{key}/{segment}/x")
    with pytest.raises(ss.StorageError, match=r"has an empty, '\.' or '\.\.' path segment"):
        ss.save(url, {"w": np.ones(2)})
    with pytest.raises(ss.StorageError, match="path segment"):
        ss.metadata(url)
    with pytest.raises(ss.CheckpointNotFoundError):
        ss.metadata(f"s3://{s3_server['bucket']}/{key}")  # nothing was written there


@pytest.mark.parametrize("scheme", ["s3", "gs", "az"])
def test_urls_parse_with_one_rule_for_empty_segments(scheme: str) -> None:
    """Only the URL is parsed: trailing '/' are ignored, an empty segment anywhere else
    is refused (a StorageError, as for '.' and '..')."""
    assert split_object_url(f"{scheme}://bucket/a/b/", scheme) == ("bucket", "a/b")
    for rest in ("/a", "a//b", "/"):
        with pytest.raises(ss.StorageError):
            split_object_url(f"{scheme}://bucket/{rest}", scheme)


def test_a_key_that_names_an_error_code_is_no_missing_bucket(
        storage: S3Storage, base_url: str) -> None:
    # the code was looked for anywhere in the message, which names the key: a prefix
    # holding "NoSuchBucket" could never be saved to ("the bucket does not exist")
    url = f"{base_url}/runs/NoSuchBucket-ablation/step1"
    ss.save(url, {"a": np.arange(4)})
    np.testing.assert_array_equal(ss.load(url)["a"], np.arange(4))
    with pytest.raises(ss.CheckpointNotFoundError, match="no committed checkpoint"):
        ss.load(url + "-missing")
    with pytest.raises(ss.StorageError, match="does not exist"):  # a missing bucket still is
        ss.load("s3://statestream-nobucket/runs/NoSuchBucket-ablation/step1")


def test_a_damaged_marker_leaves_the_directory_usable(
        s3_server: dict[str, Any], storage: S3Storage, base_url: str) -> None:
    # an oversized COMMITTED made listing, gc and a manager raise for the whole parent
    # (a local directory lists it as damaged); a deeply nested one made load, metadata
    # and verify raise a bare RecursionError
    client, bucket = s3_server["client"], s3_server["bucket"]
    run = f"{base_url}/run"
    with ss.CheckpointManager(run, async_save=False) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"w": np.full(3, step)})
    for step, body in ((2, b"{" + b" " * 5000 + b"}"), (3, b"[" * 2040 + b"]" * 2040)):
        url = f"{run}/step_{step:010d}"
        prefix = url[len(f"s3://{bucket}/"):]
        client.put_object(Bucket=bucket, Key=f"{prefix}/{COMMIT_NAME}", Body=body)
        assert storage.is_committed(url)
        for call in (ss.load, ss.metadata):
            with pytest.raises(ss.CheckpointCorruptError, match=COMMIT_NAME if step == 2
                               else "not valid JSON"):
                call(url)
        rep = ss.verify(url)
        assert not rep.ok and rep.problems
    from statestream.storage import collect_garbage

    collect_garbage(storage, run, max_age_s=0)
    with pytest.warns(RuntimeWarning, match="cannot read steps 2, 3"), \
            ss.CheckpointManager(run, async_save=False) as mgr:
        assert mgr.steps() == [1, 2, 3]
        np.testing.assert_array_equal(mgr.load(step=1)["w"], np.full(3, 1))


def test_verify_reads_a_large_chunk_in_steps_not_blocks(
        s3_server: dict[str, Any], storage: S3Storage, base_url: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """verify read one ~1 MiB checksum block per request (a 256 MiB array: 256 GETs, 9 s
    against a load's 4): a read spans the blocks of up to one 8 MiB step; a flipped
    byte is still named by its block."""
    import math
    import re

    from statestream.engine._read import _CHECK_STEP
    from statestream.storage._object_read import ObjectReader

    n = 24 << 20
    url = f"{base_url}/big"
    ss.save(url, {"w": np.random.default_rng(0).integers(0, 255, n, dtype=np.uint8)})
    reads: list[int] = []
    plain = ObjectReader.read_into

    def counted(self: ObjectReader, name: str, offset: int, buffers: Any) -> None:
        reads.append(sum(memoryview(b).nbytes for b in buffers))
        plain(self, name, offset, buffers)

    monkeypatch.setattr(ObjectReader, "read_into", counted)
    assert ss.verify(url).ok
    assert len(reads) <= math.ceil(n / _CHECK_STEP) + 2, reads
    client, bucket = s3_server["client"], s3_server["bucket"]
    (key,) = [o["Key"] for o in client.list_objects_v2(
        Bucket=bucket, Prefix=url.split(f"s3://{bucket}/", 1)[1])["Contents"]
        if "/data/" in o["Key"]]
    body = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    at = 13 * (1 << 20) + 5
    body[at] ^= 1
    client.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    (bad,) = [p for p in ss.verify(url).problems if "checksum mismatch" in p]
    lo, hi = map(int, re.findall(r"bytes \[(\d+), (\d+)\)", bad)[0])
    assert lo <= at < hi and hi - lo <= 2 << 20, bad
