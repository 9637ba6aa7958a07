"""A manager decodes no manifest it has just committed itself.

After every save its keep policy asks for the new step's metadata, and an
incremental save asks for its base's chain depth. Until 2026-12-07 each was the
step's whole manifest read and decoded again (``metadata`` of 100k arrays: about
1 s per save; 1M: 10 s); now this process's own commits are described from what
it kept (engine._recent), checked against the commit marker. A restarted process
reads the older steps (the newest twice: its metadata, its depth).
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import statestream as ss
import statestream.engine._recent as recent
import statestream.engine._refs as refs
import statestream.manager._retention as retention


@pytest.fixture
def decoded(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """The steps whose metadata the manager read (a name per ``ss.metadata`` call)."""
    seen: Counter[str] = Counter()
    real = ss.metadata

    def counted(path: Any, **kw: Any) -> ss.CheckpointMetadata:
        seen[os.path.basename(str(path))] += 1
        return real(path, **kw)

    monkeypatch.setattr(retention, "metadata", counted)  # every read of a step's manifest
    return seen


def _state(step: int) -> dict[str, Any]:
    frozen = np.random.default_rng(0).standard_normal(2048)  # unchanged: referred to
    return {"frozen": frozen, "lora": np.full(16, float(step)), "step": step}


def _name(step: int) -> str:
    return f"step_{step:010d}"


@pytest.mark.parametrize("async_save", [False, True])
def test_incremental_saves_decode_no_manifest_of_their_own(
        tmp_path: Path, decoded: Counter[str], monkeypatch: pytest.MonkeyPatch,
        async_save: bool) -> None:
    d = tmp_path / "run"
    with ss.CheckpointManager(d, incremental=3, async_save=async_save,
                              keep_policy=ss.KeepLatest(3)) as mgr:
        for s in range(6):
            mgr.save(s, _state(s), metrics={"loss": 1.0 / (s + 1)})
        mgr.wait()
        assert mgr.steps() == [3, 4, 5]
    assert decoded == Counter()
    monkeypatch.setattr(recent, "_KEPT", recent.KeptByManifest(16))  # as in a new process
    monkeypatch.setattr(refs, "_RECENT", recent.KeptByManifest(8))
    with ss.CheckpointManager(d, incremental=3, async_save=async_save,
                              keep_policy=ss.KeepLatest(3)) as mgr:
        for s in range(6, 12):
            mgr.save(s, _state(s))
        mgr.wait()
        assert mgr.steps() == [9, 10, 11]
        np.testing.assert_array_equal(mgr.load(11)["lora"], np.full(16, 11.0))
    assert set(decoded) <= {_name(s) for s in range(6)}  # the earlier run's steps only
    assert [ss.metadata(str(d / _name(s))).meta["user"]["chain"] for s in (9, 10, 11)] \
        == [1, 2, 3]


def test_a_keep_best_policy_ranks_new_steps_without_decoding_them(
        tmp_path: Path, decoded: Counter[str]) -> None:
    d = tmp_path / "run"
    losses = [0.5, 0.2, 0.9, 0.1, 0.7]
    with ss.CheckpointManager(d, keep_policy=ss.KeepBest(2, "loss")) as mgr:
        for s, loss in enumerate(losses):
            mgr.save(s, _state(s), metrics={"loss": loss})
        mgr.wait()
        assert mgr.steps() == [1, 3, 4]  # the two best and the newest
        assert mgr.best_step("loss") == 3
    assert decoded == Counter()
