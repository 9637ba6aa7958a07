"""What this process committed lately: each checkpoint's summary, kept so that the
process need not decode a manifest it has just written.

A ``CheckpointManager`` asks, after every save, for the new step's metadata (its
keep policy's metrics and the steps it refers to) and, saving incrementally, for
its base's chain depth: until 2026-12-07 each was a whole manifest decoded again
(``metadata`` of 100k arrays: about 1 s; 1M: 10 s). A kept summary is used only
while the checkpoint's commit marker names the same manifest (size and CRC-32C)
and the manifest's bytes are still that one (read and checksummed, not decoded):
a checkpoint replaced or damaged since is read again, as a fresh process would.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
from typing import Any, Generic, TypeVar

from statestream.errors import CheckpointError, StorageError
from statestream.format import (
    COMMIT_NAME,
    MANIFEST_NAME,
    MAX_COMMIT_BYTES,
    MAX_MANIFEST_BYTES,
    Manifest,
    checksum,
    decode_commit,
)
from statestream.storage import CheckpointReader, Storage, storage_for

__all__ = ["CommittedSummary", "KeptByManifest", "committed_summary", "remember_summary",
           "still_committed"]


@dataclasses.dataclass(frozen=True)
class CommittedSummary:
    """A committed checkpoint's manifest ``meta`` (a copy), raw size and ``bases``,
    as :func:`~statestream.api.metadata` gives them."""

    meta: dict[str, Any]
    total_bytes: int
    bases: tuple[str, ...]


T = TypeVar("T")


class KeptByManifest(Generic[T]):
    """Values kept per checkpoint path, each with the manifest it was made from (size
    and CRC-32C), at most ``most`` of them, the least recently used dropped first
    (thread-safe). A value is given out only while that manifest is still the one
    committed at its path (:func:`still_committed`)."""

    def __init__(self, most: int) -> None:
        self._most = most
        self._lock = threading.Lock()
        self._kept: dict[str, tuple[int, int, T]] = {}  # the most recently used last

    def put(self, spath: str, size: int, crc: int, value: T) -> None:
        with self._lock:
            self._kept.pop(spath, None)
            self._kept[spath] = (size, crc, value)
            while len(self._kept) > self._most:
                del self._kept[next(iter(self._kept))]

    def get(self, storage: Storage, spath: str) -> T | None:
        """The value kept for ``spath`` while its manifest is still committed there,
        else None.

        Raises:
            StorageError: the store failed.
            CheckpointError: the commit marker is damaged.
        """
        with self._lock:
            kept = self._kept.get(spath)
        if kept is None or not still_committed(storage, spath, kept[0], kept[1]):
            return None
        self.put(spath, *kept)  # used again: the last to be dropped
        return kept[2]


_KEPT: KeptByManifest[CommittedSummary] = KeptByManifest(16)


def remember_summary(spath: str, mbytes: bytes, manifest: Manifest, *,
                     refers: bool = True) -> None:
    """Keep the summary of ``manifest`` (encoded as ``mbytes``), just committed at
    ``spath`` by this process; ``refers=False``: a save without a base, whose chunks
    refer to nothing (not looked through: 20 ms at 100k arrays)."""
    bases = dict.fromkeys(manifest.bases)  # one being committed: only in its chunks
    for a in manifest.arrays if refers else ():
        for c in a.chunks:
            if c.ref is not None:
                bases[c.ref.base] = None
    total = manifest.meta.get("total_bytes")  # the job's sum (again: 20 ms at 100k)
    if not isinstance(total, int):
        total = sum(a.nbytes for a in manifest.arrays)
    summary = CommittedSummary(copy.deepcopy(manifest.meta), total, tuple(bases))
    _KEPT.put(spath, len(mbytes), checksum(mbytes), summary)


def committed_summary(path: str) -> CommittedSummary | None:
    """The summary of the checkpoint at ``path`` where this process committed it
    lately and that very manifest is still committed there, else None (read
    :func:`~statestream.api.metadata`). Its ``meta`` is the caller's own copy.

    Raises:
        StorageError: the store failed (not the checkpoint).
    """
    storage, spath = storage_for(path)
    try:
        summary = _KEPT.get(storage, spath)
    except CheckpointError:
        return None  # metadata() names what is wrong
    if summary is None:
        return None
    return dataclasses.replace(summary, meta=copy.deepcopy(summary.meta))


def still_committed(storage: Storage, spath: str, size: int, crc: int) -> bool:
    """Whether the checkpoint at ``spath`` is committed with the manifest of that
    size and CRC-32C, its bytes unchanged (read, not decoded).

    Raises:
        StorageError: the store failed.
        CheckpointError: the commit marker is damaged.
    """
    if not storage.is_committed(spath):
        return False
    reader = storage.open_read(spath)
    try:
        marker = decode_commit(reader.read_bytes(COMMIT_NAME, MAX_COMMIT_BYTES),
                               f"{reader.location}/{COMMIT_NAME}")
        return marker == (size, crc) and _manifest_is(reader, size, crc)
    finally:
        reader.close()


def _manifest_is(reader: CheckpointReader, size: int, crc: int) -> bool:
    """Whether the manifest file still holds what the commit marker names: kept
    knowledge must not hide a manifest damaged since. Read, not decoded."""
    try:
        data = reader.read_bytes(MANIFEST_NAME, MAX_MANIFEST_BYTES)
    except StorageError:
        raise  # the store failed, not the checkpoint
    except CheckpointError:
        return False  # the full read names what is wrong
    return len(data) == size and checksum(data) == crc
