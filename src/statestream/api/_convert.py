"""``convert``: stream a checkpoint from one format to another under the memory budget."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from statestream._memory import fresh_bytes
from statestream.api._open import has_checksums, open_checkpoint, skip_missing_checksums
from statestream.api._options import (
    bool_option,
    io_options,
    key_paths,
    max_arrays_option,
    memory_options,
    path_arg,
    progress_option,
)
from statestream.api._select import NO_TARGET, _select
from statestream.engine import (
    ByteBudget,
    CompressionOption,
    CompressionPolicy,
    IOOptions,
    MemoryOptions,
    Progress,
    read_requests,
)
from statestream.engine._saveopts import check_user_meta
from statestream.errors import InvalidOptionError, InvalidOptionTypeError, UnsupportedTypeError
from statestream.format import Compression, Manifest, dtype_from_name, itemsize_of
from statestream.interop import (
    write_dcp,
    write_orbax,
    write_safetensors,
    write_statestream,
    write_torch,
)
from statestream.interop._writers import ArraySpec, aligned_bytes, array_paths, slab_rows
from statestream.plan import ReadPiece, Wanted, plan_load
from statestream.storage import CheckpointReader, storage_for
from statestream.tree import KeyPath, Node, format_keypath

__all__ = ["FORMATS", "convert"]

#: what ``convert(to=...)`` writes
FORMATS = ("statestream", "safetensors", "torch", "dcp", "orbax")
#: the most each of the safetensors writer's two write blocks holds
_BLOCK_BYTES = 16 << 20
#: writers done with a slab before they ask for the next (they may share one buffer)
_STREAMING = ("statestream", "safetensors")
_EXTENSIONS = {".safetensors": "safetensors", ".pt": "torch", ".pth": "torch", ".bin": "torch"}
#: metadata that describes the source's own save, not carried over (a conversion is a save)
_OWN_META = ("library", "created_unix", "world_size", "total_bytes", "save_id")


def _renumber(node: Node, old: list[int], new: dict[int, int] | None = None) -> Node:
    """A copy of ``node`` whose arrays are numbered 0.. in tree order (``old`` gets the map).

    Aliases (tied weights: nodes sharing an array) keep sharing one new number,
    so the array is written once."""
    new = {} if new is None else new
    if node.array is not None:
        if node.array not in new:
            new[node.array] = len(old)
            old.append(node.array)
        return dataclasses.replace(node, array=new[node.array])
    if node.children is None:
        return node
    return dataclasses.replace(node, children=[_renumber(c, old, new) for c in node.children])


def _resolve_aliases(node: Node, keep: bool, held: dict[int, Node]) -> Node:
    """``node`` with its aliases (tied weights) fit for the output, in tree order (an
    alias follows its array leaf): an alias whose array leaf ``items=`` left out becomes
    that leaf; without ``keep`` (DCP, Orbax: as their own savers do) every alias becomes a
    copy of its array leaf (the tensor is written under each name)."""
    if node.kind == "array" and node.array is not None:
        first = held.setdefault(node.array, node)
        if first is not node and keep:  # an alias before it became the array leaf
            return Node("alias", array=node.array, attrs=node.attrs)
    elif node.kind == "alias" and node.array is not None:
        if node.array not in held:
            held[node.array] = Node("array", array=node.array, attrs=node.attrs)
            return held[node.array]
        return node if keep else held[node.array]
    if node.children is None:
        return node
    kids = [_resolve_aliases(c, keep, held) for c in node.children]
    return dataclasses.replace(node, children=kids)


def _first_paths(root: Node, old: list[int]) -> dict[int, KeyPath]:
    """Source array index -> the first key path naming it (for error messages)."""
    paths: dict[int, KeyPath] = {}
    for p, n in array_paths(root):
        paths.setdefault(old[n.array or 0], p)
    return paths


def _target_format(dst: str, to: str | None, compression: CompressionOption
                   ) -> tuple[str, CompressionPolicy]:
    """The format to write and how to compress it (statestream only)."""
    if to is None:
        to = _EXTENSIONS.get(os.path.splitext(dst)[1], "statestream")
    if to not in FORMATS:
        raise InvalidOptionError(f"convert(to={to!r}): known formats are {', '.join(FORMATS)}")
    policy = CompressionPolicy(compression)
    if policy and to != "statestream":
        raise InvalidOptionError(
            f"convert(compression=...) compresses statestream checkpoints; {to} has no "
            "compression of its own here (convert to statestream, or drop compression)")
    return to, policy


class _Slabs:
    """Reads an array of the source as row slabs of at most ``slab_bytes`` each.

    With ``reuse`` every slab is a view of one page-aligned buffer (no fresh
    memory per slab, and direct I/O takes it as it is): for writers that are
    done with a slab before asking for the next (statestream, safetensors).
    Writers that keep slabs (orbax) get fresh arrays.
    """

    def __init__(self, reader: CheckpointReader, m: Manifest, old: list[int], io: IOOptions,
                 memory: MemoryOptions, progress: Progress | None, paths: dict[int, KeyPath],
                 *, reuse: bool = False, writer_bytes: int = 0):
        self.reader, self.m, self.old, self.io = reader, m, old, io
        budget = memory.resolved()
        # slabs of half the budget line up with the chunks a conversion under the same
        # budget wrote (no whole-chunk staging to verify a checksum); the writer's
        # buffers come out of the other half, the reads' staging
        self.slab_bytes = max(1, min(budget // 2, io.max_chunk_bytes))
        #: what a writer that must hold arrays whole until it writes them (orbax) may
        #: give it at once: orbax's own copies and buffers come to about as much again
        #: (+27 MiB for batches of 8 MiB under 32 MiB), and the slab being read is on top
        self.hold_bytes = max(budget // 4, 1 << 20)
        self.budget = ByteBudget(max(budget - self.slab_bytes - writer_bytes, 1 << 20))
        self.reuse = reuse
        self._raw: np.ndarray | None = None
        self.names = [f.name for f in m.files]
        # an alias (tied weights) lists one array twice in ``old``, and writers read it once
        # (torch, safetensors) or twice (statestream): count each array's bytes once
        self.total = sum(m.arrays[i].nbytes for i in set(old))
        self.done = 0
        self.counted: dict[int, int] = {}
        self.progress = progress
        self.paths = paths

    def __call__(self, i: int) -> Iterator[tuple[int, np.ndarray]]:
        ai = self.old[i]
        entry = self.m.arrays[ai]
        dt = dtype_from_name(entry.dtype)
        if not entry.shape:
            yield 0, self._read(ai, (), self._buffer((), dt))
            return
        for r0, r1 in slab_rows(entry.dtype, entry.shape, self.slab_bytes):
            buf = self._buffer((r1 - r0,) + entry.shape[1:], dt)
            yield r0, self._read(ai, (r0,) + (0,) * (len(entry.shape) - 1), buf)
            del buf  # freed (or free to reuse) before the next slab is read

    def _buffer(self, shape: tuple[int, ...], dt: np.dtype) -> np.ndarray:
        if not self.reuse:
            return fresh_bytes(math.prod(shape) * dt.itemsize).view(dt).reshape(shape)
        n = math.prod(shape) * dt.itemsize
        if self._raw is None or self._raw.nbytes < n:
            self._raw = None  # the old buffer goes before a larger one is made
            self._raw = aligned_bytes(max(n, self.slab_bytes))
        return self._raw[:n].view(dt).reshape(shape)

    def _read(self, ai: int, start: tuple[int, ...], buf: np.ndarray) -> np.ndarray:
        if buf.nbytes:
            reqs = plan_load(self.m.arrays, [Wanted(ai, start, buf)],
                             max_request_bytes=self.io.max_request_bytes,
                             checksums=has_checksums(self.reader))
            skip_missing_checksums(self.reader, reqs)

            def describe(p: ReadPiece) -> str:
                return f"array at key path '{format_keypath(self.paths.get(p.array, ()))}'"

            read_requests(self.reader, self.names, reqs, options=self.io, budget=self.budget,
                          describe=describe)
            seen = self.counted.get(ai, 0)
            now = min(self.m.arrays[ai].nbytes, seen + buf.nbytes)
            self.counted[ai] = now
            self.done += now - seen
            if self.progress is not None:
                self.progress(min(self.done, self.total), self.total)
        return buf


def _convert_root(tree: Node, items: Sequence[str] | None, location: str, *,
                  keep_aliases: bool) -> tuple[Node, list[int]]:
    """The tree to convert (``items`` selected; one item becomes the root), renumbered.

    Tied entries stay aliases where the output format keeps them
    (``keep_aliases``), else each becomes its own copy. Also returns the
    source array index of each renumbered array.
    """
    root = tree
    if items is not None:
        root, _ = _select(root, list(items), NO_TARGET, location, typed=False)
        if len(root.keys or []) == 1 and root.children:
            root = root.children[0]
    root = _resolve_aliases(root, keep_aliases, {})
    old: list[int] = []
    return _renumber(root, old), old


def _codecs(policy: CompressionPolicy, root: Node, specs: list[ArraySpec]
            ) -> list[Compression | None]:
    """Each converted array's compression, by the first key path naming it."""
    paths: dict[int, KeyPath] = {}
    for p, n in array_paths(root):
        paths.setdefault(n.array or 0, p)
    return [policy.for_array(paths[i], d, itemsize_of(d)) if i in paths else None
            for i, (d, _) in enumerate(specs)]


