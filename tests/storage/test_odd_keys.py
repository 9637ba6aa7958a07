"""Objects whose keys name no path (``run/../x``, ``run/step-5/../../evil``, ``run//z``)
put beside a manager's steps by someone else: listings skip them with a warning that
names them, never follow them, and still find the real steps. Against moto's S3 server
and Azurite, with the odd objects written by a raw client (obstore refuses such keys)."""

from __future__ import annotations

import os
import sys
import urllib.parse
import urllib.request
import uuid
import warnings
from collections.abc import Callable, Iterator

import numpy as np
import pytest

import statestream as ss
from statestream.cli._main import main as cli_main
from statestream.storage import (
    AzureOptions,
    AzureStorage,
    S3Options,
    S3Storage,
    set_backend,
    storage_for,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _emulators import azurite_account_sas  # noqa: E402

#: odd keys, relative to the manager's directory: at its top, nested in a foreign
#: folder, nested in a real step, and the bare segments
ODD = ["../x", "step-5/../../evil", "./y", "/z", "..", ".",
       "step_0000000001/../../evil2"]


@pytest.fixture(params=["s3", "az"])
def store(request: pytest.FixtureRequest) -> Iterator[tuple[str, Callable[[str], None]]]:
    """(a fresh manager directory URL, put(key) writing an odd object with a raw client)."""
    if request.param == "s3":
        srv = request.getfixturevalue("s3_server")
        set_backend("s3", S3Storage(S3Options(
            endpoint=srv["endpoint"], region="us-east-1", access_key_id=srv["aws_access_key_id"],
            secret_access_key=srv["aws_secret_access_key"])))
        prefix = f"odd-{uuid.uuid4().hex[:8]}"

        def put(rel: str) -> None:
            srv["client"].put_object(Bucket=srv["bucket"], Key=f"{prefix}/{rel}", Body=b"x")

        url = f"s3://{srv['bucket']}/{prefix}"
    else:
        srv = request.getfixturevalue("azurite")
        set_backend("az", AzureStorage(AzureOptions(
            endpoint=srv["endpoint"], account_name=srv["account_name"],
            account_key=srv["account_key"])))
        prefix = f"odd-{uuid.uuid4().hex[:8]}"
        sas = azurite_account_sas()

        def put(rel: str) -> None:
            key = urllib.parse.quote(f"{prefix}/{rel}", safe="/")
            req = urllib.request.Request(f"{srv['endpoint']}/{srv['container']}/{key}?{sas}",
                                         data=b"x", method="PUT",
                                         headers={"x-ms-blob-type": "BlockBlob"})
            urllib.request.urlopen(req, timeout=30).close()

        url = f"az://{srv['container']}/{prefix}"
    try:
        yield url, put
    finally:
        set_backend(request.param, None)


def _saved(url: str) -> None:
    with ss.CheckpointManager(url, async_save=False) as mgr:
        mgr.save(1, {"w": np.ones(3)})
        mgr.save(2, {"w": np.full(3, 2.0)})


@pytest.mark.parametrize("odd", ODD)
def test_an_odd_key_is_skipped_with_a_warning_and_the_steps_still_list(
        store: tuple[str, Callable[[str], None]], odd: str) -> None:
    url, put = store
    _saved(url)
    put(odd)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ss.CheckpointManager(url, async_save=False, keep_policy=ss.KeepLatest(2)) as mgr:
            assert mgr.steps() == [1, 2] and mgr.latest_step() == 2
            assert mgr.load()["w"].tolist() == [2.0] * 3
        names = storage_for(url)[0].list(url)
        listing = cli_main(["ls", url])
    assert listing == 0
    assert "step_0000000001" in names and "step_0000000002" in names
    assert not {"..", ".", ""} & set(names)
    shown = odd.rstrip("/")
    said = [str(w.message) for w in caught if f"{url}/{shown}" in str(w.message)]
    assert said, [str(w.message) for w in caught]
    assert all("ignored" in s and "not followed" in s for s in said)


def test_the_keep_policy_deletes_around_an_odd_key(
        store: tuple[str, Callable[[str], None]]) -> None:
    url, put = store
    _saved(url)
    put("../x")
    put("step-5/../../evil")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with ss.CheckpointManager(url, async_save=False, keep_policy=ss.KeepLatest(1)) as mgr:
            mgr.save(3, {"w": np.full(3, 3.0)})
            assert mgr.steps() == [3]


def test_deleting_a_checkpoint_that_holds_an_odd_key_names_it(
        store: tuple[str, Callable[[str], None]]) -> None:
    url, put = store
    ss.save(f"{url}/ck", {"w": np.ones(3)})
    put("ck/../../evil")
    storage = storage_for(url)[0]
    with pytest.raises(ss.StorageError, match=r"holds the object .*ck/\.\./\.\./evil.*not "
                                              r"followed"):
        storage.delete(f"{url}/ck")


def test_a_checkpoint_that_references_an_escaping_path_is_still_refused(
        store: tuple[str, Callable[[str], None]]) -> None:
    url, _ = store
    storage = storage_for(url)[0]
    with pytest.raises(ss.StorageError):
        storage.open_read(f"{url}/../x")
