"""A local tier's records of which steps are persisted, as files beside the steps.

- ``step_<N>.persisted``: written (durably) once ``step_<N>`` is committed in the
  persistent directory, or once that directory's keep policy would delete it as
  soon as it was (never uploaded then);
- ``step_<N>.unpersisted``: written before ``step_<N>`` is saved again while the
  persistent directory may hold its older copy: until the new copy is persisted,
  that older copy does not count as persisted;
- ``.statestream-directory``: the persistent directory the tier's steps belong to
  (:func:`claim`: a tier holding another directory's steps is refused, so a run
  never lists, loads or persists another run's steps).

Only the node's leader writes them (under the tier's lease). Everything here reads
or writes the local disk only, so the training thread may ask while the persistent
directory is down.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from statestream.errors import InvalidOptionError, storage_error
from statestream.manager._steps import StepDirectory, parse_step
from statestream.storage import LocalStorage

__all__ = ["OWNER_NAME", "StepRecords", "claim", "identity", "unlink", "write_file"]

#: The file naming the persistent directory a local tier's steps belong to.
OWNER_NAME = ".statestream-directory"

_RECORD = ".persisted"
#: Marks a step saved again locally: the persistent directory's copy is outdated.
_REPLACED = ".unpersisted"


class StepRecords:
    """The persistence records of the steps of ``tier`` (a local step directory)."""

    def __init__(self, tier: StepDirectory) -> None:
        self._dir = tier

    def _record(self, step: int) -> str:
        return self._dir.path(step) + _RECORD

    def _replaced(self, step: int) -> str:
        return self._dir.path(step) + _REPLACED

    def is_persisted(self, step: int) -> bool:
        """Recorded as persisted (``step_<N>.persisted``, a file: a directory of
        that name is not a record)."""
        return os.path.isfile(self._record(step))

    def is_replaced(self, step: int) -> bool:
        """Saved again since the persistent directory's copy was made."""
        return os.path.isfile(self._replaced(step))

    def record(self, step: int) -> None:
        """Record ``step`` as persisted, durably.

        Raises:
            StorageError: the record could not be written.
        """
        path = self._record(step)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
            os.fsync(fd)
            os.close(fd)
        except OSError as exc:
            raise storage_error(f"cannot record that step {step} is persisted ({path}): {exc}",
                                exc) from exc

    def persisted(self, step: int) -> None:
        """``step``'s new copy is persisted: recorded, and no longer marked replaced
        (in that order: a crash in between leaves it persisted)."""
        self.record(step)
        unlink(self._replaced(step))

    def replaced(self, step: int) -> None:
        """``step`` is about to be saved again: not persisted, whatever copy the
        persistent directory holds (record removed first: a crash in between
        leaves the old copies)."""
        unlink(self._record(step))
        write_file(self._replaced(step), "")

    def forget(self, step: int) -> None:
        """``step`` left the tier: remove both records."""
        unlink(self._record(step))
        unlink(self._replaced(step))

    def forget_orphans(self) -> None:
        """Remove the records of steps the tier no longer holds committed (files
        only: a directory named like a record is someone else's, left alone).

        Raises:
            StorageError: the tier cannot be listed or a record removed.
        """
        committed = set(self._dir.steps())
        try:
            with os.scandir(self._dir.directory) as entries:
                orphans = [e.path for e in entries
                           if _orphan(e.name, committed) and not e.is_dir(follow_symlinks=False)]
        except OSError as exc:
            raise storage_error(f"cannot list the local tier {self._dir.directory}: {exc}",
                                exc) from exc
        for path in orphans:
            unlink(path)


def _orphan(name: str, committed: set[int]) -> bool:
    """``name`` is a record of a step not in ``committed``."""
    for suffix in (_RECORD, _REPLACED):
        if name.endswith(suffix):
            step = parse_step(name[: -len(suffix)])
            return step is not None and step not in committed
    return False


def identity(persistent: StepDirectory) -> str:
    """``persistent`` as the tier's owner file names it (a local path without links)."""
    if isinstance(persistent.storage, LocalStorage):
        return os.path.realpath(persistent.directory)
    return persistent.directory


def claim(root: str, persistent: StepDirectory, steps: Callable[[], list[int]]) -> None:
    """Record that the steps of the local tier ``root`` belong to ``persistent``.

    Raises:
        InvalidOptionError: the tier holds committed steps (``steps()``) of another
            directory (another run, or a directory that moved).
        StorageError: the owner file cannot be read or written.
    """
    path = os.path.join(root, OWNER_NAME)
    want = identity(persistent)
    try:
        with open(path) as f:
            owner: str | None = f.read()
    except FileNotFoundError:
        owner = None  # a new tier (or one made before the owner file existed)
    except OSError as exc:
        raise storage_error(f"cannot read {path}: {exc}", exc) from exc
    if owner == want:
        return
    held = steps()
    if owner is not None and held:
        raise InvalidOptionError(
            f"the local tier {root} holds steps {held} of the checkpoint directory "
            f"{owner} (recorded in {path}), not of {want}: two runs cannot share a "
            f"local tier. Give this run another local_tier, or remove {root} once "
            f"{owner} holds every step it needs")
    write_file(path, want)


def write_file(path: str, text: str) -> None:
    """Write ``path`` atomically and durably (under the local lease: one writer)."""
    tmp = f"{path}.new"
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        raise storage_error(f"cannot write {path}: {exc}", exc) from exc


def unlink(path: str) -> None:
    """Remove ``path`` if it is there."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass  # never written, or already gone: nothing to remove
    except OSError as exc:
        raise storage_error(f"cannot remove {path}: {exc}", exc) from exc
