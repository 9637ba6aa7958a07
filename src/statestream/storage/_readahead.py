"""Starting the disk on what a load has planned while its walk goes on.

A load walks the manifest and the target first (building each array's value and
planning its read, ~15 us of Python per array) and reads after. From a cold page
cache the walk's Python and the disk then take turns: for 20,000 small tensors,
0.3-0.4 s of walk and then ~0.5 s of reads. :class:`ReadAhead` is fed the byte
ranges the walk plans; runs of adjacent ranges go to one thread that asks the
kernel to read them into the page cache (``posix_fadvise(WILLNEED)``, which
returns once the reads are queued), so the disk works while the walk does. The
load's own reads, which verify every checksum, then find the pages cached.

Only small chunks are read ahead (under 1 MiB by default): the walk spends the
same ~15 us on an array of any size, which is a quarter of the time 64 KiB take to
come off the disk here but 1% of 1 MiB's. Large chunks gain nothing, and reading
them ahead competed with the load's own reads (a cold load of 3 GB of mostly large
arrays ran 1.1-1.2x slower with them read ahead).

It is a hint and it is bounded: nothing is read that the load does not plan, at
most one call (of about ``step`` bytes) is in flight, and :meth:`ReadAhead.close`
at the end of the walk drops whatever is still queued (from then on the load's
reads lead the disk).
"""

from __future__ import annotations

import collections
import threading

from statestream.errors import CheckpointError
from statestream.storage._base import MappedReader

__all__ = ["ReadAhead"]


class ReadAhead:
    """Reads ahead, on one background thread, the ranges a load's walk plans.

    ``add`` (the walk's thread only) ignores ranges over ``max_chunk`` bytes and
    joins the others to the current run of their file when they start at most
    ``gap`` bytes after the run's end; a run of ``step`` bytes or more, or one that
    a non-adjacent range ends, is queued. ``close`` drops what is queued and waits
    for the call in flight, if any (so the reader may be closed right after).
    """

    def __init__(self, reader: MappedReader, *, step: int = 8 << 20, gap: int = 64 << 10,
                 max_chunk: int = 1 << 20) -> None:
        self._reader = reader
        self._step, self._gap, self._max_chunk = step, gap, max_chunk
        self._runs: dict[str, list[int]] = {}  # file -> [start, end) being gathered
        self._queue: collections.deque[tuple[str, int, int]] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None

    def add(self, name: str, offset: int, nbytes: int) -> None:
        if nbytes > self._max_chunk:
            return
        run = self._runs.get(name)
        if run is not None and 0 <= offset - run[1] <= self._gap:
            run[1] = offset + nbytes
        else:
            if run is not None:
                self._push(name, run)
            run = self._runs[name] = [offset, offset + nbytes]
        if run[1] - run[0] >= self._step:
            self._push(name, run)
            del self._runs[name]

    def _push(self, name: str, run: list[int]) -> None:
        with self._cond:
            if self._closed:
                return
            self._queue.append((name, run[0], run[1] - run[0]))
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, daemon=True,
                                                name="statestream-readahead")
                self._thread.start()
            self._cond.notify()

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                name, offset, nbytes = self._queue.popleft()
            try:
                self._reader.read_ahead(name, offset, nbytes)
            except (CheckpointError, OSError):
                pass  # only a hint: the load's own read reports a missing file

    def close(self) -> None:
        """Stop: drop what is queued, wait for the call in flight."""
        with self._cond:
            self._closed = True
            self._queue.clear()
            self._runs.clear()
            self._cond.notify()
            thread = self._thread
        if thread is not None:
            thread.join()
