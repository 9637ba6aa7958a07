"""Object stores: a save's transaction (data, manifest, then the marker) and its writers."""

from __future__ import annotations

import json
import logging
import threading
import uuid
import weakref
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np

from statestream._memory import fresh_bytes
from statestream.errors import CheckpointError, CheckpointExistsError, StorageError
from statestream.format import COMMIT_NAME
from statestream.storage._base import Buffer, check_member_name
from statestream.storage._object_config import DAMAGED_MARKER
from statestream.storage._object_fork import check as fork_check

if TYPE_CHECKING:
    from statestream.storage._object import ObjectStorage

__all__ = ["ObjectFileWriter", "ObjectTxn", "keep_part_buffers", "release_part_buffers"]


#: Part buffers kept between saves (a fresh buffer's first touch is slow), at most this
#: many bytes in all: a save sets it to the share of its memory budget its writers
#: hold (:func:`keep_part_buffers`); until then, eight parts of the default size.
_kept_limit = 8 * (16 << 20)
_parts: dict[int, list[np.ndarray]] = {}
_parts_lock = threading.Lock()
#: How many times :func:`release_part_buffers` was called. A save's writers give
#: their part buffers back with the count its transaction began with: after a
#: release since then they are dropped, not kept (what was released stays released,
#: as with the staging pools' ``StagingPool.epoch``).
_parts_epoch = 0


def parts_epoch() -> int:
    """The current count of :func:`release_part_buffers` calls (see ``_parts_epoch``)."""
    return _parts_epoch


def _take_part(size: int) -> np.ndarray:
    with _parts_lock:
        free = _parts.get(size)
        if free:
            return free.pop()
    return fresh_bytes(size)


def _kept_locked() -> int:
    return sum(b.nbytes for free in _parts.values() for b in free)


def _give_part(buf: np.ndarray, since: int | None = None) -> None:
    """Keep ``buf`` for reuse if it fits and (``since``: the :func:`parts_epoch` its
    save began with) no release came since."""
    with _parts_lock:
        if since is not None and since != _parts_epoch:
            return  # a save in flight when a release came keeps nothing
        if _kept_locked() + buf.nbytes <= _kept_limit:
            _parts.setdefault(buf.nbytes, []).append(buf)


def keep_part_buffers(max_bytes: int) -> None:
    """Keep at most ``max_bytes`` of part buffers between saves (dropping the rest)."""
    global _kept_limit
    with _parts_lock:
        _kept_limit = max(0, int(max_bytes))
        while _parts and _kept_locked() > _kept_limit:
            size = max(_parts)
            _parts[size].pop()
            if not _parts[size]:
                del _parts[size]


def release_part_buffers() -> int:
    """Free the part buffers object writers keep between saves; return the bytes.
    Saves in flight keep none of theirs (see ``_parts_epoch``)."""
    global _parts_epoch
    with _parts_lock:
        _parts_epoch += 1
        freed = _kept_locked()
        _parts.clear()
    return freed


class _Pieces:
    """Memoryviews read in order, ``take(n)`` bytes at a time (as slices)."""

    def __init__(self, views: list[memoryview]) -> None:
        self._views = views
        self._i = self._at = 0
        self.left = sum(mv.nbytes for mv in views)

    def take(self, n: int) -> Iterator[memoryview]:
        n = min(n, self.left)
        self.left -= n
        while n:
            mv = self._views[self._i]
            k = min(n, mv.nbytes - self._at)
            yield mv[self._at:self._at + k]
            n -= k
            self._at += k
            if self._at == mv.nbytes:
                self._i, self._at = self._i + 1, 0


