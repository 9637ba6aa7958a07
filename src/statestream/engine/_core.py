"""Engine options, the staging budget, progress and the worker-thread helpers."""

from __future__ import annotations

import dataclasses
import numbers
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any

import numpy as np

from statestream.errors import InvalidOptionError, InvalidOptionTypeError
from statestream.storage import keep_part_buffers

__all__ = [
    "ByteBudget",
    "IOOptions",
    "MemoryOptions",
    "Progress",
    "default_memory_budget_bytes",
    "default_num_threads",
    "parallel_for",
    "snapshot_budgets",
    "wait_seconds",
    "writers_share",
]

Progress = Callable[[int, int], None]


def default_memory_budget_bytes() -> int:
    """min(25% of physical RAM, 4 GiB): the staging budget when none is given."""
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        ram = 16 << 30
    return int(min(ram // 4, 4 << 30))


def _check_fields(options: Any, *, ints: Sequence[str], bools: Sequence[str]) -> None:
    """Refuse an option field of the wrong type (``ints`` may be None: the default);
    a NumPy integer or bool becomes Python's."""
    for name in ints:
        v = getattr(options, name)
        if v is not None and (isinstance(v, (bool, np.bool_))
                              or not isinstance(v, numbers.Integral)):
            raise InvalidOptionTypeError(
                f"{type(options).__name__}.{name} must be an int (bytes or a count), "
                f"not {type(v).__name__} {v!r:.80}")
        if v is not None and not isinstance(v, int):
            object.__setattr__(options, name, int(v))
    for name in bools:
        v = getattr(options, name)
        if isinstance(v, np.bool_):
            object.__setattr__(options, name, bool(v))
        elif not isinstance(v, bool):
            raise InvalidOptionTypeError(
                f"{type(options).__name__}.{name} must be a bool, not {type(v).__name__} "
                f"{v!r:.80}")


def _write_threads(options: IOOptions) -> int:
    return options.num_threads or max(4, default_num_threads())


def _read_threads(options: IOOptions) -> int:
    return options.num_threads or default_num_threads()


def default_num_threads() -> int:
    """One I/O thread per core, between 2 and 8.

    Measured on a 2-core machine: 2 threads saved and cold-loaded as fast as 4,
    and hot-loaded into fresh memory 1.5x faster (4 threads contend on page
    faults).
    """
    return max(2, min(8, os.cpu_count() or 2))


@dataclasses.dataclass(frozen=True, kw_only=True)
class IOOptions:
    """How the engine does I/O.

    Attributes:
        num_threads: worker threads for writes and reads (also the most data
            files one process writes). Default: loads use one per core (2 to 8);
            saves use at least 4 (more outstanding writes keep the disk busy,
            while loads into fresh memory contend on page faults).
        max_chunk_bytes: arrays are split into chunks of at most this size;
            each chunk has its own checksum.
        max_request_bytes: the largest single coalesced read.
        background_nice: how much ``save_async`` raises the niceness of its
            background threads (writes, checksums, commit; Linux, per thread) so
            they yield the cores to training. 0 keeps normal priority. Measured
            with CPU training on 2 cores: step overhead of lazy saves every 8
            steps fell from +8% to +1% at 19, while the time to commit rose from
            0.8 s to 2-3 s (docs/async.md). A lazy snapshot's copies are not
            deprioritised: ``optimizer.step()`` may be waiting for them.
        map_files: loads from local files map arrays' bytes (private,
            copy-on-write) instead of reading them into fresh memory, small ones
            too; the checksum pass pulls the pages in, on all threads. In-place
            loads read into the targets. Off: every array is read. A mapped array
            keeps its file's disk space in use after the checkpoint is deleted,
            until the array is freed (as with ``torch.load(mmap=True)``).
        drop_behind: loads from local files let the page cache drop the pages they
            read in, once their bytes are copied and checked (pages cached before
            the load stay cached; mapped arrays are the page cache and stay). The
            page cache then does not grow by the checkpoint's size, and its pages
            are reused for the next reads: a cold 2 GiB in-place load ran 1.4-1.5x
            faster on the test VM, whose fresh memory is slow (docs/design-notes.md,
            "Load path"). The price: loading the same checkpoint again reads it
            from disk again. For a resume that loads once, or a host short of memory.

    Raises:
        InvalidOptionError: (a ``ValueError``) a count or size is not positive.
    """

    num_threads: int | None = None
    max_chunk_bytes: int = 64 << 20
    max_request_bytes: int = 32 << 20
    background_nice: int = 19
    map_files: bool = True
    drop_behind: bool = False

    def write_threads(self) -> int:
        """Threads (and at most data files per process) a save uses."""
        return _write_threads(self)

    def read_threads(self) -> int:
        """Threads a load uses."""
        return _read_threads(self)

    def __post_init__(self) -> None:
        _check_fields(self, ints=("num_threads", "max_chunk_bytes", "max_request_bytes",
                                  "background_nice"), bools=("map_files", "drop_behind"))
        if (self.num_threads is not None and self.num_threads < 1) or (
            self.max_chunk_bytes < 1 or self.max_request_bytes < 1
        ) or not 0 <= self.background_nice <= 39:
            raise InvalidOptionError(f"IOOptions values must be positive: {self}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryOptions:
    """Host memory the engine may use for staging copies and scratch reads.

    Attributes:
        memory_budget_bytes: upper bound on bytes staged at once (copies of
            non-contiguous/byte-swapped/device arrays on save, ``save_async``'s
            staging, compression and decompression buffers, scratch for
            chunks that do not land in place on load): a positive int, or
            ``None`` for :func:`default_memory_budget_bytes`. Outside it: a fixed 8 MiB
            aligned bounce buffer per data file on local disk (docs/storage.md).
        keep_staging: keep ``save_async``'s staging buffers (up to the budget)
            for the next save, which then copies into memory that is already
            mapped (or pinned, for CUDA tensors) -- about 2x faster than into
            fresh pages. :func:`statestream.release_staging` frees them.
    """

    memory_budget_bytes: int | None = None
    keep_staging: bool = True

    def __post_init__(self) -> None:
        _check_fields(self, ints=("memory_budget_bytes",), bools=("keep_staging",))
        if self.memory_budget_bytes is not None and self.memory_budget_bytes < 1:
            raise InvalidOptionError(
                "MemoryOptions.memory_budget_bytes must be positive (bytes), or None for the "
                f"default, not {self.memory_budget_bytes}")

    def resolved(self) -> int:
        b = self.memory_budget_bytes
        return default_memory_budget_bytes() if b is None else b


def writers_share(budget: int, threads: int, per_file: int) -> tuple[int, int]:
    """Writer threads and the budget left once their own buffers are charged to it.

    ``per_file``: bytes one writer holds of its own (an object store's two part
    buffers; 0 for local files, which charges nothing). The writers are as many as
    ``threads`` while their buffers take at most half of ``budget``, and at least
    one (whose buffers may take all of it, or more when it is smaller than them; at
    least one byte is left).
    The part buffers kept between saves are bounded by the same share.

    Example:
        >>> writers_share(256 << 20, 4, 0) == (4, 256 << 20)
        True
    """
    if not per_file:
        return threads, budget
    threads = max(1, min(threads, budget // (2 * per_file)))
    keep_part_buffers(threads * per_file)
    return threads, max(1, budget - threads * per_file)


#: A snapshot save that compresses keeps this share (1/N) of its memory budget for
#: the writers' compression buffers (and their copies of chunks, see
#: :func:`snapshot_budgets`); the rest stages copies.
CODEC_SHARE = 4


def snapshot_budgets(capacity: int, *, compresses: bool,
                     copies: int = 0) -> tuple[ByteBudget, ByteBudget]:
    """A snapshot save's budgets out of ``capacity``: one for the staged copies and
    one for the writers' own buffers (compression buffers, and the copies they make
    of chunks they write from the state: non-contiguous or byte-swapped arrays,
    ``copies`` bytes of them in the state).

    Two pools, not one: a writer waiting for bytes that staged copies hold would
    wait forever, since only its own writes release them. Their sum is
    ``capacity``. With neither compression nor such arrays the writers hold no
    buffers of their own; with such arrays only, they keep at most a quarter, and no
    more than those arrays' size (a small byte-swapped array takes little from the
    staging).

    Example:
        >>> staged, codec = snapshot_budgets(100, compresses=True)
        >>> staged.capacity, codec.capacity
        (75, 25)
        >>> staged, codec = snapshot_budgets(100, compresses=False, copies=10)
        >>> staged.capacity, codec.capacity
        (90, 10)
    """
    if not compresses and not copies:
        return ByteBudget(capacity), ByteBudget(1 << 62)
    reserve = max(1, capacity // CODEC_SHARE)
    if not compresses:
        reserve = max(1, min(reserve, copies))
    return ByteBudget(max(1, capacity - reserve)), ByteBudget(reserve)


class ByteBudget:
    """A counting semaphore over bytes: the staging pool's ceiling.

    A request larger than the whole budget waits until the pool is empty
    and then takes all of it, so progress is always possible.

    Example:
        >>> b = ByteBudget(100)
        >>> b.acquire(60)
        60
        >>> b.release(60)
        >>> b.in_use, b.peak
        (0, 60)
    """

    def __init__(self, capacity: int, *,
                 on_use: Callable[[int], None] | None = None) -> None:
        self.capacity = capacity
        self.in_use = 0
        self.peak = 0
        self._error: BaseException | None = None
        self._cv = threading.Condition()
        #: called with the bytes in use after each acquire that took some (outside the
        #: lock, before the caller allocates them): a synchronous save frees idle
        #: staging buffers there, so that they and its own stay within one budget
        self._on_use = on_use

    def acquire(self, n: int) -> int:
        n = min(n, self.capacity)
        if n <= 0:
            return 0
        with self._cv:
            while self.in_use + n > self.capacity:
                if self._error is not None:
                    raise self._error
                self._cv.wait()
            self.in_use += n
            self.peak = max(self.peak, self.in_use)
            used = self.in_use
        if self._on_use is not None:
            self._on_use(used)
        return n

    def try_acquire(self, n: int) -> int | None:
        """Take ``n`` bytes if available now; None (and nothing taken) otherwise."""
        n = min(n, self.capacity)
        if n <= 0:
            return 0
        with self._cv:
            if self.in_use + n > self.capacity:
                return None
            self.in_use += n
            self.peak = max(self.peak, self.in_use)
            used = self.in_use
        if self._on_use is not None:
            self._on_use(used)
        return n

    def release(self, n: int) -> None:
        if n <= 0:
            return
        with self._cv:
            self.in_use -= n
            self._cv.notify_all()

    def abort(self, exc: BaseException) -> None:
        """Make every waiting (and later blocking) ``acquire`` raise ``exc``.

        For when whoever would release the bytes has failed.
        """
        with self._cv:
            if self._error is None:
                self._error = exc
            self._cv.notify_all()


def lower_thread_priority(nice: int) -> None:
    """Give the calling thread (only) a ``nice`` value; no-op where unsupported.

    Linux schedules threads as tasks, so ``setpriority`` on the thread id
    changes this thread alone. Raising niceness needs no privilege.
    """
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError:
        # Best effort by design: a sandbox may forbid setpriority; the save is then
        # only less polite to training, never wrong.
        pass


class _Progress:
    def __init__(self, total: int, cb: Progress | None) -> None:
        self.total, self.done, self._cb = total, 0, cb
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        if self._cb is None:
            return
        with self._lock:
            self.done += n
            done = self.done
        self._cb(done, self.total)


def thread_started(t: threading.Thread) -> bool:
    """After ``t.start()`` raised (a KeyboardInterrupt inside it): whether the thread runs.

    ``Thread.start()`` creates the thread, then waits for it to say it started; an
    interrupt may land before either. Created, it says so at once.
    """
    started = getattr(t, "_started", None)  # CPython's Event; no public way to ask
    return bool(started.wait(1.0)) if started is not None else t.is_alive()


def parallel_for(fn: Callable[[Any], None], items: Sequence[Any], num_threads: int) -> None:
    """Call ``fn(item)`` for every item on up to ``num_threads`` threads (in order per thread).

    Used for bulk host copies (``np.copyto`` releases the GIL), so a snapshot
    uses every core. Re-raises the first error.
    """
    n = max(1, min(num_threads, len(items)))
    if n == 1:
        for it in items:
            fn(it)
        return
    lock = threading.Lock()
    pos = [0]

    def worker() -> None:
        while True:
            with lock:
                i = pos[0]
                pos[0] += 1
            if i >= len(items):
                return
            fn(items[i])

    _run_all(n, [worker] * n)


def _run_all(n_threads: int, jobs: Sequence[Callable[[], Any]]) -> list[Any]:
    """Run jobs on a pool; re-raise the first failure after cancelling the rest."""
    if not jobs:
        return []
    if n_threads <= 1 or len(jobs) == 1:
        return [j() for j in jobs]
    with ThreadPoolExecutor(
        max_workers=min(n_threads, len(jobs)), thread_name_prefix="statestream-io"
    ) as pool:
        futs = [pool.submit(j) for j in jobs]
        done, pending = wait(futs, return_when=FIRST_EXCEPTION)
        for f in pending:
            f.cancel()
        for f in futs:
            if f.done() and not f.cancelled() and f.exception() is not None:
                raise f.exception()  # type: ignore[misc]
        return [f.result() for f in futs]


def wait_seconds(timeout: Any, what: str) -> float | None:
    """A caller's ``timeout`` (seconds) as ``threading`` waits take it: None, infinity
    or more than the platform can wait is no limit (``inf`` raised OverflowError).

    Raises:
        InvalidOptionError: NaN (it timed out at once, "not finished after nans").
        InvalidOptionTypeError: not a real number.
    """
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise InvalidOptionTypeError(
            f"{what}: timeout must be seconds (a number) or None, not "
            f"{type(timeout).__name__}")
    t = float(timeout)
    if t != t:
        raise InvalidOptionError(
            f"{what}: timeout is NaN; pass seconds, or None to wait without limit")
    return None if t > threading.TIMEOUT_MAX else t
