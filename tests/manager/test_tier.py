"""The manager's local tier: commit locally, persist in the background, load from the best copy.

One process here (real files, a real SIGKILLed child for the crash case);
the multi-process cases are in tests/distributed/test_tier_multiprocess.py and
S3 behind a local tier in tests/storage/test_s3_tier.py.
"""

from __future__ import annotations

import gc
import glob
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
import weakref

import numpy as np
import pytest

import statestream as ss
from statestream import _hooks
from statestream.engine import copy_checkpoint

STATE_SRC = """
import numpy as np

def state_at(step):
    g = np.random.default_rng(step)
    return {"step": step,
            "params": {"w": (np.arange(300_000, dtype=np.float32) + step).reshape(300, 1000),
                       "b": g.integers(-2**40, 2**40, size=10_000, dtype=np.int64)},
            "loader": {"index": step * 32, "name": f"step-{step}"}}
"""
_ns: dict = {}
exec(STATE_SRC, _ns)
state_at = _ns["state_at"]
CHUNK = 256 << 10


def _equal(got, want, path="") -> None:
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), path
        for k in want:
            _equal(got[k], want[k], f"{path}/{k}")
    elif isinstance(want, np.ndarray):
        assert isinstance(got, np.ndarray) and got.dtype == want.dtype, path
        np.testing.assert_array_equal(got, want, err_msg=path)
    else:
        assert type(got) is type(want) and got == want, path


def _mgr(tmp_path, **kw):
    kw.setdefault("io", ss.IOOptions(max_chunk_bytes=CHUNK))
    return ss.CheckpointManager(str(tmp_path / "persist"), local_tier=str(tmp_path / "local"),
                                **kw)


@pytest.mark.parametrize("mode", ["sync", "async", "lazy"])
def test_saves_commit_locally_and_persist(tmp_path, mode):
    with _mgr(tmp_path, async_save=mode != "sync", lazy=mode == "lazy",
              local_keep_policy=ss.KeepLatest(2), keep_policy=ss.KeepLatest(3)) as mgr:
        for step in range(1, 6):
            assert mgr.save(step, state_at(step))
        mgr.wait()
        assert mgr.persisted_steps() == [3, 4, 5]
        assert mgr.steps() == [3, 4, 5]
        assert mgr.latest_step() == 5
        local = sorted(n for n in os.listdir(tmp_path / "local") if n.startswith("step_"))
        assert local == ["step_0000000004", "step_0000000004.persisted",
                         "step_0000000005", "step_0000000005.persisted"]
        _equal(mgr.load(), state_at(5))
        _equal(mgr.load(3), state_at(3))  # persisted only: read from the directory
        assert mgr.step_path(5).startswith(str(tmp_path / "local"))
        assert mgr.step_path(3).startswith(str(tmp_path / "persist"))
    for s in (3, 4, 5):  # the persistent copies are whole checkpoints on their own
        assert ss.verify(str(tmp_path / "persist" / f"step_{s:010d}")).ok
        _equal(ss.load(str(tmp_path / "persist" / f"step_{s:010d}")), state_at(s))


def test_a_step_leaves_the_local_tier_only_once_persisted(tmp_path):
    gate = threading.Event()
    _hooks.register("tier.persist", lambda: gate.wait(30))
    try:
        with _mgr(tmp_path, async_save=False, local_keep_policy=ss.KeepLatest(1)) as mgr:
            for step in range(1, 4):
                mgr.save(step, state_at(step))
            # nothing persisted yet: every step stays local, the loop was not blocked
            assert mgr.persisted_steps() == []
            assert mgr.steps() == [1, 2, 3]
            _equal(mgr.load(2), state_at(2))
            gate.set()
            mgr.wait()
            assert mgr.persisted_steps() == [1, 2, 3]
            assert sorted(n for n in os.listdir(tmp_path / "local")
                          if n.startswith("step_") and "." not in n) == ["step_0000000003"]
    finally:
        gate.set()
        _hooks.clear()


