"""CheckpointManager: when it saves, what it lists, keeps and cleans, locking, preemption."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import numpy as np
import pytest

import statestream as ss
from statestream.manager import _decide, _manager, _retention
from statestream.testing import faults

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(sys.platform == "win32", reason="POSIX flock and signals"),
]


@pytest.fixture(autouse=True)
def _no_faults():
    faults.clear()
    yield
    faults.clear()


def state_at(step: int) -> dict:
    return {"step": step, "w": np.arange(64, dtype=np.float32) + step, "name": f"s{step}"}


def check_step(mgr: ss.CheckpointManager, step: int) -> None:
    got = mgr.load(step)
    assert got["step"] == step and got["name"] == f"s{step}"
    np.testing.assert_array_equal(got["w"], state_at(step)["w"])


def run_child(code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args],
                          capture_output=True, text=True, timeout=timeout)


# ---------------------------------------------------------------- when to save
@pytest.mark.parametrize("async_save", [True, False])
def test_save_every_step_returns_whether_it_saved(tmp_path, async_save):
    with ss.CheckpointManager(tmp_path, save_policy=ss.EveryNSteps(3),
                              async_save=async_save) as mgr:
        saved = [s for s in range(10) if mgr.save(s, state_at(s))]
        assert saved == [0, 3, 6, 9]
        mgr.wait()
        assert mgr.steps() == [0, 3, 6, 9]
        assert mgr.latest_step() == 9
        for s in saved:
            check_step(mgr, s)


def test_should_save_agrees_with_save(tmp_path):
    with ss.CheckpointManager(tmp_path, save_policy=ss.AtSteps({2, 5})) as mgr:
        for s in range(7):
            expect = mgr.should_save(s)
            assert mgr.save(s, state_at(s)) == expect == (s in (2, 5))
        assert not mgr.should_save(5)  # already saved: never twice


def test_should_save_takes_the_steps_save_takes(tmp_path):
    # a JAX step (state.step of a TrainState) was a TypeError (unhashable) in
    # AtSteps/EveryNSteps, where save() took it; 8.5 and -1 were just False
    jnp = pytest.importorskip("jax.numpy")
    with ss.CheckpointManager(tmp_path, save_policy=ss.AtSteps({2, 5}),
                              async_save=False) as mgr:
        assert mgr.should_save(jnp.int32(2)) and mgr.should_save(np.int64(5))
        assert not mgr.should_save(jnp.int32(3))
        for bad in (8.5, -1):
            with pytest.raises(ss.InvalidOptionError, match="step must be"):
                mgr.should_save(bad)
        assert mgr.save(jnp.int32(2), state_at(2)) and mgr.steps() == [2]


def test_force_overrides_the_policy(tmp_path):
    with ss.CheckpointManager(tmp_path, save_policy=ss.EveryNSteps(100)) as mgr:
        assert mgr.save(0, state_at(0))
        assert not mgr.save(7, state_at(7))
        assert mgr.save(7, state_at(7), force=True)
        assert not mgr.save(8, state_at(8))
        mgr.wait()
        assert mgr.steps() == [0, 7]
        check_step(mgr, 7)


def test_no_policy_saves_every_call_but_never_a_step_twice(tmp_path):
    with ss.CheckpointManager(tmp_path) as mgr:
        assert all(mgr.save(s, state_at(s)) for s in (1, 2, 5, 6))
        assert not mgr.save(6, state_at(6))
        mgr.wait()
        assert mgr.steps() == [1, 2, 5, 6]
        # force rewrites a committed step atomically
        assert mgr.save(6, {**state_at(6), "name": "again"}, force=True)
        mgr.wait()
        assert mgr.load(6)["name"] == "again"


def test_every_n_seconds_with_injected_clock(tmp_path, monkeypatch):
    now = [1000.0]

    class Clock:
        @staticmethod
        def time() -> float:
            return now[0]

    monkeypatch.setattr(_manager, "time", Clock)  # the last save's time
    monkeypatch.setattr(_retention, "time", Clock)  # the step time it records
    monkeypatch.setattr(_decide, "time", Clock)  # the save policy's clock
    with ss.CheckpointManager(tmp_path, save_policy=ss.EveryNSeconds(60)) as mgr:
        saved = []
        for step, t in enumerate([1000, 1010, 1059, 1060, 1070, 1200, 1201]):
            now[0] = float(t)
            if mgr.save(step, state_at(step)):
                saved.append(step)
        assert saved == [0, 3, 5]
        mgr.wait()
        assert mgr.step_info(3)["time"] == 1060.0


def test_reopening_does_not_resave_the_latest_step(tmp_path):
    with ss.CheckpointManager(tmp_path, save_policy=ss.EveryNSteps(2)) as mgr:
        for s in range(5):
            mgr.save(s, state_at(s))
    with ss.CheckpointManager(tmp_path, save_policy=ss.EveryNSteps(2)) as mgr:
        assert mgr.latest_step() == 4
        assert not mgr.save(4, state_at(4))  # resuming at the saved step: no rewrite
        assert mgr.save(6, state_at(6))


def test_save_validates(tmp_path):
    with ss.CheckpointManager(tmp_path) as mgr:
        with pytest.raises(ValueError, match="step must be >= 0"):
            mgr.save(-1, state_at(0))
        with pytest.raises(ss.UnsupportedTypeError):
            mgr.save(1, {"x": object()})
        assert mgr.steps() == []
        assert mgr.save(1, state_at(1))
    with pytest.raises(ss.CheckpointError, match="closed"):
        mgr.save(2, state_at(2))


# ---------------------------------------------------------------- one save in flight
def test_one_save_in_flight_the_next_waits(tmp_path):
    gate = threading.Event()
    reached = threading.Event()

    def hold():
        reached.set()
        assert gate.wait(60)

    faults.on("commit.manifest_written", hold, nth=1)
    mgr = ss.CheckpointManager(tmp_path)
    try:
        assert mgr.save(1, state_at(1))
        h1 = mgr.in_flight
        assert h1 is not None
        assert reached.wait(60)  # save 1 is stuck before its commit
        assert not h1.done() and mgr.steps() == []
        # steps() never lists a step being written
        assert mgr.latest_step() is None

        second = threading.Thread(target=mgr.save, args=(2, state_at(2)))
        second.start()
        second.join(0.5)
        assert second.is_alive(), "the second save did not wait for the first"
        assert not [n for n in os.listdir(tmp_path) if n.startswith(".step_0000000002")]
        gate.set()
        second.join(60)
        assert not second.is_alive()
        assert h1.done()
        h1.result()
        mgr.wait()
        assert mgr.steps() == [1, 2]
    finally:
        gate.set()
        mgr.close()


def test_failed_background_save_is_reported_by_wait(tmp_path):
    def boom():
        raise OSError("disk on fire")

    faults.on("save.data_synced", boom, nth=1)
    with ss.CheckpointManager(tmp_path) as mgr:
        assert mgr.save(1, state_at(1))
        with pytest.raises(OSError, match="disk on fire"):
            mgr.wait()
        assert mgr.steps() == []
        assert mgr.save(2, state_at(2))
        mgr.wait()
        assert mgr.steps() == [2]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".step_")]


# ---------------------------------------------------------------- listing, cleanup
def test_leftovers_of_crashed_saves_are_cleaned_at_start(tmp_path):
    with ss.CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, state_at(1))
        mgr.save(2, state_at(2))
    d = str(tmp_path)
    # a staging dir of a save that never committed, one of an overwrite, a step
    # without its marker, and things the manager does not own
    os.makedirs(os.path.join(d, ".step_0000000003.tmp-0123456789ab", "data"))
    open(os.path.join(d, ".step_0000000003.tmp-0123456789ab", "data", "r0-0"), "wb").close()
    os.makedirs(os.path.join(d, ".step_0000000002.tmp-abcdefabcdef.old"))
    os.makedirs(os.path.join(d, "step_0000000004", "data"))
    os.makedirs(os.path.join(d, "notes"))
    open(os.path.join(d, "README.txt"), "w").close()
    os.makedirs(os.path.join(d, "step_5"))
    # a copy of a committed step with its marker removed
    import shutil

    shutil.copytree(os.path.join(d, "step_0000000002"), os.path.join(d, "step_0000000006"))
    os.unlink(os.path.join(d, "step_0000000006", "COMMITTED"))

    with ss.CheckpointManager(tmp_path) as mgr:
        assert mgr.steps() == [1, 2]
        assert sorted(os.listdir(d)) == sorted(
            [".statestream.lock", "README.txt", "notes", "step_0000000001",
             "step_0000000002", "step_5"])
        check_step(mgr, 2)
        assert mgr.save(3, state_at(3))
    with ss.CheckpointManager(tmp_path) as mgr:
        assert mgr.steps() == [1, 2, 3]


def test_step_dirs_without_marker_are_not_listed_by_a_reader(tmp_path):
    with ss.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, state_at(1))
        mgr.wait()
        os.makedirs(mgr.step_path(9))
        assert mgr.steps() == [1] and mgr.latest_step() == 1
        assert mgr.step_path(9).endswith("step_0000000009")


def test_load_latest_and_errors(tmp_path):
    with ss.CheckpointManager(tmp_path) as mgr:
        with pytest.raises(ss.CheckpointNotFoundError, match="no committed checkpoint"):
            mgr.load()
        for s in (3, 10):
            mgr.save(s, state_at(s))
        mgr.wait()
        # (the manager refuses to save an older step; write one behind its back)
        ss.save(mgr.step_path(7), state_at(7))
        assert mgr.steps() == [3, 7, 10]
        assert mgr.load()["step"] == 10  # the largest step, not the last written
        like = {"step": 0, "w": np.zeros(64, np.float32), "name": ""}
        got = mgr.load(target=like)
        np.testing.assert_array_equal(got["w"], state_at(10)["w"])
        assert mgr.load(3, items=["w"]).keys() == {"w"}
        with pytest.raises(ss.CheckpointNotFoundError):
            mgr.load(4)


def test_step_metadata(tmp_path):
    t0 = time.time()
    st = {"w": np.ones((100, 10), np.float64), "b": np.zeros(6, np.int32), "step": 3}
    with ss.CheckpointManager(tmp_path) as mgr:
        mgr.save(3, st, metrics={"loss": 0.25, "acc": 0.5},
                 metadata={"run": "r1", "tags": ["a", "b"]})
        mgr.save(4, st)
        mgr.wait()
        info = mgr.step_info(3)
        assert info["step"] == 3
        assert t0 <= info["time"] <= time.time()
        assert info["metrics"] == {"loss": 0.25, "acc": 0.5}
        assert info["metadata"] == {"run": "r1", "tags": ["a", "b"]}
        assert info["nbytes"] == 100 * 10 * 8 + 6 * 4
        assert mgr.step_info(4)["metrics"] == {} and mgr.step_info(4)["metadata"] == {}
        with pytest.raises(ss.UnsupportedTypeError):
            mgr.save(5, st, metadata={"bad": object()})


# ---------------------------------------------------------------- keep policies
@pytest.mark.parametrize("async_save", [True, False])
def test_keep_latest(tmp_path, async_save):
    with ss.CheckpointManager(tmp_path, keep_policy=ss.KeepLatest(2),
                              async_save=async_save) as mgr:
        for s in range(6):
            mgr.save(s, state_at(s))
            mgr.wait()
            assert mgr.steps() == list(range(max(0, s - 1), s + 1))
    assert ss.CheckpointManager(tmp_path).steps() == [4, 5]


def test_keep_every_best_union(tmp_path):
    losses = {0: 0.9, 1: 0.2, 2: 0.8, 3: 0.1, 4: 0.7, 5: 0.6, 6: 0.95}
    keep = ss.KeepUnion(ss.KeepEvery(4), ss.KeepBest(2, "loss"), ss.KeepLatest(1))
    with ss.CheckpointManager(tmp_path, keep_policy=keep) as mgr:
        for s, loss in losses.items():
            mgr.save(s, state_at(s), metrics={"loss": loss})
    with ss.CheckpointManager(tmp_path) as mgr:
        assert mgr.steps() == [0, 1, 3, 4, 6]


def test_keep_best_max(tmp_path):
    acc = {1: 0.5, 2: 0.9, 3: 0.7, 4: 0.1}
    with ss.CheckpointManager(tmp_path, keep_policy=ss.KeepBest(1, "acc", mode="max")) as mgr:
        for s, a in acc.items():
            mgr.save(s, state_at(s), metrics={"acc": a})
        mgr.wait()
        assert mgr.steps() == [2, 4]  # the best, and the latest (never deleted)


def test_keep_all_is_the_default(tmp_path):
    with ss.CheckpointManager(tmp_path) as mgr:
        for s in range(5):
            mgr.save(s, state_at(s))
    with ss.CheckpointManager(tmp_path, keep_policy=ss.KeepAll()) as mgr:
        assert mgr.steps() == [0, 1, 2, 3, 4]


class KeepNothing:
    def __init__(self):
        self.seen: list[list[int]] = []

    def keep(self, steps):
        self.seen.append([s.step for s in steps])
        return set()


@pytest.mark.parametrize("async_save", [True, False])
def test_keep_policy_never_deletes_the_latest(tmp_path, async_save):
    pol = KeepNothing()
    with ss.CheckpointManager(tmp_path, keep_policy=pol, async_save=async_save) as mgr:
        for s in range(4):
            mgr.save(s, state_at(s))
            mgr.wait()
            assert mgr.steps() == [s]
            check_step(mgr, s)
    assert pol.seen and all(seen == sorted(seen) for seen in pol.seen)


def test_keep_policy_never_deletes_the_step_being_written(tmp_path):
    gate = threading.Event()
    reached = threading.Event()

    def hold():
        reached.set()
        assert gate.wait(60)

    faults.on("save.data_synced", hold, nth=3)
    mgr = ss.CheckpointManager(tmp_path, keep_policy=KeepNothing())
    try:
        mgr.save(1, state_at(1))
        mgr.save(2, state_at(2))  # waits for 1, applies the policy: only 1 stays
        assert mgr.steps() == [1]
        mgr.save(3, state_at(3))  # waits for 2; 3 is now in flight, stuck before commit
        assert reached.wait(60)
        # a keep pass while 3 is in flight (white box: what wait()/close() run)
        mgr._flight.step = 3
        mgr._apply_keep_policy()
        staging = [n for n in os.listdir(tmp_path) if n.startswith(".step_0000000003.tmp-")]
        assert len(staging) == 1 and mgr.steps() == [2]
        gate.set()
        mgr.wait()
        assert mgr.steps() == [3]
        check_step(mgr, 3)
    finally:
        gate.set()
        mgr.close()


# ---------------------------------------------------------------- lock
def test_second_manager_in_the_same_process_is_refused(tmp_path):
    with ss.CheckpointManager(tmp_path) as mgr:
        with pytest.raises(ss.ManagerLockedError, match="already managed") as ei:
            ss.CheckpointManager(tmp_path)
        assert f"pid {os.getpid()}" in str(ei.value)
        assert isinstance(ei.value, ss.CheckpointError)
        mgr.save(1, state_at(1))
    # closed (by the with block): the directory is free again
    with ss.CheckpointManager(tmp_path) as again:
        assert again.steps() == [1]


def test_close_releases_the_lock_and_is_idempotent(tmp_path):
    mgr = ss.CheckpointManager(tmp_path)
    mgr.save(1, state_at(1))
    mgr.close()
    mgr.close()
    assert mgr.steps() == [1]  # reading still works after close
    other = ss.CheckpointManager(tmp_path)
    other.close()


_LOCK_CHILD = """
import sys
import statestream as ss
try:
    with ss.CheckpointManager(sys.argv[1]) as mgr:
        print("OPEN", mgr.steps())
