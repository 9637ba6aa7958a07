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


def _control_on_azurite(url: str, keys: list[str]) -> None:
    if url.startswith("az://") and any(ch < " " or ch == "\x7f" for k in keys for ch in k):
        pytest.skip("Azurite answers 500 to a listing that holds a key with a control "
                    "character (the client never sees the key)")


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


@pytest.mark.parametrize("odd", [["../x"], ["step-5/../../evil"], ["-5/../../evil", "../x"]])
def test_the_keep_policy_deletes_around_an_odd_key(
        store: tuple[str, Callable[[str], None]], odd: list[str]) -> None:
    """(An odd top-level key with another one that sorts after a name a checkpoint may
    have, ``../x`` and ``step-5/../../evil``, is an error: see
    test_an_odd_key_whose_page_may_hide_steps_is_an_error_not_fewer_steps.)"""
    url, put = store
    _saved(url)
    for key in odd:
        put(key)
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


@pytest.mark.parametrize("odd", ["\x01first", "step_0000000001/x\ty", "step_0000000002/\x7f"])
def test_a_key_with_a_control_character_is_skipped_and_named_escaped(
        store: tuple[str, Callable[[str], None]], odd: str) -> None:
    """The client refuses a key holding an ASCII control character as it refuses a '..'
    segment, and failed the listing naming it as one with a '..' segment (the manager at
    the top could not open); it is skipped like those, named with the character escaped."""
    url, put = store
    _control_on_azurite(url, [odd])
    _saved(url)
    put(odd)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ss.CheckpointManager(url, async_save=False, keep_policy=ss.KeepLatest(2)) as mgr:
            assert mgr.steps() == [1, 2] and mgr.latest_step() == 2
    shown = odd.replace("\x01", "\\x01").replace("\t", "\\x09").replace("\x7f", "\\x7f")
    said = [str(w.message) for w in caught if f"{url}/{shown} " in str(w.message)]
    assert said and all("control character" in s and "not followed" in s for s in said), \
        [str(w.message) for w in caught]


@pytest.mark.parametrize("odd", [["zz\x01"], ["step_0000000002\x01"],
                                 ["../y", "step_0000000002/zz/../x"]])
def test_an_odd_key_whose_page_may_hide_steps_is_an_error_not_fewer_steps(
        store: tuple[str, Callable[[str], None]], odd: list[str]) -> None:
    """The client drops the whole listing page that holds an odd key: one sorting after the
    steps (or nested in one, once an odd top-level key makes the listing step over every
    object) hid the steps before it, and steps() answered [] or [2] with a warning (a
    resumed run started over). It is now a StorageError naming the directory and the key."""
    url, put = store
    _control_on_azurite(url, odd)
    _saved(url)
    for key in odd:
        put(key)
    shown = odd[-1].replace("\x01", "\\x01")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ss.StorageError, match="not followed") as ei:
            ss.CheckpointManager(url, async_save=False).steps()
        with pytest.raises(ss.StorageError):
            storage_for(url)[0].list(url)
        assert cli_main(["ls", url]) != 0
    assert f"listing {url}/ failed" in str(ei.value) and f"{url}/{shown} " in str(ei.value)


def test_the_entry_at_the_offset_past_an_odd_key_is_listed(
        store: tuple[str, Callable[[str], None]]) -> None:
    """Past ``run//z`` the listing goes on after ``run/0`` (the least key after every
    ``run//...`` that the client takes as an offset): an object named ``run/0`` itself was
    missing from the listing, unwarned."""
    url, put = store
    _saved(url)
    put("/z")
    put("0")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        names = storage_for(url)[0].list(url)
    assert names == ["0", "step_0000000001", "step_0000000002"]
