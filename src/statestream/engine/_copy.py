"""Copy a committed checkpoint to another place, verifying every chunk; commit there last.

This is how a checkpoint of a manager's local tier is persisted: the data
files are copied byte for byte (so the manifest, which names files, offsets
and checksums, stays valid) and every chunk's CRC-32C is checked on the way,
so a copy damaged on the local disk is never persisted as good. The manifest
and commit marker are written last and the destination committed atomically
with the storage's own commit (a rename locally, a marker object on S3).

With several processes, every process copies the data files it selects
(``files``: its own ``data/r<rank>-*`` files, read from its own node's copy),
rank 0 writes the manifest and commits, and every step is agreed on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from statestream.distributed import Collective, SingleProcess, agree
from statestream.engine._core import parallel_for, writers_share
from statestream.engine._refs import sibling_path
from statestream.errors import CheckpointCorruptError, CheckpointError, ChecksumMismatchError
from statestream.format import (
    COMMIT_NAME,
    MANIFEST_NAME,
    MAX_COMMIT_BYTES,
    MAX_MANIFEST_BYTES,
    ChunkEntry,
    Manifest,
    checksum,
    checksum_of_blocks,
    decode_commit,
    decode_manifest,
)
from statestream.storage import (
    CheckpointReader,
    FileWriter,
    WriteTransaction,
    file_where,
    storage_for,
)

__all__ = ["copy_checkpoint", "read_committed"]

#: Bytes moved per read/write between chunks (gaps, padding); chunks go whole.
_PIECE = 16 << 20


def read_committed(reader: CheckpointReader) -> tuple[bytes, bytes, Manifest]:
    """The commit marker, the manifest's bytes and the decoded, verified manifest."""
    where = file_where(reader, MANIFEST_NAME)
    marker = reader.read_bytes(COMMIT_NAME, MAX_COMMIT_BYTES)
    size, crc = decode_commit(marker, f"{reader.location}/{COMMIT_NAME}")
    data = reader.read_bytes(MANIFEST_NAME, MAX_MANIFEST_BYTES)
    if len(data) != size or checksum(data) != crc:
        raise CheckpointCorruptError(
            f"manifest {where} does not match its commit marker; the checkpoint is corrupt")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CheckpointCorruptError(f"manifest {where} is not valid UTF-8: {exc}") from None
    return marker, data, decode_manifest(text, where)


def _chunks_by_file(m: Manifest) -> dict[int, list[ChunkEntry]]:
    out: dict[int, list[ChunkEntry]] = {}
    for a in m.arrays:
        for c in a.chunks:
            if c.ref is None:  # a chunk kept in another checkpoint is not in these files
                out.setdefault(c.file, []).append(c)
    for cs in out.values():
        cs.sort(key=lambda c: c.offset)
    return out


