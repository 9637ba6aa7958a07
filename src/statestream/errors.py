"""Errors raised by statestream.

Every error derives from :class:`CheckpointError` and, where one matches, from
the builtin it refines, so ``except FileNotFoundError`` keeps working (some,
such as a missing incremental base, are a bare ``CheckpointError``)::

    CheckpointError (Exception)
    ├── CheckpointNotFoundError (FileNotFoundError)   no committed checkpoint at a path
    ├── CheckpointExistsError (FileExistsError)        saving over a checkpoint without overwrite
    ├── CheckpointCorruptError (ValueError)            bytes or manifest do not verify
    │   ├── ChecksumMismatchError                      a chunk's checksum differs
    │   ├── TruncatedFileError                         a data file is shorter than the manifest says
    │   │   └── CheckpointGoneError                    overwritten or deleted while being read
    │   └── UnsafeCheckpointError                      a manifest points outside the checkpoint
    ├── FormatVersionError (ValueError)                written by a newer, unknown format version
    ├── UnsupportedTypeError (TypeError)               a leaf statestream cannot save
    ├── PickleNotAllowedError (PermissionError)        a pickled leaf allow_pickle does not trust
    ├── TargetMismatchError (ValueError)               target shape/structure differs from saved
    ├── MissingKeyError (KeyError)                     target asks for a key the checkpoint lacks
    ├── InvalidOptionError (ValueError)                an argument or option has a bad value
    ├── InvalidOptionTypeError (TypeError)             an argument or option has the wrong type
    ├── StorageError (OSError)                         the storage backend failed; carries
    │   │                                              the OS error's errno (EROFS, ENOSPC, ...)
    │   ├── StoragePermissionError (PermissionError)   EACCES / EPERM / HTTP 403
    │   ├── StorageTimeoutError (TimeoutError)         ETIMEDOUT / a request timed out
    │   └── ManagerLockedError (BlockingIOError)       another manager holds the directory's lease
    └── DistributedError (RuntimeError)                another rank failed; names it
        └── CollectiveTimeoutError (TimeoutError)      a rank never reached a collective

Every message says what failed, where (key path and/or file) and what to do.

A caller's mistake in arguments (a ``mode`` that is neither ``"min"`` nor
``"max"``, a negative step, ``allow_pickle`` given a number) raises
:class:`InvalidOptionError` or :class:`InvalidOptionTypeError`: still a
``ValueError`` / ``TypeError`` for code that catches those, and a
``CheckpointError`` for code that catches everything statestream raises.
They are not about a checkpoint's contents: a target that does not fit the
checkpoint is a :class:`TargetMismatchError`, a value that cannot be saved an
:class:`UnsupportedTypeError`.
"""

from __future__ import annotations

import os as _os

__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointGoneError",
    "CheckpointNotFoundError",
    "ChecksumMismatchError",
    "CollectiveTimeoutError",
    "DistributedError",
    "FormatVersionError",
    "InvalidOptionError",
    "InvalidOptionTypeError",
    "ManagerLockedError",
    "MissingKeyError",
    "PickleNotAllowedError",
    "StorageError",
    "StoragePermissionError",
    "StorageTimeoutError",
    "TargetMismatchError",
    "TruncatedFileError",
    "UnsafeCheckpointError",
    "UnsupportedTypeError",
]


class CheckpointError(Exception):
    """Root of every error statestream raises."""

    def __str__(self) -> str:
        # KeyError and OSError format their args oddly; always show the message.
        return str(self.args[0]) if self.args else self.__class__.__name__


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No committed checkpoint exists at the given path."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """A checkpoint already exists where a save was asked to write."""


class CheckpointCorruptError(CheckpointError, ValueError):
    """The checkpoint's bytes or manifest fail verification."""


class ChecksumMismatchError(CheckpointCorruptError):
    """A chunk's bytes do not match the checksum recorded in the manifest."""


class TruncatedFileError(CheckpointCorruptError):
    """A data file is missing or shorter than the manifest says."""


class CheckpointGoneError(TruncatedFileError):
    """The checkpoint was overwritten or deleted while being read: not damage (the
    files it lacks went with it); load it again. A ``TruncatedFileError`` for code
    that caught the missing files as one before."""


class UnsafeCheckpointError(CheckpointCorruptError):
    """The manifest references something outside the checkpoint directory."""


