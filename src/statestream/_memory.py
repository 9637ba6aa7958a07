"""Fresh host memory for large buffers: the C allocator's, with no huge-page advice.

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
saves, object-store parts -- comes from here: ``posix_memalign`` (page-aligned, so
``O_DIRECT`` can use it), freed when the last array on it goes. The C allocator,
as torch's own, rather than a mapping per buffer, so that memory the process has
freed can be handed out again. The system's THP policy still applies (``always``
gives huge pages).
"""

from __future__ import annotations

import ctypes
import mmap
import weakref

import numpy as np

__all__ = ["MAP_MIN_BYTES", "fresh_bytes"]

#: Buffers this large or larger come from ``posix_memalign``; smaller ones from
#: NumPy, which gives no huge-page advice below 4 MiB.
MAP_MIN_BYTES = 4 << 20
_PAGE = mmap.PAGESIZE


def _libc() -> tuple[ctypes.CDLL, ctypes._FuncPointer] | None:
    try:
        lib = ctypes.CDLL(None)
        lib.posix_memalign.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t,
                                       ctypes.c_size_t]
        lib.posix_memalign.restype = ctypes.c_int
        lib.free.argtypes = [ctypes.c_void_p]
        lib.free.restype = None
        view = ctypes.pythonapi.PyMemoryView_FromMemory
        view.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int]
        view.restype = ctypes.py_object
    except (OSError, AttributeError):  # no C library or CPython API in this process
        return None
    return lib, view


_C = _libc()
_PYBUF_WRITE = 0x200


def fresh_bytes(nbytes: int) -> np.ndarray:
    """A writable 1-D ``uint8`` array of ``nbytes`` uninitialised bytes.

    Large ones are page-aligned and freed when the last array (view) on them goes.

    Example:
        >>> b = fresh_bytes(8 << 20)
        >>> b.nbytes, b.flags.writeable, b.ctypes.data % 4096
        (8388608, True, 0)
    """
    if nbytes < MAP_MIN_BYTES:
        return np.empty(nbytes, dtype=np.uint8)
    if _C is None:
        mem = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        return np.frombuffer(mem, dtype=np.uint8)
    lib, view = _C
    ptr = ctypes.c_void_p()
    if lib.posix_memalign(ctypes.byref(ptr), _PAGE, nbytes) != 0 or not ptr.value:
        raise MemoryError(f"cannot allocate {nbytes} bytes")
    try:
        owner = np.frombuffer(view(ptr.value, nbytes, _PYBUF_WRITE), dtype=np.uint8)
    except BaseException:
        lib.free(ptr.value)
        raise
    # Every view NumPy (or torch.from_numpy) makes of ``out`` has ``owner`` as its
    # base (NumPy collapses chains of views), so the block lives while any does.
    weakref.finalize(owner, lib.free, ptr.value)
    out: np.ndarray = owner[:]
    return out