except ss.ManagerLockedError as exc:
    print("LOCKED", exc)
"""


def test_second_manager_in_another_process_is_refused(tmp_path):
    with ss.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, state_at(1))
        mgr.wait()
        r = run_child(_LOCK_CHILD, str(tmp_path))
        assert r.returncode == 0, r.stderr
        assert r.stdout.startswith("LOCKED"), r.stdout
        assert f"pid {os.getpid()}" in r.stdout
    r = run_child(_LOCK_CHILD, str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "OPEN [1]"


# ---------------------------------------------------------------- preemption
_PREEMPT_CHILD = """
import sys, time
import numpy as np
import statestream as ss

policy = ss.AnyOf(ss.EveryNSteps(1000), ss.OnPreemption())
with ss.CheckpointManager(sys.argv[1], preemption=True, save_policy=policy) as mgr:
    print("READY", flush=True)
    step = 0
    while True:
        step += 1
        state = {"step": step, "w": np.full(4096, step, dtype=np.float64)}
        mgr.save(step, state)
        if mgr.reached_preemption(step):
            mgr.wait()
            break
        if step >= 5_000_000:
            sys.exit(3)
        time.sleep(0.0005)
print("STOPPED", step, flush=True)
"""


def test_preemption_saves_at_the_step_and_exits_cleanly(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_PREEMPT_CHILD), str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "READY"
        time.sleep(0.3)  # let it run some steps (any moment works)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    stopped = int(out.split()[-1])
    with ss.CheckpointManager(tmp_path) as mgr:
        assert mgr.latest_step() == stopped
        assert all(s % 1000 == 0 for s in mgr.steps()[:-1])
        like = {"step": 0, "w": np.zeros(4096, np.float64)}
        got = mgr.load(step=None, target=like)
        assert got["step"] == stopped
        np.testing.assert_array_equal(got["w"], np.full(4096, stopped, np.float64))
        assert ss.verify(mgr.step_path(stopped)).ok


def test_reached_preemption_is_consistent_with_the_save_decision(tmp_path):
    policy = ss.AnyOf(ss.EveryNSteps(1000), ss.OnPreemption())
    before = signal.getsignal(signal.SIGTERM)
    with ss.CheckpointManager(tmp_path, save_policy=policy, preemption=True) as mgr:
        assert signal.getsignal(signal.SIGTERM) is not before
        assert not mgr.save(1, state_at(1))
        # SIGTERM lands between save(2) and reached_preemption(2) ...
        assert not mgr.save(2, state_at(2))
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):  # the Python handler runs at the next bytecode boundary
            if mgr._decisions.preempted.is_set():
                break
            time.sleep(0.01)
        # ... so step 2 was not saved: not the exit point yet
        assert not mgr.reached_preemption(2)
        assert mgr.save(3, state_at(3))
        assert mgr.reached_preemption(3)
        mgr.wait()
        assert mgr.steps() == [3]
    assert signal.getsignal(signal.SIGTERM) is before  # restored on close


def test_without_sigterm_never_preempted(tmp_path):
    with ss.CheckpointManager(tmp_path, save_policy=ss.OnPreemption(), preemption=True) as mgr:
        for s in range(3):
            assert not mgr.save(s, state_at(s))
            assert not mgr.reached_preemption(s)


# ---------------------------------------------------------------- what a step is
@pytest.mark.parametrize("step", [np.int64(3), np.uint8(3)])
def test_numpy_integer_steps_save_as_their_value(tmp_path, step):
    with ss.CheckpointManager(tmp_path, async_save=False) as mgr:
        assert mgr.save(step, state_at(3), metrics={"loss": 0.5})
        assert mgr.steps() == [3] and type(mgr.steps()[0]) is int
        assert mgr.step_info(3)["metrics"] == {"loss": 0.5}
        check_step(mgr, 3)


def test_torch_integer_step_saves_as_its_value(tmp_path):
    torch = pytest.importorskip("torch")
    with ss.CheckpointManager(tmp_path, async_save=False) as mgr:
        assert mgr.save(torch.tensor(4), state_at(4))
        assert mgr.steps() == [4]


@pytest.mark.parametrize("step", [1.5, 2.0, "5", True, 10**18, 2**63])
def test_steps_that_are_not_listable_integers_are_refused(tmp_path, step):
    with ss.CheckpointManager(tmp_path, async_save=False) as mgr:
        assert mgr.save(0, state_at(0))
        with pytest.raises(ss.InvalidOptionError, match="step must be"):
            mgr.save(step, state_at(1))
        assert mgr.steps() == [0]
    # nothing was written that no manager would ever list (or delete)
    assert sorted(os.listdir(tmp_path)) == [".statestream.lock", "step_0000000000"]


def test_the_newest_listable_step_saves(tmp_path):
    with ss.CheckpointManager(tmp_path, async_save=False) as mgr:
        assert mgr.save(10**18 - 1, state_at(0))
    with ss.CheckpointManager(tmp_path) as mgr:
        assert mgr.steps() == [10**18 - 1]


def test_metrics_may_be_numpy_and_torch_scalars(tmp_path):
    torch = pytest.importorskip("torch")
    loss = (torch.ones(3, requires_grad=True) * 0.25).sum()  # a loss as a training loop has it
    with ss.CheckpointManager(tmp_path, async_save=False,
                              keep_policy=ss.KeepBest(1, "loss")) as mgr:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # none is "saved without a number"
            assert mgr.save(1, state_at(1), metrics={"loss": loss, "n": np.int64(4)})
            assert mgr.step_info(1)["metrics"] == {"loss": 0.75, "n": 4}
            assert mgr.save(2, state_at(2), metrics={"loss": np.float32(0.5)})
        with pytest.warns(UserWarning, match="without a number"):  # NaN never counts
            assert mgr.save(3, state_at(3), metrics={"loss": np.float32("nan")})
        assert math.isnan(mgr.step_info(3)["metrics"]["loss"])
        assert mgr.best_step("loss") == 2
        assert mgr.steps() == [2, 3]


def test_metrics_may_be_jax_scalars(tmp_path):
    jnp = pytest.importorskip("jax.numpy")
    with ss.CheckpointManager(tmp_path, keep_policy=ss.KeepBest(1, "loss")) as mgr:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # none is "saved without a number"
            for step, loss in ((1, jnp.float32(0.75)), (2, jnp.array(0.5, jnp.bfloat16)),
                               (3, jnp.array(0.625))):
                assert mgr.save(step, {"w": jnp.full(3, step)}, metrics={"loss": loss})
        mgr.wait()
        assert mgr.step_info(2)["metrics"] == {"loss": 0.5}
        assert mgr.best_step("loss") == 2 and mgr.steps() == [2, 3]


@pytest.mark.parametrize("shape", [(1,), (2, 3)])
def test_a_metric_that_is_not_a_scalar_is_refused_naming_it(tmp_path, shape):
    with ss.CheckpointManager(tmp_path, keep_policy=ss.KeepBest(1, "loss")) as mgr:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # refused before the missing-number warning
            with pytest.raises(ss.InvalidOptionError,
                               match=rf"metric 'loss' is a ndarray of shape \({shape[0]},"):
                mgr.save(1, state_at(1), metrics={"loss": np.full(shape, 0.5), "n": 3})
        assert mgr.steps() == []
        assert mgr.save(1, state_at(1), metrics={"loss": np.float32(0.5)})  # then saves


# ---------------------------------------------------------------- a deletion that fails
@pytest.mark.parametrize("async_save", [True, False])
def test_a_step_that_cannot_be_deleted_does_not_stop_the_saves(tmp_path, monkeypatch,
                                                                async_save):
    import errno

    from statestream.errors import storage_error
    from statestream.storage import LocalStorage

    with ss.CheckpointManager(tmp_path, async_save=False) as mgr:  # keeps all
        for s in (1, 2, 3):
            mgr.save(s, state_at(s))
    stuck = {str(tmp_path / "step_0000000002")}
    real_delete = LocalStorage.delete

    def delete(self, path):
        if os.path.abspath(path) in stuck:
            raise storage_error(f"deleting {path} failed: read-only", errno.EROFS)
        real_delete(self, path)

    monkeypatch.setattr(LocalStorage, "delete", delete)
    with ss.CheckpointManager(tmp_path, keep_policy=ss.KeepLatest(1),
                              async_save=async_save) as mgr:
        with pytest.warns(RuntimeWarning, match="could not delete .*step_0000000002"):
            for s in (4, 5):
                assert mgr.save(s, state_at(s))  # the saves go on
            mgr.wait()
        # newest first, stopped at the failure: step 1 stays too (step 2 may refer to it)
        assert sorted(n for n in os.listdir(tmp_path) if n.startswith("step_")) == [
            "step_0000000001", "step_0000000002", "step_0000000005"]
        check_step(mgr, 5)
        stuck.clear()  # the mount is writable again: the next apply deletes them
        mgr.save(6, state_at(6))
        mgr.wait()
        assert mgr.steps() == [6]
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("step_")) == ["step_0000000006"]


def _immutable(path, on: bool) -> None:
    """``chattr +i``/``-i``: EPERM even for root (a read-only mount's errors, for one path)."""
    r = subprocess.run(["chattr", "+i" if on else "-i", str(path)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"chattr is not available here: {r.stderr.strip()!r}")


@pytest.mark.skipif(sys.platform != "linux" or os.geteuid() != 0, reason="chattr needs root")
@pytest.mark.parametrize("incremental", [False, True])
def test_a_deletion_that_fails_after_the_marker_warns_and_is_tried_again(tmp_path,
                                                                          incremental):
    """A step's files that cannot be removed once its commit marker is gone (its data
    directory immutable): the local storage ignored the error, so the keep policy
    neither warned nor tried again, and the step's data stayed on disk until a manager
    next opened the directory."""
    with ss.CheckpointManager(tmp_path, keep_policy=ss.KeepLatest(1), async_save=False,
                              incremental=incremental) as mgr:
        mgr.save(1, state_at(1))
        stuck = tmp_path / "step_0000000001" / "data"
        _immutable(stuck, True)
        try:
            with pytest.warns(RuntimeWarning, match=r"could not delete .*step_0000000001 "
                              r"\(deleting .* failed after it was uncommitted"):
                mgr.save(2, state_at(2))
                mgr.save(3, state_at(3))
            assert mgr.steps() == [3]  # uncommitted: never listed, never loaded
            assert (tmp_path / "step_0000000001").exists()
        finally:
            _immutable(stuck, False)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing fails now
            mgr.save(4, state_at(4))  # the same manager finishes the deletion
        assert sorted(n for n in os.listdir(tmp_path) if n.startswith("step_")) == [
            "step_0000000004"]
        check_step(mgr, 4)


@pytest.mark.skipif(sys.platform != "linux" or os.geteuid() != 0, reason="chattr needs root")
def test_a_manager_opens_beside_an_interrupted_deletion_it_cannot_finish(tmp_path):
    """Opening removes what interrupted deletions left; one that cannot be removed warns
    (the local storage now reports it) instead of failing the open."""
    with ss.CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, state_at(1))
        mgr.save(2, state_at(2))
    (tmp_path / "step_0000000001" / "COMMITTED").unlink()  # a deletion killed there
    _immutable(tmp_path / "step_0000000001" / "data", True)
    try:
        with pytest.warns(RuntimeWarning, match="could not remove .*step_0000000001"):
            mgr = ss.CheckpointManager(tmp_path, async_save=False)
        with mgr:
            assert mgr.steps() == [2]
            check_step(mgr, 2)
    finally:
        _immutable(tmp_path / "step_0000000001" / "data", False)
    ss.CheckpointManager(tmp_path).close()  # removed now
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("step_")) == [
        "step_0000000002"]


