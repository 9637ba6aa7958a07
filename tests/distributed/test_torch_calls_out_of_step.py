"""Two ranks in different raw collectives (a broadcast against an all-reduce, an
all-gather against a barrier): the error names what each rank was in, from the arrival
marks, instead of only "waited more than timeout_s" (real processes, gloo)."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _launch import Context, launch  # noqa: E402
from _workers import init_gloo  # noqa: E402

pytest.importorskip("torch")

THIS = __file__

CALLS = {
    "broadcast": lambda c: c.broadcast_object("x"),
    "all_reduce": lambda c: c.max_ints([1]),
    "all_gather": lambda c: c.all_gather_object("x"),
    "barrier": lambda c: c.barrier("b"),
}


def worker_mismatch(ctx: Context) -> dict[str, Any]:
    init_gloo(ctx, 90.0)
    import statestream as ss

    coll = ss.TorchCollective(timeout_s=3)
    coll.max_ints([0])  # one call in step first: both at call #2 next
    mine = ctx.args["calls"][ctx.rank]
    time.sleep(ctx.args.get("late", [0, 0])[ctx.rank])
    t0 = time.monotonic()
    try:
        CALLS[mine](coll)
        out: dict[str, Any] = {"type": None, "message": "no error"}
    except Exception as exc:  # noqa: BLE001
        out = {"type": type(exc).__name__, "message": str(exc),
               "distributed": isinstance(exc, ss.DistributedError)}
    out["elapsed_s"] = time.monotonic() - t0
    # Each rank stays until the other's call has ended: rank 0 hosts the rendezvous
    # store (rank 1 reads the marks from it), and a rank that exits first closes its
    # connections, which the other's call, not yet timed out on a loaded machine,
    # then reports as a gloo error instead of its timeout.
    (Path(ctx.tmp) / f"rank{ctx.rank}-done").touch()
    other = Path(ctx.tmp) / f"rank{1 - ctx.rank}-done"
    deadline = time.monotonic() + 60
    while not other.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return out


@pytest.mark.timeout(200)
@pytest.mark.parametrize("calls", [("broadcast", "all_reduce"), ("all_gather", "barrier")],
                         ids="-".join)
def test_ranks_in_different_collectives_are_named(tmp_path: Path, calls: tuple[str, str]) -> None:
    res = launch(THIS, "worker_mismatch", 2, tmp_path, args={"calls": list(calls)},
                 timeout_s=120, check=False)
    a, b = calls
    for rank, (mine, theirs) in enumerate([(a, b), (b, a)]):
        v = res[rank].value
        assert v["type"] == "CollectiveTimeoutError" and v["distributed"], v
        assert (f"rank {1 - rank} is at {_mark(theirs)} (call #2) while this rank is at "
                f"{_mark(mine)}: the ranks called different statestream functions"
                in v["message"]), v["message"]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("calls", [("all_gather", "barrier"), ("barrier", "all_gather")],
                         ids="-".join)
def test_a_rank_whose_peer_gave_up_first_names_the_calls_too(tmp_path: Path,
                                                            calls: tuple[str, str]) -> None:
    """Rank 0 enters its call 2 s after rank 1: rank 1 times out first, and rank 0's
    call then fails on the connection rank 1 closed, before its own timeout. That
    was a bare DistributedError ("all_gather (call #2) failed: [gloo ...]"), which
    named neither call (it failed a CI run as a flaky timing)."""
    res = launch(THIS, "worker_mismatch", 2, tmp_path,
                 args={"calls": list(calls), "late": [2.0, 0.0]}, timeout_s=120, check=False)
    for rank, theirs in enumerate(reversed(calls)):
        v = res[rank].value
        assert v["type"] == "CollectiveTimeoutError" and v["distributed"], v
        assert f"rank {1 - rank} is at {_mark(theirs)} (call #2)" in v["message"], v["message"]


def _mark(call: str) -> str:
    return "barrier 'b'" if call == "barrier" else call
