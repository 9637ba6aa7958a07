"""The staging ledger: which staging buffer holds which chunk, until it is written.

One ledger per save, for both ways a save reads its state:

- *streaming* (``ss.save``): writers call :meth:`read` for each chunk; host
  arrays hand out views (or copies charged to the writer's budget), device
  arrays are staged into page-locked buffers from the pinned pool;
- *snapshot* (``ss.save_async``): :meth:`copy_out` copies each chunk into a
  buffer from the host or pinned pool (charged to the snapshot budget)
  before writers see it, and :meth:`take` hands it to the writer;
- *race* (``ss.save_async`` whose staging is not all warm, and lazy saves):
  writers start on every chunk at once, reading through :meth:`race_source`
  (the staged copy if there is one, else the state itself), while copy
  threads work from the other end with :meth:`race_copy` (runs of small
  chunks with :meth:`race_copy_run`); a chunk is
  *covered* once it is copied or its direct write returned, and the
  snapshot is over when every chunk is covered (:meth:`wait_covered`).

Either way :meth:`after_write` gives written chunks' buffers back to their
pool (kept for the next save unless the storage retains written buffers)
and :meth:`reclaim` settles whatever was never written.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np

from statestream.engine._core import MemoryOptions
from statestream.engine._staging import StagingPool, host_pool, pinned_pool
from statestream.errors import CheckpointError, UnsupportedTypeError
from statestream.plan import WriteItem
from statestream.providers import PreparedArray

__all__ = ["StagingLedger"]

_Key = tuple[int, int]


def _copy_into(a: PreparedArray, item: WriteItem, out: np.ndarray) -> None:
    """Copy a host chunk into ``out``: straight from the array where it copies (a
    temporary copy of each chunk first took memory outside the budget)."""
    if a.copy_into is not None:
        a.copy_into(item.start, item.shape, out)
    else:
        np.copyto(out, a.chunk(item.start, item.shape))


class StagingLedger:
    """Staging buffers lent out for one save (thread-safe)."""

    def __init__(self, arrays: list[PreparedArray], key_of: Callable[[int], str],
                 memory: MemoryOptions, *, retains_buffers: bool, snapshot: bool,
                 capacity: int | None = None) -> None:
        self._arrays = arrays
        self._key_of = key_of
        # A backend that keeps referencing written buffers (S3 uploads parts in the
        # background) must not see them recycled: they are then dropped, not kept.
        self._keep = memory.keep_staging and not retains_buffers
        self._retains = retains_buffers
        self._pools: tuple[StagingPool, StagingPool] = (host_pool(), pinned_pool())
        for pool in self._pools if snapshot else self._pools[1:]:
            pool.set_capacity(memory.resolved() if capacity is None else capacity)
        #: the pools' epochs when the save began: after a release_staging() since
        #: then, it keeps no buffer and maps none for the next save (StagingPool.epoch)
        self._since = tuple(pool.epoch for pool in self._pools)
        self._lock = threading.Lock()
        self._lent: dict[_Key, tuple[np.ndarray, int]] = {}
        self._staged: dict[_Key, np.ndarray] = {}
        self._held: dict[_Key, int] = {}
        # race mode: chunks a writer read from the state, and the chunks not yet
        # covered per array
        self._direct: set[_Key] = set()
        self._left: list[int] = []
        self._left_in_file: Counter[int] = Counter()  # per data file: chunks not covered
        self._uncovered = 0
        self._covered_cv = threading.Condition(self._lock)
        #: told the arrays whose chunks are all covered, many at once where it can
        self.on_covered: Callable[[Sequence[int]], None] = lambda ais: None
        self.copied_bytes = 0
        self.direct_bytes = 0
        self._fresh = False  # race copies may take fresh host buffers (race_start)
        self._capacity = memory.resolved() if capacity is None else capacity

    def leave_room(self, in_use: int) -> None:
        """A synchronous save holds ``in_use`` bytes of its budget (copies of chunks,
        compression buffers): free the idle host staging buffers kept between saves
        beyond what the budget leaves, so that the two together stay within it."""
        host_pool().trim_idle(self._capacity - in_use)

    def set_staging_capacity(self, capacity: int) -> None:
        """A snapshot's staging share of the budget (the rest is the writers'): the
        host pool keeps at most that much, idle and lent together, so that idle
        staging buffers and the writers' own stay within the budget together."""
        self._pools[0].set_capacity(capacity)

    # -- streaming -------------------------------------------------------------------
    def read(self, item: WriteItem) -> np.ndarray:
        """The chunk's bytes, read from the state now (writer threads)."""
        a = self._arrays[item.array]
        try:
            if a.stage is None:
                data: np.ndarray = a.chunk(item.start, item.shape)
                if data.nbytes != item.nbytes:  # a provider's bug: never a short chunk
                    raise UnsupportedTypeError(
                        f"reading the value at key path '{self._key_of(item.array)}' gave "
                        f"{data.nbytes} bytes for a chunk of {item.nbytes}")
                return data
            pool = self._pools[1]
            buf = pool.take(item.nbytes)
            try:
                a.stage(item.start, item.shape, buf)()
            except BaseException:
                pool.give(buf, keep=False)  # a device copy may still land in it
                raise
            with self._lock:
                self._lent[(item.array, item.chunk)] = (buf, 1)
            return buf
        except CheckpointError:
            raise
        except Exception as exc:
            raise UnsupportedTypeError(
                f"reading the value at key path '{self._key_of(item.array)}' failed: {exc}"
            ) from exc

    def lendable(self, item: WriteItem) -> bool:
        """Whether :meth:`read` hands out the state's own memory for this chunk
        (not a copy, not a staging buffer), which a synchronous save leaves as is."""
        a = self._arrays[item.array]
        return a.stage is None and not a.copies

    # -- snapshot --------------------------------------------------------------------
    def copy_out(self, item: WriteItem, charged: int) -> Callable[[], None] | None:
        """Copy one chunk into a staging buffer; return the wait for a device copy.

        ``charged`` bytes of the snapshot budget are released once it is written.
        """
        a = self._arrays[item.array]
        which = 0 if a.stage is None else 1
        buf = self._pools[which].take(item.nbytes)
        key = (item.array, item.chunk)
        with self._lock:
            self._held[key] = charged
            self._lent[key] = (buf, which)
        try:
            if a.stage is not None:
                wait: Callable[[], None] | None = a.stage(item.start, item.shape, buf)
            else:
                _copy_into(a, item, buf)
                wait = None
        except Exception as exc:
            raise UnsupportedTypeError(
                f"copying the value at key path '{self._key_of(item.array)}' failed: {exc}"
            ) from exc
        with self._lock:
            self._staged[key] = buf
        return wait

    def copy_out_run(self, items: Sequence[WriteItem]) -> None:
        """:meth:`copy_out` for small host chunks, many at once (each charged its own
        size): their buffers under one lock of the pool, their records under one of
        the ledger, and each copy keeps the interpreter lock (a memoryview copy:
        NumPy's releases it for more than 500 elements and then waits to take it
        back, once per chunk). Up to 8 us a chunk went to those steps: 0.16 s of
        a snapshot of 20,000 small tensors."""
        bufs = self._pools[0].take_many([it.nbytes for it in items])
        with self._lock:
            for it, buf in zip(items, bufs):
                key = (it.array, it.chunk)
                self._held[key] = it.nbytes
                self._lent[key] = (buf, 0)
        for it, buf in zip(items, bufs):
            self._copy_small(it, buf)
        with self._lock:
            for it, buf in zip(items, bufs):
                self._staged[(it.array, it.chunk)] = buf

    def _copy_small(self, it: WriteItem, buf: np.ndarray) -> None:
        # a small host chunk into ``buf``, keeping the interpreter lock (copy_out_run)
        a = self._arrays[it.array]
        try:
            if a.copy_into is not None:
                a.copy_into(it.start, it.shape, buf)
                return
            src = a.chunk(it.start, it.shape)
            if src.flags.c_contiguous and src.dtype == buf.dtype:
                buf.data[:] = src.data.cast("B")
            else:
                np.copyto(buf, src)
        except Exception as exc:
            raise UnsupportedTypeError(
                f"copying the value at key path '{self._key_of(it.array)}' failed: {exc}"
            ) from exc

    def take(self, item: WriteItem) -> np.ndarray:
        """The staged copy of a chunk (writer threads)."""
        with self._lock:
            return self._staged.pop((item.array, item.chunk))

    # -- race ----------------------------------------------------------------------
    def race_start(self, items: Sequence[Sequence[WriteItem]]) -> None:
        """Count the chunks to cover (``items[i]``: array ``i``'s); arrays with
        none are covered at once."""
        # Fresh host buffers for the copy threads only where the writers hold no
        # memory of their own while they race: their copies of non-contiguous or
        # byte-swapped chunks (charged to the writers' share, race_copy_bytes), and
        # an object store's private copies. (Fresh ones beside the writers' copies
        # took a first save_async of 384 MiB of such arrays under 32 MiB from +33
        # MiB peak RSS to +65, though within the budget's accounting.)
        self._fresh = not self._retains and not any(
            a.copies for its, a in zip(items, self._arrays) if its and a.stage is None)
        with self._lock:
            self._left = [len(its) for its in items]
            self._left_in_file = Counter(it.file for its in items for it in its)
            self._uncovered = sum(self._left)
        self.on_covered([ai for ai, n in enumerate(self._left) if n == 0])

    def _cover_locked(self, item: WriteItem) -> int | None:
        self._uncovered -= 1
        self._left[item.array] -= 1
        self._left_in_file[item.file] -= 1
        if self._uncovered == 0:
            self._covered_cv.notify_all()
        return item.array if self._left[item.array] == 0 else None

    def race_copy(self, item: WriteItem, charged: int,
                  check: Callable[[list[WriteItem]], None]) -> bool:
        """Copy one chunk into a pooled buffer unless a writer already read it
        (copy threads): a host buffer idle or fresh (see :meth:`race_start`), a
        page-locked one only idle.

        ``check([item])`` runs once the copy landed and before the chunk counts as
        covered: its array's values must not have changed since the walk. Covered,
        a guarded step may change them (as :meth:`race_written` checks first too).

        Returns whether the copy was kept; if not, the caller releases
        ``charged``. A device copy is waited for here.
        """
        key = (item.array, item.chunk)
        with self._lock:
            if key in self._direct:
                return False
        a = self._arrays[item.array]
        which = 0 if a.stage is None else 1
        # Host buffers may be fresh: without huge-page advice (statestream._memory)
        # copying 1 GiB into fresh pages takes 0.28 s with two threads here, faster
        # than the writers write it (0.55 s). Page-locked buffers are costly to
        # allocate (cudaHostAlloc): only those already mapped.
        pool = self._pools[which]
        try:
            got = (pool.take_within(item.nbytes) if which == 0 and self._fresh
                   else pool.take_idle(item.nbytes))
        except MemoryError:
            got = None  # the writers read it from the state
        if got is None:
            return False
        buf = got
        try:
            if a.stage is not None:
                a.stage(item.start, item.shape, buf)()
            else:
                _copy_into(a, item, buf)
        except BaseException as exc:
            self._pools[which].give(buf, keep=False)  # a device copy may still land
            if isinstance(exc, Exception):
                raise UnsupportedTypeError(
                    f"copying the value at key path '{self._key_of(item.array)}' failed: {exc}"
                ) from exc
            raise
        return self._keep_copies([(item, buf)], which, charged, check) > 0  # (nbytes > 0)

    def race_copy_run(self, items: Sequence[WriteItem],
                      check: Callable[[list[WriteItem]], None]) -> int:
        """:meth:`race_copy` for a run of small host chunks (engine/_snapshot.py's
        ``_runs``), each charged its own size: one lock of the ledger to claim
        them, one of the pool for their buffers, one to cover them, and copies that
        keep the interpreter lock. Per chunk, a copy thread waited about 140 us to
        take it back after NumPy's copy released it, while the writers held it.

        Returns the bytes of the copies kept; the caller releases the rest.
        """
        with self._lock:
            todo = [it for it in items if (it.array, it.chunk) not in self._direct]
        if not todo:
            return 0
        pool = self._pools[0]
        bufs = pool.take_some([it.nbytes for it in todo], fresh=self._fresh)
        pairs = [(it, buf) for it, buf in zip(todo, bufs) if buf is not None]
        try:
            for it, buf in pairs:
                self._copy_small(it, buf)
        except BaseException:
            for _, buf in pairs:
                pool.give(buf, keep=self._keep, since=self._since[0])
            raise
        return self._keep_copies(pairs, 0, None, check)

    def _keep_copies(self, pairs: list[tuple[WriteItem, np.ndarray]], which: int,
                     charged: int | None, check: Callable[[list[WriteItem]], None]) -> int:
        """Keep and cover the chunks whose copies landed in ``pairs`` (each charged
        its size, or ``charged`` for a single chunk) after ``check``; give back the
        buffers of those a writer read from the state meanwhile. Returns the bytes
        kept."""
        with self._lock:
            mine = [it for it, _ in pairs if (it.array, it.chunk) not in self._direct]
        if mine:  # else their writers check them (and may have covered them already)
            check(mine)
        kept = 0
        ready: list[int] = []
        back: list[np.ndarray] = []
        with self._lock:
            for it, buf in pairs:
                key = (it.array, it.chunk)
                if key in self._direct:  # a writer read it from the state meanwhile
                    back.append(buf)
                    continue
                self._held[key] = it.nbytes if charged is None else charged
                self._lent[key] = (buf, which)
                self._staged[key] = buf
                kept += it.nbytes
                r = self._cover_locked(it)
                if r is not None:
                    ready.append(r)
            self.copied_bytes += kept
        for buf in back:
            self._pools[which].give(buf, keep=self._keep, since=self._since[which])
        self.on_covered(ready)
        return kept

    def race_defer(self, item: WriteItem,
                   failed: Callable[[], bool]) -> Callable[[], None] | None:
        """Whether a writer should hold off writing ``item`` (a staged copy) until the
        snapshot is complete: a waiter, or None to write it now.

        It should while other files' chunks are still to be written from the state
        and its own file has none left: its staged copies can wait, and the disk is
        then the other writers' alone. (Sharing it with writers of staged copies,
        later saves with a budget of half the state blocked 0.71 s instead of
        0.51.) Its own file having none left means no chunk the snapshot waits
        for is behind it in its queue, so waiting cannot stall it.
        """
        if self._uncovered <= 0:  # the common case once the race is over: no lock
            return None
        with self._lock:
            if (self._uncovered <= 0 or self._left_in_file[item.file] > 0
                    or (item.array, item.chunk) not in self._staged):
                return None
        return lambda: self.wait_covered(failed)

    def race_copy_bytes(self, item: WriteItem) -> int:
        """The bytes :meth:`race_source` would allocate to read ``item`` now: a copy of
        a non-contiguous or byte-swapped chunk not staged (writers, before they take
        it; a copy staged meanwhile leaves the charge unused until the write)."""
        a = self._arrays[item.array]
        if not a.copies or a.stage is not None:
            return 0
        with self._lock:
            return 0 if (item.array, item.chunk) in self._staged else item.nbytes

    def race_source(self, item: WriteItem) -> np.ndarray:
        """The chunk's staged copy, or (not copied yet) the state itself (writers)."""
        key = (item.array, item.chunk)
        with self._lock:
            buf = self._staged.pop(key, None)
            if buf is None:
                self._direct.add(key)
        if buf is not None:
            return buf
        a = self._arrays[item.array]
        if self._retains and a.stage is None:
            # The storage keeps reading written buffers after the write returns (an
            # upload in flight): never hand it the state's memory, which may change
            # once the snapshot is over. A private copy, dropped after the upload.
            own = self._pools[0].take(item.nbytes)
            with self._lock:
                self._lent[key] = (own, 0)
            _copy_into(a, item, own)
            return own
        return self.read(item)

    def race_written(self, items: Sequence[WriteItem],
                     check: Callable[[list[WriteItem]], None]) -> None:
        """After a write: ``check`` the chunks that were written from the state
        (their values must not have changed since the walk), then cover them."""
        with self._lock:
            direct = [it for it in items if (it.array, it.chunk) in self._direct]
        if not direct:
            return
        check(direct)
        ready: list[int] = []
        with self._lock:
            for it in direct:
                self.direct_bytes += it.nbytes
                r = self._cover_locked(it)
                if r is not None:
                    ready.append(r)
        self.on_covered(ready)

    def warm(self, items: Sequence[Sequence[WriteItem]]) -> bool:
        """Whether the pools can stage every chunk in buffers already mapped."""
        sizes: tuple[list[int], list[int]] = ([], [])
        for its in items:
            for it in its:
                sizes[0 if self._arrays[it.array].stage is None else 1].append(it.nbytes)
        return all(pool.can_serve(sz) for pool, sz in zip(self._pools, sizes))

    def warm_sizes(self, items: Sequence[Sequence[WriteItem]]
                   ) -> tuple[list[int], list[int]]:
        """The buffer sizes :meth:`warm_up` maps for this save's chunks (host, pinned),
        last first (the order a racing snapshot copies them); none when buffers are
        not kept. Asked before the save lets go of its arrays."""
        sizes: tuple[list[int], list[int]] = ([], [])
        if self._keep:
            for its in reversed(items):
                for it in reversed(its):
                    sizes[0 if self._arrays[it.array].stage is None else 1].append(it.nbytes)
        return sizes

    def warm_up(self, sizes: tuple[list[int], list[int]],
                stop: Callable[[], bool] = lambda: False) -> int:
        """Fill the pools with mapped buffers of ``sizes`` (:meth:`warm_sizes`), within
        the budget, until ``stop()``; return the bytes added."""
        return sum(pool.warm(sz, stop, since)
                   for pool, sz, since in zip(self._pools, sizes, self._since))

    def wait_covered(self, failed: Callable[[], bool]) -> None:
        """Wait until every chunk is copied or written (or ``failed()``)."""
        with self._lock:
            while self._uncovered > 0 and not failed():
                self._covered_cv.wait(0.05)

    # -- both ------------------------------------------------------------------------
    def after_write(self, items: Sequence[WriteItem]) -> int:
        """Give written chunks' buffers back; return the snapshot budget they held."""
        if not self._lent:
            return 0
        with self._lock:
            back = sum(self._held.pop((it.array, it.chunk), 0) for it in items)
            bufs = [self._lent.pop((it.array, it.chunk), None) for it in items]
        for b in bufs:
            if b is not None:
                self._pools[b[1]].give(b[0], keep=self._keep, since=self._since[b[1]])
        return back

    def reclaim(self, keep: bool) -> None:
        """After the writers stopped: buffers never written go back to their pool
        (dropped after a failure, when a device copy may still be landing)."""
        with self._lock:
            left = list(self._lent.values())
            self._lent.clear()
            self._staged.clear()
            self._held.clear()
            self._direct.clear()
        for buf, which in left:
            self._pools[which].give(buf, keep=self._keep and keep, since=self._since[which])
