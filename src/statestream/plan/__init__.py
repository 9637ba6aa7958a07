"""Planning: pure functions from what is saved/wanted to byte-level work items."""

from statestream.plan._load import (
    ReadPiece,
    ReadRequest,
    Wanted,
    coalesce,
    plan_load,
    plan_verify,
)
from statestream.plan._save import (
    ArraySpec,
    FilePlan,
    SavePlan,
    StreamPlanner,
    WriteItem,
    assign_writers,
    block_rows_for,
    plan_save,
    split_chunks,
)

__all__ = [
    "ArraySpec",
    "FilePlan",
    "ReadPiece",
    "ReadRequest",
    "SavePlan",
    "StreamPlanner",
    "Wanted",
    "WriteItem",
    "assign_writers",
    "block_rows_for",
    "coalesce",
    "plan_load",
    "plan_save",
    "plan_verify",
    "split_chunks",
]