def _write_as(fmt: str, dst_s: str, root: Node, specs: list[ArraySpec], slabs: _Slabs,
              meta: dict[str, object], *, overwrite: bool, max_shard_bytes: int | None,
              block_bytes: int, codecs: list[Compression | None] | None) -> None:
    """Write the converted tree in format ``fmt``, its arrays' bytes from ``slabs``."""
    if fmt == "statestream":
        write_statestream(dst_s, root, specs, slabs, meta, overwrite=overwrite,
                          slab_bytes=slabs.slab_bytes, codecs=codecs,
                          threads=slabs.io.write_threads())
    elif fmt == "torch":
        write_torch(dst_s, root, specs, slabs, overwrite=overwrite)
    elif fmt == "dcp":
        write_dcp(dst_s, root, specs, slabs, overwrite=overwrite)
    elif fmt == "orbax":
        write_orbax(dst_s, root, specs, slabs, overwrite=overwrite,
                    batch_bytes=slabs.hold_bytes)
    else:
        sharded = max_shard_bytes is not None or not dst_s.endswith(".safetensors")
        write_safetensors(dst_s, root, specs, slabs, meta, overwrite=overwrite,
                          sharded=sharded, max_shard_bytes=max_shard_bytes,
                          block_bytes=block_bytes)


