"""A manager's local tier: steps commit on this node's disk, then persist in the background.

Layout of the local tier (a local directory, one per node):

- ``step_<N>/``: the step as committed locally (a normal checkpoint; with
  several processes on several nodes, each node's copy holds the manifest and
  the data files its own processes wrote, see docs/manager.md);
- ``step_<N>.persisted``: an empty file written once ``step_<N>`` is
  committed in the persistent directory (so a step the persistent keep policy
  already deleted is never persisted again);
- ``.statestream.lock``: the local lease (``flock``) of the node's manager.

Persisting a step copies its files to ``directory/step_<N>`` with every
chunk's checksum verified on the way, and commits there last
(``engine.copy_checkpoint``), on the engine's background worker.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from statestream import _hooks
from statestream.distributed import Collective, byte_channel
from statestream.engine import (
    BackgroundTasks,
    NodeGroups,
    SaveHandle,
    TaskHandle,
    copy_checkpoint,
    replicate_to_peers,
)
from statestream.errors import CheckpointError, InvalidOptionError, storage_error
from statestream.manager._lease import DirectoryLease
from statestream.manager._policies import KeepPolicy
from statestream.manager._retention import Retention
from statestream.manager._steps import StepDirectory, parse_step
from statestream.storage import LocalStorage, storage_for

__all__ = ["LocalTier"]

_RECORD = ".persisted"


class LocalTier:
    """The local steps of a manager and their persistence to its directory.

    Args:
        root: the local directory (a path, or ``file://``).
        persistent: the manager's directory.
        keep: the local keep policy (a step leaves only once persisted).
        coll: the collective of the background persistence (a forked channel).
        groups: which processes share which node's directory (the leader of
            each manages it: lease, cleanup, local keep policy).
        files: which data files this process persists (None: all).
        peers: after each local commit, send this process's files to the next
            node's local tier too (``replicate_to_peers``).
    """

    def __init__(self, root: str, persistent: StepDirectory, keep: KeepPolicy,
                 coll: Collective, groups: NodeGroups, *,
                 files: Callable[[str], bool] | None = None, peers: bool = False) -> None:
        storage, path = storage_for(root)
        if not isinstance(storage, LocalStorage):
            raise InvalidOptionError(
                f"local_tier must be a local directory (a node's own disk), got {root!r}")
        self.dir = StepDirectory(storage, path)
        self.root = path
        self.persistent = persistent
        self.retention = Retention(keep, self.dir)
        self._coll = coll
        self.groups = groups
        self._leader = leader = groups.is_leader
        self._files = files
        self._peers = peers
        self.tasks = BackgroundTasks("statestream-persist", nice=10)
        self._running: dict[int, TaskHandle] = {}
        self.lease: DirectoryLease | None = None
        if leader:
            try:
                os.makedirs(path, exist_ok=True)
            except OSError as exc:
                raise storage_error(f"cannot create the local tier {path}: {exc}", exc) from exc
            self.lease = DirectoryLease(storage, path, self.dir.lease_path(), 60.0)
            self.lease.check()  # a local tier that cannot be written is no tier
            self.dir.remove_leftovers()
            self._forget_orphan_records()

    # ------------------------------------------------------------------ state
    def path(self, step: int) -> str:
        return self.dir.path(step)

    def steps(self) -> list[int]:
        """Steps committed in this node's local tier."""
        return self.dir.steps()

    def is_committed(self, step: int) -> bool:
        return self.dir.is_committed(step)

    def _record(self, step: int) -> str:
        return self.dir.path(step) + _RECORD

    def is_persisted(self, step: int) -> bool:
        """Committed in the persistent directory now, or was (the record)."""
        return os.path.exists(self._record(step)) or self.persistent.is_committed(step)

    def pending_steps(self) -> set[int]:
        """Steps whose persistence is queued or running."""
        self._running = {s: h for s, h in self._running.items() if not h.done()}
        return set(self._running)

    def unpersisted(self) -> list[int]:
        """Locally committed steps not (yet) persisted, ascending."""
        return [s for s in self.steps() if not self.is_persisted(s)]

    def _forget_orphan_records(self) -> None:
        committed = set(self.steps())
        for name in os.listdir(self.root):
            if name.endswith(_RECORD):
                step = parse_step(name[: -len(_RECORD)])
                if step is not None and step not in committed:
                    os.unlink(os.path.join(self.root, name))

    # ------------------------------------------------------------------ persistence
    def forget_persisted(self, step: int) -> None:
        """``step`` is about to be saved again: its new copy is not persisted yet."""
        if self._leader:
            try:
                os.unlink(self._record(step))
            except FileNotFoundError:
                pass  # never persisted: nothing to forget
            except OSError as exc:
                raise storage_error(f"cannot reset {self._record(step)}: {exc}", exc) from exc

    def persist(self, step: int, after: SaveHandle | None = None) -> TaskHandle:
        """Queue the persistence of ``step`` (after ``after``, its save, commits)."""

        def task() -> None:
            if after is not None:
                try:
                    after.result()
                except BaseException:
                    return  # the save failed: its own handle reports it; nothing to persist
            if self._peers:
                replicate_to_peers(self._coll, byte_channel(self._coll), self.groups,
                                   self.path(step))
            _hooks.fire("tier.persist")
            overwrite = self.persistent.is_committed(step)
            copy_checkpoint(self.path(step), self.persistent.path(step), overwrite=overwrite,
                            collective=self._coll, files=self._files)
            _hooks.fire("tier.persisted")
            if self._leader:
                self._write_record(step)

        h = self.tasks.submit(task, f"persisting step {step} to {self.persistent.directory}")
        self._running[step] = h
        return h

    def _write_record(self, step: int) -> None:
        path = self._record(step)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
            os.fsync(fd)
            os.close(fd)
        except OSError as exc:
            raise storage_error(f"cannot record that step {step} is persisted ({path}): {exc}",
                                exc) from exc

    def wait(self) -> None:
        """Wait for every queued persistence; raise the first failure.

        Raises:
            CheckpointError: a step could not be persisted (it stays in the local
                tier and the next manager on it persists it again).
        """
        first: BaseException | None = None
        for h in self.tasks.handles():
            try:
                h.result()
            except BaseException as exc:
                first = first or exc
        if first is not None:
            if isinstance(first, CheckpointError):
                raise first
            raise CheckpointError(f"persisting a local step failed: {first}") from first

    def raise_failed(self) -> None:
        """Raise the error of a finished persistence nobody asked about yet."""
        for h in self.tasks.handles():
            if h.done():
                h.result()

    # ------------------------------------------------------------------ retention
    def apply_keep(self) -> list[int]:
        """Apply the local keep policy to persisted steps (the leader only)."""
        if not self._leader or self.lease is None:
            return []
        self.lease.check()
        protected = set(self.unpersisted()) | self.pending_steps()
        dropped = self.retention.apply(protected)
        for s in dropped:
            try:
                os.unlink(self._record(s))
            except FileNotFoundError:
                pass  # never written (persisted by another manager, seen in the directory)
        return dropped

    def close(self) -> None:
        if self.lease is not None:
            self.lease.release()