class ObjectFileWriter:
    """One object written as a multipart upload, parts uploaded in the background.

    obstore keeps a reference to what it is given until that part is uploaded,
    and holds bytes short of a whole part until more arrive. So:

    - ``write_at`` returns only once the store is done with the caller's
      buffers, which the caller may then reuse (save_async's staging buffers go
      back to their pool, within the memory budget): the caller's bytes are
      handed over zero-copy only where they complete parts, and the rest is
      copied into part buffers of the writer's own, at most :attr:`OWN_PARTS`
      of ``part_bytes`` per file (one filling while one uploads);
    - ``lend_at`` hands everything over zero-copy and returns at once, for
      buffers that stay unchanged and alive until :meth:`finish` (a synchronous
      save's own arrays): obstore bounds what it holds to ``max_concurrency``
      parts in flight.

    When obstore drops a reference is seen by a ``weakref.finalize`` on the
    view it was given (run on its I/O thread; never hold ``_cv`` while calling
    obstore, which may wait for that thread).
    """

    #: Part buffers of its own a writer has at once: one filling while one uploads.
    OWN_PARTS = 2

    def __init__(self, owner: ObjectStorage, bucket: str, key: str,
                 since: int | None = None) -> None:
        import obstore

        self._where = owner._url(bucket, key)
        self._owner = owner
        self._part = owner.options.part_bytes
        try:
            self._w = obstore.open_writer(owner._store(bucket), key,
                                          buffer_size=self._part,
                                          max_concurrency=owner.options.max_concurrency)
        except Exception as exc:
            raise owner._map_error(exc, f"opening {self._where}") from exc
        self._pos = 0  # the object's size so far, as the caller sees it
        self._sent = 0  # bytes handed to obstore (it holds _sent % part in its buffer)
        self._cv = threading.Condition()
        self._borrowed = 0  # views of the caller's buffers obstore still holds
        self._own = 0  # own part buffers taken (filling or uploading)
        self._spare: list[np.ndarray] = []
        self._fill: np.ndarray | None = None  # own bytes after _sent, not handed over
        self._filled = 0
        self._since = parts_epoch() if since is None else since  # see _give_part
        self._closed = False  # finished or aborted

    # -- handing bytes to obstore -------------------------------------------------
    def _borrowed_released(self) -> None:
        with self._cv:
            self._borrowed -= 1
            self._cv.notify_all()

    def _own_released(self, buf: np.ndarray) -> None:
        with self._cv:
            self._spare.append(buf)
            self._cv.notify_all()

    def _send(self, data: Buffer, n: int) -> None:
        fork_check()  # a writer opened before a fork: its client does not work here
        self._sent += n
        self._w.write(data)

    def _send_borrowed(self, mv: memoryview) -> None:
        view = np.frombuffer(mv, np.uint8)
        with self._cv:
            self._borrowed += 1
        weakref.finalize(view, self._borrowed_released)
        self._send(view, mv.nbytes)

    def _send_fill(self) -> None:
        assert self._fill is not None
        view = self._fill[:self._filled]
        weakref.finalize(view, self._own_released, self._fill)
        n, self._fill, self._filled = self._filled, None, 0
        self._send(view, n)

    def _take_fill(self) -> np.ndarray:
        # Every own buffer taken is in a whole part by now, so it comes back.
        with self._cv:
            while not self._spare and self._own >= self.OWN_PARTS:
                self._cv.wait()
            if self._spare:
                return self._spare.pop()
            self._own += 1
        return _take_part(self._part)

    def _copy_in(self, mv: memoryview) -> None:
        assert self._fill is not None
        self._fill[self._filled:self._filled + mv.nbytes] = np.frombuffer(mv, np.uint8)
        self._filled += mv.nbytes

    def _feed(self, pieces: _Pieces) -> None:
        part = self._part
        short = -self._sent % part  # lent bytes wait in obstore for this many more
        if short:
            if pieces.left < short:  # still short: a private copy waits with them
                for mv in pieces.take(pieces.left):
                    self._send(mv.tobytes(), mv.nbytes)
                return
            for mv in pieces.take(short):
                self._send_borrowed(mv)
        if self._fill is not None:
            for mv in pieces.take(part - self._filled):
                self._copy_in(mv)
            if self._filled == part:
                self._send_fill()
        for mv in pieces.take(pieces.left // part * part):
            self._send_borrowed(mv)
        if pieces.left:
            self._fill = self._take_fill()
            for mv in pieces.take(pieces.left):
                self._copy_in(mv)

    def _views(self, buffers: Sequence[Buffer], offset: int) -> tuple[list[memoryview], int]:
        if offset < self._pos:
            raise StorageError(f"object writes must be sequential ({self._where})")
        views = [mv for mv in (memoryview(b).cast("B") for b in buffers) if mv.nbytes]
        end = offset + sum(mv.nbytes for mv in views)
        if offset > self._pos:
            views.insert(0, memoryview(bytes(offset - self._pos)))
        return views, end

    def write_at(self, buffers: Sequence[Buffer], offset: int) -> None:
        views, end = self._views(buffers, offset)
        try:
            self._feed(_Pieces(views))
            with self._cv:
                while self._borrowed:
                    self._cv.wait()
        except Exception as exc:
            raise self._owner._map_error(exc, f"uploading {self._where}") from exc
        self._pos = end

    def lend_at(self, buffers: Sequence[Buffer], offset: int) -> None:
        """As :meth:`write_at`, for buffers the caller leaves unchanged and alive until
        :meth:`finish`: they are uploaded from where they are, without waiting."""
        views, end = self._views(buffers, offset)
        try:
            if self._fill is not None:
                self._send_fill()  # it comes back once the lent bytes complete its part
            for mv in views:
                self._send(mv, mv.nbytes)
        except Exception as exc:
            raise self._owner._map_error(exc, f"uploading {self._where}") from exc
        self._pos = end

    def finish(self) -> None:
        self._closed = True
        try:
            if self._fill is not None:
                self._send_fill()
            fork_check()
            self._w.close()
        except Exception as exc:
            raise self._owner._map_error(exc, _completing(self._where, exc)) from exc
        finally:
            self._recycle()

    def abort(self) -> None:
        """Give up the object: its multipart upload, if one began, is aborted (it is never
        visible, but the store keeps its parts, and bills them, until it is completed or
        aborted; a writer dropped unclosed leaves it open). Best effort: the save's own
        failure is what is reported. Own buffers obstore may still hold are not reused."""
        self._fill = None
        with self._cv:
            self._spare.clear()
        if self._closed:
            return
        self._closed = True
        try:  # the client aborts the upload when its writer exits with an error
            fork_check()
            self._w.__exit__(StorageError, StorageError("save aborted"), None)
        except Exception as exc:
            logging.getLogger("statestream").info(
                "aborting the upload of %s failed: %s", self._where, exc)

    def _recycle(self) -> None:
        with self._cv:
            spare, self._spare = self._spare, []
        for buf in spare:
            _give_part(buf, self._since)


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
        #: the part buffers' epoch when the save began: after a release_part_buffers()
        #: (release_staging()) since then, its writers keep no part buffer
        self._parts_since = parts_epoch()

    @property
    def token(self) -> str:
        return self._root

    def _key(self, name: str) -> str:
        return f"{self._prefix}/{self._root}/{check_member_name(name)}"

    def create_file(self, name: str, size_hint: int) -> ObjectFileWriter:
        return ObjectFileWriter(self._owner, self._bucket, self._key(name), self._parts_since)

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
            try:
                self._owner._delete_prefix(self._bucket, f"{self._prefix}/{old}/")
            except CheckpointError as exc:
                # committed: the replaced root is an unreferenced leftover (statestream
                # gc, or deleting the checkpoint, removes it), as a local overwrite
                # ignores a failed removal of the replaced directory
                logging.getLogger("statestream").warning(
                    "%s is committed; its replaced save %s/%s/ was not removed (statestream "
                    "gc removes it): %s", self.location, self.location, old, exc)

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


def _completing(where: str, exc: BaseException) -> str:
    """What failed, for an error of the writer's close. When a part fails, obstore
    aborts the multipart upload (a DELETE of ``?uploadId=``) and, if that fails too
    (a store that stopped answering), raises the abort's error alone: say so, since
    the part's own error (often a timeout) is gone."""
    text = str(exc)
    if "DELETE" in text and "uploadId=" in text:
        return (f"uploading {where} (a part of its multipart upload failed, then so did "
                "the client's abort of the upload, whose error is all it reports: the store "
                "may have stopped answering)")
    return f"completing {where}"
