"""Pin the public API: ``__all__`` of statestream and of every subpackage.

Changing a public name is an API change; update this list on purpose.
"""

from __future__ import annotations

import importlib

import pytest

EXPECTED: dict[str, list[str]] = {
    "statestream": [
        "AllOf", "AnyOf", "AtSteps", "CheckpointManager", "EveryNSeconds", "EveryNSteps",
        "KeepAll", "KeepBest", "KeepEvery", "KeepLatest", "KeepUnion", "ManagerLockedError",
        "OnPreemption",
        "ArrayMetadata", "CheckpointCorruptError", "CheckpointError", "CheckpointExistsError",
        "CheckpointGoneError", "CheckpointMetadata", "CheckpointNotFoundError",
        "ChecksumMismatchError", "Compression",
        "CollectiveTimeoutError", "DistributedError",
        "FormatVersionError", "IOOptions", "InvalidOptionError", "InvalidOptionTypeError",
        "JaxCollective", "MemoryOptions", "MissingKeyError",
        "PickleNotAllowedError", "SaveHandle", "SingleProcess", "StorageError",
        "StoragePermissionError", "StorageTimeoutError", "TargetMismatchError",
        "TorchCollective", "TruncatedFileError",
        "UnsafeCheckpointError", "UnsupportedTypeError", "VerifyReport", "__version__",
        "guard_module", "guard_optimizer", "load", "metadata", "register_provider",
        "release_staging", "save", "save_async", "verify", "convert",
    ],
    "statestream.tree": [
        "CONTAINER_KINDS", "MAX_TREE_DEPTH", "Key", "KeyPath", "Node", "PytreeExpansion",
        "Stateful", "flatten", "format_keypath", "is_stateful", "match_keypath", "parse_keypath",
        "rebuild_container", "state_fields", "type_name",
    ],
    "statestream.format": [
        "ARRAY_TABLE_MIN", "CHECKSUM_ALGORITHM", "CODECS", "COMMIT_NAME", "DATA_DIR",
        "DTYPE_NAMES", "FORMAT_NAME", "FORMAT_VERSION", "FORMAT_VERSIONS",
        "MANIFEST_NAME",
        "MAX_ARRAYS", "MAX_ARRAY_BYTES",
        "MAX_CODEC_RATIO", "MAX_COMMIT_BYTES", "MAX_DIM",
        "MAX_FILES", "MAX_MANIFEST_BYTES", "MAX_NDIM", "ArrayEntry", "ChunkEntry", "ChunkRef",
        "Compression", "FileEntry",
        "Manifest", "check_max_arrays", "checksum", "checksum_of_blocks", "decode_commit",
        "decode_manifest",
        "decode_tree",
        "dtype_from_name", "dtype_name", "encode_commit", "encode_manifest", "encode_tree",
        "itemsize_of", "manifest_version", "over_max_arrays", "tiles_exactly",
        "validate_base_name", "validate_file_name",
    ],
    "statestream.storage": [
        "AzureOptions", "AzureStorage", "Buffer", "CheckpointReader", "FileWriter",
        "GCSOptions", "GCSStorage", "Lease", "Leftover",
        "LocalStorage", "MappedReader", "ReadAhead", "S3Options", "S3Storage", "Storage",
        "StorageCapabilities",
        "WriteTransaction", "WriterId", "collect_garbage", "file_where", "keep_part_buffers",
        "preadv_all",
        "release_part_buffers",
        "set_backend", "staging_dir", "storage_for",
    ],
    "statestream.plan": [
        "COMPRESSED_CHUNK_BYTES",
        "ArrayDecl", "ArrayShape", "ArraySpec", "FilePlan", "LoadPlan", "MergedTree", "RankPart",
        "RankTree",
        "ReadPiece",
        "ReadRequest", "StreamPlanner", "Wanted", "WriteItem", "assign_writers",
        "block_rows_for", "build_manifest", "chunk_offset", "coalesce", "manifest_matches",
        "merge_trees", "meta_matches",
        "plan_load", "plan_verify", "single_tree", "split_chunks",
    ],
    "statestream.engine": [
        "BackgroundTasks", "ByteBudget", "ChainReader", "CommittedSummary", "CompressionOption",
        "CompressionPolicy", "IOOptions", "MemoryOptions", "NodeGroups", "Progress",
        "SaveHandle", "SaveJob", "SaveOptions", "StagingPool", "StreamWriter", "TaskHandle",
        "check_base", "chunk_checksums", "committed_summary", "complete_copies",
        "copy_checkpoint",
        "default_memory_budget_bytes",
        "describe_copy",
        "follow_bases", "host_pool", "lower_thread_priority", "node_groups", "parallel_for",
        "pinned_pool", "read_budget", "read_committed", "read_manifest", "read_requests",
        "referred_to_by", "release_staging", "replicate_to_peers", "run_save", "saving_to",
        "start_save",
    ],
    "statestream.providers": [
        "ArrayProvider", "Destination", "JaxProvider", "NumpyProvider", "PreparedArray",
        "ProviderCapabilities", "StateAdapter", "TorchProvider", "adapter_by_name",
        "adapter_for", "adapters", "array_provider_for", "box_slices",
        "chunk_of_host_array", "find_box", "expand_pytree", "module_provider_for",
        "optimizer_provider_for",
        "pinned_alloc", "provider_by_kind", "providers", "rebuild_pytree", "register_adapter",
        "register_provider", "target_provider_for",
    ],
    "statestream.distributed": [
        "ByteChannel", "Collective", "JaxCollective", "SingleProcess", "TorchCollective",
        "agree", "any_of", "byte_channel", "default_collective", "forget_left", "gather_each",
        "note_left", "share_from_0",
    ],
    "statestream.api": [
        "ArrayMetadata", "CheckpointMetadata", "SaveHandle", "VerifyReport", "files_read",
        "guard_module", "guard_optimizer", "load", "metadata", "save", "save_async", "verify",
        "convert",
    ],
    "statestream.interop": [
        "FileSetReader", "ForeignCheckpoint", "MissingDependencyError", "detect_format",
        "open_foreign",
        "write_dcp", "write_orbax", "write_safetensors", "write_statestream", "write_torch",
    ],
    "statestream.cli": ["main"],
    "statestream.integrations.lightning": [
        "AsyncStatestreamCheckpointIO", "StatestreamCheckpointIO",
    ],
    "statestream.manager": [
        "AllOf", "AnyOf", "AtSteps", "CheckpointManager", "EveryNSeconds", "EveryNSteps",
        "KeepAll", "KeepBest", "KeepEvery", "KeepLatest", "KeepPolicy", "KeepUnion",
        "ManagerLockedError", "OnPreemption", "SaveContext", "SavePolicy", "StepInfo",
    ],
    "statestream.errors": [
        "CheckpointCorruptError", "CheckpointError", "CheckpointExistsError",
        "CheckpointGoneError", "CheckpointNotFoundError", "ChecksumMismatchError",
        "CollectiveTimeoutError",
        "DistributedError", "FormatVersionError", "InvalidOptionError",
        "InvalidOptionTypeError", "ManagerLockedError",
        "MissingKeyError", "PickleNotAllowedError", "StorageError", "StoragePermissionError",
        "StorageTimeoutError", "TargetMismatchError",
        "TruncatedFileError", "UnsafeCheckpointError", "UnsupportedTypeError",
    ],
}


