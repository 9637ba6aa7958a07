"""The engine: the only layer that owns threads, queues and buffers."""

from statestream.engine._core import (
    ByteBudget,
    IOOptions,
    MemoryOptions,
    Progress,
    default_memory_budget_bytes,
    lower_thread_priority,
    parallel_for,
)
from statestream.engine._read import read_requests
from statestream.engine._staging import StagingPool, host_pool, pinned_pool, release_staging
from statestream.engine._write import StreamWriter, chunk_checksums, write_files

__all__ = [
    "ByteBudget",
    "IOOptions",
    "MemoryOptions",
    "Progress",
    "StagingPool",
    "StreamWriter",
    "chunk_checksums",
    "default_memory_budget_bytes",
    "host_pool",
    "lower_thread_priority",
    "parallel_for",
    "pinned_pool",
    "read_requests",
    "release_staging",
    "write_files",
]
