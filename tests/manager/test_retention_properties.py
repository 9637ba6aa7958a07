"""The keep policy with references (Retention), checked against its promises on random
histories (Hypothesis).

Retention decides what a manager deletes, so a mistake there loses checkpoints.
The steps here live in a dictionary (a fake directory: steps, their metrics, the
steps each refers to, some unreadable); the real manager runs the same class on
real checkpoints in test_incremental_manager.py and test_tier_incremental*.py.
After every ``apply``:

- every step a kept step refers to remains (a retired step's own references
  are not kept: references are flattened, it is kept for its own chunks);
- the latest step, the protected steps and every step the policy keeps remain
  (the policy sees the steps that refer to no step that is gone);
- a step whose manifest cannot be read stays, and so does every step older than
  it (what it refers to is unknown); the policy sees the readable steps;
- a step the policy drops and no kept step refers to is gone;
- deletions go newest first; ``listed`` is the remaining steps minus the
  retired ones (dropped by the policy, kept only for a reference) and, but
  for the newest, those that refer to a step that is gone.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import statestream as ss  # noqa: E402
from statestream.errors import CheckpointError  # noqa: E402
from statestream.manager import _retention  # noqa: E402
from statestream.manager._retention import Retention  # noqa: E402


class _Dir:
    """A manager directory in memory: step -> (loss, the steps it refers to)."""

    directory = "mem"

    def __init__(self) -> None:
        self.held: dict[int, tuple[float, list[int]]] = {}
        self.unreadable: set[int] = set()
        self.deleted: list[int] = []

    def steps(self) -> list[int]:
        return sorted(self.held)

    def listing(self) -> tuple[list[int], list[str]]:
        return self.steps(), []  # no entries but steps: none refers to one

    def path(self, step: int) -> str:
        return f"mem/{step}"

    def is_committed(self, step: int) -> bool:
        return step in self.held

    def delete(self, step: int) -> None:
        del self.held[step]
        self.deleted.append(step)


def _policies() -> st.SearchStrategy[Any]:
    simple = st.one_of(
        st.builds(ss.KeepLatest, st.integers(1, 4)),
        st.builds(ss.KeepBest, st.integers(1, 3), st.just("loss")),
        st.builds(ss.KeepEvery, st.integers(2, 4)),
    )
    return st.one_of(simple, st.lists(simple, min_size=2, max_size=3).map(
        lambda ps: ss.KeepUnion(*ps)))


# one history event: a new step referring to some older ones, or an apply with some
# steps protected, or a step's manifest becoming unreadable (or readable again)
_EVENTS = st.lists(st.one_of(
    st.tuples(st.just("save"), st.floats(0, 1), st.lists(st.integers(0, 20), max_size=3)),
    st.tuples(st.just("apply"), st.lists(st.integers(0, 40), max_size=3)),
    st.tuples(st.just("unreadable"), st.integers(0, 40)),
), min_size=1, max_size=30)


@settings(max_examples=150, deadline=None)
@given(policy=_policies(), events=_EVENTS)
def test_retention_keeps_its_promises(policy: Any, events: list[Any]) -> None:
    d = _Dir()

    def info(path: str, step: int) -> dict[str, Any]:
        if step in d.unreadable or step not in d.held:
            raise CheckpointError(f"{path} cannot be read")
        loss, bases = d.held[step]
        return {"step": step, "time": float(step), "metrics": {"loss": loss},
                "metadata": {}, "nbytes": 1, "bases": [f"step_{b:010d}" for b in bases]}

    mp = pytest.MonkeyPatch()
    mp.setattr(_retention, "step_info", info)
    try:
        r = Retention(policy, d)  # type: ignore[arg-type]
        step = 0
        for ev in events:
            if ev[0] == "save":
                step += 1
                have = d.steps()
                # references point to older steps still there (a save's base and its bases)
                bases = sorted({have[i % len(have)] for i in ev[2]}) if have else []
                d.held[step] = (ev[1], bases)
                r.forget(step)
            elif ev[0] == "unreadable":
                s = ev[1]
                d.unreadable ^= {s}
                r.forget(s)
            else:
                _check_apply(r, d, policy, {s for s in ev[1] if s in d.held})
    finally:
        mp.undo()


def _held(before: list[int], readable: set[int]) -> set[int]:
    """The unreadable steps and every step older than one (they stay)."""
    bad = [s for s in before if s not in readable]
    return {s for s in before if s <= bad[-1]} if bad else set()


def _broken(steps: list[int], readable: set[int], d: _Dir) -> set[int]:
    """The readable ``steps`` that refer to a step not among them (cannot be loaded)."""
    return {s for s in steps if s in readable and not set(d.held[s][1]) <= set(steps)}


def _check_apply(r: Retention, d: _Dir, policy: Any, protected: set[int]) -> None:
    before = d.steps()
    readable = {s for s in before if s not in d.unreadable}
    broken = _broken(before, readable, d)
    infos = [r._info(s) for s in before if s not in broken]
    kept_by_policy = set(policy.keep([i for i in infos if i is not None]))
    d.deleted.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the unreadable steps, named
        gone = r.apply(protected)
    after = d.steps()
    assert gone == d.deleted == sorted(gone, reverse=True)  # newest first
    if len(before) <= 1:
        assert not gone
        return
    must_stay = kept_by_policy | protected | {before[-1]} | _held(before, readable)
    assert must_stay & set(before) <= set(after)
    keep_of = must_stay & set(before)
    for s in keep_of & readable:  # what a kept step refers to stays
        assert set(d.held[s][1]) & set(before) <= set(after), (s, d.held[s][1], after)
    needed = _direct(keep_of, readable, d)
    # only what a kept step refers to directly: references are flattened, so a retired
    # step is kept for its own chunks, not for what it refers to (that leaked: KeepLatest(1)
    # with arrays changing in turn kept every step of the chain)
    assert set(after) == keep_of | (needed & set(before))
    # listed: what remains, less the retired (dropped by the policy, needed by a kept one)
    # and the steps that refer to a step that is gone (but the newest)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        broken_now = _broken(after, readable, d)
        kept_now = set(policy.keep([i for i in map(r._info, after)
                                    if i is not None and i.step not in broken_now]))
        listed = set(r.listed())
    kept_now |= ({after[-1]} if after else set()) | _held(after, readable)
    needed_now = _direct(kept_now & set(after), readable, d)
    assert listed == {s for s in after if (s in kept_now or s not in needed_now)
                      and (s not in broken_now or s == after[-1])}
    for s in listed - {after[-1]}:  # a listed step loads: nothing it refers to is gone
        assert s not in readable or set(d.held[s][1]) <= set(after), (s, after)


def _direct(keep: set[int], readable: set[int], d: _Dir) -> set[int]:
    """The steps the ``keep`` steps refer to (an unreadable one's references are
    unknown: every older step is kept instead, see _held)."""
    return {b for s in keep if s in readable for b in d.held[s][1]}
