"""Opening a checkpoint: the commit marker and verified manifest, native or foreign."""

from __future__ import annotations

import os

from statestream.engine import follow_bases, read_manifest
from statestream.format import MAX_ARRAYS, Manifest, check_max_arrays
from statestream.interop import FileSetReader, open_foreign
from statestream.plan import ReadRequest
from statestream.storage import CheckpointReader, storage_for
from statestream.tree import Key, KeyPath, Node, format_keypath

__all__ = ["array_paths", "open_checkpoint", "read_manifest", "skip_missing_checksums"]


def array_paths(node: Node, p: KeyPath, out: dict[int, KeyPath]) -> None:
    """Fill ``out`` with the key path of every array leaf under ``node``."""
    if node.array is not None:
        out.setdefault(node.array, p)  # an alias (tied weights) names the same array
    kids = node.children or []
    if node.kind == "stateful":
        for c in kids:
            array_paths(c, p, out)
        return
    keys: list[Key] = list(node.keys) if node.keys is not None else list(range(len(kids)))
    for k, c in zip(keys, kids):
        array_paths(c, p + (k,), out)


def skip_missing_checksums(reader: CheckpointReader, requests: list[ReadRequest]) -> None:
    """Foreign formats carry no checksums: their reads check sizes and bounds only."""
    if isinstance(reader, FileSetReader):
        for r in requests:
            for p in r.pieces:
                p.verify = []


def has_checksums(reader: CheckpointReader | None) -> bool:
    """Whether ``reader``'s chunks carry checksums (not a foreign format's)."""
    return not isinstance(reader, FileSetReader)


def open_checkpoint(path: str | os.PathLike[str], *, allow_pickle: bool = False,
                    follow: bool = True, max_arrays: int = MAX_ARRAYS,
                    ) -> tuple[CheckpointReader, Manifest]:
    """Open the committed checkpoint at ``path`` and read its verified manifest.

    A foreign checkpoint (safetensors, ...; see docs/interop.md) is recognised
    by its content and comes back as a manifest its parser built
    (``allow_pickle``: see torch.save files there).

    ``follow``: an incremental checkpoint's references to its bases are
    checked against the bases and resolved (the reader reads the bases'
    files; the manifest's chunks are all plain). Without it the manifest
    comes back as stored, references and all (``metadata``).

    ``max_arrays``: refuse (CheckpointError) a checkpoint of more arrays, a manifest
    before its entries are built; each base's manifest too (with ``follow``).
    """
    foreign = open_foreign(path, allow_pickle=allow_pickle)
    if foreign is not None:
        try:
            check_max_arrays(len(foreign.manifest.arrays), max_arrays, foreign.reader.location)
        except BaseException:
            foreign.reader.close()
            raise
        return foreign.reader, foreign.manifest
    storage, spath = storage_for(path)
    reader = storage.open_read(spath)
    try:
        m = read_manifest(reader, max_arrays)
        if not follow or not m.bases:
            return reader, m
        paths: dict[int, KeyPath] = {}
        array_paths(m.tree, (), paths)
        return follow_bases(storage, spath, reader, m,
                            lambda i: format_keypath(paths.get(i, ())), max_arrays)
    except BaseException:
        reader.close()
        raise
