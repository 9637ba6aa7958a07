"""The Storage protocol: the few operations a checkpoint backend provides.

Methods are synchronous and thread-safe: the engine calls them from its
worker threads (blocking I/O there releases the GIL). A backend that wraps
an async client bridges it on one long-lived loop thread.
"""

from __future__ import annotations

import builtins
import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from statestream.errors import StorageError, UnsafeCheckpointError
from statestream.format import DATA_DIR, validate_file_name

__all__ = [
    "MappedReader",
    "Buffer",
    "CheckpointReader",
    "FileWriter",
    "Lease",
    "Leftover",
    "LeftoverKeptError",
    "Storage",
    "StorageCapabilities",
    "WriteTransaction",
    "WriterId",
    "check_member_name",
]

#: Anything exposing the buffer protocol (bytes, memoryview, numpy arrays).
Buffer = Any


@dataclasses.dataclass(frozen=True, kw_only=True)
class StorageCapabilities:
    """What a backend can do, declared up front instead of probed with try/except."""

    #: Commit is a rename of a temporary location (local) rather than a marker object.
    atomic_rename: bool
    #: Files accept writes at arbitrary offsets (pwrite); otherwise write in order.
    random_write: bool
    #: Reads of byte ranges are cheap (local, object-store ranged GET).
    ranged_read: bool = True
    #: Preferred size of one read request and number of parallel readers when
    #: the caller gives no IOOptions (object stores want few, large GETs).
    read_request_bytes: int | None = None
    read_threads: int | None = None
    #: ``FileWriter.write_at`` may keep referencing the buffers it was given
    #: after it returns (until ``finish``), so callers must not reuse them.
    #: Staging buffers are then not recycled. The object stores do not: their
    #: writers return once the store is done with the bytes (``lend_at`` is
    #: the zero-copy way for buffers that stay put).
    retains_buffers: bool = False
    #: Bytes of its own one ``FileWriter`` may hold beyond the buffers it is given
    #: (an object store's part buffers); a save charges them to its memory budget.
    writer_buffer_bytes: int = 0


class FileWriter(Protocol):
    """One data file being written inside a transaction.

    A writer may also have ``lend_at(buffers, offset)``, called as ``write_at``
    for buffers the caller leaves unchanged and alive until ``finish`` (a
    synchronous save's own arrays): it may keep referencing them after it
    returns (an object store uploading them in the background, zero-copy).
    """

    def write_at(self, buffers: Sequence[Buffer], offset: int) -> None:
        """Write ``buffers`` back to back starting at byte ``offset``; on return
        the writer is done with them (the caller may reuse them at once)."""
        ...

    def finish(self) -> None:
        """Make the file durable (fsync) and close it."""
        ...

    def abort(self) -> None:
        """Close without making durable."""
        ...


class WriteTransaction(Protocol):
    """A checkpoint being written; invisible until :meth:`commit`."""

    location: str

    @property
    def token(self) -> str:
        """Plain string other processes pass to ``Storage.join_write``."""
        ...

    def create_file(self, name: str, size_hint: int) -> FileWriter:
        """Create data file ``name`` (``data/...``) of about ``size_hint`` bytes."""
        ...

    def write_bytes(self, name: str, data: bytes) -> None:
        """Write a small file (manifest, commit marker) durably in one go."""
        ...

    def commit(self) -> None:
        """Atomically publish the checkpoint at its final path."""
        ...

    def abort(self) -> None:
        """Discard everything written; the final path is untouched."""
        ...


class CheckpointReader(Protocol):
    """Read access to one committed checkpoint."""

    location: str

    def read_bytes(self, name: str, max_bytes: int) -> bytes:
        """Read a whole small file, refusing ones larger than ``max_bytes``."""
        ...

    def file_size(self, name: str) -> int:
        """Size in bytes of data file ``name``; TruncatedFileError if missing."""
        ...

    def read_into(self, name: str, offset: int, buffers: Sequence[Buffer]) -> None:
        """Fill writable ``buffers`` from ``name`` starting at ``offset``, exactly."""
        ...

    def close(self) -> None:
        """Release file handles."""
        ...


@runtime_checkable
class MappedReader(CheckpointReader, Protocol):
    """A reader that can also map data file bytes into memory (local files).

    A mapping is private (copy-on-write): writing to it never changes the
    file. Its pages are read from the file as they are first touched, so the
    caller verifies checksums by touching them.
    """

    def map_range(self, name: str, offset: int, nbytes: int) -> memoryview | None:
        """A writable private mapping of bytes ``[offset, offset + nbytes)`` of
        ``name``, or None when it cannot be mapped (then read it).

        Raises:
            TruncatedFileError: the file is missing or shorter than the range.
        """
        ...

    def map_ranges(self, ranges: Sequence[tuple[str, int, int]]) -> memoryview | None:
        """One writable private mapping of several ``(name, offset, nbytes)`` ranges
        placed back to back, or None when they cannot be mapped so (then read them).
        Offsets must be page-aligned, and every range but the last a whole number of
        pages.

        Raises:
            TruncatedFileError: a file is missing or shorter than its range.
        """
        ...

    def cold_ranges(self, name: str, offset: int, nbytes: int) -> list[tuple[int, int]]:
        """``(start, end)`` byte ranges of ``[offset, offset + nbytes)`` of ``name`` whose
        pages are not in the page cache now; empty when all are, or when this cannot
        be told (then nothing may be dropped)."""
        ...

    def drop_cached(self, name: str, ranges: list[tuple[int, int]], lo: int, hi: int) -> None:
        """Let the page cache drop the pages of ``ranges`` (from :meth:`cold_ranges`)
        that lie wholly within ``[lo, hi)``. A hint; never fails."""
        ...

    def read_ahead(self, name: str, offset: int, nbytes: int) -> None:
        """Start reading ``[offset, offset + nbytes)`` of ``name`` into the page cache
        and return without waiting for it (a hint)."""
        ...


