"""Save and keep policies as plain objects (no files, no manager)."""

from __future__ import annotations

import math

import numpy as np
import pytest

import statestream as ss
from statestream.manager import KeepPolicy, SaveContext, SavePolicy, StepInfo

pytestmark = pytest.mark.timeout(60)


def ctx(step, *, last_step=None, last_time=None, preempted=False, now=0.0):
    return SaveContext(step, last_step, last_time, preempted, now)


def saves(policy: SavePolicy, steps, **kw):
    return [s for s in steps if policy.should_save(ctx(s, **kw))]


def infos(*steps, metrics=None):
    metrics = metrics or {}
    return [StepInfo(s, float(s), dict(metrics.get(s, {})), 100) for s in steps]


# ---------------------------------------------------------------- save policies
def test_every_n_steps():
    assert saves(ss.EveryNSteps(5), range(17)) == [0, 5, 10, 15]
    assert saves(ss.EveryNSteps(1), range(4)) == [0, 1, 2, 3]


@pytest.mark.parametrize("n", [0, -3])
def test_every_n_steps_rejects_bad_n(n):
    with pytest.raises(ValueError, match="n >= 1"):
        ss.EveryNSteps(n)


def test_numpy_and_torch_integers_are_counts_like_ints():
    """A step count that came out of NumPy or torch (a config's np.int64, a tensor's
    item kept as a 0-d tensor) is a whole number like an int, as it is for steps: the
    policies refused it ("needs an int n, not int64"). It is kept as a plain int."""
    torch = pytest.importorskip("torch")
    every = ss.EveryNSteps(np.int64(5))
    assert saves(every, range(11)) == [0, 5, 10] and type(every.n) is int
    assert every == ss.EveryNSteps(5)
    at = ss.AtSteps(np.array([3, 7]))
    assert saves(at, range(10)) == [3, 7] and all(type(s) is int for s in at.steps)
    assert ss.KeepLatest(torch.tensor(2)).keep(infos(1, 5, 3)) == {3, 5}
    assert ss.KeepEvery(np.uint8(2)).keep(infos(1, 2, 4)) == {2, 4}
    assert ss.KeepBest(np.int32(1), "loss").n == 1
    assert saves(ss.EveryNSeconds(np.float32(2.0)), [1], last_time=0.0, now=2.5) == [1]
    with pytest.raises(TypeError, match="needs an int n, not float64"):
        ss.EveryNSteps(np.float64(5.0))
    with pytest.raises(TypeError, match="needs an int n, not Tensor"):
        ss.KeepLatest(torch.tensor(2.0))
    with pytest.raises(ValueError, match="n >= 1"):
        ss.EveryNSteps(np.int64(0))


def test_at_steps():
    assert saves(ss.AtSteps({3, 7, 100}), range(20)) == [3, 7]
    assert saves(ss.AtSteps([0]), range(3)) == [0]
    assert saves(ss.AtSteps(()), range(3)) == []


def test_every_n_seconds_uses_injected_time():
    p = ss.EveryNSeconds(60.0)
    assert p.should_save(ctx(1, now=1000.0))  # never saved: save now
    assert not p.should_save(ctx(2, last_step=1, last_time=1000.0, now=1000.0))
    assert not p.should_save(ctx(3, last_step=1, last_time=1000.0, now=1059.999))
    assert p.should_save(ctx(4, last_step=1, last_time=1000.0, now=1060.0))
    assert p.should_save(ctx(5, last_step=1, last_time=1000.0, now=5000.0))


def test_every_n_seconds_saves_when_the_clock_was_set_back():
    # now < the last save's time: the wall clock went back (NTP, a resumed VM). The
    # policy saved nothing until the clock caught up again (here an hour), so a crash
    # then lost more than an interval.
    p = ss.EveryNSeconds(60.0)
    assert p.should_save(ctx(2, last_step=1, last_time=5000.0, now=1400.0))
    assert p.should_save(ctx(2, last_step=1, last_time=1000.0, now=999.5))


def test_on_preemption():
    p = ss.OnPreemption()
    assert not p.should_save(ctx(5))
    assert p.should_save(ctx(5, preempted=True))


def test_any_of_and_all_of():
    any_ = ss.AnyOf(ss.EveryNSteps(10), ss.AtSteps({3}), ss.OnPreemption())
    assert saves(any_, range(25)) == [0, 3, 10, 20]
    assert saves(any_, range(4, 7), preempted=True) == [4, 5, 6]
    all_ = ss.AllOf(ss.EveryNSteps(2), ss.EveryNSteps(3))
    assert saves(all_, range(13)) == [0, 6, 12]
    # AllOf with a clock: every 5 steps, but not more often than every 60 s
    clocked = ss.AllOf(ss.EveryNSteps(5), ss.EveryNSeconds(60))
    assert clocked.should_save(ctx(5, last_step=0, last_time=0.0, now=61.0))
    assert not clocked.should_save(ctx(5, last_step=0, last_time=0.0, now=30.0))
    assert not clocked.should_save(ctx(6, last_step=0, last_time=0.0, now=61.0))
    # empty compositions: any() of nothing is False, all() of nothing is True
    assert not ss.AnyOf().should_save(ctx(1))
    assert ss.AllOf().should_save(ctx(1))
    # nesting
    nested = ss.AnyOf(ss.AllOf(ss.EveryNSteps(4), ss.EveryNSteps(6)), ss.OnPreemption())
    assert saves(nested, range(25)) == [0, 12, 24]


