"""Storage backends: where checkpoint bytes live.

``Storage`` is the protocol; ``LocalStorage`` is the POSIX fast path.
``storage_for(path)`` picks the backend for a path or URL; ``collect_garbage``
removes the staging areas of saves whose writers died.
"""

from statestream.storage._azure import AzureOptions, AzureStorage
from statestream.storage._base import (
    Buffer,
    CheckpointReader,
    FileWriter,
    Lease,
    Leftover,
    MappedReader,
    Storage,
    StorageCapabilities,
    WriterId,
    WriteTransaction,
    file_where,
)
from statestream.storage._gcs import GCSOptions, GCSStorage
from statestream.storage._iov import preadv_all
from statestream.storage._leftovers import collect_garbage
from statestream.storage._local import LocalStorage
from statestream.storage._local_lease import staging_dir
from statestream.storage._object_write import keep_part_buffers, release_part_buffers
from statestream.storage._readahead import ReadAhead
from statestream.storage._resolve import set_backend, storage_for
from statestream.storage._s3 import S3Options, S3Storage

__all__ = [
    "AzureOptions",
    "AzureStorage",
    "Buffer",
    "CheckpointReader",
    "FileWriter",
    "GCSOptions",
    "GCSStorage",
    "Lease",
    "Leftover",
    "LocalStorage",
    "MappedReader",
    "ReadAhead",
    "S3Options",
    "S3Storage",
    "Storage",
    "StorageCapabilities",
    "WriteTransaction",
    "WriterId",
    "keep_part_buffers",
    "preadv_all",
    "release_part_buffers",
    "collect_garbage",
    "file_where",
    "set_backend",
    "staging_dir",
    "storage_for",
]