@pytest.mark.parametrize("module_name", sorted(EXPECTED))
def test_all_is_pinned(module_name: str) -> None:
    module = importlib.import_module(module_name)
    assert sorted(module.__all__) == sorted(EXPECTED[module_name])
    assert len(set(module.__all__)) == len(module.__all__), "duplicate names in __all__"


@pytest.mark.parametrize("module_name", sorted(EXPECTED))
def test_every_exported_name_is_importable(module_name: str) -> None:
    module = importlib.import_module(module_name)
    namespace: dict[str, object] = {}
    exec(f"from {module_name} import *", namespace)  # noqa: S102
    for name in module.__all__:
        assert hasattr(module, name), f"{module_name}.{name} is in __all__ but missing"
        if name != "__version__":
            assert name in namespace


def test_top_level_errors_are_the_errors_module_classes() -> None:
    import statestream
    import statestream.errors as errors

    for name in errors.__all__:
        assert getattr(statestream, name) is getattr(errors, name)
        assert issubclass(getattr(errors, name), errors.CheckpointError)


def test_error_builtin_bases() -> None:
    import statestream.errors as e

    pairs = {
        e.CheckpointNotFoundError: FileNotFoundError,
        e.CheckpointExistsError: FileExistsError,
        e.CheckpointCorruptError: ValueError,
        e.ChecksumMismatchError: e.CheckpointCorruptError,
        e.TruncatedFileError: e.CheckpointCorruptError,
        e.CheckpointGoneError: e.TruncatedFileError,
        e.UnsafeCheckpointError: e.CheckpointCorruptError,
        e.FormatVersionError: ValueError,
        e.UnsupportedTypeError: TypeError,
        e.PickleNotAllowedError: PermissionError,
        e.TargetMismatchError: ValueError,
        e.MissingKeyError: KeyError,
        e.StorageError: OSError,
    }
    for cls, base in pairs.items():
        assert issubclass(cls, base), (cls, base)
    assert str(e.MissingKeyError("key 'a' is missing")) == "key 'a' is missing"
    assert str(e.StorageError("disk full")) == "disk full"
    assert str(e.CheckpointError()) == "CheckpointError"


def test_testing_package_imports_hypothesis_only_for_strategies() -> None:
    import subprocess
    import sys

    code = ("import sys, statestream.testing, statestream.testing.faults; "
            "assert 'hypothesis' not in sys.modules; "
            "statestream.testing.dtypes; assert 'hypothesis' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
