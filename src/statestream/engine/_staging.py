"""Staging buffers for snapshot copies, kept between saves and reused.

A training loop saves the same state again and again, so its chunks have
the same sizes every time, and a free list per exact size serves every
save after the first from memory that is already mapped. That matters:
copying 1.2 GB into fresh pages took 0.40 s on the 2-core development
machine and 0.22 s into pages already touched (page faults and zeroing
are half the cost), and page-locked (pinned) buffers for CUDA copies are
far more expensive to allocate than to reuse.

A pool keeps idle buffers only up to its capacity (the save's memory
budget), evicting the least recently used first, and never lets idle plus
lent-out bytes exceed it when it allocates. A load's scratch buffers are
reserved beside them (:meth:`StagingPool.reserve`): idle buffers make room
first, and a load waits for a save in flight to give staged copies back rather
than go over (engine/_readbudget.py). ``release()`` (exposed as
:func:`statestream.release_staging`) frees every idle buffer; a save that was in
flight then keeps none of its buffers when it gives them back, and maps none for
the next save (see :attr:`StagingPool.epoch`).
"""

from __future__ import annotations

import collections
import os
import threading
from collections.abc import Callable, Sequence

import numpy as np

from statestream._memory import aligned_bytes
from statestream.providers import pinned_alloc
from statestream.storage import release_part_buffers

__all__ = ["StagingPool", "host_pool", "pinned_pool", "release_staging"]


#: Large buffers start on a page boundary, so local storage can write them
#: with O_DIRECT (no copy into the page cache).
_ALIGN_MIN_BYTES = 64 << 10


def _host_alloc(nbytes: int) -> np.ndarray:
    if nbytes < _ALIGN_MIN_BYTES:
        return np.empty(nbytes, dtype=np.uint8)
    return aligned_bytes(nbytes)  # no huge-page advice (statestream._memory)


def _pinned_alloc(nbytes: int) -> np.ndarray:
    """Page-locked host memory from a provider that can pin (torch's CUDA allocator).

    Falls back to ordinary memory when none can, so a save never fails for
    want of pinning; the copy is then merely synchronous.
    """
    buf = pinned_alloc(nbytes)
    return buf if buf is not None else _host_alloc(nbytes)


