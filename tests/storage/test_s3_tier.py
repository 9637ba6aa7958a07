"""A local tier in front of S3 (moto server on loopback): commit locally, persist to S3."""

from __future__ import annotations

import glob
import os
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import statestream as ss
from statestream import _hooks
from statestream.storage import S3Options, S3Storage, set_backend
from statestream.storage._s3 import split_url

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _emulators import OutageProxy  # noqa: E402


@pytest.fixture
def url(s3_server: dict[str, Any]) -> Iterator[str]:
    set_backend("s3", S3Storage(S3Options(
        endpoint=s3_server["endpoint"], region="us-east-1",
        access_key_id=s3_server["aws_access_key_id"],
        secret_access_key=s3_server["aws_secret_access_key"], part_bytes=5 << 20)))
    try:
        yield f"s3://{s3_server['bucket']}/tier-{uuid.uuid4().hex[:8]}"
    finally:
        set_backend("s3", None)


def _behind_proxy(s3_server: dict[str, Any], prefix: str = "down",
                  **options: Any) -> tuple[OutageProxy, str]:
    """S3 behind an :class:`OutageProxy` (short timeouts unless ``options`` say
    otherwise) as the s3:// backend; the URL of a fresh prefix."""
    proxy = OutageProxy(int(s3_server["endpoint"].rsplit(":", 1)[1]))
    set_backend("s3", S3Storage(S3Options(
        endpoint=f"http://127.0.0.1:{proxy.port}", region="us-east-1",
        access_key_id=s3_server["aws_access_key_id"],
        secret_access_key=s3_server["aws_secret_access_key"],
        **(options or {"timeout_s": 5, "max_retries": 1, "retry_timeout_s": 3}))))
    return proxy, f"s3://{s3_server['bucket']}/{prefix}-{uuid.uuid4().hex[:8]}"


def _state(step: int) -> dict[str, Any]:
    return {"w": np.arange(3_000_000, dtype=np.float32) + step,  # 12 MB: multipart uploads
            "b": np.full(100, step, dtype=np.int64), "step": step}


def _check(got: dict[str, Any], step: int) -> None:
    want = _state(step)
    np.testing.assert_array_equal(got["w"], want["w"])
    np.testing.assert_array_equal(got["b"], want["b"])
    assert got["step"] == step


@pytest.mark.timeout(180)
@pytest.mark.parametrize("async_save", [False, True])
def test_local_tier_in_front_of_s3(tmp_path, url, async_save):
    local = str(tmp_path / "local")
    io = ss.IOOptions(max_chunk_bytes=4 << 20)
    with ss.CheckpointManager(url, local_tier=local, async_save=async_save, io=io,
                              local_keep_policy=ss.KeepLatest(1),
                              keep_policy=ss.KeepLatest(2)) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _state(step))
        mgr.wait()
        assert mgr.persisted_steps() == [2, 3]
        assert mgr.steps() == [2, 3]
        _check(mgr.load(), 3)
        _check(mgr.load(2), 2)  # from S3
    for s in (2, 3):
        _check(ss.load(f"{url}/step_{s:010d}"), s)
        assert ss.verify(f"{url}/step_{s:010d}").ok
    # a damaged local copy: the persisted one is read, with a warning
    name = sorted(glob.glob(os.path.join(local, "step_0000000003", "data", "*.bin")))[0]
    with open(name, "r+b") as f:
        f.seek(10)
        f.write(b"\xff\xff\xff\xff")
    with ss.CheckpointManager(url, local_tier=local) as mgr:
        with pytest.warns(RuntimeWarning, match="damaged"):
            _check(mgr.load(), 3)
    # a new machine: nothing local, everything from S3
    with ss.CheckpointManager(url, local_tier=str(tmp_path / "fresh")) as mgr:
        assert mgr.steps() == [2, 3]
        _check(mgr.load(), 3)


def _frozen(step: int) -> dict[str, Any]:
    """'w' (12 MB) never changes: incremental steps after the first refer to it."""
    return {"w": np.arange(3_000_000, dtype=np.float32),
            "b": np.full(100, step, dtype=np.int64), "step": step}


