"""The streaming writer: one thread and queue per data file."""

from __future__ import annotations

import dataclasses
import math
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from statestream import _hooks
from statestream.engine._codec import encode_chunk
from statestream.engine._core import (
    ByteBudget,
    Progress,
    lower_thread_priority,
    thread_started,
)
from statestream.engine._refs import BaseChunks, chunk_digest, digest_and_checksums
from statestream.format import ChunkEntry, FileEntry, checksum, checksum_of_blocks
from statestream.plan import WriteItem, chunk_offset
from statestream.storage import FileWriter, WriteTransaction

#: Bytes handed to one vectored write call (many small chunks coalesce up to this).
_WRITE_BATCH_BYTES = 16 << 20
_ZEROS = bytes(4096)
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


@dataclasses.dataclass(slots=True)
class _FileState:
    """One writer thread's running state: its records, where its file ends, budget held."""

    written: dict[tuple[int, int], ChunkEntry] = dataclasses.field(default_factory=dict)
    cursor: int = 0
    held: int = 0


def _codec_bytes(it: WriteItem) -> int:
    """Memory compressing ``it`` takes beyond its staging: the output (at most about
    the raw size) and, when shuffling, the shuffled copy."""
    if it.codec is None:
        return 0
    return it.nbytes * (2 if it.codec.shuffle else 1)


