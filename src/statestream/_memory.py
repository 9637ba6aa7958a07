"""Fresh host memory for large buffers: anonymous mappings, no huge-page advice.

``numpy.empty`` asks the kernel for transparent huge pages (``madvise(MADV_HUGEPAGE)``)
on every buffer of 4 MiB or more. Where the kernel's THP defrag setting is
``madvise`` (a common default), that advice lets each fault stall in direct
compaction whenever no free 2 MiB block is at hand -- the usual state of a
machine whose memory is full of page cache, as a machine that has just read a
checkpoint is. Measured on the development VM (benchmarks/README.md, "Fresh
memory for loads"), reading 1 GiB into fresh buffers, medians of 5 fresh processes:
NumPy's 0.73 s (0.55-1.51) and, after the process had freed 2.4 GB, 1.53 s
(0.12-1.56); these 0.24-0.26 s (0.24-0.40); ``torch.empty``'s 0.28-0.29 s.

So every large buffer statestream fills -- load destinations, staging for async
saves, object-store parts, bounce and decode buffers -- comes from here: a private
anonymous mapping of its own (page-aligned, so ``O_DIRECT`` can use it), unmapped
when the last array on it goes. Not the C allocator's memory: freed heap memory
may lie in a range NumPy advised earlier (the advice stays with the range), and
freed memory the allocator keeps (per-thread arenas) would show as peak RSS above
the memory budget. The system's THP policy still applies (``always`` gives huge
pages).
"""

from __future__ import annotations

import mmap

import numpy as np

__all__ = ["MAP_MIN_BYTES", "fresh_bytes"]

#: Buffers this large or larger are mapped; smaller ones come from NumPy, which
#: gives no huge-page advice below 4 MiB.
MAP_MIN_BYTES = 4 << 20


def fresh_bytes(nbytes: int) -> np.ndarray:
    """A writable 1-D ``uint8`` array of ``nbytes`` uninitialised bytes.

    Large ones are page-aligned and unmapped when the last array (view) on them goes.

    Example:
        >>> b = fresh_bytes(8 << 20)
        >>> b.nbytes, b.flags.writeable, b.ctypes.data % 4096
        (8388608, True, 0)
    """
    if nbytes < MAP_MIN_BYTES:
        return np.empty(nbytes, dtype=np.uint8)
    mem = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(mem, dtype=np.uint8)