def _convert_open(src: str | os.PathLike[str], fmt: str, dst_s: str, *, allow_pickle: bool,
                  max_arrays: int, items: Sequence[str] | None, overwrite: bool,
                  max_shard_bytes: int | None, io: IOOptions, memory: MemoryOptions,
                  progress: Progress | None, policy: CompressionPolicy) -> None:
    """Open the source at ``src`` and convert it to ``fmt`` at ``dst_s``."""
    reader, m = open_checkpoint(src, allow_pickle=allow_pickle, max_arrays=max_arrays)
    try:
        root, old = _convert_root(m.tree, items, reader.location,
                                  keep_aliases=fmt in ("statestream", "safetensors", "torch"))
        specs: list[ArraySpec] = [(m.arrays[i].dtype, m.arrays[i].shape) for i in old]
        # the safetensors writer's two blocks come out of the budget too, and so do an
        # object store writer's part buffers (a statestream checkpoint on S3, GCS, Azure)
        block = min(_BLOCK_BYTES, memory.resolved() // 8) if fmt == "safetensors" else 0
        writer = 2 * block
        if fmt == "statestream":
            writer += storage_for(dst_s)[0].capabilities.writer_buffer_bytes
        slabs = _Slabs(reader, m, old, io, memory, progress, _first_paths(root, old),
                       writer_bytes=writer, reuse=fmt in _STREAMING)
        meta = _carried_meta(m.meta, reader.location, fmt in _STREAMING)
        _write_as(fmt, dst_s, root, specs, slabs, meta, overwrite=overwrite,
                  max_shard_bytes=max_shard_bytes, block_bytes=block,
                  codecs=_codecs(policy, root, specs) if policy else None)
    finally:
        reader.close()


def _carried_meta(meta: dict[str, Any], where: str, kept: bool) -> dict[str, Any]:
    """The source's metadata the output carries over (not what described its own save),
    checked as a save checks its caller's before anything is written where the output
    keeps it (``kept``: statestream, safetensors): a source's may hold what no save
    writes (NaN, which JSON readers accept), and the writer raised a bare ValueError
    once all the data was written."""
    carried = {k: v for k, v in meta.items() if k not in _OWN_META}
    if not kept:
        return carried
    try:
        check_user_meta(carried)
    except UnsupportedTypeError as exc:
        raise UnsupportedTypeError(f"cannot carry the metadata of {where} over: {exc}") from exc
    return carried


def _shard_bytes(n: Any, fmt: str) -> int | None:
    """``max_shard_bytes`` checked: None, or a positive int for safetensors output
    (another format's conversion ignored it: a directory ``dst`` without
    ``to="safetensors"`` became a statestream checkpoint, not shards)."""
    if n is None:
        return None
    if isinstance(n, bool) or not isinstance(n, int):
        raise InvalidOptionTypeError(f"max_shard_bytes must be an int (bytes), not {n!r:.80}")
    if n < 1:
        raise InvalidOptionError(f"max_shard_bytes must be positive, not {n}")
    if fmt != "safetensors":
        raise InvalidOptionError(
            f"convert(max_shard_bytes=...) shards safetensors output; {fmt} is not sharded "
            "here (pass to='safetensors', or drop max_shard_bytes)")
    return n


def convert(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    to: str | None = None,
    items: Sequence[str] | None = None,
    overwrite: bool = False,
    allow_pickle: bool = False,
    max_shard_bytes: int | None = None,
    io: IOOptions | None = None,
    memory: MemoryOptions | None = None,
    progress: Progress | None = None,
    compression: CompressionOption = None,
    max_arrays: int | None = None,
) -> str:
    """Convert a checkpoint to another format, streaming it through the memory budget.

    Args:
        src: any checkpoint ``load`` reads (statestream, safetensors file or
            Hugging Face shards, torch.save file, DCP or Orbax directory);
            detected by content. See docs/interop.md.
        dst: where to write; must not exist unless ``overwrite``.
        to: ``"statestream"``, ``"safetensors"``, ``"torch"``, ``"dcp"`` or
            ``"orbax"``. Default: from ``dst``'s extension (``.safetensors``;
            ``.pt``/``.pth``/``.bin`` for torch), else ``"statestream"``.
        items: top-level keys to convert; with exactly one, its contents become
            the root (a safetensors export holds a model's state_dict keys as
            they are).
        overwrite: replace an existing ``dst`` (a file, an empty or checkpoint
            directory of any format: docs/interop.md; not a statestream checkpoint
            that an incremental sibling refers to: ``CheckpointError``).
        allow_pickle: let a torch.save source's pickle name globals a
            weights-only load refuses. Pickled leaves of a statestream
            checkpoint are copied as bytes, never unpickled.
        max_shard_bytes: with ``to="safetensors"``, write Hugging Face shards
            of at most this many bytes (a larger tensor gets its own shard)
            and ``model.safetensors.index.json``; also chosen when ``dst`` does
            not end in ``.safetensors`` (default 5 GB). Refused for other formats.
        io: thread count and request sizes for reading.
        memory: the budget; one slab of at most half of it (and at most
            ``io.max_chunk_bytes``) is held at a time (``to="orbax"``: arrays go
            in batches of a quarter of it, each an orbax partial save; docs/interop.md).
        progress: called as ``progress(bytes_done, bytes_total)``.
        compression: with ``to="statestream"``, compress the arrays as ``save``'s
            ``compression`` does (a codec name, an ``ss.Compression``, or key-path
            patterns to those); default raw. A compressed source is always
            decoded on the way, so this also recompresses or decompresses.
        max_arrays: ``load``'s: refuse (``CheckpointError``) a source, or a base of
            it, whose manifest declares more arrays (default: the format's 2^24).

    Returns ``dst`` as a string.

    Raises:
        UnsupportedTypeError: the target format cannot hold a dtype or a
            name (the message names the key paths).
        CheckpointExistsError: ``dst`` exists and ``overwrite`` is false.
        PickleNotAllowedError: a torch.save/DCP source's pickle names a
            global a weights-only load refuses.
        InvalidOptionError: ``compression`` (``max_shard_bytes``) not to statestream (safetensors).
        MissingDependencyError: torch (``to="torch"``/``"dcp"``) or
            orbax-checkpoint (Orbax) is not installed; names the extra.

    Example:
        >>> import numpy as np, tempfile, os, statestream as ss
        >>> d = tempfile.mkdtemp()
        >>> ss.save(os.path.join(d, "ck"), {"w": np.arange(3.0), "step": 7})
        >>> out = ss.convert(os.path.join(d, "ck"), os.path.join(d, "w.safetensors"))
        >>> ss.load(out)
        {'w': array([0., 1., 2.]), 'step': 7}
    """
    src, dst_s = path_arg(src, "src"), os.fspath(path_arg(dst, "dst"))
    overwrite = bool_option(overwrite, "overwrite")
    fmt, policy = _target_format(dst_s, to, compression)
    io, memory, selected = io_options(io), memory_options(memory), key_paths(items, "items")
    progress, max_shard_bytes = progress_option(progress), _shard_bytes(max_shard_bytes, fmt)
    _convert_open(src, fmt, dst_s, allow_pickle=bool_option(allow_pickle, "allow_pickle"),
                  max_arrays=max_arrays_option(max_arrays), items=selected, overwrite=overwrite,
                  max_shard_bytes=max_shard_bytes, io=io, memory=memory, progress=progress,
                  policy=policy)
    return dst_s
