"""Object stores: a save's transaction (data, manifest, then the marker) and its writers."""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING

from statestream.errors import CheckpointError, CheckpointExistsError, StorageError
from statestream.format import COMMIT_NAME
from statestream.storage._base import Buffer, check_member_name
from statestream.storage._object_config import DAMAGED_MARKER

if TYPE_CHECKING:
    from statestream.storage._object import ObjectStorage

__all__ = ["ObjectFileWriter", "ObjectTxn"]


class ObjectFileWriter:
    def __init__(self, owner: ObjectStorage, bucket: str, key: str) -> None:
        import obstore

        self._where = owner._url(bucket, key)
        self._owner = owner
        try:
            self._w = obstore.open_writer(owner._store(bucket), key,
                                          buffer_size=owner.options.part_bytes,
                                          max_concurrency=owner.options.max_concurrency)
        except Exception as exc:
            raise owner._map_error(exc, f"opening {self._where}") from exc
        self._pos = 0

    def write_at(self, buffers: Sequence[Buffer], offset: int) -> None:
        if offset < self._pos:
            raise StorageError(f"object writes must be sequential ({self._where})")
        try:
            if offset > self._pos:
                self._w.write(bytes(offset - self._pos))
            for b in buffers:
                mv = memoryview(b).cast("B")
                if mv.nbytes:
                    # Zero-copy: obstore keeps a reference to the buffer until its
                    # part is uploaded (capabilities.retains_buffers), so callers do
                    # not recycle buffers they hand to an object-store writer.
                    self._w.write(mv)
                    offset += mv.nbytes
        except Exception as exc:
            raise self._owner._map_error(exc, f"uploading {self._where}") from exc
        self._pos = offset

    def finish(self) -> None:
        try:
            self._w.close()
        except Exception as exc:
            raise self._owner._map_error(exc, f"completing {self._where}") from exc

    def abort(self) -> None:
        pass  # an unfinished multipart upload is never visible


class ObjectTxn:
    def __init__(self, owner: ObjectStorage, url: str, overwrite: bool, root: str | None) -> None:
        self._owner = owner
        self.location = url
        self._bucket, self._prefix = owner.split_url(url)
        self._is_owner = root is None
        self._root = root or uuid.uuid4().hex
        self._overwrite = overwrite
        self._marker: bytes | None = None
        self._done = False

    @property
    def token(self) -> str:
        return self._root

    def _key(self, name: str) -> str:
        return f"{self._prefix}/{self._root}/{check_member_name(name)}"

    def create_file(self, name: str, size_hint: int) -> ObjectFileWriter:
        return ObjectFileWriter(self._owner, self._bucket, self._key(name))

    def write_bytes(self, name: str, data: bytes) -> None:
        if name == COMMIT_NAME:
            self._marker = data  # written by commit(), last
            return
        self._owner._put(self._bucket, self._key(name), data)

    def commit(self) -> None:
        if not self._is_owner:
            raise StorageError("only the process that began a write may commit it")
        if self._marker is None:
            raise StorageError("commit() before the commit marker was written")
        doc = json.loads(self._marker)
        doc["root"] = self._root
        marker = json.dumps(doc, separators=(",", ":")).encode()
        if not self._overwrite:
            self._commit_new(marker)
            return
        old = self._owner._live_root(self._bucket, self._prefix)
        self._put_marker(marker)
        if old is not None and old not in (self._root, DAMAGED_MARKER):
            self._owner._delete_prefix(self._bucket, f"{self._prefix}/{old}/")

    def _commit_new(self, marker: bytes) -> None:
        """Create-only (a conditional PUT): of two writers racing to the same path,
        exactly one commits; the other fails here and cleans up."""
        key = f"{self._prefix}/{COMMIT_NAME}"
        try:
            created = self._owner._put_new(self._bucket, key, marker)
        except CheckpointError:
            if not self._settle():
                raise
            created = True
        # A refusal may be the client's retry of our own PUT whose answer was lost:
        # the marker then names this root, and deleting it would damage the checkpoint.
        if not created and not self._settle():
            self.abort()
            raise CheckpointExistsError(
                f"{self.location} already holds a checkpoint; pass overwrite=True"
            )
        self._done = True

    def _put_marker(self, marker: bytes) -> None:
        try:
            self._owner._put(self._bucket, f"{self._prefix}/{COMMIT_NAME}", marker)
        except CheckpointError:
            if not self._settle():
                raise
        self._done = True

    def _settle(self) -> bool:
        """After a marker PUT failed or was refused: does the marker name this root?

        The store may have written it although its answer never arrived (a dropped
        connection, a timeout). True: committed. False: not (``abort`` may delete the
        root). When the marker cannot be read either, the outcome is unknown: the root
        is kept (``abort`` leaves it; garbage collection removes it if unreferenced),
        so a committed checkpoint is never left without its data.
        """
        try:
            ours = self._owner._live_root(self._bucket, self._prefix) == self._root
        except CheckpointError:
            self._done = True
            return False
        self._done = self._done or ours
        return ours

    def abort(self) -> None:
        if not self._done and self._is_owner:
            self._done = True
            try:
                self._owner._delete_prefix(self._bucket, f"{self._prefix}/{self._root}/")
            except CheckpointError:
                # abort runs while the save's own failure propagates: reporting the
                # cleanup's failure instead would hide it. The root is unreferenced
                # (nothing loads it); `delete` of the checkpoint removes it later.
                pass
        self._done = True