def chunk_checksums(item: WriteItem, data: np.ndarray) -> tuple[int, tuple[int, ...]]:
    """The chunk's CRC-32C, and its block CRCs when ``item.block_rows`` is set.

    With blocks, the chunk checksum is the CRC-32C of the block CRCs as
    little-endian uint32 (:func:`~statestream.format.checksum_of_blocks`,
    docs/format.md), so each byte is hashed once.
    """
    if not item.block_rows:
        return checksum(data), ()
    step = (item.nbytes // item.shape[0]) * item.block_rows
    blocks = tuple(checksum(data[a : a + step]) for a in range(0, item.nbytes, step))
    return checksum_of_blocks(blocks), blocks


def _gone(item: WriteItem) -> np.ndarray:
    raise RuntimeError("the writer was closed")


class StreamWriter:
    """Writes items as they are planned: one thread and queue per data file.

    The caller (walking the state on its own thread) ``submit``s items; each
    file's thread writes them in order, coalescing queued neighbours into
    vectored writes of up to 16 MiB, charging copies to ``budget``. So
    preparing later arrays overlaps writing earlier ones. Items with a codec
    are compressed by their file's thread (so files compress in parallel);
    in a save that compresses (``relayout``), each thread places its chunks
    one after the other by their stored sizes. With ``hashes`` each chunk's
    XXH3-128 is recorded; a chunk equal to one of ``base`` (an incremental
    save, which relayouts too) is recorded as a reference and not written. ``close()`` waits,
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
        relayout: bool = False,
        hashes: bool = False,
        base: BaseChunks | None = None,
        nice_later: bool = False,
        lendable: Callable[[WriteItem], bool] | None = None,
        defer: Callable[[WriteItem], Callable[[], None] | None] | None = None,
        copy_bytes: Callable[[WriteItem], int] | None = None,
    ) -> None:
        self._nice = nice
        #: whether an item's bytes from ``source`` stay unchanged and alive until
        #: close (a synchronous save's own arrays): a writer with ``lend_at``
        #: (object stores) then uploads them from where they are
        self._lendable = lendable
        #: before an item: a waiter to call (after writing what is batched and
        #: releasing the budget held) before going on, or None (a racing snapshot)
        self._defer = defer
        #: the bytes ``source`` will allocate for an item beyond its ``staging_bytes``
        #: (a racing snapshot's copies of chunks read from the state), charged too
        self._copy_bytes = copy_bytes
        #: set: writer threads take ``nice`` (at once, or from the next batch on
        #: when ``nice_later``, after :meth:`yield_to_training`)
        self._yield = threading.Event()
        if not nice_later:
            self._yield.set()
        #: record each chunk's XXH3-128; with a base, refer to its equal chunks
        self._hashes = hashes or base is not None
        self._base = base
        #: this save compresses: writers place chunks by their stored sizes
        self._relayout = relayout
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
        #: one per writer thread, set once it is out of its file (finished or aborted)
        self._stopped: list[threading.Event] = []
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
                stopped = threading.Event()
                t = threading.Thread(
                    target=self._run,
                    args=(len(self._queues), q, stopped),
                    name=f"statestream-write-{len(self._queues)}",
                    daemon=True,
                )
                self._queues.append(q)
                self._threads.append(t)
                self._stopped.append(stopped)
                try:
                    t.start()
                except BaseException:  # a KeyboardInterrupt inside start()
                    if not thread_started(t):
                        stopped.set()  # it never ran: nothing else will say it stopped
                    raise
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
        self._join()
        self._drop_callbacks()
        if self._errors:
            self._raise()
        records, self._records = self._records, {}  # the caller's from now on
        return records

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
        self._join()
        self._drop_callbacks()

    def _join(self) -> None:
        """Wait until every writer thread is out of its file (finished or aborted).

        Each thread says so itself (``_stopped``), not ``Thread.join()``: on Python
        3.11 a join that a KeyboardInterrupt interrupts may mark the thread stopped
        while it still runs (CPython's bpo-45274 workaround releases the lock the
        running thread holds), and every later join returns at once. A Ctrl-C in
        ``close()`` then let ``abort()`` return while a writer was still in its
        file's ``finish()``, which completed an object store's upload after the
        save had deleted its root (an orphan data object, a thread outliving the
        save). An interrupt here raises (a second Ctrl-C gets out of ``abort()``,
        leaving the save's root behind as a killed save would); a writer's wait is
        bounded by the store's own timeouts.
        """
        for stopped in self._stopped:
            stopped.wait()

    def _drop_callbacks(self) -> None:
        # The callbacks are the job's bound methods and the job holds this writer:
        # with the threads gone, unhook them so the whole save is freed by reference
        # counting, not left to the cyclic collector (0.1-0.3 s on the caller's thread
        # for a 20,000-array save).
        self._source = _gone
        self._after_write = self._on_error = self._defer = self._copy_bytes = None

    def _raise(self) -> None:
        raise self._errors[0] if self._errors else RuntimeError("a writer thread stopped")

    def _run(self, index: int, q: queue.SimpleQueue[Any], stopped: threading.Event) -> None:
        try:
            self._run_file(index, q)
        finally:
            stopped.set()  # out of its file: _join() may return

    def _run_file(self, index: int, q: queue.SimpleQueue[Any]) -> None:
        lowered = False
        w = None
        st = _FileState()
        try:
            w = self._txn.create_file(self._name(index), 0)
            while not self._failed.is_set():
                if not lowered and self._yield.is_set():
                    lower_thread_priority(self._nice)
                    lowered = True
                work = q.get()
                if work is self._STOP:
                    break
                self._write_work(w, work, st)
            if not self._failed.is_set():
                w.finish()
                w = None
            with self._lock:
                self._records.update(st.written)
                self._sizes[index] = max((c.offset + c.nbytes for c in st.written.values()
                                          if c.ref is None), default=0)
        except BaseException as exc:  # reported by submit()/close()
            with self._lock:
                self._errors.append(exc)
            self._failed.set()
            if self._on_error is not None:
                self._on_error(exc)
        finally:
            self._budget.release(st.held)
            st.held = 0
            if w is not None:
                w.abort()

    def _write_work(self, w: FileWriter, work: list[WriteItem], st: _FileState) -> None:
        """Write one handed-over list of items (in file order), in vectored batches."""
        budget = self._budget
        batch: list[Any] = []
        done_items: list[WriteItem] = []
        batch_off = end = 0
        lendable = self._lendable
        lend_at = getattr(w, "lend_at", None) if lendable is not None else None
        lends = True  # every payload of the batch may be lent (alignment gaps may)
        for it in work:
            if self._failed.is_set():
                break
            wait = self._defer(it) if self._defer is not None else None
            flush = wait is not None or (
                batch and (end - batch_off >= _WRITE_BATCH_BYTES or len(batch) > 900))
            need = it.staging_bytes + _codec_bytes(it)
            if self._copy_bytes is not None:
                need += self._copy_bytes(it)
            got = None if flush else budget.try_acquire(need)
            if wait is not None or got is None:
                if done_items:  # never wait while holding staged bytes: write first
                    if batch:
                        (lend_at if lend_at and lends else w.write_at)(batch, batch_off)
                        batch, lends = [], True
                    self._written(done_items)
                    budget.release(st.held)
                    st.held = 0
                    done_items = []
                if wait is None and self._defer is not None:
                    wait = self._defer(it)  # the batch just written may have been the last
                if wait is not None:
                    wait()  # holding nothing; returns early if a writer failed
                    if self._failed.is_set():
                        break
                got = budget.acquire(need)
            st.held += got
            data = self._source(it)
            entry, payload = self._record(it, data, st.cursor)
            if lend_at is not None and lendable is not None and payload is not None:
                lends = lends and payload is data and lendable(it)
            del data
            st.written[(it.array, it.chunk)] = entry
            if payload is None:  # a reference to the base: nothing to write
                done_items.append(it)
                continue
            if not batch:
                batch_off = end = entry.offset
            _pad(batch, entry.offset - end)
            batch.append(payload)
            del payload  # the batch holds the bytes until they are written
            done_items.append(it)
            end = st.cursor = entry.offset + entry.nbytes
        if batch:
            (lend_at if lend_at and lends else w.write_at)(batch, batch_off)
            batch = []  # the buffers are freed before their budget is
        if done_items:  # written, or references that needed no write
            self._written(done_items)
        budget.release(st.held)
        st.held = 0

    def _record(self, it: WriteItem, data: np.ndarray, end: int) -> tuple[ChunkEntry, Any]:
        """The chunk's record and the bytes to write for it (None: a reference).

        Without compression in this save, a chunk goes where the plan put it.
        With it, each chunk (compressed, or stored raw when that does not pay)
        goes right after the file's previous one (``end``), at its alignment.
        """
        if not self._hashes:
            return self._stored(it, data, end)
        if it.codec is not None:  # hashed here, checksummed once compressed
            digest = chunk_digest(data)
            ref = self._base.match(digest, data.nbytes, it.start, it.shape) \
                if self._base else None
            if ref is not None:
                return ref, None
            entry, payload = self._stored(it, data, end)
            entry.digest = digest
            return entry, payload
        if self._base is not None:  # the hash first: a chunk of the base needs no CRC pass
            digest = chunk_digest(data)
            ref = self._base.match(digest, data.nbytes, it.start, it.shape)
            if ref is not None:
                return ref, None
            crc, blocks = chunk_checksums(it, data)
        else:  # its hash and checksums in one pass over its bytes
            row_bytes = it.nbytes // it.shape[0] if it.shape and it.shape[0] else 0
            digest, crc, blocks = digest_and_checksums(data, row_bytes * it.block_rows)
        off = chunk_offset(end, it.nbytes) if self._relayout else it.offset
        return ChunkEntry(it.file, off, it.nbytes, crc, it.start, it.shape, it.block_rows,
                          blocks, digest=digest), data

    def _stored(self, it: WriteItem, data: np.ndarray, end: int) -> tuple[ChunkEntry, Any]:
        stored = None
        if it.codec is not None:
            stored = encode_chunk(data, it.nbytes // math.prod(it.shape), it.codec)
        off = chunk_offset(end, it.nbytes if stored is None else len(stored)) \
            if self._relayout else it.offset
        if stored is None:
            crc, blocks = chunk_checksums(it, data)
            return ChunkEntry(it.file, off, it.nbytes, crc, it.start, it.shape, it.block_rows,
                              blocks), data
        assert it.codec is not None
        return ChunkEntry(it.file, off, len(stored), checksum(stored), it.start, it.shape,
                          codec=it.codec.codec, shuffle=bool(it.codec.shuffle)), stored

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
