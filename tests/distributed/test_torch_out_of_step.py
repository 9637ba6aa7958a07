"""Ranks whose statestream collectives pair across different operations (2 gloo
processes, loopback only): one rank agrees on one phase while the other agrees on
another. Every rank raises DistributedError naming each rank's phase, instead of
a TypeError from a payload of another operation.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _launch import Context, launch  # noqa: E402
from _workers import init_gloo, require_gloo  # noqa: E402

torch, dist = require_gloo()

THIS = os.path.abspath(__file__)
#: short, so a wait that should not happen ends soon; the assertions are on messages
TIMEOUT_S = 20
pytestmark = pytest.mark.timeout(300)


def _outcome(fn: Any) -> str:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - compared in the test
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def helpers(ctx: Context) -> dict[str, str]:
    """Each agreement helper with a different phase on each rank; the ranks stay in
    step afterwards (both made the same collective calls), so the next case runs."""
    import statestream as ss
    from statestream.distributed import agree, any_of, gather_each, share_from_0

    init_gloo(ctx)
    coll = ss.TorchCollective(timeout_s=TIMEOUT_S)
    mine = f"phase {ctx.rank}"
    out = {
        "agree": _outcome(lambda: agree(coll, mine, None)),
        "agree_failed": _outcome(lambda: agree(
            coll, mine, ValueError("bad") if ctx.rank == 1 else None)),
        "gather_each": _outcome(lambda: gather_each(coll, mine, lambda: ctx.rank)),
        "share_from_0": _outcome(lambda: share_from_0(coll, mine, lambda: [1, 2])),
        "any_of": _outcome(lambda: any_of(coll, mine, ctx.rank == 1)),
    }
    out["same"] = _outcome(lambda: agree(coll, "the same phase", None))
    out["same_gather"] = str(gather_each(coll, "the same phase", lambda: ctx.rank))
    return out


def test_helpers_in_different_phases_raise_naming_both_on_every_rank(tmp_path: Path) -> None:
    got = [r.value for r in launch(THIS, "helpers", 2, tmp_path, timeout_s=240)]
    for case in ("agree", "agree_failed", "gather_each", "share_from_0", "any_of"):
        for rank in (0, 1):
            msg = got[rank][case]
            assert msg.startswith("DistributedError: "), (case, got)
            assert ("ranks out of step: the ranks called different operations at the same "
                    "point: rank 0 was in 'phase 0', rank 1 in 'phase 1'") in msg, (case, got)
            # a failure that came with it is named first, with its rank's own phase
            assert (msg.startswith("DistributedError: rank 1 failed during 'phase 1': "
                                   "ValueError: bad; ranks out of step")
                    == (case == "agree_failed")), (case, got)
    for rank in (0, 1):
        assert "nothing was committed" in got[rank]["agree"], got
        assert "nothing was changed" in got[rank]["gather_each"], got
        assert got[rank]["same"] == "ok", got
        assert got[rank]["same_gather"] == "[0, 1]", got



def mixed(ctx: Context) -> dict[str, str]:
    """One rank agrees while the other gathers: different kinds of collective calls."""
    import statestream as ss
    from statestream.distributed import agree, gather_each, share_from_0

    init_gloo(ctx)
    coll = ss.TorchCollective(timeout_s=TIMEOUT_S)
    calls = [lambda: gather_each(coll, "phase 0", lambda: 5),
             lambda: agree(coll, "phase 1", None)]
    out = {"gather_agree": _outcome(calls[ctx.rank])}
    calls = [lambda: share_from_0(coll, "phase 0", lambda: 5),
             lambda: agree(coll, "phase 1", ValueError("x"))]
    out["share_agree"] = _outcome(calls[ctx.rank])
    return out


def test_an_agreement_and_a_gather_in_different_phases_raise_naming_both(
        tmp_path: Path) -> None:
    got = [r.value for r in launch(THIS, "mixed", 2, tmp_path, timeout_s=240)]
    for case in ("gather_agree", "share_agree"):
        for rank in (0, 1):
            msg = got[rank][case]
            assert "ranks out of step" in msg, (case, got)
            assert "rank 0 was in 'phase 0', rank 1 in 'phase 1'" in msg, (case, got)
            assert ("rank 1 failed during 'phase 1': ValueError: x"
                    in msg) == (case == "share_agree"), (case, got)


def manager(ctx: Context) -> dict[str, Any]:
    """Rank 0 saves step 2 while rank 1 closes its manager (its keep policy's agreement)."""
    import statestream as ss

    init_gloo(ctx)
    root = Path(ctx.args["root"])
    coll = ss.TorchCollective(timeout_s=TIMEOUT_S)
    mgr = ss.CheckpointManager(root / "ck", async_save=False, collective=coll)
    mgr.save(1, {"w": np.full(100, ctx.rank, np.float32)})
    out: dict[str, Any] = {"preemption": _outcome(
        [lambda: mgr.reached_preemption(2),
         lambda: mgr.save(2, {"w": np.zeros(100, np.float32)})][ctx.rank])}
    calls = [lambda: mgr.save(2, {"w": np.zeros(100, np.float32)}), mgr.close]
    out["outcome"] = _outcome(calls[ctx.rank])
    done = root / "rank0-done"
    if ctx.rank == 0:
        out["listed"] = sorted(p.name for p in (root / "ck").iterdir())
        done.touch()
    else:  # rank 1 stays until rank 0 has its error
        while not done.exists():
            time.sleep(0.05)
    return out


def test_a_save_beside_a_close_raises_naming_both_on_every_rank(tmp_path: Path) -> None:
    got = [r.value for r in launch(THIS, "manager", 2, tmp_path, timeout_s=240,
                                   args={"root": str(tmp_path)})]
    for rank in (0, 1):
        msg = got[rank]["outcome"]
        assert msg.startswith("DistributedError: ranks out of step"), got
        assert ("rank 0 was in 'deciding whether to save step 2', "
                "rank 1 in 'applying the keep policy'") in msg, got
    for rank in (0, 1):
        msg = got[rank]["preemption"]
        assert msg.startswith("DistributedError: ranks out of step"), got
        assert ("rank 0 was in 'checking for a preemption at step 2', "
                "rank 1 in 'deciding whether to save step 2'") in msg, got
    assert got[0]["outcome"].endswith("nothing was changed"), got
    assert got[1]["outcome"].endswith("the keep policy was not applied"), got
    assert [n for n in got[0]["listed"] if n.startswith("step_")] == ["step_0000000001"], got
