"""The memory budget of a load's (or a verify's) scratch buffers, one with the staging.

A load reads what cannot land in place (compressed chunks, pieces scattered into a
partial box, gaps between coalesced pieces) through scratch buffers charged to its
budget. Those bytes are also reserved in the host staging pool
(:meth:`StagingPool.reserve`), so that the staging buffers — lent to a
``save_async`` in flight, or idle between saves — and the load's scratch stay within
one budget together: the larger of the load's and the pool's (the last save's), one
budget when both use the same (the default). Idle staging is freed first, least
recently used first. Where the staged copies of a save in flight leave too little
room, the load waits for its writers to give them back as they write them — for
that much of the save, never for its end (it commits after its writes) — and once no
save is in flight it goes through. Before 2026-12-07 a load kept a budget of its
own beside the save's: peak host memory could reach two budgets plus idle staging.

On a thread of a save (a progress callback) or in a ``state_dict()`` a save walks,
the load reserves without waiting: the save it would wait for waits for that thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from statestream.engine._core import ByteBudget, MemoryOptions
from statestream.engine._handle import SAVE_THREADS, previous_save, start_lock
from statestream.engine._staging import StagingPool, host_pool
from statestream.engine._start import holding_start

__all__ = ["ReadBudget", "read_budget", "save_in_flight", "saving_to"]


def save_in_flight() -> bool:
    """Whether a save runs in this process now (started, not settled)."""
    previous = previous_save()
    return start_lock().locked() or (previous is not None
                                     and not previous.settled.is_set())


def saving_to(spath: str) -> bool:
    """Whether the ``save_async`` in flight in this process (not committed yet) writes
    the checkpoint at storage path ``spath``."""
    previous = previous_save()
    return previous is not None and not previous.done() and previous.path == spath


class ReadBudget(ByteBudget):
    """A :class:`ByteBudget` whose bytes are also reserved in a staging pool.

    ``wait()``: whether a reservation that does not fit beside the pool's lent
    buffers waits for them (else it goes through at once).

    Example:
        >>> pool = StagingPool(capacity=100)
        >>> b = ReadBudget(100, pool, lambda: False)
        >>> b.acquire(60), pool.reserved_bytes
        (60, 60)
        >>> b.release(60); pool.reserved_bytes
        0
    """

    def __init__(self, capacity: int, pool: StagingPool, wait: Callable[[], bool]) -> None:
        super().__init__(capacity)
        self._pool = pool
        self._wait = wait

    def _limit(self) -> int:
        return max(self.capacity, self._pool.capacity)

    def acquire(self, n: int) -> int:
        got = super().acquire(n)  # within the load's own budget first
        if got:
            try:
                self._pool.reserve(got, self._limit(), self._wait)
            except BaseException:
                super().release(got)
                raise
        return got

    def try_acquire(self, n: int) -> int | None:
        got = super().try_acquire(n)
        if got and not self._pool.try_reserve(got, self._limit()):
            super().release(got)
            return None
        return got

    def release(self, n: int) -> None:
        if n > 0:
            self._pool.unreserve(n)
        super().release(n)


def read_budget(memory: MemoryOptions) -> ReadBudget:
    """The scratch budget of a load or verify started on this thread now, shared with
    the host staging pool (see the module docstring)."""
    own_save = threading.current_thread().name.startswith(SAVE_THREADS) or holding_start()
    return ReadBudget(memory.resolved(), host_pool(),
                      (lambda: False) if own_save else save_in_flight)
