"""Local storage, read side: a committed checkpoint opened by fd, regular files only."""

from __future__ import annotations

import errno
import mmap
import os
import stat
import threading
from collections.abc import Sequence

from statestream.errors import (
    CheckpointCorruptError,
    CheckpointGoneError,
    CheckpointNotFoundError,
    TruncatedFileError,
    UnsafeCheckpointError,
    storage_error,
)
from statestream.format import COMMIT_NAME, DATA_DIR, validate_file_name
from statestream.storage._base import Buffer
from statestream.storage._compose import compose
from statestream.storage._hints import not_a_checkpoint_hint
from statestream.storage._iov import preadv_all
from statestream.storage._pagecache import cold_ranges, drop_cached, read_ahead

_KINDS = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO (named pipe)",
          stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a character device",
          stat.S_IFBLK: "a block device", stat.S_IFLNK: "a symbolic link"}


def _missing_reason(path: str) -> str:
    """Why there is no checkpoint directory at ``path`` (it may be a file, a FIFO, a
    device, ...: stat only, nothing there is opened)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return f"no checkpoint at {path}: the directory does not exist"
    if stat.S_ISREG(mode):
        return (
            f"no checkpoint at {path}: it is a file, and a statestream checkpoint is a "
            "directory; the files statestream also reads are safetensors and torch.save "
            "files, recognised by their first bytes, and this is neither"
        )
    what = _KINDS.get(stat.S_IFMT(mode), "a special file")
    return (f"no checkpoint at {path}: it is {what}, not a directory or a regular file "
            "(a checkpoint is one of those); nothing was opened")


def _not_regular(mode: int, where: str) -> UnsafeCheckpointError:
    what = _KINDS.get(stat.S_IFMT(mode), "not a regular file")
    return UnsafeCheckpointError(
        f"cannot open {where} safely: it is {what}, not a regular file; refusing to read it "
        "(the checkpoint is damaged or hostile)"
    )


def open_regular(name: str, dir_fd: int | None, where: str) -> int:
    """Open ``name`` under ``dir_fd`` (an absolute path when None) for reading, only if
    it is a regular file (also the opener of foreign checkpoints' files).

    Never blocks (a FIFO or a device in place of a file would): the entry is
    checked with lstat first, so special files are not even opened, then
    opened with ``O_NONBLOCK | O_NOFOLLOW`` and checked again with fstat (the
    entry may have been swapped in between); ``O_NONBLOCK`` is then cleared.

    Raises:
        FileNotFoundError: nothing is there (the caller words the error).
        UnsafeCheckpointError: a symbolic link, FIFO, directory, device, ...
        StorageError: any other OS error (permissions, I/O).
    """
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode):
            raise _not_regular(st.st_mode, where)
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
                     | os.O_NOCTTY, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafeCheckpointError(
                f"{where} is a symbolic link or lies under one; refusing to follow it out of "
                "the checkpoint"
            ) from None
        raise storage_error(f"cannot open {where}: {exc}", exc) from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _not_regular(st.st_mode, where)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_root(path: str, follow_links: bool) -> int:
    """The checkpoint directory's fd; ``follow_links=False`` refuses a symbolic link
    at ``path`` itself (a base named by a manifest must not lead out of its parent)."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
    try:
        return os.open(path, flags if follow_links else flags | os.O_NOFOLLOW)
    except OSError as exc:
        if not follow_links and os.path.islink(path):
            raise UnsafeCheckpointError(
                f"{path} is a symbolic link; refusing to follow it") from None
        if isinstance(exc, (FileNotFoundError, NotADirectoryError)):
            raise CheckpointNotFoundError(_missing_reason(path)) from None
        raise storage_error(f"cannot open the checkpoint directory {path}: {exc}", exc) from exc


#: How often an open looks again at a path whose checkpoint was replaced meanwhile.
_OPEN_TRIES = 5


def _moved(fd: int, path: str, follow_links: bool) -> str | None:
    """Why the directory ``fd`` (opened at ``path``) is no longer the checkpoint at
    ``path``: it was removed, or ``path`` names another directory now (an overwrite
    swapped one in); None while it is still there (or when that cannot be told)."""
    try:
        held = os.fstat(fd)
        if held.st_nlink == 0:
            return "its directory was removed"
        now = os.stat(path, follow_symlinks=follow_links)
    except FileNotFoundError:
        return "its directory was removed"
    except OSError:
        return None
    if (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino):
        return "its path names another directory now"
    return None


def _open_committed(path: str, follow_links: bool) -> int:
    """The fd of the committed checkpoint directory at ``path``.

    One replaced between the open and the look at its commit marker (an
    overwrite swaps the new one in, then removes the old) is opened again: a
    reader sees the old checkpoint or the new one.
    """
    for _ in range(_OPEN_TRIES):
        fd = _open_root(path, follow_links)
        try:
            os.stat(COMMIT_NAME, dir_fd=fd, follow_symlinks=False)
            return fd
        except FileNotFoundError:
            moved = _moved(fd, path, follow_links)
            os.close(fd)
        except OSError as exc:
            os.close(fd)
            where = os.path.join(path, COMMIT_NAME)
            raise storage_error(f"cannot read {where}: {exc}", exc) from exc
        if moved is None:
            from statestream.storage._local import LocalStorage  # _local imports this module

            hint = not_a_checkpoint_hint(LocalStorage(), path)
            raise CheckpointNotFoundError(
                hint or f"no committed checkpoint at {path}: it has no {COMMIT_NAME} marker (being "
                "deleted, or an interrupted or foreign save?); refusing to load it"
            )
    raise CheckpointNotFoundError(
        f"no committed checkpoint at {path}: it was replaced {_OPEN_TRIES} times while "
        "being opened")


class _LocalReader:
    def __init__(self, path: str, follow_links: bool = True) -> None:
        self.location = path
        self._follow = follow_links
        self._root = _open_committed(path, follow_links)
        self._data: int | None = None
        self._fds: dict[str, int] = {}
        self._sizes: dict[str, int] = {}
        self._maps: dict[str, mmap.mmap] = {}
        self._lock = threading.Lock()

    def _missing(self, where: str, damage: CheckpointCorruptError) -> CheckpointCorruptError:
        """The error for file ``where`` of this checkpoint that is not there: the
        checkpoint was overwritten or deleted since this reader opened it (the
        directory it holds was removed or replaced, or lost its commit marker), else
        ``damage``."""
        why = _moved(self._root, self.location, self._follow)
        if why is None:
            try:
                os.stat(COMMIT_NAME, dir_fd=self._root, follow_symlinks=False)
            except FileNotFoundError:
                why = f"its {COMMIT_NAME} marker was removed"
            except OSError:
                pass  # cannot tell: report what is known
        if why is None:
            return damage
        return CheckpointGoneError(
            f"{where} is gone: {self.location} was overwritten or deleted while being read "
            f"({why}); load it again")

    def _open(self, name: str) -> int:
        fd = self._fds.get(name)
        if fd is not None:
            return fd
        with self._lock:
            fd = self._fds.get(name)
            if fd is not None:
                return fd
            validate_file_name(name)
            where = os.path.join(self.location, name)
            try:
                if self._data is None:
                    self._data = os.open(
                        DATA_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                        dir_fd=self._root,
                    )
            except FileNotFoundError:
                raise self._missing(where, TruncatedFileError(
                    f"data file {where} is missing (so is {DATA_DIR}/); the checkpoint is "
                    "damaged")) from None
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise UnsafeCheckpointError(
                        f"{os.path.join(self.location, DATA_DIR)} is a symbolic link or not a "
                        f"directory; refusing to read {name} through it"
                    ) from None
                raise storage_error(f"cannot open {where}: {exc}", exc) from exc
            try:
                fd = open_regular(name[len(DATA_DIR) + 1 :], self._data, where)
            except FileNotFoundError:
                raise self._missing(where, TruncatedFileError(
                    f"data file {where} is missing; the checkpoint is damaged")) from None
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            except OSError:
                pass  # a read-ahead hint only; reads work without it
            self._fds[name] = fd
            return fd

    def read_bytes(self, name: str, max_bytes: int) -> bytes:
        where = os.path.join(self.location, name)
        if "/" in name or name in ("", ".", ".."):
            raise UnsafeCheckpointError(f"refusing to read {name!r} outside the checkpoint")
        try:
            fd = open_regular(name, self._root, where)
        except FileNotFoundError:
            raise self._missing(where, CheckpointCorruptError(
                f"{where} is missing; the checkpoint is damaged")) from None
        try:
            size = os.fstat(fd).st_size
            if size > max_bytes:
                raise CheckpointCorruptError(
                    f"{where} is {size} bytes, over the {max_bytes}-byte limit"
                )
            buf = bytearray(size)
            try:
                got = os.preadv(fd, [buf], 0) if size else 0
            except OSError as exc:
                raise storage_error(f"reading {where} failed: {exc}", exc) from exc
            if got != size:
                raise TruncatedFileError(f"{where} changed while being read")
            return bytes(buf)
        finally:
            os.close(fd)

    def file_size(self, name: str) -> int:
        size = self._sizes.get(name)
        if size is None:
            size = os.fstat(self._open(name)).st_size
            self._sizes[name] = size
        return size

    def map_range(self, name: str, offset: int, nbytes: int) -> memoryview | None:
        """A private (copy-on-write) mapping of a checked range of a data file.

        The whole file is mapped once (its size checked first, so no page of the
        range lies past its end); the views keep the mapping alive after
        :meth:`close`. A file truncated by someone else *after* this check makes
        touching the lost pages fail with SIGBUS, as with any mapped file.
        """
        self._check_range(name, offset, nbytes)
        mm = self._maps.get(name)
        if mm is None:
            with self._lock:
                mm = self._maps.get(name)
                if mm is None:
                    try:
                        mm = mmap.mmap(self._open(name), self.file_size(name),
                                       flags=mmap.MAP_PRIVATE,
                                       prot=mmap.PROT_READ | mmap.PROT_WRITE)
                    except (OSError, ValueError):
                        return None  # e.g. a file system without mmap: read it instead
                    self._maps[name] = mm
        return memoryview(mm)[offset:offset + nbytes]

    def cold_ranges(self, name: str, offset: int, nbytes: int) -> list[tuple[int, int]]:
        """Byte ranges of ``[offset, offset + nbytes)`` of ``name`` not in the page cache
        (empty when all are, or when the system does not say)."""
        return cold_ranges(self._open(name), offset, nbytes)

    def drop_cached(self, name: str, ranges: list[tuple[int, int]], lo: int, hi: int) -> None:
        """Let the page cache drop the pages of ``ranges`` (from :meth:`cold_ranges`)
        within ``[lo, hi)``: bytes a load read in and has copied and checked."""
        drop_cached(self._open(name), ranges, lo, hi)

    def read_ahead(self, name: str, offset: int, nbytes: int) -> None:
        """Start reading ``[offset, offset + nbytes)`` of ``name`` into the page cache
        (a hint; returns once the reads are queued)."""
        read_ahead(self._open(name), offset, nbytes)

    def _check_range(self, name: str, offset: int, nbytes: int) -> None:
        """Refuse a range the file does not hold (before mapping it: no page of a mapped
        range may lie past the end of its file)."""
        size = self.file_size(name)
        if offset + nbytes > size:
            raise TruncatedFileError(
                f"data file {os.path.join(self.location, name)} is {size} bytes, but the "
                f"manifest puts data up to byte {offset + nbytes} in it; it is truncated")

    def map_ranges(self, ranges: Sequence[tuple[str, int, int]]) -> memoryview | None:
        """One private mapping of ``(name, offset, nbytes)`` ranges of data files placed
        back to back (an array whose row blocks lie in several files), or None when they
        cannot be mapped so (then read them). Offsets must be page-aligned, and every
        range but the last a whole number of pages (:mod:`._compose`).

        Raises:
            TruncatedFileError: a file is missing or shorter than its range.
        """
        fds = []
        for name, offset, nbytes in ranges:
            self._check_range(name, offset, nbytes)
            fds.append((self._open(name), offset, nbytes))
        try:
            return compose(fds)
        except (OSError, ValueError):
            return None

    def list_files(self) -> list[str]:
        """Every entry of the checkpoint (``data/`` entries as ``data/<name>``), unsorted.

        Nothing is followed or opened but the two directories; special files
        and subdirectories are listed like files (``verify`` reports them).
        """
        out: list[str] = []
        try:
            with os.scandir(self._root) as it:
                top = [e.name for e in it]
            for n in top:
                if n != DATA_DIR:
                    out.append(n)
                    continue
                try:
                    fd = os.open(DATA_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
                                 | os.O_CLOEXEC, dir_fd=self._root)
                except OSError:
                    out.append(n)  # a symlink or a file in place of data/: listed as is
                    continue
                with os.scandir(fd) as it:
                    out.extend(f"{DATA_DIR}/{e.name}" for e in it)
                os.close(fd)
        except OSError as exc:
            raise storage_error(f"cannot list {self.location}: {exc}", exc) from exc
        return out

    def read_into(self, name: str, offset: int, buffers: Sequence[Buffer]) -> None:
        fd = self._open(name)
        try:
            end = preadv_all(fd, buffers, offset)
        except OSError as exc:
            raise storage_error(f"reading {self.location}/{name} failed: {exc}", exc) from exc
        if end is not None:
            raise TruncatedFileError(
                f"data file {os.path.join(self.location, name)} ends at byte {end}, "
                "before the data the manifest lists; the checkpoint is truncated"
            )

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
            self._maps.clear()  # arrays built on a mapping keep it alive
            if self._data is not None:
                os.close(self._data)
                self._data = None
            if self._root >= 0:
                os.close(self._root)
                self._root = -1
