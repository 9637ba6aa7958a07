"""Fresh host memory for large buffers: NumPy's allocator, without its huge-page advice.

``numpy.empty`` asks the kernel for transparent huge pages (``madvise(MADV_HUGEPAGE)``)
on every buffer of 4 MiB or more. Where the kernel's THP defrag setting is
``madvise`` (a common default), that advice lets each fault stall in direct
compaction whenever no free 2 MiB block is at hand -- the usual state of a
machine whose memory is full of page cache, as a machine that has just read a
checkpoint is. Measured on the development VM (benchmarks/README.md, "Fresh
memory for loads"), reading 1 GiB into fresh buffers in a fresh process: NumPy's
0.35-1.66 s over three runs, the same allocation without the advice 0.27-0.29 s.

So every large buffer statestream fills -- load destinations, staging for async
saves, object-store parts, bounce and decode buffers -- comes from here: NumPy's
allocator (which hands out memory the process freed earlier: in a process that
had freed 2.4 GB, 0.11-0.15 s against 0.26-0.30 s for pages mapped anew) with the
advice switched off for the call, and page-aligned (``O_DIRECT`` can use it).
Where this NumPy has no switch, a private anonymous mapping of its own. The
system's THP policy still applies (``always`` gives huge pages).
"""

from __future__ import annotations

import importlib
import mmap
import os
import threading
from collections.abc import Callable

import numpy as np

__all__ = ["MAP_MIN_BYTES", "aligned_bytes", "fresh_bytes"]

#: Buffers this large or larger are allocated without the advice (NumPy gives
#: none below 4 MiB) and page-aligned.
MAP_MIN_BYTES = 4 << 20
_PAGE = mmap.PAGESIZE


def _advice_switch() -> Callable[[bool], bool] | None:
    """NumPy's ``_set_madvise_hugepage`` (returns the previous setting), if it has one."""
    for name in ("numpy._core.multiarray", "numpy.core.multiarray"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        switch = getattr(module, "_set_madvise_hugepage", None)
        if callable(switch):
            return switch  # type: ignore[no-any-return]
    return None


_SWITCH = _advice_switch()
_LOCK = threading.Lock()


def _fresh_lock_in_child() -> None:
    # after fork(): a thread that held it (a save's copy thread) did not come along
    global _LOCK
    _LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_fresh_lock_in_child)


def fresh_bytes(nbytes: int) -> np.ndarray:
    """A writable 1-D ``uint8`` array of ``nbytes`` uninitialised bytes.

    Large ones start on a page boundary and carry no huge-page advice of ours.

    Example:
        >>> b = fresh_bytes(8 << 20)
        >>> b.nbytes, b.flags.writeable, b.ctypes.data % 4096
        (8388608, True, 0)
    """
    if nbytes < MAP_MIN_BYTES:
        return np.empty(nbytes, dtype=np.uint8)
    if _SWITCH is None:
        mem = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        return np.frombuffer(mem, dtype=np.uint8)
    with _LOCK:  # the switch is NumPy's global: other threads see it off briefly
        was = _SWITCH(False)
        try:
            return _page_aligned(nbytes)
        finally:
            _SWITCH(was)


def aligned_bytes(nbytes: int) -> np.ndarray:
    """Like :func:`fresh_bytes`, but page-aligned whatever the size (for ``O_DIRECT``).

    Example:
        >>> aligned_bytes(100_000).ctypes.data % 4096
        0
    """
    return fresh_bytes(nbytes) if nbytes >= MAP_MIN_BYTES else _page_aligned(nbytes)


def _page_aligned(nbytes: int) -> np.ndarray:
    raw = np.empty(nbytes + _PAGE, dtype=np.uint8)
    skip = -raw.ctypes.data % _PAGE
    out: np.ndarray = raw[skip:skip + nbytes]  # keeps raw alive
    return out
