"""Incremental saves: chunk hashes, matching chunks of a base, following references.

A save with a *base* (a committed sibling checkpoint whose chunks carry
XXH3-128 hashes) hashes every chunk it writes in the writer threads; a chunk
whose raw bytes equal a chunk of the base (same 128-bit hash, same shape and
raw size) is not written again, and not checksummed either:
its record refers to the checkpoint that physically holds the bytes (format
v2 ``ref``; references are flattened, so that may be the base's own base).

Reading an incremental checkpoint (following its references into its bases)
is in ``_chain``.
"""

from __future__ import annotations

import copy
import json
import math
import re
import warnings
from collections.abc import Collection, Mapping
from typing import Any

import numpy as np

from statestream.engine._recent import KeptByManifest, still_committed
from statestream.errors import (
    CheckpointCorruptError,
    CheckpointError,
    InvalidOptionError,
    StorageError,
    UnsafeCheckpointError,
)
from statestream.format import (
    COMMIT_NAME,
    MANIFEST_NAME,
    MAX_ARRAYS,
    MAX_COMMIT_BYTES,
    MAX_MANIFEST_BYTES,
    ChunkEntry,
    ChunkRef,
    Manifest,
    checksum,
    checksum_of_blocks,
    decode_commit,
    decode_manifest,
    itemsize_of,
    validate_base_name,
)
from statestream.storage import CheckpointReader, Storage, file_where, storage_for

__all__ = [
    "BaseChunks",
    "base_chunks",
    "base_name_for",
    "check_base",
    "check_bases_committed",
    "chunk_digest",
    "digest_and_checksums",
    "remember_committed",
    "open_base",
    "read_manifest",
    "referred_to_by",
    "refuse_replacing_a_base",
    "sibling_path",
]

_Buffer = Any


def _xxh3_128() -> Any:
    try:
        import xxhash
    except ImportError as exc:  # a declared dependency; say which one is missing
        raise CheckpointError(
            "chunk hashes (incremental saves) need the xxhash package: pip install xxhash"
        ) from exc
    return xxhash.xxh3_128()


