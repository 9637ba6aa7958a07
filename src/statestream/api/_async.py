"""``save_async``: a short blocking phase, then write/fsync/commit in the background.

Blocking phase (the caller's thread): walk the state, plan, and *snapshot*
every chunk into staging buffers drawn from the memory budget. Writers
start on staged chunks at once and give their buffers back as they go, so
a state larger than the budget streams through it (the blocking phase then
lasts until all but the last budget's worth is written). With
``lazy=True`` the snapshot itself runs on a background thread and
``save_async`` returns at once; ``wait_snapshot()`` (or an optimizer
guarded with :func:`guard_optimizer`) waits only for copies still pending.

Saves are serialised: a new ``save_async`` first waits for the previous one
to finish, so an in-flight save is never disturbed. Pending saves are
completed at interpreter exit, and failures are printed then — never
silently dropped.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import weakref
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

import numpy as np

from statestream import _hooks
from statestream._gc import gc_paused
from statestream.api._multi import CollectiveSave
from statestream.api._save import _Collector, check_user_meta, commit_single
from statestream.distributed import Collective, default_collective
from statestream.engine import (
    ByteBudget,
    IOOptions,
    MemoryOptions,
    Progress,
    StreamWriter,
    host_pool,
    lower_thread_priority,
    parallel_for,
    pinned_pool,
)
from statestream.errors import UnsupportedTypeError
from statestream.format import itemsize_of
from statestream.plan import ArraySpec, StreamPlanner, WriteItem
from statestream.providers import expand_pytree
from statestream.storage import storage_for
from statestream.tree import flatten, format_keypath

__all__ = ["SaveHandle", "guard_optimizer", "save_async"]

_LOCK = threading.Lock()
_LAST: SaveHandle | None = None
_PENDING: set[SaveHandle] = set()
_ATEXIT = False


class SaveHandle:
    """A save in flight. ``result()`` waits for the commit and raises its error.

    Example:
        >>> import numpy as np, tempfile, os, statestream as ss
        >>> d = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> h = ss.save_async(d, {"w": np.ones(3)})
        >>> h.result(); h.done()
        True
    """

    def __init__(self, path: str, n_arrays: int) -> None:
        self.path = path
        self._snapshot = threading.Event()
        self._finished = threading.Event()
        self._array_ready = [threading.Event() for _ in range(n_arrays)]
        self._error: BaseException | None = None
        self._snapshot_failed = False
        self._ptrs: dict[int, list[int]] = {}
        self.bytes_total = 0
        self.bytes_written = 0

    # -- progress ---------------------------------------------------------------
    def done(self) -> bool:
        """True once the save is committed (or has failed)."""
        return self._finished.is_set()

    def snapshot_done(self) -> bool:
        """True once every byte has been copied out of the state."""
        return self._snapshot.is_set()

    def progress(self) -> tuple[int, int]:
        """(bytes written, bytes total) so far."""
        return self.bytes_written, self.bytes_total

    # -- waiting ----------------------------------------------------------------
    def wait_snapshot(self, timeout: float | None = None) -> None:
        """Block until the state may be mutated (every chunk copied).

        Raises:
            TimeoutError: the snapshot did not finish within ``timeout`` seconds.
            CheckpointError: the snapshot failed (the save is abandoned).
        """
        if not self._snapshot.wait(timeout):
            raise TimeoutError(f"snapshot of {self.path} not done after {timeout}s")
        if self._snapshot_failed and self._error is not None:
            self._reported()
            raise self._error

    def wait_for(self, tensors: Iterable[Any]) -> None:
        """Block until the arrays backed by these tensors' memory are copied."""
        if self._snapshot.is_set():
            return
        ptrs = set()
        for t in tensors:
            p = _data_ptr(t)
            if p:
                ptrs.add(p)
        for ptr in ptrs:
            for ai in self._ptrs.get(ptr, ()):
                self._array_ready[ai].wait()

    def result(self, timeout: float | None = None) -> None:
        """Wait until the checkpoint is durable and committed; raise any error.

        Raises:
            TimeoutError: not finished within ``timeout`` seconds.
            CheckpointError (or the original error): the background phase failed;
                nothing was committed.
        """
        if not self._finished.wait(timeout):
            raise TimeoutError(f"save to {self.path} not finished after {timeout}s")
        if self._error is not None:
            self._reported()
            raise self._error

    def _fail(self, exc: BaseException) -> None:
        if self._error is None:
            self._error = exc
        if not self._snapshot.is_set():
            self._snapshot_failed = True
        for e in self._array_ready:
            e.set()
        self._snapshot.set()
        # A failed save stays pending until the caller has seen its error, so one
        # that nobody asked about is still reported at interpreter exit.
        self._finished.set()

    def _finish(self) -> None:
        self._finished.set()
        self._reported()

    def _reported(self) -> None:
        with _LOCK:
            _PENDING.discard(self)


