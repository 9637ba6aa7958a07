"""Credentials that may read and write objects but not list them: a save to a new path
needs no listing; what does list (verify, an overwrite's check for incremental siblings)
says that the listing was refused, of which prefix, and which permission it needs.

S3: moto's server in its own process with IAM enforced (INITIAL_NO_AUTH_ACTION_COUNT;
process-wide, so not the session's in-process server) and a user whose policy lacks
s3:ListBucket. Azure: Azurite with an account SAS without 'l'.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import statestream as ss
from statestream.storage import AzureOptions, AzureStorage, S3Options, S3Storage, set_backend

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _emulators import _free_port, _wait_for_port, azurite_account_sas  # noqa: E402

#: what a user may do to the bucket's objects: everything but listing them
_OBJECT_ACTIONS = ["s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"]


@pytest.fixture(scope="module")
def s3_no_list(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A moto server enforcing IAM; credentials of an admin and of a user without list."""
    boto3 = pytest.importorskip("boto3")
    pytest.importorskip("moto.server")
    pytest.importorskip("obstore")
    port = _free_port()
    log = open(tmp_path_factory.mktemp("moto-iam") / "moto.log", "w+")  # noqa: SIM115
    # the first requests (creating the bucket, the user and its key) are let through
    env = dict(os.environ, INITIAL_NO_AUTH_ACTION_COUNT="4")
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                             str(port)], env=env, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)
    try:
        _wait_for_port(proc, port, log, "moto (IAM enforced)")
        endpoint = f"http://127.0.0.1:{port}"
        kw = dict(endpoint_url=endpoint, region_name="us-east-1",
                  aws_access_key_id="AKIAIOSFODNN7EXAMPLE", aws_secret_access_key="admin")
        boto3.client("s3", **kw).create_bucket(Bucket="no-list")
        iam = boto3.client("iam", **kw)
        iam.create_user(UserName="writer")
        iam.put_user_policy(UserName="writer", PolicyName="objects-only", PolicyDocument=(
            json.dumps({"Version": "2012-10-17", "Statement": [{
                "Effect": "Allow", "Action": _OBJECT_ACTIONS,
                "Resource": ["arn:aws:s3:::no-list", "arn:aws:s3:::no-list/*"]}]})))
        key = iam.create_access_key(UserName="writer")["AccessKey"]
        yield {"endpoint": endpoint, "bucket": "no-list", "access_key_id": key["AccessKeyId"],
               "secret_access_key": key["SecretAccessKey"]}
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()


@pytest.fixture
def s3_writer(s3_no_list: dict[str, Any]) -> Iterator[S3Storage]:
    st = S3Storage(S3Options(endpoint=s3_no_list["endpoint"], region="us-east-1",
                             access_key_id=s3_no_list["access_key_id"],
                             secret_access_key=s3_no_list["secret_access_key"], max_retries=0))
    set_backend("s3", st)
    try:
        yield st
    finally:
        set_backend("s3", None)


def test_s3_a_save_needs_no_list_permission(s3_no_list: dict[str, Any],
                                            s3_writer: S3Storage) -> None:
    """The save listed the bucket first (a probe for a missing bucket) and failed with
    "accessing s3://no-list: access denied (403)", which did not say it was a listing."""
    url = f"s3://{s3_no_list['bucket']}/t-{uuid.uuid4().hex[:8]}/a"
    ss.save(url, {"w": np.arange(5)})
    np.testing.assert_array_equal(ss.load(url)["w"], np.arange(5))
    assert s3_writer.is_committed(url)
    with pytest.raises(ss.CheckpointExistsError):
        ss.save(url, {"w": np.arange(6)})


