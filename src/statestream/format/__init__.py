"""The on-disk format (v1): manifest schema, dtypes, checksums and limits.

``docs/format.md`` is the specification; this package enforces it.
"""

from statestream.format._checksum import CHECKSUM_ALGORITHM, checksum
from statestream.format._dtypes import DTYPE_NAMES, dtype_from_name, dtype_name, itemsize_of
from statestream.format._manifest import (
    COMMIT_NAME,
    DATA_DIR,
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_NAME,
    MAX_ARRAY_BYTES,
    MAX_COMMIT_BYTES,
    MAX_DIM,
    MAX_FILES,
    MAX_MANIFEST_BYTES,
    MAX_NDIM,
    ArrayEntry,
    ChunkEntry,
    ChunkRef,
    FileEntry,
    Manifest,
    decode_commit,
    decode_manifest,
    decode_tree,
    encode_commit,
    encode_manifest,
    encode_tree,
    validate_file_name,
)

__all__ = [
    "CHECKSUM_ALGORITHM",
    "COMMIT_NAME",
    "DATA_DIR",
    "DTYPE_NAMES",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "MAX_ARRAY_BYTES",
    "MAX_COMMIT_BYTES",
    "MAX_DIM",
    "MAX_FILES",
    "MAX_MANIFEST_BYTES",
    "MAX_NDIM",
    "ArrayEntry",
    "ChunkEntry",
    "ChunkRef",
    "FileEntry",
    "Manifest",
    "checksum",
    "decode_commit",
    "decode_manifest",
    "decode_tree",
    "dtype_from_name",
    "dtype_name",
    "encode_commit",
    "encode_manifest",
    "encode_tree",
    "itemsize_of",
    "validate_file_name",
]
