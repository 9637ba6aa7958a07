"""The engine: the only layer that owns threads, queues and buffers."""

from statestream.engine._io import (
    ByteBudget,
    IOOptions,
    MemoryOptions,
    Progress,
    StreamWriter,
    chunk_checksums,
    default_memory_budget_bytes,
    parallel_for,
    read_requests,
    write_files,
)

__all__ = [
    "ByteBudget",
    "IOOptions",
    "MemoryOptions",
    "Progress",
    "StreamWriter",
    "chunk_checksums",
    "default_memory_budget_bytes",
    "parallel_for",
    "read_requests",
    "write_files",
]
