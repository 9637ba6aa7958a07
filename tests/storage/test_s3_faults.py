"""S3 under faults: stalled servers, endpoints that change, leases of killed managers.

Everything runs against real servers on loopback: moto (see conftest.py), a
socket server that accepts connections and never answers, and a proxy in front
of moto that stops forwarding on demand.
"""

from __future__ import annotations

import errno
import os
import select
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import statestream as ss
from statestream.storage import S3Options, S3Storage, set_backend
from statestream.storage._s3 import split_url

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _emulators import AnswerLosingProxy, OutageProxy  # noqa: E402

_FAST_FAIL = dict(timeout_s=2, max_retries=1, retry_timeout_s=5)


def _options(srv: dict[str, Any], **kw: Any) -> S3Options:
    base: dict[str, Any] = dict(endpoint=srv["endpoint"], region="us-east-1",
                                access_key_id=srv["aws_access_key_id"],
                                secret_access_key=srv["aws_secret_access_key"])
    base.update(kw)
    return S3Options(**base)


class _Silent:
    """A TCP server on loopback that accepts every connection and never answers."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)

    def close(self) -> None:
        self.sock.close()
        for c in self.held:
            c.close()


class _StallingProxy:
    """Forwards to ``upstream`` until :attr:`stalled` is set; then drops every byte."""

    def __init__(self, upstream_port: int) -> None:
        self.stalled = threading.Event()
        self._upstream = upstream_port
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self._open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self._upstream))
            self._open += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                if not self.stalled.is_set():
                    dst.sendall(data)
        except OSError:
            pass

    def close(self) -> None:
        self.sock.close()
        for s in self._open:
            s.close()


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
    return f"s3://{s3_server['bucket']}/f-{uuid.uuid4().hex[:8]}"


# ----------------------------------------------------------------------------- bounded time
def test_options_reject_unbounded_values() -> None:
    with pytest.raises(ss.StorageError, match="timeout_s"):
        S3Options(timeout_s=0)
    with pytest.raises(ss.StorageError, match="max_retries"):
        S3Options(max_retries=-1)


@pytest.mark.timeout(90)
def test_a_silent_server_fails_a_save_in_bounded_time() -> None:
    silent = _Silent()
    try:
        set_backend("s3", S3Storage(S3Options(
            endpoint=f"http://127.0.0.1:{silent.port}", region="us-east-1",
            access_key_id="k", secret_access_key="s", **_FAST_FAIL)))
        with pytest.raises(ss.StorageError) as ei:
            ss.save("s3://silent-bucket/ckpt", {"a": np.ones(3)})
    finally:
        set_backend("s3", None)
        silent.close()
    assert isinstance(ei.value, TimeoutError) and ei.value.errno == errno.ETIMEDOUT
    assert "timed out" in str(ei.value)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("multipart", [False, True])
def test_a_stall_mid_upload_reports_the_upload_not_the_cleanup(
        s3_server: dict[str, Any], storage: S3Storage, base_url: str, multipart: bool) -> None:
    old = f"{base_url}/old"
    ss.save(old, {"w": np.arange(1000.0)})
    port = int(s3_server["endpoint"].rsplit(":", 1)[1])
    proxy = _StallingProxy(port)
    parts = {"part_bytes": 5 << 20} if multipart else {}
    via_proxy = S3Storage(_options(s3_server, endpoint=f"http://127.0.0.1:{proxy.port}",
                                   **parts, **_FAST_FAIL))

    def progress(done: int, total: int) -> None:
        proxy.stalled.set()  # after the first chunk: every later request hangs

    set_backend("s3", via_proxy)
    try:
        with pytest.raises(ss.StorageError) as ei:
            ss.save(old, {"w": np.ones((2048 if multipart else 512, 1024))}, overwrite=True,
                    progress=progress,
                    io=ss.IOOptions(max_chunk_bytes=256 << 10, num_threads=1))
    finally:
        set_backend("s3", storage)
        proxy.close()
    text = str(ei.value)
    assert "uploading" in text or "completing" in text or "writing" in text, text
    assert "deleting" not in text  # not the cleanup's failure
    if "uploadId=" in text:  # the client aborted the multipart upload, and that failed
        assert "then so did the client's abort" in text, text
    np.testing.assert_array_equal(ss.load(old)["w"], np.arange(1000.0))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("lazy", [False, True])
def test_a_stall_mid_upload_fails_save_async_in_bounded_time(
        s3_server: dict[str, Any], storage: S3Storage, base_url: str, lazy: bool) -> None:
    """save_async's writers wait until the store is done with each whole part they
    handed over (so staging buffers can be reused): a store that stops answering
    mid-upload fails the save within the client's timeouts, never hangs a writer."""
    port = int(s3_server["endpoint"].rsplit(":", 1)[1])
    proxy = _StallingProxy(port)
    via_proxy = S3Storage(_options(s3_server, endpoint=f"http://127.0.0.1:{proxy.port}",
                                   part_bytes=5 << 20, **_FAST_FAIL))

    def progress(done: int, total: int) -> None:
        proxy.stalled.set()  # after the first chunk: every later request hangs

    set_backend("s3", via_proxy)
    try:
        h = ss.save_async(f"{base_url}/a", {"w": np.ones((4096, 1024))}, lazy=lazy,
                          progress=progress, io=ss.IOOptions(max_chunk_bytes=8 << 20))
        with pytest.raises(ss.StorageError):
            h.result(timeout=90)
    finally:
        set_backend("s3", storage)
        proxy.close()
    assert not storage.is_committed(f"{base_url}/a")


