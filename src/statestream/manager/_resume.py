"""Which step a resume loads: the newest one that is not damaged.

A load of the newest step can fail because that step is damaged (a checksum
mismatch, a truncated or unsafe file: :class:`CheckpointCorruptError` here, or
on every failing process of a collective load, which ``DistributedError``
reports by class name) or for any other reason (a missing target key, a dead
peer). Only damage makes a resume go back a step; the rest is raised.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any

from statestream.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    DistributedError,
)

__all__ = ["is_damage", "load_newest_good", "missing_step"]


def missing_step(step: int, directory: str, have: list[int]) -> CheckpointNotFoundError:
    """The error for a step asked for by number that is not committed: the steps that are."""
    shown = ", ".join(map(str, have[-20:])) if have else "none"
    return CheckpointNotFoundError(
        f"step {step} is not a committed step of {directory} (its steps: "
        f"{'..., ' if len(have) > 20 else ''}{shown}); a keep policy may have deleted it")


def _names(cls: type[Exception]) -> set[str]:
    return {cls.__name__}.union(*(_names(sub) for sub in cls.__subclasses__()))


#: CheckpointCorruptError and its subclasses by name, as DistributedError reports them
_DAMAGE = frozenset(_names(CheckpointCorruptError))


def is_damage(exc: CheckpointError) -> bool:
    """Whether ``exc`` says the checkpoint is damaged (on every process that failed)."""
    if isinstance(exc, DistributedError):
        return bool(exc.failed_types) and all(t in _DAMAGE for t in exc.failed_types)
    return isinstance(exc, CheckpointCorruptError)


def load_newest_good(newest: int, older: Callable[[], Iterable[int]],
                     load_step: Callable[[int], Any], directory: str) -> Any:
    """``load_step(newest)``, or else that of the newest older step (``older()``,
    asked only after a damaged step) that is not damaged, warning for each damaged
    step skipped.

    Raises:
        CheckpointError: the first damage found, when every step is damaged; any
            other error of a load as it is.

    Warns:
        RuntimeWarning: naming each damaged step, its damage and the step loaded instead.
    """
    try:
        return load_step(newest)
    except CheckpointError as exc:
        if not is_damage(exc):
            raise
        first: CheckpointError = exc
    damaged, why = newest, first
    for s in sorted((s for s in older() if s < newest), reverse=True):
        warnings.warn(f"step {damaged} in {directory} is damaged, loading step {s} "
                      f"instead: {why}", RuntimeWarning, stacklevel=3)
        try:
            return load_step(s)
        except CheckpointError as exc:
            if not is_damage(exc):
                raise
            damaged, why = s, exc
    raise first
