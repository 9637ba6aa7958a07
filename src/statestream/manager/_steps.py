"""Step discovery and cleanup of a manager's directory, on the Storage protocol only."""

from __future__ import annotations

import operator
import re
import warnings
from typing import Any

from statestream.errors import CheckpointError, CheckpointExistsError, InvalidOptionError
from statestream.storage import LocalStorage, Storage
from statestream.storage._leftovers import sweep
from statestream.storage._local import refuse_inside_checkpoint

__all__ = ["LEASE_NAME", "MAX_STEP", "StepDirectory", "check_forward", "check_step", "parse_step"]

_STEP_RE = re.compile(r"^step_(0\d{9}|[1-9]\d{9,17})$")  # exactly what step names look like
#: The manager's lease (lock) inside its directory.
LEASE_NAME = ".statestream.lock"
#: The newest step a step name holds (18 digits, as _STEP_RE and storage hints read them).
MAX_STEP = 10**18 - 1


def check_step(step: Any) -> int:
    """``step`` as a plain int (NumPy, torch and JAX integer scalars included).

    Raises:
        InvalidOptionError: not an integer (a float, a bool, a string), negative,
            or above :data:`MAX_STEP` (its directory would never be listed).
    """
    try:
        if isinstance(step, bool):
            raise TypeError
        value = operator.index(step)
    except TypeError:
        raise InvalidOptionError(
            f"step must be an integer, got {type(step).__name__} {step!r}") from None
    if value < 0:
        raise InvalidOptionError(f"step must be >= 0, got {value}")
    if value > MAX_STEP:
        raise InvalidOptionError(
            f"step must be at most {MAX_STEP} (18 digits), got {value}")
    return value


def parse_step(name: str) -> int | None:
    """The step a directory entry names (``step_0000000042`` -> 42), else None."""
    m = _STEP_RE.match(name)
    if m is None or name != f"step_{int(m.group(1)):010d}":
        return None
    return int(m.group(1))


def check_forward(step: Any, last: int | None, directory: str) -> int:
    """``step`` as an int (:func:`check_step`) that is not older than ``last``, the
    last step saved in ``directory``: a manager's steps only go forward.

    Raises:
        CheckpointError: ``step`` is older than ``last``.
        InvalidOptionError: ``step`` is not a step number.
    """
    checked = check_step(step)
    if last is not None and checked < last:
        raise CheckpointError(
            f"cannot save step {checked} in {directory}: step {last} is already saved "
            "there, and a manager's steps only go forward (an older step would silently "
            f"rewrite history). A resumed run continues from step {last} + 1 "
            "(mgr.latest_step()); to start over, use another directory"
        )
    return checked


class StepDirectory:
    """The ``step_<N>`` checkpoints under one directory or URL prefix."""

    def __init__(self, storage: Storage, directory: str) -> None:
        self.storage = storage
        self.directory = directory

    @staticmethod
    def name(step: int) -> str:
        """The directory entry of ``step`` (42 -> ``step_0000000042``)."""
        return f"step_{step:010d}"

    def path(self, step: int) -> str:
        """Path (or URL) of ``step``."""
        return f"{self.directory}/{self.name(step)}"

    def lease_path(self) -> str:
        return f"{self.directory}/{LEASE_NAME}"

    def is_committed(self, step: int) -> bool:
        return bool(self.storage.is_committed(self.path(step)))

    def refuse_checkpoint(self) -> None:
        """Raise where the directory is itself a committed checkpoint: steps saved in
        it would go with it when it is replaced or deleted whole, and a load of it
        reads the checkpoint, not the steps. On a local file system a directory inside
        a checkpoint too (object stores: its first save is not refused)."""
        if self.storage.is_committed(self.directory):
            raise CheckpointExistsError(
                f"{self.directory} is a statestream checkpoint, not a manager's directory: "
                "steps saved in it would be deleted with it when it is replaced; load it "
                "with ss.load, or give the manager a directory of its own")
        if isinstance(self.storage, LocalStorage):
            refuse_inside_checkpoint(self.directory)

    def steps(self) -> list[int]:
        """Committed steps, ascending (never a step still being written)."""
        return self.listing()[0]

    def listing(self) -> tuple[list[int], list[str]]:
        """(:meth:`steps`, the other entries but the lease, committed or not: a user's
        own checkpoints among them may refer to steps), from one listing."""
        steps, others = [], []
        for name in self.storage.list(self.directory):
            s = parse_step(name)
            if s is None:
                if name != LEASE_NAME:
                    others.append(name)
            elif self.is_committed(s):
                steps.append(s)
        return sorted(steps), others

    def remove_leftovers(self) -> list[str]:
        """Remove what crashed saves left: staging areas and steps that never committed.

        Only for the lease holder: no one else writes steps here, so a step's
        staging area whose writer is not provably alive is garbage. What cannot be
        removed (permission denied, a store that refuses) is a RuntimeWarning, not an
        error: it never loads, and the next manager to open the directory tries again.
        """
        removed, failed = sweep(self.storage, self.directory,
                                lease_held=lambda target: parse_step(target) is not None)
        for path, exc in failed:  # a store that refused: cleaning up only, as below
            warnings.warn(f"could not remove {path}, what a crashed save left ({exc}); it "
                          f"is tried again when a manager next opens {self.directory}",
                          RuntimeWarning, stacklevel=2)
        for name in self.storage.list(self.directory):
            step = parse_step(name)
            if step is not None and not self.is_committed(step):
                try:
                    self.storage.delete(self.path(step))
                except NotADirectoryError:
                    continue  # a file named like a step: not a save's, left alone
                except OSError as exc:  # StorageError: it never loads; cleaning up only
                    warnings.warn(f"could not remove {self.path(step)}, a step that never "
                                  f"committed or whose deletion was interrupted ({exc}); "
                                  "it is tried again when a manager next opens "
                                  f"{self.directory}", RuntimeWarning, stacklevel=2)
                    continue
                removed.append(self.path(step))
        return removed

    def delete(self, step: int) -> None:
        """Delete ``step`` (the backend uncommits first, then removes the data)."""
        self.storage.delete(self.path(step))

    def discard(self, step: int) -> None:
        """Delete ``step`` where only its being gone matters (a local tier's step that
        is not the run's history): once uncommitted it never loads, so data that
        cannot be removed is warned about (and removed when a manager next opens the
        directory), not raised; a step that stays committed raises."""
        try:
            self.delete(step)
        except OSError as exc:  # StorageError included
            if self.is_committed(step):
                raise
            warnings.warn(f"could not remove all of {self.path(step)}, uncommitted ({exc}); "
                          f"it is tried again when a manager next opens {self.directory}",
                          RuntimeWarning, stacklevel=2)
