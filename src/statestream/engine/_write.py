"""The streaming writer: one thread and queue per data file."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from statestream import _hooks
from statestream.engine._core import ByteBudget, Progress, lower_thread_priority
from statestream.format import ChunkEntry, FileEntry, checksum
from statestream.plan import WriteItem
from statestream.storage import WriteTransaction

#: Bytes handed to one vectored write call (many small chunks coalesce up to this).
_WRITE_BATCH_BYTES = 16 << 20
_ZEROS = bytes(4096)
_NO_DATA = np.empty(0, dtype=np.uint8)
#: The walking thread hands a writer this much work at a time.
_HANDOFF_BYTES = 8 << 20
_HANDOFF_ITEMS = 256

__all__ = ["StreamWriter", "chunk_checksums"]


def _pad(batch: list[Any], gap: int) -> None:
    """Append ``gap`` zero bytes (the alignment gap before the next chunk)."""
    while gap > 0:
        z = min(gap, len(_ZEROS))
        batch.append(_ZEROS[:z])
        gap -= z


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
    fsyncs every file, and returns what was written: a
    :class:`~statestream.format.ChunkEntry` per (array, chunk), made once its
    bytes are in the file (offset, stored size, CRC-32C and block CRCs), and
    :meth:`files` the files with their final sizes.
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
        after_write: Callable[[Sequence[WriteItem]], object] | None = None,
        on_error: Callable[[BaseException], None] | None = None,
        nice: int = 0,
        nice_later: bool = False,
    ) -> None:
        self._nice = nice
        #: set: writer threads take ``nice`` (at once, or from the next batch on
        #: when ``nice_later``, after :meth:`yield_to_training`)
        self._yield = threading.Event()
        if not nice_later:
            self._yield.set()
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
        self._records: dict[tuple[int, int], ChunkEntry] = {}
        self._sizes: dict[int, int] = {}
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

    def close(self) -> dict[tuple[int, int], ChunkEntry]:
        """Finish every file (fsync); return the record of every written chunk.

        A record's ``file`` is the writer's file index, which is also its
        position in :meth:`files`.
        """
        for i in range(len(self._pending)):
            self._handoff(i)
        for q in self._queues:
            q.put(self._STOP)
        for t in self._threads:
            t.join()
        if self._errors:
            self._raise()
        return self._records

    def files(self) -> list[FileEntry]:
        """The data files written (after :meth:`close`), in file-index order."""
        return [FileEntry(self._name(i), self._sizes.get(i, 0)) for i in range(len(self._queues))]

    def yield_to_training(self) -> None:
        """Writers take their niceness from their next batch on (``nice_later``)."""
        self._yield.set()

    def failed(self) -> bool:
        """Whether a writer has failed (:meth:`check` raises its error)."""
        return self._failed.is_set()

    def check(self) -> None:
        """Raise the first writer error, if any."""
        if self._failed.is_set():
            self._raise()

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
        lowered = False
        budget = self._budget
        w = None
        held = 0
        written: dict[tuple[int, int], ChunkEntry] = {}
        try:
            w = self._txn.create_file(self._name(index), 0)
            while not self._failed.is_set():
                if not lowered and self._yield.is_set():
                    lower_thread_priority(self._nice)
                    lowered = True
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
                            self._written(done_items)
                            budget.release(held)
                            held = 0
                            done_items = []
                            batch_off = end = it.offset
                        got = budget.acquire(it.staging_bytes)
                    held += got
                    data = self._source(it)
                    crc, blocks = chunk_checksums(it, data)
                    written[(it.array, it.chunk)] = ChunkEntry(
                        it.file, it.offset, it.nbytes, crc, it.start, it.shape, it.block_rows,
                        blocks)
                    _pad(batch, it.offset - end)
                    batch.append(data)
                    done_items.append(it)
                    end = it.offset + it.nbytes
                if batch:
                    w.write_at(batch, batch_off)
                    batch = []
                    data = _NO_DATA  # the buffers are freed before their budget is
                    self._written(done_items)
                budget.release(held)
                held = 0
            if not self._failed.is_set():
                w.finish()
                w = None
            with self._lock:
                self._records.update(written)
                self._sizes[index] = max((c.offset + c.nbytes for c in written.values()),
                                         default=0)
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
        # Progress counts chunk bytes (as ``total_bytes`` does), not alignment gaps.
        self._advance(sum(it.nbytes for it in items))
        _hooks.fire("save.chunk_written")
        if self._after_write is not None and items:
            self._after_write(items)

    def _advance(self, n: int) -> None:
        if self._progress is not None:
            with self._lock:
                self._done += n
                done = self._done
            self._progress(done, self.total_bytes)
