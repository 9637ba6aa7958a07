"""The engine: the only layer that owns threads, queues, buffers and the save job."""

from statestream.engine._chain import ChainReader, follow_bases
from statestream.engine._codec import CompressionOption, CompressionPolicy
from statestream.engine._copy import copy_checkpoint, read_committed
from statestream.engine._core import (
    ByteBudget,
    IOOptions,
    MemoryOptions,
    Progress,
    default_memory_budget_bytes,
    lower_thread_priority,
    parallel_for,
)
from statestream.engine._handle import SaveHandle
from statestream.engine._job import SaveJob, SaveOptions
from statestream.engine._nodelocal import NodeGroups, node_groups
from statestream.engine._read import read_requests
from statestream.engine._readbudget import read_budget, saving_to
from statestream.engine._recent import CommittedSummary, committed_summary
from statestream.engine._refs import check_base, read_manifest, referred_to_by
from statestream.engine._staging import StagingPool, host_pool, pinned_pool, release_staging
from statestream.engine._start import run_save, start_save
from statestream.engine._tasks import BackgroundTasks, TaskHandle
from statestream.engine._transfer import complete_copies, describe_copy, replicate_to_peers
from statestream.engine._write import StreamWriter, chunk_checksums

__all__ = [
    "check_base",
    "BackgroundTasks",
    "ByteBudget",
    "ChainReader",
    "CommittedSummary",
    "CompressionOption",
    "CompressionPolicy",
    "IOOptions",
    "MemoryOptions",
    "NodeGroups",
    "Progress",
    "SaveHandle",
    "SaveJob",
    "SaveOptions",
    "StagingPool",
    "StreamWriter",
    "TaskHandle",
    "chunk_checksums",
    "committed_summary",
    "complete_copies",
    "copy_checkpoint",
    "default_memory_budget_bytes",
    "describe_copy",
    "follow_bases",
    "host_pool",
    "lower_thread_priority",
    "node_groups",
    "parallel_for",
    "pinned_pool",
    "read_manifest",
    "read_committed",
    "read_budget",
    "read_requests",
    "referred_to_by",
    "release_staging",
    "replicate_to_peers",
    "run_save",
    "saving_to",
    "start_save",
]
