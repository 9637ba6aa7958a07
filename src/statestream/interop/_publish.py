"""Where a conversion writes its output before it is in place, what it may replace,
and the move into place (:func:`publish`)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from statestream.engine._refs import refuse_replacing_a_base
from statestream.errors import (
    CheckpointError,
    CheckpointExistsError,
    StorageError,
    storage_error,
)
from statestream.format import COMMIT_NAME
from statestream.interop._dcp import looks_like_dcp
from statestream.interop._orbax import looks_like_orbax
from statestream.interop._safetensors import find_index, find_single
from statestream.storage import staging_dir, storage_for
from statestream.storage._local import (
    SwapBackFailed,
    exchange_paths,
    fsync_dir,
    refuse_inside_checkpoint,
    remove_replaced,
    sync_or_swap_back,
)

__all__ = ["claim", "holds_checkpoint", "publish", "staging_path", "writing"]


def staging_path(final: str) -> str:
    """Where a conversion to ``final`` is written before it is moved into place: a
    directory with the umask's mode (a published shard directory is readable as any
    other), that ``statestream gc`` removes when the conversion was killed. Missing
    parent directories of ``final`` are made, as a save makes them."""
    with writing(final):
        os.makedirs(os.path.dirname(os.path.abspath(final)), exist_ok=True)
        return staging_dir(final)


def holds_checkpoint(path: str) -> bool:
    """An empty directory, or one holding a checkpoint statestream reads."""
    if not os.listdir(path) or os.path.exists(os.path.join(path, COMMIT_NAME)):
        return True
    try:
        return (find_index(path) is not None or looks_like_dcp(path) or looks_like_orbax(path)
                or find_single(path) is not None)
    except CheckpointError:  # several safetensors indexes: shards all the same
        return True


def claim(final: str, overwrite: bool, *, directory: bool) -> None:
    """Refuse an existing ``final`` unless ``overwrite``, and even then anything the
    output (a ``directory`` or a file) should not replace: a directory by a file, a
    file by a directory, or a directory holding something other than a checkpoint
    (publishing renames the output over it and removes what it held); nor a path inside
    a statestream checkpoint (replaced or deleted whole, taking the output along)."""
    refuse_inside_checkpoint(os.path.abspath(final))
    if not os.path.lexists(final):
        return
    if not overwrite:
        raise CheckpointExistsError(
            f"{final} already exists; pass overwrite=True to replace it")
    is_dir = os.path.isdir(final) and not os.path.islink(final)
    if is_dir == directory and (not is_dir or holds_checkpoint(final)):
        if is_dir:  # a statestream checkpoint that incremental siblings refer to stays
            refuse_replacing_a_base(storage_for(final)[0], final, overwrite)
        return
    what = ("a directory that is neither empty nor a checkpoint" if is_dir == directory
            else "a directory" if is_dir else "a file")
    out = "a directory" if directory else "one file"
    raise CheckpointExistsError(
        f"{final} exists and is {what}; this conversion writes {out} and never replaces "
        "it, not even with overwrite=True (only a file by a file, or an empty or "
        "checkpoint directory by a directory). Choose another path, or remove it yourself")


@contextlib.contextmanager
def writing(path: str) -> Iterator[None]:
    """A file system failure (ENOSPC, EIO, EACCES) while writing ``path`` raised as a
    ``StorageError`` naming it, with its errno (a bare OSError named no file)."""
    try:
        yield
    except CheckpointError:
        raise
    except OSError as exc:
        raise storage_error(f"writing {path} failed: {exc}", exc) from exc


def publish(staged: str, final: str) -> None:
    """Move the finished file or directory into place (replacing an old one), durably.

    The output replaces the old one in one atomic swap (renameat2 RENAME_EXCHANGE):
    before 2026-12-06 a directory was renamed aside first, so a kill between the two
    renames left no ``final`` (the new output in a staging directory that ``gc``
    removes, the old one under ``final.old-<pid>``); where the file system has no
    renameat2 that window remains (a file is replaced by ``os.replace``). A staged
    directory's entries are made durable before it moves (its files are fsynced by
    their writers). The old output is removed only once the parent directory is
    synced; if that fails, the swap is undone and the conversion raises, having
    replaced nothing (it used to raise with the new output in place and the old one
    deleted)."""
    with writing(final):
        if os.path.isdir(staged) and not os.path.islink(staged):
            fsync_dir(staged)
        old = _swap_in(staged, final)
        try:
            sync_or_swap_back(staged, final, old)
        except SwapBackFailed as exc:
            kept = f"; the output it replaced is at {old}" if old not in (None, staged) else ""
            raise StorageError(
                f"publishing {final} failed after the rename, and putting back what it held "
                f"failed too ({exc.error}): {final} holds the new output, which may not "
                f"survive a crash{kept}") from exc.error
        remove_replaced(old)


def _swap_in(staged: str, final: str) -> str | None:
    """``staged`` moved to ``final``; where what ``final`` held lies now (None: nothing
    kept, or nothing was there)."""
    if os.path.lexists(final) and exchange_paths(staged, final):
        return staged  # which holds the old output now
    if os.path.isdir(final) and not os.path.islink(final):
        old = final + f".old-{os.getpid()}"
        os.rename(final, old)
        os.rename(staged, final)
        return old
    os.replace(staged, final)  # a file, or nothing there: one atomic rename
    return None
