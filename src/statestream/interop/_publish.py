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
from statestream.interop._dcp import METADATA_NAME, looks_like_dcp
from statestream.interop._orbax import looks_like_orbax
from statestream.interop._orbax_meta import orbax_strays
from statestream.interop._safetensors import find_single, index_shards
from statestream.storage import staging_dir, storage_for
from statestream.storage._local import (
    SwapBackFailed,
    exchange_paths,
    fsync_dir,
    refuse_inside_checkpoint,
    remove_replaced,
    sync_or_swap_back,
)

__all__ = ["checkpoint_strays", "claim", "holds_checkpoint", "publish", "staging_path",
           "writing"]


def staging_path(final: str) -> str:
    """Where a conversion to ``final`` is written before it is moved into place: a
    directory with the umask's mode (a published shard directory is readable as any
    other), that ``statestream gc`` removes when the conversion was killed. Missing
    parent directories of ``final`` are made, as a save makes them."""
    with writing(final):
        os.makedirs(os.path.dirname(os.path.abspath(final)), exist_ok=True)
        return staging_dir(final)


def holds_checkpoint(path: str) -> bool:
    """An empty directory, or one holding a checkpoint statestream reads and nothing else."""
    return checkpoint_strays(path) == []


def checkpoint_strays(path: str) -> list[str] | None:
    """The entries of directory ``path`` that are not its checkpoint's, sorted; None when
    it holds no checkpoint statestream reads.

    Nothing is a stray in an empty directory or a statestream checkpoint (``COMMITTED``:
    replaced whole, as a save replaces it). Otherwise the format is decided as
    ``detect_format`` decides it, and its files are: the safetensors indexes and the
    shards their ``weight_map`` names (every ``*.safetensors`` file, when an index cannot
    be read); DCP's ``.metadata`` and ``*.distcp`` files; an Orbax checkpoint's own
    entries (``orbax_strays``); a model directory's one ``*.safetensors`` file. A Hugging
    Face model directory's ``config.json`` or tokenizer is a stray: replacing the
    directory would delete it (it did, before 2026-12-08).
    """
    try:
        names = os.listdir(path)
    except OSError:  # not a readable directory: the caller's own check says what it is
        return None
    if not names or COMMIT_NAME in names:
        return []
    indexes = [n for n in names if n.endswith(".safetensors.index.json")]
    if indexes:
        own = set(indexes)
        for index in indexes:
            shards = index_shards(os.path.join(path, index))
            own |= shards if shards is not None else {
                n for n in names if n.endswith(".safetensors")}
    elif looks_like_dcp(path):
        own = {n for n in names if n == METADATA_NAME or n.endswith(".distcp")}
    elif looks_like_orbax(path):
        return orbax_strays(path)
    else:
        one = find_single(path)
        if one is None:
            return None
        own = {os.path.basename(one)}
    return sorted(set(names) - own)


def claim(final: str, overwrite: bool, *, directory: bool) -> None:
    """Refuse an existing ``final`` unless ``overwrite``, and even then anything the
    output (a ``directory`` or a file) should not replace: a directory by a file, a
    file by a directory, or a directory holding something other than a checkpoint, or
    more than one (publishing renames the output over it and removes what it held); nor
    a path inside a statestream checkpoint (replaced or deleted whole, taking the output
    along), nor a symbolic link."""
    refuse_inside_checkpoint(os.path.abspath(final))
    _refuse_a_link(final)
    if not os.path.lexists(final):
        return
    if not overwrite:
        raise CheckpointExistsError(
            f"{final} already exists; pass overwrite=True to replace it")
    is_dir = os.path.isdir(final) and not os.path.islink(final)
    strays = checkpoint_strays(final) if is_dir and directory else None
    if is_dir == directory and (not is_dir or strays == []):
        if is_dir:  # a statestream checkpoint that incremental siblings refer to stays
            refuse_replacing_a_base(storage_for(final)[0], final, overwrite)
        return
    out = "a directory" if directory else "one file"
    if strays:
        shown = ", ".join(f"{n!r:.80}" for n in strays[:5])
        more = f" and {len(strays) - 5} more" if len(strays) > 5 else ""
        raise CheckpointExistsError(
            f"{final} exists and holds {shown}{more} beside its checkpoint, which replacing "
            f"it would delete; this conversion writes {out} and never replaces such a "
            "directory, not even with overwrite=True (only a directory holding a checkpoint "
            "and nothing else, or an empty one). Choose another path, or move them out")
    what = ("a directory that is neither empty nor a checkpoint" if is_dir == directory
            else "a directory" if is_dir else "a file")
    raise CheckpointExistsError(
        f"{final} exists and is {what}; this conversion writes {out} and never replaces "
        "it, not even with overwrite=True (only a file by a file, or an empty or "
        "checkpoint directory by a directory). Choose another path, or remove it yourself")


def _refuse_a_link(final: str) -> None:
    """A symbolic link is never replaced, with or without overwrite, as a save never
    replaces one: publishing would replace the link, not what it points to. (A link to a
    checkpoint directory was told to pass overwrite=True, which then called it 'a file';
    a file output replaced a link to a file by the file.)"""
    try:
        target = os.readlink(final)
    except OSError:  # not a link (or gone): the other checks say what it is
        return
    raise CheckpointExistsError(
        f"{final} exists and is a symbolic link (to {target}); a conversion never replaces "
        "a link, not even with overwrite=True (it would replace the link, not what it "
        "points to). Convert to the path it points to, or remove the link yourself")


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
