"""Planning: pure functions from what is saved/wanted to byte-level work items."""

from statestream.plan._load import (
    ReadPiece,
    ReadRequest,
    Wanted,
    coalesce,
    plan_load,
    plan_verify,
)
from statestream.plan._manifest import (
    ArrayDecl,
    ArrayShape,
    MergedTree,
    RankPart,
    RankTree,
    build_manifest,
    manifest_matches,
    merge_trees,
    single_tree,
)
from statestream.plan._save import (
    COMPRESSED_CHUNK_BYTES,
    ArraySpec,
    FilePlan,
    StreamPlanner,
    WriteItem,
    assign_writers,
    block_rows_for,
    chunk_offset,
    split_chunks,
)

__all__ = [
    "COMPRESSED_CHUNK_BYTES",
    "ArrayDecl",
    "ArrayShape",
    "MergedTree",
    "RankPart",
    "RankTree",
    "build_manifest",
    "manifest_matches",
    "merge_trees",
    "single_tree",
    "ArraySpec",
    "FilePlan",
    "ReadPiece",
    "ReadRequest",
    "StreamPlanner",
    "Wanted",
    "WriteItem",
    "assign_writers",
    "block_rows_for",
    "chunk_offset",
    "coalesce",
    "plan_load",
    "plan_verify",
    "split_chunks",
]
