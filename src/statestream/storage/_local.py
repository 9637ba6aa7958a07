"""Local POSIX storage: pwritev/preadv from worker threads, commit by rename."""

from __future__ import annotations

import builtins
import ctypes
import errno
import os
import shutil
from collections.abc import Sequence
from typing import Any

from statestream import _hooks
from statestream.errors import (
    CheckpointError,
    CheckpointExistsError,
    StorageError,
    storage_error,
)
from statestream.format import COMMIT_NAME, DATA_DIR
from statestream.storage._base import (
    Buffer,
    Leftover,
    StorageCapabilities,
    WriterId,
    check_member_name,
)
from statestream.storage._iov import IOV_MAX, advance, byte_views
from statestream.storage._leftovers import collect_garbage
from statestream.storage._local_lease import (
    _STAGING_RE,
    _last_change,
    _LocalLease,
    _lock_file,
    _staging_name,
)
from statestream.storage._local_read import _LocalReader

__all__ = ["LocalStorage"]

_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _renameat2_fn() -> Any:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_renameat2 = _renameat2_fn()


def _rename2(src: str, dst: str, flags: int) -> bool:
    """renameat2(2); returns False if the kernel/file system does not support it."""
    if _renameat2 is None:
        return False
    rc = _renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), dst)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


class _ViewCursor:
    """Takes byte ranges off the front of a list of views, in order."""

    __slots__ = ("_views", "_i", "_skip", "left")

    def __init__(self, views: list[memoryview]) -> None:
        self._views = views
        self._i = 0
        self._skip = 0
        self.left = sum(v.nbytes for v in views)

    def take(self, n: int) -> list[memoryview]:
        """Views of the next ``n`` bytes (``n`` at most :attr:`left`)."""
        out: list[memoryview] = []
        self.left -= n
        while n:
            v = self._views[self._i]
            avail = v.nbytes - self._skip
            if n >= avail:
                out.append(v[self._skip:] if self._skip else v)
                n -= avail
                self._i += 1
                self._skip = 0
            else:
                out.append(v[self._skip:self._skip + n])
                self._skip += n
                n = 0
        return out


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
        rest = _ViewCursor(views)
        if head:
            self._write_buffered(rest.take(head), pos)
            pos += head
        b = self._bounce_buffer()
        bm = memoryview(b)
        direct = False
        while body:
            m = min(_BOUNCE, body)
            piece = rest.take(m)
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
        self._tail(rest.take(rest.left), pos, last, direct)

    def _bounce_buffer(self) -> Any:
        import numpy as np

        if self._bounce is None:
            raw = np.empty(_BOUNCE + _DIRECT_ALIGN, dtype=np.uint8)
            skip = -raw.__array_interface__["data"][0] % _DIRECT_ALIGN
            self._bounce = raw[skip:skip + _BOUNCE]
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


class _LocalWriteTransaction:
    def __init__(self, path: str, overwrite: bool, join: str | None = None,
                 direct_io: bool = False) -> None:
        self._direct_io = direct_io
        self.location = path
        self._final = path
        self._overwrite = overwrite
        parent, name = os.path.split(path)
        self._owner = join is None
        if join is None:
            os.makedirs(parent, exist_ok=True)
            self._tmp = os.path.join(parent, _staging_name(name))
            os.mkdir(self._tmp)
            os.mkdir(os.path.join(self._tmp, DATA_DIR))
        else:
            expected = os.path.join(parent, f".{name}.tmp-")
            if not join.startswith(expected) or not os.path.isdir(join):
                raise StorageError(f"cannot join write of {path}: {join!r} is not its staging dir")
            self._tmp = join
        self._done = False

    @property
    def token(self) -> str:
        """Identifies the staging area so other processes can write into it."""
        return self._tmp

    def _tmp_path(self, name: str) -> str:
        return os.path.join(self._tmp, check_member_name(name))

    def create_file(self, name: str, size_hint: int) -> _LocalFileWriter:
        path = self._tmp_path(name)
        try:
            return _LocalFileWriter(path, size_hint, self._direct_io)
        except OSError as exc:
            raise storage_error(f"cannot create {path}: {exc}", exc) from exc

    def write_bytes(self, name: str, data: bytes) -> None:
        w = self.create_file(name, 0)
        try:
            w.write_at([data], 0)
            w.finish()
        except BaseException:
            w.abort()
            raise

    def commit(self) -> None:
        if not self._owner:
            raise StorageError("only the process that began a write may commit it")
        try:
            _fsync_dir(os.path.join(self._tmp, DATA_DIR))
            _fsync_dir(self._tmp)
            self._publish()
            _fsync_dir(os.path.dirname(self._final) or ".")
            self._done = True
        except CheckpointError:
            self.abort()
            raise
        except OSError as exc:
            self.abort()
            raise storage_error(f"committing {self._final} failed: {exc}", exc) from exc
        except BaseException:
            self.abort()
            raise

    def _publish(self) -> None:
        """Rename the staging dir to the final path; with overwrite, the last writer wins."""
        final = self._final
        for _ in range(_PUBLISH_ATTEMPTS):
            if os.path.lexists(final):
                if not self._overwrite:
                    _check_replaceable(final)  # overwrite=True would not help: say so
                    raise CheckpointExistsError(
                        f"{final} already exists; pass overwrite=True to replace it atomically "
                        "or choose another path"
                    )
                _check_replaceable(final)
                if self._replace(final):
                    return
                continue  # it vanished meanwhile: publish as new
            try:
                ok = _rename2(self._tmp, final, _RENAME_NOREPLACE)
            except FileExistsError:
                if self._overwrite:
                    continue  # created by another writer meanwhile: replace it
                raise CheckpointExistsError(
                    f"{final} was created by someone else while this save ran; "
                    "nothing was replaced"
                ) from None
            if not ok:
                os.rename(self._tmp, final)
            return
        raise StorageError(f"{final} kept changing while this save tried to commit; gave up")

    def _replace(self, final: str) -> bool:
        """Swap the staging dir with ``final``; False if ``final`` disappeared first."""
        try:
            if _rename2(self._tmp, final, _RENAME_EXCHANGE):
                # self._tmp now holds the previous checkpoint
                shutil.rmtree(self._tmp, ignore_errors=True)
                return True
            old = self._tmp + ".old"
            os.rename(final, old)
        except FileNotFoundError:
            return False
        os.rename(self._tmp, final)
        shutil.rmtree(old, ignore_errors=True)
        return True

    def abort(self) -> None:
        if not self._done:
            if self._owner:
                shutil.rmtree(self._tmp, ignore_errors=True)
            self._done = True


