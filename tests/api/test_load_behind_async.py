"""``ss.load`` while a ``save_async`` is in flight: its scratch buffers share one memory
budget with the save's staged copies and the idle staging, and it never deadlocks.

Before, a load kept a budget of its own beside the save's (1 GiB state, 256 MiB budget,
a zstd checkpoint loaded while save_async wrote: peak RSS +331 MiB against +274 now,
benchmarks/sync_behind_async.py --kind load). The hooks hold the save's writer at a
known point; the timeouts only guard against hangs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import statestream as ss
from statestream import _hooks
from statestream.engine import _read, host_pool

_WAIT_S = 120
MiB = 1 << 20
BUDGET = 8 * MiB
MEM = ss.MemoryOptions(memory_budget_bytes=BUDGET)
ONE_WRITER = ss.IOOptions(num_threads=1)


def _state() -> dict[str, np.ndarray]:
    # exactly the budget: once staged, the save's copies hold all of it
    return {f"w{i}": np.full(MiB // 8, i, np.float64) for i in range(8)}


@pytest.fixture
def compressed(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    """A zstd checkpoint: its chunks are read through scratch buffers."""
    rng = np.random.default_rng(0)
    saved = {f"c{i}": rng.standard_normal(MiB // 4, np.float32) for i in range(4)}
    ss.save(tmp_path / "c", saved, compression="zstd")
    return tmp_path / "c", saved


@pytest.fixture(autouse=True)
def _clean() -> Iterator[None]:
    ss.release_staging()
    yield
    _hooks.clear()
    ss.release_staging()


def _many_chunks() -> dict[str, np.ndarray]:
    # the writer writes at most 901 chunks a batch (engine/_write.py): the first
    # batch is the small ones, and the 7 MiB after them are still staged when it
    # reports its progress
    return {**{f"a{i:03d}": np.full(128, i, np.float64) for i in range(901)},
            **{f"b{i}": np.full(MiB // 8, i, np.float64) for i in range(7)}}


def _warm_staging(tmp_path: Path, state: dict[str, np.ndarray] | None = None) -> None:
    """A first save_async, committed, with its staging for the next one mapped."""
    state = _state() if state is None else state
    ss.save_async(tmp_path / "first", state, memory=MEM).result(timeout=_WAIT_S)
    need = sum(v.nbytes for v in state.values())
    deadline = time.monotonic() + _WAIT_S
    while host_pool().idle_bytes < need and time.monotonic() < deadline:
        time.sleep(0.01)
    assert host_pool().idle_bytes == need


class _HeldWriter:
    """Holds the save's writer after its first chunk is written (its staged copies all
    still lent) until ``release`` is set, or a load waits for room in the pool."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.held = threading.Event()

    def hold(self) -> None:
        if not threading.current_thread().name.startswith("statestream-write-") or (
                self.held.is_set()):
            return
        self.held.set()
        deadline = time.monotonic() + _WAIT_S
        while not self.release.wait(0.005) and time.monotonic() < deadline:
            if host_pool().waiting:
                return


def _record_held(monkeypatch: pytest.MonkeyPatch, seen: list[int]) -> None:
    """Record, as each read request of the load starts (its scratch granted), the host
    memory held: the staging pool's lent and idle buffers plus the request's scratch."""
    real = _read._read_request

    def recording(reader: Any, name: str, req: Any, *args: Any, **kwargs: Any) -> Any:
        if threading.current_thread().name == "loader":
            pool = host_pool()
            seen.append(pool.lent_bytes + pool.idle_bytes + _read._scratch_bytes(req))
        return real(reader, name, req, *args, **kwargs)

    monkeypatch.setattr(_read, "_read_request", recording)


def _load_on_thread(path: Path, **kw: Any) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(ss.load(path, io=ONE_WRITER, memory=MEM, **kw))
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            out.append(exc)

    t = threading.Thread(target=run, name="loader")
    t.start()
    return t, out


