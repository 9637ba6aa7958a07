"""CheckpointManager: when to save, what to keep, where the latest good step is."""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import signal
import threading
import time
from collections.abc import Mapping, Sequence
from types import FrameType, TracebackType
from typing import Any

from statestream.api import SaveHandle, load, metadata, save, save_async
from statestream.api._async import guard_optimizers_in
from statestream.distributed import Collective, agree, default_collective
from statestream.engine import IOOptions, MemoryOptions
from statestream.errors import CheckpointError, CheckpointNotFoundError
from statestream.format import COMMIT_NAME
from statestream.manager._policies import (
    KeepAll,
    KeepPolicy,
    SaveContext,
    SavePolicy,
    StepInfo,
)
from statestream.storage import storage_for

__all__ = ["CheckpointManager", "ManagerLockedError"]

_STEP_RE = re.compile(r"^step_(0\d{9}|[1-9]\d{9,17})$")  # exactly what step_path writes
_TMP_RE = re.compile(r"^\.step_\d{1,18}\.tmp-[0-9a-f]+(\.old)?$")
_LOCK_NAME = ".statestream.lock"


class ManagerLockedError(CheckpointError, BlockingIOError):
    """Another CheckpointManager already writes to this directory."""


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
        preemption: install a SIGTERM handler; after SIGTERM,
            :meth:`reached_preemption` turns true and ``OnPreemption`` policies fire.
        collective: processes that save together (default: detected).
        io, memory: engine options for every save and load.

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
    ) -> None:
        text = os.fspath(directory)
        #: object-store directories (s3://...) go through the Storage backend
        self._remote = "://" in text and not text.startswith("file://")
        self._storage: Any = None
        if self._remote:
            self._storage, self.directory = storage_for(text)
        else:
            self.directory = os.path.abspath(text.removeprefix("file://"))
        self._save_policy = save_policy
        self._keep_policy: KeepPolicy = keep_policy or KeepAll()
        self._coll = collective if collective is not None else default_collective()
        self._async = async_save
        self._lazy = lazy
        self._io = io
        self._memory = memory
        self._inflight: SaveHandle | None = None
        self._inflight_step: int | None = None
        self._last_saved_step: int | None = None
        self._last_saved_time: float | None = None
        self._preempted = threading.Event()
        self._old_handler: Any = None
        self._lock_fd: int | None = None
        self._closed = False
        #: (step, preempted) as seen by the last save decision; keeps
        #: reached_preemption(step) consistent with save(step) (see there).
        self._decided: tuple[int, bool] | None = None
        #: keep-policy view of committed steps (a committed step only changes by our own saves)
        self._infos: dict[int, StepInfo] = {}
        self._remote_lock = False
        err: BaseException | None = None
        if self._coll.rank == 0:
            try:
                if not self._remote:
                    os.makedirs(self.directory, exist_ok=True)
                self._acquire_lock()
                self._cleanup_leftovers()
            except BaseException as exc:
                err = exc
        try:
            agree(self._coll, "opening the checkpoint manager", err)
        except BaseException:
            self._release_lock()
            raise
        latest = self.latest_step()
        self._last_saved_step = latest
        if preemption:
            self._install_sigterm()

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Wait for the in-flight save, apply the keep policy, release the directory."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            if self._old_handler is not None:
                signal.signal(signal.SIGTERM, self._old_handler)
                self._old_handler = None
            self._release_lock()

    def _release_lock(self) -> None:
        if self._remote_lock:
            self._remote_lock = False
            assert self._storage is not None
            self._storage.release_lock(f"{self.directory}/{_LOCK_NAME}")
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _acquire_lock(self) -> None:
        if self._remote:
            assert self._storage is not None
            owner = f"pid {os.getpid()} on {os.uname().nodename}"
            held_by = self._storage.try_lock(f"{self.directory}/{_LOCK_NAME}", owner)
            if held_by is not None:
                raise ManagerLockedError(
                    f"{self.directory} is already managed by another CheckpointManager "
                    f"({held_by}); close it first, or delete {self.directory}/{_LOCK_NAME} if "
                    "that manager crashed"
                )
            self._remote_lock = True
            return
        path = os.path.join(self.directory, _LOCK_NAME)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                owner = os.pread(fd, 200, 0).decode(errors="replace").strip()
            finally:
                os.close(fd)
            raise ManagerLockedError(
                f"{self.directory} is already managed by another CheckpointManager "
                f"({owner or 'unknown process'}); close it first or use another directory"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {os.uname().nodename}".encode(), 0)
        self._lock_fd = fd

    def _cleanup_leftovers(self) -> None:
        """Remove staging dirs of crashed saves and steps that never committed."""
        if self._remote:
            assert self._storage is not None
            for name in self._storage.list(self.directory):
                m = _STEP_RE.match(name)
                if m and name == f"step_{int(m.group(1)):010d}":
                    full = f"{self.directory}/{name}"
                    if not self._storage.is_committed(full):
                        self._storage.delete(full)
            return
        for name in os.listdir(self.directory):
            full = os.path.join(self.directory, name)
            if _TMP_RE.match(name):
                shutil.rmtree(full, ignore_errors=True)
            elif _STEP_RE.match(name) and os.path.isdir(full) and not os.path.exists(
                os.path.join(full, COMMIT_NAME)
            ):
                shutil.rmtree(full, ignore_errors=True)

    # ------------------------------------------------------------------ discovery
    def step_path(self, step: int) -> str:
        """Directory (or URL) of ``step``."""
        if self._remote:
            return f"{self.directory}/step_{step:010d}"
        return os.path.join(self.directory, f"step_{step:010d}")

    def _committed(self, path: str) -> bool:
        if self._storage is not None:
            return bool(self._storage.is_committed(path))
        return os.path.exists(os.path.join(path, COMMIT_NAME))

    def steps(self) -> list[int]:
        """Committed steps, ascending (never a step still being written)."""
        out = []
        if self._storage is not None:
            names = self._storage.list(self.directory)
        else:
            try:
                names = os.listdir(self.directory)
            except FileNotFoundError:
                return []
        for name in names:
            m = _STEP_RE.match(name)
            if m and name == f"step_{int(m.group(1)):010d}" and self._committed(
                self.step_path(int(m.group(1)))
            ):
                out.append(int(m.group(1)))
        return sorted(out)

    def latest_step(self) -> int | None:
        """The newest committed step, or None."""
        s = self.steps()
        return s[-1] if s else None

    def step_info(self, step: int) -> dict[str, Any]:
        """Recorded metadata of a step: wall time, metrics, size, user metadata."""
        md = metadata(self.step_path(step))
        user = md.meta.get("user", {})
        return {
            "step": step,
            "time": user.get("time", md.meta.get("created_unix")),
            "metrics": user.get("metrics", {}),
            "metadata": user.get("metadata", {}),
            "nbytes": md.total_bytes,
        }

    # ------------------------------------------------------------------ policies
    def _context(self, step: int, preempted: bool) -> SaveContext:
        return SaveContext(step, self._last_saved_step, self._last_saved_time,
                           preempted, time.time())

    def _decide(self, step: int, preempted: bool) -> bool:
        if step == self._last_saved_step or step in self._pending_steps():
            return False
        if self._save_policy is None:
            return True
        return bool(self._save_policy.should_save(self._context(step, preempted)))

    def should_save(self, step: int) -> bool:
        """Whether :meth:`save` at ``step`` would save (decided by rank 0, shared).

        Every rank's preemption flag counts: a SIGTERM seen by any rank fires
        ``OnPreemption`` on all of them.
        """
        flag = self._preempted.is_set()
        choices = None
        if self._coll.rank == 0:  # rank 0 decides, for either answer about preemption
            choices = (self._decide(step, False), self._decide(step, True))
        if self._coll.world_size > 1:
            got = self._coll.all_gather_object((flag, choices))
            flag = any(f for f, _ in got)
            choices = got[0][1]
            if flag:
                self._preempted.set()
        assert choices is not None
        self._decided = (step, flag)
        return bool(choices[1] if flag else choices[0])

    def _pending_steps(self) -> set[int]:
        return {self._inflight_step} if self._inflight_step is not None else set()

    def reached_preemption(self, step: int) -> bool:
        """True (on every rank) once SIGTERM arrived; save and exit at this boundary.

        Consistent with :meth:`save`: if ``save(step)`` decided without seeing the
        preemption (the signal came just after), this returns False at ``step``
        so that the next ``save(step + 1)`` saves and this returns True there.
        Call ``save`` on every step, as in the example loop.
        """
        flag = self._preempted.is_set()
        if self._coll.world_size > 1:
            flags = self._coll.all_gather_object(flag)
            flag = any(flags)
            if flag:
                self._preempted.set()
        if flag and self._decided is not None and self._decided == (step, False):
            return False
        return flag

    def _install_sigterm(self) -> None:
        def handler(signum: int, frame: FrameType | None) -> None:
            self._preempted.set()

        self._old_handler = signal.signal(signal.SIGTERM, handler)

    # ------------------------------------------------------------------ save/load
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

        Returns:
            Whether a save was started.
        """
        if self._closed:
            raise CheckpointError("this CheckpointManager is closed")
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if force:
            self._decided = (step, True)  # a save of this step happens whatever the signal
        elif not self.should_save(step):
            return False
        self.wait()
        self._infos.pop(step, None)  # an overwrite changes what the keep policy sees
        path = self.step_path(step)
        meta = {"step": step, "time": time.time(),
                "metrics": dict(metrics or {}), "metadata": dict(metadata or {})}
        overwrite = self._committed(path)
        if self._async:
            self._inflight = save_async(path, state, lazy=self._lazy, overwrite=overwrite,
                                        io=self._io, memory=self._memory,
                                        collective=self._coll, meta=meta)
            if self._lazy:  # an optimizer.step() must not race the lazy snapshot
                guard_optimizers_in(state, self._inflight)
            self._inflight_step = step
        else:
            save(path, state, overwrite=overwrite, io=self._io, memory=self._memory,
                 collective=self._coll, meta=meta)
            self._apply_keep_policy()
        self._last_saved_step = step
        self._last_saved_time = time.time()
        return True

    @property
    def in_flight(self) -> SaveHandle | None:
        """The handle of the save in progress, if any (e.g. for ``guard_optimizer``)."""
        return self._inflight

    def wait(self) -> None:
        """Wait until the in-flight save is committed; then apply the keep policy.

        Raises:
            CheckpointError: the background save failed (nothing was committed).
        """
        h, self._inflight = self._inflight, None
        self._inflight_step = None
        if h is not None:
            h.result()
        self._apply_keep_policy()

    def _apply_keep_policy(self) -> None:
        if self._coll.rank != 0:
            return
        steps = self.steps()
        if len(steps) <= 1:
            return
        infos = []
        for s in steps:
            si = self._infos.get(s)
            if si is None:
                try:
                    info = self.step_info(s)
                except CheckpointError:
                    continue
                si = StepInfo(s, float(info["time"] or 0.0), dict(info["metrics"]),
                              int(info["nbytes"]))
                self._infos[s] = si
            infos.append(si)
        keep = set(self._keep_policy.keep(infos))
        keep.add(steps[-1])  # never the last good step
        keep |= self._pending_steps()
        for s in steps:
            if s not in keep:
                self._infos.pop(s, None)
                if self._storage is not None:
                    self._storage.delete(self.step_path(s))  # marker first, then data
                else:
                    _delete_step(self.step_path(s))

    def load(
        self,
        step: int | None = None,
        target: Any = None,
        *,
        items: Sequence[str] | None = None,
        allow_pickle: bool = False,
    ) -> Any:
        """Load ``step`` (default: the latest committed one).

        Raises:
            CheckpointNotFoundError: no committed step (or not that one).
        """
        if step is None:
            step = self.latest_step()
            if step is None:
                raise CheckpointNotFoundError(
                    f"no committed checkpoint in {self.directory}; save one first"
                )
        return load(self.step_path(step), target, items=items, allow_pickle=allow_pickle,
                    io=self._io, memory=self._memory, collective=self._coll)


def _delete_step(path: str) -> None:
    """Uncommit first (remove the marker, fsync), then remove the data."""
    marker = os.path.join(path, COMMIT_NAME)
    try:
        os.unlink(marker)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except FileNotFoundError:
        pass
    shutil.rmtree(path, ignore_errors=True)
