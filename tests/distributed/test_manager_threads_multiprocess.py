"""A manager's collective listing on another thread waits for the save being made
(2 gloo processes, loopback only).

With a local tier, ``steps()`` (and ``latest_step()``) gathers every node's listing:
a collective. Called on another thread while ``save`` was between two of its own
collectives, it ran its gather beside them on the same process group, and the ranks'
messages could pair the wrong calls. Now it takes the manager's call lock when the
collective has several processes. Each rank's other thread calls ``steps()`` in the
middle of a synchronous ``save(2)`` (its data planned, its commit's agreements still
to come); the test checks that the call had to wait for the lock on every rank and
then returned the same steps on every rank. Before, both ranks' other threads ran
their gather at once (the training threads were held at the same point) and
returned while ``save(2)`` was not finished.
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _launch import Context, launch  # noqa: E402
from _workers import require_gloo  # noqa: E402

torch, dist = require_gloo()

THIS = os.path.abspath(__file__)
pytestmark = pytest.mark.timeout(300)


class _Watched:
    """The manager's call lock, telling when a call has to wait for it."""

    def __init__(self, lock: Any, waiting: threading.Event) -> None:
        self._lock = lock
        self._waiting = waiting

    def __enter__(self) -> None:
        if not self._lock.acquire(blocking=False):
            self._waiting.set()
            self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def worker(ctx: Context) -> dict[str, Any]:
    import statestream as ss
    from statestream.testing import faults

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ctx.port}", rank=ctx.rank,
                            world_size=ctx.world, timeout=datetime.timedelta(seconds=90))
    root = ctx.args["root"]
    mgr = ss.CheckpointManager(os.path.join(root, "persist"),
                               local_tier=os.path.join(root, f"node{ctx.rank}"),
                               async_save=False, collective=ss.TorchCollective(timeout_s=60))
    state = {"own": {f"r{ctx.rank}": np.full(50_000, ctx.rank, dtype=np.float32)}}
    mgr.save(1, state)
    progressed, returned = threading.Event(), threading.Event()
    listed: list[Any] = []
    seen: list[bool] = []
    mgr._calls = _Watched(mgr._calls, progressed)

    def other_call() -> None:
        try:
            listed.append(mgr.steps())
        except Exception as exc:  # noqa: BLE001 - reported in the result
            listed.append(f"{type(exc).__name__}: {exc}")
        returned.set()
        progressed.set()

    other = threading.Thread(target=other_call)

    def in_the_save() -> None:  # save(2) planned; its commit's collectives to come
        other.start()
        assert progressed.wait(120)
        seen.append(returned.is_set())

    faults.on("save.planned", in_the_save)
    try:
        mgr.save(2, state)
    finally:
        faults.clear()
    other.join(120)
    out = {"returned_during_save": seen, "listed": listed, "after": mgr.steps()}
    mgr.close()
    return out


def test_steps_on_another_thread_waits_for_the_save_on_every_rank(tmp_path: Path) -> None:
    results = launch(THIS, "worker", 2, tmp_path, args={"root": str(tmp_path)},
                     timeout_s=240)
    for r in results:
        assert r.value["returned_during_save"] == [False], (r.rank, r.value)
        assert r.value["listed"] == [[1, 2]], (r.rank, r.value)
        assert r.value["after"] == [1, 2], (r.rank, r.value)
