"""A manager's job SIGKILLed anywhere in a save leaves only committed, intact steps.

Each case runs a real child process (NumPy only, so it starts fast) that
saves steps 1..5 of a state that is a deterministic function of the step,
with a fault injected by ``statestream.testing.faults`` that SIGKILLs it the
``nth`` time a point of the save path is reached. The parent then opens a
new manager on the directory and checks: only committed steps are listed
(exactly the ones expected from where the kill landed), leftovers are gone,
the latest loads bit-exact, ``verify`` passes on every step, and the next
save works. A last pair of cases does the same with two torch.distributed
(gloo) ranks, one of which is killed mid-save.
"""

from __future__ import annotations

import glob
import os
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest

import statestream as ss
from statestream import _hooks

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")

N_STEPS = 5
CHUNK = 256 << 10

# Shared by the children and the parent: the state at a step (~3 MB, ~12 chunks).
STATE_SRC = """
import numpy as np

def state_at(step, rank=0):
    g = np.random.default_rng(step)
    return {
        "step": step,
        "params": {
            "w": (np.arange(600_000, dtype=np.float32) * 0.25 + step).reshape(600, 1000),
            "b": g.integers(-2**40, 2**40, size=64_000, dtype=np.int64),
        },
        "opt": {"m": np.full((256, 256), step * 0.5, dtype=np.float64)},
        "loader": {"index": step * 32, "seed": 1234, "name": f"step-{step}"},
    }
"""
_ns: dict = {}
exec(STATE_SRC, _ns)
state_at = _ns["state_at"]

_CHILD = STATE_SRC + f"CHUNK, N_STEPS = {CHUNK}, {N_STEPS}\n" + """
import os, sys
import statestream as ss
from statestream.testing import faults

directory, mode, point, nth = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
faults.kill_at(point, nth=nth)
with ss.CheckpointManager(directory, async_save=mode == "async",
                          io=ss.IOOptions(max_chunk_bytes=CHUNK),
                          memory=ss.MemoryOptions(memory_budget_bytes=3 * CHUNK)) as mgr:
    for step in range(1, N_STEPS + 1):
        # One write(2) per line: print() under PYTHONUNBUFFERED=1 writes "begin", " ",
        # the step and "\\n" apart, and a kill from the save's thread could land between.
        os.write(1, b"begin %d\\n" % step)
        mgr.save(step, state_at(step))
    mgr.wait()
print("DONE", flush=True)
"""


def _assert_tree_equal(got, want, path="") -> None:
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), path
        for k in want:
            _assert_tree_equal(got[k], want[k], f"{path}/{k}")
    elif isinstance(want, np.ndarray):
        assert isinstance(got, np.ndarray), path
        assert got.dtype == want.dtype and got.shape == want.shape, path
        np.testing.assert_array_equal(got, want, err_msg=path)
    else:
        assert type(got) is type(want) and got == want, path


def _chunks_per_async_save() -> int:
    """How many times one save of state_at(.) reaches async.snapshot_chunk."""
    import tempfile

    count = [0]

    def cb() -> None:
        count[0] += 1

    _hooks.register("async.snapshot_chunk", cb)
    try:
        with tempfile.TemporaryDirectory() as d:
            ss.save_async(os.path.join(d, "c"), state_at(1),
                          io=ss.IOOptions(max_chunk_bytes=CHUNK)).result()
    finally:
        _hooks.clear()
    return count[0]


# (mode, point, nth) with nth either a count or ("save", k, "chunk", i) for snapshot chunks.
CASES = [
    ("async", "save.planned", 1),
    ("async", "save.planned", 3),
    ("async", "async.snapshot_chunk", 1),
    ("async", "async.snapshot_chunk", 3),
    ("async", "async.snapshot_chunk", (2, 5)),
    ("async", "async.snapshot_chunk", (4, -1)),
    ("async", "save.chunk_written", 1),
    ("async", "save.chunk_written", 2),
    ("async", "save.chunk_written", 5),
    ("async", "save.data_synced", 2),
    ("async", "commit.manifest_written", 1),
    ("async", "commit.marker_written", 3),
    ("async", "commit.renamed", 2),
    ("sync", "save.planned", 2),
    ("sync", "save.chunk_written", 1),
    ("sync", "save.chunk_written", 3),
    ("sync", "save.data_synced", 4),
    ("sync", "commit.manifest_written", 2),
    ("sync", "commit.marker_written", 1),
    ("sync", "commit.renamed", 3),
]


def _case_id(case) -> str:
    mode, point, nth = case
    n = f"s{nth[0]}c{nth[1]}" if isinstance(nth, tuple) else str(nth)
    return f"{mode}-{point}-{n}"


