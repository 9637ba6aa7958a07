"""The public, synchronous API: save, load, metadata, verify."""

from statestream.api._async import SaveHandle, guard_module, guard_optimizer, save_async
from statestream.api._convert import convert
from statestream.api._inspect import (
    ArrayMetadata,
    CheckpointMetadata,
    VerifyReport,
    metadata,
    verify,
)
from statestream.api._load import files_read, load
from statestream.api._save import save

__all__ = [
    "ArrayMetadata",
    "CheckpointMetadata",
    "SaveHandle",
    "VerifyReport",
    "convert",
    "files_read",
    "guard_module",
    "guard_optimizer",
    "load",
    "metadata",
    "save",
    "save_async",
    "verify",
]