def test_the_local_storage_reports_a_tree_it_could_not_remove(tmp_path):
    from statestream.storage import LocalStorage

    if os.geteuid() != 0 or sys.platform != "linux":
        pytest.skip("chattr needs root")
    ss.save(tmp_path / "ck", state_at(1))
    _immutable(tmp_path / "ck" / "data", True)
    try:
        with pytest.raises(ss.StorageError, match="failed after it was uncommitted") as ei:
            LocalStorage().delete(str(tmp_path / "ck"))
        assert str(tmp_path / "ck") in str(ei.value)
        with pytest.raises(ss.CheckpointError):
            ss.load(tmp_path / "ck")  # uncommitted first: what is left never loads
    finally:
        _immutable(tmp_path / "ck" / "data", False)
    LocalStorage().delete(str(tmp_path / "ck"))
    assert not (tmp_path / "ck").exists()


def _wait_flag(mgr) -> None:
    for _ in range(1000):  # the Python handler runs at the next bytecode boundary
        if mgr._decisions.preempted.is_set():
            return
        time.sleep(0.001)


def test_every_manager_sees_sigterm_and_the_users_handler_still_runs(tmp_path):
    # One manager's handler used to replace another's (only the last opened saw the
    # signal) and the user's own handler; closing them out of order disarmed the other.
    seen = []
    before = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        user = signal.getsignal(signal.SIGTERM)
        m1 = ss.CheckpointManager(tmp_path / "a", save_policy=ss.OnPreemption(),
                                  preemption=True, async_save=False)
        m2 = ss.CheckpointManager(tmp_path / "b", save_policy=ss.OnPreemption(),
                                  preemption=True, async_save=False)
        m3 = ss.CheckpointManager(tmp_path / "c", save_policy=ss.OnPreemption(),
                                  preemption=True, async_save=False)
        m1.close()  # closed first: m2 and m3 stay armed
        os.kill(os.getpid(), signal.SIGTERM)
        _wait_flag(m3)
        _wait_flag(m2)
        assert seen == [signal.SIGTERM]
        assert m2.save(1, state_at(1)) and m2.reached_preemption(1)
        assert m3.save(1, state_at(1)) and m3.reached_preemption(1)
        assert not m1._decisions.preempted.is_set()  # closed before the signal
        m3.close()
        m2.close()
        assert signal.getsignal(signal.SIGTERM) is user  # the last close puts it back
    finally:
        signal.signal(signal.SIGTERM, before)


def test_a_save_on_a_closed_manager_names_the_step_and_directory(tmp_path):
    # the error said only "this CheckpointManager is closed"
    mgr = ss.CheckpointManager(tmp_path, async_save=False)
    mgr.save(1, state_at(1))
    mgr.close()
    with pytest.raises(ss.CheckpointError, match=r"cannot save step 2 in .*"
                       + tmp_path.name + r": this CheckpointManager is closed"):
        mgr.save(2, state_at(2))
