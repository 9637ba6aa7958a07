"""Azure Blob Storage against a real Azurite server on loopback (see conftest.py)."""

from __future__ import annotations

import os
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import statestream as ss
from statestream.storage import (
    AzureOptions,
    AzureStorage,
    collect_garbage,
    set_backend,
    storage_for,
)
from statestream.testing.storage import StorageTests

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _emulators import (  # noqa: E402
    AZURITE_ACCOUNT,
    AZURITE_KEY,
    AnswerLosingProxy,
    _free_port,
    azurite_account_sas,
    azurite_create_container,
    start_azurite,
    stop_process,
)


def _options(srv: dict[str, Any], **kw: Any) -> AzureOptions:
    base: dict[str, Any] = dict(endpoint=srv["endpoint"], account_name=srv["account_name"],
                                account_key=srv["account_key"])
    base.update(kw)
    return AzureOptions(**base)


@pytest.fixture
def storage(azurite: dict[str, Any]) -> Iterator[AzureStorage]:
    st = AzureStorage(_options(azurite))
    set_backend("az", st)
    try:
        yield st
    finally:
        set_backend("az", None)


@pytest.fixture
def base_url(azurite: dict[str, Any]) -> str:
    return f"az://{azurite['container']}/t-{uuid.uuid4().hex[:8]}"


class TestAzureConformance(StorageTests):
    pass


