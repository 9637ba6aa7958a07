"""The staging ledger: which staging buffer holds which chunk, until it is written.

One ledger per save, for both ways a save reads its state:

- *streaming* (``ss.save``): writers call :meth:`read` for each chunk; host
  arrays hand out views (or copies charged to the writer's budget), device
  arrays are staged into page-locked buffers from the pinned pool;
- *snapshot* (``ss.save_async``): :meth:`copy_out` copies each chunk into a
  buffer from the host or pinned pool (charged to the snapshot budget)
  before writers see it, and :meth:`take` hands it to the writer.

Either way :meth:`after_write` gives written chunks' buffers back to their
pool (kept for the next save unless the storage retains written buffers)
and :meth:`reclaim` settles whatever was never written.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import numpy as np

from statestream.engine._core import MemoryOptions
from statestream.engine._staging import StagingPool, host_pool, pinned_pool
from statestream.errors import CheckpointError, UnsupportedTypeError
from statestream.plan import WriteItem
from statestream.providers import PreparedArray

__all__ = ["StagingLedger"]

_Key = tuple[int, int]


class StagingLedger:
    """Staging buffers lent out for one save (thread-safe)."""

    def __init__(self, arrays: list[PreparedArray], key_of: Callable[[int], str],
                 memory: MemoryOptions, *, retains_buffers: bool, snapshot: bool) -> None:
        self._arrays = arrays
        self._key_of = key_of
        # A backend that keeps referencing written buffers (S3 uploads parts in the
        # background) must not see them recycled: they are then dropped, not kept.
        self._keep = memory.keep_staging and not retains_buffers
        self._pools: tuple[StagingPool, StagingPool] = (host_pool(), pinned_pool())
        for pool in self._pools if snapshot else self._pools[1:]:
            pool.set_capacity(memory.resolved())
        self._lock = threading.Lock()
        self._lent: dict[_Key, tuple[np.ndarray, int]] = {}
        self._staged: dict[_Key, np.ndarray] = {}
        self._held: dict[_Key, int] = {}

    # -- streaming -------------------------------------------------------------------
    def read(self, item: WriteItem) -> np.ndarray:
        """The chunk's bytes, read from the state now (writer threads)."""
        a = self._arrays[item.array]
        try:
            if a.stage is None:
                data: np.ndarray = a.chunk(item.start, item.shape)
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
                np.copyto(buf, a.chunk(item.start, item.shape))
                wait = None
        except Exception as exc:
            raise UnsupportedTypeError(
                f"copying the value at key path '{self._key_of(item.array)}' failed: {exc}"
            ) from exc
        with self._lock:
            self._staged[key] = buf
        return wait

    def take(self, item: WriteItem) -> np.ndarray:
        """The staged copy of a chunk (writer threads)."""
        with self._lock:
            return self._staged.pop((item.array, item.chunk))

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
                self._pools[b[1]].give(b[0], keep=self._keep)
        return back

    def reclaim(self, keep: bool) -> None:
        """After the writers stopped: buffers never written go back to their pool
        (dropped after a failure, when a device copy may still be landing)."""
        with self._lock:
            left = list(self._lent.values())
            self._lent.clear()
            self._staged.clear()
            self._held.clear()
        for buf, which in left:
            self._pools[which].give(buf, keep=self._keep and keep)
