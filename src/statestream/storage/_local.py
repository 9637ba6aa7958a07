"""Local POSIX storage: pwritev/preadv from worker threads, commit by rename."""

from __future__ import annotations

import builtins
import contextlib
import ctypes
import errno
import os
import shutil
import warnings
from typing import Any

from statestream import _hooks
from statestream.errors import (
    CheckpointError,
    CheckpointExistsError,
    StorageError,
    storage_error,
)
from statestream.format import COMMIT_NAME, DATA_DIR, MANIFEST_NAME
from statestream.storage._base import (
    Leftover,
    LeftoverKeptError,
    StorageCapabilities,
    WriterId,
    check_member_name,
)
from statestream.storage._leftovers import collect_garbage
from statestream.storage._local_lease import (
    _STAGING_RE,
    _last_change,
    _LocalLease,
    _lock_file,
    _staging_name,
)
from statestream.storage._local_read import _LocalReader
from statestream.storage._local_write import _LocalFileWriter

__all__ = [
    "LocalStorage",
    "SwapBackFailed",
    "exchange_paths",
    "fsync_dir",
    "remove_replaced",
    "sync_or_swap_back",
]

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


def exchange_paths(a: str, b: str) -> bool:
    """Swap two existing paths in one atomic rename (renameat2 RENAME_EXCHANGE); False
    where the kernel or file system does not support it (nothing was changed)."""
    return _rename2(a, b, _RENAME_EXCHANGE)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class SwapBackFailed(Exception):
    """:func:`sync_or_swap_back` could neither make the swap durable nor undo it: the
    path holds the new output, which may not survive a crash."""

    def __init__(self, cause: BaseException, error: OSError) -> None:
        super().__init__(f"{cause}; swapping back: {error}")
        #: why the swap could not be made durable; why it could not be undone
        self.cause, self.error = cause, error


def sync_or_swap_back(staged: str, final: str, old: str | None) -> None:
    """Make the move of ``staged`` to ``final`` durable (fsync the parent), or undo it.

    ``old`` is where what ``final`` held lies now: ``staged`` itself after an exchange
    (:func:`exchange_paths`), a path it was renamed to, or None (nothing was there). If
    the sync fails (or is interrupted) the new output goes back to ``staged`` and the
    old one back to ``final``, and the sync's error is raised; :class:`SwapBackFailed`
    if undoing fails too. The one mechanism of a save's commit and a conversion's
    publication: neither may raise with the new output in place and the old removed."""
    try:
        fsync_dir(os.path.dirname(os.path.abspath(final)))
    except BaseException as cause:  # an interrupt too: the caller raises, so undo
        try:
            if old == staged:  # exchanged: exchange back
                if not _rename2(staged, final, _RENAME_EXCHANGE):
                    raise OSError(errno.ENOTSUP, "renameat2 refused the exchange back", final)
            else:
                os.rename(final, staged)
                if old is not None:
                    os.rename(old, final)
        except OSError as exc:
            raise SwapBackFailed(cause, exc) from exc
        raise


