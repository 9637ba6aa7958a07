"""The asynchronous save's own phases: the snapshot and the background phase.

``ss.save_async`` runs the same :class:`~statestream.engine._job.SaveJob` as a
synchronous save; what only an asynchronous save does lives here, as functions of
the job:

- :func:`take_snapshot` copies (or writes) every chunk this process writes before
  the state may change: all at once with every core when the staging buffers are
  warm and the state fits the budget, otherwise racing the writers (copy threads
  from the end of the writers' queues, writers from the front; small chunks
  in runs either way). On the caller's thread, or in the
  background when the save is lazy; a value modified in place before its copy
  landed fails the save, naming its key paths.
- :func:`run_background` writes, agrees, commits and then warms the staging
  buffers for the next save; it never raises (the handle carries the outcome).
"""

from __future__ import annotations

import heapq
import os
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from statestream import _hooks
from statestream.engine._core import lower_thread_priority, parallel_for
from statestream.engine._handle import EXITING
from statestream.errors import CheckpointError
from statestream.plan import WriteItem

if TYPE_CHECKING:
    from statestream.engine._job import SaveJob

__all__ = ["check_copied", "copy_order", "run_background", "take_snapshot"]

#: Most key paths a torn-snapshot error lists.
_MAX_NAMED = 20


def take_snapshot(job: SaveJob) -> None:
    """Copy or write every chunk this process writes before the state may change.

    With every staging buffer already mapped (a later save of the same
    state) and the state within the budget, every chunk is copied at once
    with every core and the writers follow (:func:`_at_once`). Otherwise the
    snapshot *races* the writers (:func:`_race`): whichever of copying (into
    fresh memory, on a first save) and writing is faster covers more.

    Raises:
        CheckpointError: a value was modified in place before its copy landed
            (a lazy snapshot raced an unguarded ``optimizer.step()``), naming
            the key paths; nothing is committed.
    """
    torn = job._torn
    if (not job.lazy and job.planner.total_bytes <= job.budget.capacity
            and job.ledger.warm(job.items)):
        _at_once(job, torn)
    else:
        _race(job, torn)
    if torn:
        raise CheckpointError(_torn_message([job.collector.key(i) for i in sorted(torn)],
                                            job.lazy))
    job.writer.flush()
    # Writers that raced the snapshot (someone waits for it) yield from now on.
    job.writer.yield_to_training()
    assert job.handle is not None
    job.handle.snapshot_finished()


def check_copied(job: SaveJob, items: Sequence[WriteItem], torn: set[int]) -> None:
    """Right after a chunk's copy landed: if its value changed since the walk, the
    copy may hold new bytes (``torn``). A change after this point is allowed."""
    if job.collector.versions:
        changed = [it.array for it in items if job.collector.changed(it.array)]
        if changed:
            with job._torn_lock:
                torn.update(changed)


def _at_once(job: SaveJob, torn: set[int]) -> None:
    # Staging is warm and the whole state fits in the budget: copy it with
    # every core first, and only then let the writers start, so checksums and
    # writes do not compete with the copy the caller is waiting for. Device
    # copies are all queued first and waited for together.
    jobs = [it for its in job.items for it in its]
    waits: list[Callable[[], None]] = []

    def one(run: list[WriteItem]) -> None:
        if len(run) > 1:  # small host chunks (_runs): the whole run fits the budget
            job.budget.acquire(sum(it.nbytes for it in run))
            job.ledger.copy_out_run(run)
        else:
            wait = job.ledger.copy_out(run[0], job.budget.acquire(run[0].nbytes))
            if wait is not None:
                waits.append(wait)
        for _ in run:
            _hooks.fire("async.snapshot_chunk")

    parallel_for(one, _runs(job, jobs), max(2, os.cpu_count() or 2))
    for wait in waits:
        wait()
    check_copied(job, jobs, torn)
    assert job.handle is not None
    job.writer.yield_to_training()  # nobody waits for these writes
    for its in job.items:
        job.writer.submit(its)
    job.handle.arrays_ready(range(len(job.items)))