class _ChunkCheck:
    """A chunk's checksum computed piece by piece (pieces end on block boundaries)."""

    def __init__(self, c: ChunkEntry) -> None:
        self.c = c
        self.step = 0
        if c.block_rows and c.shape and c.shape[0]:
            self.step = (c.nbytes // c.shape[0]) * c.block_rows
        # the whole chunk's CRC too, unless it is that of the block CRCs (another
        # writer's: docs/format.md)
        self.whole = not self.step or c.checksum != checksum_of_blocks(c.block_checksums)
        self.crc = 0
        self.blocks: list[int] = []

    def piece(self, limit: int) -> int:
        """Bytes to read at a time: at most ``limit`` in whole blocks, at least one."""
        if not self.step:
            return limit
        return max(self.step, limit // self.step * self.step)

    def add(self, view: memoryview) -> None:
        if self.step:
            self.blocks += [checksum(view[a : a + self.step])
                            for a in range(0, len(view), self.step)]
        if self.whole:
            self.crc = checksum(view, self.crc)

    def check(self, where: str) -> None:
        c = self.c
        ok = ((not self.step or tuple(self.blocks) == tuple(c.block_checksums))
              and (not self.whole or self.crc == c.checksum))
        if not ok:
            raise ChecksumMismatchError(
                f"checksum mismatch in {where} at offset {c.offset} ({c.nbytes} bytes, chunk "
                f"at {list(c.start)}): the copy being persisted is damaged; nothing was "
                "committed")


def _copy_range(reader: CheckpointReader, w: FileWriter, name: str, start: int, end: int,
                buf: bytearray | None, check: _ChunkCheck | None, limit: int) -> None:
    """Copy bytes ``[start, end)`` of ``name`` through ``buf``, feeding ``check``.

    ``buf`` None: the writer keeps the buffers it is given (a backend that
    declares ``retains_buffers``), so each piece gets a buffer of its own.
    """
    piece = check.piece(limit) if check is not None else limit
    pos = start
    while pos < end:
        n = min(piece, end - pos)
        if buf is None:
            view = memoryview(bytearray(n))
        else:
            if len(buf) < n:
                buf.extend(bytes(n - len(buf)))
            view = memoryview(buf)[:n]
        reader.read_into(name, pos, [view])
        if check is not None:
            check.add(view)
        w.write_at([view], pos)
        pos += n


def _copy_file(reader: CheckpointReader, txn: WriteTransaction, name: str, size: int,
               chunks: Sequence[ChunkEntry], retains: bool, limit: int) -> None:
    """Copy one data file in order (object stores write sequentially), verifying chunks.

    Memory: one buffer of at most ``limit`` bytes (or one block of rows, if larger),
    plus what a writer that ``retains`` buffers holds until it uploads them.
    """
    where = file_where(reader, name)
    have = reader.file_size(name)
    if have != size:
        raise CheckpointCorruptError(f"{where} holds {have} bytes, its manifest says {size}")
    w = txn.create_file(name, size)
    try:
        pos = 0
        buf = None if retains else bytearray()
        for c in chunks:
            _copy_range(reader, w, name, pos, c.offset, buf, None, limit)  # padding, as it is
            check = _ChunkCheck(c)
            _copy_range(reader, w, name, c.offset, c.offset + c.nbytes, buf, check, limit)
            check.check(where)
            pos = c.offset + c.nbytes
        _copy_range(reader, w, name, pos, size, buf, None, limit)
        w.finish()
    except BaseException:
        w.abort()
        raise


def _threads_and_piece(memory_bytes: int | None, threads: int,
                       per_file: int) -> tuple[int, int]:
    """Copying threads and each one's buffer. With a budget, an object store writer's
    own part buffers (``per_file``) come out of it, as in a save: at most half of it
    (at least one thread), and the pieces share the rest."""
    if memory_bytes is None:
        return threads, _piece_limit(None, threads)
    threads, left = writers_share(memory_bytes, threads, per_file)
    return threads, _piece_limit(left, threads)


def _piece_limit(memory_bytes: int | None, threads: int) -> int:
    """Each copying thread's buffer: at most 16 MiB, and its share of ``memory_bytes``
    (in 4 KiB pages, at least 1 MiB)."""
    if memory_bytes is None:
        return _PIECE
    return max(1 << 20, min(_PIECE, memory_bytes // threads) // 4096 * 4096)


def _check_bases(m: Manifest, src: str, dst: str) -> None:
    """Refuse to commit a copy whose references would dangle at ``dst``."""
    storage, path = storage_for(dst)
    for name in m.bases:  # decoded: exactly the checkpoints its chunks refer to
        there = sibling_path(path, name)
        if not storage.is_committed(there):
            raise CheckpointError(
                f"cannot commit the copy of {src} at {dst}: it refers to chunks of its base "
                f"{name}, which is not committed at {there}; copy the base there first")


def _check_same_save(coll: Collective, src: str, marker: bytes) -> None:
    """Refuse, on every process, to copy processes' ``src`` copies (each its node's)
    that are different saves: rank 0 would commit its manifest over the others'
    files (a save of it interrupted after some nodes committed their copy)."""
    if coll.world_size == 1:
        return
    markers = coll.all_gather_object(marker.decode("utf-8", "replace"))  # JSON-able (JAX)
    odd = [r for r, m in enumerate(markers) if m != markers[0]]
    if odd:
        raise CheckpointCorruptError(
            f"the copies of {src} that ranks 0 and {odd[0]} read (their nodes') are different "
            "saves of it (a save was interrupted after some nodes committed their copy); "
            "nothing was committed")


def _name(path: str) -> str:
    """The last part of ``path`` (a step's directory name): what the ranks compare of
    a path in their agreements, as a node-local copy's path may differ by node."""
    return path.rstrip("/").rsplit("/", 1)[-1]


def _open_dst(coll: Collective, dst: str, overwrite: bool | None) -> WriteTransaction:
    storage, path = storage_for(dst)
    txn: WriteTransaction | None = None
    err: BaseException | None = None
    if coll.rank == 0:
        try:
            if overwrite is None:
                overwrite = storage.is_committed(path)
            txn = storage.begin_write(path, overwrite=overwrite)
        except BaseException as exc:
            err = exc
    agree(coll, f"starting the copy to {dst}", err, check_as=f"starting the copy to {_name(dst)}")
    token = coll.broadcast_object(txn.token if txn is not None else None, src=0)
    try:
        if txn is None:
            txn = storage.join_write(path, token)
    except BaseException as exc:
        err = exc
    agree(coll, f"joining the copy to {dst}", err, check_as=f"joining the copy to {_name(dst)}")
    assert txn is not None
    return txn


def _commit_copy(txn: WriteTransaction, mbytes: bytes, marker: bytes,
                 before_commit: Callable[[], None] | None) -> None:
    txn.write_bytes(MANIFEST_NAME, mbytes)
    txn.write_bytes(COMMIT_NAME, marker)
    if before_commit is not None:
        before_commit()
    txn.commit()


def copy_checkpoint(src: str, dst: str, *, overwrite: bool | None = False,
                    collective: Collective | None = None,
                    files: Callable[[str], bool] | None = None,
                    threads: int = 4, memory_bytes: int | None = None,
                    require_bases: bool = True,
                    before_commit: Callable[[], None] | None = None) -> None:
    """Copy the committed checkpoint ``src`` to ``dst`` and commit it there.

    Memory: ``threads`` data files are copied at once, each through one buffer of at
    most 16 MiB, or of ``memory_bytes / threads`` (at least 1 MiB, or one block of
    rows) when ``memory_bytes`` (a manager's memory budget) is given.

    Every chunk's checksum is verified as it is read. Collective: each
    process opens its own ``src`` (its node's copy) and copies the data
    files ``files`` selects (default: all of them, which is right for one
    process); rank 0 writes the manifest and marker, calls ``before_commit`` (a
    manager's lease check: raising fails the copy, nothing committed) and commits.

    ``overwrite``: replace ``dst`` if it is committed (None: if it is, which rank 0
    looks up, so a store that fails there fails the copy on every process).

    Chunks ``src`` keeps in its bases (an incremental save's references)
    are not copied: the bases must already be committed next to ``dst``
    under the same names, which is checked before committing
    (``require_bases=False``: not checked, for a copy that is only read for its
    own chunks, such as a manager's retired step, whose bases may be gone).

    Raises:
        ChecksumMismatchError, CheckpointCorruptError: ``src`` is damaged, or the
            processes' copies of it are different saves (their commit markers
            differ); nothing is committed at ``dst``.
        CheckpointError: a base ``src`` refers to is not committed next to ``dst``.
        StorageError: reading or writing failed.
    """
    coll = collective if collective is not None else SingleProcess()
    st, sp = storage_for(src)
    reader: CheckpointReader | None = None
    err: BaseException | None = None
    try:
        reader = st.open_read(sp)
        marker, mbytes, m = read_committed(reader)
    except BaseException as exc:
        err = exc
    try:
        agree(coll, f"opening {src} to copy it", err, check_as=f"opening {_name(src)} to copy it")
        assert reader is not None
        _check_same_save(coll, src, marker)
        txn = _open_dst(coll, dst, overwrite)
        caps = storage_for(dst)[0].capabilities
        retains = caps.retains_buffers
        try:
            by_file = _chunks_by_file(m)
            mine = [(i, f) for i, f in enumerate(m.files) if files is None or files(f.name)]
            n, limit = _threads_and_piece(memory_bytes, max(1, min(threads, len(mine))),
                                          caps.writer_buffer_bytes)
            try:
                parallel_for(lambda job: _copy_file(reader, txn, job[1].name, job[1].size,
                                                    by_file.get(job[0], []), retains, limit),
                             mine, n)
            except BaseException as exc:
                err = exc
            agree(coll, f"copying {src} to {dst}", err,
                  check_as=f"copying {_name(src)} to {_name(dst)}")
            err = None
            if coll.rank == 0:
                try:
                    if require_bases:
                        _check_bases(m, src, dst)
                    _commit_copy(txn, mbytes, marker, before_commit)
                except BaseException as exc:
                    err = exc
            agree(coll, f"committing the copy of {src} at {dst}", err,
                  check_as=f"committing the copy of {_name(src)} at {_name(dst)}")
        except BaseException:
            if coll.rank == 0:
                txn.abort()
            raise
    finally:
        if reader is not None:
            reader.close()
