"""Opening a checkpoint: the commit marker and verified manifest, native or foreign."""

from __future__ import annotations

import os

from statestream.errors import CheckpointCorruptError
from statestream.format import (
    COMMIT_NAME,
    MANIFEST_NAME,
    MAX_COMMIT_BYTES,
    MAX_MANIFEST_BYTES,
    Manifest,
    checksum,
    decode_commit,
    decode_manifest,
)
from statestream.interop import FileSetReader, open_foreign
from statestream.plan import ReadRequest
from statestream.storage import CheckpointReader, storage_for

__all__ = ["open_checkpoint", "read_manifest", "skip_missing_checksums"]


def read_manifest(reader: CheckpointReader) -> Manifest:
    """Read and verify the commit marker and manifest of an open checkpoint."""
    where = f"{reader.location}/{MANIFEST_NAME}"
    size, crc = decode_commit(
        reader.read_bytes(COMMIT_NAME, MAX_COMMIT_BYTES), f"{reader.location}/{COMMIT_NAME}"
    )
    data = reader.read_bytes(MANIFEST_NAME, MAX_MANIFEST_BYTES)
    if len(data) != size or checksum(data) != crc:
        raise CheckpointCorruptError(
            f"manifest {where} does not match its commit marker (size {len(data)} vs {size}, "
            "or checksum differs); the checkpoint is corrupt"
        )
    try:  # decode from text only, so the bytes are not held while decoding
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CheckpointCorruptError(f"manifest {where} is not valid UTF-8: {exc}") from None
    del data
    return decode_manifest(text, where)


def skip_missing_checksums(reader: CheckpointReader, requests: list[ReadRequest]) -> None:
    """Foreign formats carry no checksums: their reads check sizes and bounds only."""
    if isinstance(reader, FileSetReader):
        for r in requests:
            for p in r.pieces:
                p.verify = []


def open_checkpoint(path: str | os.PathLike[str], *, allow_pickle: bool = False
                    ) -> tuple[CheckpointReader, Manifest]:
    """Open the committed checkpoint at ``path`` and read its verified manifest.

    A foreign checkpoint (safetensors, ...; see docs/interop.md) is recognised
    by its content and comes back as a manifest its parser built
    (``allow_pickle``: see torch.save files there).
    """
    foreign = open_foreign(path, allow_pickle=allow_pickle)
    if foreign is not None:
        return foreign.reader, foreign.manifest
    storage, spath = storage_for(path)
    reader = storage.open_read(spath)
    try:
        return reader, read_manifest(reader)
    except BaseException:
        reader.close()
        raise
