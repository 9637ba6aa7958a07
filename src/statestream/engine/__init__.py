"""The engine: the only layer that owns threads, queues and buffers."""

from statestream.engine._core import (
    ByteBudget,
    IOOptions,
    MemoryOptions,
    Progress,
    default_memory_budget_bytes,
    parallel_for,
)
from statestream.engine._read import read_requests
from statestream.engine._write import StreamWriter, chunk_checksums, write_files

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
