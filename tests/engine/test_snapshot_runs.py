"""A snapshot at once copies consecutive small host chunks in runs (engine/_snapshot.py).

Per chunk, the budget, the staging pool and the ledger each took a lock, and NumPy's
copy released the interpreter lock and waited to take it back: about 8 us a chunk, 0.16
s of the blocking phase of a warm save_async of 20,000 small tensors
(benchmarks/async_small.py --pause 1). A run takes each of those once.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import statestream as ss
from statestream import _hooks
from statestream.engine._snapshot import RUN_BYTES, RUN_CHUNKS, SMALL_CHUNK_BYTES, _runs
from statestream.plan import WriteItem


def _item(array: int, nbytes: int) -> WriteItem:
    return WriteItem(array, 0, (0,), (nbytes,), nbytes, 0, 0, 0)


def _job(staged: set[int], n: int) -> Any:
    arrays = [SimpleNamespace(stage=object() if i in staged else None) for i in range(n)]
    return SimpleNamespace(collector=SimpleNamespace(arrays=arrays))


def test_runs_group_consecutive_small_host_chunks_in_order() -> None:
    small, big = 1024, SMALL_CHUNK_BYTES
    sizes = [small] * 300 + [big] + [small] * 3 + [small] + [small] * 2
    items = [_item(i, n) for i, n in enumerate(sizes)]
    runs = _runs(_job({304}, len(items)), items)  # array 304: a device array
    assert [it for run in runs for it in run] == items  # every chunk once, in order
    assert [len(r) for r in runs] == [RUN_CHUNKS, 300 - RUN_CHUNKS, 1, 3, 1, 2]
    assert runs[2][0].nbytes == big and runs[4][0].array == 304


def test_runs_stop_at_their_byte_limit() -> None:
    n = SMALL_CHUNK_BYTES - 8
    items = [_item(i, n) for i in range(2 * RUN_BYTES // n + 3)]
    runs = _runs(_job(set(), len(items)), items)
    assert all(sum(it.nbytes for it in r) <= RUN_BYTES for r in runs)
    assert [it for run in runs for it in run] == items


def _mixed() -> dict[str, Any]:
    rng = np.random.default_rng(0)
    state: dict[str, Any] = {f"s{i:03d}": rng.standard_normal(256).astype(np.float32)
                             for i in range(600)}
    state["big"] = rng.standard_normal(1 << 18).astype(np.float32)  # 1 MiB: alone
    state["t"] = rng.standard_normal((64, 48)).astype(np.float32).T  # writers' copy
    state["swapped"] = rng.standard_normal(100).astype(">f8")
    state["scalar"] = np.float64(2.5)
    state["i8"] = np.arange(7, dtype=np.int8)
    state["empty"] = np.zeros((0, 3), np.float32)
    return state


def test_a_warm_snapshot_of_mixed_chunks_copies_them_all(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    state = _mixed()
    state["torch"] = {f"w{i}": torch.randn(33) for i in range(300)}
    state["torch_t"] = torch.randn(20, 30).t()
    raced: list[int] = []
    _hooks.register("async.race_begins", lambda: raced.append(1))
    try:
        ss.save_async(tmp_path / "a", state).result()  # cold: races the writers
        time.sleep(0.5)  # its warm-up maps every buffer for the next
        raced.clear()
        h = ss.save_async(tmp_path / "b", state)
        assert raced == []  # copied at once
        h.result()
    finally:
        _hooks.clear()
    got = ss.load(tmp_path / "b")
    for k, v in state.items():
        if k.startswith("torch"):
            continue
        np.testing.assert_array_equal(got[k], v, err_msg=k)
        # (a byte-swapped array loads in the machine's byte order)
        assert np.asarray(got[k]).dtype == np.asarray(v).dtype.newbyteorder("="), k
    for k, v in state["torch"].items():
        np.testing.assert_array_equal(np.asarray(got["torch"][k]), v.numpy(), err_msg=k)
    np.testing.assert_array_equal(np.asarray(got["torch_t"]), state["torch_t"].numpy())


def test_a_run_that_fails_names_its_key_path_and_commits_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = _mixed()
    ss.save_async(tmp_path / "a", state).result()
    time.sleep(0.5)
    from statestream.engine import _ledger

    real = _ledger.StagingLedger.copy_out_run

    def broken(self: Any, items: Any) -> None:
        for it in items:  # a provider whose chunk fails for one array
            if self._key_of(it.array) == "s123":
                self._arrays[it.array] = SimpleNamespace(
                    copy_into=None, chunk=lambda *a: (_ for _ in ()).throw(OSError("gone")))
        real(self, items)

    monkeypatch.setattr(_ledger.StagingLedger, "copy_out_run", broken)
    with pytest.raises(ss.UnsupportedTypeError, match="'s123'.*gone"):
        ss.save_async(tmp_path / "b", state)
    monkeypatch.undo()
    assert not (tmp_path / "b").exists()
    ss.save_async(tmp_path / "c", state).result()  # the budget and buffers came back
    np.testing.assert_array_equal(ss.load(tmp_path / "c")["s123"], state["s123"])


# -- the race: saves whose staging is not warm copy small chunks in runs too -------------


def test_a_race_caps_its_runs_at_a_share_of_the_budget() -> None:
    items = [_item(i, 1000) for i in range(40)] + [_item(40, 5000)] + [_item(41, 10)]
    runs = _runs(_job(set(), len(items)), items, 3000)
    assert [len(r) for r in runs] == [3] * 13 + [1, 1, 1]  # 5000 > 3000: alone
    assert [it for run in runs for it in run] == items


def _race_runs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, list[Any], int]]:
    # (ledger, chunks, bytes kept) of every race_copy_run of the saves to come
    from statestream.engine import _ledger

    real = _ledger.StagingLedger.race_copy_run
    calls: list[tuple[Any, list[Any], int]] = []

    def counted(self: Any, items: Any, check: Any) -> int:
        kept = real(self, items, check)
        calls.append((self, list(items), kept))
        return kept

    monkeypatch.setattr(_ledger.StagingLedger, "race_copy_run", counted)
    return calls


def test_a_cold_snapshot_races_the_writers_with_runs_of_small_chunks(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    state = _mixed()
    state["torch"] = {f"w{i}": torch.randn(33) for i in range(300)}
    ss.release_staging()  # nothing warm: the snapshot races the writers
    calls = _race_runs(monkeypatch)
    ss.save_async(tmp_path / "a", state).result()
    assert calls and max(len(its) for _, its, _ in calls) > 1  # runs, not chunk by chunk
    ledger = calls[0][0]
    assert ledger.copied_bytes + ledger.direct_bytes == sum(  # every chunk covered once
        np.asarray(v).nbytes for k, v in state.items() if k != "torch") + 300 * 33 * 4
    got = ss.load(tmp_path / "a")
    for k, v in state.items():
        if k != "torch":
            np.testing.assert_array_equal(got[k], v, err_msg=k)
    for k, v in state["torch"].items():
        np.testing.assert_array_equal(np.asarray(got["torch"][k]), v.numpy(), err_msg=k)
    from statestream.engine._staging import host_pool

    assert host_pool().lent_bytes == 0


def test_chunks_a_writer_took_while_their_run_copied_go_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The copy thread claimed a run, then every writer went past it and wrote its
    # chunks from the state: the run's copies are given back, not kept, and their
    # budget released; the save is whole.
    from statestream.engine import _ledger

    state = {f"s{i:03d}": np.full(256, i, np.float32) for i in range(400)}
    real, source = _ledger.StagingLedger._copy_small, _ledger.StagingLedger.race_source
    held: list[Any] = []
    copying = threading.Event()

    def slow(self: Any, it: Any, buf: Any) -> None:
        if not held:
            held.append(it)
            copying.set()
            deadline = time.monotonic() + 60
            while self._uncovered > 0 and time.monotonic() < deadline:
                time.sleep(0.005)  # the writers cover every chunk, this run's too
        real(self, it, buf)

    def after_a_claim(self: Any, item: Any) -> Any:  # the writer reads once a run is claimed
        assert copying.wait(60)
        return source(self, item)

    monkeypatch.setattr(_ledger.StagingLedger, "_copy_small", slow)
    monkeypatch.setattr(_ledger.StagingLedger, "race_source", after_a_claim)
    calls = _race_runs(monkeypatch)
    ss.release_staging()
    ss.save_async(tmp_path / "a", state, io=ss.IOOptions(num_threads=1)).result()
    (run,) = [c for c in calls if any(it is held[0] for it in c[1])]
    assert run[0]._uncovered == 0 and run[2] == 0  # nothing of the held run kept
    assert run[0].direct_bytes + run[0].copied_bytes == 400 * 256 * 4
    got = ss.load(tmp_path / "a")
    for k, v in state.items():
        np.testing.assert_array_equal(got[k], v, err_msg=k)
    from statestream.engine._staging import host_pool

    assert host_pool().lent_bytes == 0


def test_a_run_copied_after_a_change_fails_the_save_naming_the_array(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A lazy snapshot's run copied a tensor after an unguarded in-place change: its
    # check, before the run counts as covered, finds the version moved on. (The
    # writer waits until the copies covered everything, so none of it is read
    # from the state and checked by the writer instead.)
    torch = pytest.importorskip("torch")
    from statestream.engine import _ledger

    state = {f"w{i:03d}": torch.ones(64) for i in range(300)}
    copy, source = _ledger.StagingLedger._copy_small, _ledger.StagingLedger.race_source

    def changing(self: Any, it: Any, buf: Any) -> None:
        if self._key_of(it.array) == "w150":
            state["w150"].add_(1.0)  # as an unguarded optimizer.step() would
        copy(self, it, buf)

    def late(self: Any, item: Any) -> Any:
        deadline = time.monotonic() + 60
        while self._uncovered > 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        return source(self, item)

    monkeypatch.setattr(_ledger.StagingLedger, "_copy_small", changing)
    monkeypatch.setattr(_ledger.StagingLedger, "race_source", late)
    calls = _race_runs(monkeypatch)
    ss.release_staging()
    h = ss.save_async(tmp_path / "a", state, lazy=True)
    with pytest.raises(ss.CheckpointError, match="w150") as err:
        h.result(timeout=120)
    assert "w149" not in str(err.value) and "w151" not in str(err.value)
    assert sum(kept for _, _, kept in calls) == 300 * 64 * 4  # all copied by runs
    assert not (tmp_path / "a").exists()
