"""Which step a resume loads: the newest one that is not damaged.

A load of the newest step can fail because that step is damaged (a checksum
mismatch, a truncated or unsafe file: :class:`CheckpointCorruptError` here, or
on every failing process of a collective load, which ``DistributedError``
reports by class name) or for any other reason (a missing target key, a dead
peer). Only damage makes a resume go back a step; the rest is raised.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from statestream.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    DistributedError,
)

__all__ = ["ResumeGuard", "is_damage", "load_newest_good", "load_numbered", "missing_step",
           "steps_here"]


def missing_step(step: int, directory: str, have: list[int]) -> CheckpointNotFoundError:
    """The error for a step asked for by number that is not committed: the steps that are."""
    shown = ", ".join(map(str, have[-20:])) if have else "none"
    return CheckpointNotFoundError(
        f"step {step} is not a committed step of {directory} (its steps: "
        f"{'..., ' if len(have) > 20 else ''}{shown}); a keep policy may have deleted it")


def load_numbered(step: int, load_step: Callable[[int], Any], directory: str,
                  listed: Callable[[], list[int]], exists: Callable[[int], bool]) -> Any:
    """``load_step(step)`` for a step asked for by number: never another step. One
    that is not there (``exists`` false) is an error naming the steps that are."""
    try:
        return load_step(step)
    except CheckpointNotFoundError as exc:
        if exists(step):
            raise
        raise missing_step(step, directory, listed()) from exc


def steps_here(directory: Any, tier: Any, listed: Callable[[], list[int]]
               ) -> tuple[Callable[[], list[int]], Callable[[int], bool]]:
    """:func:`load_numbered`'s ``listed`` and ``exists`` for a manager's ``directory``
    (a StepDirectory; ``listed`` its steps without retired ones) and local ``tier``
    (None without), as this process sees them: one rank's error lists them, so nothing
    collective; a directory that cannot be listed (its store down) is left out. (With a
    tier every step counted as there, and a missing one was a bare 'no checkpoint at'.)"""
    def exists(step: int) -> bool:
        return bool(directory.is_committed(step)) or (
            tier is not None and bool(tier.is_committed(step)))

    def steps() -> list[int]:
        here = set() if tier is None else set(tier.retention.listed())
        try:
            return sorted(here | set(listed()))
        except CheckpointError:
            return sorted(here)

    return steps, exists


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
                     load_step: Callable[[int], Any], directory: str,
                     guard: ResumeGuard | None = None,
                     retired: Callable[[], Iterable[Sequence[Any]]] | None = None) -> Any:
    """``load_step(newest)``, or else that of the newest older step (``older()``,
    asked only after a damaged step) that is not damaged, warning for each damaged
    step skipped. ``guard`` is told which steps were tried (see :class:`ResumeGuard`).

    ``retired()`` (asked only when every listed step is damaged) gives the steps
    the keep policy dropped but kept because a kept step refers to them, each as
    (step, the steps it refers to): full committed checkpoints, tried last, newest
    first. One that refers to a step found damaged is damaged too, and not loaded.

    Raises:
        CheckpointError: the first damage found, when every step is damaged; any
            other error of a load as it is.

    Warns:
        RuntimeWarning: naming each damaged step, its damage and the step loaded instead.
    """
    tried = [newest]
    try:
        out = load_step(newest)
    except CheckpointError as exc:
        if not is_damage(exc):
            raise
        first: CheckpointError = exc
    else:
        if guard is not None:
            guard.loaded(tried)
        return out
    damaged, why = newest, first
    for s, bases in _fallbacks(newest, older, retired):
        bad = [b for b in bases or () if b in tried]
        if bad:  # its chain holds a damaged step: never trusted
            warnings.warn(f"step {s} in {directory}, {_RETIRED}, is not loaded either: it "
                          f"refers to step {bad[0]}, found damaged", RuntimeWarning,
                          stacklevel=3)
            tried.append(s)
            continue
        what = "" if bases is None else f", {_RETIRED} (every listed step is damaged),"
        warnings.warn(f"step {damaged} in {directory} is damaged, loading step {s}{what} "
                      f"instead: {why}", RuntimeWarning, stacklevel=3)
        tried.append(s)
        try:
            out = load_step(s)
        except CheckpointError as exc:
            if not is_damage(exc):
                raise
            damaged, why = s, exc
            continue
        if guard is not None:
            guard.loaded(tried)
        return out
    if guard is not None:
        guard.none_loaded(tried)
    raise first


#: how a resume's warnings name a retired step
_RETIRED = "which the keep policy dropped but keeps because a kept step refers to it"


def _fallbacks(newest: int, older: Callable[[], Iterable[int]],
               retired: Callable[[], Iterable[Sequence[Any]]] | None,
               ) -> Iterator[tuple[int, list[int] | None]]:
    """The steps a resume tries after ``newest``, newest first: the listed ones
    (bases None), then the retired ones (with the steps each refers to)."""
    listed = sorted((s for s in older() if s < newest), reverse=True)
    yield from ((s, None) for s in listed)
    if retired is None:
        return
    for s, bases in sorted(((int(s), list(b)) for s, b in retired()), reverse=True):
        if s < newest and s not in listed:
            yield s, bases


class ResumeGuard:
    """The step a resume went back to, past newer steps it found damaged.

    A keep policy sees a damaged step as a good one (its manifest reads fine), so
    ``KeepLatest(1)`` would keep the damaged newest step and delete the one the
    run resumed from: nothing loadable left. This keeps the newest step not found
    damaged while a step found damaged is newer (until the run saves past it, or
    saves again under its number).

    The run goes on from the step it loaded: its saves of the steps between that
    step and the damaged ones are not refused as going back (a save under a damaged
    step's number replaces it), see :meth:`resumed_from`.
    """

    def __init__(self) -> None:
        self.step: int | None = None
        self.damaged: set[int] = set()

    def loaded(self, tried: Sequence[int]) -> None:
        """A resume tried ``tried`` (newest first) and loaded the last of them."""
        self.step = tried[-1] if len(tried) > 1 else None
        self.damaged = set(tried[:-1])

    def none_loaded(self, tried: Sequence[int]) -> None:
        """A resume found every step in ``tried`` damaged: none is protected, and none
        is the next incremental save's base (a run that starts over after the error
        would otherwise refer to their damaged chunks)."""
        self.step = None
        self.damaged = set(tried)

    def saved(self, step: int) -> None:
        """``step`` was committed by this manager: it is not damaged now."""
        self.damaged.discard(step)

    def resumed_from(self, last: int | None) -> int | None:
        """The last step saved, as the next save's going-forward check sees it, after a
        load (``last``: as before it): the step a resume went back to, past ``last`` found
        damaged. Before 2026-12-07 every save of such a resumed run was refused ('steps
        only go forward') until it passed the damaged step's number, and that step's own
        number was skipped as saved already. None when every step was found damaged: a
        run that starts over then saves from its first step (it was refused at every
        save, forever, unless moved to another directory)."""
        if last is None or last in self.damaged:
            return self.step
        return last

    def newest_good(self, steps: list[int]) -> int | None:
        """The newest of ``steps`` not found damaged; if all are, the step a resume went
        back to (a retired one), or None (every step was found damaged: a run starting
        over saves below them)."""
        good = [s for s in steps if s not in self.damaged]
        return max(good) if good else self.step

    def kept(self, committed: Callable[[], list[int]]) -> set[int]:
        """The steps to protect from the keep policy (``committed``: the directory's):
        the newest one not found damaged, while a step found damaged is newer."""
        if not self.damaged:
            return set()
        steps = committed()
        good = [s for s in steps if s not in self.damaged]
        if not good or not any(s > good[-1] for s in steps if s in self.damaged):
            return set()
        return {good[-1]}