def _damage(step_dir: str) -> None:
    name = sorted(glob.glob(os.path.join(step_dir, "data", "*.bin")))[0]
    with open(name, "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0xFF]))


def test_a_damaged_local_copy_falls_back_to_the_persisted_one(tmp_path):
    with _mgr(tmp_path, async_save=False) as mgr:
        mgr.save(1, state_at(1))
        mgr.wait()
        _damage(mgr.step_path(1))
        with pytest.warns(RuntimeWarning, match="damaged.*persisted copy"):
            got = mgr.load()
        _equal(got, state_at(1))


def test_a_damaged_local_copy_without_a_persisted_one_raises(tmp_path):
    gate = threading.Event()
    _hooks.register("tier.persist", lambda: gate.wait(30))
    try:
        mgr = _mgr(tmp_path, async_save=False)
        mgr.save(1, state_at(1))
        _damage(mgr.step_path(1))
        with pytest.raises(ss.ChecksumMismatchError):
            mgr.load()
        gate.set()
        # the damage is found while persisting too: nothing bad is committed
        with pytest.raises(ss.ChecksumMismatchError, match="damaged; nothing was committed"):
            mgr.wait()
        assert mgr.persisted_steps() == [] and mgr.unpersisted_steps() == [1]
        with pytest.raises(ss.ChecksumMismatchError):  # still local only: close says so too
            mgr.close()
    finally:
        gate.set()
        _hooks.clear()


def test_an_empty_local_tier_restores_from_the_directory(tmp_path):
    with _mgr(tmp_path) as mgr:
        mgr.save(7, state_at(7))
    os.rename(tmp_path / "local", tmp_path / "old-local")  # a new machine
    with _mgr(tmp_path) as mgr:
        assert mgr.steps() == [7] and mgr.persisted_steps() == [7]
        _equal(mgr.load(), state_at(7))
        assert mgr.save(8, state_at(8))  # and the run goes on
        with pytest.raises(ss.CheckpointError, match="only go forward"):
            mgr.save(6, state_at(6))
    with _mgr(tmp_path) as mgr:
        assert mgr.persisted_steps() == [7, 8]


def test_copy_checkpoint_refuses_a_damaged_source(tmp_path):
    src, dst = str(tmp_path / "a"), str(tmp_path / "b")
    ss.save(src, state_at(1), io=ss.IOOptions(max_chunk_bytes=CHUNK))
    copy_checkpoint(src, dst)
    _equal(ss.load(dst), state_at(1))
    with open(os.path.join(src, "manifest.json"), "rb") as f1, \
            open(os.path.join(dst, "manifest.json"), "rb") as f2:
        assert f1.read() == f2.read()
    _damage(src)
    with pytest.raises(ss.ChecksumMismatchError):
        copy_checkpoint(src, str(tmp_path / "c"))
    assert not os.path.exists(tmp_path / "c")
    assert glob.glob(str(tmp_path / ".c.tmp-*")) == []


def test_local_tier_must_be_local(tmp_path):
    with pytest.raises(ss.InvalidOptionError, match="local directory"):
        ss.CheckpointManager(str(tmp_path / "p"), local_tier="s3://bucket/x")


_CHILD = STATE_SRC + """
import sys
import statestream as ss
from statestream.testing import faults

persist, local, mode, nth = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
faults.kill_at("tier.persist", nth=nth)
mgr = ss.CheckpointManager(persist, local_tier=local, async_save=mode != "sync",
                           lazy=mode == "lazy", io=ss.IOOptions(max_chunk_bytes=256 << 10))
for step in range(1, 4):
    mgr.save(step, state_at(step))
    print("saved", step, flush=True)
mgr.wait()
print("DONE", flush=True)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["sync", "async", "lazy"])
def test_sigkill_before_persistence_loses_nothing(tmp_path, mode):
    persist, local = str(tmp_path / "persist"), str(tmp_path / "local")
    proc = subprocess.run([sys.executable, "-c", _CHILD, persist, local, mode, "2"],
                          capture_output=True, text=True, timeout=90)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    # killed as it began persisting step 2: step 1 is persisted, step 2 (at least) is not
    with ss.CheckpointManager(persist) as plain:
        assert plain.steps() == [1]
    local_steps = sorted(int(n[5:]) for n in os.listdir(local)
                         if n.startswith("step_") and "." not in n)
    assert 2 in local_steps
    with ss.CheckpointManager(persist, local_tier=local) as mgr:
        mgr.wait()  # the new manager persisted what the killed one had not
        assert mgr.persisted_steps() == local_steps
        last = local_steps[-1]
    os.rename(local, local + "-lost")
    with ss.CheckpointManager(persist, local_tier=local) as mgr:
        _equal(mgr.load(), state_at(last))
        for s in local_steps:
            _equal(mgr.load(s), state_at(s))


@pytest.mark.parametrize("shape", [(8192, 1024), (1, 8 << 20)], ids=["blocks", "one-crc"])
def test_copy_checkpoint_verifies_chunks_larger_than_a_piece(tmp_path, shape):
    # 32 MiB chunks, read in 16 MiB pieces: per-block checksums, or one running CRC
    src = str(tmp_path / "a")
    w = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    ss.save(src, {"w": w})
    copy_checkpoint(src, str(tmp_path / "b"))
    np.testing.assert_array_equal(ss.load(str(tmp_path / "b"))["w"], w)
    name = glob.glob(os.path.join(src, "data", "*.bin"))[0]
    with open(name, "r+b") as f:
        f.seek(20 << 20)  # in the second piece
        f.write(b"\x01\x02")
    with pytest.raises(ss.ChecksumMismatchError):
        copy_checkpoint(src, str(tmp_path / "c"))


def test_a_manager_that_fails_to_open_its_tier_holds_no_lease(tmp_path):
    with pytest.raises(ss.InvalidOptionError):
        ss.CheckpointManager(str(tmp_path / "p"), local_tier="s3://bucket/x")
    with ss.CheckpointManager(str(tmp_path / "p")) as mgr:  # not locked by the failed one
        assert mgr.steps() == []


def test_force_rewrites_both_tiers(tmp_path):
    with _mgr(tmp_path, async_save=False) as mgr:
        mgr.save(1, state_at(1))
        mgr.wait()
        assert mgr.save(1, state_at(2), force=True)
        mgr.wait()
        _equal(mgr.load(1), state_at(2))
    _equal(ss.load(str(tmp_path / "persist" / "step_0000000001")), state_at(2))


def test_a_failed_persistence_warns_costs_no_local_step_and_is_retried(tmp_path):
    """The store is down for steps 1 and 2: both still commit locally (save warns,
    never raises), wait() raises; once it is back, the next save's persistence
    catches the earlier steps up, without a new manager."""
    down = threading.Event()
    down.set()

    def store() -> None:
        if down.is_set():
            raise ss.StorageError("the object store is down (injected)")

    caught_up = threading.Event()
    _hooks.register("tier.persist", store)
    _hooks.register("tier.caught_up", caught_up.set)
    try:
        mgr = _mgr(tmp_path, async_save=False)
        mgr.save(1, state_at(1))
        with pytest.raises(ss.StorageError, match="down"):
            mgr.wait()  # the outage does not go unnoticed
        mgr.save(2, state_at(2))
        _settle(mgr)
        with pytest.warns(RuntimeWarning, match=r"persisting step 2 .*failed .*down.*steps "
                          r"\[1, 2\] are only in the local tier"):
            assert mgr.save(3, state_at(3))  # step 2's failure is reported, step 3 saved
        assert mgr.unpersisted_steps() == [1, 2, 3] and mgr.persisted_steps() == []
        _settle(mgr)
        down.clear()  # the store is back
        caught_up.clear()
        with pytest.warns(RuntimeWarning, match=r"persisting step 3 .*steps \[1, 2, 3\]"):
            mgr.save(4, state_at(4))
        assert caught_up.wait(60)  # step 4's persistence, then steps 1 to 3 again
        assert mgr.persisted_steps() == [1, 2, 3, 4] and mgr.unpersisted_steps() == []
        mgr.close()
    finally:
        _hooks.clear()
    for s in (1, 2, 3, 4):
        _equal(ss.load(str(tmp_path / "persist" / f"step_{s:010d}")), state_at(s))


def _settle(mgr) -> None:
    """Wait until the queued persistences have run (without asking their outcome)."""
    for _ in range(6000):
        if not mgr._tier.tasks.pending():
            return
        time.sleep(0.01)
    raise AssertionError("the persistence worker never finished")


def test_a_store_down_at_every_save_loses_no_local_step(tmp_path):
    """Persistence always fails: every save still commits locally, none raises."""
    _hooks.register("tier.persist", _store_down)
    try:
        mgr = _mgr(tmp_path, async_save=True, local_keep_policy=ss.KeepLatest(1))
        for step in range(1, 6):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                assert mgr.save(step, state_at(step))
        with pytest.raises(ss.StorageError, match="down"):
            mgr.wait()
        assert mgr.unpersisted_steps() == [1, 2, 3, 4, 5]  # kept locally: not persisted
        for step in range(1, 6):
            _equal(mgr.load(step), state_at(step))
        with pytest.raises(ss.StorageError, match="down"):
            mgr.close()
    finally:
        _hooks.clear()
    with _mgr(tmp_path) as mgr:  # the next manager persists them all
        mgr.wait()
        assert mgr.persisted_steps() == [1, 2, 3, 4, 5]


def test_the_local_tier_cannot_be_the_directory_itself(tmp_path):
    persist = tmp_path / "persist"
    os.makedirs(persist)
    os.symlink(persist, tmp_path / "link")
    for local in (persist, tmp_path / "link"):  # the same directory, by another name too
        with pytest.raises(ss.InvalidOptionError, match="is the checkpoint directory itself"):
            ss.CheckpointManager(str(persist), local_tier=str(local))
    with ss.CheckpointManager(str(persist), local_tier=str(tmp_path / "local")) as mgr:
        assert mgr.save(1, state_at(1))  # the failed managers held no lease


def test_two_runs_cannot_share_a_local_tier(tmp_path):
    local = str(tmp_path / "local")
    run_a, run_b = str(tmp_path / "a"), str(tmp_path / "b")
    with ss.CheckpointManager(run_a, local_tier=local, async_save=False) as mgr:
        mgr.save(5, state_at(5))
    # run b would list and load run a's step 5 as its own latest step
    with pytest.raises(ss.InvalidOptionError, match=r"holds steps \[5\] of the checkpoint "
                       rf"directory {run_a} .*not of {run_b}"):
        ss.CheckpointManager(run_b, local_tier=local)
    os.symlink(run_a, tmp_path / "link")
    with ss.CheckpointManager(str(tmp_path / "link"), local_tier=local) as mgr:
        assert mgr.steps() == [5]  # run a by another name is run a
        _equal(mgr.load(), state_at(5))
    with ss.CheckpointManager(run_b) as mgr:  # the refused manager held no lease
        assert mgr.steps() == []
    # a tier whose steps are all gone can serve another run
    for name in os.listdir(local):
        if name.startswith("step_") and "." not in name:
            ss.storage.LocalStorage().delete(os.path.join(local, name))
    with ss.CheckpointManager(run_b, local_tier=local, async_save=False) as mgr:
        assert mgr.steps() == []
        mgr.save(1, state_at(1))
    with pytest.raises(ss.InvalidOptionError, match=r"holds steps \[1\]"):
        ss.CheckpointManager(run_a, local_tier=local)


def test_a_forced_save_counts_as_persisted_only_once_its_new_copy_is(tmp_path):
    with _mgr(tmp_path, async_save=False) as mgr:
        mgr.save(1, state_at(1))
        mgr.wait()
        _hooks.register("tier.persist", _store_down)
        try:
            mgr.save(1, state_at(2), force=True)
            with pytest.raises(ss.StorageError, match="down"):
                mgr.wait()
        finally:
            _hooks.clear()
    with _mgr(tmp_path) as mgr:  # the next manager persists the new copy
        mgr.wait()
        _equal(mgr.load(1), state_at(2))
    _equal(ss.load(str(tmp_path / "persist" / "step_0000000001")), state_at(2))
    assert os.listdir(tmp_path / "local").count("step_0000000001.persisted") == 1
    assert not glob.glob(str(tmp_path / "local" / "step_*.unpersisted"))


def test_an_incremental_step_after_a_forced_save_persists_its_new_base(tmp_path):
    with _mgr(tmp_path, async_save=False, incremental=True) as mgr:
        mgr.save(1, state_at(1))
        mgr.wait()
        _hooks.register("tier.persist", _store_down)
        try:
            mgr.save(1, state_at(2), force=True)
            with pytest.raises(ss.StorageError, match="down"):
                mgr.wait()
        finally:
            _hooks.clear()
        mgr.save(2, state_at(2))  # refers to step 1's new chunks (all of them)
        mgr.wait()
    for s in (1, 2):  # step 1's new copy went first: step 2's references hold there
        _equal(ss.load(str(tmp_path / "persist" / f"step_{s:010d}")), state_at(2))


def _store_down() -> None:
    raise ss.StorageError("the object store is down (injected)")


def test_an_earlier_attempts_local_steps_are_dropped_not_loaded_or_persisted(tmp_path):
    """Node A saved steps 1 and 2 and never persisted them; the run went on from
    node B, which saved step 1 again; then the run comes back to A."""
    persist, node_a = str(tmp_path / "persist"), str(tmp_path / "node-a")
    _hooks.register("tier.persist", _store_down)
    try:
        mgr = ss.CheckpointManager(persist, local_tier=node_a, async_save=False,
                                   incremental=True)
        mgr.save(1, state_at(1))
        with pytest.raises(ss.StorageError, match="down"):
            mgr.wait()
        mgr.save(2, state_at(2))
        with pytest.raises(ss.StorageError, match="down"):
            mgr.close()
    finally:
        _hooks.clear()
    with ss.CheckpointManager(persist, local_tier=str(tmp_path / "node-b"),
                              incremental=True) as mgr:
        assert mgr.steps() == []  # node A's steps never reached the directory
        mgr.save(1, state_at(11))
    with pytest.warns(RuntimeWarning, match=r"step 1 as another save.*steps \[1, 2\]"):
        mgr = ss.CheckpointManager(persist, local_tier=node_a, incremental=True)
    with mgr:
        mgr.wait()
        assert mgr.steps() == [1]  # node A's step 2 is not persisted into the run
        _equal(mgr.load(1), state_at(11))
        mgr.save(2, state_at(12))  # refers to the directory's step 1, not A's old one
    assert ss.CheckpointManager(persist).steps() == [1, 2]
    for s in (1, 2):
        _equal(ss.load(str(tmp_path / "persist" / f"step_{s:010d}")), state_at(10 + s))


@pytest.mark.skipif(sys.platform != "linux" or os.geteuid() != 0, reason="chattr needs root")
def test_an_earlier_attempts_step_that_cannot_be_removed_does_not_fail_the_open(tmp_path):
    """The local storage reports a tree it could not remove once uncommitted (d9ec4b0):
    the stale local step is uncommitted, so it never loads; the open warns, not fails."""
    persist, node_a = str(tmp_path / "persist"), str(tmp_path / "node-a")
    _hooks.register("tier.persist", _store_down)
    try:
        mgr = ss.CheckpointManager(persist, local_tier=node_a, async_save=False)
        mgr.save(1, state_at(1))
        with pytest.raises(ss.StorageError, match="down"):
            mgr.close()
    finally:
        _hooks.clear()
    with ss.CheckpointManager(persist, local_tier=str(tmp_path / "node-b")) as mgr:
        mgr.save(1, state_at(11))
    stuck = os.path.join(node_a, "step_0000000001", "data")
    subprocess.run(["chattr", "+i", stuck], check=True)
    try:
        with pytest.warns(RuntimeWarning, match=r"could not remove all of .*step_0000000001"):
            mgr = ss.CheckpointManager(persist, local_tier=node_a)
        with mgr:
            assert mgr.steps() == [1]
            _equal(mgr.load(1), state_at(11))
    finally:
        subprocess.run(["chattr", "-i", stuck], check=True)


def test_a_damaged_unpersisted_step_does_not_hold_back_the_later_ones(tmp_path):
    _hooks.register("tier.persist", _store_down)
    try:
        mgr = _mgr(tmp_path, async_save=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            for step in (1, 2, 3):
                mgr.save(step, state_at(step))
        _settle(mgr)
    finally:
        _hooks.clear()  # the store is back
    _damage(mgr.step_path(1))  # the node's disk damaged step 1 meanwhile
    with pytest.raises(ss.ChecksumMismatchError, match="step_0000000001"):
        mgr.wait()  # steps 1 to 3 retried, oldest first: 1 fails, 2 and 3 go on
    assert mgr.persisted_steps() == [2, 3] and mgr.unpersisted_steps() == [1]
    with pytest.raises(ss.ChecksumMismatchError):
        mgr.close()
    for s in (2, 3):
        _equal(ss.load(str(tmp_path / "persist" / f"step_{s:010d}")), state_at(s))


@pytest.mark.parametrize("async_save", [False, True])
def test_a_step_saved_again_at_once_is_the_one_persisted(tmp_path, async_save):
    # The first copy's persistence, still running, recorded step 3 as persisted after
    # the forced save had marked it replaced: the new copy's persistence skipped it,
    # and the next open removed it as "an earlier attempt's" (the forced save lost).
    with _mgr(tmp_path, async_save=async_save) as mgr:
        mgr.save(3, {"v": np.full(4, 1.0)})
        mgr.save(3, {"v": np.full(4, 2.0)}, force=True)
        mgr.wait()
        assert mgr.unpersisted_steps() == []
        assert ss.load(str(tmp_path / "persist" / "step_0000000003"))["v"].tolist() == [2.0] * 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing removed at the open
        with _mgr(tmp_path, async_save=async_save) as mgr:
            assert mgr.load(3)["v"].tolist() == [2.0] * 4


def test_a_closed_manager_leaves_no_persistence_thread_behind(tmp_path):
    # Each manager's persistence thread outlived close(), holding the manager (its
    # last task's closure) alive: a job opening managers in a loop leaked both.
    before = sum(t.name == "statestream-persist" for t in threading.enumerate())
    for i in range(3):
        with _mgr(tmp_path, async_save=i % 2 == 1) as mgr:
            mgr.save(i, {"w": np.full(10, i)})
    ref = weakref.ref(mgr)
    del mgr
    gc.collect()
    assert sum(t.name == "statestream-persist" for t in threading.enumerate()) == before
    assert ref() is None
    with _mgr(tmp_path) as again:  # the next manager persists on a thread of its own
        assert again.persisted_steps() == [0, 1, 2] and again.load()["w"].tolist() == [2] * 10
    with pytest.raises(ss.CheckpointError, match="closed"):
        again.wait()


def test_an_error_in_the_with_block_stays_the_one_raised(tmp_path):
    # The close at the end of the block failed too (here: the store is down; with
    # several processes, a block that raised on one rank alone times out in close):
    # its error replaced the block's, which showed only as its __context__.
    _hooks.register("tier.persist", _store_down)
    try:
        with pytest.raises(ValueError, match="loss is NaN") as info:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                with _mgr(tmp_path, async_save=False) as mgr:
                    mgr.save(1, state_at(1))
                    raise ValueError("loss is NaN")
    finally:
        _hooks.clear()
    if sys.version_info >= (3, 11):
        (note,) = info.value.__notes__
        assert note.startswith("closing the CheckpointManager after this error failed too: "
                               "StorageError: ") and "store is down" in note, note
    assert mgr._closed and mgr.unpersisted_steps() == [1]  # closed all the same
    with _mgr(tmp_path) as again:  # the store is back: the next manager persists it
        again.wait()
        assert again.persisted_steps() == [1]


def test_a_queued_persistence_of_a_step_gone_from_the_tier_copies_nothing(tmp_path):
    # a step dropped unpersisted (the directory's policy would delete it at once) and
    # then deleted by the local keep policy, with its record, while its persistence was
    # still queued behind a hung store: the task tried to copy it and failed ("cannot
    # be read"), and wait() raised for a step nobody needs
    with ss.CheckpointManager(tmp_path / "persist", local_tier=tmp_path / "local",
                              async_save=False) as mgr:
        mgr.save(1, {"w": np.ones(4)})
        mgr.wait()
        h = mgr._tier.persist(7)  # step 7 is not (any more) in the tier
        h.result(timeout=60)
        mgr.wait()
        assert mgr.persisted_steps() == [1] and mgr.steps() == [1]
