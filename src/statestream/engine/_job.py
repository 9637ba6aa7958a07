"""The save job: walk -> agree -> stage -> write -> commit, for one process or many.

``ss.save`` and ``ss.save_async`` run the same :class:`SaveJob`; one process
is the collective case with a collective of one (whose agreements cost
nothing). The phases:

1. **begin** (caller's thread): walk the state into a tree and prepared
   arrays; with several processes, gather every process's tree and array
   descriptions, agree on the checkpoint's tree (differences are named by
   rank and key path before any data is written), choose one writer per
   distinct box (engine/_plans.py, which reuses the plan of an earlier save of
   the same structure) and open the shared transaction.
2. **stage**: a synchronous save writes straight from the state (zero-copy
   views, device arrays through pinned buffers); one process starts writing
   while the walk goes on. An asynchronous save *snapshots* every chunk it
   writes into staging buffers under the memory budget (on the caller's
   thread, or in the background when lazy), checking that nothing it copied
   was modified in place before the copy landed (engine/_snapshot.py).
3. **write**: one writer thread per data file; records of what was written
   (offset, stored size, checksums) are made after the bytes exist.
4. **commit**: every process agrees its part is durable; the parts (each
   process's files and chunk records) are gathered to rank 0 alone, which joins
   them into the manifest, writes it and the commit marker, and commits. The
   manifest carries the save's id (``meta.save_id``, rank 0's random 128 bits,
   sent with the transaction's token), by which a process that loses rank 0 at
   the last agreement tells whether what is committed is this save.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from statestream import __version__, _hooks
from statestream.distributed import agree
from statestream.engine._collect import Collector
from statestream.engine._committed import committed_as_saved
from statestream.engine._core import (
    ByteBudget,
    snapshot_budgets,
    writers_share,
)
from statestream.engine._handle import SaveHandle
from statestream.engine._ledger import StagingLedger
from statestream.engine._nodelocal import NodeGroups, node_groups
from statestream.engine._plans import agree_on_plan, total_bytes
from statestream.engine._recent import remember_summary
from statestream.engine._refs import (
    BaseChunks,
    base_chunks,
    base_name_for,
    check_bases_committed,
    refuse_replacing_a_base,
    remember_committed,
)
from statestream.engine._saveopts import SaveOptions, check_user_meta
from statestream.engine._snapshot import check_copied, run_background, take_snapshot
from statestream.engine._write import StreamWriter
from statestream.format import (
    COMMIT_NAME,
    MANIFEST_NAME,
    ChunkEntry,
    Manifest,
    decode_manifest,
    encode_commit,
    encode_manifest,
    itemsize_of,
)
from statestream.plan import (
    ArrayDecl,
    ArraySpec,
    MergedTree,
    RankPart,
    StreamPlanner,
    WriteItem,
    build_manifest,
    single_tree,
)
from statestream.storage import WriteTransaction, storage_for

__all__ = ["SaveJob", "SaveOptions"]

_Box = tuple[tuple[int, ...], tuple[int, ...]]
#: The smallest chunk of an array whose chunks are copies, whatever the budget.
MIN_COPY_CHUNK_BYTES = 1 << 20


def _no_pause() -> None:
    pass


class SaveJob:
    """One save of ``state`` to ``path`` (see the module docstring).

    ``snapshot``: copy the state into staging buffers before writing (an
    asynchronous save) instead of writing straight from it; ``lazy``: the
    snapshot runs in the background, reading private copies where a
    provider needs them.
    """

    def __init__(self, path: str | os.PathLike[str], state: Any, options: SaveOptions, *,
                 snapshot: bool, lazy: bool = False) -> None:
        self.state = state
        self.options = options
        self.coll = options.collective
        #: the collective of the commit phase (async saves: a forked channel, so
        #: background messages never interleave with the training thread's)
        self.finish_coll = self.coll
        self.snapshot_mode = snapshot
        self.lazy = lazy
        self.multi = self.coll.world_size > 1
        self.storage, self.spath = storage_for(path)
        # Which memory each array uses matters to guarded optimizer steps (async
        # saves); whether it changed before its copy, to every snapshot: a lazy one
        # races the training step, and another thread may change the state while
        # save_async copies it (which once committed a mix of old and new chunks).
        self.collector = Collector(options.pickle_paths, track=snapshot, versions=snapshot,
                                   private_copies=lazy)
        io = options.io
        # an object store writer's own part buffers come out of the budget
        files, capacity = writers_share(options.memory.resolved(), io.write_threads(),
                                        self.storage.capabilities.writer_buffer_bytes)
        # An array whose chunks are copies (non-contiguous, byte-swapped) takes each
        # chunk whole: at most a quarter of the budget, so writers copy side by side.
        # Compressing a chunk takes up to twice its size (output, shuffled copy), and
        # a snapshot keeps a quarter of its budget for that: an eighth.
        self.planner = StreamPlanner(file_prefix=f"data/r{self.coll.rank}",
                                     max_files=files,
                                     max_chunk_bytes=io.max_chunk_bytes,
                                     copy_chunk_bytes=max(MIN_COPY_CHUNK_BYTES, capacity // 4),
                                     codec_chunk_bytes=max(MIN_COPY_CHUNK_BYTES, capacity // 8))
        self.txn: WriteTransaction | None = None
        self.merged: MergedTree | None = None
        self._total_bytes = 0  # the checkpoint's raw size (the manifest's total_bytes)
        #: per local array: the boxes this process writes (None: one process, all)
        self.mine: list[list[_Box]] | None = None
        self.items: list[list[WriteItem]] = []
        self.ledger = StagingLedger(
            self.collector.arrays, self.collector.key, options.memory,
            retains_buffers=self.storage.capabilities.retains_buffers, snapshot=snapshot,
            capacity=capacity)
        # A synchronous save's own buffers share the budget with the staging buffers
        # an earlier save_async left idle: taking bytes frees idle ones beyond the rest.
        # (A snapshot's budgets are split once the walk found its arrays: _open_writer.)
        self.budget = self._codec_budget = ByteBudget(
            capacity, on_use=None if snapshot else self.ledger.leave_room)
        self.handle: SaveHandle | None = None
        self._writer: StreamWriter | None = None
        #: the snapshot races the writers (see StagingLedger): writers read
        #: through race_source instead of taking staged copies only
        self._race = False
        self._torn: set[int] = set()
        self._torn_lock = threading.Lock()
        self._decls: list[ArrayDecl] = []
        #: the base's hashed chunks (an incremental save), read at the begin
        self.base: BaseChunks | None = None
        #: with ``node_local`` and several processes: who shares which copy
        self.groups: NodeGroups | None = None
        #: the manifest this process built at the commit (rank 0), for remember_committed
        self._built: Manifest | None = None
        #: this node's leader committed its copy of a node-local save
        self._committed_here = False
        #: with several processes: this save's id, agreed with the transaction (meta.save_id)
        self.save_id: str | None = None
        self._user_meta: dict[str, Any] | None = None
        #: an asynchronous save's pause of the cyclic collector, resumed once its
        #: outcome is known (statestream._gc; idempotent)
        self.resume_gc: Callable[[], None] = _no_pause

    def _open_base(self) -> None:
        """Read the base's manifest (before anything is written)."""
        if self.options.base is None:
            return
        name = base_name_for(self.storage, self.spath, self.options.base)
        self.base = base_chunks(self.storage, self.spath, name)

    def _begin_write(self) -> WriteTransaction:
        """Open the save's transaction; a committed checkpoint that incremental
        siblings refer to is not replaced (``overwrite=True`` would break them)."""
        refuse_replacing_a_base(self.storage, self.spath, self.options.overwrite)
        return self.storage.begin_write(self.spath, overwrite=self.options.overwrite)

    @property
    def writer(self) -> StreamWriter:
        assert self._writer is not None, "the save job has not begun"
        return self._writer

    # ----------------------------------------------------------------------- begin
    def begin(self) -> None:
        """Walk, agree, plan and open the transaction (collective).

        One process has nothing to agree on, so it opens its transaction
        *before* the walk and (writing straight from the state) starts its
        writers on each array as the walk finds it; everything after the begin
        is the same for one process and many.
        """
        if self.multi:
            self._begin_collective()
        else:
            self._begin_single()

    def _begin_single(self) -> None:
        self._user_meta = check_user_meta(self.options.user_meta)
        self._open_base()
        self.txn = self._begin_write()
        try:
            if not self.snapshot_mode:
                self._open_writer()
                # Writers start on each array while the walk goes on to the next.
                self.collector.on_array = lambda i, _: self.writer.submit(self._plan(i))
            try:
                tree = self.collector.walk(self.state)
            finally:
                self.collector.on_array = None  # (it refers back to the job: no cycle)
            if self.snapshot_mode:
                self._open_writer()  # its budget depends on the arrays found
                self.items = [self._plan(i) for i in range(len(self.collector.arrays))]
            self.merged = single_tree(tree, self.collector.arrays)
            self._total_bytes = total_bytes(self.collector.arrays)
        except BaseException:
            self._abort_local()
            raise

    def _begin_collective(self) -> None:
        coll = self.coll
        tree = None
        err: BaseException | None = None
        try:  # a fault of one rank's own (its metadata, its base, its state) is agreed
            self._user_meta = check_user_meta(self.options.user_meta)
            self._open_base()
            tree = self.collector.walk(self.state)
        except BaseException as exc:
            err = exc
        agree(coll, "walking the state", err)
        assert tree is not None
        decls = self._decls = self.collector.decls()
        boxes = [a.boxes if a.boxes is not None else [((0,) * len(a.shape), a.shape)]
                 for a in self.collector.arrays]
        # the plan of an earlier save of the same structure is reused (engine/_plans.py)
        self.merged, self.mine, self._total_bytes = agree_on_plan(coll, tree, decls, boxes)
        try:
            self._open_transaction()  # rank 0's may exist when a join fails
            self._open_writer()
            if self.snapshot_mode:
                self.items = [self._plan(i) for i in range(len(self.collector.arrays))]
        except BaseException:
            self._abort_txn()
            raise

    def _open_transaction(self) -> None:
        if self.options.node_local:
            self._open_node_local()
            return
        coll = self.coll
        err: BaseException | None = None
        if coll.rank == 0:
            try:
                self.txn = self._begin_write()
            except BaseException as exc:
                err = exc
        agree(coll, "starting the save", err)
        token, self.save_id = coll.broadcast_object(
            [self.txn.token if self.txn is not None else None,
             secrets.token_hex(16) if coll.rank == 0 else None], src=0)
        try:
            if self.txn is None:
                self.txn = self.storage.join_write(self.spath, token)
        except BaseException as exc:
            err = exc
        agree(coll, "joining the save", err)

    def _open_node_local(self) -> None:
        """Each node's first process opens its copy; the node's others join it."""
        coll = self.coll
        groups = self.groups = node_groups(coll, os.path.dirname(self.spath))
        err: BaseException | None = None
        if groups.is_leader:
            try:
                self.txn = self._begin_write()
            except BaseException as exc:
                err = exc
        agree(coll, "starting the save", err)
        tokens = coll.all_gather_object([self.txn.token if self.txn is not None else None,
                                         secrets.token_hex(16) if coll.rank == 0 else None])
        self.save_id = tokens[0][1]
        try:
            if self.txn is None:
                self.txn = self.storage.join_write(self.spath, tokens[groups.leader()][0])
        except BaseException as exc:
            err = exc
        agree(coll, "joining the save", err)

    def _open_writer(self) -> None:
        assert self.txn is not None
        if self.snapshot_mode:
            self._split_snapshot_budget()
            # A failed writer never gives its staged bytes back: wake the snapshot
            # instead of letting it wait for them forever. The writer charges only
            # its own buffers (the snapshot charged the staged bytes): compression
            # buffers and copies of chunks it reads from the state, to their own
            # share of the budget (see _split_snapshot_budget).
            self._writer = StreamWriter(
                self.txn, self.planner.file_name, self._snapshot_source,
                budget=self._codec_budget,
                after_write=self._snapshot_written, on_error=self.budget.abort,
                nice=self.options.io.background_nice, relayout=self._relayout(),
                hashes=self.options.hashes, base=self.base, nice_later=True,
                defer=self._snapshot_defer, copy_bytes=self._snapshot_copy_bytes)
        else:
            self._writer = StreamWriter(
                self.txn, self.planner.file_name, self.ledger.read, budget=self.budget,
                progress=self.options.progress, after_write=self.ledger.after_write,
                relayout=self._relayout(), hashes=self.options.hashes, base=self.base,
                lendable=self.ledger.lendable)

    def _split_snapshot_budget(self) -> None:
        """Split a snapshot's budget between the staged copies and the writers' own
        buffers (:func:`snapshot_budgets`), once the walk found the arrays.

        A racing snapshot's writers copy each chunk of a non-contiguous or
        byte-swapped array they write from the state; those copies were charged to
        nothing, and each writer batches up to 16 MiB of them (a transposed 128 MiB
        array under a 4 MiB budget, four writers: +40 MiB peak RSS, +13 saved by
        ``ss.save``). The staging pool keeps no more than its share, so that idle
        staging buffers and the writers' copies stay within the budget together.
        """
        copies = sum(a.nbytes for a in self.collector.arrays if a.copies and a.stage is None)
        self.budget, self._codec_budget = snapshot_budgets(
            self.budget.capacity, compresses=bool(self.options.compression), copies=copies)
        self.ledger.set_staging_capacity(self.budget.capacity)

    def _snapshot_copy_bytes(self, item: WriteItem) -> int:
        # what the writer copies to write ``item`` from the state (its own budget)
        return self.ledger.race_copy_bytes(item) if self._race else 0

    def _relayout(self) -> bool:
        # chunks placed one after the other by what is really written (stored sizes;
        # references take no room)
        return bool(self.options.compression) or self.base is not None

    def _plan(self, i: int) -> list[WriteItem]:
        a = self.collector.arrays[i]
        boxes = a.boxes if self.mine is None else self.mine[i]
        isz = itemsize_of(a.dtype)
        codec = (self.options.compression.for_array(self.collector.paths[i], a.dtype, isz)
                 if self.options.compression else None)
        spec = ArraySpec(a.shape, isz, a.copies and not self.snapshot_mode, codec,
                         copied_whole=a.copies)
        return self.planner.add(i, spec, boxes)

    # ----------------------------------------------------------------------- sync
    def run(self) -> None:
        """The whole save on the caller's thread, writing straight from the state."""
        self.begin()
        err: BaseException | None = None
        written: dict[tuple[int, int], ChunkEntry] = {}
        try:
            _hooks.fire("save.planned")  # in the try: an interrupt here aborts the save too
            if self.multi:
                for i in range(len(self.collector.arrays)):
                    self.writer.submit(self._plan(i))
            written = self.writer.close()
            _hooks.fire("save.data_synced")
        except BaseException as exc:
            self.writer.abort()
            self.ledger.reclaim(False)
            err = exc
        self.finish(written, err)

    # ----------------------------------------------------------------------- async
    def release_values(self) -> None:
        """Let go of the state and of what the save made of it (host views of its
        memory, the plan, the tree, the manifest); only what warming the staging
        buffers needs remains. Once the outcome is known, and before the collector
        resumes: hundreds of thousands of objects for a large state, each of which
        a collection would traverse while it lived (statestream._gc)."""
        self.state = None
        self.collector.release()
        self.planner.chunks = []
        self.items = []
        self.merged = None
        self.mine = None
        self._built = None
        self._decls = []
        self.base = None

    def make_handle(self) -> SaveHandle:
        h = self.handle = SaveHandle(self.spath, len(self.collector.arrays))
        h.bytes_total = self.planner.total_bytes
        h._memory = self.collector.memory
        return h

    def _snapshot_source(self, item: WriteItem) -> np.ndarray:
        return self.ledger.race_source(item) if self._race else self.ledger.take(item)

    def _snapshot_defer(self, item: WriteItem) -> Callable[[], None] | None:
        return self.ledger.race_defer(item, self.writer.failed) if self._race else None

    def _snapshot_written(self, items: Sequence[WriteItem]) -> None:
        h = self.handle
        assert h is not None
        if self._race:
            self.ledger.race_written(items, self._check_direct)
        h.bytes_written += sum(it.nbytes for it in items)
        self.budget.release(self.ledger.after_write(items))
        if self.options.progress is not None:
            self.options.progress(h.bytes_written, h.bytes_total)

    def snapshot(self) -> None:
        """Copy or write every chunk before the state may change (engine/_snapshot.py)."""
        take_snapshot(self)

    def _check_direct(self, items: list[WriteItem]) -> None:
        # A chunk written straight from the state: checked after its write.
        check_copied(self, items, self._torn)

    def background(self, run_snapshot: bool, early: BaseException | None = None) -> None:
        """The background phase: (lazy) snapshot, write, agree, commit; never raises."""
        run_background(self, run_snapshot, early)

    # ----------------------------------------------------------------------- commit
    def finish(self, written: dict[tuple[int, int], ChunkEntry],
               error: BaseException | None) -> None:
        """Agree that every process wrote its part; rank 0 commits (collective)."""
        coll = self.finish_coll
        try:
            agree(coll, "writing data", error)
            parts = self._gather_parts(self._part(written))
            err = None
            if self.groups is not None:
                err = self._commit_node_local(parts)
            elif coll.rank == 0:
                try:
                    self._commit(parts)
                except BaseException as exc:
                    err = exc
            # A process lost right after rank 0 committed must not fail a committed
            # save: the survivors check that what is committed is this save's (its
            # parts, on rank 0; its id and metadata, on the others).
            merged = self.merged
            assert merged is not None
            agree(coll, "committing", err, outcome=self._failed_commit_outcome(),
                  committed=lambda: committed_as_saved(self.storage, self.spath, merged,
                                                       parts, self._meta()))
        except BaseException:
            self._abort_txn()
            self._undo_node_local()
            raise

    def _gather_parts(self, part: RankPart) -> list[RankPart] | None:
        """Every process's part on rank 0, in rank order (None on the others).

        With N processes an all-gather would make each receive and decode all N
        parts (a record per chunk); only rank 0 builds the manifest. Collectives
        without ``gather_object`` all-gather, and the others drop what they got.
        """
        if not self.multi:
            return [part]
        coll = self.finish_coll
        gather = getattr(coll, "gather_object", None)
        wires = (gather(part.to_wire(), 0) if gather is not None
                 else coll.all_gather_object(part.to_wire()))
        if coll.rank != 0 or wires is None:
            return None
        return [RankPart.from_wire(w) for w in wires]

    def _part(self, written: dict[tuple[int, int], ChunkEntry]) -> RankPart:
        merged = self.merged
        assert merged is not None
        glob: Sequence[int] = range(len(self.collector.arrays))
        if self.multi:
            glob = [merged.index[d.key] for d in self._decls]
        chunks: dict[int, list[ChunkEntry]] = {}
        for ai, per in enumerate(self.planner.chunks):
            out = [written[(ai, ci)] for ci, (_, _, nb) in enumerate(per) if nb]
            if out:
                chunks[glob[ai]] = out
        return RankPart(self.writer.files(), chunks)

    def _meta(self) -> dict[str, Any]:
        """The manifest's metadata (stamped now)."""
        user = self._user_meta
        return {
            "library": f"statestream {__version__}",
            "created_unix": time.time(),
            "world_size": self.coll.world_size,
            **({"save_id": self.save_id} if self.save_id is not None else {}),
            "total_bytes": self._total_bytes,
            **({"user": user} if user is not None else {}),
        }

    def _manifest_bytes(self, parts: list[RankPart] | None) -> bytes:
        merged, txn = self.merged, self.txn
        assert merged is not None and txn is not None and parts is not None
        manifest = self._built = build_manifest(merged, parts, self._meta())
        check_bases_committed(self.storage, self.spath, {
            c.ref.base for a in manifest.arrays for c in a.chunks if c.ref is not None},
            self.base.manifests if self.base is not None else {})
        mbytes = encode_manifest(manifest)
        if self.multi:
            # Check the merged manifest exactly as a reader will (coverage, overlaps,
            # sizes) before it becomes visible: a planning bug must fail the save.
            decode_manifest(mbytes, f"{txn.location}/{MANIFEST_NAME} (being committed)")
        return mbytes

    def _commit_node_local(self, parts: list[RankPart] | None) -> BaseException | None:
        """Rank 0 builds the manifest; each node's leader commits its own copy of it."""
        coll, groups = self.finish_coll, self.groups
        assert groups is not None
        text: str | None = None
        err: BaseException | None = None
        if coll.rank == 0:
            try:
                text = self._manifest_bytes(parts).decode("utf-8")
            except BaseException as exc:
                err = exc
        agree(coll, "building the manifest", err)
        text = coll.broadcast_object(text, src=0)
        if groups.is_leader:
            try:
                self._commit(parts, text.encode("utf-8"))
            except BaseException as exc:
                return exc
            self._committed_here = True
        return None

    def _failed_commit_outcome(self) -> str:
        if self.groups is None or not self.options.overwrite:
            return "nothing was committed"  # node-local: see _undo_node_local
        return ("the nodes that committed their copy hold the new save, the others the "
                "old one: such copies are never completed from each other nor persisted")

    def _undo_node_local(self) -> None:
        """The nodes did not all commit their copy of a node-local save: a leader that
        committed its own removes it again (a step on some nodes only would be listed
        and never load). A save again (``overwrite``) cannot be undone: its old copy
        is gone; the copies of the two saves are told apart by their markers."""
        if not self._committed_here or self.options.overwrite:
            return
        self._committed_here = False
        try:
            self.storage.delete(self.spath)
        except Exception as exc:  # noqa: BLE001 - the save's own error is raised
            warnings.warn(f"could not remove {self.spath}, committed on this node only: "
                          f"{exc}", RuntimeWarning, stacklevel=2)

    def _commit(self, parts: list[RankPart] | None, mbytes: bytes | None = None) -> None:
        txn = self.txn
        assert txn is not None
        if mbytes is None:
            mbytes = self._manifest_bytes(parts)
        txn.write_bytes(MANIFEST_NAME, mbytes)
        _hooks.fire("commit.manifest_written")
        txn.write_bytes(COMMIT_NAME, encode_commit(mbytes))
        _hooks.fire("commit.marker_written")
        if self.options.before_commit is not None:
            self.options.before_commit()  # raises: aborted as any failed commit
        txn.commit()
        _hooks.fire("commit.renamed")
        if self._built is not None:
            remember_summary(self.spath, mbytes, self._built, refers=self.base is not None)
            if self.options.hashes or self.base is not None:
                remember_committed(self.spath, mbytes, self._built)

    # ----------------------------------------------------------------------- failure
    def _abort_local(self) -> None:
        if self._writer is not None:
            self._writer.abort()
        self.ledger.reclaim(False)
        self._abort_txn()

    def _abort_txn(self) -> None:
        # With several processes, rank 0 owns the transaction; the others joined it
        # (node-local: each node's leader owns its node's).
        owner = self.groups.is_leader if self.groups is not None else (
            not self.multi or self.coll.rank == 0)
        if self.txn is not None and owner:
            self.txn.abort()
