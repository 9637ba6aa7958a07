"""``metadata`` (no data read) and ``verify`` (every byte re-read and checked)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator
from typing import Any

from statestream._gc import gc_paused
from statestream.api._load import array_paths
from statestream.api._open import open_checkpoint, skip_missing_checksums
from statestream.api._options import (
    bool_option,
    io_options,
    max_arrays_option,
    memory_options,
    path_arg,
)
from statestream.engine import IOOptions, MemoryOptions, Progress, read_budget, read_requests
from statestream.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointGoneError,
    CheckpointNotFoundError,
    FormatVersionError,
    InvalidOptionError,
    InvalidOptionTypeError,
    PickleNotAllowedError,
    StorageError,
    UnsupportedTypeError,
)
from statestream.format import COMMIT_NAME, DATA_DIR, MANIFEST_NAME, Manifest, over_max_arrays
from statestream.interop import FileSetReader, MissingDependencyError
from statestream.plan import ReadPiece, ReadRequest, coalesce, plan_verify
from statestream.storage import CheckpointReader, file_where
from statestream.tree import KeyPath, Node, format_keypath

__all__ = ["ArrayMetadata", "CheckpointMetadata", "VerifyReport", "leaf_paths", "metadata",
           "verify"]


@dataclasses.dataclass(frozen=True)
class ArrayMetadata:
    """Shape, dtype and size of a saved array (``kind`` says numpy/torch/jax/bytes/pickle).

    ``nbytes`` is its raw size; ``stored_bytes`` what its chunks take in the data
    files (less when compressed); ``codec`` the codec of its compressed chunks
    (``"zstd"``), or None when every chunk is stored raw.
    """

    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    kind: str
    num_chunks: int
    stored_bytes: int = 0
    codec: str | None = None


@dataclasses.dataclass(frozen=True)
class CheckpointMetadata:
    """What a checkpoint holds, from its manifest alone.

    ``tree`` mirrors the saved state: dicts (also for namedtuples,
    dataclasses, pytrees and stateful objects), lists and tuples, with
    :class:`ArrayMetadata` for arrays and the plain values themselves.
    """

    path: str
    format_version: int
    tree: Any
    total_bytes: int
    num_arrays: int
    files: list[tuple[str, int]]
    meta: dict[str, Any]
    #: ``"statestream"``, or the foreign format read (docs/interop.md)
    format: str = "statestream"
    #: the sibling checkpoints it refers to (an incremental save): loading it needs them
    bases: list[str] = dataclasses.field(default_factory=list)
    #: bytes of its chunks stored in those bases rather than in its own files
    referenced_bytes: int = 0

    def leaves(self) -> Iterator[tuple[str, Any]]:
        """Yield ``(key path, leaf)`` for every leaf, depth first."""
        for p, x in leaf_paths(self.tree):
            yield format_keypath(p), x


def leaf_paths(tree: Any, p: KeyPath = ()) -> Iterator[tuple[KeyPath, Any]]:
    """``(key path, leaf)`` for every leaf of a metadata tree, depth first, the key path
    as its keys (``CheckpointMetadata.leaves`` formats them; ``diff`` needs their types).
    """
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from leaf_paths(v, p + (k,))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from leaf_paths(v, p + (i,))
    else:
        yield p, tree


def _meta_tree(node: Node, m: Manifest) -> Any:
    if node.kind in ("array", "alias", "bytes", "pickle"):
        assert node.array is not None
        a = m.arrays[node.array]
        kind = (node.kind if node.kind not in ("array", "alias")
                else str((node.attrs or {}).get("kind", "numpy")))
        codecs = sorted({c.codec for c in a.chunks if c.codec is not None})
        return ArrayMetadata(a.shape, a.dtype, a.nbytes, kind, len(a.chunks),
                             sum(c.nbytes for c in a.chunks), "+".join(codecs) or None)
    if node.kind in ("none", "bool", "int", "float", "str"):
        return node.value
    if node.kind == "stateful":
        return _meta_tree((node.children or [])[0], m)
    kids = [_meta_tree(c, m) for c in node.children or []]
    if node.kind == "list":
        return kids
    if node.kind == "tuple":
        return tuple(kids)
    return dict(zip(node.keys or [], kids))


def metadata(path: str | os.PathLike[str], *, allow_pickle: bool = False,
             max_arrays: int | None = None) -> CheckpointMetadata:
    """Describe a checkpoint without reading tensor data.

    ``allow_pickle``: let a torch.save/DCP checkpoint's pickle name globals a
    weights-only load refuses (as ``load``'s; only for files you trust). A
    statestream checkpoint's pickled leaves are described, never unpickled.

    ``max_arrays``: refuse (``CheckpointError``, naming the manifest) a checkpoint
    of more arrays before they are decoded, as ``load``'s (default: the format's 2^24).

    Example:
        >>> import numpy as np, tempfile, os, statestream as ss
        >>> d = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> ss.save(d, {"w": np.zeros((2, 3), np.float32)})
        >>> ss.metadata(d).tree["w"]  # doctest: +NORMALIZE_WHITESPACE
        ArrayMetadata(shape=(2, 3), dtype='float32', nbytes=24, kind='numpy', num_chunks=1,
                      stored_bytes=24, codec=None)
    """
    with gc_paused():  # a large manifest is many small objects (see statestream._gc)
        reader, m = open_checkpoint(path_arg(path, "path"), follow=False,
                                    allow_pickle=bool_option(allow_pickle, "allow_pickle"),
                                    max_arrays=max_arrays_option(max_arrays))
        reader.close()
        return _describe(reader, m)


def _describe(reader: CheckpointReader, m: Manifest) -> CheckpointMetadata:
    where = reader.location  # a foreign checkpoint's reader has the path as given
    return CheckpointMetadata(
        path=where if "://" in where else os.path.abspath(where),
        format_version=m.version,
        tree=_meta_tree(m.tree, m),
        total_bytes=sum(a.nbytes for a in m.arrays),
        num_arrays=len(m.arrays),
        files=(reader.disk_files(m.files) if isinstance(reader, FileSetReader)
               else [(f.name, f.size) for f in m.files]),
        meta=dict(m.meta),
        format=reader.format if isinstance(reader, FileSetReader) else "statestream",
        bases=list(m.bases),
        referenced_bytes=sum(c.nbytes for a in m.arrays for c in a.chunks if c.ref is not None)
        if m.bases else 0,
    )


@dataclasses.dataclass
class VerifyReport:
    """Result of :func:`verify`: ``ok`` is True when nothing is damaged."""

    path: str
    checked_chunks: int = 0
    checked_bytes: int = 0
    problems: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _unlisted(reader: CheckpointReader, m: Manifest) -> list[str]:
    """A problem for every file of the checkpoint that its manifest does not list."""
    list_files = getattr(reader, "list_files", None)
    if list_files is None:  # a backend that cannot list: nothing to compare
        return []
    expected = {COMMIT_NAME, MANIFEST_NAME, DATA_DIR} | {f.name for f in m.files}
    return [
        f"{file_where(reader, name)} is in the checkpoint but not listed in its manifest "
        "(added after the save?)"
        for name in sorted(set(list_files()) - expected)
    ]


def _size_problems(reader: CheckpointReader, m: Manifest) -> dict[int, tuple[str, int]]:
    """A problem for every data file shorter or longer than the manifest lists, or
    unreadable (missing), by file index, with the bytes it holds (-1: none can be read)."""
    out: dict[int, tuple[str, int]] = {}
    for i, f in enumerate(m.files):
        try:
            size = reader.file_size(f.name)
        except (StorageError, CheckpointGoneError):
            raise
        except CheckpointError as exc:
            out[i] = (str(exc), -1)
            continue
        if size < f.size:
            out[i] = (f"data file {file_where(reader, f.name)} is {size} bytes, the manifest "
                      f"says {f.size}; it is truncated", size)
        elif size > f.size:
            out[i] = (f"data file {file_where(reader, f.name)} is {size} bytes, longer than the "
                      f"{f.size} the manifest lists; {size - f.size} bytes were added after "
                      "the save", size)
    return out


def _cut_off(requests: list[ReadRequest], short: dict[int, tuple[str, int]],
             describe: Callable[[ReadPiece], str], max_request_bytes: int
             ) -> tuple[list[str], list[ReadRequest]]:
    """One problem per short or unreadable file, naming the arrays whose chunks it lacks,
    and the requests for the chunks left to read: a chunk the file cannot hold is not
    read again, whose error would report the same file a second time."""
    lost: dict[int, list[ReadPiece]] = {}
    kept: list[ReadPiece] = []
    for p in (p for r in requests for p in r.pieces):
        s = short.get(p.file, (None, 1 << 62))[1]
        if p.offset + p.nbytes > s:
            lost.setdefault(p.file, []).append(p)
        else:
            kept.append(p)
    problems = []
    for i, (msg, _) in short.items():
        names = "; ".join(sorted({describe(p) for p in lost.get(i, [])})[:5])
        problems.append(f"{msg} (affects {names})" if names else msg)
    if not lost:
        return problems, requests
    return problems, coalesce(kept, max_request_bytes=max_request_bytes)


#: what opening a checkpoint raises that says nothing of its bytes: :func:`verify` raises
#: it (``statestream verify`` exits 2) rather than report damage (exit 1)
_NOT_DAMAGE = (CheckpointNotFoundError, CheckpointGoneError, StorageError, PickleNotAllowedError,
               UnsupportedTypeError, InvalidOptionError, InvalidOptionTypeError,
               FormatVersionError, MissingDependencyError)


def verify(
    path: str | os.PathLike[str],
    *,
    allow_pickle: bool = False,
    io: IOOptions | None = None,
    memory: MemoryOptions | None = None,
    progress: Progress | None = None,
    max_arrays: int | None = None,
) -> VerifyReport:
    """Re-read every chunk of a checkpoint and check sizes and checksums.

    Damage is collected, not raised: the report lists every broken array
    with its key path and file, every data file longer or shorter than the
    manifest lists, and every file in the checkpoint the manifest does not
    list. A committed checkpoint whose manifest cannot be read at all is
    reported as one problem.

    ``allow_pickle``: let a torch.save/DCP checkpoint's pickle name globals a
    weights-only load refuses (as ``load``'s; only for files you trust).
    Pickled leaves of a statestream checkpoint are checked as bytes, never
    unpickled.

    ``max_arrays``: refuse a checkpoint (or an incremental checkpoint's base) whose
    manifest declares more arrays, before they are decoded, as ``load``'s
    (default: the format's 2^24).

    What is not damage is raised, as ``statestream verify`` exits 2 for it
    rather than 1:

    Raises:
        CheckpointNotFoundError: no committed checkpoint at ``path`` (nothing
            there, a save that never committed, one deleted before or while it
            was opened): as :func:`load` and :func:`metadata` raise it.
        CheckpointGoneError: the checkpoint was overwritten or deleted while
            being verified: what it lacks went with it.
        StorageError: the store could not be read (unreachable, a timeout, access
            denied, a missing bucket): that says nothing about the checkpoint's
            bytes.
        PickleNotAllowedError: a torch.save/DCP checkpoint's pickle names a
            global that ``allow_pickle=False`` refuses.
        UnsupportedTypeError: the checkpoint holds what statestream cannot
            represent (a sparse tensor, a dtype it does not hold), or ``path`` is a
            file in a format it does not read (a legacy torch.save file, a data file).
        FormatVersionError: written by a format version (or with a codec) this
            statestream does not know: upgrade it.
        MissingDependencyError: the format needs an optional library that is not
            installed (orbax-checkpoint: ``statestream[orbax]``).
        InvalidOptionError, InvalidOptionTypeError: an argument statestream does
            not take (an empty path; an Orbax CheckpointManager step of several
            items, where one item's directory is what can be read).
        CheckpointError: a manifest of more arrays than ``max_arrays`` (the bound
            refused it; the checkpoint is not damaged).

    Example:
        >>> import numpy as np, tempfile, os, statestream as ss
        >>> d = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> ss.save(d, {"w": np.arange(4)})
        >>> ss.verify(d).ok
        True
    """
    io, memory = io_options(io), memory_options(memory)
    allow_pickle = bool_option(allow_pickle, "allow_pickle")
    limit = max_arrays_option(max_arrays)
    report = VerifyReport(path=os.fspath(path_arg(path, "path")))
    try:
        reader, m = open_checkpoint(path, allow_pickle=allow_pickle, max_arrays=limit)
    except _NOT_DAMAGE:
        raise  # nothing to verify, the store failed, or statestream will not read it
    except CheckpointError as exc:
        if over_max_arrays(exc):
            raise  # the caller's bound refused it: nothing was read, nothing is damaged
        report.problems.append(str(exc))
        return report
    try:
        _check(reader, m, report, io, memory, progress)
    finally:
        reader.close()
    return report


def _check(reader: CheckpointReader, m: Manifest, report: VerifyReport, io: IOOptions,
           memory: MemoryOptions, progress: Progress | None) -> None:
    """Re-read every chunk of the open checkpoint ``reader`` (manifest ``m``) and check
    the sizes of its files: what is damaged goes to ``report.problems``."""
    paths: dict[int, KeyPath] = {}
    array_paths(m.tree, (), paths)
    names = [f.name for f in m.files]
    requests = plan_verify(m.arrays, max_request_bytes=io.max_request_bytes)
    skip_missing_checksums(reader, requests)

    def describe(p: ReadPiece) -> str:
        return f"array at key path '{format_keypath(paths.get(p.array, ()))}'"

    problems, to_read = _cut_off(requests, _size_problems(reader, m), describe,
                                 io.max_request_bytes)
    report.problems.extend(problems)
    report.problems.extend(_unlisted(reader, m))
    errors: list[CheckpointCorruptError] = []
    read_requests(reader, names, to_read, options=io,
                  budget=read_budget(memory), describe=describe,
                  progress=progress, collect=errors)
    for e in errors:
        msg = str(e)
        if msg not in report.problems:
            report.problems.append(msg)
    report.checked_chunks = sum(len(r.pieces) for r in requests)
    report.checked_bytes = sum(p.nbytes for r in requests for p in r.pieces)