#: Host chunks under this size are copied in runs (StagingLedger.copy_out_run) ...
SMALL_CHUNK_BYTES = 64 << 10
#: ... of at most this many chunks and bytes
RUN_CHUNKS, RUN_BYTES = 256, 4 << 20


def _runs(job: SaveJob, items: Sequence[WriteItem],
          limit: int = RUN_BYTES) -> list[list[WriteItem]]:
    """``items`` in order, as a snapshot's copy threads take them: consecutive
    small host chunks together (at most ``limit`` bytes a run), every other
    chunk alone."""
    arrays = job.collector.arrays
    limit = min(limit, RUN_BYTES)
    runs: list[list[WriteItem]] = []
    run: list[WriteItem] = []
    size = 0
    for it in items:
        if it.nbytes >= SMALL_CHUNK_BYTES or arrays[it.array].stage is not None:
            if run:
                runs.append(run)
                run, size = [], 0
            runs.append([it])
            continue
        if run and (len(run) >= RUN_CHUNKS or size + it.nbytes > limit):
            runs.append(run)
            run, size = [], 0
        run.append(it)
        size += it.nbytes
    if run:
        runs.append(run)
    return runs


def _race(job: SaveJob, torn: set[int]) -> None:
    # Writers start on every chunk at once, reading from the state what is not
    # copied yet; copy threads work backwards from the end of the writers' queues
    # (copy_order) into staging buffers under the budget and stop when it is full.
    # The snapshot is over when every chunk is copied or written: never later
    # than a synchronous save's writes, and with warm buffers about one copy.
    assert job.handle is not None
    _hooks.fire("async.race_begins")
    job.ledger.on_covered = job.handle.arrays_ready
    job._race = True
    job.ledger.race_start(job.items)
    for its in job.items:
        job.writer.submit(its)
    job.writer.flush()
    # runs of small chunks: a run's bytes are at most a quarter of the budget
    jobs = _runs(job, copy_order(job.items), job.budget.capacity // 4)
    full = threading.Event()

    def check(its: list[WriteItem]) -> None:
        check_copied(job, its, torn)

    def one(run: list[WriteItem]) -> None:
        for _ in run:
            _hooks.fire("async.snapshot_chunk")  # once per chunk, copied or not
        if full.is_set() or job.writer.failed():
            return
        want = sum(it.nbytes for it in run)
        got = job.budget.try_acquire(want)
        if got is None:
            full.set()  # the writers read the rest from the state
            return
        # checked before the chunks count as covered: a guarded step may go on then
        if len(run) > 1:
            job.budget.release(got - job.ledger.race_copy_run(run, check))
        elif not job.ledger.race_copy(run[0], got, check):
            job.budget.release(got)

    # A lazy snapshot copies on its own (background) thread: a thread pool cannot
    # start while the interpreter exits, and pending saves complete then.
    parallel_for(one, jobs, 1 if job.lazy else max(2, os.cpu_count() or 2))
    job.ledger.wait_covered(job.writer.failed)
    job.writer.check()


def copy_order(items: Sequence[Sequence[WriteItem]]) -> list[WriteItem]:
    """The order in which a race's copy threads take chunks: from the back of the
    writers' queues, always from the file whose writer has the most bytes left
    before it would meet the copies.

    Each data file's writer takes its chunks front to back, so what the copies
    leave over is written from the state while the call blocks. Taking them
    strictly from the last chunk backwards left one writer (behind the largest
    chunks) with most of that rest while the others had finished theirs and
    were writing staged copies, competing for the disk (budget 0.75x the state:
    two writers still writing from the state 0.1 s after the other two had
    done). Balanced, every writer reaches its copies at about the same time.

        >>> from statestream.plan import WriteItem
        >>> its = [[WriteItem(0, c, (4 * c,), (4,), 4, 0, 4 * c, 0) for c in range(2)],
        ...        [WriteItem(1, c, (2 * c,), (2,), 2, 1, 2 * c, 0) for c in range(4)]]
        >>> [(it.file, it.chunk) for it in copy_order(its)]
        [(0, 1), (1, 3), (1, 2), (0, 0), (1, 1), (1, 0)]
    """
    queues: dict[int, list[WriteItem]] = {}
    for its in items:
        for it in its:
            queues.setdefault(it.file, []).append(it)
    # (-bytes left, file): the file with the most bytes left first, ties by file
    heap = [(-sum(it.nbytes for it in q), f) for f, q in queues.items()]
    heapq.heapify(heap)
    out: list[WriteItem] = []
    while heap:
        left, f = heapq.heappop(heap)
        it = queues[f].pop()
        out.append(it)
        if queues[f]:
            heapq.heappush(heap, (left + it.nbytes, f))
    return out


def run_background(job: SaveJob, run_snapshot: bool,
                   early: BaseException | None = None) -> None:
    """The background phase: (lazy) snapshot, write, agree, commit; never raises."""
    h = job.handle
    assert h is not None
    agreed = False
    warm: tuple[list[int], list[int]] | None = None
    try:
        if early is not None:
            raise early
        if run_snapshot:
            # A lazy snapshot races the training step's optimizer.step(): it
            # runs at normal priority; everything after it yields to training.
            take_snapshot(job)
        lower_thread_priority(job.options.io.background_nice)
        job.writer.yield_to_training()
        _hooks.fire("save.planned")
        written = job.writer.close()
        _hooks.fire("save.data_synced")
        agreed = True
        job.finish(written, None)
        del written  # (freed before the collector resumes: release_values)
        job.ledger.reclaim(True)
        warm = job.ledger.warm_sizes(job.items)
        # Let go of the state before the caller hears of the commit: after
        # result() the library holds no reference to it (a training step may
        # donate or free it, and nothing of it is dropped later on this thread).
        job.release_values()
        job.resume_gc()
        h.finish()
    except BaseException as exc:
        job.writer.abort()
        job.ledger.reclaim(False)
        if job.multi and not agreed:
            try:  # the other ranks wait for this rank's verdict: give it
                job.finish({}, exc)
            except BaseException as agreed_exc:
                exc = agreed_exc
        job._abort_txn()
        job.release_values()
        job.resume_gc()
        h.fail(exc)
    try:
        if warm is not None:
            _warm_up(job, warm)
    finally:
        job.resume_gc()  # (done above unless that raised)
        h._settled.set()


def _warm_up(job: SaveJob, sizes: tuple[list[int], list[int]]) -> None:
    # Committed. Map the staging buffers the next save of this state will copy
    # into now, at low priority, rather than in that save's blocking phase (the
    # state was let go of before the commit was reported). Interpreter exit stops it,
    # and so does the next save's start.
    _hooks.fire("async.warming")
    try:
        h = job.handle
        assert h is not None
        job.ledger.warm_up(sizes, stop=lambda: EXITING.is_set() or h._superseded.is_set())
    except MemoryError:
        # Warming is an optimisation for the next save; it may fault its own
        # buffers instead. The save itself is committed and reported.
        pass


def _torn_message(keys: list[str], lazy: bool = True) -> str:
    named = ", ".join(f"'{k}'" for k in keys[:_MAX_NAMED])
    more = f" and {len(keys) - _MAX_NAMED} more" if len(keys) > _MAX_NAMED else ""
    if not lazy:  # the caller was blocked in save_async: another thread changed it
        return (
            f"the state was modified while save_async() copied it: {len(keys)} tensor(s) "
            f"changed in place before their copy was complete ({named}{more}), from "
            "another thread; the checkpoint would mix old and new values, so nothing was "
            "committed. Keep other threads from changing the state until save_async() "
            "returns")
    return (
        f"a lazy snapshot was modified before it was copied: {len(keys)} tensor(s) changed "
        f"in place after save_async() returned ({named}{more}); the checkpoint would mix "
        "old and new values, so nothing was committed. Guard the optimizer with "
        "ss.guard_optimizer(optimizer, handle), or call handle.wait_snapshot() before "
        "changing the state"
    )
