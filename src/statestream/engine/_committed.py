"""Did a multi-process save commit? Asked by survivors when the last agreement fails.

After rank 0 commits, every process still agrees once more; if rank 0 (or
any rank) dies right then, the others' collective fails although the
checkpoint is complete. They read what is committed at the path (its commit
marker and the manifest the marker names) and compare it with this save: rank 0,
which holds every process's part, with the manifest those parts build
(:func:`statestream.plan.manifest_matches`); the others, which do not (the
parts are gathered to rank 0 alone), with this save's metadata, which names the
save by a random 128-bit id that rank 0 chose and sent with the transaction
(:func:`statestream.plan.meta_matches`). Only then is the save reported as done.
An older checkpoint left at the path (``overwrite=True``, commit never reached)
has another id.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from statestream.format import (
    COMMIT_NAME,
    MANIFEST_NAME,
    MAX_COMMIT_BYTES,
    MAX_MANIFEST_BYTES,
    checksum,
    decode_commit,
)
from statestream.plan import MergedTree, RankPart, manifest_matches, meta_matches
from statestream.storage import Storage

__all__ = ["committed_as_saved"]


def committed_as_saved(storage: Storage, path: str, merged: MergedTree,
                       parts: Sequence[RankPart] | None, meta: dict[str, Any]) -> bool:
    """Whether ``path`` holds a committed checkpoint that is exactly this save's.

    Args:
        storage: the save's storage; ``path`` its path there.
        merged: the checkpoint's tree and arrays (every process computed it).
        parts: every process's written files and chunks, in rank order; None on
            the processes that do not hold them (then ``meta`` must hold the
            save's ``save_id``).
        meta: the manifest metadata this save commits (its commit time aside).
    """
    try:
        reader = storage.open_read(path)
    except Exception:  # not committed (or unreadable): not known to be this save
        return False
    try:
        size, crc = decode_commit(reader.read_bytes(COMMIT_NAME, MAX_COMMIT_BYTES),
                                  f"{reader.location}/{COMMIT_NAME}")
        data = reader.read_bytes(MANIFEST_NAME, MAX_MANIFEST_BYTES)
    except Exception:  # a torn or foreign marker: not known to be this save
        return False
    finally:
        reader.close()
    if len(data) != size or checksum(data) != crc:
        return False
    if parts is None:
        return "save_id" in meta and meta_matches(data, meta)
    return manifest_matches(data, merged, parts, meta)