def test_az_urls_use_the_azure_backend_configured_from_the_environment(
        azurite: dict[str, Any], base_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import base64

    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", azurite["account_name"])
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_KEY", base64.b64encode(b"wrong" * 12).decode())
    monkeypatch.setenv("AZURE_STORAGE_ENDPOINT", azurite["endpoint"])
    monkeypatch.setenv("AZURE_ALLOW_HTTP", "true")
    set_backend("az", None)  # the default backend, built from the environment
    try:
        backend, path = storage_for(f"{base_url}/env/")
        assert type(backend) is AzureStorage and path == f"{base_url}/env"
        with pytest.raises(ss.StoragePermissionError):
            ss.save(f"{base_url}/env", {"w": np.arange(10.0)})
        # the client follows the environment: the right key works without a new backend
        monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_KEY", azurite["account_key"])
        assert storage_for(f"{base_url}/env")[0] is backend
        ss.save(f"{base_url}/env", {"w": np.arange(10.0)})
        np.testing.assert_array_equal(ss.load(f"{base_url}/env")["w"], np.arange(10.0))
    finally:
        set_backend("az", None)


def test_a_sas_token_authorizes_from_options_or_the_environment(
        azurite: dict[str, Any], base_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    sas = azurite_account_sas()
    st = AzureStorage(AzureOptions(endpoint=azurite["endpoint"],
                                   account_name=azurite["account_name"], sas_token=sas))
    set_backend("az", st)
    try:
        ss.save(f"{base_url}/sas", {"w": np.arange(5)})
        np.testing.assert_array_equal(ss.load(f"{base_url}/sas")["w"], np.arange(5))
    finally:
        set_backend("az", None)
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", azurite["account_name"])
    monkeypatch.setenv("AZURE_STORAGE_SAS_TOKEN", sas)
    monkeypatch.setenv("AZURE_STORAGE_ENDPOINT", azurite["endpoint"])
    monkeypatch.setenv("AZURE_ALLOW_HTTP", "true")
    try:
        np.testing.assert_array_equal(ss.load(f"{base_url}/sas")["w"], np.arange(5))
        read_only = AzureStorage(AzureOptions(
            endpoint=azurite["endpoint"], account_name=azurite["account_name"],
            sas_token=azurite_account_sas("rl"), max_retries=0))
        set_backend("az", read_only)  # a SAS without write permission: a clear 403
        with pytest.raises(ss.StoragePermissionError, match="403") as ei:
            ss.save(f"{base_url}/sas-ro", {"w": np.arange(5)})
        assert "sig=" not in str(ei.value)
    finally:
        set_backend("az", None)


def test_wrong_container_is_a_clear_error(storage: AzureStorage) -> None:
    with pytest.raises(ss.StorageError, match="az://no-such-container does not exist"):
        ss.save("az://no-such-container/x", {"a": np.ones(3)})
    with pytest.raises(ss.StorageError, match="does not exist"):
        ss.load("az://no-such-container/x")


def test_an_invalid_container_name_is_a_clear_error(storage: AzureStorage) -> None:
    """Azure answers a container name it does not allow (upper case, '_') with a bare
    400: a load said "reading az://My_Box/x/COMMITTED failed: GenericError: ... 400 Bad
    Request: " and nothing more."""
    for url in ("az://My_Box/x", "az://Box/x", "az://my_box/x", "az://a--b/x", "az://ab-/x"):
        with pytest.raises(ss.StorageError, match="is no Azure container name"):
            ss.load(url)
        with pytest.raises(ss.StorageError, match="is no Azure container name"):
            ss.save(url, {"a": np.ones(3)})
        with pytest.raises(ss.StorageError, match="is no Azure container name"):
            ss.CheckpointManager(url)


def test_malformed_urls_are_refused(storage: AzureStorage) -> None:
    for url in ("az://ab/x", "az://container", "az://container/a//b", "az://container/a/../b"):
        with pytest.raises(ss.StorageError):
            storage.is_committed(url)


def test_a_backslash_in_a_path_is_refused(storage: AzureStorage, base_url: str) -> None:
    """Azure (and Azurite) store a backslash in a blob name as '/': a save to ``a\\b``
    went to ``a/b``, and one to ``q\\\\r`` or ``x\\..\\y`` wrote blobs with empty or
    '..' segments, after which every listing of the parent failed (InvalidPathError:
    the manager's steps, ls, gc)."""
    ss.save(f"{base_url}/ok", {"w": np.arange(3)})
    for name in ("a\\b", "q\\\\r", "x\\..\\..\\out", "t\\"):
        with pytest.raises(ss.StorageError, match="backslash"):
            ss.save(f"{base_url}/{name}", {"w": np.arange(3)})
        with pytest.raises(ss.StorageError, match="backslash"):
            ss.load(f"{base_url}/{name}")
    with pytest.raises(ss.StorageError, match="backslash"):
        ss.CheckpointManager(f"{base_url}\\run")
    assert storage.list(base_url) == ["ok"]


def test_a_wrong_key_is_a_403_that_does_not_show_the_key(azurite: dict[str, Any],
                                                          base_url: str) -> None:
    import base64

    wrong = base64.b64encode(b"not-the-key-" * 6).decode()
    st = AzureStorage(_options(azurite, account_key=wrong))
    assert wrong not in repr(st) and azurite["account_key"] not in repr(st)
    set_backend("az", st)
    try:
        with pytest.raises(ss.StoragePermissionError, match="403") as ei:
            ss.save(f"{base_url}/denied", {"a": np.ones(3)})
        assert wrong not in str(ei.value) and "not-the-key" not in str(ei.value)
    finally:
        set_backend("az", None)


def test_a_key_that_is_no_key_is_reported_once(azurite: dict[str, Any],
                                              base_url: str) -> None:
    """A key the client cannot decode fails while building the client: that error was
    wrapped again by the request around it ("reading .../COMMITTED failed: StorageError:
    configuring access to az://... failed: ... Invalid Access Key ...")."""
    for key in ("not-base64!!", "YQ"):
        st = AzureStorage(_options(azurite, account_key=key, max_retries=0))
        set_backend("az", st)
        try:
            for call in (lambda: ss.save(f"{base_url}/k", {"a": np.ones(3)}),
                         lambda: ss.load(f"{base_url}/k"),
                         lambda st=st: st.is_committed(f"{base_url}/k"),
                         lambda: ss.CheckpointManager(f"{base_url}/run")):
                with pytest.raises(ss.StorageError) as ei:
                    call()
                msg = str(ei.value)
                assert msg.startswith(f"configuring access to az://{azurite['container']} "
                                      "failed:"), msg
                assert msg.count("configuring access") == 1 and "Invalid Access Key" in msg
                assert "StorageError" not in msg and key not in msg, msg
        finally:
            set_backend("az", None)


def test_a_wrong_key_is_not_a_missing_list_permission(azurite: dict[str, Any],
                                                      base_url: str) -> None:
    """Every request of a wrong key is refused (403), a listing too: the manager's (its
    first request) said the listing "needs the List permission on the container"."""
    import base64

    st = AzureStorage(_options(azurite, account_key=base64.b64encode(b"k" * 64).decode(),
                               max_retries=0))
    set_backend("az", st)
    try:
        for call in (lambda: ss.CheckpointManager(f"{base_url}/run"),
                     lambda: ss.save(f"{base_url}/k", {"a": np.ones(3)})):
            with pytest.raises(ss.StoragePermissionError, match="403") as ei:
                call()
            msg = str(ei.value)
            assert "did not accept the credentials" in msg and "List permission" not in msg
            assert "AZURE_STORAGE_ACCOUNT_KEY" in msg, msg
    finally:
        set_backend("az", None)


def test_a_sas_token_never_appears_in_errors_or_reprs(azurite: dict[str, Any],
                                                      base_url: str) -> None:
    """A SAS token travels in the query string of every request: obstore's messages
    quote the URL, so its signature is hidden before a message is raised."""
    sas = "sv=2021-08-06&ss=b&srt=sco&sp=rwdlac&se=2099-01-01T00:00:00Z&sig=TopSecretSig123%3D"
    opts = AzureOptions(endpoint=azurite["endpoint"], account_name=azurite["account_name"],
                        sas_token=sas, max_retries=0)
    st = AzureStorage(opts)
    assert "TopSecretSig" not in repr(opts) and "TopSecretSig" not in repr(st)
    with pytest.raises(ss.StorageError) as ei:
        st.is_committed(f"{base_url}/x")
    chain: list[BaseException] = []
    exc: BaseException | None = ei.value
    while exc is not None:  # what a traceback shows: the error and everything it chains
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    assert len(chain) >= 2 and not [e for e in chain if "TopSecretSig" in str(e)], chain


def test_secret_query_parameters_are_hidden_from_messages() -> None:
    from statestream.storage._object import redact

    text = ("Error performing GET http://h/c?restype=container&sv=2021&sig=AbC%2Fd&se=1 "
            "and https://s/o?X-Goog-Signature=deadbeef&X-Amz-Security-Token=tok")
    out = redact(text)
    assert "AbC" not in out and "deadbeef" not in out and "=tok" not in out, out
    assert "restype=container" in out and "sv=2021" in out


def test_manager_on_azure(storage: AzureStorage, base_url: str) -> None:
    url = f"{base_url}/run"
    with ss.CheckpointManager(url, save_policy=ss.EveryNSteps(2),
                              keep_policy=ss.KeepLatest(2)) as mgr:
        for step in range(7):
            mgr.save(step, {"w": np.full(4, step, dtype=np.int64)}, metrics={"s": step})
        mgr.wait()
        assert mgr.steps() == [4, 6]
        assert int(mgr.load()["w"][0]) == 6
        with pytest.raises(ss.ManagerLockedError):
            ss.CheckpointManager(url)
    txn = storage.begin_write(f"{url}/step_{9:010d}", overwrite=False)  # killed before commit
    w = txn.create_file("data/r0-0.bin", 3)
    w.write_at([b"abc"], 0)
    w.finish()
    assert [x.target for x in storage.leftovers(url)] == [f"step_{9:010d}"]
    with ss.CheckpointManager(url) as mgr:
        assert mgr.steps() == [4, 6]
        assert storage.leftovers(url) == []


def test_ls_lists_a_killed_save_once_as_a_leftover(storage: AzureStorage, base_url: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """A save killed before its commit leaves an unreferenced root inside its step's
    prefix: ls listed that step twice, as ``uncommitted`` and as ``leftover`` ("1
    committed checkpoint, 2 other"); it is one unfinished save, as on local disk."""
    import json

    from statestream.cli import main

    url = f"{base_url}/run"
    with ss.CheckpointManager(url) as mgr:
        mgr.save(1, {"w": np.zeros(2)})
    txn = storage.begin_write(f"{url}/step_{2:010d}", overwrite=False)  # killed before commit
    w = txn.create_file("data/r0-0.bin", 3)
    w.write_at([b"abc"], 0)
    w.finish()
    assert main(["ls", url, "--json"]) == 0
    entries = json.loads(capsys.readouterr().out)["entries"]
    assert [(e["step"], e["state"]) for e in entries] == [(1, "committed"), (2, "leftover")]
    assert main(["ls", url]) == 0
    assert "1 committed checkpoint, 1 other" in capsys.readouterr().out


def test_an_expired_lease_is_taken_over_and_its_holder_learns_it(storage: AzureStorage,
                                                                  base_url: str) -> None:
    """Takeover is a PUT conditional on the expired lease's ETag (If-Match)."""
    path = f"{base_url}/.statestream.lock"
    first = storage.acquire_lease(path, holder="pid 1 on a", ttl_s=0.5)
    first.renew()  # renewals match the ETag the holder last wrote
    deadline = time.monotonic() + 30
    while True:  # expiry: Last-Modified older than ttl plus 2 s of slack
        try:
            second = storage.acquire_lease(path, holder="pid 2 on b", ttl_s=60)
            break
        except ss.ManagerLockedError:
            assert time.monotonic() < deadline
            time.sleep(0.5)
    with pytest.raises(ss.ManagerLockedError, match="taken over"):
        first.renew()
    first.release()  # not ours any more: leaves the new holder's lease alone
    with pytest.raises(ss.ManagerLockedError, match="pid 2 on b"):
        storage.acquire_lease(path, holder="pid 3 on c", ttl_s=60)
    second.release()
    storage.acquire_lease(path, holder="pid 3 on c", ttl_s=60).release()


def test_a_lease_whose_answers_are_lost_is_still_ours(storage: AzureStorage, base_url: str,
                                                      azurite: dict[str, Any]) -> None:
    """The lease's create and its renewal are stored but their answers lost; the
    client's retries are refused (Azure's ETag changed with our own write). The
    holder keeps its lease instead of taking itself for another holder."""
    path = f"{base_url}/run/.statestream.lock"
    port = int(azurite["endpoint"].split(":")[2].split("/")[0])
    proxy = AnswerLosingProxy(port, b"/.statestream.lock HTTP", 1)
    endpoint = azurite["endpoint"].replace(f":{port}/", f":{proxy.port}/")
    via = AzureStorage(_options(azurite, endpoint=endpoint, timeout_s=2, max_retries=1,
                                retry_timeout_s=5))
    try:
        lease = via.acquire_lease(path, holder="pid 1 on a", ttl_s=60)
        proxy.left = 1
        lease.renew()
        assert proxy.lost == 2
        with pytest.raises(ss.ManagerLockedError, match="held by pid 1 on a"):
            storage.acquire_lease(path, holder="pid 1 on a", ttl_s=60)  # same holder name
        lease.release()  # still ours: its ETag is the one the lost renewal wrote
    finally:
        proxy.close()
    storage.acquire_lease(path, holder="pid 2 on b", ttl_s=60).release()


def test_large_state_goes_up_as_block_blobs(base_url: str, azurite: dict[str, Any]) -> None:
    """Data objects larger than part_bytes are uploaded in blocks (put block list)."""
    st = AzureStorage(_options(azurite, part_bytes=5 << 20, max_concurrency=4))
    set_backend("az", st)
    try:
        w = np.random.default_rng(0).standard_normal((4, 1 << 20)).astype(np.float32)  # 16 MiB
        ss.save(f"{base_url}/big", {"w": w}, io=ss.IOOptions(num_threads=1))
        np.testing.assert_array_equal(ss.load(f"{base_url}/big")["w"], w)
        assert ss.verify(f"{base_url}/big").ok
    finally:
        set_backend("az", None)


@pytest.mark.timeout(180)
def test_azurite_stopped_mid_save_commits_nothing(tmp_path: Any) -> None:
    """A server that goes away mid-upload: the save fails within its bounded time,
    and after a restart the previous checkpoint loads and the new one is not there."""
    port = _free_port()
    proc, log = start_azurite(tmp_path, port, persistent=True)
    endpoint = f"http://127.0.0.1:{port}/{AZURITE_ACCOUNT}"
    try:
        azurite_create_container(endpoint, "faults")
        st = AzureStorage(AzureOptions(endpoint=endpoint, account_name=AZURITE_ACCOUNT,
                                       account_key=AZURITE_KEY, timeout_s=5, max_retries=1,
                                       retry_timeout_s=3))
        set_backend("az", st)
        good = "az://faults/run/step1"
        ss.save(good, {"w": np.arange(1000.0)})
        stopped: list[bool] = []

        def progress(done: int, total: int) -> None:
            if not stopped:
                stopped.append(True)
                stop_process(proc, log)

        with pytest.raises(ss.CheckpointError):
            ss.save("az://faults/run/step2", {"w": np.ones((2000, 1000))}, progress=progress,
                    io=ss.IOOptions(max_chunk_bytes=1 << 20, num_threads=1))
        assert stopped
        proc, log = start_azurite(tmp_path, port, persistent=True)  # same port, same data
        assert not st.is_committed("az://faults/run/step2")
        np.testing.assert_array_equal(ss.load(good)["w"], np.arange(1000.0))
        with pytest.raises(ss.CheckpointNotFoundError):
            ss.load("az://faults/run/step2")
        # whatever the failed save left (its cleanup could not reach the server) is garbage
        collect_garbage(st, "az://faults/run", max_age_s=0)
        assert st.leftovers("az://faults/run") == []
        assert st.list("az://faults/run") == ["step1"]
    finally:
        set_backend("az", None)
        stop_process(proc, log)


@pytest.mark.parametrize("field, value", [("timeout_s", 0), ("connect_timeout_s", -1.0),
                                          ("retry_timeout_s", 0), ("max_retries", -1)])
def test_options_refuse_impossible_limits(field: str, value: float) -> None:
    from statestream.storage import GCSOptions

    for cls in (AzureOptions, GCSOptions):
        with pytest.raises(ss.StorageError, match=f"{cls.__name__}.{field}"):
            cls(**{field: value})


def test_a_key_that_names_an_error_code_is_no_missing_container(
        storage: AzureStorage, base_url: str) -> None:
    # the code was looked for anywhere in the message, which names the key: a prefix
    # holding "ContainerNotFound" could never be saved to
    url = f"{base_url}/runs/ContainerNotFound-debug/s1"
    ss.save(url, {"a": np.arange(4)})
    np.testing.assert_array_equal(ss.load(url)["a"], np.arange(4))
    with pytest.raises(ss.CheckpointNotFoundError, match="no committed checkpoint"):
        ss.load(url + "-missing")
    with pytest.raises(ss.StorageError, match="container .* does not exist"):
        ss.load("az://nocontainer/runs/ContainerNotFound-debug/s1")