def test_user_policies_follow_the_protocols():
    class Odd:
        def should_save(self, c: SaveContext) -> bool:
            return c.step % 2 == 1

    class KeepNone:
        def keep(self, steps):
            return set()

    p: SavePolicy = ss.AnyOf(Odd(), ss.AtSteps({4}))
    assert saves(p, range(6)) == [1, 3, 4, 5]
    k: KeepPolicy = ss.KeepUnion(KeepNone(), ss.KeepLatest(1))
    assert k.keep(infos(1, 2, 3)) == {3}


# ---------------------------------------------------------------- keep policies
def test_keep_latest():
    assert ss.KeepLatest(3).keep(infos(5, 1, 9, 3, 7)) == {5, 7, 9}
    assert ss.KeepLatest(10).keep(infos(1, 2)) == {1, 2}
    assert ss.KeepLatest(1).keep(infos(4, 2)) == {4}
    assert ss.KeepLatest(0).keep(infos(1, 2)) == set()
    assert ss.KeepLatest(2).keep([]) == set()


def test_keep_every():
    assert ss.KeepEvery(10).keep(infos(0, 5, 10, 15, 20, 25)) == {0, 10, 20}
    assert ss.KeepEvery(1).keep(infos(3, 4)) == {3, 4}


def test_keep_best_min_and_max():
    m = {1: {"loss": 0.9, "acc": 0.1}, 2: {"loss": 0.3, "acc": 0.7}, 3: {"loss": 0.5, "acc": 0.9},
         4: {"acc": 0.95}, 5: {"loss": math.nan, "acc": 0.2}, 6: {"loss": 0.4}}
    steps = infos(1, 2, 3, 4, 5, 6, metrics=m)
    assert ss.KeepBest(2, "loss").keep(steps) == {2, 6}
    assert ss.KeepBest(2, "loss", mode="min").keep(steps) == {2, 6}
    assert ss.KeepBest(1, "loss", mode="max").keep(steps) == {1}  # NaN never counts
    assert ss.KeepBest(2, "acc", mode="max").keep(steps) == {3, 4}
    assert ss.KeepBest(3, "missing").keep(steps) == set()
    assert ss.KeepBest(100, "loss").keep(steps) == {1, 2, 3, 6}


def test_keep_best_ranks_finite_metrics_only(tmp_path):
    # A diverged step's loss of -inf was the best for ever (KeepBest deleted the good
    # steps for it, best_step named it); an int beyond a float's range made the ranking
    # raise OverflowError, and with it every later save.
    m = {1: {"loss": 0.5}, 2: {"loss": -math.inf}, 3: {"loss": 0.4}, 4: {"loss": math.inf},
         5: {"loss": -(10**400)}}
    steps = infos(1, 2, 3, 4, 5, metrics=m)
    assert ss.KeepBest(2, "loss").keep(steps) == {1, 3}
    assert ss.KeepBest(1, "loss", mode="max").keep(steps) == {1}
    with ss.CheckpointManager(tmp_path, async_save=False,
                              keep_policy=ss.KeepBest(2, "loss")) as mgr:
        with pytest.warns(UserWarning, match=r"step 2 .* without a number \(finite\)"):
            for s in (1, 2, 3, 4):
                mgr.save(s, {"w": np.full(3, s)}, metrics=m[s])
        assert mgr.best_step("loss") == 3
        assert mgr.steps() == [1, 3, 4]


def test_keep_best_rejects_bad_mode():
    with pytest.raises(ValueError, match="mode"):
        ss.KeepBest(1, "loss", mode="largest")


def test_keep_union_and_all():
    steps = infos(10, 15, 20, 25, 30)
    assert ss.KeepUnion(ss.KeepLatest(1), ss.KeepEvery(20)).keep(steps) == {20, 30}
    assert ss.KeepUnion().keep(steps) == set()
    m = {15: {"loss": 0.1}, 25: {"loss": 0.2}}
    best = infos(10, 15, 20, 25, 30, metrics=m)
    assert ss.KeepUnion(ss.KeepBest(1, "loss"), ss.KeepLatest(2)).keep(best) == {15, 25, 30}
    assert ss.KeepAll().keep(steps) == {10, 15, 20, 25, 30}


class _KeepListed(list):
    """Keeps the steps it lists: an empty one is falsy, and keeps none."""

    def keep(self, steps):
        return {s.step for s in steps if s.step in self}


def test_a_falsy_keep_policy_is_used_as_given(tmp_path):
    # `keep_policy or KeepAll()` put KeepAll (and `local_keep_policy or KeepLatest(2)`,
    # KeepLatest(2)) in place of a policy that is falsy, as an empty list subclass is.
    with ss.CheckpointManager(tmp_path / "a", async_save=False, keep_policy=_KeepListed()) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, {"w": np.full(3, s)})
        assert mgr.steps() == [3]
    with ss.CheckpointManager(tmp_path / "p", local_tier=tmp_path / "l", async_save=False,
                              local_keep_policy=_KeepListed()) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, {"w": np.full(3, s)})
            mgr.wait()
        assert mgr.persisted_steps() == [1, 2, 3]
    assert sorted(p.name for p in (tmp_path / "l").glob("step_*") if p.is_dir()) == [
        "step_0000000003"]