def remove_replaced(old: str | None) -> None:
    """Remove what a durable swap replaced (a directory or a file; None: nothing)."""
    if old is not None and os.path.isdir(old) and not os.path.islink(old):
        shutil.rmtree(old, ignore_errors=True)
    elif old is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(old)


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
        #: where the checkpoint an overwrite replaced lies until the commit is durable
        self._displaced: str | None = None

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
            fsync_dir(os.path.join(self._tmp, DATA_DIR))
            fsync_dir(self._tmp)
            self._publish()
            self._sync_published()
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
        remove_replaced(self._displaced)  # the checkpoint this one replaced, durably

    def _sync_published(self) -> None:
        """Make the rename durable, else put back what the path held (``abort`` then
        removes the new checkpoint from staging).

        A save that raises has committed nothing: a failed fsync here once left the new
        checkpoint published (and, with overwrite, the old one deleted) under an error
        saying the commit failed. Only once the parent is synced is the replaced
        checkpoint removed."""
        final, old = self._final, self._displaced
        try:
            sync_or_swap_back(self._tmp, final, old)
        except SwapBackFailed as exc:
            self._done = True  # the path holds this save's checkpoint: abort keeps it
            where = (f"; the checkpoint it replaced is at {old}"
                     if old is not None and old != self._tmp else "")
            raise StorageError(
                f"committing {final} failed after it was published (syncing its directory: "
                f"{exc.cause}) and putting back what it held failed too ({exc.error}): "
                f"{final} holds this save's checkpoint, which may not survive a crash"
                f"{where}") from exc.error
        except BaseException:
            self._displaced = None  # put back at the path
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
        """Swap the staging dir with ``final``; False if ``final`` disappeared first.

        The previous checkpoint is left at :attr:`_displaced` until the swap is durable."""
        try:
            if _rename2(self._tmp, final, _RENAME_EXCHANGE):
                self._displaced = self._tmp  # which now holds the previous checkpoint
                return True
            old = self._tmp + ".old"
            os.rename(final, old)
        except FileNotFoundError:
            return False
        os.rename(self._tmp, final)
        self._displaced = old
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
    if os.path.islink(path):  # it said "not a statestream checkpoint" of a link to one
        raise CheckpointExistsError(
            f"{path} exists and is a symbolic link (to {os.readlink(path)}); statestream "
            "never replaces a link, not even with overwrite=True (a save would replace the "
            "link, not what it points to). Save to the path it points to, or remove the "
            "link yourself")
    what = "a file, " if os.path.isfile(path) else ""
    raise CheckpointExistsError(
        f"{path} exists and is {what}not a statestream checkpoint; statestream never "
        "replaces it, not even with overwrite=True (only a committed checkpoint or an empty "
        "directory). Choose another path, or remove it yourself"
    )


_PUBLISH_ATTEMPTS = 100


def _file_above(path: str) -> str | None:
    """The nearest parent of ``path`` that exists and is not a directory, if any (a
    checkpoint's parent directories cannot be made through it)."""
    parent = os.path.dirname(path)
    while parent and parent != os.path.dirname(parent):
        if os.path.lexists(parent):
            return None if os.path.isdir(parent) else parent
        parent = os.path.dirname(parent)
    return None


def checkpoint_above(path: str) -> str | None:
    """The nearest parent directory of ``path`` that is a committed checkpoint (its
    commit marker and manifest there), if any."""
    parent = os.path.dirname(path)
    while parent and parent != os.path.dirname(parent):
        if (os.path.isfile(os.path.join(parent, COMMIT_NAME))
                and os.path.isfile(os.path.join(parent, MANIFEST_NAME))):
            return parent
        parent = os.path.dirname(parent)
    return None