def test_a_load_beside_a_save_async_stays_within_one_budget(
        tmp_path: Path, compressed: tuple[Path, dict[str, np.ndarray]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    # warm staging: the save_async copies the whole state (the budget) before it
    # returns, and its writer is held with every copy lent. Before, the load's
    # scratch came on top of them (the budget + 1 MiB); now it waits for the
    # writer to give copies back
    path, saved = compressed
    _warm_staging(tmp_path)
    seen: list[int] = []
    _record_held(monkeypatch, seen)
    held = _HeldWriter()
    _hooks.register("save.chunk_written", held.hold)
    h = ss.save_async(tmp_path / "second", _state(), memory=MEM, io=ONE_WRITER)
    assert held.held.wait(_WAIT_S)
    t, out = _load_on_thread(path)
    t.join(_WAIT_S)
    held.release.set()
    h.result(timeout=_WAIT_S)
    assert not t.is_alive() and len(out) == 1 and not isinstance(out[0], BaseException), out
    assert all(np.array_equal(out[0][k], v) for k, v in saved.items())
    assert seen and max(seen) <= BUDGET, [s / MiB for s in seen]
    assert ss.verify(tmp_path / "second").ok


def test_a_load_after_a_save_async_frees_idle_staging_to_stay_within_the_budget(
        tmp_path: Path, compressed: tuple[Path, dict[str, np.ndarray]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    # the staging kept between saves fills the budget: the load's scratch frees
    # idle buffers for itself, least recently used first (before: on top of them)
    path, saved = compressed
    _warm_staging(tmp_path)
    seen: list[int] = []
    _record_held(monkeypatch, seen)
    t, out = _load_on_thread(path)
    t.join(_WAIT_S)
    assert len(out) == 1 and not isinstance(out[0], BaseException), out
    assert seen and max(seen) <= BUDGET, [s / MiB for s in seen]
    assert host_pool().idle_bytes < BUDGET  # what the load took is gone
    assert host_pool().reserved_bytes == 0


def test_a_load_does_not_wait_for_the_save_in_flight_to_commit(
        tmp_path: Path, compressed: tuple[Path, dict[str, np.ndarray]]) -> None:
    # the save is held before its commit, its data written: the load runs now
    path, saved = compressed
    _warm_staging(tmp_path)
    go = threading.Event()

    def hold() -> None:
        if threading.current_thread().name == "statestream-save":
            go.wait(_WAIT_S)

    _hooks.register("commit.manifest_written", hold)
    h = ss.save_async(tmp_path / "second", _state(), memory=MEM)
    try:
        got = ss.load(path, memory=MEM)
        assert not h.done()
    finally:
        go.set()
    h.result(timeout=_WAIT_S)
    assert all(np.array_equal(got[k], v) for k, v in saved.items())


def test_a_load_from_a_save_async_progress_callback_does_not_wait_for_that_save(
        tmp_path: Path, compressed: tuple[Path, dict[str, np.ndarray]]) -> None:
    # the callback runs on the save's writer, which holds the staged copies the load
    # would wait for: it reserves beside them instead of waiting forever
    path, saved = compressed
    state = _many_chunks()
    _warm_staging(tmp_path, state)
    got: list[Any] = []
    lent: list[int] = []

    def progress(done: int, total: int) -> None:
        if not got:
            lent.append(host_pool().lent_bytes)
            got.append(ss.load(path, io=ONE_WRITER, memory=MEM))

    h = ss.save_async(tmp_path / "second", state, memory=MEM, io=ONE_WRITER,
                      progress=progress)
    h.result(timeout=_WAIT_S)
    assert lent and lent[0] >= 7 * MiB  # more than the load's scratch leaves room for
    assert all(np.array_equal(got[0][k], v) for k, v in saved.items())
    assert host_pool().reserved_bytes == 0


class _Loads:
    """A stateful value whose state_dict() loads a checkpoint (while a save walks it)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.got: list[Any] = []

    def state_dict(self) -> dict[str, Any]:
        self.got.append(ss.load(self.path, memory=MEM))
        return {"x": np.ones(3)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        pass


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_load_from_a_state_dict_a_save_walks(
        tmp_path: Path, compressed: tuple[Path, dict[str, np.ndarray]],
        asynchronous: bool) -> None:
    path, saved = compressed
    _warm_staging(tmp_path)
    rec = _Loads(path)
    state = {**_state(), "r": rec}
    if asynchronous:
        ss.save_async(tmp_path / "second", state, memory=MEM).result(timeout=_WAIT_S)
    else:
        ss.save(tmp_path / "second", state, memory=MEM)
    assert len(rec.got) == 1
    assert all(np.array_equal(rec.got[0][k], v) for k, v in saved.items())


def test_loading_the_checkpoint_a_save_async_is_writing(tmp_path: Path) -> None:
    # not committed yet: refused, naming the save in flight; over an existing one
    # (overwrite=True): the committed old state, until the new one commits
    p = tmp_path / "ck"
    go = threading.Event()

    def hold() -> None:
        if threading.current_thread().name == "statestream-save":
            go.wait(_WAIT_S)

    _hooks.register("commit.manifest_written", hold)
    h = ss.save_async(p, {"w": np.ones(4)})
    try:
        with pytest.raises(ss.CheckpointNotFoundError, match="save_async to it is in flight"):
            ss.load(p)
    finally:
        go.set()
    h.result(timeout=_WAIT_S)
    go.clear()
    h = ss.save_async(p, {"w": np.full(4, 2.0)}, overwrite=True)
    try:
        assert ss.load(p)["w"].tolist() == [1.0] * 4
    finally:
        go.set()
    h.result(timeout=_WAIT_S)
    assert ss.load(p)["w"].tolist() == [2.0] * 4
