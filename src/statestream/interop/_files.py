"""A read-only view of a fixed set of local files (the files of a foreign checkpoint)."""

from __future__ import annotations

import os
import struct
import threading
import zipfile
import zlib
from collections.abc import Mapping, Sequence
from typing import BinaryIO

from statestream.errors import (
    CheckpointCorruptError,
    TruncatedFileError,
    UnsafeCheckpointError,
)
from statestream.format import FileEntry
from statestream.storage import Buffer, preadv_all
from statestream.storage._local_read import open_regular

__all__ = ["FileSetReader", "hub_blob", "open_binary", "open_plain", "plain_size"]


def open_plain(path: str) -> int:
    """A read-only fd of the regular file at ``path`` (a file of a foreign checkpoint),
    opened as statestream's own files are (docs/security.md): a symbolic link, FIFO,
    directory or device is refused without being opened, or waited on. The caller
    resolves a path it was given by the user (which may be a link) before asking.

    Raises:
        TruncatedFileError: nothing is there.
        UnsafeCheckpointError: not a regular file.
        StorageError: any other OS error.
    """
    try:
        return open_regular(path, None, path)
    except FileNotFoundError:
        raise TruncatedFileError(f"{path} is missing; the checkpoint is incomplete") from None


def hub_blob(path: str) -> str:
    """``path``, or the blob it links to when it is a file of a Hugging Face hub
    cache snapshot.

    The hub cache keeps each file once, as ``<repo>/blobs/<hash>``, and a
    snapshot ``<repo>/snapshots/<revision>/<name>`` holds a symbolic link to
    it. Such a link is followed when it resolves to a file directly in that
    repository's ``blobs``, so a read never leaves ``<repo>``; any other link
    is left as it is, and :func:`open_plain` refuses it.
    """
    if not os.path.islink(path):
        return path
    snapshot = os.path.dirname(os.path.abspath(path))
    snapshots = os.path.dirname(snapshot)
    if os.path.basename(snapshots) != "snapshots":
        return path
    blobs = os.path.realpath(os.path.join(os.path.dirname(snapshots), "blobs"))
    real = os.path.realpath(path)
    return real if os.path.dirname(real) == blobs else path


def open_binary(path: str) -> BinaryIO:
    """:func:`open_plain` as a buffered binary file object."""
    return os.fdopen(open_plain(path), "rb")


#: What Python's zipfile raises for a damaged archive besides BadZipFile: a name
#: that is not UTF-8 (UnicodeDecodeError, a ValueError), an unknown compression
#: method, a truncated or corrupt deflate stream, a bad header field. Catch
#: CheckpointError before these (it is a ValueError too).
ZIP_ERRORS = (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, NotImplementedError,
              EOFError, zlib.error, struct.error, OverflowError, KeyError)


def read_capped(path: str, cap: int, what: str | None = None) -> bytes:
    """The whole regular file at ``path``, refused when larger than ``cap`` bytes.

    The size is taken from ``fstat`` and only that many bytes are asked for:
    ``read(cap + 1)`` would reserve ``cap + 1`` bytes of buffer for a file of
    any size (a gigabyte for a DCP ``.metadata`` of a few kilobytes).
    """
    with open_binary(path) as f:
        size = os.fstat(f.fileno()).st_size
        if size > cap:
            raise CheckpointCorruptError(f"{what or path} is larger than {cap} bytes")
        return f.read(size)


def plain_size(path: str) -> int:
    """The size of the regular file at ``path`` (refused as :func:`open_plain` does)."""
    fd = open_plain(path)
    try:
        return os.fstat(fd).st_size
    finally:
        os.close(fd)



class FileSetReader:
    """``CheckpointReader`` over named local files (no manifest, no checksums).

    Only the files named when it is made can be read: a name maps to a path
    the format's parser validated (a plain file in the checkpoint's
    directory), never to a path taken from the file's contents.
    """

    def __init__(self, location: str, files: Mapping[str, str], format: str = "",
                 memory: Mapping[str, bytes | memoryview] | None = None) -> None:
        self.location = location
        #: values already in memory (DCP's bytes values, arrays a library restored), by name
        self._memory = {k: memoryview(v).cast("B") for k, v in (memory or {}).items()}
        #: the foreign format's name (``"safetensors"``, ...), set by ``open_foreign``
        self.format = format
        self._paths = dict(files)
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def _open(self, name: str) -> int:
        with self._lock:
            fd = self._fds.get(name)
            if fd is not None:
                return fd
            path = self._paths.get(name)
            if path is None:
                raise UnsafeCheckpointError(f"{self.location}: no file {name!r} in this checkpoint")
            fd = open_plain(path)
            self._fds[name] = fd
            return fd

    def disk_files(self, files: Sequence[FileEntry]) -> list[tuple[str, int]]:
        """The checkpoint's files and their sizes, as ``metadata`` lists them: of its
        manifest's ``files``, those on disk (not the values held in memory, whose
        pseudo-file names such as ``<bytes values>`` name no file)."""
        return [(f.name, f.size) for f in files if f.name in self._paths]

    def read_bytes(self, name: str, max_bytes: int) -> bytes:
        size = self.file_size(name)
        if size > max_bytes:
            raise CheckpointCorruptError(
                f"{self._paths[name]} is {size} bytes, more than the {max_bytes} allowed")
        buf = bytearray(size)
        self.read_into(name, 0, [buf])
        return bytes(buf)

    def file_size(self, name: str) -> int:
        if name in self._memory:
            return len(self._memory[name])
        return os.fstat(self._open(name)).st_size

    def read_into(self, name: str, offset: int, buffers: Sequence[Buffer]) -> None:
        if name in self._memory:
            data = self._memory[name]
            for b in buffers:
                v = memoryview(b).cast("B")
                if offset + v.nbytes > len(data):
                    raise TruncatedFileError(f"{self.location}: {name} is too short")
                v[:] = data[offset:offset + v.nbytes]
                offset += v.nbytes
            return
        fd = self._open(name)
        try:
            end = preadv_all(fd, buffers, offset)
        except OSError as exc:
            raise TruncatedFileError(f"reading {self._paths[name]} failed: {exc}") from exc
        if end is not None:
            raise TruncatedFileError(
                f"{self._paths[name]} ends at byte {end}, before the data its header "
                "lists; the file is truncated"
            )

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