def refuse_inside_checkpoint(path: str) -> None:
    """Raise where ``path`` lies inside a committed checkpoint: a checkpoint's directory
    is replaced or deleted whole (``overwrite=True``, a keep policy), and what was saved
    inside it went with it, without a word. Before 2026-12-07 such saves (and a
    ``CheckpointManager`` opened on a checkpoint) went through."""
    above = checkpoint_above(path)
    if above is not None:
        raise CheckpointExistsError(
            f"cannot write {path}: it lies inside the checkpoint {above}, whose directory "
            "is replaced or deleted whole (overwrite=True, a keep policy), taking it along; "
            "choose a path outside it")


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
        refuse_inside_checkpoint(path)
        try:
            txn = _LocalWriteTransaction(path, overwrite, direct_io=self.direct_io)
        except OSError as exc:
            blocker = _file_above(path)
            why = (f"{blocker} is a file, not a directory" if blocker is not None
                   else str(exc))
            raise storage_error(f"cannot create a checkpoint under {path}: {why}",
                                exc) from exc
        try:
            collect_garbage(self, os.path.dirname(path))
        except (OSError, CheckpointError):
            pass  # removing others' garbage is a courtesy; it must not fail this save
        return txn

    def join_write(self, path: str, token: str) -> _LocalWriteTransaction:
        """Write data files into a save another process began (its ``txn.token``)."""
        return _LocalWriteTransaction(os.path.abspath(path), False, join=token,
                                      direct_io=self.direct_io)

    def open_read(self, path: str, *, follow_links: bool = True) -> _LocalReader:
        return _LocalReader(os.path.abspath(path), follow_links)

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
        """Uncommit, then remove the tree. A symbolic link (a checkpoint linked in from
        elsewhere) is removed as a link: what it points to is not this path's to
        delete. A file that is not a directory is refused (NotADirectoryError). A tree
        that cannot be removed whole raises (StorageError), uncommitted: before
        2026-12-06 that was ignored, and what was left stayed on disk, unreported."""
        try:
            if os.path.islink(path):
                os.unlink(path)
                fsync_dir(os.path.dirname(os.path.abspath(path)))
                return
            if os.path.lexists(path) and not os.path.isdir(path):
                raise NotADirectoryError(errno.ENOTDIR, "a file, not a checkpoint directory")
        except FileNotFoundError:
            return
        except OSError as exc:
            raise storage_error(f"deleting {path} failed: {exc}", exc) from exc
        marker = os.path.join(path, COMMIT_NAME)
        try:
            os.unlink(marker)  # uncommit first: a half-deleted checkpoint never loads
            fsync_dir(path)
            _hooks.fire("delete.uncommitted")
        except FileNotFoundError:
            pass  # no marker: not committed (or half-deleted); the tree goes below
        except OSError as exc:
            raise storage_error(f"deleting {path} failed: {exc}", exc) from exc
        try:
            shutil.rmtree(path)
        except FileNotFoundError:
            pass  # removed meanwhile (by another deleter)
        except OSError as exc:  # uncommitted already: what is left never loads, and says so
            raise storage_error(f"deleting {path} failed after it was uncommitted, part of "
                                f"it is left: {exc}", exc) from exc

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

    def remove_leftover(self, leftover: Leftover) -> str | None:
        path = leftover.path
        if not _STAGING_RE.match(os.path.basename(path)) or os.path.islink(path):
            raise LeftoverKeptError(f"{path} is not a statestream staging directory; "
                                    "not removing it")
        if path.endswith(".old") and _restore_replaced(path, leftover.target):
            return os.path.join(os.path.dirname(path), leftover.target)
        try:
            shutil.rmtree(path)
        except FileNotFoundError:
            pass  # already gone: removing is idempotent
        except OSError as exc:
            raise storage_error(f"removing {path} failed: {exc}", exc) from exc
        return None


def _restore_replaced(path: str, target: str) -> bool:
    """Put back the checkpoint an overwrite moved aside (``<staging>.old``) if it is
    committed and nothing took its place: an overwrite without renameat2 renames the
    old checkpoint away, then the new one in; a kill between the two left no
    checkpoint at the path, and removing both staging areas lost every copy. The
    overwrite did not commit, so the old checkpoint is the one restored."""
    final = os.path.join(os.path.dirname(path), target)
    if os.path.lexists(final) or not os.path.isfile(os.path.join(path, COMMIT_NAME)):
        return False
    try:
        if not _rename2(path, final, _RENAME_NOREPLACE):
            os.rename(path, final)
        fsync_dir(os.path.dirname(path))
    except FileExistsError:
        return False  # a new checkpoint took the path meanwhile: this one is garbage
    except OSError as exc:
        raise storage_error(f"restoring {final} from {path} failed: {exc}", exc) from exc
    warnings.warn(f"restored {final} from {path}: an overwrite was killed while replacing it "
                  "and the path held no checkpoint", RuntimeWarning, stacklevel=3)
    return True
