"""CheckpointManager: when to save, what to keep, where the latest good step is."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any

from statestream.api import SaveHandle
from statestream.api._async import guard_state_in
from statestream.api._options import (
    collective_option,
    io_options,
    max_arrays_option,
    memory_options,
    path_arg,
)
from statestream.api._pickles import AllowPickle
from statestream.distributed import Collective, agree, default_collective, share_from_0
from statestream.engine import CompressionOption, CompressionPolicy, IOOptions, MemoryOptions
from statestream.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    InvalidOptionError,
    ManagerLockedError,
)
from statestream.manager._chain import CHAIN_KEY, chain_base, incremental_option
from statestream.manager._decide import LastSaveTime, SaveDecisions, check_can_arm
from statestream.manager._inflight import InFlight
from statestream.manager._lease import (
    DirectoryHold,
    LeaseNotRenewedError,
    close_after,
    open_lease,
    release_after_failed_open,
    release_at_close,
    warn_deferred,
)
from statestream.manager._policies import (
    KeepAll,
    KeepPolicy,
    SavePolicy,
    best_metrics,
    check_policy,
    drops_for_good,
    warn_missing_metrics,
)
from statestream.manager._resume import ResumeGuard, load_newest_good, load_numbered, steps_here
from statestream.manager._retention import Retention, step_info, step_meta
from statestream.manager._savestep import save_step, start_step
from statestream.manager._serial import one_at_a_time, one_at_a_time_if_collective
from statestream.manager._steps import StepDirectory, check_step
from statestream.manager._tier import LocalTier
from statestream.manager._tierops import load_step, open_tier, tier_steps
from statestream.manager._tierspace import raise_if_full, started, write_making_room
from statestream.storage import storage_for

__all__ = ["CheckpointManager", "ManagerLockedError"]


class CheckpointManager:
    """Saves steps under ``directory/step_<N>``, decides when, keeps what policies say.

    Args:
        directory: where steps live (created if missing).
        save_policy: when :meth:`save` really saves (default: every call).
        keep_policy: which committed steps to keep (default: all). The latest
            committed step and the step being written are never deleted.
        async_save: save in the background (one save in flight at most).
        lazy: lazy snapshots (see ``save_async``); the optimizers in the saved
            state are guarded (``guard_optimizer``) by the manager itself.
        preemption: install a SIGTERM handler (one per process, for every manager
            that asks; it also calls the handler it replaced); after SIGTERM,
            :meth:`reached_preemption` turns true and ``OnPreemption`` policies fire.
        collective: processes that save together (default: detected).
        io, memory: engine options for every save and load.
        compression: how every save compresses arrays (see ``save``).
        incremental: True: each save uses the previous step as its ``base`` (see
            ``ss.save``): chunks that did not change are not written again, the
            new step refers to the step that holds them. Every step records
            chunk hashes. A step the keep policy drops is kept (not listed by
            :meth:`steps`) while a kept step refers to it, and deleted once
            none does. With ``local_tier``, steps refer to local steps and
            persist after what they refer to. An int N >= 1: the same, but after
            N incremental saves a full one (docs/manager.md, "Incremental steps").
        lease_ttl_s: how long the directory's lease lasts without renewal where
            the store needs one (object stores; renewed every third of it in the
            background). A crashed manager's directory can be taken over this
            long after its last renewal. Local directories use ``flock``, which
            ends with the holder's process.
        local_tier: a fast local directory (a node's own disk): saves commit
            there and are persisted to ``directory`` in the background (see
            docs/manager.md, "The local tier"); steps the last manager on it did
            not persist are persisted when the manager opens. An object store
            that cannot be reached then does not stop the job: the lease is
            taken before the first persistence (RuntimeWarning).
        local_keep_policy: which persisted steps the local tier keeps (default
            ``KeepLatest(2)``); a step leaves it only once persisted.
        replicate_to_peers: with several nodes, each process's local files are
            also sent (over torch.distributed) to the next node's local tier, so
            a lost node restores from its peer without the persistent directory.

    Threads may share a manager: :meth:`save`, :meth:`wait`, :meth:`close` and
    :meth:`load` run one at a time.

    A directory the manager cannot write (a read-only mount, no permission)
    opens read-only: :attr:`read_only` is true, steps list and load, and
    :meth:`save` raises a StorageError carrying the ``errno`` (EROFS, EACCES).

    Example:
        >>> import numpy as np, tempfile, statestream as ss
        >>> with ss.CheckpointManager(tempfile.mkdtemp(), save_policy=ss.EveryNSteps(2),
        ...                           keep_policy=ss.KeepLatest(2)) as mgr:
        ...     for step in range(7):
        ...         _ = mgr.save(step, {"w": np.full(3, step)}, metrics={"loss": 1 / (step + 1)})
        ...     mgr.wait()
        ...     mgr.steps(), int(mgr.load()["w"][0])
        ([4, 6], 6)
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        save_policy: SavePolicy | None = None,
        keep_policy: KeepPolicy | None = None,
        async_save: bool = True,
        lazy: bool = False,
        preemption: bool = False,
        collective: Collective | None = None,
        io: IOOptions | None = None,
        memory: MemoryOptions | None = None,
        lease_ttl_s: float = 60.0,
        compression: CompressionOption = None,
        incremental: bool | int = False,
        local_tier: str | os.PathLike[str] | None = None,
        local_keep_policy: KeepPolicy | None = None,
        replicate_to_peers: bool = False,
    ) -> None:
        self._calls = threading.RLock()  # save, wait, close, load: one at a time
        self._incremental, self._chain = incremental_option(incremental)
        check_policy(save_policy, "save_policy", "should_save", "ss.EveryNSteps(100)")
        check_policy(keep_policy, "keep_policy", "keep", "ss.KeepLatest(3)")
        check_policy(local_keep_policy, "local_keep_policy", "keep", "ss.KeepLatest(2)")
        io_options(io), memory_options(memory)  # a bad option fails here, not at a save
        if preemption:  # before the lease: a manager that cannot arm holds nothing
            check_can_arm()
        if local_tier is not None:
            path_arg(local_tier, "local_tier")
        storage, self.directory = storage_for(os.fspath(path_arg(directory, "directory")))
        self._dir = StepDirectory(storage, self.directory)
        self._retention = Retention(KeepAll() if keep_policy is None else keep_policy, self._dir)
        self._best_metrics = best_metrics(keep_policy)
        self._coll = (collective_option(collective) if collective is not None
                      else default_collective())
        self._async = async_save
        self._lazy = lazy
        self._io = io
        self._memory = memory
        CompressionPolicy(compression)  # a bad option fails here, not at the first save
        self._compression = compression
        self._flight = InFlight()
        self._resumed = ResumeGuard()
        self._last_time = LastSaveTime()
        self._closed = False
        self._decisions = SaveDecisions(
            save_policy, self._coll,
            lambda step: step == self._last_saved_step or step in self._pending_steps(),
            lambda: (self._last_saved_step, self._last_time.counted(self._flight.handle)))
        opened = open_lease(self._coll, self._dir, lease_ttl_s,
                            may_defer=local_tier is not None)
        self._hold = DirectoryHold(self._dir, opened, lease_ttl_s)
        self._tier: LocalTier | None = None
        try:
            if local_tier is not None:
                if opened.deferred is not None:
                    warn_deferred(self.directory, os.fspath(local_tier), opened.deferred)
                self._tier = open_tier(os.fspath(local_tier), self._dir, local_keep_policy,
                                       self._coll, self._hold.read_only,
                                       replicate_to_peers, self._keep_after_persist,
                                       keep_policy if drops_for_good(keep_policy) else None,
                                       (memory or MemoryOptions()).resolved(),
                                       take_lease=self._hold.ensure)
            self._last_saved_step = self._agreed_latest()
        except BaseException:
            release_after_failed_open(  # it holds nothing
                self._hold, None if self._tier is None else self._tier.close)
            raise
        if preemption:
            self._decisions.install_sigterm()

    @property
    def read_only(self) -> bool:
        """True if the directory could not be written when the manager opened it."""
        return self._hold.read_only is not None

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        close_after(self.close, ev, self._coll, self.directory)  # ev stays the one raised

    @one_at_a_time
    def close(self) -> None:
        """Wait for the in-flight save, apply the keep policy, release the directory."""
        if self._closed:
            return
        try:
            self.wait()
        finally:  # not while the save or a persistence still writes (a Ctrl-C ended the wait)
            if not self._flight.running() and not (self._tier and self._tier.tasks.pending()):
                self._closed = True
                self._decisions.restore_sigterm()
                release_at_close(self._hold, None if self._tier is None else self._tier.close)

    def _keep_and_check(self, phase: str, *, directory: bool = True, check: bool = False,
                        then: Callable[[], None] | None = None,
                        outcome: str = "nothing was committed") -> None:
        """The keep policies, then (``check``) the lease check, then ``then()``,
        agreed: all ranks raise if one failed.

        Both are one process's work (rank 0 holds the lease and deletes from the
        directory, a node's leader keeps its local tier), so a failure there
        (a lost lease, an unwritable directory) must reach the other ranks
        before the save's first collective; they would otherwise wait for it
        until the collective's timeout, and report the failing rank as dead.
        One collective call (an all-reduce) when all went well.
        """
        err: BaseException | None = None
        try:
            self._apply_keep_policy(directory=directory)
            if check:
                self._hold.check_writable(confirm=self._tier is None)
            if then is not None:
                then()
        except Exception as exc:  # noqa: BLE001 - agreed and raised on every rank
            err = exc
        agree(self._coll, phase, err, outcome=outcome)

    # ------------------------------------------------------------------ discovery
    def step_path(self, step: int) -> str:
        """Directory (or URL) of ``step``: its local-tier copy when there is one."""
        if self._tier is not None and self._tier.is_committed(step):
            return self._tier.path(step)
        return self._dir.path(step)

    @one_at_a_time_if_collective
    def steps(self) -> list[int]:
        """Committed steps, ascending (never a step still being written, nor a step
        the keep policy dropped that is kept only because a kept step refers to it).

        With a local tier: the steps committed in either tier.
        """
        if self._tier is None:
            return self._retention.listed()
        return tier_steps(self._tier, self._coll, self._retention.listed)

    def persisted_steps(self) -> list[int]:
        """Steps committed in ``directory`` itself (durable beyond this node), ascending;
        like :meth:`steps`, without those kept only because a kept step refers to them."""
        return self._retention.listed()

    def unpersisted_steps(self) -> list[int]:
        """Steps this node's local tier holds that are not persisted to ``directory``
        yet (queued, or left by a persistence that failed), ascending; ``[]``
        without a local tier. Reads the local disk only (the store may be down):
        e.g. stop a job whose store has been down for too many steps."""
        return [] if self._tier is None else self._tier.unpersisted()

    @one_at_a_time_if_collective
    def latest_step(self) -> int | None:
        """The newest committed step, or None."""
        return max(self.steps(), default=None)

    def _agreed_steps(self) -> list[int]:
        """:meth:`steps`, the same on every rank: without a local tier, rank 0's
        listing (each rank listing the store itself could see another list, or
        fail alone and leave the others waiting in the next collective)."""
        if self._tier is not None:
            return self.steps()  # collective already
        return share_from_0(self._coll, f"listing the steps of {self.directory}",
                            self._retention.listed)

    def _agreed_latest(self) -> int | None:
        return max(self._agreed_steps(), default=None)

    def step_info(self, step: int) -> dict[str, Any]:
        """Recorded metadata of a step: wall time, metrics, size, user metadata."""
        return step_info(self.step_path(step), step)

    def best_step(self, metric: str, mode: str = "min") -> int | None:
        """The committed step with the lowest (``"min"``) or highest (``"max"``) ``metric``.

        Steps saved without that metric (or with NaN, an infinity) do not count; on a tie
        the earliest step wins. None if no committed step has the metric. A
        save still in flight is not committed yet: :meth:`wait` first to count it.

        Example:
            >>> import numpy as np, tempfile, statestream as ss
            >>> with ss.CheckpointManager(tempfile.mkdtemp(), async_save=False) as mgr:
            ...     for step, loss in [(1, 0.9), (2, 0.4), (3, 0.6)]:
            ...         _ = mgr.save(step, {"w": np.zeros(2)}, metrics={"loss": loss})
            ...     mgr.best_step("loss"), mgr.best_step("loss", mode="max")
            (2, 1)
        """
        if mode not in ("min", "max"):
            raise InvalidOptionError(f"best_step mode must be 'min' or 'max', got {mode!r}")
        return self._retention.best(metric, mode)

    # ------------------------------------------------------------------ policies
    @one_at_a_time
    def should_save(self, step: int) -> bool:
        """Whether :meth:`save` at ``step`` would save (decided by rank 0, shared).

        Every rank's preemption flag counts: a SIGTERM seen by any rank fires
        ``OnPreemption`` on all of them.

        Raises:
            InvalidOptionError: ``step`` is not a step number, as for :meth:`save`
                (a JAX or NumPy integer scalar is one).
        """
        # the step as save() takes it: a policy's set of steps could not hash a JAX
        # 0-d array (TypeError), and 8.5 was just 'no'
        return self._decisions.should_save(step, lambda: check_step(step))

    def _pending_steps(self) -> set[int]:
        return self._flight.steps() | (set() if self._tier is None
                                       else self._tier.pending_steps())

    @one_at_a_time
    def reached_preemption(self, step: int) -> bool:
        """True (on every rank) once SIGTERM arrived; save and exit at this boundary.

        Consistent with :meth:`save`: if ``save(step)`` decided without seeing the
        preemption (the signal came just after), this returns False at ``step``
        so that the next ``save(step + 1)`` saves and this returns True there.
        Call ``save`` on every step, as in the example loop.
        """
        return self._decisions.reached_preemption(step)

    # ------------------------------------------------------------------ save/load
    @one_at_a_time
    def save(
        self,
        step: int,
        state: Any,
        metrics: Mapping[str, float] | None = None,
        *,
        force: bool = False,
        metadata: Mapping[str, Any] | None = None,
    ) -> bool:
        """Save ``state`` as ``step`` if the save policy (or ``force``) says so.

        Waits for the previous save first (one in flight at most). With
        ``async_save`` it returns once the state is snapshotted.

        Steps only go forward: a step older than the last one saved raises
        (a resumed run that forgot to advance its step must not rewrite
        history). The last step itself is not saved again (returns False)
        unless ``force``, which rewrites it atomically; while its async save is in
        flight, this waits for that save and raises its error (then it may be saved).

        Returns:
            Whether a save was started.

        ``step`` is an integer from 0 to 10**18 - 1 (NumPy, torch and JAX
        integer scalars are taken as such). ``metrics`` values are numbers;
        NumPy, torch and JAX scalars (a 0-d loss tensor) are stored as theirs.

        Raises:
            CheckpointError: ``step`` is older than the last saved step, or the
                previous background save failed.
            InvalidOptionError: ``step`` is not such an integer.

        Warns:
            UserWarning: ``metrics`` lacks a number for a ``KeepBest`` policy's metric.
            RuntimeWarning: a local tier's step could not be persisted (this one commits).
        """
        if self._closed:
            raise CheckpointError(f"cannot save step {step} in {self.directory}: this "
                                  "CheckpointManager is closed (open a new one)")
        decided = self._decisions.decide_save(step, metrics, force, self.directory)
        if decided is None:
            if self._flight.step is not None and self._flight.step == step:
                self._wait_save()  # a retry of the step in flight: its failure is raised
            return False
        step, metrics = decided
        overwrite = self._prepare_save(step, metrics, force)
        target = self._dir if self._tier is None else self._tier.dir
        path = target.path(step)
        meta = step_meta(step, metrics, metadata)
        base_step, depth = (chain_base(step, self._chain, self._coll, self._tier,
                                       self._retention.listed, self._dir.path,
                                       self._resumed.damaged)
                            if self._incremental else (None, None))
        meta.update({} if depth is None else {CHAIN_KEY: depth})
        base = None if base_step is None else target.path(base_step)

        write_making_room(self._tier, self._coll, step, base_step, not self._async,
                          lambda: self._write(path, state, overwrite, meta, base))
        if self._async:
            assert self._flight.handle is not None
            if self._lazy:  # a step or a forward pass must not race the lazy snapshot
                guard_state_in(state, self._flight.handle)
            self._flight.step = step
            if self._tier is not None:
                self._tier.persist(step, self._flight.handle, base=base_step)
        else:
            self._committed(step)
            if self._tier is not None:
                self._tier.persist(step, base=base_step)
            self._keep_and_check(f"applying the keep policy after step {step}",
                                 directory=self._tier is None,
                                 outcome=f"step {step} was committed")
        self._last_saved_step = step
        self._last_time.started(time.time())
        return True

    def _write(self, path: str, state: Any, overwrite: bool, meta: dict[str, Any],
               base: str | None) -> None:
        """Save (or start saving, ``async_save``) ``state`` to ``path``."""
        tiered = self._tier is not None
        opts: dict[str, Any] = dict(
            overwrite=overwrite, io=self._io, memory=self._memory, collective=self._coll,
            meta=meta, compression=self._compression, base=base, hashes=self._incremental,
            node_local=tiered)
        # a save to the directory commits only while rank 0 holds the lease (confirmed)
        check = None if tiered else self._hold.check_to_commit
        if self._async:  # agreed: one rank's failure is raised on every rank
            self._flight.handle = started(self._coll, path, lambda: start_step(
                path, state, check, lazy=self._lazy, **opts))
        else:
            save_step(path, state, check, **opts)

    def _prepare_save(self, step: int, metrics: Mapping[str, float] | None,
                      force: bool) -> bool:
        """Before ``step`` is saved: the previous save done, the keep policies
        applied, the lease checked, whether the save overwrites ``step`` found
        (returned) and the local tier told (agreed: every rank raises alike)."""
        self._wait_save()
        if self._tier is not None:
            self._tier.report_failed()  # warns: a store that is down costs no local step
        warn_missing_metrics(step, metrics, self._best_metrics, self.directory)
        self._retention.forget(step)  # an overwrite changes what the keep policy sees
        overwrite = False

        def overwrites() -> None:
            nonlocal overwrite
            overwrite = (self._dir if self._tier is None else self._tier.dir).is_committed(step)
            if self._tier is not None and (overwrite or force):
                self._tier.forget_persisted(step)  # the directory may hold an older copy

        self._keep_and_check(f"preparing to save step {step}", directory=self._tier is None,
                             check=True, then=overwrites)
        return overwrite

    @property
    def in_flight(self) -> SaveHandle | None:
        """The handle of the save in progress, if any (e.g. for ``guard_optimizer``)."""
        return self._flight.handle

    @one_at_a_time
    def wait(self) -> None:
        """Wait until the in-flight save is committed (and, with a local tier,
        every committed step is persisted); then apply the keep policies.

        Raises:
            CheckpointError: the background save failed (nothing was committed),
                or a step could not be persisted (it stays in the local tier).
        """
        try:
            self._wait_save()
        finally:
            if self._tier is not None:
                self._tier.wait()
        self._keep_and_check("applying the keep policy", outcome="committed steps stay "
                             "committed; the keep policy was not applied")

    def _wait_save(self) -> None:
        """Wait for the in-flight save (its local commit, with a local tier)."""
        self._flight.wait(self._committed, self._save_failed)

    def _save_failed(self, step: int | None, exc: BaseException) -> None:
        """That step never committed: it may be saved again, and a time-based save
        policy counts from the last save that did (not from the failed one)."""
        self._last_saved_step = self._resumed.newest_good(self.steps())
        self._last_time.failed()
        if step is not None and self._tier is not None:
            raise_if_full(self._tier, step, exc)

    def _committed(self, step: int) -> None:
        """This manager's save of ``step`` committed: it is not damaged now, and what
        was read of an older copy (a save with ``force=True``; read when the keep
        policy ran before the save) is read again: its metrics and bases. Before
        2026-12-07 they stayed: ``best_step`` and ``KeepBest`` ranked the old metrics
        (and deleted the new best step), the bases kept steps the new copy does not
        need."""
        self._resumed.saved(step)
        self._retention.forget(step)
        if self._tier is not None:
            self._tier.retention.forget(step)

    def _apply_keep_policy(self, *, directory: bool = True) -> None:
        """The local tier's keep policy, then (``directory``) the directory's.

        With a local tier, ``save`` applies the local one only: the directory's
        is applied on the persistence worker after each persistence that went
        through (:meth:`_keep_after_persist`), so the training thread never waits
        on the store to clean up; ``wait`` and ``close`` apply both.
        """
        if self._tier is not None:
            self._tier.apply_keep()
        if directory:
            self._apply_directory_keep()

    def _keep_after_persist(self) -> None:
        """The directory's keep policy, on the persistence worker (a lost lease, or one
        the store did not renew for longer than its ttl, is reported by the next
        ``save`` or persistence; here it only means deleting nothing)."""
        try:
            self._apply_directory_keep(after_persist=True)
        except (ManagerLockedError, LeaseNotRenewedError):
            return  # deletes nothing; the next save or persistence raises it

    def _apply_directory_keep(self, *, after_persist: bool = False) -> None:
        # Only the lease holder deletes; a read-only or lost lease deletes nothing.
        if self._coll.rank != 0 or not self._hold.deletes:
            return
        if self._tier is not None and self._tier.directory_failing and not after_persist:
            return  # the store is down: tried again once a persistence went through
        self._hold.ensure()
        protected = self._pending_steps() | self._resumed.kept(self._dir.steps)
        if self._tier is not None:
            protected |= self._tier.bases_to_keep()
        self._retention.apply(protected)

    @one_at_a_time
    def load(
        self,
        step: int | None = None,
        target: Any = None,
        *,
        items: Sequence[str] | None = None,
        allow_pickle: AllowPickle = False,
        max_arrays: int | None = None,
    ) -> Any:
        """Load ``step`` (default: the newest committed one that is not damaged).

        Without ``step``, a newest step that turns out damaged (a checksum
        mismatch, a truncated or unsafe file: a ``CheckpointCorruptError`` on
        any process) is skipped with a RuntimeWarning naming it and the damage,
        and the next older step is loaded, so a resume goes on from the last
        good step. (A load into a target may have filled part of it from the
        damaged step; the older step's load then overwrites what it holds.) A
        ``step`` asked for by number is never replaced by another.

        ``allow_pickle`` and ``max_arrays`` are :func:`statestream.load`'s (over
        ``max_arrays``, a plain ``CheckpointError``: not damage, no older step is tried).

        A save of this manager still in flight is waited for first (its commit,
        not its persistence): a load right after ``save`` sees that step, and a
        load into the state being saved never changes it under a lazy snapshot.
        If that save failed, its error is left for the next ``save``, ``wait`` or
        ``close`` to raise, and the load reads what is committed.

        Raises:
            CheckpointNotFoundError: no committed step (or not that one).
            CheckpointCorruptError: every committed step is damaged (the newest
                one's error; with several processes a ``DistributedError``).
        """
        limit = max_arrays_option(max_arrays)
        self._flight.settle()
        resume = step is None or (self._tier is not None and self._incremental)
        latest = self._agreed_latest() if resume else None

        def one(s: int) -> Any:  # only the newest step is fetched into the tier
            return load_step(self._tier, self.step_path(s), s, target, items=items,
                             allow_pickle=allow_pickle, io=self._io, memory=self._memory,
                             collective=self._coll, fetch=self._incremental and s == latest,
                             max_arrays=limit)
        if step is not None:
            return load_numbered(check_step(step), one, self.directory,
                                 *steps_here(self._dir, self._tier, self._retention.listed))
        if latest is None:
            raise CheckpointNotFoundError(
                f"no committed checkpoint in {self.directory}; save one first")
        try:
            return load_newest_good(latest, self._agreed_steps, one, self.directory,
                                    self._resumed,
                                    lambda: share_from_0(self._coll, "listing retired steps",
                                                         self._retention.retired))
        finally:  # every step damaged too: the run may start over below them
            self._last_saved_step = self._resumed.resumed_from(self._last_saved_step)