def _save_through_an_outage(s3_server: dict[str, Any], storage: S3Storage, url: str,
                            fault: str, how: str, multipart: bool) -> BaseException:
    """Save ``url`` through an OutageProxy whose ``fault`` (stall: the store hangs; down:
    it resets connections) starts after the first chunk; the save's error."""
    proxy = OutageProxy(int(s3_server["endpoint"].rsplit(":", 1)[1]))
    via_proxy = S3Storage(_options(s3_server, endpoint=f"http://127.0.0.1:{proxy.port}",
                                   part_bytes=5 << 20, **_FAST_FAIL))
    state = {"w": np.ones((2048 if multipart else 512, 1024))}  # 16 MiB or 4 MiB
    io = ss.IOOptions(max_chunk_bytes=256 << 10, num_threads=1)

    def progress(done: int, total: int) -> None:
        getattr(proxy, fault).set()

    set_backend("s3", via_proxy)
    try:
        with pytest.raises(ss.StorageError) as ei:
            if how == "sync":
                ss.save(url, state, progress=progress, io=io)
            else:
                ss.save_async(url, state, lazy=how == "lazy", progress=progress,
                              io=io).result(timeout=90)
    finally:
        getattr(proxy, fault).clear()
        set_backend("s3", storage)
        proxy.close()
    assert not storage.is_committed(url)
    return ei.value


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("how", "multipart"),
                         [("sync", False), ("async", False), ("lazy", True)])
def test_a_store_that_stalls_mid_upload_is_a_timeout_in_every_save(
        s3_server: dict[str, Any], storage: S3Storage, base_url: str, how: str,
        multipart: bool) -> None:
    """The data objects go up through obstore's writer, whose errors are plain OSErrors
    holding the first line of the message only (not the chain with "kind: Timeout"): a
    save whose store stopped answering mid-upload raised a plain StorageError, where a
    stall met by a GET or PUT (a silent server) raised StorageTimeoutError."""
    err = _save_through_an_outage(s3_server, storage, f"{base_url}/a", "stall", how,
                                  multipart)
    assert isinstance(err, ss.StorageTimeoutError) and err.errno == errno.ETIMEDOUT, err
    assert "timed out" in str(err) and "S3Options.timeout_s" in str(err), err


