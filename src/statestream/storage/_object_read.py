"""Object stores: reading one committed checkpoint (the root its marker names)."""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from statestream.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointGoneError,
    CheckpointNotFoundError,
    TruncatedFileError,
    UnsafeCheckpointError,
)
from statestream.format import COMMIT_NAME, DATA_DIR, MAX_COMMIT_BYTES, validate_file_name
from statestream.storage._base import Buffer
from statestream.storage._hints import not_a_checkpoint_hint
from statestream.storage._object_config import DELETING_NAME, ROOT_RE
from statestream.storage._object_list import listed

if TYPE_CHECKING:
    from statestream.storage._object import ObjectStorage

__all__ = ["ObjectReader"]


#: the pieces a ranged read's response is copied into place in
_STREAM_PIECE = 1 << 20


def _copy_stream(pieces: Any, views: Sequence[memoryview]) -> int:
    """Copy the byte pieces of ``pieces`` into ``views`` one after another; the number of
    bytes received (more than the views hold is not copied)."""
    import numpy as np

    dst = [np.frombuffer(v, dtype=np.uint8) for v in views]
    vi, vpos, got = 0, 0, 0
    for piece in pieces:
        src = np.frombuffer(memoryview(piece), dtype=np.uint8)
        got += src.nbytes
        spos = 0
        while spos < src.nbytes and vi < len(dst):
            n = min(src.nbytes - spos, dst[vi].nbytes - vpos)
            dst[vi][vpos:vpos + n] = src[spos:spos + n]
            spos, vpos = spos + n, vpos + n
            if vpos == dst[vi].nbytes:
                vi, vpos = vi + 1, 0
    return got


class ObjectReader:
    def __init__(self, owner: ObjectStorage, url: str) -> None:
        self._owner = owner
        self.location = url
        self._bucket, self._prefix = owner.split_url(url)
        marker = owner._get_small(self._bucket, f"{self._prefix}/{COMMIT_NAME}",
                                  MAX_COMMIT_BYTES, missing_ok=True)
        if marker is None:
            try:  # a clearer error for a missing bucket, if the credentials may list
                owner.check_bucket(self._bucket)
            except PermissionError:
                pass  # they may not: reading the marker found no bucket missing
            raise CheckpointNotFoundError(
                not_a_checkpoint_hint(owner, url)
                or f"no committed checkpoint at {url}: it has no {COMMIT_NAME} marker"
            )
        self._marker = marker
        try:
            root = json.loads(marker).get("root")
        except (ValueError, AttributeError, RecursionError):  # (nested past Python's limit)
            raise CheckpointCorruptError(f"commit marker of {url} is not valid JSON") from None
        if type(root) is not str or not ROOT_RE.match(root):
            raise UnsafeCheckpointError(f"commit marker of {url} names an invalid root {root!r}")
        self._root = root
        self._sizes: dict[str, int] = {}
        self._lock = threading.Lock()

    def file_url(self, name: str) -> str:
        """The URL of file ``name`` of this checkpoint (under its root)."""
        return f"{self.location}/{self._root}/{name}"

    def _key(self, name: str) -> str:
        if name != COMMIT_NAME and not name.startswith(DATA_DIR + "/") and "/" in name:
            raise UnsafeCheckpointError(f"refusing to read {name!r} outside the checkpoint")
        if name.startswith(DATA_DIR + "/"):
            validate_file_name(name)
        return f"{self._prefix}/{self._root}/{name}"

    def _gone(self, where: str) -> TruncatedFileError:
        """The error for object ``where`` of this checkpoint that is not there: overwritten
        (or deleted) since this reader read the marker, else damage."""
        try:
            now = self._owner._live_root(self._bucket, self._prefix)
        except CheckpointError:
            now = self._root  # cannot tell: report what is known
        if now != self._root:
            state = "now names another save" if now else "is gone"
            return CheckpointGoneError(
                f"{where} is gone: {self.location} was overwritten or deleted while being "
                f"read (its {COMMIT_NAME} marker {state}); load it again"
            )
        return TruncatedFileError(f"{where} is missing; the checkpoint is damaged")

    def read_bytes(self, name: str, max_bytes: int) -> bytes:
        if name == COMMIT_NAME:
            return self._marker
        key = self._key(name)
        data = self._owner._get_small(self._bucket, key, max_bytes, missing_ok=True)
        if data is None:
            raise self._gone(self._owner._url(self._bucket, key))
        return data

    def file_size(self, name: str) -> int:
        with self._lock:
            if name in self._sizes:
                return self._sizes[name]
        import obstore

        key = self._key(name)
        where = self._owner._url(self._bucket, key)
        try:
            size = int(obstore.head(self._owner._store(self._bucket), key)["size"])
        except Exception as exc:
            err = self._owner._map_error(exc, f"reading the size of {where}")
            if isinstance(err, CheckpointNotFoundError):
                raise self._gone(f"data object {where}") from None
            raise err from exc
        with self._lock:
            self._sizes[name] = size
        return size

    def read_into(self, name: str, offset: int, buffers: Sequence[Buffer]) -> None:
        import obstore

        views = [memoryview(b).cast("B") for b in buffers]
        total = sum(v.nbytes for v in views)
        if total == 0:
            return
        key = self._key(name)
        where = self._owner._url(self._bucket, key)
        size = self.file_size(name)
        if offset + total > size:
            raise TruncatedFileError(
                f"data object {where} has {size} bytes; the manifest needs "
                f"bytes up to {offset + total}; the checkpoint is truncated"
            )
        try:
            # streamed: each piece of the response is copied into place as it comes,
            # never a whole response (up to max_request_bytes per reader thread, and
            # the HTTP client's pieces of it) held at once
            got = obstore.get(self._owner._store(self._bucket), key,
                              options={"range": (offset, offset + total)})
            n = _copy_stream(got.stream(min_chunk_size=_STREAM_PIECE), views)
        except Exception as exc:
            err = self._owner._map_error(exc, f"reading {where}")
            if isinstance(err, CheckpointNotFoundError):  # its size was known: it vanished
                raise self._gone(f"data object {where}") from None
            raise err from exc
        if n != total:
            raise TruncatedFileError(f"short read of {where}")

    def list_files(self) -> list[str]:
        """Every object of the checkpoint, named like the local reader's entries.

        Objects under the committed root are named relative to it
        (``manifest.json``, ``data/<name>``); other objects under the
        checkpoint's prefix keep their name relative to it (``COMMITTED``,
        ``extra.bin``, ``sub/x``). Other roots (an overwritten version not yet
        deleted, a killed save's leftovers) belong to ``statestream gc``.
        """
        top = self._prefix + "/"
        out: list[str] = []
        try:
            for m in listed(self._owner, self._bucket, top):
                rel = m["path"][len(top):]
                first, sep, rest = rel.partition("/")
                if first == self._root and sep:
                    out.append(rest)
                elif rel == DELETING_NAME:
                    continue  # a deletion's mark, left by one that was killed
                elif not (sep and ROOT_RE.match(first)):
                    out.append(rel)
        except Exception as exc:
            raise self._owner._list_error(
                exc, self.location, "finding every object of the checkpoint (verify "
                "looks for objects its manifest does not name)") from exc
        return out

    def close(self) -> None:
        pass


