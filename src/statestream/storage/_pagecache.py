"""Which bytes of a file a read will bring into the page cache, and letting them go.

A load copies what it reads into its destinations; the page-cache copy is then a
second one. Dropping the pages a load brought in (and only those: what was cached
before stays) keeps the page cache from growing by the checkpoint's size, and lets
the kernel reuse the same physical pages for the next reads. On the test VM, where
memory the host has not backed lately costs a slow first touch, a cold in-place
read of 2 GiB ran 1.5x faster so (docs/design-notes.md, "Load path").

Residency comes from ``mincore`` on a throw-away shared mapping of the range. The
kernel answers that for a file only to its owner, a writer or root; otherwise this
module says it cannot tell, and nothing is dropped.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import sys

from statestream.storage._compose import _FAILED, _MACHINES, PAGE, libc

__all__ = ["cold_ranges", "drop_cached", "read_ahead"]


def _may_inspect(fd: int) -> bool:
    """Whether ``mincore`` tells this process the file's page-cache state (Linux 5.0+
    answers only to the file's owner, a process allowed to write it, or root)."""
    if sys.platform != "linux" or platform.machine() not in _MACHINES:
        return False
    try:
        st = os.fstat(fd)
    except OSError:
        return False
    euid = os.geteuid()
    return euid == 0 or st.st_uid == euid


#: ``mincore`` is asked about at most this many bytes at a time (its answer takes a byte
#: per page: 256 KiB per GiB), so a file of any size costs bounded memory
_WINDOW = 1 << 30


def cold_ranges(fd: int, offset: int, nbytes: int) -> list[tuple[int, int]]:
    """``(start, end)`` byte ranges of ``[offset, offset + nbytes)`` of the file whose
    pages are not in the page cache now, widened to whole pages; empty when all are
    cached, or when this cannot be told (then nothing should be dropped)."""
    if nbytes <= 0 or not _may_inspect(fd):
        return []
    out: list[tuple[int, int]] = []
    pos = offset - offset % PAGE
    end = offset + nbytes
    while pos < end:
        part = _cold_window(fd, pos, min(_WINDOW, end - pos))
        if part is None:
            return []
        for a, b in part:
            if out and out[-1][1] == a:
                out[-1] = (out[-1][0], b)
            else:
                out.append((a, b))
        pos += _WINDOW
    return out


def _cold_window(fd: int, start: int, length: int) -> list[tuple[int, int]] | None:
    """:func:`cold_ranges` of ``[start, start + length)``, ``start`` page-aligned; None
    when the system does not say."""
    lib = libc()
    addr = lib.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, start)
    if addr in (None, _FAILED):
        return None
    try:
        npages = -(-length // PAGE)
        vec = (ctypes.c_ubyte * npages)()
        if lib.mincore(addr, length, vec) != 0:
            return None
    finally:
        lib.munmap(addr, length)
    import numpy as np

    resident = np.frombuffer(memoryview(vec).cast("B"), dtype=np.uint8) & 1
    if resident.all():
        return []
    edges = np.diff(np.concatenate(([1], resident, [1])).astype(np.int8))
    firsts, ends = np.flatnonzero(edges == -1), np.flatnonzero(edges == 1)
    return [(start + int(a) * PAGE, start + int(b) * PAGE) for a, b in zip(firsts, ends)]


def drop_cached(fd: int, ranges: list[tuple[int, int]], lo: int, hi: int) -> None:
    """Let the page cache drop the pages of ``ranges`` (from :func:`cold_ranges`) that
    lie wholly within ``[lo, hi)`` (a page shared with bytes past either end stays:
    another read may want it). Best effort: a hint."""
    for a, b in ranges:
        x, y = max(a, lo), min(b, hi)
        if x < y:
            try:
                os.posix_fadvise(fd, x, y - x, os.POSIX_FADV_DONTNEED)
            except OSError:
                return  # only a hint: the bytes were read and checked either way


def read_ahead(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start reading ``[offset, offset + nbytes)`` of ``fd`` into the
    page cache. A hint: never fails, never waits for the data."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is None or nbytes <= 0:
        return
    try:
        advise(fd, offset, nbytes, os.POSIX_FADV_WILLNEED)
    except OSError:
        pass
