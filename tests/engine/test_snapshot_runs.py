"""A snapshot at once copies consecutive small host chunks in runs (engine/_snapshot.py).

Per chunk, the budget, the staging pool and the ledger each took a lock, and NumPy's
copy released the interpreter lock and waited to take it back: about 8 us a chunk, 0.16
s of the blocking phase of a warm save_async of 20,000 small tensors
(benchmarks/async_small.py --pause 1). A run takes each of those once.
"""

from __future__ import annotations

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
