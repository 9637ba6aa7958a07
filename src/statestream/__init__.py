"""statestream: fast, safe checkpoints of whole training states.

Example:
    >>> import numpy as np, tempfile, os, statestream as ss
    >>> path = os.path.join(tempfile.mkdtemp(), "step-1")
    >>> ss.save(path, {"params": {"w": np.ones((2, 2), np.float32)}, "step": 1})
    >>> ss.load(path)["params"]["w"].shape
    (2, 2)
"""

from statestream._version import __version__
from statestream.api import (
    ArrayMetadata,
    CheckpointMetadata,
    SaveHandle,
    VerifyReport,
    convert,
    guard_module,
    guard_optimizer,
    load,
    metadata,
    save,
    save_async,
    verify,
)
from statestream.distributed import JaxCollective, SingleProcess, TorchCollective
from statestream.engine import IOOptions, MemoryOptions, release_staging
from statestream.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointGoneError,
    CheckpointNotFoundError,
    ChecksumMismatchError,
    CollectiveTimeoutError,
    DistributedError,
    FormatVersionError,
    InvalidOptionError,
    InvalidOptionTypeError,
    MissingKeyError,
    PickleNotAllowedError,
    StorageError,
    StoragePermissionError,
    StorageTimeoutError,
    TargetMismatchError,
    TruncatedFileError,
    UnsafeCheckpointError,
    UnsupportedTypeError,
)
from statestream.format import Compression
from statestream.manager import (
    AllOf,
    AnyOf,
    AtSteps,
    CheckpointManager,
    EveryNSeconds,
    EveryNSteps,
    KeepAll,
    KeepBest,
    KeepEvery,
    KeepLatest,
    KeepUnion,
    ManagerLockedError,
    OnPreemption,
)
from statestream.providers import register_provider

__all__ = [
    "AllOf",
    "AnyOf",
    "ArrayMetadata",
    "AtSteps",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointGoneError",
    "CheckpointManager",
    "CheckpointMetadata",
    "CheckpointNotFoundError",
    "Compression",
    "ChecksumMismatchError",
    "CollectiveTimeoutError",
    "DistributedError",
    "EveryNSeconds",
    "EveryNSteps",
    "FormatVersionError",
    "IOOptions",
    "InvalidOptionError",
    "InvalidOptionTypeError",
    "MemoryOptions",
    "MissingKeyError",
    "OnPreemption",
    "JaxCollective",
    "KeepAll",
    "KeepBest",
    "KeepEvery",
    "KeepLatest",
    "KeepUnion",
    "ManagerLockedError",
    "PickleNotAllowedError",
    "SaveHandle",
    "SingleProcess",
    "StorageError",
    "StoragePermissionError",
    "StorageTimeoutError",
    "TargetMismatchError",
    "TorchCollective",
    "TruncatedFileError",
    "UnsafeCheckpointError",
    "UnsupportedTypeError",
    "VerifyReport",
    "__version__",
    "convert",
    "guard_module",
    "guard_optimizer",
    "load",
    "metadata",
    "register_provider",
    "release_staging",
    "save",
    "save_async",
    "verify",
]
