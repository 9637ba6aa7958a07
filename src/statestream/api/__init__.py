"""The public, synchronous API: save, load, metadata, verify."""

from statestream.api._inspect import (
    ArrayMetadata,
    CheckpointMetadata,
    VerifyReport,
    metadata,
    verify,
)
from statestream.api._load import load
from statestream.api._save import save

__all__ = [
    "ArrayMetadata",
    "CheckpointMetadata",
    "VerifyReport",
    "load",
    "metadata",
    "save",
    "verify",
]