def _data_ptr(t: Any) -> int:
    local = getattr(t, "to_local", None)
    if local is not None:
        t = local()
    ptr = getattr(t, "data_ptr", None)
    if ptr is None:
        return 0
    try:
        return int(ptr())
    except Exception:
        return 0


def _drain_at_exit() -> None:
    with _LOCK:
        pending = list(_PENDING)
    for h in pending:
        try:
            h.result()
        except BaseException as exc:  # report, never drop silently
            print(f"statestream: background save to {h.path} failed: "
                  f"{type(exc).__name__}: {exc}", file=sys.stderr)


def save_async(
    path: str | os.PathLike[str],
    state: Any,
    *,
    lazy: bool = False,
    overwrite: bool = False,
    pickle_paths: Collection[str] = (),
    io: IOOptions | None = None,
    memory: MemoryOptions | None = None,
    collective: Collective | None = None,
    progress: Progress | None = None,
    meta: Mapping[str, Any] | None = None,
) -> SaveHandle:
    """Start saving ``state``; return once it is safe to mutate (or at once if lazy).

    Args:
        path, state, overwrite, pickle_paths, io, memory, progress, meta: as for
            :func:`save`. ``memory`` bounds the staging buffers.
        lazy: return immediately and copy in the background; call
            ``handle.wait_snapshot()`` (or use :func:`guard_optimizer`) before
            mutating the state. In-place changes outside a guarded optimizer
            (``p.add_(...)`` under ``no_grad``) must wait for ``wait_snapshot()``.
        collective: in a multi-process job every rank calls ``save_async``; the
            plan is agreed in the blocking phase, each rank snapshots and writes
            only the chunks it owns, and the background phase agrees and commits
            (``result()`` raises on every rank if any rank failed).

    Returns:
        A :class:`SaveHandle`; ``result()`` raises any background error.

    Raises:
        UnsupportedTypeError, CheckpointExistsError: from the blocking phase,
            before anything runs in the background.
    """
    global _LAST, _ATEXIT
    coll = collective if collective is not None else default_collective()
    multi = coll.world_size > 1
    io = io or IOOptions()
    memory = memory or MemoryOptions()
    user = check_user_meta(meta)
    with _LOCK:
        previous = _LAST
        if not _ATEXIT:
            atexit.register(_drain_at_exit)
            _ATEXIT = True
    if previous is not None:
        # One save at a time. The previous one's error stays on its handle (and is
        # reported at exit unless its caller asks for it).
        previous._finished.wait()

    storage, spath = storage_for(path)
    collector = _Collector(pickle_paths)
    collector.track_ptrs = True
    jax_copies = lazy

    def leaf(p: Any, x: Any) -> Any:
        if jax_copies and _is_jax_array(x):
            # A donated buffer is freed by the step that donates it; a lazy
            # snapshot reads a private device copy instead, never the original.
            x = x.copy()
        return collector.leaf(p, x)

    job: CollectiveSave | None = None
    tree: Any = None
    if multi:
        # Collective blocking phase: walk, agree on the plan, open the shared
        # staging area; every rank then copies and writes only what it owns.
        job = CollectiveSave(path, state, overwrite, io, coll, collector, user, leaf=leaf)
        job.finish_coll = coll.fork("statestream-async")
        with gc_paused():
            job.begin()
        assert job.planner is not None
        txn, planner = job.txn, job.planner
        arrays = job.arrays
        items = job.items(copies=False)
    else:
        with gc_paused():
            txn = storage.begin_write(spath, overwrite=overwrite)
            try:
                tree = flatten(state, leaf, pytree_fn=expand_pytree,
                               fallback_fn=collector.fallback)
            except BaseException:
                txn.abort()
                raise
        arrays = collector.arrays
        planner = StreamPlanner(file_prefix="data/r0", max_files=io.write_threads(),
                                max_chunk_bytes=io.max_chunk_bytes)
        items = []
        for i, a in enumerate(arrays):
            its = planner.add(i, ArraySpec(a.shape, itemsize_of(a.dtype), False), a.boxes)
            items.append(its)
    handle = SaveHandle(spath, len(arrays))
    handle.bytes_total = planner.total_bytes
    for i in range(len(arrays)):
        for obj_ptr in collector.ptrs.get(i, ()):
            handle._ptrs.setdefault(obj_ptr, []).append(i)
    budget = ByteBudget(memory.resolved())
    # Staging buffers come from the process's pools and go back after writing,
    # so the next save copies into memory that is already mapped (or pinned).
    pools = (host_pool(), pinned_pool())
    for pool in pools:
        pool.set_capacity(budget.capacity)
    # A backend that keeps referencing written buffers (S3 uploads parts in the
    # background) must not see them recycled: they are then dropped, not kept.
    keep = memory.keep_staging and not storage.capabilities.retains_buffers
    staged: dict[tuple[int, int], np.ndarray] = {}
    staged_lock = threading.Lock()

    def source(it: WriteItem) -> np.ndarray:
        with staged_lock:
            return staged.pop((it.array, it.chunk))

    held: dict[tuple[int, int], int] = {}
    lent: dict[tuple[int, int], tuple[np.ndarray, int]] = {}

    def after_write(done: Any) -> None:
        n = sum(it.nbytes for it in done)
        handle.bytes_written += n
        with staged_lock:
            back = sum(held.pop((it.array, it.chunk), 0) for it in done)
            bufs = [lent.pop((it.array, it.chunk), None) for it in done]
        for b in bufs:
            if b is not None:
                pools[b[1]].give(b[0], keep=keep)
        budget.release(back)
        if progress is not None:
            progress(handle.bytes_written, handle.bytes_total)

    def reclaim(keep_bufs: bool) -> None:
        # After the writers have stopped: buffers never written go back (or are
        # dropped after a failure, when a device copy may still be landing).
        with staged_lock:
            left = list(lent.values())
            lent.clear()
            staged.clear()
        for buf, which in left:
            pools[which].give(buf, keep=keep and keep_bufs)

    # A failed writer never gives its staged bytes back: wake the snapshot instead
    # of letting it wait for them forever.
    writer = StreamWriter(txn, planner.file_name, source, budget=ByteBudget(1 << 62),
                          after_write=after_write, on_error=budget.abort,
                          nice=io.background_nice)

    def copy_out(ai: int, it: WriteItem, got: int) -> Callable[[], None] | None:
        """Copy one chunk into a staging buffer; return the wait for a device copy."""
        a = arrays[ai]
        which = 0 if a.stage is None else 1
        buf = pools[which].take(it.nbytes)
        key = (it.array, it.chunk)
        with staged_lock:
            held[key] = got
            lent[key] = (buf, which)
        try:
            if a.stage is not None:
                wait: Callable[[], None] | None = a.stage(it.start, it.shape, buf)
            else:
                np.copyto(buf, a.chunk(it.start, it.shape))
                wait = None
        except Exception as exc:
            raise UnsupportedTypeError(
                f"copying the value at key path "
                f"'{format_keypath(collector.paths[ai])}' failed: {exc}"
            ) from exc
        with staged_lock:
            staged[key] = buf
        return wait

    def snapshot_at_once() -> None:
        # The whole state fits in the budget: copy it with every core first, and
        # only then let the writers start, so checksums and page-cache writes do
        # not compete with the copy the caller is waiting for. Device copies are
        # all queued first and waited for together.
        jobs = [(ai, it) for ai, its in enumerate(items) for it in its]
        waits: list[Callable[[], None]] = []

        def one(job: tuple[int, WriteItem]) -> None:
            ai, it = job
            wait = copy_out(ai, it, budget.acquire(it.nbytes))
            if wait is not None:
                waits.append(wait)
            _hooks.fire("async.snapshot_chunk")

        parallel_for(one, jobs, max(2, os.cpu_count() or 2))
        for wait in waits:
            wait()
        for ai, its in enumerate(items):
            writer.submit(its)
            handle._array_ready[ai].set()
        writer.flush()
        handle._snapshot.set()

    def snapshot() -> None:
        if not lazy and planner.total_bytes <= budget.capacity:
            snapshot_at_once()
            return
        queued: list[tuple[WriteItem, Callable[[], None] | None]] = []

        def hand_over() -> None:
            # Host copies are done on return; device copies land when waited for.
            for _, wait in queued:
                if wait is not None:
                    wait()
            writer.submit([it for it, _ in queued])
            queued.clear()

        for ai, its in enumerate(items):
            for it in its:
                got = budget.try_acquire(it.nbytes)
                if got is None:
                    hand_over()
                    writer.flush()  # let writers free buffers before we wait for one
                    got = budget.acquire(it.nbytes)
                wait = copy_out(ai, it, got)
                queued.append((it, wait))
                if wait is None:
                    hand_over()
                _hooks.fire("async.snapshot_chunk")
            hand_over()
            handle._array_ready[ai].set()
        writer.flush()
        handle._snapshot.set()

    def background(run_snapshot: bool, early: BaseException | None = None) -> None:
        agreed = False
        try:
            if early is not None:
                raise early
            if run_snapshot:
                # A lazy snapshot races the training step's optimizer.step(): it
                # runs at normal priority; everything after it yields to training.
                snapshot()
            lower_thread_priority(io.background_nice)
            _hooks.fire("save.planned")
            sums = writer.close()
            _hooks.fire("save.data_synced")
            if job is not None:
                agreed = True
                job.finish(sums, None)
            else:
                commit_single(txn, tree, arrays, planner, sums, user)
            reclaim(True)
            handle._finish()
        except BaseException as exc:
            writer.abort()
            reclaim(False)
            if job is not None and not agreed:
                try:  # the other ranks wait for this rank's verdict: give it
                    job.finish({}, exc)
                except BaseException as agreed_exc:
                    exc = agreed_exc
            if job is not None:
                job.abort()
            else:
                txn.abort()
            handle._fail(exc)

    with _LOCK:
        _PENDING.add(handle)
        _LAST = handle
    if lazy:
        threading.Thread(target=background, args=(True,), name="statestream-save",
                         daemon=True).start()
        return handle
    try:
        snapshot()
    except BaseException as exc:
        if job is not None:  # still agree with the other ranks, then report
            background(False, exc)
            handle.result()
        writer.abort()
        reclaim(False)
        txn.abort()
        handle._fail(exc)
        handle._reported()  # raised to the caller right here
        raise
    threading.Thread(target=background, args=(False,), name="statestream-save",
                     daemon=True).start()
    return handle


