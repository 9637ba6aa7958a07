"""Errors raised by statestream.

Every error derives from :class:`CheckpointError` and from the builtin it
refines, so ``except FileNotFoundError`` keeps working::

    CheckpointError (Exception)
    ├── CheckpointNotFoundError (FileNotFoundError)   no committed checkpoint at a path
    ├── CheckpointExistsError (FileExistsError)        saving over a checkpoint without overwrite
    ├── CheckpointCorruptError (ValueError)            bytes or manifest do not verify
    │   ├── ChecksumMismatchError                      a chunk's checksum differs
    │   ├── TruncatedFileError                         a data file is shorter than the manifest says
    │   └── UnsafeCheckpointError                      a manifest points outside the checkpoint
    ├── FormatVersionError (ValueError)                written by a newer, unknown format version
    ├── UnsupportedTypeError (TypeError)               a leaf statestream cannot save
    ├── PickleNotAllowedError (PermissionError)        a pickled leaf allow_pickle does not trust
    ├── TargetMismatchError (ValueError)               target shape/structure differs from saved
    ├── MissingKeyError (KeyError)                     target asks for a key the checkpoint lacks
    ├── StorageError (OSError)                         the storage backend failed
    └── DistributedError (RuntimeError)                another rank failed; names it
        └── CollectiveTimeoutError (TimeoutError)      a rank never reached a collective

Every message says what failed, where (key path and/or file) and what to do.
"""

from __future__ import annotations

__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "ChecksumMismatchError",
    "CollectiveTimeoutError",
    "DistributedError",
    "FormatVersionError",
    "MissingKeyError",
    "PickleNotAllowedError",
    "StorageError",
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


class StorageError(CheckpointError, OSError):
    """The storage backend failed to read, write, list or commit."""


class DistributedError(CheckpointError, RuntimeError):
    """A collective save/load failed on some rank; the message names which."""


class CollectiveTimeoutError(DistributedError, TimeoutError):
    """A rank did not reach a collective step within the configured timeout."""