@dataclasses.dataclass(frozen=True)
class WriterId:
    """Who wrote a staging area: enough to prove, on its host, that it is dead.

    ``host`` identifies the machine *and* PID namespace and boot (a hash), so a
    pid is only ever compared with processes of the same kernel instance;
    ``start`` is the process's start time in clock ticks since boot (Linux
    ``/proc/<pid>/stat`` field 22), so a recycled pid is not mistaken for it.
    """

    host: str
    pid: int
    start: int


@dataclasses.dataclass(frozen=True)
class Leftover:
    """The staging area of a save that did not finish (or has not yet)."""

    #: Full path or URL of the staging area (what ``remove_leftover`` removes).
    path: str
    #: Name (last path component) of the checkpoint it was writing.
    target: str
    #: Its writer, when recorded; None for staging areas of older versions.
    writer: WriterId | None
    #: Last time anything in it changed (Unix seconds): a live writer keeps it recent.
    modified: float


class Lease(Protocol):
    """Exclusive, renewable ownership of a directory (``CheckpointManager``'s lock).

    A lease that is not renewed expires after its ``ttl_s``; another holder may
    then take it over. Backends where the holder's death ends it by itself
    (``flock`` on a local file system) may ignore ``ttl_s``.
    """

    #: Who holds it (``pid N on HOST``), for messages.
    holder: str
    #: Seconds it lasts without renewal; None: it lasts as long as its holder
    #: lives (no renewal needed).
    ttl_s: float | None

    def renew(self) -> None:
        """Extend the lease by its ttl.

        Raises:
            ManagerLockedError: it expired and someone else took it over.
        """
        ...

    def release(self) -> None:
        """Give the lease up (idempotent); others may take it at once."""
        ...


class Storage(Protocol):
    """A place checkpoints live: a local file system, an object store, ..."""

    capabilities: StorageCapabilities

    def begin_write(self, path: str, *, overwrite: bool) -> WriteTransaction:
        """Start writing a checkpoint to ``path``.

        Raises:
            CheckpointExistsError: ``path`` exists and ``overwrite`` is false
                (or it exists and is not a checkpoint).
        """
        ...

    def join_write(self, path: str, token: str) -> WriteTransaction:
        """Join a save begun by another process (it alone commits or aborts)."""
        ...

    def open_read(self, path: str, *, follow_links: bool = True) -> CheckpointReader:
        """Open the committed checkpoint at ``path``.

        ``follow_links=False``: ``path`` itself must not be a symbolic link (a
        base checkpoint a manifest names stays inside its parent directory).

        Raises:
            CheckpointNotFoundError: nothing committed lives there.
            UnsafeCheckpointError: ``follow_links`` is False and ``path`` is a link.
        """
        ...

    def is_committed(self, path: str) -> bool:
        """True if ``path`` holds a committed checkpoint."""
        ...

    def list(self, path: str) -> list[str]:
        """Names of the entries directly under ``path`` (empty if none)."""
        ...

    def delete(self, path: str) -> None:
        """Remove the checkpoint at ``path`` (uncommit first, then data)."""
        ...

    def acquire_lease(self, path: str, *, holder: str, ttl_s: float) -> Lease:
        """Take the lease named ``path`` (creating its parent directory if needed).

        Raises:
            ManagerLockedError: someone else holds it and it has not expired.
            StorageError: the location cannot be written (read-only mount, no
                permission: ``errno`` EROFS / EACCES).
        """
        ...

    def leftovers(self, parent: str) -> builtins.list[Leftover]:
        """Staging areas of unfinished saves of checkpoints directly under ``parent``."""
        ...

    def remove_leftover(self, leftover: Leftover) -> str | None:
        """Remove one staging area listed by :meth:`leftovers` (a missing one is fine).

        Returns the checkpoint put back in its place instead, if any: a local
        ``<staging>.old`` holding the committed checkpoint an overwrite moved aside
        and was killed before it could replace (the path holds none) is restored,
        not removed. ``None``: removed.

        Raises:
            LeftoverKeptError: it is not garbage (any more), so it was left alone on
                purpose: committed meanwhile, not a staging area, or beside a damaged
                commit marker or objects no save writes.
            StorageError: removing it failed (permission denied, the store did not
                answer, ...): a failure, not a decision.
        """
        ...


class LeftoverKeptError(StorageError):
    """:meth:`Storage.remove_leftover` left a staging area alone on purpose: it is no
    garbage (committed meanwhile, not a save's, or maybe the data of a checkpoint
    whose commit marker is damaged). ``collect_garbage`` skips it; any other error
    removing a leftover is a failure it reports."""


def check_member_name(name: str) -> str:
    """Reject a name a write transaction must not create (escapes, nesting).

    ``data/<file>`` names go through the format's file-name rules; anything
    else must be a plain top-level name (``manifest.json``, ``COMMITTED``).
    """
    if name.startswith(DATA_DIR + "/"):
        validate_file_name(name)
    elif "/" in name or name in ("", ".", ".."):
        raise UnsafeCheckpointError(f"refusing to write {name!r} outside the checkpoint")
    return name


def file_where(reader: Any, name: str) -> str:
    """Where file ``name`` of the checkpoint ``reader`` reads really is, for messages:
    the reader's ``file_url(name)`` if it has one (an object store's checkpoint keeps
    its files under a root named by its commit marker), else ``location/name``."""
    url = getattr(reader, "file_url", None)
    return str(url(name)) if callable(url) else f"{reader.location}/{name}"