@pytest.fixture(scope="module")
def chunks_per_save() -> int:
    n = _chunks_per_async_save()
    assert n >= 8  # several chunks per save, as the cases assume
    return n


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_sigkill_at_fault_point(tmp_path, case, chunks_per_save):
    mode, point, nth = case
    if isinstance(nth, tuple):
        save_k, i = nth
        nth = (save_k - 1) * chunks_per_save + (i if i > 0 else chunks_per_save + 1 + i)
    d = str(tmp_path / "ckpts")
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, d, mode, point, str(nth)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == -signal.SIGKILL, (
        f"child not killed at {point}: rc={proc.returncode}\n{err}")
    begun = [int(line.split()[1]) for line in out.splitlines() if line.startswith("begin")]
    last = begun[-1]

    # Which save was killed: exact where the point is reached a known number of times per save.
    if point == "async.snapshot_chunk":
        killed = {(nth - 1) // chunks_per_save + 1}
    elif point == "save.chunk_written":
        # writes of save k may still run after the loop began step k + 1 (async)
        killed = {last - 1, last} if mode == "async" else {last}
    else:
        killed = {nth}
    assert last in killed or last - 1 in killed
    committed_by = {k: list(range(1, k + (point == "commit.renamed"))) for k in killed}

    # The kill left the killed save's staging directory behind (or, after the rename, none).
    staging = glob.glob(os.path.join(d, ".step_*.tmp-*"))
    if point == "commit.renamed":
        assert staging == []
    else:
        assert len(staging) == 1, staging
        assert int(os.path.basename(staging[0])[6:16]) in killed

    with ss.CheckpointManager(d) as mgr:
        steps = mgr.steps()
        assert steps in committed_by.values(), (steps, committed_by)
        assert glob.glob(os.path.join(d, ".step_*")) == []
        assert sorted(n for n in os.listdir(d) if n.startswith("step_")) == [
            f"step_{s:010d}" for s in steps]
        for s in steps:
            report = ss.verify(mgr.step_path(s))
            assert report.ok, report.problems
        if steps:
            assert mgr.latest_step() == steps[-1]
            _assert_tree_equal(mgr.load(), state_at(steps[-1]))
        else:
            with pytest.raises(ss.CheckpointNotFoundError):
                mgr.load()
        nxt = (steps[-1] if steps else 0) + 1
        assert mgr.save(nxt, state_at(nxt))
        mgr.wait()
        assert mgr.steps() == steps + [nxt]
        _assert_tree_equal(mgr.load(), state_at(nxt))
        assert ss.verify(mgr.step_path(nxt)).ok


# ---------------------------------------------------------------- two processes
_DIST_CHILD = STATE_SRC + f"CHUNK = {CHUNK}\n" + """
import datetime, sys
import torch.distributed as dist
import statestream as ss
from statestream.testing import faults

rank, port, directory = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
kill_rank, point, nth = int(sys.argv[4]), sys.argv[5], int(sys.argv[6])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                        world_size=2, timeout=datetime.timedelta(seconds=60))
coll = ss.TorchCollective(timeout_s=10)
if rank == kill_rank:
    faults.kill_at(point, nth=nth)
with ss.CheckpointManager(directory, async_save=False, collective=coll,
                          io=ss.IOOptions(max_chunk_bytes=CHUNK)) as mgr:
    for step in range(1, 4):
        print("begin", step, flush=True)
        mgr.save(step, state_at(step))
print("DONE", flush=True)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kill_rank,point,nth,expect", [
    (1, "save.chunk_written", 2, [1]),        # rank 1 dies writing its part of step 2
    (0, "commit.manifest_written", 3, [1, 2]),  # rank 0 dies committing step 3
], ids=["rank1-chunk_written-2", "rank0-manifest_written-3"])
def test_two_ranks_one_killed_mid_save(tmp_path, kill_rank, point, nth, expect):
    pytest.importorskip("torch.distributed")
    d = str(tmp_path / "ckpts")
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-c", _DIST_CHILD, str(r), str(port), d,
                               str(kill_rank), point, str(nth)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True)
             for r in range(2)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=150))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate()
    killed, survivor = procs[kill_rank], procs[1 - kill_rank]
    s_err = outs[1 - kill_rank][1]
    assert killed.returncode == -signal.SIGKILL, outs[kill_rank][1][-3000:]
    # the survivor failed (a collective timed out or lost its peer), it did not hang or commit
    assert survivor.returncode not in (0, None), s_err[-3000:]
    assert "DONE" not in outs[1 - kill_rank][0]
    assert ("Timeout" in s_err or "timed out" in s_err or "Distributed" in s_err
            or "Connection" in s_err), s_err[-3000:]

    with ss.CheckpointManager(d) as mgr:  # one process now: NumPy
        assert mgr.steps() == expect
        assert glob.glob(os.path.join(d, ".step_*")) == []
        for s in expect:
            assert ss.verify(mgr.step_path(s)).ok
        _assert_tree_equal(mgr.load(), state_at(expect[-1]))
        assert mgr.save(expect[-1] + 1, state_at(expect[-1] + 1))
        mgr.wait()
        _assert_tree_equal(mgr.load(), state_at(expect[-1] + 1))
