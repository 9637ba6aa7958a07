"""What ``load``'s walk asks the engine to read: the job, its supply checks and mappings.

:class:`_Job` collects the destinations the walk of manifest + target finds, refuses to
allocate what the checkpoint's files cannot hold, and builds large arrays on private
mappings of their file bytes when the reader can map them (``api/_load.py`` walks).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, cast

import numpy as np

from statestream.api._castfill import CastFill, cast_fill
from statestream.api._open import array_paths, has_checksums
from statestream.api._overlap import InPlaceMemory
from statestream.api._pickles import _PickleTrust
from statestream.api._state_loads import StateLoad
from statestream.errors import (
    CheckpointCorruptError,
    CheckpointError,
    TargetMismatchError,
    TruncatedFileError,
)
from statestream.format import ArrayEntry, ChunkEntry, Manifest, dtype_from_name
from statestream.plan import LoadPlan, Wanted
from statestream.providers import ArrayProvider, Destination
from statestream.storage import CheckpointReader, MappedReader, ReadAhead, file_where
from statestream.tree import KeyPath, format_keypath, type_name

#: what the walk returns for a subtree: called once the reads are done, it builds the value
Build = Callable[[], Any]

#: arrays of several chunks at least this large are mapped (their chunks must be row
#: blocks, see :func:`_row_block_ranges`); an array of one raw chunk is mapped at any
#: size. Mapped data must start this aligned in the file.
_MAP_MIN_BYTES = 1 << 20
_MAP_ALIGN = 64

@dataclasses.dataclass
class _Job:
    """Everything the walk of manifest + target asks the engine to read."""

    pickles: _PickleTrust
    in_place: bool = False
    wanted: list[Wanted] = dataclasses.field(default_factory=list)
    paths: dict[int, KeyPath] = dataclasses.field(default_factory=dict)
    #: the open checkpoint, whose real file sizes bound what the walk allocates
    reader: CheckpointReader | None = None
    file_names: list[str] = dataclasses.field(default_factory=list)
    manifest: Manifest | None = None
    #: (array, id of the target leaf, kind) -> its build (tied leaves share it)
    shared: dict[tuple[int, int, str], Build] = dataclasses.field(default_factory=dict)
    #: map large arrays' file bytes instead of reading them (a local checkpoint)
    maps: bool = False
    #: > 0 while the walk is inside a stateful target that keeps the loaded arrays
    #: as its own state (an optimizer; a module loading with ``assign``): those are
    #: read, never mapped, since training writes them at once and every written page
    #: of a private mapping is a fault and a copy (docs/design-notes.md, "Load path")
    adopting: int = 0
    _aliased: set[int] | None = None
    _sizes: dict[int, int] = dataclasses.field(default_factory=dict)
    #: data file -> its whole private mapping (False: it cannot be mapped)
    _file_maps: dict[int, Any] = dataclasses.field(default_factory=dict)
    #: pieces planned during the walk (:meth:`restore_flat`); the rest from ``wanted``
    plan: LoadPlan = dataclasses.field(default_factory=lambda: LoadPlan([]))
    #: starts the disk on the chunks the walk plans, while it goes on (local files)
    ahead: ReadAhead | None = None
    #: ids of targets that give a layout only (providers' state hints, which may be
    #: views of parameters): never filled in place
    layout_only: set[int] = dataclasses.field(default_factory=set)
    #: where the in-place destinations lie: those sharing memory are read apart
    #: (api/_overlap.py)
    own: InPlaceMemory = dataclasses.field(default_factory=InPlaceMemory)
    #: id of a provider -> it and the targets it fills in place (told before the reads)
    filled: dict[int, tuple[ArrayProvider, list[Any]]] = dataclasses.field(
        default_factory=dict)
    #: the stateful targets' load_state_dict calls, made once every value is built
    state_loads: list[StateLoad] = dataclasses.field(default_factory=list)
    #: in-place targets of another dtype, cast into in pieces after the reads
    casts: list[CastFill] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        if self.manifest is not None:
            self.plan = LoadPlan(self.manifest.arrays, checksums=has_checksums(self.reader))

    @property
    def str_keyed(self) -> bool:
        """The checkpoint's format stores every dict key as a string (DCP, Orbax): an
        optimizer's int-keyed ``state`` comes back keyed "0", "1", and a target's int
        key matches its string."""
        return getattr(self.reader, "format", None) in ("dcp", "orbax")

    @contextlib.contextmanager
    def keeping(self, keeps: bool) -> Iterator[None]:
        """While the walk is inside a target that ``keeps`` the loaded arrays."""
        self.adopting += keeps
        try:
            yield
        finally:
            self.adopting -= keeps

    def restore_flat(self, prov: ArrayProvider, index: int, entry: ArrayEntry,
                     like: Any, path: KeyPath) -> tuple[Any] | None:
        """``(value,)`` for an array that one raw chunk holds whole, built in one step
        (planned here, no box arithmetic); None for the general path. Most arrays of
        a load come this way.

        The value lies on a private mapping of the chunk's file bytes when the reader
        maps (nothing to allocate or copy: the checksum pass touches the pages in),
        else in the buffer ``prov.restore_flat`` gives, which the chunk is read into.
        An in-place load reads into the target's own memory.
        """
        c = _whole_chunk(entry)
        if c is None or index in self.plan.touched:
            return None
        in_place = self.fills(prov, like)
        memory = (self._mapped_chunk(prov, index, entry, c, path)
                  if self.maps and not self.adopting and not (in_place and like is not None)
                  else None)
        got = prov.restore_flat(entry.dtype, entry.shape, c.nbytes, like, in_place, memory)
        if got is None:
            return None
        flat, value = got
        # verify-only when the value really is on the mapping (a provider may ignore it)
        piece = self.plan.whole(index, c, dtype_from_name(entry.dtype), flat,
                                mapped=memory is not None and flat is memory)
        if in_place and like is not None:
            self.own.add_flat(piece)
            self._fills(prov, like)
        if self.ahead is not None and c.ref is None:
            self.ahead.add(self.file_names[c.file], c.offset, c.nbytes)
        return (value,)

    def fills(self, prov: ArrayProvider, like: Any) -> bool:
        """Whether the load writes into target ``like``'s own memory (``in_place``)."""
        return (self.in_place and prov.capabilities.in_place_restore
                and id(like) not in self.layout_only)

    def restore_into(self, prov: ArrayProvider, index: int, entry: ArrayEntry, like: Any,
                     path: KeyPath) -> Destination | None:
        """``prov.restore_into`` (destinations in ``like``'s own memory) when the load
        fills ``like`` in place, else None."""
        if not self.fills(prov, like):
            return None
        found = prov.restore_into(entry.dtype, entry.shape, like, path)
        if found is not None:
            self.own.add_boxes(index, found.boxes)
            self._fills(prov, like)
        return found

    def cast_into(self, prov: ArrayProvider, index: int, entry: ArrayEntry, like: Any,
                  path: KeyPath) -> bool:
        """Whether ``like`` (filled in place, another dtype) is cast into in pieces
        within the memory budget (api/_castfill.py) rather than from a whole copy."""
        if not self.fills(prov, like) or self.reader is None or self.manifest is None:
            return False
        fill = cast_fill(prov, index, entry, like, path)
        if fill is not None:
            self.casts.append(fill)
        return fill is not None

    def copied_in(self, prov: ArrayProvider, like: Any, dest: Destination) -> Destination:
        """``dest``, whose value is then copied into ``like``'s own memory and ``like``
        returned (``prov.assign``) where the load fills ``like`` in place but
        :meth:`restore_into` could not (non-contiguous, another dtype or device)."""
        if not self.fills(prov, like):
            return dest
        finish = dest.finish

        def copy_in() -> Any:
            value = finish()
            done = prov.assign(like, value)
            return value if done is None else done

        return Destination(boxes=dest.boxes, finish=copy_in)

    def _fills(self, prov: ArrayProvider, like: Any) -> None:
        found = self.filled.get(id(prov))
        if found is None:
            found = self.filled[id(prov)] = (prov, [])
        found[1].append(like)

    def before_fill(self) -> None:
        """Tell the providers which targets the reads are about to write (in place):
        torch bumps their version counters."""
        for prov, targets in self.filled.values():
            prov.before_fill(targets)

    def plan_wanted(self) -> None:
        """Plan the reads of every wanted box (one-step restores are planned already);
        in-place destinations that share memory are read apart first (api/_overlap.py)."""
        for w in self.own.untangle(self.wanted):
            self.plan.add(w)

    def _mapped_chunk(self, prov: ArrayProvider, index: int, entry: ArrayEntry,
                      c: ChunkEntry, path: KeyPath) -> Any:
        """A private mapping (1-D uint8) of chunk ``c``'s bytes, or None to read them."""
        if c.ref is not None or c.offset % _MAP_ALIGN or not prov.capabilities.buffer_restore:
            return None
        self.check_supply(index, entry, path)  # a short file fails here, with the key path
        whole = self._file_maps.get(c.file)
        if whole is None:  # the file, mapped once: each array is a slice of it
            name = self.file_names[c.file]
            # cast, not isinstance: a runtime Protocol check costs ~30 us per call
            reader = cast(MappedReader, self.reader)
            buf = reader.map_range(name, 0, reader.file_size(name))
            whole = np.frombuffer(buf, dtype=np.uint8) if buf is not None else False
            self._file_maps[c.file] = whole
        if not isinstance(whole, np.ndarray):
            return None
        return whole[c.offset:c.offset + c.nbytes]

    def aliased(self) -> set[int]:
        """Arrays that an alias leaf (tied weights) also holds: only those need sharing."""
        if self._aliased is None:
            self._aliased = set()
            if self.manifest is not None:
                stack = [self.manifest.tree]
                while stack:
                    n = stack.pop()
                    if n.children:
                        stack.extend(n.children)
                    elif n.kind == "alias" and n.array is not None:
                        self._aliased.add(n.array)
        return self._aliased

    def check_supply(self, index: int, entry: ArrayEntry, path: KeyPath) -> None:
        """Refuse to allocate array ``index`` unless its files really hold its bytes.

        The manifest alone may claim terabytes in a 4 KB file. Chunks never
        share bytes (the manifest decoder checks), so with every chunk of every
        array allocated this way inside a real file, one load allocates at most
        what its files hold.
        """
        if self.reader is None:
            return
        for c in entry.chunks:
            if not c.nbytes:
                continue
            known = self._sizes.get(c.file)
            if known is not None and c.offset + c.nbytes <= known:
                continue
            name = self.file_names[c.file]
            try:
                size = self.reader.file_size(name)
            except CheckpointCorruptError as exc:
                others = self._short_arrays(c.file, 0, index)
                raise type(exc)(
                    f"{exc} (affects the array at key path '{format_keypath(path)}'"
                    + (f", and {others})" if others else ")")
                ) from None
            self._sizes[c.file] = size
            if c.offset + c.nbytes > size:
                others = self._short_arrays(c.file, size, index)
                raise TruncatedFileError(
                    f"the array at key path '{format_keypath(path)}' ({entry.dtype}, shape "
                    f"{entry.shape}) needs bytes [{c.offset}, {c.offset + c.nbytes}) of "
                    f"{file_where(self.reader, name)}, which has only {size} bytes; nothing was "
                    "allocated for it (the checkpoint is truncated or its manifest is wrong)"
                    + (f"; the file also lacks the data of {others}" if others else "")
                )

    def restore_mapped(self, prov: ArrayProvider, index: int, entry: ArrayEntry, like: Any,
                       path: KeyPath, scalar: bool) -> Destination | None:
        """``prov``'s value built on a private mapping of the array's file bytes, or None.

        Large arrays stored as row blocks need no fresh memory and no copy: their
        pages come from the page cache as the checksum pass touches them (the
        engine verifies every one). Blocks back to back in one file are one range
        of its mapping; blocks in several files (a large array's chunks go to
        different writers) are mapped side by side into one region, when each
        starts on a page and all but the last are whole pages.
        """
        if (not self.maps or self.adopting or entry.nbytes < _MAP_MIN_BYTES or not entry.chunks
                or not prov.capabilities.buffer_restore):
            return None
        ranges = _row_block_ranges(entry)
        if ranges is None:
            return None
        if like is not None and not self._present({f for f, _, _ in ranges}):
            # a node's partial copy (docs/manager.md): a target that takes part of the
            # array (a shard) reads its boxes; a missing file it needs fails that read
            return None
        self.check_supply(index, entry, path)  # a short file fails here, with the key path
        reader = cast(MappedReader, self.reader)
        if len(ranges) == 1:
            f, off, n = ranges[0]
            buf = reader.map_range(self.file_names[f], off, n)
        else:  # None unless the ranges are page-aligned (storage/_compose.py)
            buf = reader.map_ranges([(self.file_names[f], off, n) for f, off, n in ranges])
        if buf is None:
            return None
        return prov.restore_on(entry.dtype, entry.shape, like, path, buf, scalar=scalar)

    def _present(self, files: set[int]) -> bool:
        """Whether the reader has each of these data files (of any size)."""
        reader = cast(CheckpointReader, self.reader)
        for f in files:
            try:
                reader.file_size(self.file_names[f])
            except TruncatedFileError:
                return False
        return True

    def _short_arrays(self, file: int, size: int, skip: int) -> str:
        """Key paths of (up to 5) other arrays whose data lies past ``size`` in ``file``."""
        if self.manifest is None:
            return ""
        paths: dict[int, KeyPath] = {}
        array_paths(self.manifest.tree, (), paths)
        bad = [i for i, a in enumerate(self.manifest.arrays) if i != skip and any(
            c.file == file and c.nbytes and c.offset + c.nbytes > size for c in a.chunks)]
        names = [f"'{format_keypath(paths.get(i, ()))}'" for i in bad[:5]]
        return ", ".join(names) + (", ..." if len(bad) > 5 else "")