def _bytes_of(data: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(data).view(np.uint8).reshape(-1)


def digest_hasher() -> Any:
    """A streaming XXH3-128 (``update(bytes)``, ``digest()``): :func:`chunk_digest` of
    what it was given, in pieces."""
    return _xxh3_128()


def chunk_digest(data: np.ndarray) -> bytes:
    """XXH3-128 of a chunk's raw bytes (16 bytes, as ``xxh3_128().digest()``)."""
    h = _xxh3_128()
    h.update(_bytes_of(data).data)
    return bytes(h.digest())


#: Bytes hashed and checksummed together (in cache) by :func:`digest_and_checksums`.
_SEGMENT = 1 << 20


def digest_and_checksums(data: np.ndarray, block_bytes: int
                         ) -> tuple[bytes, int, tuple[int, ...]]:
    """A chunk's XXH3-128, CRC-32C and block CRCs (``block_bytes``: 0 for none) in one
    pass over memory: each segment is hashed and checksummed while it is in cache.

    With blocks, the CRC is that of the block CRCs (docs/format.md), as
    :func:`~statestream.engine.chunk_checksums` computes it.
    """
    raw = _bytes_of(data)
    h = _xxh3_128()
    if block_bytes:
        blocks = []
        for a in range(0, raw.nbytes, block_bytes):
            seg = raw[a:a + block_bytes]
            h.update(seg.data)
            blocks.append(checksum(seg))
        return bytes(h.digest()), checksum_of_blocks(blocks), tuple(blocks)
    crc = 0
    for a in range(0, raw.nbytes, _SEGMENT):
        seg = raw[a:a + _SEGMENT]
        h.update(seg.data)
        crc = checksum(seg, crc)
    return bytes(h.digest()), crc, ()


def read_manifest(reader: CheckpointReader, max_arrays: int = MAX_ARRAYS) -> Manifest:
    """Read and verify the commit marker and manifest of an open checkpoint (of at most
    ``max_arrays`` arrays: ``decode_manifest``'s)."""
    return _read_committed(reader, max_arrays)[0]


def _read_committed(reader: CheckpointReader,
                    max_arrays: int = MAX_ARRAYS) -> tuple[Manifest, int, int]:
    """:func:`read_manifest`, with the manifest's size and CRC-32C (its commit marker's)."""
    where = file_where(reader, MANIFEST_NAME)
    marker = reader.read_bytes(COMMIT_NAME, MAX_COMMIT_BYTES)
    size, crc = decode_commit(marker, f"{reader.location}/{COMMIT_NAME}")
    data = reader.read_bytes(MANIFEST_NAME, MAX_MANIFEST_BYTES)
    if len(data) != size or checksum(data) != crc:
        raise CheckpointCorruptError(
            f"manifest {where} does not match its commit marker (size {len(data)} vs {size}, "
            "or checksum differs); the checkpoint is corrupt"
        )
    try:  # decode from text only, so the bytes are not held while decoding
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CheckpointCorruptError(f"manifest {where} is not valid UTF-8: {exc}") from None
    del data
    m = decode_manifest(text, where, max_arrays)
    # the marker's version is trusted without the manifest where that saves a read
    # (dependents_of skips a v1 sibling): a marker that lies about it is damage
    if json.loads(marker)["version"] != m.version:
        raise CheckpointCorruptError(
            f"manifest {where} is format version {m.version} but its commit marker says "
            f"{json.loads(marker)['version']}; the checkpoint is corrupt")
    return m, size, crc


# ----------------------------------------------------------------------------- siblings


def _split(spath: str) -> tuple[str, str]:
    """(parent, name) of a storage path or URL."""
    parent, sep, name = spath.rstrip("/").rpartition("/")
    if not sep or not name or parent.endswith(":/") or parent.endswith(":"):
        raise InvalidOptionError(f"{spath} has no parent directory to hold sibling checkpoints")
    return parent, name


def sibling_path(spath: str, name: str) -> str:
    """The path of checkpoint ``name`` next to the checkpoint at ``spath``."""
    return f"{_split(spath)[0]}/{name}"


def check_bases_committed(storage: Storage, spath: str, bases: Collection[str],
                          read: Mapping[str, tuple[int, int]]) -> None:
    """Refuse to commit ``spath`` while a checkpoint its references point into is no
    longer the one the save read (``read``: name -> its manifest's size and CRC-32C,
    :attr:`BaseChunks.manifests`): removed, or replaced by an overwrite, while the
    save ran, the new checkpoint could never be loaded (its references name chunks
    that are gone or hold other bytes), and its save must not report success."""
    for name in sorted(bases):
        there = sibling_path(spath, name)
        known = read.get(name)
        if not (storage.is_committed(there) if known is None
                else still_committed(storage, there, *known)):
            raise CheckpointError(
                f"cannot commit {spath}: it refers to chunks of {name}, which is no longer "
                f"the checkpoint this save read at {there} (removed or replaced while this "
                "save was running?); nothing was committed")


#: a JSON value's decoder and the whitespace JSON allows between tokens
_JSON = json.JSONDecoder()
_WS = re.compile(r"[ \t\n\r]*")


def _head_bases(text: str) -> list[Any] | None:
    """The ``bases`` of the manifest ``text``, decoding its top-level values only up to
    ``bases`` (statestream writes it after ``files``, before ``arrays`` and ``tree``):
    never its arrays or tree, which a hostile sibling can make cost gigabytes to decode
    (2^24 arrays). ``[]`` where it has none: ``arrays`` before any ``bases`` (a decoder
    refuses a reference to a base not listed before the arrays), an object that ends
    without them, text that is not a manifest (nothing can load it, nothing refers).
    None where ``tree`` comes first, as statestream never writes it: whatever its text
    names counts as referred to (an overwrite is refused rather than risk its chunks).

    Raises:
        ValueError: the text is not JSON where the head was decoded.
    """
    i = _WS.match(text, 0).end()  # type: ignore[union-attr]  # (it matches "")
    if text[i:i + 1] != "{":
        return []
    while True:
        key, i = _JSON.raw_decode(text, _WS.match(text, i + 1).end())  # type: ignore[union-attr]
        i = _WS.match(text, i).end()  # type: ignore[union-attr]
        if text[i:i + 1] != ":":
            return []
        i = _WS.match(text, i + 1).end()  # type: ignore[union-attr]
        if key == "bases":
            bases, _ = _JSON.raw_decode(text, i)
            return bases if isinstance(bases, list) else []
        if key in ("arrays", "tree"):
            return None if key == "tree" else []
        _, i = _JSON.raw_decode(text, i)  # format, version, checksum, meta, files
        i = _WS.match(text, i).end()  # type: ignore[union-attr]
        if text[i:i + 1] != ",":
            return []


def _names_as_base(text: str, own: str) -> bool:
    """Whether the manifest ``text`` lists ``own`` in its ``bases`` (:func:`_head_bases`;
    a ``tree`` before them counts as referring to ``own``)."""
    bases = _head_bases(text)
    return bases is None or own in bases


def _committed_head(storage: Storage, path: str) -> bytes | None:
    """The manifest of the committed checkpoint at ``path`` where it may refer to
    other checkpoints (format v2 or later), else None (not committed, format v1).

    Raises:
        CheckpointError: it cannot be read (StorageError: the store failed).
    """
    if not storage.is_committed(path):
        return None
    reader = storage.open_read(path)
    try:
        marker = reader.read_bytes(COMMIT_NAME, MAX_COMMIT_BYTES)
        decode_commit(marker, f"{reader.location}/{COMMIT_NAME}")
        if json.loads(marker)["version"] == 1:
            return None  # format v1 has no references: its manifest is not read
        return reader.read_bytes(MANIFEST_NAME, MAX_MANIFEST_BYTES)
    finally:
        reader.close()


def referred_to_by(storage: Storage, path: str, names: Collection[str]) -> list[str]:
    """The ``names`` (siblings of ``path``) whose chunks the committed checkpoint at
    ``path`` refers to (its manifest's ``bases`` name them), sorted; ``[]`` where it is
    not committed, of format v1, or cannot be read (whatever it refers to, nothing can
    load it now). Decodes only the manifest's values before ``bases``
    (:func:`_head_bases`; a ``tree`` before them: the ``names`` its text holds).

    A ``CheckpointManager`` asks this of the checkpoints beside its steps that are not
    steps (a user's ``ss.save(..., base=mgr.step_path(s))``) before its keep policy
    deletes a step.

    Raises:
        StorageError: the store failed (not the checkpoint).
    """
    try:
        data = _committed_head(storage, path)
        if data is None:
            return []
        text = data.decode("utf-8")
        del data  # (not held twice while the head is decoded)
        bases = _head_bases(text)
    except StorageError:
        raise
    except (CheckpointError, OSError, KeyError, ValueError, RecursionError):
        return []
    if bases is None:
        return sorted(n for n in names if json.dumps(n) in text)
    wanted = set(names)
    return sorted({b for b in bases if isinstance(b, str) and b in wanted})


def dependents_of(storage: Storage, spath: str) -> list[str]:
    """The committed siblings of ``spath`` that refer to chunks of it (their
    manifests' ``bases`` name it), sorted. A sibling that cannot be read is
    skipped: whatever it refers to, nothing can load it now. Reads the manifest
    of every committed sibling of format v2 or later (v1 cannot refer) that names
    ``spath``, but decodes only its values before ``bases`` (:func:`_names_as_base`)."""
    parent, own = _split(spath)
    try:
        validate_base_name(own)
    except UnsafeCheckpointError:
        return []  # a name no manifest may record as a base: nothing refers to it
    # a manifest that refers to ``own`` holds it as a JSON string (a base name has
    # nothing JSON escapes): one without those bytes is not decoded
    quoted = json.dumps(own).encode()
    found = []
    for name in sorted(storage.list(parent)):
        if name == own:
            continue
        try:
            data = _committed_head(storage, sibling_path(spath, name))
            if data is None or quoted not in data:
                continue
            text = data.decode("utf-8")
            del data  # (not held twice while the head is decoded)
            if _names_as_base(text, own):
                found.append(name)
        except (CheckpointError, OSError, KeyError, ValueError):
            continue
    return found


def refuse_replacing_a_base(storage: Storage, spath: str, overwrite: bool) -> None:
    """Before ``overwrite`` replaces the committed checkpoint at ``spath``: refuse
    if an incremental sibling refers to its chunks (replacing it would leave that
    sibling unloadable; a load would refuse its references, but the data is gone).

    Raises:
        CheckpointError: naming the checkpoints that refer to ``spath``.
    """
    if not overwrite or not storage.is_committed(spath):
        return
    try:
        deps = dependents_of(storage, spath)
    except InvalidOptionError:
        return  # no parent directory: no siblings
    if deps:
        raise CheckpointError(
            f"{spath} is the base of the incremental checkpoint(s) {', '.join(deps)} next "
            "to it, which keep chunks only there; overwrite=True would leave them "
            "unloadable. Delete them first (or convert them to full checkpoints with "
            "ss.convert), or save to another path"
        )


def base_name_for(storage: Storage, spath: str, base: Any) -> str:
    """The directory name of ``base``, which must be a sibling of ``spath``.

    Raises:
        CheckpointError: ``base`` is not in the same parent directory (or store)
            as the new checkpoint, or is the checkpoint itself.
    """
    bstorage, bpath = storage_for(base)
    parent, own = _split(spath)
    bparent, name = _split(bpath)
    if type(bstorage) is not type(storage) or bparent != parent:
        raise CheckpointError(
            f"the base {bpath} of the incremental save to {spath} is not a sibling of it: "
            f"references stay inside the parent directory {parent}, so the base must be "
            "there too"
        )
    if name == own:
        raise CheckpointError(
            f"the incremental save to {spath} names itself as its base; a checkpoint "
            "cannot refer to the bytes it replaces"
        )
    try:
        return validate_base_name(name)
    except UnsafeCheckpointError:
        raise CheckpointError(
            f"the base {bpath} of the incremental save to {spath} has a name a manifest "
            "cannot record ([A-Za-z0-9_][A-Za-z0-9_.-]{0,199}, no '..')") from None


def open_base(storage: Storage, spath: str, name: str, *, of: str
              ) -> tuple[CheckpointReader, Manifest]:
    """Open the committed sibling ``name`` of ``spath`` and read its verified manifest.

    Raises:
        CheckpointError: the base is missing (deleted), naming it.
        UnsafeCheckpointError: it exists but is not committed, or is a symbolic link.
    """
    reader, m, _, _ = _open_committed(storage, spath, name, of=of)
    return reader, m


def _open_committed(storage: Storage, spath: str, name: str, *, of: str,
                    missing: type[CheckpointError] = CheckpointError,
                    max_arrays: int = MAX_ARRAYS,
                    ) -> tuple[CheckpointReader, Manifest, int, int]:
    """:func:`open_base`, with the manifest's size and CRC-32C from its commit marker;
    a missing base raises ``missing``; a manifest of more than ``max_arrays`` arrays,
    a CheckpointError (:func:`read_manifest`)."""
    path = sibling_path(spath, name)
    if not storage.is_committed(path):
        if name in storage.list(_split(spath)[0]):
            raise UnsafeCheckpointError(
                f"base checkpoint {name} ({path}) of {of} is not committed (a save never "
                "finished, or it is being deleted); refusing to follow references into it")
        raise missing(
            f"base checkpoint {name} ({path}) of {of} is missing: {of} refers to chunks "
            "stored there, so it cannot be read without it (was the base deleted?)")
    try:
        reader = storage.open_read(path, follow_links=False)
    except UnsafeCheckpointError as exc:
        raise UnsafeCheckpointError(
            f"base checkpoint {name} of {of} is not a plain directory next to it ({exc}): "
            "references must not lead out of the parent directory") from None
    try:
        return (reader, *_read_committed(reader, max_arrays))
    except BaseException:
        reader.close()
        raise


# ----------------------------------------------------------------------------- writing


def _moved(c: ChunkEntry, start: tuple[int, ...], shape: tuple[int, ...],
           ref: ChunkRef | None) -> ChunkEntry:
    """A copy of ``c`` at another place (``dataclasses.replace`` takes ~3x as long)."""
    return ChunkEntry(c.file, c.offset, c.nbytes, c.checksum, start, shape, c.block_rows,
                      c.block_checksums, c.codec, c.shuffle, c.digest, ref)


def _same_record(b: ChunkEntry, c: ChunkEntry) -> bool:
    """Whether two records of a chunk agree on its stored bytes (raw size aside)."""
    return (b.nbytes == c.nbytes and b.checksum == c.checksum and b.codec == c.codec
            and b.shuffle == c.shuffle and b.digest == c.digest
            and b.block_rows == c.block_rows and b.block_checksums == c.block_checksums)


class BaseChunks:
    """The hashed chunks of a base checkpoint, for a save to refer to.

    Each is recorded as the flattened reference a new chunk with the same
    bytes gets: the checkpoint that physically holds the bytes (the base, or
    the base's own base for a chunk the base refers to) and the holder's
    record of them.
    """

    def __init__(self, name: str, manifest: Manifest) -> None:
        self.name = name
        #: the manifest (size, CRC-32C) of each checkpoint a reference from here may
        #: point into, as read: the save commits only while they are still committed
        self.manifests: dict[str, tuple[int, int]] = {}
        self._by: dict[tuple[bytes, tuple[int, ...], int], ChunkEntry] = {}
        for a in manifest.arrays:
            isz = itemsize_of(a.dtype)
            for c in a.chunks:
                if c.digest is None:
                    continue
                key = (c.digest, c.shape, math.prod(c.shape) * isz)
                if c.ref is None:  # a chunk of its own, preferred to a reference
                    held = self._by.get(key)
                    if held is None or (held.ref is not None and held.ref.base != name):
                        self._by[key] = _moved(c, c.start, c.shape, ChunkRef(name, c.file))
                elif key not in self._by:  # a reference is already flattened: kept as is
                    self._by[key] = c

    def __len__(self) -> int:
        return len(self._by)

    def bases(self) -> set[str]:
        """Every checkpoint a reference from here may point to."""
        return {c.ref.base for c in self._by.values() if c.ref is not None}

    def holders(self) -> set[str]:
        """The other checkpoints that hold bytes this base refers to (its own ``bases``)."""
        return self.bases() - {self.name}

    def _holds(self, key: tuple[bytes, tuple[int, ...], int], c: ChunkEntry) -> bool:
        """Whether this checkpoint stores ``c`` (a reference to it) as a chunk of its own."""
        own = self._by.get(key)
        return (own is not None and own.ref is not None and own.ref.base == self.name
                and own.file == c.file and own.offset == c.offset and _same_record(own, c))

    def followable(self, holders: dict[str, BaseChunks | None]) -> tuple[BaseChunks, int]:
        """This index without the references that their holder (``holders``: None for one
        that cannot be read) does not list exactly as its own chunk, and how many were
        left out: a new chunk equal to one of those is written, never referred to a
        checkpoint that does not hold it."""
        def ok(key: tuple[bytes, tuple[int, ...], int], c: ChunkEntry) -> bool:
            if c.ref is None or c.ref.base == self.name:
                return True
            h = holders.get(c.ref.base)
            return h is not None and h._holds(key, c)

        kept = {k: c for k, c in self._by.items() if ok(k, c)}
        if len(kept) == len(self._by):
            return self, 0
        out = copy.copy(self)
        out._by = kept
        return out, len(self._by) - len(kept)

    def match(self, digest: bytes, nbytes: int, start: tuple[int, ...],
              shape: tuple[int, ...]) -> ChunkEntry | None:
        """The reference for a chunk with this hash and raw size, or None (write it).

        Identity is the 128-bit hash with the shape and raw size (issue 14: a
        strong hash, never CRC-32C alone); the reference takes the holder's
        own CRC-32C and block checksums, which a reader verifies against the
        bytes it reads, so a matched chunk is never checksummed here.
        """
        c = self._by.get((digest, shape, nbytes))
        if c is None:
            return None
        return _moved(c, start, shape, c.ref)


#: The hashed chunks of checkpoints this process committed, or read as a base or as what
#: a base refers to, last (path -> (manifest size, manifest CRC-32C, chunks)), the most
#: recently used last: the next incremental save uses one without decoding that manifest
#: again, once the checkpoint's commit marker shows that exactly that manifest is
#: committed there.
_RECENT: KeptByManifest[BaseChunks] = KeptByManifest(8)


def remember_committed(spath: str, mbytes: bytes, manifest: Manifest) -> None:
    """Record a checkpoint this process just committed with hashed chunks."""
    chunks = BaseChunks(_split(spath)[1], manifest)
    chunks.manifests[chunks.name] = (len(mbytes), checksum(mbytes))
    _RECENT.put(spath, *chunks.manifests[chunks.name], chunks)


def _committed_chunks(storage: Storage, spath: str, name: str, *, of: str) -> BaseChunks:
    """The hashed chunks of the committed sibling ``name`` of ``spath``: the index kept
    for it while its commit marker names the same manifest, else read (and kept)."""
    path = sibling_path(spath, name)
    known = _RECENT.get(storage, path)
    if known is not None:
        return known
    reader, m, size, crc = _open_committed(storage, spath, name, of=of)
    reader.close()
    chunks = BaseChunks(name, m)
    chunks.manifests[name] = (size, crc)
    _RECENT.put(path, size, crc, chunks)
    return chunks


def check_base(path: str) -> None:
    """Raise the CheckpointError that a save with ``base=path`` would raise opening it
    (missing, not committed, its manifest damaged); the index read is kept for that save.

    Raises:
        StorageError: the store failed (not the checkpoint).
        CheckpointError: ``path`` cannot be a base.
    """
    storage, spath = storage_for(path)
    _committed_chunks(storage, spath, _split(spath)[1], of=f"the base {spath}")


def base_chunks(storage: Storage, spath: str, name: str) -> BaseChunks:
    """The hashed chunks of the committed sibling ``name`` of ``spath`` (a save's base).

    The chunks the base itself refers to are offered only where their holder
    (a sibling) is committed and lists that very chunk as its own; the others
    are left out, with a warning, so that the save writes them instead of
    committing a reference nothing can follow.

    Raises:
        CheckpointError: the base is missing, naming it; UnsafeCheckpointError:
            it is not committed.

    Warns:
        RuntimeWarning: the base refers to a checkpoint that is missing, not
            committed, unreadable or no longer holds those chunks (the base
            itself cannot be loaded then), naming both.
    """
    chunks = _committed_chunks(storage, spath, name, of=f"the save to {spath}")
    holders: dict[str, BaseChunks | None] = {}
    why: dict[str, str] = {}
    for h in sorted(chunks.holders()):
        try:
            holders[h] = _committed_chunks(storage, spath, h, of=f"base checkpoint {name}")
        except StorageError:
            raise  # the store failed, not the checkpoint
        except CheckpointError as exc:
            holders[h], why[h] = None, str(exc)
    usable, dropped = chunks.followable(holders)
    if dropped:
        _warn_unfollowable(spath, name, why, dropped)
    usable = copy.copy(usable)  # (the kept index is shared: its manifests stay its own)
    usable.manifests = {n: c.manifests[n] for n, c in [(name, chunks), *holders.items()]
                        if c is not None}
    return usable


def _warn_unfollowable(spath: str, name: str, why: dict[str, str], dropped: int) -> None:
    cause = "; ".join(why.values()) or (
        "the checkpoints it refers to no longer list those chunks (replaced since?)")
    warnings.warn(
        f"base checkpoint {name} of the save to {spath} refers to {dropped} chunk(s) that "
        f"cannot be followed ({cause}); the save writes them instead of referring to them, "
        f"but {name} itself cannot be loaded", RuntimeWarning, stacklevel=2)
