"""Save and keep policies: small objects the manager composes.

A save policy answers "save at this step?"; a keep policy answers "which
committed steps must stay?". Both are plain objects with one method, so
users can write their own.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import operator
import warnings
from collections.abc import Collection, Mapping, Sequence
from typing import Protocol

from statestream.errors import InvalidOptionError, InvalidOptionTypeError

__all__ = [
    "AllOf",
    "AnyOf",
    "AtSteps",
    "EveryNSeconds",
    "EveryNSteps",
    "KeepAll",
    "KeepBest",
    "KeepEvery",
    "KeepLatest",
    "KeepPolicy",
    "KeepUnion",
    "OnPreemption",
    "SaveContext",
    "SavePolicy",
    "StepInfo",
    "best_metrics",
    "check_policy",
    "drops_for_good",
    "is_score",
    "kept_by",
    "warn_missing_metrics",
]


def _count(policy: str, name: str, value: object, least: int) -> int:
    """A policy's whole-number argument as a plain int: an int (not a bool; NumPy,
    torch and JAX integer scalars count, as they do for steps) of at least ``least``."""
    try:
        if isinstance(value, bool):
            raise TypeError
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidOptionTypeError(
            f"{policy} needs an int {name}, not {type(value).__name__} {value!r:.60}") from None
    if number < least:
        raise InvalidOptionError(f"{policy} needs {name} >= {least}, got {number}")
    return number


def _is_policy(value: object, method: str) -> bool:
    return not isinstance(value, type) and callable(getattr(value, method, None))


def check_policy(value: object, name: str, method: str, example: str) -> None:
    """A policy argument: None, or an object (not a class) with a ``method``."""
    if value is not None and not _is_policy(value, method):
        raise InvalidOptionTypeError(
            f"{name} must be a policy object with a {method}() method (e.g. {example}; "
            f"an instance, not the class), not {type(value).__name__} {value!r:.60}")


def _policies(kind: str, policies: tuple[object, ...], method: str) -> None:
    for p in policies:
        if not _is_policy(p, method):
            raise InvalidOptionTypeError(
                f"{kind} takes policy objects with a {method}() method (an instance, e.g. "
                f"KeepLatest(3), not the class), not {type(p).__name__} {p!r:.60}")


@dataclasses.dataclass(frozen=True)
class SaveContext:
    """What a save policy may look at."""

    step: int
    last_saved_step: int | None
    last_saved_time: float | None
    preempted: bool
    now: float


class SavePolicy(Protocol):
    """Decides whether to save at a step."""

    def should_save(self, ctx: SaveContext) -> bool: ...


@dataclasses.dataclass(frozen=True)
class EveryNSteps:
    """Save when ``step % n == 0``.

    Example:
        >>> p = EveryNSteps(10)
        >>> [s for s in range(25) if p.should_save(SaveContext(s, None, None, False, 0.0))]
        [0, 10, 20]
    """

    n: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "n", _count("EveryNSteps", "n", self.n, 1))

    def should_save(self, ctx: SaveContext) -> bool:
        return ctx.step % self.n == 0


@dataclasses.dataclass(frozen=True)
class AtSteps:
    """Save at exactly these steps."""

    steps: Collection[int]

    def __post_init__(self) -> None:
        if isinstance(self.steps, (str, bytes)) or not isinstance(self.steps, Collection):
            raise InvalidOptionTypeError(
                f"AtSteps takes a collection of steps ({{100, 500}}), not {self.steps!r:.60}")
        object.__setattr__(self, "steps",
                           frozenset(_count("AtSteps", "steps", s, 0) for s in self.steps))

    def should_save(self, ctx: SaveContext) -> bool:
        return ctx.step in self.steps


@dataclasses.dataclass(frozen=True)
class EveryNSeconds:
    """Save when at least ``seconds`` passed since the last save (and at the first call).

    The times are the wall clock's (``time.time()``): a clock set back (NTP, a resumed
    VM) makes the last save look in the future, and that counts as due (the next save
    counts from the new time); it saved nothing until the clock caught up again.
    """

    seconds: float

    def __post_init__(self) -> None:
        if isinstance(self.seconds, bool) or not isinstance(self.seconds, numbers.Real):
            raise InvalidOptionTypeError(
                f"EveryNSeconds needs a number of seconds, not {self.seconds!r:.60}")
        object.__setattr__(self, "seconds", float(self.seconds))  # NumPy's float32 too
        if not math.isfinite(self.seconds) or self.seconds < 0:
            raise InvalidOptionError(
                f"EveryNSeconds needs seconds >= 0 (finite), got {self.seconds}")

    def should_save(self, ctx: SaveContext) -> bool:
        if ctx.last_saved_time is None:
            return True
        elapsed = ctx.now - ctx.last_saved_time
        return elapsed >= self.seconds or elapsed < 0


@dataclasses.dataclass(frozen=True)
class OnPreemption:
    """Save once the job has been told to stop (SIGTERM with ``preemption=True``)."""

    def should_save(self, ctx: SaveContext) -> bool:
        return ctx.preempted


class AnyOf:
    """Save when any of the policies says so.

    Example:
        >>> p = AnyOf(EveryNSteps(100), AtSteps({7}))
        >>> p.should_save(SaveContext(7, None, None, False, 0.0))
        True
    """

    def __init__(self, *policies: SavePolicy) -> None:
        _policies("AnyOf", policies, "should_save")
        self.policies = policies

    def should_save(self, ctx: SaveContext) -> bool:
        return any(p.should_save(ctx) for p in self.policies)


class AllOf:
    """Save when all of the policies say so."""

    def __init__(self, *policies: SavePolicy) -> None:
        _policies("AllOf", policies, "should_save")
        self.policies = policies

    def should_save(self, ctx: SaveContext) -> bool:
        return all(p.should_save(ctx) for p in self.policies)


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """A committed step as keep policies see it."""

    step: int
    time: float
    metrics: dict[str, float]
    nbytes: int


class KeepPolicy(Protocol):
    """Decides which committed steps to keep (the rest may be deleted)."""

    def keep(self, steps: Sequence[StepInfo]) -> set[int]: ...


class KeepAll:
    """Never delete anything."""

    def keep(self, steps: Sequence[StepInfo]) -> set[int]:
        return {s.step for s in steps}


@dataclasses.dataclass(frozen=True)
class KeepLatest:
    """Keep the ``n`` most recent steps.

    Example:
        >>> KeepLatest(2).keep([StepInfo(s, 0.0, {}, 0) for s in (1, 5, 3)])
        {3, 5}
    """

    n: int

    def __post_init__(self) -> None:
        # 0: only the latest step, which always stays
        object.__setattr__(self, "n", _count("KeepLatest", "n", self.n, 0))

    def keep(self, steps: Sequence[StepInfo]) -> set[int]:
        return set(sorted(s.step for s in steps)[-self.n:]) if self.n > 0 else set()


@dataclasses.dataclass(frozen=True)
class KeepEvery:
    """Keep every step that is a multiple of ``k`` forever."""

    k: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "k", _count("KeepEvery", "k", self.k, 1))

    def keep(self, steps: Sequence[StepInfo]) -> set[int]:
        return {s.step for s in steps if s.step % self.k == 0}


@dataclasses.dataclass(frozen=True)
class KeepBest:
    """Keep the ``n`` best steps by ``metric`` (``mode`` "min" or "max").

    Steps without the metric are never counted as best.

    Example:
        >>> steps = [StepInfo(s, 0.0, {"loss": l}, 0) for s, l in [(1, .9), (2, .5), (3, .7)]]
        >>> sorted(KeepBest(2, "loss").keep(steps))
        [2, 3]
    """

    n: int
    metric: str
    mode: str = "min"

    def __post_init__(self) -> None:
        object.__setattr__(self, "n", _count("KeepBest", "n", self.n, 0))
        if not isinstance(self.metric, str):
            raise InvalidOptionTypeError(
                f"KeepBest needs a metric name (str), not {self.metric!r:.60}")
        if self.mode not in ("min", "max"):
            raise InvalidOptionError(f"KeepBest mode must be 'min' or 'max', got {self.mode!r}")

    def keep(self, steps: Sequence[StepInfo]) -> set[int]:
        scored = [s for s in steps if is_score(s.metrics.get(self.metric))]
        scored.sort(key=lambda s: float(s.metrics[self.metric]), reverse=self.mode == "max")
        return {s.step for s in scored[: self.n]}


class KeepUnion:
    """Keep a step if any of the policies keeps it.

    Example:
        >>> p = KeepUnion(KeepLatest(1), KeepEvery(10))
        >>> sorted(p.keep([StepInfo(s, 0.0, {}, 0) for s in (10, 15, 20, 25)]))
        [10, 20, 25]
    """

    def __init__(self, *policies: KeepPolicy) -> None:
        _policies("KeepUnion", policies, "keep")
        self.policies = policies

    def keep(self, steps: Sequence[StepInfo]) -> set[int]:
        out: set[int] = set()
        for p in self.policies:
            out |= kept_by(p, steps)
        return out


def kept_by(policy: KeepPolicy, steps: Sequence[StepInfo]) -> set[int]:
    """``policy.keep(steps)``: the step numbers it keeps, checked.

    Raises:
        InvalidOptionTypeError: the policy returned something else than step numbers
            (ints; NumPy integers count): the ``StepInfo`` objects it was given (a
            ``TypeError`` about an unhashable dict before), strings (every step but the
            latest was deleted), None. Nothing is deleted.
    """
    got = policy.keep(steps)
    try:
        items = None if isinstance(got, (str, bytes)) else list(got)
    except TypeError:
        items = None
    out: set[int] = set()
    for x in items or ():
        try:
            if isinstance(x, bool):
                raise TypeError
            out.add(operator.index(x))
        except TypeError:
            items = None
            break
    if items is None:
        raise InvalidOptionTypeError(
            f"{type(policy).__name__}.keep() must return the step numbers to keep (ints, "
            "e.g. {info.step for info in steps if ...}), not "
            f"{type(got).__name__} {got!r:.120}")
    return out


def is_score(value: object) -> bool:
    """True for a number a metric can be ranked by: finite. Not NaN, nor an infinity
    (a loss of -inf is a diverged step: until 2026-12-07 it was the best for ever, and
    ``KeepBest`` deleted good steps for it), nor an int beyond a float's range (its
    ranking raised OverflowError, and every save with it).

    Example:
        >>> [is_score(v) for v in (0.5, 3, float("nan"), float("-inf"), 10**400, "1")]
        [True, True, False, False, False, False]
    """
    if not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def warn_missing_metrics(step: int, metrics: Mapping[str, object] | None,
                         wanted: Sequence[str], directory: str) -> None:
    """Warn when ``metrics`` lacks a number for a metric in ``wanted`` (a ``KeepBest``'s).

    Warns:
        UserWarning: naming the metrics missing and what the step's fate is.
    """
    missing = [m for m in wanted if not is_score((metrics or {}).get(m))]
    if missing:
        warnings.warn(
            f"step {step} in {directory} is saved without a number (finite) for the metric "
            f"{', '.join(repr(m) for m in missing)} of the KeepBest keep policy (metrics "
            f"given: {sorted(metrics or {})}): it never counts as a best step, and it is "
            "deleted once it is no longer the latest unless another policy keeps it",
            UserWarning,
            stacklevel=4,
        )


def best_metrics(policy: object) -> list[str]:
    """The metrics that ``KeepBest`` policies inside ``policy`` rank by (``KeepUnion`` walked).

    Example:
        >>> best_metrics(KeepUnion(KeepLatest(1), KeepBest(2, "loss"), KeepBest(1, "acc", "max")))
        ['loss', 'acc']
    """
    if isinstance(policy, KeepBest):
        return [policy.metric]
    out: list[str] = []
    for sub in getattr(policy, "policies", ()):
        out += [m for m in best_metrics(sub) if m not in out]
    return out


def drops_for_good(policy: object) -> bool:
    """Whether a step ``policy`` drops from some steps stays dropped from any more steps
    (each built-in policy: newer or better steps never bring a dropped one back; a
    ``KeepUnion`` of such). Unknown policies: False (nothing is decided early).

    Example:
        >>> drops_for_good(KeepUnion(KeepLatest(2), KeepBest(1, "loss"))), drops_for_good(object())
        (True, False)
    """
    if isinstance(policy, (KeepAll, KeepLatest, KeepEvery, KeepBest)):
        return True
    if isinstance(policy, KeepUnion):
        return all(drops_for_good(p) for p in policy.policies)
    return False
