"""Fuzzing: mutated real checkpoints against load, metadata, verify and the CLI.

Every example must end in a result or a CheckpointError, within a per-example
timeout and memory cap (see statestream.testing.fuzz). The default run is
bounded; ``STATESTREAM_FUZZ_EXAMPLES=2000`` runs a longer campaign (docs/security.md).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import statestream as ss
from statestream.testing.fuzz import (
    apply_to_copy,
    failures,
    failures_of_copy,
    mutations,
    run_targets,
)

EXAMPLES = int(os.environ.get("STATESTREAM_FUZZ_EXAMPLES", "40"))
TIMEOUT_S = float(os.environ.get("STATESTREAM_FUZZ_TIMEOUT_S", "60"))

pytestmark = pytest.mark.timeout(max(600, int(EXAMPLES * TIMEOUT_S)))


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A small checkpoint with every kind of node, chunked arrays and two data files."""
    p = tmp_path_factory.mktemp("fuzz") / "base"
    rng = np.random.default_rng(0)
    state = {
        "params": {"w": rng.standard_normal((16, 8)).astype(np.float32),
                   "b": np.arange(5, dtype=np.int64), "s": np.float64(2.5)},
        "opt": {"m": [np.zeros(3, np.float16), np.ones((2, 2), np.uint8)], "lr": 1e-3},
        "blob": b"\x00\x01hello", "step": 12, "big": 3 ** 200, "name": "run\u00e9",
        "flags": (True, None, float("nan")), "empty": np.zeros((0, 4), np.int32),
    }
    ss.save(p, state, io=ss.IOOptions(max_chunk_bytes=128))
    assert ss.verify(p).ok
    return str(p)


@settings(max_examples=EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture,
                                 HealthCheck.too_slow])
@given(muts=mutations())
def test_mutated_checkpoints_fail_cleanly(base: str, muts: list[tuple[object, ...]]) -> None:
    bad = failures_of_copy(apply_to_copy(base, muts), timeout_s=TIMEOUT_S)
    assert not bad, bad


def test_harness_sees_a_hang_and_an_escape(base: str, tmp_path: Path) -> None:
    """The runner itself: an unmodified checkpoint is all ok, and what it reports as
    failures really are failures (a non-CheckpointError outcome is one)."""
    res = run_targets(base, timeout_s=TIMEOUT_S)
    assert set(res.values()) == {"ok"}, res
    assert failures({"load": "ESCAPED MemoryError"}) and failures({"all": "TIMEOUT"})
    assert not failures({"load": "error TruncatedFileError", "verify": "ok"})