class StagingPool:
    """Reusable 1-D uint8 host buffers, keyed by exact size.

    Example:
        >>> p = StagingPool(capacity=1 << 20)
        >>> a = p.take(1000); p.give(a)
        >>> b = p.take(1000)
        >>> b is a, p.allocations, p.reuses
        (True, 1, 1)
    """

    def __init__(self, capacity: int = 0, *,
                 allocate: Callable[[int], np.ndarray] = _host_alloc) -> None:
        self.capacity = capacity
        self._allocate = allocate
        self._lock = threading.Lock()
        self._idle: collections.OrderedDict[int, np.ndarray] = collections.OrderedDict()
        self._by_size: dict[int, list[int]] = {}
        self.idle_bytes = 0
        self.lent_bytes = 0
        self.allocations = 0
        self.reuses = 0
        #: the most bytes lent out at once (staging in use) since creation
        self.peak_lent_bytes = 0
        #: bytes loads hold for their scratch buffers (:meth:`reserve`): no buffers of
        #: this pool, but counted with it, so neither goes over the budget for the other
        self.reserved_bytes = 0
        #: loads waiting in :meth:`reserve` now (a test hook)
        self.waiting = 0
        self._epoch = 0
        self._room = threading.Condition(self._lock)

    @property
    def epoch(self) -> int:
        """How many times :meth:`release` was called. A save's buffers given back
        with the epoch it began in (``give(..., since=)``) after a release are not
        kept, and its warm-up (``warm(..., since=)``) stops: what was released
        stays released."""
        return self._epoch

    def set_capacity(self, capacity: int) -> None:
        """Retain at most ``capacity`` bytes (idle + lent) from now on."""
        with self._lock:
            self.capacity = max(0, int(capacity))
            self._evict_locked(0)

    def take_idle(self, nbytes: int) -> np.ndarray | None:
        """An idle (already mapped) buffer of exactly ``nbytes``, or None."""
        with self._lock:
            return self._take_idle_locked(nbytes)

    def _take_idle_locked(self, nbytes: int) -> np.ndarray | None:
        ids = self._by_size.get(nbytes)
        if not ids:
            return None
        buf = self._idle.pop(ids.pop())
        self.idle_bytes -= nbytes
        self.lent_bytes += nbytes
        self.peak_lent_bytes = max(self.peak_lent_bytes, self.lent_bytes)
        self.reuses += 1
        return buf

    def take_many(self, sizes: Sequence[int]) -> list[np.ndarray]:
        """:meth:`take` for each of ``sizes``, the idle ones under one lock. If one
        cannot be allocated, those taken go back before the error is raised."""
        out = self._take_each(sizes, within=False)
        return [b for b in out if b is not None]  # (without a capacity, never None)

    def take_some(self, sizes: Sequence[int], *, fresh: bool) -> list[np.ndarray | None]:
        """:meth:`take_within` (``fresh``) or :meth:`take_idle` for each of ``sizes``,
        the idle ones under one lock; None where neither gives a buffer (after an
        allocation fails, the rest are not tried)."""
        if not fresh:
            with self._lock:
                return [self._take_idle_locked(n) for n in sizes]
        return self._take_each(sizes, within=True)

    def _take_each(self, sizes: Sequence[int], *, within: bool) -> list[np.ndarray | None]:
        # Idle buffers under one lock, then the rest one by one (_take); within the
        # capacity, an allocation that fails leaves the rest None, and anything else
        # raised gives back what was taken first.
        with self._lock:
            out = [self._take_idle_locked(n) for n in sizes]
        for i, n in enumerate(sizes):
            if out[i] is not None:
                continue
            try:
                out[i] = self._take(n, within=within)
            except BaseException as exc:
                if within and isinstance(exc, MemoryError):
                    break
                for buf in out:
                    if buf is not None:
                        self.give(buf)
                raise
        return out

    def take(self, nbytes: int) -> np.ndarray:
        """A buffer of exactly ``nbytes`` (contents undefined)."""
        buf = self._take(nbytes, within=False)
        assert buf is not None
        return buf

    def take_within(self, nbytes: int) -> np.ndarray | None:
        """An idle buffer of exactly ``nbytes``, else a fresh one if the lent bytes
        stay within the capacity (idle buffers of other sizes evicted first), else
        None."""
        return self._take(nbytes, within=True)

    def _take(self, nbytes: int, *, within: bool) -> np.ndarray | None:
        with self._lock:
            buf = self._take_idle_locked(nbytes)
            if buf is not None:
                return buf
            if within and self.lent_bytes + self.reserved_bytes + nbytes > self.capacity:
                return None
            self._evict_locked(nbytes)
            self.lent_bytes += nbytes
            self.peak_lent_bytes = max(self.peak_lent_bytes, self.lent_bytes)
            self.allocations += 1
        try:
            return self._allocate(nbytes)
        except BaseException:
            with self._lock:
                self.lent_bytes -= nbytes
                self._room.notify_all()
            raise

    def can_serve(self, sizes: Sequence[int]) -> bool:
        """Whether idle buffers exist for every one of ``sizes`` (no allocation)."""
        need = collections.Counter(sizes)
        with self._lock:
            return all(len(self._by_size.get(n, ())) >= k for n, k in need.items())

    def warm(self, sizes: Sequence[int], stop: Callable[[], bool] = lambda: False,
             since: int | None = None) -> int:
        """Allocate and touch idle buffers for ``sizes``, in order, until the
        capacity is reached or ``stop()``, so a later save copies into memory
        already mapped (a copy into reused pages is 3x one into fresh pages). Sizes
        already idle count; return the bytes added. ``since``: the :attr:`epoch`
        the warm-up is for (a save's start); a :meth:`release` since then stops it,
        before or while it maps."""
        added = 0
        epoch = self._epoch if since is None else since
        with self._lock:
            have = collections.Counter({n: len(ids) for n, ids in self._by_size.items()})
        for n in sizes:
            if stop() or self._epoch != epoch:
                break
            if have[n] > 0:
                have[n] -= 1
                continue
            with self._lock:
                if self.idle_bytes + self.lent_bytes + self.reserved_bytes + n > self.capacity:
                    break
            buf = self._allocate(n)
            buf.fill(0)  # fault the pages in now, not during the next save
            with self._lock:
                self.allocations += 1
                self.lent_bytes += n  # give() takes it back as idle
            self.give(buf, since=epoch)  # released meanwhile: dropped
            added += n
        return added

    def give(self, buf: np.ndarray, *, keep: bool = True, since: int | None = None) -> None:
        """Return a buffer from :meth:`take`; it is kept for reuse if it fits, and
        (``since``: the :attr:`epoch` its save began in) if no release came since."""
        n = int(buf.nbytes)
        with self._lock:
            self.lent_bytes = max(0, self.lent_bytes - n)
            if self.waiting:
                self._room.notify_all()
            if since is not None and since != self._epoch:
                return  # a save in flight when a release came keeps nothing
            if not keep or (self.idle_bytes + self.lent_bytes + self.reserved_bytes + n
                            > self.capacity):
                return
            key = id(buf)
            self._idle[key] = buf
            self._by_size.setdefault(n, []).append(key)
            self.idle_bytes += n

    def trim_idle(self, keep: int) -> int:
        """Free idle buffers, least recently used first, until at most ``keep`` bytes
        are idle; return the bytes freed."""
        with self._lock:
            before = self.idle_bytes
            while self._idle and self.idle_bytes > keep:
                self._pop_oldest_locked()
            return before - self.idle_bytes

    def reserve(self, nbytes: int, limit: int, wait: Callable[[], bool]) -> None:
        """Hold ``nbytes`` of host memory beside the pool's buffers (a load's scratch),
        so that idle + lent + reserved bytes stay within ``limit``.

        Idle buffers go first (least recently used first). If the lent ones (a save's
        staged copies) and other reservations still leave too little room, it waits
        for them to be given back while ``wait()`` holds (a save is in flight: its
        writers give staged copies back as they write them), then goes through
        anyway; it always goes through once nothing is lent or reserved.
        :meth:`unreserve` gives the bytes back.
        """
        with self._room:
            while not self._try_reserve_locked(nbytes, limit):
                if not wait():
                    self.reserved_bytes += nbytes
                    return
                self.waiting += 1
                try:
                    # give() and unreserve() notify; the timeout notices a save
                    # that settled without giving anything back
                    self._room.wait(0.05)
                finally:
                    self.waiting -= 1

    def try_reserve(self, nbytes: int, limit: int) -> bool:
        """:meth:`reserve` if it fits now (idle buffers freed for it); else False."""
        with self._lock:
            return self._try_reserve_locked(nbytes, limit)

    def _try_reserve_locked(self, nbytes: int, limit: int) -> bool:
        while self._idle and (self.idle_bytes + self.lent_bytes + self.reserved_bytes
                              + nbytes > limit):
            self._pop_oldest_locked()
        busy = self.lent_bytes + self.reserved_bytes
        if busy and busy + nbytes > limit:
            return False
        self.reserved_bytes += nbytes
        return True

    def unreserve(self, nbytes: int) -> None:
        """Give back bytes held by :meth:`reserve`."""
        with self._room:
            self.reserved_bytes = max(0, self.reserved_bytes - nbytes)
            self._room.notify_all()

    def release(self) -> int:
        """Free every idle buffer; return how many bytes were freed. Saves in
        flight keep none of theirs (see :attr:`epoch`)."""
        with self._lock:
            self._epoch += 1
            freed = self.idle_bytes
            self._idle.clear()
            self._by_size.clear()
            self.idle_bytes = 0
        return freed

    def forget_parent(self) -> None:
        """In a child after ``fork()``: the buffers lent out and the bytes reserved are
        the parent's threads', which did not come along and never give them back; a
        lock one of them held at the fork stays held, and what it was changing under
        the lock may be half done. The child starts with an empty pool of its own."""
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)
        self._idle = collections.OrderedDict()
        self._by_size = {}
        self.idle_bytes = self.lent_bytes = self.reserved_bytes = self.waiting = 0

    def _evict_locked(self, incoming: int) -> None:
        # Oldest idle buffers go first until idle + lent + reserved + incoming fits.
        while self._idle and (self.idle_bytes + self.lent_bytes + self.reserved_bytes
                              + incoming > self.capacity):
            self._pop_oldest_locked()

    def _pop_oldest_locked(self) -> None:
        key, buf = self._idle.popitem(last=False)
        n = int(buf.nbytes)
        self._by_size[n].remove(key)
        if not self._by_size[n]:
            del self._by_size[n]
        self.idle_bytes -= n


