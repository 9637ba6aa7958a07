"""A manager's local tier: steps commit on this node's disk, then persist in the background.

Layout of the local tier (a local directory, one per node):

- ``step_<N>/``: the step as committed locally (a normal checkpoint; with
  several processes on several nodes, each node's copy holds the manifest and
  the data files its own processes wrote, see docs/manager.md);
- ``step_<N>.persisted``, ``step_<N>.unpersisted``: which steps are persisted
  (manager/_records.py; a step the persistent keep policy already deleted is
  never persisted again, nor one it would delete as soon as it was:
  :meth:`LocalTier.drop_unwanted`);
- ``.statestream.lock``: the local lease (``flock``) of the node's manager;
- ``.statestream-directory``: the persistent directory this tier belongs to
  (a tier holding another directory's steps is refused, so a run never lists,
  loads or persists another run's steps).

Persisting a step copies its files to ``directory/step_<N>`` with every
chunk's checksum verified on the way, and commits there last
(``engine.copy_checkpoint``), on the engine's background worker.

Incremental steps (``incremental=True``) refer to chunks of older local
steps (sibling names, so the same references hold in ``directory``). A step
is persisted only after every step it refers to is committed in
``directory``: a base the persistent keep policy already deleted is copied
again from the local tier first, and while a step waits to be persisted the
manager's keep policy on ``directory`` protects its bases
(:meth:`LocalTier.bases_to_keep`).
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable

from statestream import _hooks
from statestream.api import metadata
from statestream.distributed import (
    Collective,
    agree,
    byte_channel,
    gather_each,
    share_from_0,
)
from statestream.engine import (
    BackgroundTasks,
    NodeGroups,
    SaveHandle,
    TaskHandle,
    copy_checkpoint,
    replicate_to_peers,
)
from statestream.errors import (
    CheckpointError,
    InvalidOptionError,
    StorageError,
    storage_error,
)
from statestream.manager._lease import DirectoryLease
from statestream.manager._policies import KeepPolicy
from statestream.manager._records import StepRecords, claim, identity
from statestream.manager._resume import is_damage
from statestream.manager._retention import Retention
from statestream.manager._steps import StepDirectory
from statestream.manager._tierrefs import missing_bases
from statestream.manager._tierspace import TierRoom, make_room, went_through
from statestream.manager._uploads import upload_filter
from statestream.storage import LocalStorage, storage_for

__all__ = ["LocalTier"]

class LocalTier:
    """The local steps of a manager and their persistence to its directory.

    Args:
        root: the local directory (a path, or ``file://``).
        persistent: the manager's directory.
        keep: the local keep policy (a step leaves only once persisted).
        coll: the collective of the background persistence (a forked channel).
        groups: which processes share which node's directory (the leader of
            each manages it: lease, cleanup, local keep policy).
        peers: after each local commit, send this process's files to the next
            node's local tier too (``replicate_to_peers``).
        after_persist: called on the background worker after each persistence that
            went through (the manager applies the directory's keep policy there:
            the training thread never waits on the store to clean up).
        directory_keep: the directory's keep policy, when a step it drops stays
            dropped (``drops_for_good``): unpersisted steps it would delete as soon
            as they were persisted are not persisted (:meth:`drop_unwanted`).
        memory_bytes: the manager's memory budget, which the copies' buffers stay
            within (None: 16 MiB per file copied at once).
        take_lease: called on rank 0 (agreed) before each persistence: takes the
            directory's lease if the manager opened without it (its store could not
            be reached) and checks it is still held (again as each copy commits);
            until it succeeds nothing is persisted.
        on_close: called once the persistence thread has ended after :meth:`close`
            (on that thread, or in ``close``): ``coll`` is no longer used.
    """

    def __init__(self, root: str, persistent: StepDirectory, keep: KeepPolicy,
                 coll: Collective, groups: NodeGroups, *, peers: bool = False,
                 after_persist: Callable[[], None] | None = None,
                 directory_keep: KeepPolicy | None = None,
                 memory_bytes: int | None = None,
                 take_lease: Callable[[], None] | None = None,
                 on_close: Callable[[], None] | None = None) -> None:
        self._on_close = on_close
        storage, path = storage_for(root)
        if not isinstance(storage, LocalStorage):
            raise InvalidOptionError(
                f"local_tier must be a local directory (a node's own disk), got {root!r}")
        self.dir = StepDirectory(storage, path)
        self.root = path
        self.persistent = persistent
        self.retention = Retention(keep, self.dir)
        self.records = StepRecords(self.dir)
        self.room = TierRoom()  # what its leader said of a tier short of room
        self._coll = coll
        self.groups = groups
        self._leader = leader = groups.is_leader
        self.memory_bytes = memory_bytes  # the persistence copy's buffers stay within it
        self._peers = peers
        self._after_persist = after_persist
        self._directory_keep = directory_keep
        self._take_lease = take_lease
        self.tasks = BackgroundTasks("statestream-persist", nice=10)
        #: guards _running, _base_of, _active and the records drop_unwanted writes
        self._lock = threading.RLock()
        #: the step this process is persisting now (never dropped meanwhile)
        self._active: int | None = None
        self._running: dict[int, TaskHandle] = {}
        #: the base each queued step was saved against (known before it commits)
        self._base_of: dict[int, int | None] = {}
        self.lease: DirectoryLease | None = None
        #: steps whose local copy a load found damaged (the persisted copy was loaded
        #: instead): never an incremental save's base here, until saved again
        self.damaged_copies: set[int] = set()
        #: the last persistence failed: the directory is probably unreachable
        self.directory_failing = False
        if leader:
            self._open_as_leader(storage)

    def _open_as_leader(self, storage: LocalStorage) -> None:
        """Take the local lease, check the tier is this directory's, clean it up."""
        if (isinstance(self.persistent.storage, LocalStorage)
                and os.path.realpath(self.root) == identity(self.persistent)):
            raise InvalidOptionError(
                f"local_tier {self.root} is the checkpoint directory itself; give the "
                "local tier a directory of its own on the node's local disk")
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as exc:
            raise storage_error(f"cannot create the local tier {self.root}: {exc}",
                                exc) from exc
        self.lease = DirectoryLease(storage, self.root, self.dir.lease_path(), 60.0)
        try:
            self.lease.check()  # a local tier that cannot be written is no tier
            claim(self.root, self.persistent, self.steps)
            self.dir.remove_leftovers()
            self.records.forget_orphans()
            self._drop_stale()
        except BaseException:
            self.lease.release()  # a tier that failed to open holds nothing
            raise

    # ------------------------------------------------------------------ state
    def path(self, step: int) -> str:
        return self.dir.path(step)

    def steps(self) -> list[int]:
        """Steps committed in this node's local tier."""
        return self.dir.steps()

    def is_committed(self, step: int) -> bool:
        return self.dir.is_committed(step)

    def is_persisted(self, step: int) -> bool:
        """Recorded as persisted. Reads the local disk only: the training thread
        asks it, and the persistent directory may be down."""
        return self.records.is_persisted(step)

    def current_in_persistent(self, step: int) -> bool:
        """The persistent directory holds ``step`` as the local tier holds it."""
        return not self.records.is_replaced(step) and self.persistent.is_committed(step)

    def pending_steps(self) -> set[int]:
        """Steps whose persistence is queued or running."""
        with self._lock:
            self._running = {s: h for s, h in self._running.items() if not h.done()}
            self._base_of = {s: b for s, b in self._base_of.items() if s in self._running}
            return set(self._running)

    def queued_bases(self) -> set[int]:
        """The bases that queued steps not committed locally yet are saved against
        (their manifests do not exist yet). A committed step's manifest names what it
        refers to; its save-time base was protected here until it was persisted, even
        when the step referred to nothing of it or was dropped itself, so an outage
        slower than the saves kept every local step."""
        with self._lock:
            self.pending_steps()  # forgets the finished ones
            queued = [(s, b) for s, b in self._base_of.items() if b is not None]
        return {b for s, b in queued if not self.is_committed(s)}

    def unpersisted(self) -> list[int]:
        """Locally committed steps not recorded as persisted, ascending (local disk only)."""
        return [s for s in self.steps() if not self.is_persisted(s)]

    def settle_records(self) -> list[int]:
        """:meth:`unpersisted`, less the steps the persistent directory holds as the
        tier does (a crash between the commit there and the record): those are
        recorded now (by the leader). Asks the directory: at open and in the
        background only."""
        out = []
        for s in self.unpersisted():
            try:
                there = self.current_in_persistent(s)
            except StorageError:  # the store is down: persisted again once it is back
                there = False
            if not there:
                out.append(s)
            elif self._leader:
                self.records.record(s)
        return out

    def _drop_stale(self) -> None:
        """Remove the local steps from the oldest one that the persistent directory
        holds as another save on: an earlier attempt's copies on a node the run
        moved away from (the run went on from an older step elsewhere and saved
        that step again). They are no longer the run's history: never loaded,
        persisted or used as a base."""
        steps = self.steps()
        first = next((s for s in steps if self._is_stale(s)), None)
        if first is None:
            return
        stale = [s for s in steps if s >= first]
        warnings.warn(
            f"the local tier {self.root} holds step {first} as another save than "
            f"{self.persistent.directory} holds: the local steps {stale} are an earlier "
            "attempt's, removed (a step the directory holds loads from there)",
            RuntimeWarning, stacklevel=2)
        for s in reversed(stale):  # newest first: no dangling reference
            self.dir.discard(s)
            self.records.forget(s)
            self.retention.forget(s)

    def _is_stale(self, step: int) -> bool:
        """The persistent directory holds ``step`` committed as another save."""
        try:
            if self.records.is_replaced(step) or not self.persistent.is_committed(step):
                return False  # saved again here (newer), or the local copy is the only one
        except StorageError:
            return False  # the store is down: cannot tell; the next open looks again
        try:
            here, there = metadata(self.path(step)), metadata(self.persistent.path(step))
        except CheckpointError:
            return False  # unreadable: a load of it falls back or says what is wrong
        return here.meta != there.meta

    # ------------------------------------------------------------------ persistence
    def forget_persisted(self, step: int) -> None:
        """``step`` is about to be saved again: its new copy is not persisted yet,
        whatever copy the persistent directory holds (a crash or a failed
        persistence leaves the marker; the next persistence replaces that copy).

        A persistence of ``step`` still queued or running is waited for first: it
        copies the copy being replaced, and recording that as persisted after the
        marker was set would make the new copy's persistence skip it (the forced
        save was then never persisted, and removed at the next open).
        """
        self.damaged_copies.discard(step)
        with self._lock:
            running = self._running.get(step)
        if running is not None:
            running.wait()  # its error, if any, is reported as every persistence's
        self.retention.forget(step)
        if self._leader:
            self.records.replaced(step)

    def persist(self, step: int, after: SaveHandle | None = None,
                base: int | None = None) -> TaskHandle:
        """Queue the persistence of ``step`` (after ``after``, its save, commits).

        ``base``: the step it was saved against (incremental), protected in the
        persistent directory from now on, before the step's manifest exists.
        """

        def task() -> None:
            if saved := after is None or went_through(after):  # failed: its handle reports it
                self._persist_one(step, replicate=self._peers)
                _hooks.fire("tier.persisted")
            caught = self._catch_up(before=step if saved else None)  # a failed save's too
            if self._after_persist is not None and (saved or caught):
                self._after_persist()
            _hooks.fire("tier.caught_up")

        with self._lock:
            self._base_of[step] = base
            h = self.tasks.submit(self._watched(task),
                                  f"persisting step {step} to {self.persistent.directory}")
            self._running[step] = h
        return h

    def _watched(self, task: Callable[[], None]) -> Callable[[], None]:
        """``task``, recording whether it reached the persistent directory."""

        def run() -> None:
            try:
                task()
            except BaseException:
                self.directory_failing = True
                raise
            self.directory_failing = False

        return run

    def _persist_one(self, step: int, replicate: bool = False) -> list[int]:
        """Persist ``step`` after the steps it refers to that the directory lacks
        (``replicate``: send this process's files to the next node first); returns
        the steps copied (the same on every process): none when ``step`` is
        recorded by then (persisted, or dropped by :meth:`drop_unwanted`)."""
        if not self._take(step):
            return []
        try:
            if replicate:
                replicate_to_peers(self._coll, byte_channel(self._coll), self.groups,
                                   self.path(step))
            _hooks.fire("tier.persist")
            self._ensure_lease()
            bases = self._agreed_missing_bases(step)
            for b in bases:
                self._copy(b)
            self._copy(step)
        finally:
            with self._lock:
                self._active = None
        return [*bases, step]

    def _ensure_lease(self) -> None:
        """The directory's lease held (taken if the manager could not take it when it
        opened, confirmed if the store has not renewed it for longer than its ttl)."""
        if self._take_lease is None:
            return
        share_from_0(self._coll, f"holding the lease of {self.persistent.directory}",
                     self._take_lease, outcome="nothing was persisted")

    def _take(self, step: int) -> bool:
        """Whether ``step`` is still to be persisted (no process sees it recorded, and
        a node holds it: a step dropped and then deleted by the local keep policy while
        its persistence was queued has nothing to copy); while it is,
        :meth:`drop_unwanted` leaves it alone. Agreed."""
        with self._lock:
            todo = not self.is_persisted(step)
            held = self.is_committed(step)
            self._active = step if todo and held else None
        if self._coll.world_size > 1:
            seen = gather_each(self._coll, f"deciding whether to persist step {step}",
                               lambda: (todo, held), outcome="nothing was persisted")
            todo, held = all(t for t, _ in seen), any(h for _, h in seen)
        todo = todo and held
        if not todo:
            with self._lock:
                self._active = None
        return todo

    def _catch_up(self, before: int | None) -> list[int]:
        """Persist the local steps that earlier persistences left unpersisted (a store
        that was down), older than ``before`` (all: None), oldest first, so that once the
        store is back everything catches up without a restart; returns the steps copied.
        Stops at the first failure (raised: the store is still down); every process copies
        the same steps (the nodes' lists are agreed). A damaged local copy does not stop
        the others (its error is raised at the end)."""
        done: set[int] = set()
        damaged: CheckpointError | None = None
        for s in self._agreed_unpersisted():
            if s not in done and (before is None or s < before):
                try:
                    done.update(self._persist_one(s))
                except CheckpointError as exc:
                    if not is_damage(exc):
                        raise
                    damaged = damaged or exc
        if damaged is not None:
            raise damaged
        return sorted(done)

    def _agreed_unpersisted(self) -> list[int]:
        """The steps every node holds committed and unpersisted (its leader says),
        after :meth:`drop_unwanted` (the step just persisted may outdate older ones).
        Reading the local disk can fail on one node alone (its disk is gone): the
        error travels in the gather, so every process raises it together."""

        def mine() -> list[int] | None:
            self.drop_unwanted()
            return self.settle_records() if self._leader else None

        lists = [set(x) for x in gather_each(
            self._coll, "listing the unpersisted steps of every node's local tier", mine,
            outcome="nothing more was persisted") if x is not None]
        return sorted(set.intersection(*lists))

    def _copy(self, step: int) -> None:
        """Copy ``step`` to the directory, each data file from a process of a node
        that holds it (:func:`upload_filter`: the ranks may have moved)."""
        files = upload_filter(self._coll, self.groups, self.path(step), step)
        copy_checkpoint(self.path(step), self.persistent.path(step), overwrite=None,
                        collective=self._coll, files=files, memory_bytes=self.memory_bytes,
                        before_commit=self._take_lease)
        err: BaseException | None = None
        if self._leader:
            try:
                self.records.persisted(step)
            except Exception as exc:  # noqa: BLE001 - agreed: the next collective must match
                err = exc
        agree(self._coll, f"recording step {step} as persisted in {self.root}", err,
              check_as=f"recording step {step} as persisted in the local tier",
              outcome=f"step {step} was persisted but is not recorded so: it is copied again")

    def _agreed_missing_bases(self, step: int) -> list[int]:
        """What ``step`` refers to that the directory lacks (``_tierrefs.missing_bases``),
        as rank 0 of the persistence channel sees it."""
        todo: list[int] = []
        err: BaseException | None = None
        if self._coll.rank == 0:
            try:
                todo = missing_bases(self, step)
            except BaseException as exc:
                err = exc
        agree(self._coll, f"finding what step {step} refers to", err)
        if self._coll.world_size > 1:
            todo = self._coll.broadcast_object(todo, src=0)
        return todo

    def bases_to_keep(self) -> set[int]:
        """Steps the persistent keep policy must not delete yet: every step that a
        step still to be persisted refers to (its manifest's ``bases``: references
        are flattened, so its copy needs those only; a base that is itself still to
        be persisted counts by its own bases).

        A queued step that has not committed locally yet counts by the base it
        is saved against; a local manifest that cannot be read protects every
        local step (what it refers to is unknown).
        """
        out: set[int] = set()
        for s in self.pending_steps() | set(self.unpersisted()):
            bases = self.retention.bases_of(s) if self.is_committed(s) else None
            if bases is None:
                if self.is_committed(s):
                    return set(self.steps())
                with self._lock:
                    b = self._base_of.get(s)
                bases = [] if b is None else [b]
            out.update(bases)
        return out

    def holds(self, step: int) -> bool:
        """``step`` is committed here with every step it refers to (a retired local
        step whose bases the local keep policy deleted loads from the directory)."""
        if not self.is_committed(step):
            return False
        bases = self.retention.bases_of(step)
        return bases is None or all(self.is_committed(b) for b in bases)

    def wait(self) -> None:
        """Wait for every queued persistence, then try once more, every process
        together, to persist what is still unpersisted; raise if that fails.

        Raises:
            CheckpointError: a step could not be persisted (it stays in the local
                tier; later saves, ``wait`` and the next manager persist it again);
                with several processes a ``DistributedError`` on every process;
                the tier is closed (its manager was).
        """
        if self.tasks.closed:
            raise CheckpointError(f"the local tier {self.root} is closed (its manager was)")
        for h in self.tasks.handles():
            try:
                h.result()
            except BaseException:
                if not h.done():
                    raise  # the wait was interrupted (KeyboardInterrupt), not the task
                # a step left unpersisted is retried (and reported) just below
        h = self.catch_up_now()
        try:
            h.result()
        except BaseException as exc:
            if not h.done() or isinstance(exc, CheckpointError):
                raise
            raise CheckpointError(f"persisting a local step failed: {exc}") from exc

    def catch_up_now(self, why: str = "") -> TaskHandle:
        """Queue :meth:`wait`'s catch-up (after what is queued; every process alike)."""
        return self.tasks.submit(self._watched(self._retry_all), "persisting the unpersisted "
                                 f"local steps to {self.persistent.directory}{why}")

    def _retry_all(self) -> None:
        err: BaseException | None = None
        try:
            self._catch_up(before=None)
        except BaseException as exc:
            err = exc
        agree(self._coll, f"persisting the local steps to {self.persistent.directory}", err,
              outcome=f"the steps stay in the local tier {self.root}")

    def report_failed(self) -> None:
        """Warn about each finished persistence that failed and was not reported yet.

        Never raises: the step being saved commits locally whatever the store
        does, and every process goes on the same way (a warning decides nothing).

        Warns:
            RuntimeWarning: naming the failure and the local-only steps.
        """
        for h in self.tasks.handles():
            if not h.done():
                continue
            try:
                h.result()
            except Exception as exc:  # noqa: BLE001 - reported as a warning, see above
                warnings.warn(
                    f"{h.what} failed ({type(exc).__name__}: {exc}); the steps "
                    f"{self.unpersisted()} are only in the local tier {self.root}. Saves go "
                    "on: each later save's persistence retries them (oldest first), and "
                    "wait() and close() raise if they still cannot be persisted",
                    RuntimeWarning, stacklevel=3)

    # ------------------------------------------------------------------ retention
    def drop_unwanted(self) -> list[int]:
        """Record as persisted the unpersisted steps that the directory's keep
        policy would delete as soon as they were persisted: it drops them among
        the local steps (persisted or not), so among the directory's steps too
        (a step it drops stays dropped: a newer or better step stays or was
        dropped for one newer or better still), and no step it keeps refers to
        them. They are never uploaded, and the local keep policy deletes them as
        it deletes persisted steps: this bounds the local tier during an outage.
        Local disk only (the leader: the training thread, and the worker before a
        catch-up).

        Warns:
            RuntimeWarning: naming the steps that will not be persisted.
        """
        if self._directory_keep is None or not self._leader:
            return []
        with self._lock:
            todo = set(self.unpersisted())
            protected = self.queued_bases()
            if self._active is not None:
                protected.add(self._active)
            # an unpersisted step that is kept for a reference is copied to the directory
            # later, which needs its bases there first: those are kept too (``through``)
            dropped = [s for s in self.retention.dropped_by(self._directory_keep, self.steps(),
                                                            protected, through=todo)
                       if s in todo and s not in protected]
            for s in dropped:
                self.records.record(s)
        if dropped:
            warnings.warn(
                f"the local steps {dropped} are not persisted to {self.persistent.directory}: "
                "its keep policy would delete them as soon as they were (newer steps wait "
                f"to be persisted); they count as persisted and leave the local tier "
                f"{self.root} by its keep policy", RuntimeWarning, stacklevel=5)
        return dropped

    def apply_keep(self) -> list[int]:
        """Apply the local keep policy to persisted steps (the leader only), then,
        if the tier has less room than the next save needs, drop the oldest persisted
        steps still there (``_tierspace.make_room``)."""
        if not self._leader or self.lease is None:
            return []
        self.lease.check()
        self.drop_unwanted()
        with self._lock:
            active = set() if self._active is None else {self._active}
        protected = set(self.unpersisted()) | active | self.queued_bases()
        dropped = self.retention.apply(protected)
        for s in dropped:
            self.records.forget(s)
        with self._lock:  # a full tier: persisted copies make room for the next save
            if self._active is not None:
                protected.add(self._active)
            return dropped + make_room(self, protected | self.pending_steps())

    def close(self) -> None:
        """End the persistence thread and release the local lease. The thread is
        waited for unless a persistence is still running (a ``wait`` interrupted
        before it): it then ends after that one."""
        on_close, self._on_close = self._on_close, None
        try:
            busy = bool(self.tasks.pending())
            if busy and on_close is not None:  # once the running persistence ends
                self.tasks.submit(on_close, f"closing the local tier {self.root}")
                on_close = None
            self.tasks.close(wait=not busy)
        finally:
            if on_close is not None:
                on_close()
            if self.lease is not None:
                self.lease.release()