@pytest.mark.timeout(180)
def test_incremental_steps_through_a_local_tier_to_s3(tmp_path, url):
    local = str(tmp_path / "local")
    io = ss.IOOptions(max_chunk_bytes=4 << 20)
    with ss.CheckpointManager(url, local_tier=local, incremental=True, io=io,
                              local_keep_policy=ss.KeepLatest(1),
                              keep_policy=ss.KeepLatest(1)) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _frozen(step))
        mgr.wait()
        assert mgr.steps() == [3] and mgr.persisted_steps() == [3]
    # on S3: step 3 refers to step 1 (retired, kept) for 'w'; step 2 is gone
    meta = ss.metadata(f"{url}/step_0000000003")
    assert list(meta.bases) == ["step_0000000001"]
    assert ss.verify(f"{url}/step_0000000003").ok
    with pytest.raises(ss.CheckpointNotFoundError):
        ss.metadata(f"{url}/step_0000000002")
    # a new machine: step 3 loads from S3 through its reference, and is copied into the
    # local tier with step 1 meanwhile, so the next save refers to them again
    with ss.CheckpointManager(url, local_tier=str(tmp_path / "fresh"), incremental=True,
                              io=io, keep_policy=ss.KeepLatest(1)) as mgr:
        got = mgr.load()
        np.testing.assert_array_equal(got["w"], _frozen(3)["w"])
        assert got["step"] == 3
        mgr.wait()
        mgr.save(4, _frozen(4))
        mgr.wait()
        assert mgr.persisted_steps() == [4]
    assert list(ss.metadata(f"{url}/step_0000000004").bases) == ["step_0000000001"]
    got = ss.load(f"{url}/step_0000000004")
    np.testing.assert_array_equal(got["b"], _frozen(4)["b"])
    np.testing.assert_array_equal(got["w"], _frozen(4)["w"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("async_save", [False, True])
def test_an_s3_outage_costs_no_step_and_catches_up_without_a_restart(
        tmp_path, s3_server, async_save):
    """S3 (moto behind a proxy that refuses connections) goes down after step 1:
    steps 2 to 4 still commit locally (no save raises or touches the store: the
    keep policy of the directory is applied after persistences), wait() raises;
    once S3 is back, step 5's persistence persists step 4 too (step 3, which the
    keep policy would delete at once, is not uploaded), in the same manager."""
    proxy, url = _behind_proxy(s3_server, "outage")
    caught_up = threading.Event()
    _hooks.register("tier.caught_up", caught_up.set)
    try:
        mgr = ss.CheckpointManager(url, local_tier=str(tmp_path / "local"),
                                   async_save=async_save, keep_policy=ss.KeepLatest(2),
                                   local_keep_policy=ss.KeepLatest(1))
        mgr.save(1, _small(1))
        mgr.wait()
        proxy.down.set()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for step in (2, 3, 4):
                assert mgr.save(step, _small(step))
            with pytest.raises(ss.StorageError):
                mgr.wait()
        # the keep policy of the directory waits for a persistence that goes through
        assert not any("could not list" in str(w.message) for w in seen)
        # every step committed locally; step 2 counts as persisted: KeepLatest(2) would
        # delete it from the directory as soon as it was there
        assert mgr.unpersisted_steps() == [3, 4]
        # listing and loading still work from the local tier while the store is down
        with pytest.warns(RuntimeWarning, match="could not list the steps of"):
            assert mgr.latest_step() == 4
        with pytest.warns(RuntimeWarning, match="could not list the steps of"):
            _check_small(mgr.load(), 4)
        proxy.down.clear()  # S3 is back
        caught_up.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            assert mgr.save(5, _small(5))
        assert caught_up.wait(120)  # step 5, then the steps the outage left behind
        assert mgr.unpersisted_steps() == []
        assert mgr.persisted_steps() == [4, 5]  # the keep policy applied again
        for s in (4, 5):
            assert ss.verify(f"{url}/step_{s:010d}").ok
        mgr.close()
        with ss.CheckpointManager(url) as after:
            assert after.steps() == [4, 5]
            _check_small(after.load(), 5)
    finally:
        _hooks.clear()
        set_backend("s3", None)
        proxy.close()


@pytest.mark.timeout(180)
def test_a_manager_opens_while_the_store_is_down_and_persists_once_it_is_back(
        tmp_path, s3_server):
    """A job that starts during an outage trains on: the manager opens without the
    lease (warning), saves commit to the local tier, and the first persistence once
    the store is back takes the lease and uploads every step."""
    proxy, url = _behind_proxy(s3_server)
    try:
        proxy.down.set()
        with pytest.warns(RuntimeWarning, match="cannot be reached.*opens without its lease"):
            mgr = ss.CheckpointManager(url, local_tier=str(tmp_path / "local"),
                                       async_save=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the outage, at each step
            for step in (1, 2):
                assert mgr.save(step, _small(step))
            with pytest.raises(ss.StorageError):
                mgr.wait()
        assert mgr.unpersisted_steps() == [1, 2]
        proxy.down.clear()  # the store is back
        mgr.wait()  # takes the lease, then persists both steps
        assert mgr.unpersisted_steps() == []
        assert mgr.persisted_steps() == [1, 2]
        with pytest.raises(ss.ManagerLockedError):  # this manager holds the lease now
            ss.CheckpointManager(url)
        mgr.close()
        with ss.CheckpointManager(url) as after:
            assert after.steps() == [1, 2]
            _check_small(after.load(), 2)
    finally:
        set_backend("s3", None)
        proxy.close()


@pytest.mark.timeout(180)
def test_a_manager_opened_during_an_outage_yields_to_the_lease_holder(tmp_path, s3_server):
    """Another manager took the directory while this one waited for the store: this
    one persists nothing there, and its next save raises ManagerLockedError; its
    steps stay in its local tier."""
    proxy, url = _behind_proxy(s3_server)
    try:
        proxy.down.set()
        with pytest.warns(RuntimeWarning, match="cannot be reached"):
            late = ss.CheckpointManager(url, local_tier=str(tmp_path / "local"),
                                        async_save=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            assert late.save(1, _small(1))
            with pytest.raises(ss.StorageError):
                late.wait()  # its persistence failed: nothing retries until the next call
        proxy.down.clear()
        holder = ss.CheckpointManager(url, async_save=False)  # got there first
        holder.save(7, _small(7))
        with pytest.raises(ss.ManagerLockedError):
            late.wait()  # the lease is taken before anything is persisted
        with pytest.raises(ss.ManagerLockedError, match="managed by another"):
            late.save(2, _small(2))
        assert late.unpersisted_steps() == [1]
        assert holder.steps() == [7]
        holder.close()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            with pytest.raises(ss.ManagerLockedError):
                late.close()  # its last try to persist step 1 is refused too
        with ss.CheckpointManager(url) as after:
            assert after.steps() == [7]
    finally:
        set_backend("s3", None)
        proxy.close()


def _take_over(s3_server: dict[str, Any], url: str) -> S3Storage:
    """Another holder's lease in ``url`` (as a takeover after expiry writes it), put
    straight to the store; that store client."""
    direct = S3Storage(S3Options(
        endpoint=s3_server["endpoint"], region="us-east-1",
        access_key_id=s3_server["aws_access_key_id"],
        secret_access_key=s3_server["aws_secret_access_key"]))
    bucket, key = split_url(f"{url}/.statestream.lock")
    direct._put(bucket, key, b'{"holder": "pid 1 on elsewhere", "ttl_s": 60}')
    return direct


@pytest.mark.parametrize("tier", [False, True], ids=["directory", "local tier"])
def test_a_lease_the_store_did_not_renew_for_a_ttl_writes_and_deletes_nothing(
        tmp_path, s3_server, tier):
    """The lease counted as lost only once a renewal reached the store and was refused:
    a manager whose renewals failed (its lease requests dropped) for longer than its
    ttl saved, persisted and deleted steps after another manager could have taken the
    directory over (its KeepLatest(1) deleted step 1 of a directory it no longer held)."""
    proxy, url = _behind_proxy(s3_server, "stale")
    kw: dict[str, Any] = {"local_tier": str(tmp_path / "local")} if tier else {}
    mgr = ss.CheckpointManager(url, lease_ttl_s=2, async_save=False,
                               keep_policy=ss.KeepLatest(1), **kw)
    try:
        mgr.save(1, _small(1))
        mgr.wait()
        proxy.refuse = b".statestream.lock"
        time.sleep(3)  # no renewal goes through for longer than the ttl (2 s)
        direct = _take_over(s3_server, url)
        step = [f"{url}/step_{s:010d}" for s in (0, 1, 2)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            if tier:  # the step commits locally; its persistence renews first, and fails
                assert mgr.save(2, _small(2))
                with pytest.raises(ss.StorageError, match="could not renew its lease"):
                    mgr.wait()
            else:
                with pytest.raises(ss.StorageError, match="could not renew its lease for"):
                    mgr.save(2, _small(2))
            assert direct.is_committed(step[1]) and not direct.is_committed(step[2])
            proxy.refuse = None  # the renewal now reaches the store: taken over
            if tier:  # a local save does not wait for the store; persisting finds it out
                with pytest.raises(ss.ManagerLockedError, match="lost its lease"):
                    mgr.wait()
            with pytest.raises(ss.ManagerLockedError, match="lost its lease"):
                mgr.save(3, _small(3))
            assert direct.is_committed(step[1]) and not direct.is_committed(step[2])
            assert mgr.unpersisted_steps() == ([2] if tier else [])
    finally:
        with pytest.raises(ss.ManagerLockedError):
            mgr.close()
        set_backend("s3", None)
        proxy.close()


def _small(step: int) -> dict[str, Any]:
    return {"w": np.arange(100_000, dtype=np.float32) + step, "step": step}


def _check_small(got: dict[str, Any], step: int) -> None:
    np.testing.assert_array_equal(got["w"], _small(step)["w"])
    assert got["step"] == step


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["sync", "async", "lazy"])
def test_save_does_no_store_round_trip_on_the_training_thread(tmp_path, s3_server, mode):
    """The store hangs (moto behind a proxy that accepts connections and never
    answers; the client waits 10 minutes per request): save() with a local tier
    commits locally and returns, the keep policy of the directory included (it is
    applied in the background, after a persistence); only persistence waits."""
    proxy, url = _behind_proxy(s3_server, "stall", timeout_s=600)
    done = threading.Event()
    try:
        mgr = ss.CheckpointManager(url, local_tier=str(tmp_path / "local"),
                                   async_save=mode != "sync", lazy=mode == "lazy",
                                   keep_policy=ss.KeepLatest(2),
                                   local_keep_policy=ss.KeepLatest(1))
        for step in (1, 2, 3):
            mgr.save(step, _small(step))
        mgr.wait()
        assert mgr.persisted_steps() == [2, 3]
        proxy.stall.set()

        def train() -> None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                for step in (4, 5, 6):
                    mgr.save(step, _small(step))
            done.set()

        trainer = threading.Thread(target=train)
        trainer.start()
        try:
            # no bound on a save: any store request it made would hang 10 minutes
            assert done.wait(300), "save() waited on the hung store"
        finally:
            proxy.stall.clear()
            trainer.join()
        mgr.wait()  # the store is back: everything is persisted, the keep policy applied
        assert mgr.persisted_steps() == [5, 6]
        assert mgr.unpersisted_steps() == []
        mgr.close()
        with ss.CheckpointManager(url) as after:
            _check_small(after.load(), 6)
    finally:
        set_backend("s3", None)
        proxy.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("async_save", [False, True])
def test_after_an_outage_only_the_steps_the_keep_policy_keeps_are_uploaded(
        tmp_path, s3_server, async_save):
    """S3 is down for steps 2 to 12 with KeepLatest(2) + KeepBest(1, "loss") on the
    directory: the local tier keeps only what that policy would keep (step 2, the
    best, and the two newest; the others count as persisted, with a warning, and
    leave by the local keep policy), so its disk stays bounded; once S3 is back,
    only those are uploaded, besides the new step."""
    proxy, url = _behind_proxy(s3_server, "bounded")
    local = tmp_path / "local"
    uploads: list[int] = []
    _hooks.register("tier.persist", lambda: uploads.append(1))
    try:
        mgr = ss.CheckpointManager(
            url, local_tier=str(local), async_save=async_save,
            keep_policy=ss.KeepUnion(ss.KeepLatest(2), ss.KeepBest(1, "loss")),
            local_keep_policy=ss.KeepLatest(1))
        mgr.save(1, _small(1), metrics={"loss": 0.5})
        mgr.wait()
        proxy.down.set()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for step in range(2, 13):
                assert mgr.save(step, _small(step), metrics={"loss": 0.1 if step == 2 else 0.9})
                # the unpersisted steps it keeps, one being copied, the new one
                assert len(glob.glob(str(local / "step_??????????"))) <= 5
            with pytest.raises(ss.StorageError):
                mgr.wait()
        assert mgr.unpersisted_steps() == [2, 11, 12]
        assert any("are not persisted" in str(w.message) and "keep policy" in str(w.message)
                   for w in seen)
        proxy.down.clear()  # S3 is back
        uploads.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            assert mgr.save(13, _small(13), metrics={"loss": 0.9})
            mgr.wait()
        assert len(uploads) == 3  # 13, then 2 and 12 (11 is outdated by 13)
        assert mgr.unpersisted_steps() == []
        assert mgr.persisted_steps() == [2, 12, 13]
        mgr.close()
        with ss.CheckpointManager(url) as after:
            assert after.steps() == [2, 12, 13]
            _check_small(after.load(2), 2)
            _check_small(after.load(), 13)
    finally:
        _hooks.clear()
        set_backend("s3", None)
        proxy.close()
