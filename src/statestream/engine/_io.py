"""The engine: worker threads, the staging budget, and the write/read pipelines.

This is the only module that owns threads and buffers. Everything above it
hands it plain plans; blocking I/O and checksums run here on worker
threads (pwritev/preadv and CRC-32C release the GIL).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any

import numpy as np

from statestream import _hooks
from statestream.errors import (
    CheckpointCorruptError,
    ChecksumMismatchError,
)
from statestream.format import checksum
from statestream.plan import FilePlan, ReadPiece, ReadRequest, WriteItem
from statestream.storage import CheckpointReader, WriteTransaction

__all__ = [
    "ByteBudget",
    "IOOptions",
    "MemoryOptions",
    "Progress",
    "StreamWriter",
    "chunk_checksums",
    "default_memory_budget_bytes",
    "parallel_for",
    "read_requests",
    "write_files",
]

#: Bytes handed to one vectored write call (many small chunks coalesce up to this).
_WRITE_BATCH_BYTES = 16 << 20
_ZEROS = bytes(4096)
_NO_DATA = np.empty(0, dtype=np.uint8)
#: The walking thread hands a writer this much work at a time.
_HANDOFF_BYTES = 8 << 20
_HANDOFF_ITEMS = 256

Progress = Callable[[int, int], None]


def default_memory_budget_bytes() -> int:
    """min(25% of physical RAM, 4 GiB): the staging budget when none is given."""
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        ram = 16 << 30
    return int(min(ram // 4, 4 << 30))


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
    """

    num_threads: int | None = None
    max_chunk_bytes: int = 64 << 20
    max_request_bytes: int = 32 << 20

    def write_threads(self) -> int:
        """Threads (and at most data files per process) a save uses."""
        return _write_threads(self)

    def read_threads(self) -> int:
        """Threads a load uses."""
        return _read_threads(self)

    def __post_init__(self) -> None:
        if (self.num_threads is not None and self.num_threads < 1) or (
            self.max_chunk_bytes < 1 or self.max_request_bytes < 1
        ):
            raise ValueError(f"IOOptions values must be positive: {self}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryOptions:
    """Host memory the engine may use for staging copies and scratch reads.

    Attributes:
        memory_budget_bytes: upper bound on bytes staged at once (copies of
            non-contiguous/byte-swapped/device arrays on save, scratch for
            chunks that do not land in place on load). ``None`` picks
            :func:`default_memory_budget_bytes`.
    """

    memory_budget_bytes: int | None = None

    def resolved(self) -> int:
        b = self.memory_budget_bytes
        return default_memory_budget_bytes() if b is None else max(1, int(b))


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

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.in_use = 0
        self.peak = 0
        self._error: BaseException | None = None
        self._cv = threading.Condition()

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
    with ThreadPoolExecutor(max_workers=min(n_threads, len(jobs)),
                            thread_name_prefix="statestream-io") as pool:
        futs = [pool.submit(j) for j in jobs]
        done, pending = wait(futs, return_when=FIRST_EXCEPTION)
        for f in pending:
            f.cancel()
        for f in futs:
            if f.done() and not f.cancelled() and f.exception() is not None:
                raise f.exception()  # type: ignore[misc]
        return [f.result() for f in futs]


# ----------------------------------------------------------------------------- write


def write_files(
    txn: WriteTransaction,
    files: Sequence[FilePlan],
    source: Callable[[WriteItem], np.ndarray],
    *,
    options: IOOptions,
    budget: ByteBudget,
    progress: Progress | None = None,
) -> dict[tuple[int, int], int]:
    """Write every planned file in parallel (one thread per file), fsync each.

    ``source(item)`` returns the item's bytes (1-D uint8, C order); it is
    called on the worker thread, after ``item.staging_bytes`` has been
    reserved from ``budget``. Returns the CRC-32C of every (array, chunk).
    """
    prog = _Progress(sum(f.size for f in files), progress)
    sums: dict[tuple[int, int], int] = {}
    lock = threading.Lock()

    def write_one(fp: FilePlan) -> None:
        w = txn.create_file(fp.name, fp.size)
        try:
            batch: list[Any] = []
            batch_off = 0
            batch_end = 0
            held = 0
            reported = 0  # progress counts alignment gaps between batches too
            local: dict[tuple[int, int], int] = {}

            def flush() -> None:
                nonlocal batch, held, reported
                if batch:
                    w.write_at(batch, batch_off)
                    prog.add(batch_end - reported)
                    reported = batch_end
                batch = []
                budget.release(held)
                held = 0

            for it in fp.items:
                if batch and (it.offset - batch_off > _WRITE_BATCH_BYTES or len(batch) > 900):
                    flush()
                if not batch:
                    batch_off = batch_end = it.offset
                got = budget.try_acquire(it.staging_bytes)
                if got is None:
                    # never wait while holding staged bytes: write them out first
                    flush()
                    batch_off = batch_end = it.offset
                    got = budget.acquire(it.staging_bytes)
                held += got
                data = source(it)
                if data.nbytes != it.nbytes:  # pragma: no cover - provider bug guard
                    raise AssertionError(
                        f"chunk {it.array}/{it.chunk} produced {data.nbytes} bytes, "
                        f"planned {it.nbytes}"
                    )
                local[(it.array, it.chunk)] = checksum(data)
                pad = it.offset - batch_end
                while pad > 0:
                    z = min(pad, len(_ZEROS))
                    batch.append(_ZEROS[:z])
                    pad -= z
                batch.append(data)
                batch_end = it.offset + it.nbytes
            flush()
            w.finish()
        except BaseException:
            budget.release(held)
            w.abort()
            raise
        with lock:
            sums.update(local)

    jobs: list[Callable[[], None]] = [functools.partial(write_one, fp) for fp in files]
    _run_all(_write_threads(options), jobs)
    return sums


# ----------------------------------------------------------------------------- read


def read_requests(
    reader: CheckpointReader,
    file_names: Sequence[str],
    requests: Sequence[ReadRequest],
    *,
    options: IOOptions,
    budget: ByteBudget,
    describe: Callable[[ReadPiece], str],
    progress: Progress | None = None,
    collect: list[CheckpointCorruptError] | None = None,
) -> None:
    """Execute read requests on worker threads, verifying every chunk's CRC-32C.

    Pieces with a ``direct`` destination are read in place; the rest go
    through scratch buffers charged to ``budget`` and are scattered.

    With ``collect``, corruption is appended there and reading goes on
    (``verify``); otherwise the first problem is raised.

    Raises:
        ChecksumMismatchError: naming the array (via ``describe``) and file.
        TruncatedFileError: a file ends early or is missing.
    """
    prog = _Progress(sum(r.nbytes for r in requests), progress)
    lock = threading.Lock()
    queue = list(requests)
    queue.reverse()

    def next_request() -> ReadRequest | None:
        with lock:
            return queue.pop() if queue else None

    def worker() -> None:
        while True:
            req = next_request()
            if req is None:
                return
            if collect is None:
                _read_one(req)
                continue
            try:
                _read_one(req)
            except CheckpointCorruptError as exc:
                with lock:
                    collect.append(exc)

    def _read_one(req: ReadRequest) -> None:
        need = sum(p.staging_bytes for p in req.pieces)
        held = budget.acquire(need)
        try:
            bufs: list[Any] = []
            views: list[np.ndarray] = []
            pos = req.offset
            for p in req.pieces:
                if p.offset > pos:
                    bufs.append(np.empty(p.offset - pos, dtype=np.uint8))
                buf = p.direct if p.direct is not None else np.empty(p.nbytes, dtype=np.uint8)
                bufs.append(buf)
                views.append(buf)
                pos = p.offset + p.nbytes
            try:
                reader.read_into(file_names[req.file], req.offset, bufs)
            except CheckpointCorruptError as exc:  # missing, truncated, symlinked file
                names = "; ".join(sorted({describe(p) for p in req.pieces})[:5])
                raise type(exc)(f"{exc} (affects {names})") from None
            for p, buf in zip(req.pieces, views):
                err = None
                for a, b, want in p.checks():
                    got = checksum(buf[a:b])
                    if got != want:
                        err = ChecksumMismatchError(
                            f"checksum mismatch in {describe(p)}: chunk {p.chunk}, bytes "
                            f"[{p.offset + a}, {p.offset + b}) of "
                            f"{reader.location}/{file_names[p.file]} have CRC-32C {got:08x}, "
                            f"the manifest says {want:08x}; the checkpoint is corrupt, "
                            "restore it from another copy"
                        )
                        break
                if err is not None:
                    if collect is None:
                        raise err
                    with lock:
                        collect.append(err)
                    continue
                if p.scatter:
                    src = buf.view(p.dtype).reshape(p.chunk_shape)
                    for dview, csl in p.scatter:
                        dview[...] = src[csl] if csl else src
            prog.add(req.nbytes)
        finally:
            budget.release(held)

    n = max(1, min(_read_threads(options), len(requests)))
    _run_all(n, [worker for _ in range(n)])


def chunk_checksums(item: WriteItem, data: np.ndarray) -> tuple[int, tuple[int, ...]]:
    """The chunk's CRC-32C, and its block CRCs when ``item.block_rows`` is set.

    With blocks, the chunk checksum is the CRC-32C of the block CRCs as
    little-endian uint32 (docs/format.md), so each byte is hashed once.
    """
    if not item.block_rows:
        return checksum(data), ()
    step = (item.nbytes // item.shape[0]) * item.block_rows
    blocks = tuple(checksum(data[a : a + step]) for a in range(0, item.nbytes, step))
    return checksum(np.array(blocks, dtype="<u4").tobytes()), blocks


class StreamWriter:
    """Writes items as they are planned: one thread and queue per data file.

    The caller (walking the state on its own thread) ``submit``s items; each
    file's thread writes them in order, coalescing queued neighbours into
    vectored writes of up to 16 MiB, charging copies to ``budget``. So
    preparing later arrays overlaps writing earlier ones. ``close()`` waits,
    fsyncs every file, and returns the CRC-32C of every (array, chunk).

    """

    _STOP = object()

    def __init__(
        self,
        txn: WriteTransaction,
        file_name: Callable[[int], str],
        source: Callable[[WriteItem], np.ndarray],
        *,
        budget: ByteBudget,
        progress: Progress | None = None,
        after_write: Callable[[Sequence[WriteItem]], None] | None = None,
        on_error: Callable[[BaseException], None] | None = None,
    ) -> None:
        self._after_write = after_write
        self._on_error = on_error
        self._txn = txn
        self._name = file_name
        self._source = source
        self._budget = budget
        self._progress = progress
        self._done = 0
        self._lock = threading.Lock()
        self._queues: list[queue.SimpleQueue[Any]] = []
        self._threads: list[threading.Thread] = []
        self._errors: list[BaseException] = []
        self._sums: dict[tuple[int, int], tuple[int, tuple[int, ...]]] = {}
        self._failed = threading.Event()
        self._pending: list[list[WriteItem]] = []
        self._pending_bytes: list[int] = []
        self.total_bytes = 0

    def submit(self, items: Sequence[WriteItem]) -> None:
        """Queue items for writing; raises at once if a writer has failed."""
        if self._failed.is_set():
            self._raise()
        for it in items:
            while it.file >= len(self._queues):
                q: queue.SimpleQueue[Any] = queue.SimpleQueue()
                t = threading.Thread(target=self._run, args=(len(self._queues), q),
                                     name=f"statestream-write-{len(self._queues)}", daemon=True)
                self._queues.append(q)
                self._threads.append(t)
                t.start()
            while it.file >= len(self._pending):
                self._pending.append([])
                self._pending_bytes.append(0)
            pend = self._pending[it.file]
            pend.append(it)
            self._pending_bytes[it.file] += it.nbytes
            self.total_bytes += it.nbytes
            # Hand work over in batches: waking a writer per small item would make
            # it fight the walking thread for the GIL on every chunk.
            if self._pending_bytes[it.file] >= _HANDOFF_BYTES or len(pend) >= _HANDOFF_ITEMS:
                self._handoff(it.file)

    def flush(self) -> None:
        """Hand every queued item to its writer now (before waiting on the budget)."""
        for i in range(len(self._pending)):
            self._handoff(i)

    def _handoff(self, index: int) -> None:
        if self._pending[index]:
            self._queues[index].put(self._pending[index])
            self._pending[index] = []
            self._pending_bytes[index] = 0

    def close(self) -> dict[tuple[int, int], tuple[int, tuple[int, ...]]]:
        """Finish every file (fsync); return each chunk's (CRC, block CRCs)."""
        for i in range(len(self._pending)):
            self._handoff(i)
        for q in self._queues:
            q.put(self._STOP)
        for t in self._threads:
            t.join()
        if self._errors:
            self._raise()
        return self._sums

    def abort(self) -> None:
        """Stop writers as soon as possible (after an error elsewhere)."""
        self._failed.set()
        for q in self._queues:
            q.put(self._STOP)
        for t in self._threads:
            t.join()

    def _raise(self) -> None:
        raise self._errors[0] if self._errors else RuntimeError("a writer thread stopped")

    def _run(self, index: int, q: queue.SimpleQueue[Any]) -> None:
        budget = self._budget
        w = None
        held = 0
        sums: dict[tuple[int, int], tuple[int, tuple[int, ...]]] = {}
        try:
            w = self._txn.create_file(self._name(index), 0)
            while not self._failed.is_set():
                work = q.get()
                if work is self._STOP:
                    break
                batch: list[Any] = []
                done_items: list[WriteItem] = []
                batch_off = end = work[0].offset
                for it in work:
                    if self._failed.is_set():
                        break
                    flush = batch and (
                        it.offset - batch_off >= _WRITE_BATCH_BYTES or len(batch) > 900
                    )
                    got = None if flush else budget.try_acquire(it.staging_bytes)
                    if got is None:
                        if batch:  # never wait while holding staged bytes: write first
                            w.write_at(batch, batch_off)
                            batch = []
                            data = _NO_DATA
                            self._advance(end - batch_off)
                            self._written(done_items)
                            budget.release(held)
                            held = 0
                            done_items = []
                            batch_off = end = it.offset
                        got = budget.acquire(it.staging_bytes)
                    held += got
                    data = self._source(it)
                    sums[(it.array, it.chunk)] = chunk_checksums(it, data)
                    pad = it.offset - end
                    while pad > 0:
                        z = min(pad, len(_ZEROS))
                        batch.append(_ZEROS[:z])
                        pad -= z
                    batch.append(data)
                    done_items.append(it)
                    end = it.offset + it.nbytes
                if batch:
                    w.write_at(batch, batch_off)
                    batch = []
                    data = _NO_DATA  # the buffers are freed before their budget is
                    self._advance(end - batch_off)
                    self._written(done_items)
                budget.release(held)
                held = 0
            if not self._failed.is_set():
                w.finish()
                w = None
            with self._lock:
                self._sums.update(sums)
        except BaseException as exc:  # reported by submit()/close()
            with self._lock:
                self._errors.append(exc)
            self._failed.set()
            if self._on_error is not None:
                self._on_error(exc)
        finally:
            budget.release(held)
            if w is not None:
                w.abort()

    def _written(self, items: Sequence[WriteItem]) -> None:
        _hooks.fire("save.chunk_written")
        if self._after_write is not None and items:
            self._after_write(items)

    def _advance(self, n: int) -> None:
        if self._progress is not None:
            with self._lock:
                self._done += n
                done = self._done
            self._progress(done, self.total_bytes)
