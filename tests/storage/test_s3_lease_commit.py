"""A manager on S3 (moto server on loopback) whose lease lapses while a save is in
flight commits nothing: the lease is confirmed again as the save commits."""

from __future__ import annotations

import time
import uuid
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import statestream as ss
from statestream import _hooks
from statestream.errors import StorageError
from statestream.manager._lease import LeaseNotRenewedError
from statestream.storage import S3Options, S3Storage, set_backend
from statestream.storage._object_lease import LEASE_SLACK_S

TTL_S = 2.0


@pytest.fixture
def url(s3_server: dict[str, Any]) -> Iterator[str]:
    set_backend("s3", S3Storage(S3Options(
        endpoint=s3_server["endpoint"], region="us-east-1",
        access_key_id=s3_server["aws_access_key_id"],
        secret_access_key=s3_server["aws_secret_access_key"])))
    try:
        yield f"s3://{s3_server['bucket']}/lc-{uuid.uuid4().hex[:8]}"
    finally:
        _hooks.clear()
        set_backend("s3", None)


def _keys(s3_server: dict[str, Any], url: str, under: str) -> list[str]:
    prefix = f"{url.split('/', 3)[3]}/{under}"
    got = s3_server["client"].list_objects_v2(Bucket=s3_server["bucket"], Prefix=prefix)
    return sorted(o["Key"] for o in got.get("Contents", []))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("async_save,renewals", [
    (False, "dropped"), (True, "dropped"), (False, "refused")])
def test_a_save_whose_lease_lapsed_meanwhile_commits_nothing(
        s3_server: dict[str, Any], url: str, monkeypatch: pytest.MonkeyPatch,
        async_save: bool, renewals: str) -> None:
    """A's lease requests are dropped (or its process paused) while it saves step 2;
    past the ttl B takes the directory over and removes A's staged step as a
    leftover. Until 2026-12-08 A wrote its commit marker all the same: B listed
    step 2, whose manifest was gone (its latest step did not load). ``refused``: A's
    renewals reach the store again once B holds the lease, and are refused."""
    a = ss.CheckpointManager(url, lease_ttl_s=TTL_S, async_save=async_save)
    taken: list[ss.CheckpointManager] = []

    def paused_past_the_ttl() -> None:
        _hooks.clear()
        hold = a._hold.lease
        assert hold is not None and hold._lease is not None
        renew = hold._lease.renew
        monkeypatch.setattr(hold._lease, "renew", _dropped)
        time.sleep(TTL_S + LEASE_SLACK_S + 1.5)  # the store's clock counts whole seconds
        taken.append(ss.CheckpointManager(url, lease_ttl_s=60))  # takes over, cleans up
        assert _keys(s3_server, url, "step_0000000002") == []
        if renewals == "refused":
            monkeypatch.setattr(hold._lease, "renew", renew)

    try:
        a.save(1, {"w": np.arange(3)})
        a.wait()
        _hooks.register("commit.marker_written", paused_past_the_ttl)
        want = LeaseNotRenewedError if renewals == "dropped" else ss.ManagerLockedError
        with pytest.raises(want):
            a.save(2, {"w": np.arange(5)})
            a.wait()
    finally:
        _hooks.clear()
        with pytest.raises(ss.StorageError):  # the lease is not A's any more
            a.close()
    (b,) = taken
    with b:
        assert _keys(s3_server, url, "step_0000000002") == []
        assert b.steps() == [1]
        assert b.load()["w"].tolist() == [0, 1, 2]
        b.save(2, {"w": np.arange(2)})
        b.wait()
        assert b.load(2)["w"].tolist() == [0, 1]


def test_a_save_under_a_lease_renewed_recently_makes_no_lease_request(
        url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check as a save commits costs no store request while a renewal confirmed
    the lease within half its ttl (renewals run every third)."""
    with ss.CheckpointManager(url, lease_ttl_s=600, async_save=False) as mgr:
        hold = mgr._hold.lease
        assert hold is not None and hold._lease is not None
        calls: list[float] = []
        renew = hold._lease.renew
        monkeypatch.setattr(hold._lease, "renew", lambda: (calls.append(1), renew())[1])
        for step in range(3):
            mgr.save(step, {"w": np.arange(3) + step})
        assert calls == []
        # half the ttl without a renewal (as if they failed): the commit renews first
        hold._confirmed_at -= 301
        mgr.save(3, {"w": np.arange(3)})
        assert calls == [1]
        assert mgr.steps() == [0, 1, 2, 3]


@pytest.mark.timeout(120)
def test_a_persistence_whose_lease_lapsed_meanwhile_commits_nothing(
        tmp_path: Any, s3_server: dict[str, Any], url: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The same for a local tier's copy of a step to the directory: the lease is
    confirmed again as the copy commits (until 2026-12-08 only before it began)."""
    from statestream.engine import _copy

    a = ss.CheckpointManager(url, lease_ttl_s=TTL_S, async_save=False,
                             local_tier=str(tmp_path / "local"))
    taken: list[ss.CheckpointManager] = []
    copy_file = _copy._copy_file

    def paused_past_the_ttl(*args: Any) -> None:
        if not taken:
            hold = a._hold.lease
            assert hold is not None and hold._lease is not None
            monkeypatch.setattr(hold._lease, "renew", _dropped)
            time.sleep(TTL_S + LEASE_SLACK_S + 1.5)
            taken.append(ss.CheckpointManager(url, lease_ttl_s=60))
        copy_file(*args)

    try:
        a.save(1, {"w": np.arange(3)})
        a.wait()
        assert a.persisted_steps() == [1]
        monkeypatch.setattr(_copy, "_copy_file", paused_past_the_ttl)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            assert a.save(2, {"w": np.arange(5)})  # committed locally
            with pytest.raises(LeaseNotRenewedError):
                a.wait()
        assert a.unpersisted_steps() == [2]
    finally:
        with pytest.raises(ss.StorageError):
            a.close()
    (b,) = taken
    with b:
        assert _keys(s3_server, url, "step_0000000002") == []
        assert b.steps() == [1]
        assert b.load()["w"].tolist() == [0, 1, 2]


def _dropped() -> None:
    raise StorageError("the lease request was dropped (simulated)")
