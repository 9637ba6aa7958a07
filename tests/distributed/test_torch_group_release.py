"""statestream's objects do not keep torch.distributed's groups, or rank 0's store server,
alive after ``destroy_process_group()``.

A closed CheckpointManager that is still referenced (a variable of the training
function, a reference cycle waiting for the collector) held its collective, which held
statestream's gloo group and the rendezvous store, so their threads ran on into the
interpreter's exit. There a gloo thread that lets go of finished work holding Python
tensors aborts the process ("terminate called without an active exception") after a job
that succeeded: seen about once in 20 runs of the FSDP2 example of
docs/integrations.md on a loaded machine (a core dump showed pt_gloo_runloop destroying
an all-gather's work while the main thread finalized).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _launch import PYTHON, Context, free_port, launch  # noqa: E402
from _workers import require_gloo  # noqa: E402

torch, dist = require_gloo()

THIS = os.path.abspath(__file__)
_KEPT: list[Any] = []


def _thread_names() -> list[str]:
    out = []
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                out.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return out


def worker_release(ctx: Context) -> dict[str, Any]:
    import datetime
    import gc

    import torch
    import torch.distributed as dist

    import statestream as ss
    from statestream.errors import DistributedError

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ctx.port}",
                            rank=ctx.rank, world_size=ctx.world,
                            timeout=datetime.timedelta(seconds=60))
    mgr = ss.CheckpointManager(os.path.join(ctx.tmp, "ck"), async_save=False)
    mgr.save(1, {"w": torch.full((64,), float(ctx.rank))})
    mgr.close()
    _KEPT.append(mgr)  # closed, and still referenced
    coll = mgr._coll
    during = _thread_names()
    dist.destroy_process_group()
    gc.collect()
    after = _thread_names()
    try:
        coll.barrier("after destroy")
        used = "no error"
    except DistributedError as exc:
        used = str(exc)
    return {"during": during, "after": after, "used": used}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")
def test_destroying_the_process_group_ends_its_threads(tmp_path: Path) -> None:
    results = launch(THIS, "worker_release", 2, tmp_path, timeout_s=120)
    for r in results:
        v = r.value
        assert "pt_gloo_runloop" in v["during"], v  # the names this check relies on
        assert "pt_gloo_runloop" not in v["after"] and "gloo_tcp_loop" not in v["after"], v
        assert "destroyed" in v["used"], v
    assert "pt_tcpstore_uv" in results[0].value["during"]
    assert "pt_tcpstore_uv" not in results[0].value["after"]  # rank 0 hosted the store


#: A rank that never destroys its process group and keeps its collective in a module
#: global until the interpreter ends. Its first exit handler (so the last to run)
#: counts gloo's worker threads once statestream's handlers are done; before the
#: fix, statestream's group and its threads were still there, into finalization.
_NEVER_DESTROYS = """
import atexit, datetime, os, sys

def runloops():
    names = []
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass
    return names.count("pt_gloo_runloop")

first = os.getpid()
atexit.register(lambda: os.write(  # one write: the forked child shares the pipe
    1, f"{'at exit' if os.getpid() == first else 'child at exit'} {runloops()}\\n".encode()))

import torch
import torch.distributed as dist
import statestream as ss

port, rank, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                        world_size=2, timeout=datetime.timedelta(seconds=60))
dist.barrier()  # the job's own group has its threads running
print("job's group", runloops(), flush=True)
coll = ss.TorchCollective(timeout_s=60)
ss.save(path, {"w": torch.arange(8.0) + rank}, collective=coll)
ss.load(path, collective=coll)
print("with statestream's", runloops(), flush=True)
if rank == 0 and os.fork() == 0:  # a child ending normally has none of those threads
    sys.exit(0)
"""


def _counts(out: str) -> dict[str, int]:
    return {line.rsplit(" ", 1)[0]: int(line.rsplit(" ", 1)[1])
            for line in out.splitlines() if line.rsplit(" ", 1)[-1].isdigit()}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")
def test_statestreams_group_ends_before_the_interpreter_finalizes(tmp_path: Path) -> None:
    """A job that never calls destroy_process_group(): statestream's gloo group (and its
    threads) ends at exit, before the interpreter finalizes, where a gloo thread letting
    go of a finished collective's work aborted the process about once in 20 runs on a
    loaded machine ("terminate called without an active exception")."""
    script = tmp_path / "never_destroys.py"
    script.write_text(_NEVER_DESTROYS)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    port = str(free_port())
    procs = [subprocess.Popen([PYTHON, str(script), port, str(rank), str(tmp_path / "ck")],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=env, start_new_session=True) for rank in range(2)]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:  # the whole session: rank 0's forked child too, had it hung
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out
        counts = _counts(out)
        assert {"job's group", "with statestream's", "at exit"} <= set(counts), out
        assert counts["with statestream's"] > counts["job's group"], out  # threads seen
        # the job's group (never destroyed) keeps its threads: only statestream's ended
        assert counts["at exit"] < counts["with statestream's"], out
    assert _counts(outs[0])["child at exit"] == 0, outs[0]  # it ended normally, nothing hung
