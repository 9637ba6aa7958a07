"""``save``: one blocking call of the engine's save job (see ``engine/_job.py``)."""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from typing import Any

from statestream.api._options import (
    bool_option,
    collective_option,
    io_options,
    key_paths,
    memory_options,
    meta_option,
    path_arg,
    path_option,
    progress_option,
)
from statestream.distributed import Collective, default_collective
from statestream.engine import (
    CompressionOption,
    CompressionPolicy,
    IOOptions,
    MemoryOptions,
    Progress,
    SaveOptions,
    run_save,
)

__all__ = ["save"]


def save(
    path: str | os.PathLike[str],
    state: Any,
    *,
    overwrite: bool = False,
    pickle_paths: Collection[str] = (),
    io: IOOptions | None = None,
    memory: MemoryOptions | None = None,
    collective: Collective | None = None,
    progress: Progress | None = None,
    meta: Mapping[str, Any] | None = None,
    compression: CompressionOption = None,
    base: str | os.PathLike[str] | None = None,
    hashes: bool = False,
    node_local: bool = False,
) -> None:
    """Save ``state`` as a checkpoint at ``path``, atomically.

    Saves run one at a time in a process (a ``save_async`` in flight is waited for).

    Args:
        path: a directory path (it must not exist unless ``overwrite``).
        state: nested dict/list/tuple/namedtuple/dataclass/JAX pytree of
            arrays (NumPy, torch, JAX), plain values and objects with
            ``state_dict()``/``load_state_dict()``. Top-level keys are the
            checkpointables that ``load(items=...)`` selects.
        overwrite: replace an existing checkpoint atomically (the old one
            stays loadable until the new one is committed); refused while
            an incremental sibling refers to its chunks.
        pickle_paths: key paths (``"a/b"``) whose otherwise unsupported
            values may be pickled; loading them needs ``load``'s ``allow_pickle``
            to cover them (those key paths, e.g. ``["a/b"]``, or ``True``).
        io: thread count and chunk sizes.
        memory: the host staging budget.
        collective: how processes agree; by default torch.distributed when a
            process group is initialised, multi-process JAX when running, else
            one process. Every process of the collective must call ``save``.
        progress: called as ``progress(bytes_done, bytes_total)`` while writing.
        meta: small JSON-able user metadata (under 1 MiB of JSON, nested at
            most 64 levels), stored in the manifest (``metadata(path).meta["user"]``).
        compression: compress arrays chunk by chunk (format v2): ``"zstd"``
            or an :class:`~statestream.Compression` for every array, or a dict
            of key-path patterns to those or ``None`` (``{"opt/**": "zstd",
            "params/**": None}``; ``*`` within a key, ``**`` across keys, a
            pattern covers its subtree, the last match decides; an array under
            several key paths, stored once, by its first). Floating-point
            arrays are byte-shuffled first by default. A chunk that does not
            shrink is stored raw. Default: nothing compressed (format v1).
        base: an incremental save (format v2): a committed checkpoint in the
            same parent directory as ``path``. Every chunk is hashed
            (XXH3-128) while it is written; a chunk whose bytes equal a hashed
            chunk of ``base`` is not written again, the manifest refers to it
            (to the checkpoint that holds its bytes). Loading the new
            checkpoint needs those checkpoints (``metadata(path).bases``).
        hashes: record every chunk's hash, so that this checkpoint can be a
            later save's ``base`` (implied by ``base``; format v2).
        node_local: ``path`` is on each node's own disk, not shared: every
            node commits its own copy, holding the manifest and the data files
            of its own processes (a ``CheckpointManager`` local tier, see
            docs/manager.md). One process: no difference.

    Raises:
        UnsupportedTypeError: a leaf cannot be saved (the key path is named);
            nothing is written.
        CheckpointExistsError: ``path`` exists and ``overwrite`` is false.
        CheckpointError: ``base`` is missing, not committed or not a sibling (also when
            removed before this save commits); or ``overwrite`` would replace a base.
        StorageError: the file system failed; nothing is committed.

    Example:
        >>> import numpy as np, tempfile, os, statestream as ss
        >>> d = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> ss.save(d, {"w": np.arange(3.0), "step": 7})
        >>> ss.load(d)["step"]
        7
    """
    run_save(path_arg(path, "path"), state, save_options(
        overwrite=overwrite, pickle_paths=pickle_paths, io=io, memory=memory,
        collective=collective, progress=progress, meta=meta, compression=compression,
        base=base, hashes=hashes, node_local=node_local))


def save_options(*, overwrite: bool, pickle_paths: Collection[str], io: IOOptions | None,
                 memory: MemoryOptions | None, collective: Collective | None,
                 progress: Progress | None, meta: Mapping[str, Any] | None,
                 compression: CompressionOption = None,
                 base: str | os.PathLike[str] | None = None,
                 hashes: bool = False,
                 node_local: bool = False) -> SaveOptions:
    """The engine's options for a save, with the defaults filled in."""
    return SaveOptions(
        overwrite=bool_option(overwrite, "overwrite"),
        pickle_paths=key_paths(pickle_paths, "pickle_paths") or (),
        io=io_options(io), memory=memory_options(memory),
        collective=(collective_option(collective) if collective is not None
                    else default_collective()),
        progress=progress_option(progress), user_meta=meta_option(meta),
        compression=CompressionPolicy(compression), base=path_option(base, "base"),
        hashes=bool_option(hashes, "hashes"),
        node_local=bool_option(node_local, "node_local"))


