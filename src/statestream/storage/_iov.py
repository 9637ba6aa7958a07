"""Vectored I/O helpers shared by the readers and the writer (``preadv``/``pwritev``)."""

from __future__ import annotations

import os
from collections.abc import Sequence

from statestream.storage._base import Buffer

__all__ = ["IOV_MAX", "advance", "byte_views", "preadv_all", "take"]

#: at most this many buffers per preadv/pwritev call (Linux's IOV_MAX)
IOV_MAX = 1024


def byte_views(buffers: Sequence[Buffer]) -> list[memoryview]:
    """Flat byte views of the non-empty ``buffers``."""
    return [v for v in (memoryview(b).cast("B") for b in buffers) if v.nbytes]


def advance(views: list[memoryview], n: int) -> None:
    """Drop the views a call transferred ``n`` bytes of; trim a partly done one."""
    while n and views:
        v = views[0]
        if n >= v.nbytes:
            n -= v.nbytes
            views.pop(0)
        else:
            views[0] = v[n:]
            n = 0


def take(views: list[memoryview], n: int) -> list[memoryview]:
    """Views of the first ``n`` bytes of ``views`` (at most all of them), dropped from
    ``views`` as :func:`advance` drops them."""
    out: list[memoryview] = []
    left = n
    for v in views:
        if left <= 0:
            break
        out.append(v[:left] if v.nbytes > left else v)
        left -= v.nbytes
    advance(views, n)
    return out


def preadv_all(fd: int, buffers: Sequence[Buffer], offset: int) -> int | None:
    """Fill ``buffers`` from ``fd`` at ``offset`` (``preadv``, IOV_MAX views a call).

    Returns None once every byte is read, or the offset at which the file ended
    first (the caller names the file and says what it expected); an
    :class:`OSError` is the caller's to word as well.
    """
    views = byte_views(buffers)
    while views:
        n = os.preadv(fd, views[:IOV_MAX], offset)
        if n == 0:
            return offset
        offset += n
        advance(views, n)
    return None