def test_s3_a_refused_listing_names_itself_its_prefix_and_the_permission(
        s3_no_list: dict[str, Any], s3_writer: S3Storage) -> None:
    base = f"s3://{s3_no_list['bucket']}/t-{uuid.uuid4().hex[:8]}"
    ss.save(f"{base}/a", {"w": np.arange(5)})
    with pytest.raises(ss.StoragePermissionError) as ei:
        ss.verify(f"{base}/a")
    msg = str(ei.value)
    assert f"listing the objects under {base}/a/ was refused (403)" in msg, msg
    assert "verify" in msg and "s3:ListBucket" in msg, msg
    # replacing a checkpoint lists its siblings (none may refer to its chunks)
    with pytest.raises(ss.StoragePermissionError) as ei:
        ss.save(f"{base}/a", {"w": np.arange(6)}, overwrite=True)
    msg = str(ei.value)
    assert f"listing the objects under {base}/ was refused (403)" in msg, msg
    assert "s3:ListBucket" in msg, msg
    np.testing.assert_array_equal(ss.load(f"{base}/a")["w"], np.arange(5))


@pytest.fixture
def az_writer(azurite: dict[str, Any]) -> Iterator[AzureStorage]:
    st = AzureStorage(AzureOptions(endpoint=azurite["endpoint"],
                                   account_name=azurite["account_name"],
                                   sas_token=azurite_account_sas("rwdac"), max_retries=0))
    set_backend("az", st)
    try:
        yield st
    finally:
        set_backend("az", None)


def test_azure_a_save_needs_no_list_permission_and_refusals_say_what(
        azurite: dict[str, Any], az_writer: AzureStorage) -> None:
    base = f"az://{azurite['container']}/t-{uuid.uuid4().hex[:8]}"
    ss.save(f"{base}/a", {"w": np.arange(5)})
    np.testing.assert_array_equal(ss.load(f"{base}/a")["w"], np.arange(5))
    with pytest.raises(ss.StoragePermissionError) as ei:
        ss.verify(f"{base}/a")
    msg = str(ei.value)
    assert f"listing the objects under {base}/a/ was refused (403)" in msg, msg
    assert "List permission" in msg and "'l'" in msg and "sig=" not in msg, msg
    with pytest.raises(ss.StoragePermissionError, match=f"listing the objects under {base}/ "):
        ss.save(f"{base}/a", {"w": np.arange(6)}, overwrite=True)


def test_a_missing_container_is_an_error_not_an_absent_checkpoint(
        azurite: dict[str, Any]) -> None:
    """is_committed (the manager's, ls's and the engine's test for a checkpoint) answered
    False for a path in a container that does not exist; without list permission too."""
    full = AzureStorage(AzureOptions(endpoint=azurite["endpoint"],
                                     account_name=azurite["account_name"],
                                     account_key=azurite["account_key"], max_retries=0))
    no_list = AzureStorage(AzureOptions(endpoint=azurite["endpoint"],
                                        account_name=azurite["account_name"],
                                        sas_token=azurite_account_sas("rwdac"), max_retries=0))
    for st in (full, no_list):
        with pytest.raises(ss.StorageError,
                           match="the container az://no-such-container does not exist"):
            st.is_committed("az://no-such-container/x")
        assert not st.is_committed(f"az://{azurite['container']}/absent-{uuid.uuid4().hex}")


def test_s3_a_wrong_secret_is_not_a_missing_list_permission(s3_no_list: dict[str, Any]
                                                            ) -> None:
    """A wrong secret is refused on every request (SignatureDoesNotMatch, 403), a
    listing too: that is not a permission to grant."""
    st = S3Storage(S3Options(endpoint=s3_no_list["endpoint"], region="us-east-1",
                             access_key_id=s3_no_list["access_key_id"],
                             secret_access_key="not-the-secret", max_retries=0))
    base = f"s3://{s3_no_list['bucket']}/t-{uuid.uuid4().hex[:8]}"
    for call in (lambda: st.list(base), lambda: st.is_committed(f"{base}/a")):
        with pytest.raises(ss.StoragePermissionError) as ei:
            call()
        msg = str(ei.value)
        assert "did not accept the credentials (SignatureDoesNotMatch)" in msg, msg
        assert "ListBucket" not in msg and "not-the-secret" not in msg, msg