_HOST = StagingPool()
_PINNED = StagingPool(allocate=_pinned_alloc)


def _forget_in_child() -> None:
    # a DataLoader worker forked while a save's threads use the pools
    _HOST.forget_parent()
    _PINNED.forget_parent()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def host_pool() -> StagingPool:
    """The process's pool of ordinary host staging buffers."""
    return _HOST


def pinned_pool() -> StagingPool:
    """The process's pool of page-locked buffers for device-to-host copies."""
    return _PINNED


def release_staging() -> int:
    """Free the staging buffers kept between asynchronous saves.

    ``save_async`` keeps its staging buffers (up to the memory budget) so the
    next save copies into memory that is already mapped (or pinned); object
    store writers keep their part buffers too, up to a byte cap across part sizes
    that each save sets to its writer threads x 2 parts (128 MiB before the first
    save; docs/storage.md). Call this when no more saves are coming, or to give
    the memory back for a while. A save in flight meanwhile (copying into
    staging, writing, or done and mapping buffers for the next save) keeps
    nothing for later: the buffers it holds (its object store part buffers too)
    are freed as it finishes with them, and its warm-up for the next save stops
    (before 2026-12-06 a save whose ``result()`` had returned went on to map a
    whole budget's worth after the release, and a save writing to an object store
    put its part buffers back).

    Returns:
        The number of bytes freed.

    Example:
        >>> import statestream as ss
        >>> ss.release_staging() >= 0
        True
    """
    return _HOST.release() + _PINNED.release() + release_part_buffers()
