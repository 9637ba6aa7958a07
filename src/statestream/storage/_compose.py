"""One private mapping made of several file ranges, back to back (Linux).

An array saved in row blocks spread over several data files (a large array's chunks
go to different writer threads) is still loaded without fresh memory: a region of
address space is reserved, and each range is mapped over its place in it with
``MAP_FIXED | MAP_PRIVATE`` (copy-on-write, as :meth:`map_range`'s mappings). Python's
``mmap`` module cannot place a mapping, so libc's ``mmap`` is called through ctypes.

Every range but the last must be a whole number of pages, and every file offset
page-aligned (the save layout aligns large chunks so, docs/format.md); the caller
checks this and reads the array instead when it does not hold.
"""

from __future__ import annotations

import ctypes
import mmap
import platform
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["PAGE", "compose", "libc"]

PAGE = mmap.PAGESIZE
#: ``MAP_FIXED`` on Linux for these machines (the generic ABI value; Alpha differs)
_MAP_FIXED = 0x10
_MACHINES = {"x86_64", "aarch64", "arm64", "ppc64le", "s390x", "riscv64"}
_PROT_NONE = 0  # a reservation nothing may touch (and, not writable, not committed memory)
_FAILED = ctypes.c_void_p(-1).value

_libc: Any = None


def libc() -> Any:
    """libc through ctypes, with ``mmap``, ``munmap`` and ``mincore`` declared."""
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_long]
        libc.munmap.restype = ctypes.c_int
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.restype = ctypes.c_int  # (storage/_pagecache.py)
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
        _libc = libc
    return _libc


class _Region:
    """Owns the composed mapping; unmapped when the last array over it is gone
    (NumPy keeps an object exposing ``__array_interface__`` as the array's base)."""

    def __init__(self, addr: int, size: int, nbytes: int) -> None:
        self.addr, self.size = addr, size
        self.__array_interface__ = {"data": (addr, False), "shape": (nbytes,),
                                    "typestr": "|u1", "version": 3}

    def __del__(self) -> None:
        libc().munmap(self.addr, self.size)


def compose(ranges: Sequence[tuple[int, int, int]]) -> memoryview | None:
    """A writable private mapping of ``(fd, offset, nbytes)`` ranges placed back to back,
    or None where this system cannot make one (the caller then reads the bytes).

    The fds may be closed afterwards: the mapping holds the files.
    """
    if sys.platform != "linux" or platform.machine() not in _MACHINES or not ranges:
        return None
    import numpy as np

    for i, (_, off, n) in enumerate(ranges):
        if off % PAGE or (n % PAGE and i < len(ranges) - 1):
            raise ValueError("composed ranges must be page-aligned (but the last's end)")
    nbytes = sum(n for _, _, n in ranges)
    size = -(-nbytes // PAGE) * PAGE
    lib = libc()
    flags = mmap.MAP_PRIVATE
    base = lib.mmap(None, size, _PROT_NONE, flags | mmap.MAP_ANONYMOUS, -1, 0)
    if base in (None, _FAILED):
        return None
    region = _Region(base, size, nbytes)  # unmaps the reservation if a range fails
    pos = 0
    for fd, off, n in ranges:
        length = -(-n // PAGE) * PAGE
        got = lib.mmap(base + pos, length, mmap.PROT_READ | mmap.PROT_WRITE,
                       flags | _MAP_FIXED, fd, off)
        if got != base + pos:
            return None
        pos += n
    view: memoryview = np.asarray(region).data
    return view