def _is_jax_array(x: Any) -> bool:
    jax = sys.modules.get("jax")
    return jax is not None and isinstance(x, jax.Array)


_GUARDS: weakref.WeakKeyDictionary[Any, list[Any]] = weakref.WeakKeyDictionary()


def guard_optimizer(optimizer: Any, handle: SaveHandle) -> Any:
    """Make ``optimizer.step()`` wait for a lazy snapshot of what it will change.

    The first call registers one pre-step hook on the optimizer; later calls
    (one per save) just point it at the newest handle. Before each step it
    waits only for the parameters and optimizer-state tensors of pending
    snapshots that are still being copied, and costs nothing otherwise. (It
    never removes itself while torch iterates over the hooks.)

    Returns:
        The hook's removable handle (removing it ends the guarding).
    """
    import torch

    entry = _GUARDS.get(optimizer)
    if entry is not None:
        entry[1].append(handle)
        return entry[0]
    pending: list[SaveHandle] = [handle]

    def hook(opt: Any, args: Any, kwargs: Any) -> None:
        live = [h for h in pending if not h.snapshot_done()]
        pending[:] = live
        if not live:
            return
        tensors: list[Any] = [p for g in opt.param_groups for p in g["params"]]
        for st in opt.state.values():
            tensors.extend(v for v in st.values() if isinstance(v, torch.Tensor))
        for h in live:
            h.wait_for(tensors)

    removable = optimizer.register_step_pre_hook(hook)
    _GUARDS[optimizer] = [removable, pending]
    return removable