def target_shape(prov: ArrayProvider, like: Any, path: KeyPath) -> tuple[int, ...]:
    """``prov.target_shape(like)``, whose errors (a target without one shape: a nested
    tensor) are told the key path the provider is not given."""
    try:
        return prov.target_shape(like)
    except CheckpointError as exc:
        raise type(exc)(f"the target at key path '{format_keypath(path)}': {exc}") from None
    except Exception as exc:  # a provider's own: still a target that does not fit
        raise TargetMismatchError(
            f"the target at key path '{format_keypath(path)}' ({type_name(like)}) has no "
            f"shape {type(prov).__name__} can read: {type(exc).__name__}: {exc}") from exc


def _whole_chunk(entry: ArrayEntry) -> ChunkEntry | None:
    """The array's only chunk if it holds the whole array raw (no codec, no block
    checksums) in at least one byte, else None."""
    chunks = entry.chunks
    if len(chunks) != 1:
        return None
    c = chunks[0]
    if (c.codec is not None or c.block_rows or not c.nbytes
            or (c.shape is not entry.shape and c.shape != entry.shape)):
        return None
    return c


def _row_block_ranges(entry: ArrayEntry) -> list[tuple[int, int, int]] | None:
    """The array's bytes as ``(file, offset, nbytes)`` ranges in row order, runs of
    blocks back to back in one file merged; None unless its chunks are raw row blocks
    covering it in order (then the array is those ranges, concatenated) and the first
    starts ``_MAP_ALIGN``-aligned."""
    row_bytes = entry.nbytes // entry.shape[0] if entry.shape and entry.shape[0] else 0
    inner = entry.shape[1:]
    ranges: list[list[int]] = []
    row = 0
    for c in sorted(entry.chunks, key=lambda c: c.start[0]):
        if (c.codec is not None or c.ref is not None  # stored bytes are not the array's
                or c.shape[1:] != inner or any(c.start[1:]) or c.start[0] != row):
            return None
        n = c.shape[0] * row_bytes
        last = ranges[-1] if ranges else None
        if last is not None and last[0] == c.file and last[1] + last[2] == c.offset:
            last[2] += n
        else:
            ranges.append([c.file, c.offset, n])
        row += c.shape[0]
    if not ranges or ranges[0][1] % _MAP_ALIGN or sum(r[2] for r in ranges) != entry.nbytes:
        return None
    return [(f, off, n) for f, off, n in ranges]