class FormatVersionError(CheckpointError, ValueError):
    """The checkpoint uses a format version this statestream cannot read."""


class UnsupportedTypeError(CheckpointError, TypeError):
    """A value in the state has a type statestream cannot save."""


class PickleNotAllowedError(CheckpointError, PermissionError):
    """A pickled leaf sits at a key path that the caller's ``allow_pickle`` does not trust."""


class TargetMismatchError(CheckpointError, ValueError):
    """The target's structure, shape or type does not match the checkpoint."""


class MissingKeyError(CheckpointError, KeyError):
    """The target (or ``items=``) names a key the checkpoint does not hold."""


class InvalidOptionError(CheckpointError, ValueError):
    """An argument or option has a value statestream does not accept (names it and the choices)."""


class InvalidOptionTypeError(CheckpointError, TypeError):
    """An argument or option has a type statestream does not accept, or is not accepted at all."""


class StorageError(CheckpointError, OSError):
    """The storage backend failed to read, write, list or commit."""


class StoragePermissionError(StorageError, PermissionError):
    """The backend refused access (EACCES, EPERM, an HTTP 403)."""


class StorageTimeoutError(StorageError, TimeoutError):
    """A storage request did not complete in time (ETIMEDOUT, a client timeout)."""


class ManagerLockedError(StorageError, BlockingIOError):
    """Another CheckpointManager holds the lease on this directory."""


_BY_BUILTIN: dict[type[OSError], type[StorageError]] = {
    OSError: StorageError,
    PermissionError: StoragePermissionError,
    TimeoutError: StorageTimeoutError,
}


def _refine(builtin: type[OSError]) -> type[StorageError]:
    name = f"Storage{builtin.__name__}"
    cls = type(name, (StorageError, builtin), {
        "__module__": __name__, "__qualname__": name,
        "__doc__": f"A StorageError that is a {builtin.__name__} (made by storage_error).",
    })
    globals()[name] = cls  # importable by name, so it pickles
    return cls


# The other builtin OSError subclasses an errno maps to, refined once at import.
for _builtin in (BlockingIOError, ChildProcessError, BrokenPipeError, ConnectionAbortedError,
                 ConnectionRefusedError, ConnectionResetError, FileExistsError,
                 FileNotFoundError, InterruptedError, IsADirectoryError, NotADirectoryError,
                 ProcessLookupError):
    _BY_BUILTIN[_builtin] = _refine(_builtin)


def _class_for(code: int) -> type[StorageError]:
    """StorageError refined by the builtin Python maps ``code`` to (EEXIST: FileExistsError)."""
    return _BY_BUILTIN.get(type(OSError(code, "")), StorageError)


def storage_error(message: str, err: int | OSError | None) -> StorageError:
    """A StorageError for an OS-level failure, carrying its ``errno`` and builtin class.

    ``err`` is the errno or the OSError that caused it. The result is an instance
    of the builtin Python maps the errno to (EACCES: PermissionError, EEXIST:
    FileExistsError, ETIMEDOUT: TimeoutError, EROFS/ENOSPC/EIO: OSError) and has
    ``.errno``/``.strerror`` set, so ``exc.errno == errno.EROFS`` works as for any
    OSError.

    Example:
        >>> import errno
        >>> e = storage_error("writing /ro/ckpt failed", errno.EACCES)
        >>> isinstance(e, PermissionError), e.errno == errno.EACCES, str(e)
        (True, True, 'writing /ro/ckpt failed')
    """
    code = err.errno if isinstance(err, OSError) else err
    if code is None:
        return StorageError(message)
    exc = _class_for(code)(message)
    exc.errno = code
    exc.strerror = _os.strerror(code)
    return exc


class DistributedError(CheckpointError, RuntimeError):
    """A collective save/load failed on some rank; the message names which.

    ``failed_types`` holds the class names of the failing ranks' errors (the
    same on every rank; empty when a collective itself failed), so every rank
    can tell what went wrong the same way, e.g. damage (a
    ``ChecksumMismatchError`` on the rank that read it) from a dead peer.
    """

    failed_types: tuple[str, ...] = ()


class CollectiveTimeoutError(DistributedError, TimeoutError):
    """A rank did not reach a collective step within the configured timeout."""
