"""Write pipelines: whole-plan writes and the streaming writer (one thread per file)."""

from __future__ import annotations

import functools
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from statestream import _hooks
from statestream.engine._core import (
    ByteBudget,
    IOOptions,
    Progress,
    _Progress,
    _run_all,
    _write_threads,
    lower_thread_priority,
)
from statestream.format import checksum
from statestream.plan import FilePlan, WriteItem
from statestream.storage import WriteTransaction

#: Bytes handed to one vectored write call (many small chunks coalesce up to this).
_WRITE_BATCH_BYTES = 16 << 20
_ZEROS = bytes(4096)
_NO_DATA = np.empty(0, dtype=np.uint8)
#: The walking thread hands a writer this much work at a time.
_HANDOFF_BYTES = 8 << 20
_HANDOFF_ITEMS = 256

__all__ = ["StreamWriter", "chunk_checksums", "write_files"]


def _pad(batch: list[Any], gap: int) -> None:
    """Append ``gap`` zero bytes (the alignment gap before the next chunk)."""
    while gap > 0:
        z = min(gap, len(_ZEROS))
        batch.append(_ZEROS[:z])
        gap -= z
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
                _pad(batch, it.offset - batch_end)
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
        nice: int = 0,
    ) -> None:
        self._nice = nice
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
                t = threading.Thread(
                    target=self._run,
                    args=(len(self._queues), q),
                    name=f"statestream-write-{len(self._queues)}",
                    daemon=True,
                )
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
        lower_thread_priority(self._nice)
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
                    _pad(batch, it.offset - end)
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
