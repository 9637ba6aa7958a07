"""A conformance suite every Storage backend must pass.

Subclass :class:`StorageTests` in a pytest module and provide two fixtures:
``storage`` (the backend) and ``base_url`` (a fresh, empty location under
which the tests create checkpoints: a directory path or an ``s3://`` URL).
Runs with pytest; needs no other dependency.

Besides commit semantics, leases and garbage collection, it runs every
backend under :class:`statestream.testing.faults.FaultyStorage`: each
write-side call of a save fails in turn (ENOSPC, EIO, or a stall then
ETIMEDOUT), and the backend must show the same guarantees as any other:
nothing committed, the previous checkpoint intact, no thread or staging
buffer left behind.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from typing import Any

import numpy as np
import pytest

import statestream as ss
from statestream.format import COMMIT_NAME, MANIFEST_NAME, encode_commit

__all__ = ["StorageTests"]


def _url(base: str, name: str) -> str:
    return f"{base.rstrip('/')}/{name}" if "://" in base else os.path.join(base, name)


def _read_back(storage: Any, url: str, n: int) -> bytes:
    """The first ``n`` bytes of the committed data file ``data/r0-0.bin`` at ``url``."""
    r = storage.open_read(url)
    try:
        got = bytearray(n)
        r.read_into("data/r0-0.bin", 0, [got])
        return bytes(got)
    finally:
        r.close()


class StorageTests:
    """Behaviour shared by every backend (local disk, object stores, ...)."""

    def _write(self, storage: Any, url: str, payload: bytes, overwrite: bool = False) -> Any:
        txn = storage.begin_write(url, overwrite=overwrite)
        w = txn.create_file("data/r0-0.bin", len(payload))
        w.write_at([payload[:3], payload[3:]], 0)
        w.finish()
        txn.write_bytes(MANIFEST_NAME, b"{}")
        txn.write_bytes(COMMIT_NAME, encode_commit(b"{}"))
        return txn

    def test_invisible_until_commit(self, storage: Any, base_url: str) -> None:
        url = _url(base_url, "a")
        txn = self._write(storage, url, b"hello world")
        assert not storage.is_committed(url)
        with pytest.raises(ss.CheckpointNotFoundError):
            storage.open_read(url)
        txn.commit()
        assert storage.is_committed(url)
        r = storage.open_read(url)
        try:
            assert r.file_size("data/r0-0.bin") == 11
            buf = bytearray(5)
            r.read_into("data/r0-0.bin", 6, [buf])
            assert bytes(buf) == b"world"
            with pytest.raises(ss.TruncatedFileError):
                r.read_into("data/r0-0.bin", 8, [bytearray(10)])
        finally:
            r.close()

    def test_write_at_is_done_with_its_buffers_on_return(self, storage: Any,
                                                         base_url: str) -> None:
        # save_async reuses staging buffers as soon as write_at returns, unless the
        # backend declares that it keeps referencing them (retains_buffers).
        if storage.capabilities.retains_buffers:
            pytest.skip("the backend keeps buffers until finish(); callers do not reuse them")
        url = _url(base_url, "reuse")
        txn = storage.begin_write(url, overwrite=False)
        w = txn.create_file("data/r0-0.bin", 0)
        buf = bytearray(b"A" * 4096)
        w.write_at([buf], 0)
        buf[:] = b"B" * 4096
        w.write_at([buf], 4096)
        buf[:] = b"C" * 4096
        w.finish()
        txn.write_bytes(MANIFEST_NAME, b"{}")
        txn.write_bytes(COMMIT_NAME, encode_commit(b"{}"))
        txn.commit()
        assert _read_back(storage, url, 8192) == b"A" * 4096 + b"B" * 4096

    def test_writes_of_any_size_and_lent_buffers_reach_the_file(self, storage: Any,
                                                                base_url: str) -> None:
        # Sizes below, at and across 1 MiB and several MiB, in one to three buffers a
        # call, with a gap; each write_at buffer is overwritten as soon as it returns.
        # A writer with lend_at gets every other call through it, and those buffers
        # stay as they are until finish().
        rng = np.random.default_rng(3)
        mib = 1 << 20
        sizes = [1, mib - 1, 1, mib, 3 * mib + 17, 100, 2 * mib, mib // 2, mib // 2 + 1,
                 *rng.integers(1, 3 * mib, 4).tolist()]
        url = _url(base_url, "sizes")
        txn = storage.begin_write(url, overwrite=False)
        w = txn.create_file("data/r0-0.bin", 0)
        lend = getattr(w, "lend_at", None)
        want, pos, lent = bytearray(), 0, []
        for i, n in enumerate(sizes):
            data = rng.integers(0, 256, n, dtype=np.uint8)
            want += data.tobytes()
            bufs = np.array_split(data, 1 + i % 3)
            if lend is not None and i % 2:
                lend(bufs, pos)
                lent.append(data)
            else:
                w.write_at(bufs, pos)
                data[:] = 0
            pos += n
        w.write_at([b"tail"], pos + 10)
        want += bytes(10) + b"tail"
        w.finish()
        txn.write_bytes(MANIFEST_NAME, b"{}")
        txn.write_bytes(COMMIT_NAME, encode_commit(b"{}"))
        txn.commit()
        assert _read_back(storage, url, len(want)) == bytes(want)

    def test_racing_writers_without_overwrite_commit_exactly_one(
            self, storage: Any, base_url: str) -> None:
        # Both begin before either commits, so both pass any check made at begin.
        url = _url(base_url, "race")
        first = self._write(storage, url, b"first writer")
        second = self._write(storage, url, b"second one!!")
        first.commit()
        with pytest.raises(ss.CheckpointExistsError):
            second.commit()
        assert _read_back(storage, url, 12) == b"first writer"

    def test_abort_leaves_nothing(self, storage: Any, base_url: str) -> None:
        url = _url(base_url, "b")
        txn = self._write(storage, url, b"x" * 100)
        txn.abort()
        assert not storage.is_committed(url)
        assert "b" not in storage.list(base_url)

    def test_exists_and_overwrite(self, storage: Any, base_url: str) -> None:
        url = _url(base_url, "c")
        self._write(storage, url, b"old").commit()
        with pytest.raises(ss.CheckpointExistsError):
            storage.begin_write(url, overwrite=False)
        self._write(storage, url, b"new!", overwrite=True).commit()
        r = storage.open_read(url)
        try:
            assert r.file_size("data/r0-0.bin") == 4
        finally:
            r.close()

    def test_rejects_escaping_names(self, storage: Any, base_url: str) -> None:
        txn = storage.begin_write(_url(base_url, "d"), overwrite=False)
        try:
            with pytest.raises(ss.UnsafeCheckpointError):
                txn.create_file("data/../../x.bin", 1)
        finally:
            txn.abort()

    def test_delete_uncommits(self, storage: Any, base_url: str) -> None:
        url = _url(base_url, "e")
        self._write(storage, url, b"abc").commit()
        storage.delete(url)
        assert not storage.is_committed(url)
        with pytest.raises(ss.CheckpointNotFoundError):
            storage.open_read(url)

    def test_repeated_async_saves_keep_each_snapshot(self, storage: Any,
                                                      base_url: str) -> None:
        # Same shapes every save (so staging buffers would be recycled within and
        # across saves), the state mutated right after each snapshot: every
        # checkpoint must hold exactly the values of its own snapshot.
        state: dict[str, np.ndarray] = {"a": np.zeros((64, 1024), np.float32),
                                        "b": np.zeros(70_000, np.int64)}
        io = ss.IOOptions(max_chunk_bytes=64 << 10)
        mem = ss.MemoryOptions(memory_budget_bytes=256 << 10)
        for i, lazy in enumerate([False, True, False, True]):
            for v in state.values():
                v[...] = i
            h = ss.save_async(_url(base_url, f"snap{i}"), state, lazy=lazy, io=io, memory=mem)
            h.wait_snapshot()
            for v in state.values():
                v += 100
            h.result()
        for i in range(4):
            got = ss.load(_url(base_url, f"snap{i}"))
            assert (got["a"] == i).all() and (got["b"] == i).all(), i

    def test_api_round_trip(self, storage: Any, base_url: str) -> None:
        url = _url(base_url, "f")
        w = np.arange(100_000, dtype=np.float32).reshape(1000, 100)
        state: dict[str, Any] = {"w": w,
                 "small": [np.int8(3), b"bytes", "text", 2**80]}
        ss.save(url, state, io=ss.IOOptions(max_chunk_bytes=64 << 10))
        out = ss.load(url)
        np.testing.assert_array_equal(out["w"], state["w"])
        assert out["small"][1:] == [b"bytes", "text", 2**80]
        assert ss.metadata(url).tree["w"].shape == (1000, 100)
        assert ss.verify(url).ok
        assert ss.load(url, items=["w"])["w"].sum() == w.sum()
        h = ss.save_async(url, {"w": w + 1}, overwrite=True)
        h.result()
        np.testing.assert_array_equal(ss.load(url)["w"], w + 1)

    def test_overwrite_replaces_a_path_created_meanwhile(self, storage: Any,
                                                         base_url: str) -> None:
        # With overwrite=True the last writer wins, even over a checkpoint that
        # appeared after this save began.
        url = _url(base_url, "lww")
        mine = self._write(storage, url, b"last writer", overwrite=True)
        self._write(storage, url, b"came first", overwrite=True).commit()
        mine.commit()
        assert _read_back(storage, url, 11) == b"last writer"

    def test_lease_is_exclusive_until_released(self, storage: Any, base_url: str) -> None:
        path = _url(base_url, "lease")
        lease = storage.acquire_lease(path, holder="pid 1 on a", ttl_s=60)
        try:
            with pytest.raises(ss.ManagerLockedError, match="pid 1 on a"):
                storage.acquire_lease(path, holder="pid 2 on b", ttl_s=60)
            lease.renew()
            with pytest.raises(ss.ManagerLockedError):
                storage.acquire_lease(path, holder="pid 2 on b", ttl_s=60)
        finally:
            lease.release()
        lease.release()  # idempotent
        storage.acquire_lease(path, holder="pid 2 on b", ttl_s=60).release()

    def test_garbage_collection_spares_a_save_in_progress(self, storage: Any,
                                                           base_url: str) -> None:
        from statestream.storage import collect_garbage

        url = _url(base_url, "busy")
        txn = self._write(storage, url, b"in progress")
        collect_garbage(storage, base_url, max_age_s=3600)
        ss.save(_url(base_url, "other"), {"x": np.arange(3)})  # a save collects too
        txn.commit()
        assert storage.is_committed(url)

    @pytest.mark.parametrize("mode", ["save", "save_async", "lazy"])
    @pytest.mark.parametrize("kind", ["enospc", "eio", "stall"])
    def test_a_fault_at_any_storage_call_commits_nothing(
            self, storage: Any, base_url: str, kind: str, mode: str) -> None:
        """Every write-side call of a save fails in turn: the save raises a
        StorageError carrying the errno, nothing is committed, the previous
        checkpoint still loads, and no thread or staging buffer is left behind."""
        from statestream.engine import host_pool, pinned_pool
        from statestream.testing.faults import StorageFault, faulty_backend

        url = _url(base_url, f"faulty-{kind}-{mode}")
        old = {"a": np.arange(3000, dtype=np.float32), "b": np.full(700, 7, np.int64)}
        ss.save(url, old)
        new = {"a": np.ones(3000, np.float32), "b": np.zeros(700, np.int64)}
        io = ss.IOOptions(max_chunk_bytes=4 << 10, num_threads=2)

        def attempt(fault: StorageFault) -> None:
            with faulty_backend(url, fault):
                if mode == "save":
                    ss.save(url, new, overwrite=True, io=io)
                else:
                    ss.save_async(url, new, overwrite=True, io=io,
                                  lazy=mode == "lazy").result()

        counting = StorageFault(kind)
        attempt(counting)  # counts the calls (and overwrites with `new`)
        assert counting.calls >= 5, counting
        ss.save(url, old, overwrite=True)
        threads = set(threading.enumerate())
        lent = (host_pool().lent_bytes, pinned_pool().lent_bytes)
        for k in range(1, counting.calls + 1):
            fault = StorageFault(kind, at=k, stall_s=0.05)
            with pytest.raises(ss.StorageError) as ei:
                attempt(fault)
            assert fault.fired is not None, k
            assert ei.value.errno == _FAULT_ERRNO[kind], (k, fault.fired, ei.value)
            got = ss.load(url)
            np.testing.assert_array_equal(got["a"], old["a"], err_msg=f"{k}: {fault.fired}")
            np.testing.assert_array_equal(got["b"], old["b"])
            assert not [n for n in storage.list(base_url) if n.startswith(".faulty")], k
        _wait_for_threads(threads)
        assert (host_pool().lent_bytes, pinned_pool().lent_bytes) == lent


_FAULT_ERRNO = {"enospc": errno.ENOSPC, "eio": errno.EIO, "stall": errno.ETIMEDOUT}


def _wait_for_threads(before: set[threading.Thread]) -> None:
    """Threads a failed save started must end (they may take a moment to wind down)."""
    deadline = time.monotonic() + 60
    while True:
        extra = [t for t in threading.enumerate() if t not in before and t.is_alive()]
        if not extra:
            return
        assert time.monotonic() < deadline, f"threads left behind: {extra}"
        time.sleep(0.05)