@pytest.mark.timeout(120)
def test_a_store_that_resets_mid_upload_is_no_timeout(
        s3_server: dict[str, Any], storage: S3Storage, base_url: str) -> None:
    err = _save_through_an_outage(s3_server, storage, f"{base_url}/a", "down", "async", False)
    assert not isinstance(err, TimeoutError) and "timed out" not in str(err), err


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("overwrite", "times"), [(False, 1), (False, 3), (True, 3)])
def test_a_commit_whose_answer_is_lost_keeps_its_data(
        s3_server: dict[str, Any], storage: S3Storage, base_url: str, overwrite: bool,
        times: int) -> None:
    """The marker PUT reaches the store but its answer is lost: the client's retry of a
    create-only PUT is refused (the marker exists: our own), or every answer is lost
    and the retries run out. The marker names the new root, so the save committed: it
    must not delete that root (a checkpoint that no longer loads) nor report 'exists'."""
    url = f"{base_url}/ckpt"
    if overwrite:
        ss.save(url, {"w": np.zeros(4)})
    port = int(s3_server["endpoint"].rsplit(":", 1)[1])
    proxy = AnswerLosingProxy(port, b"/COMMITTED", times)
    set_backend("s3", S3Storage(_options(s3_server, endpoint=f"http://127.0.0.1:{proxy.port}",
                                         **_FAST_FAIL)))
    try:
        ss.save(url, {"w": np.arange(4.0)}, overwrite=overwrite)
    finally:
        set_backend("s3", storage)
        proxy.close()
    assert proxy.lost >= 1
    np.testing.assert_array_equal(ss.load(url)["w"], np.arange(4.0))
    assert storage.leftovers(base_url) == []  # an overwritten root is gone as usual