def _check_replaceable(path: str) -> None:
    """Only a committed checkpoint or an empty directory may be replaced."""
    if os.path.isdir(path) and not os.path.islink(path):
        if os.path.exists(os.path.join(path, COMMIT_NAME)) or not os.listdir(path):
            return
    what = "a file, " if os.path.isfile(path) and not os.path.islink(path) else ""
    raise CheckpointExistsError(
        f"{path} exists and is {what}not a statestream checkpoint; statestream never "
        "replaces it, not even with overwrite=True (only a committed checkpoint or an empty "
        "directory). Choose another path, or remove it yourself"
    )


_PUBLISH_ATTEMPTS = 100


class LocalStorage:
    """Checkpoints as directories on a local (POSIX) file system.

    A save writes into ``.<name>.tmp-<id>`` next to the final path, fsyncs
    every file and directory, then renames it into place (``renameat2``
    with ``RENAME_NOREPLACE``, or ``RENAME_EXCHANGE`` to replace an existing
    checkpoint atomically).

    Example:
        >>> import tempfile, os
        >>> st = LocalStorage()
        >>> d = tempfile.mkdtemp()
        >>> st.is_committed(os.path.join(d, "ckpt"))
        False
    """

    capabilities = StorageCapabilities(atomic_rename=True, random_write=True)

    def __init__(self, *, direct_io: bool = True) -> None:
        #: Write buffers of 1 MiB or more at page-aligned offsets with O_DIRECT
        #: where the file system allows it (unaligned memory through an 8 MiB
        #: bounce buffer); everything else goes through the page cache.
        self.direct_io = direct_io

    def begin_write(self, path: str, *, overwrite: bool) -> _LocalWriteTransaction:
        path = os.path.abspath(path)
        if os.path.lexists(path):
            if not overwrite:
                _check_replaceable(path)  # overwrite=True would not help: say so
                raise CheckpointExistsError(
                    f"{path} already exists; pass overwrite=True to replace it atomically or "
                    "choose another path"
                )
            _check_replaceable(path)
        try:
            txn = _LocalWriteTransaction(path, overwrite, direct_io=self.direct_io)
        except OSError as exc:
            raise storage_error(f"cannot create a checkpoint under {path}: {exc}", exc) from exc
        try:
            collect_garbage(self, os.path.dirname(path))
        except (OSError, CheckpointError):
            pass  # removing others' garbage is a courtesy; it must not fail this save
        return txn

    def join_write(self, path: str, token: str) -> _LocalWriteTransaction:
        """Write data files into a save another process began (its ``txn.token``)."""
        return _LocalWriteTransaction(os.path.abspath(path), False, join=token,
                                      direct_io=self.direct_io)

    def open_read(self, path: str) -> _LocalReader:
        return _LocalReader(os.path.abspath(path))

    def is_committed(self, path: str) -> bool:
        return os.path.isfile(os.path.join(path, COMMIT_NAME))

    def list(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(path))
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise storage_error(f"listing {path} failed: {exc}", exc) from exc

    def delete(self, path: str) -> None:
        marker = os.path.join(path, COMMIT_NAME)
        try:
            os.unlink(marker)  # uncommit first: a half-deleted checkpoint never loads
            _fsync_dir(path)
            _hooks.fire("delete.uncommitted")
        except FileNotFoundError:
            pass  # no marker: not committed (or half-deleted); the tree goes below
        except OSError as exc:
            raise storage_error(f"deleting {path} failed: {exc}", exc) from exc
        shutil.rmtree(path, ignore_errors=True)

    def acquire_lease(self, path: str, *, holder: str, ttl_s: float) -> _LocalLease:
        """``flock`` on the file ``path``; ``ttl_s`` is not needed (ends with the holder)."""
        return _lock_file(os.path.abspath(path), holder)

    def leftovers(self, parent: str) -> builtins.list[Leftover]:
        parent = os.path.abspath(parent)
        try:
            it = os.scandir(parent)
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as exc:
            raise storage_error(f"listing {parent} failed: {exc}", exc) from exc
        out = []
        with it:
            for e in it:
                m = _STAGING_RE.match(e.name)
                if m is None or not e.is_dir(follow_symlinks=False):
                    continue
                changed = _last_change(e.path)
                if changed is None:
                    continue
                writer = (WriterId(m["host"], int(m["pid"]), int(m["start"]))
                          if m["host"] else None)
                out.append(Leftover(e.path, m["target"], writer, changed))
        return out

    def remove_leftover(self, leftover: Leftover) -> None:
        path = leftover.path
        if not _STAGING_RE.match(os.path.basename(path)) or os.path.islink(path):
            raise StorageError(f"{path} is not a statestream staging directory; not removing it")
        try:
            shutil.rmtree(path)
        except FileNotFoundError:
            pass  # already gone: removing is idempotent
        except OSError as exc:
            raise storage_error(f"removing {path} failed: {exc}", exc) from exc
