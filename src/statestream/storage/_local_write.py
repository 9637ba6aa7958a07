"""Local data files: vectored writes, direct I/O for whole pages, early writeback.

One ``_LocalFileWriter`` per data file of a local save (``_local.py`` owns the
transaction and the commit). See docs/storage.md, "Local disk: direct I/O".
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Sequence
from typing import Any

from statestream._memory import aligned_bytes
from statestream.errors import StorageError, storage_error
from statestream.storage._base import Buffer
from statestream.storage._iov import IOV_MAX, advance, byte_views, take


def _pwrite_all(fd: int, buffers: Sequence[Buffer], offset: int, where: str) -> int:
    views = byte_views(buffers)
    while views:
        batch = views[:IOV_MAX]
        try:
            n = os.pwritev(fd, batch, offset)
        except OSError as exc:
            raise storage_error(f"writing {where} at offset {offset} failed: {exc}", exc) from exc
        offset += n
        advance(views, n)
    return offset


def _sync_file_range_fn() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _sync_file_range_fn()
_SYNC_FILE_RANGE_WRITE = 2
#: Start writeback every this many written bytes (the final fsync then has little left).
_WRITEBACK_BYTES = 16 << 20


#: Direct I/O needs buffer address, file offset and length aligned to the
#: logical block size; a page covers every common one.
_DIRECT_ALIGN = 4096
#: Smaller buffers go through the page cache (the saving would not pay the syscall).
_DIRECT_MIN_BYTES = 1 << 20
_O_DIRECT = getattr(os, "O_DIRECT", 0)
#: Unaligned large buffers (tensor memory) are copied through a page-aligned
#: buffer of this size per file and written direct.
_BOUNCE = 8 << 20
#: Runs of small buffers at least this long are gathered and written direct:
#: copying 1-64 KiB tensors into the reused bounce buffer costs less than the
#: kernel's copy into fresh page-cache pages (and leaves no writeback to fsync).
_GATHER_MIN_BYTES = 256 << 10


def _address(view: memoryview) -> int:
    import numpy as np

    addr: int = np.frombuffer(view, dtype=np.uint8).__array_interface__["data"][0]
    return addr


class _LocalFileWriter:
    def __init__(self, path: str, size_hint: int, direct_io: bool = False) -> None:
        self._path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        self._dirty_lo = -1
        self._dirty_hi = 0
        # None: not tried yet; -1: this file system refuses O_DIRECT.
        self._dfd: int | None = None if direct_io and _O_DIRECT else -1
        self._bounce: Any = None
        #: (offset, bytes): the unaligned end of the last direct write, kept to
        #: lead the next one when it follows on (else written buffered)
        self._carry: tuple[int, bytes] | None = None
        if size_hint > 0:
            try:
                os.posix_fallocate(self._fd, 0, size_hint)
            except OSError:
                pass  # not supported by this file system; writes extend the file

    def write_at(self, buffers: Sequence[Buffer], offset: int) -> None:
        if self._dfd == -1:
            self._write_buffered(buffers, offset)
            return
        # Large buffers at page-aligned file offsets bypass the page cache: the
        # kernel then copies nothing (measured here: 0.05 s of CPU per 1.2 GB
        # instead of 0.5-1.2 s, and no writeback left for fsync), which is what
        # lets background saves stay out of training's way. Page-aligned buffers
        # (the engine's staging buffers) go as they are; others (tensor memory)
        # through an 8 MiB aligned bounce buffer, a copy that costs less than the
        # kernel's. Runs of small buffers (many small tensors) are gathered into
        # the same bounce buffer and written direct too. Unaligned heads and tails
        # take the buffered path; the two never share a page, so they cannot
        # overwrite each other.
        # A buffered write of a partial page next to direct writes costs ~3 ms here,
        # so the last partial page of a write is carried over to lead the next one.
        views = byte_views(buffers)
        if self._carry is not None:
            c_off, c_bytes = self._carry
            self._carry = None
            gap = offset - c_off - len(c_bytes)
            if 0 <= gap < _DIRECT_ALIGN:  # the same page: the gap (alignment) is zeros
                views[:0] = [memoryview(c_bytes), memoryview(bytes(gap))]
                offset = c_off
            else:
                self._write_buffered([c_bytes], c_off)
        pos, i, n = offset, 0, len(views)
        while i < n:
            if views[i].nbytes >= _DIRECT_MIN_BYTES:
                pos = self._write_large(views[i], pos, i == n - 1)
                i += 1
                continue
            j, run = i, 0
            while j < n and views[j].nbytes < _DIRECT_MIN_BYTES:
                run += views[j].nbytes
                j += 1
            if run >= _GATHER_MIN_BYTES:
                self._write_gathered(views[i:j], pos, run, j == n)
            else:
                self._write_buffered(views[i:j], pos)
            pos += run
            i = j

    def _tail(self, views: list[memoryview], pos: int, last: bool, direct: bool) -> None:
        """Bytes after the last whole page written direct: carried when they end the
        write (and the direct path works), else written buffered."""
        if not views:
            return
        if last and direct and self._dfd != -1:
            self._carry = (pos, b"".join(views))
        else:
            self._write_buffered(views, pos)

    def _write_large(self, v: memoryview, pos: int, last: bool) -> int:
        """One large buffer: its whole pages direct when ``pos`` is aligned."""
        k = v.nbytes - v.nbytes % _DIRECT_ALIGN
        ok = False
        if pos % _DIRECT_ALIGN == 0:
            ok = (self._write_direct(v[:k], pos) if _address(v) % _DIRECT_ALIGN == 0
                  else self._write_bounced(v[:k], pos))
            if ok:
                pos += k
                v = v[k:]
        if v.nbytes:
            self._tail([v], pos, last, ok)
            pos += v.nbytes
        return pos

    def _write_gathered(self, views: list[memoryview], pos: int, total: int,
                        last: bool) -> None:
        """Small buffers, back to back from ``pos``: the whole pages they cover are
        copied into the bounce buffer and written direct, the rest buffered."""
        head = -pos % _DIRECT_ALIGN
        body = max(0, total - head) // _DIRECT_ALIGN * _DIRECT_ALIGN
        rest = list(views)
        if head:
            self._write_buffered(take(rest, head), pos)
            pos += head
        b = self._bounce_buffer()
        bm = memoryview(b)
        direct = False
        while body:
            m = min(_BOUNCE, body)
            piece = take(rest, m)
            o = 0
            for v in piece:
                # a memoryview copy keeps the GIL (numpy's would release it and
                # then wait for it behind the walking thread, once per tensor)
                bm[o:o + v.nbytes] = v
                o += v.nbytes
            direct = self._write_direct(memoryview(b[:m]), pos)
            if not direct:
                self._write_buffered(piece, pos)  # this file system refuses O_DIRECT
            pos += m
            body -= m
        self._tail(rest, pos, last, direct)

    def _bounce_buffer(self) -> Any:
        if self._bounce is None:
            self._bounce = aligned_bytes(_BOUNCE)  # O_DIRECT takes it
        return self._bounce

    def _write_bounced(self, view: memoryview, offset: int) -> bool:
        """Copy through the aligned bounce buffer, writing each piece direct."""
        import numpy as np

        b = self._bounce_buffer()
        src = np.frombuffer(view, dtype=np.uint8)
        for a in range(0, view.nbytes, _BOUNCE):
            m = min(_BOUNCE, view.nbytes - a)
            b[:m] = src[a:a + m]
            if not self._write_direct(memoryview(b[:m]), offset + a):
                if a == 0:
                    return False
                raise StorageError(f"direct I/O to {self._path} stopped working mid-file")
        return True

    def _write_direct(self, view: memoryview, offset: int) -> bool:
        """Write with O_DIRECT; False (nothing written) if the file system refuses it."""
        if self._dfd is None:
            try:
                self._dfd = os.open(self._path, os.O_WRONLY | os.O_CLOEXEC | _O_DIRECT)
            except OSError:  # no O_DIRECT here: -1 remembers it, buffered writes follow
                self._dfd = -1
        if self._dfd == -1:
            return False
        done = 0
        while done < view.nbytes:
            try:
                n = os.pwritev(self._dfd, [view[done:]], offset + done)
            except OSError as exc:
                if exc.errno == errno.EINVAL and done == 0:
                    os.close(self._dfd)  # alignment this file system will not take
                    self._dfd = -1
                    return False
                raise storage_error(
                    f"writing {self._path} at offset {offset + done} failed: {exc}", exc
                ) from exc
            if n <= 0:  # pragma: no cover - a zero-length direct write
                raise StorageError(f"writing {self._path} at offset {offset + done}: no progress")
            done += n
        return True

    def _write_buffered(self, buffers: Sequence[Buffer], offset: int) -> None:
        end = _pwrite_all(self._fd, buffers, offset, self._path)
        # Start writeback of what was just written, asynchronously, so the disk
        # works while we prepare the next bytes instead of all at the final fsync.
        if _sync_file_range is None:
            return
        self._dirty_lo = offset if self._dirty_lo < 0 else min(self._dirty_lo, offset)
        self._dirty_hi = max(self._dirty_hi, end)
        if self._dirty_hi - self._dirty_lo >= _WRITEBACK_BYTES:
            _sync_file_range(self._fd, self._dirty_lo, self._dirty_hi - self._dirty_lo,
                             _SYNC_FILE_RANGE_WRITE)
            self._dirty_lo = -1
            self._dirty_hi = 0

    def finish(self) -> None:
        try:
            if self._carry is not None:
                self._write_buffered([self._carry[1]], self._carry[0])
                self._carry = None
            os.fsync(self._fd)
        except OSError as exc:
            raise storage_error(f"fsync of {self._path} failed: {exc}", exc) from exc
        finally:
            self.abort()

    def abort(self) -> None:
        if self._dfd is not None and self._dfd >= 0:
            os.close(self._dfd)
            self._dfd = -1
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