@pytest.mark.timeout(120)
def test_verify_raises_a_store_failure_instead_of_reporting_damage(
        s3_server: dict[str, Any], storage: S3Storage, base_url: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    """An unreachable store says nothing about the checkpoint's bytes: ss.verify raises
    the StorageError and `statestream verify` exits 2 (an error), not 1 (DAMAGED)."""
    from statestream.cli import main

    url = f"{base_url}/ckpt"
    ss.save(url, {"w": np.arange(100.0)})
    port = int(s3_server["endpoint"].rsplit(":", 1)[1])
    proxy = AnswerLosingProxy(port, b"/data/", 100, method=b"HEAD")  # the data objects' sizes
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = sock.getsockname()[1]  # nothing listens there once closed
    try:
        for where in (proxy.port, dead):
            set_backend("s3", S3Storage(_options(s3_server, endpoint=f"http://127.0.0.1:{where}",
                                                 **_FAST_FAIL)))
            with pytest.raises(ss.StorageError):
                ss.verify(url)
            assert main(["verify", url]) == 2
            err = capsys.readouterr().err
            assert err.startswith("error: ") and "DAMAGED" not in err, err
    finally:
        set_backend("s3", storage)
        proxy.close()
    assert proxy.lost > 0
    assert ss.verify(url).ok


# ----------------------------------------------------------------------------- configuration
def _moto(port: int = 0) -> Any:
    from moto.server import ThreadedMotoServer

    if port == 0:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
    srv = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    srv.start()
    return srv


@pytest.mark.timeout(120)
def test_client_follows_the_endpoint_in_the_environment(
        s3_server: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """The default S3Storage reads AWS_*; a changed AWS_ENDPOINT_URL is used at once."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server["aws_access_key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server["aws_secret_access_key"])
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ALLOW_HTTP", "true")
    set_backend("s3", None)
    first, second = _moto(), _moto()
    try:
        host, port = first.get_host_and_port()
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://{host}:{port}")
        url = f"s3://{s3_server['bucket']}/env-{uuid.uuid4().hex[:8]}"
        ss.save(f"{url}/a", {"x": np.arange(3)})
        first.stop()  # the first endpoint is dead from now on
        host, port = second.get_host_and_port()
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://{host}:{port}")
        # moto servers in one process share their buckets: what the first one
        # stored is visible through the second
        ss.save(f"{url}/b", {"x": np.arange(4)})
        np.testing.assert_array_equal(ss.load(f"{url}/b")["x"], np.arange(4))
        np.testing.assert_array_equal(ss.load(f"{url}/a")["x"], np.arange(3))
    finally:
        second.stop()


# ----------------------------------------------------------------------------- leases
_HOLDER = """
import sys, time
import statestream as ss
from statestream.storage import S3Options, S3Storage, set_backend
from statestream.storage._s3 import split_url
set_backend("s3", S3Storage(S3Options(endpoint=sys.argv[2], region="us-east-1",
            access_key_id="testing", secret_access_key="testing-secret")))
mgr = ss.CheckpointManager(sys.argv[1], lease_ttl_s=float(sys.argv[3]))
print("HOLDING", flush=True)
time.sleep(600)
"""


def _start_holder(url: str, endpoint: str, ttl: float) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_HOLDER), url, endpoint,
                             str(ttl)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if line.strip() != "HOLDING":
        proc.kill()
        pytest.fail(f"holder did not start: {line!r} {proc.communicate()[1]}")
    return proc


_FORKING_HOLDER = _HOLDER.replace('print("HOLDING", flush=True)', """
import os
pid = os.fork()
if pid == 0:
    sys.exit(0)  # a plain child that ends normally: the exit handlers run in it
os.waitpid(pid, 0)
print("HOLDING", flush=True)""")


@pytest.mark.timeout(120)
def test_a_forked_child_ending_does_not_release_the_parents_lease(
        s3_server: dict[str, Any], storage: S3Storage, base_url: str) -> None:
    """A child forked by a process holding a manager's lease ran the exit handler that
    gives up never-closed managers' leases, and deleted the parent's lease object:
    another manager then took the directory while the parent still wrote to it. The
    leases are the parent's: a child forgets them."""
    url = f"{base_url}/forked"
    proc = subprocess.Popen([sys.executable, "-W", "ignore", "-c",
                             textwrap.dedent(_FORKING_HOLDER), url, s3_server["endpoint"], "60"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        # (before the fix the child hung at exit, in the release, and the parent with it)
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready, "the forked child did not end (it hung in its exit handlers)"
        line = proc.stdout.readline()
        assert line.strip() == "HOLDING", line
        with pytest.raises(ss.ManagerLockedError, match="already managed"):
            ss.CheckpointManager(url)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("times", [1, 2])
def test_a_lease_whose_create_answer_is_lost_is_still_ours(
        s3_server: dict[str, Any], storage: S3Storage, base_url: str, times: int) -> None:
    """The lease PUT is stored but its answer lost; the client's retry is refused by
    the lease itself, or its answer is lost too and the retries run out. The manager
    holds it: it must not report itself as the other holder, nor fail and leave its
    own lease blocking the directory for lease_ttl_s."""
    port = int(s3_server["endpoint"].rsplit(":", 1)[1])
    proxy = AnswerLosingProxy(port, b"/.statestream.lock HTTP", times)
    set_backend("s3", S3Storage(_options(s3_server, endpoint=f"http://127.0.0.1:{proxy.port}",
                                         **_FAST_FAIL)))
    try:
        with ss.CheckpointManager(f"{base_url}/run", async_save=False) as mgr:
            mgr.save(1, {"w": np.arange(3.0)})
            # still exclusive: another manager, even one of this process, is refused
            with pytest.raises(ss.ManagerLockedError):
                ss.CheckpointManager(f"{base_url}/run")
    finally:
        set_backend("s3", storage)
        proxy.close()
    assert proxy.lost == times
    with ss.CheckpointManager(f"{base_url}/run") as mgr:  # released on close
        assert mgr.steps() == [1]


@pytest.mark.timeout(180)
def test_lease_of_a_killed_manager_is_taken_over_after_expiry(
        s3_server: dict[str, Any], storage: S3Storage, base_url: str) -> None:
    url = f"{base_url}/run"
    proc = _start_holder(url, s3_server["endpoint"], ttl=15)
    try:
        with pytest.raises(ss.ManagerLockedError, match="already managed"):
            ss.CheckpointManager(url, lease_ttl_s=15)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
    deadline = time.monotonic() + 120
    while True:  # the dead holder renews no more: its lease expires
        try:
            mgr = ss.CheckpointManager(url, lease_ttl_s=15)
            break
        except ss.ManagerLockedError:
            assert time.monotonic() < deadline, "the lease of a dead manager never expired"
            time.sleep(1)
    with mgr:
        mgr.save(1, {"w": np.arange(3)})
        mgr.wait()
        assert mgr.steps() == [1]


@pytest.mark.timeout(120)
def test_a_live_holder_keeps_its_lease_past_the_ttl(storage: S3Storage, base_url: str) -> None:
    url = f"{base_url}/run"
    with ss.CheckpointManager(url, lease_ttl_s=3) as mgr:
        time.sleep(10)  # several ttls: only renewals keep it
        with pytest.raises(ss.ManagerLockedError, match="already managed"):
            ss.CheckpointManager(url, lease_ttl_s=3)
        mgr.save(1, {"w": np.arange(3)})
    with ss.CheckpointManager(url) as again:  # released on close
        assert again.steps() == [1]


def test_a_lease_taken_over_stops_the_manager(storage: S3Storage, base_url: str) -> None:
    url = f"{base_url}/run"
    mgr = ss.CheckpointManager(url, lease_ttl_s=2)
    try:
        mgr.save(1, {"w": np.arange(3)})
        mgr.wait()
        # another holder overwrites the lease object (as a takeover after expiry does)
        bucket, key = split_url(f"{url}/.statestream.lock")
        storage._put(bucket, key, b'{"holder": "pid 1 on elsewhere", "ttl_s": 60}')
        deadline = time.monotonic() + 60
        while mgr._hold.lease is not None and mgr._hold.lease._lost is None:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        with pytest.raises(ss.ManagerLockedError, match="lost its lease"):
            mgr.save(2, {"w": np.arange(3)})
        assert mgr.steps() == [1]
    finally:
        with pytest.raises(ss.ManagerLockedError):
            mgr.close()



@pytest.mark.parametrize("skew_s", [3600.0, -3600.0])
def test_a_lease_is_judged_on_the_stores_clock(storage: S3Storage, base_url: str,
                                               monkeypatch: pytest.MonkeyPatch,
                                               skew_s: float) -> None:
    """A taker whose clock is an hour off neither takes a live lease nor waits on a dead one."""
    path = f"{base_url}/run/.statestream.lock"
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + skew_s)  # this host's clock only
    held = storage.acquire_lease(path, holder="pid 1 on a", ttl_s=60)
    try:
        # seconds on the store's clock (an hour off on this host's), whole seconds: a
        # second boundary may pass between the two calls on a loaded machine
        with pytest.raises(ss.ManagerLockedError, match=r"held by pid 1 on a, renewed [0-5] s ago"):
            storage.acquire_lease(path, holder="pid 2 on b", ttl_s=60)
    finally:
        held.release()
    dead = storage.acquire_lease(path, holder="pid 3 on c", ttl_s=0.5)
    assert dead.holder == "pid 3 on c"
    time.sleep(3.5)  # ttl + slack on the store's clock, whatever this host's says
    storage.acquire_lease(path, holder="pid 4 on d", ttl_s=60).release()
    assert [n for n in storage.list(f"{base_url}/run") if "clock" in n] == []


# ----------------------------------------------------------------------------- garbage
def test_gc_removes_unreferenced_roots_once_stale(storage: S3Storage, base_url: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    from statestream.cli import main
    from statestream.storage import collect_garbage

    ss.save(f"{base_url}/a", {"x": np.arange(3)})
    for name, overwrite in (("a", True), ("b", False)):  # two saves killed before commit
        txn = storage.begin_write(f"{base_url}/{name}", overwrite=overwrite)
        w = txn.create_file("data/r0-0.bin", 3)
        w.write_at([b"abc"], 0)
        w.finish()
    left = storage.leftovers(base_url)
    assert sorted(x.target for x in left) == ["a", "b"] and all(x.writer is None for x in left)
    assert collect_garbage(storage, base_url) == []  # writers unverifiable, roots fresh
    assert main(["gc", base_url, "--max-age-hours", "0"]) == 0
    out = capsys.readouterr().out
    assert "2 leftover staging directories removed" in out
    assert storage.leftovers(base_url) == []
    np.testing.assert_array_equal(ss.load(f"{base_url}/a")["x"], np.arange(3))
    assert storage.list(f"{base_url}/b") == []


def test_manager_removes_its_unreferenced_roots_when_it_opens(storage: S3Storage,
                                                               base_url: str) -> None:
    url = f"{base_url}/run"
    with ss.CheckpointManager(url) as mgr:
        mgr.save(1, {"w": np.arange(3)})
    txn = storage.begin_write(f"{url}/step_{1:010d}", overwrite=True)  # killed overwrite
    txn.write_bytes("manifest.json", b"{}")
    assert len(storage.leftovers(url)) == 1
    with ss.CheckpointManager(url) as mgr:
        assert storage.leftovers(url) == []
        assert mgr.steps() == [1]
        np.testing.assert_array_equal(mgr.load()["w"], np.arange(3))


def test_a_damaged_commit_marker_is_a_damaged_step_never_garbage(
        s3_server: dict[str, Any], storage: S3Storage, base_url: str) -> None:
    """A COMMITTED marker that is there but unreadable: the step is listed (and refused
    as damaged when read), a manager goes back past it, and neither the manager's
    cleanup nor gc takes its data for a killed save's leftovers (it deleted it all)."""
    from statestream.storage import collect_garbage

    client, bucket = s3_server["client"], s3_server["bucket"]
    d = f"{base_url}/run"
    with ss.CheckpointManager(d, async_save=False) as mgr:
        for s in (1, 2):
            mgr.save(s, {"w": np.arange(100.0) + s, "step": s})
    _, prefix = split_url(d)
    marker = f"{prefix}/step_0000000002/COMMITTED"

    def objects() -> list[str]:
        got = client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/step_0000000002/")
        return sorted(o["Key"] for o in got.get("Contents", []))

    client.put_object(Bucket=bucket, Key=marker, Body=b"{not json")
    before = objects()
    assert len(before) >= 3  # the marker, the manifest, data
    with ss.CheckpointManager(d) as mgr:  # opening cleans up leftovers
        assert mgr.steps() == [1, 2]
        with pytest.warns(RuntimeWarning, match="step 2 .* is damaged, loading step 1"):
            assert mgr.load()["step"] == 1
    assert collect_garbage(storage, d, max_age_s=0) == []
    assert objects() == before
    with pytest.raises(ss.CheckpointCorruptError, match="commit marker"):
        ss.load(f"{d}/step_0000000002")


@pytest.mark.timeout(120)
def test_an_overwrite_whose_old_root_cannot_be_deleted_still_commits(
        s3_server: dict[str, Any], storage: S3Storage, base_url: str) -> None:
    """Found on Azurite, whose bulk delete answers 500 to a SAS: an overwrite committed
    (its marker names the new root) and then raised the failure of deleting the
    replaced root, so the caller took a committed save for a failed one. The local
    backend ignores a failed removal of the replaced directory; so do object stores
    now: the old root is an unreferenced leftover for gc."""
    url = f"{base_url}/a"
    ss.save(url, {"w": np.arange(10.0)})
    proxy = OutageProxy(int(s3_server["endpoint"].rsplit(":", 1)[1]))
    proxy.refuse = b"?delete"  # S3's DeleteObjects: POST /bucket?delete
    set_backend("s3", S3Storage(_options(s3_server, endpoint=f"http://127.0.0.1:{proxy.port}",
                                         **_FAST_FAIL)))
    try:
        ss.save(url, {"w": np.arange(10.0) + 1}, overwrite=True)
    finally:
        set_backend("s3", storage)
        proxy.close()
    np.testing.assert_array_equal(ss.load(url)["w"], np.arange(10.0) + 1)
    assert [x.target for x in storage.leftovers(base_url)] == ["a"]  # the old root


@pytest.mark.timeout(120)
def test_gc_reports_a_store_that_refuses_the_deletes(
        s3_server: dict[str, Any], storage: S3Storage, base_url: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Found by an audit: every error removing a leftover was skipped, so a store that
    refused the deletes read as "0 leftover staging directories removed", exit 0."""
    from statestream.cli import main
    from statestream.storage import collect_garbage

    ss.save(f"{base_url}/a", {"x": np.arange(3)})
    txn = storage.begin_write(f"{base_url}/a", overwrite=True)  # an overwrite killed
    txn.write_bytes("manifest.json", b"{}")
    (left,) = storage.leftovers(base_url)
    proxy = OutageProxy(int(s3_server["endpoint"].rsplit(":", 1)[1]))
    proxy.refuse = b"?delete"  # S3's DeleteObjects: POST /bucket?delete
    via_proxy = S3Storage(_options(s3_server, endpoint=f"http://127.0.0.1:{proxy.port}",
                                   **_FAST_FAIL))
    set_backend("s3", via_proxy)
    try:
        with pytest.raises(ss.StorageError, match=left.path):
            collect_garbage(via_proxy, base_url, max_age_s=0)
        assert main(["gc", base_url, "--max-age-hours", "0"]) == 2
    finally:
        set_backend("s3", storage)
        proxy.close()
    out, err = capsys.readouterr()
    assert "0 leftover staging directories removed" in out
    (line,) = err.splitlines()
    assert line.startswith("error: ") and left.path in line
    assert storage.leftovers(base_url) == [left]  # still there, as the error says
    assert collect_garbage(storage, base_url, max_age_s=0) == [left.path]
