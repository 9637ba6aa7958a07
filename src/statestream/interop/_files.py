"""A read-only view of a fixed set of local files (the files of a foreign checkpoint)."""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence

from statestream.errors import CheckpointCorruptError, TruncatedFileError, UnsafeCheckpointError
from statestream.storage import Buffer, preadv_all

__all__ = ["FileSetReader"]



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
            try:
                fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | os.O_CLOEXEC)
            except OSError as exc:
                raise TruncatedFileError(f"cannot open {path}: {exc}") from exc
            self._fds[name] = fd
            return fd

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
