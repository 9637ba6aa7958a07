"""Agreement helpers over any Collective: error propagation and defaults."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

from statestream.distributed._base import ByteChannel, Collective, SingleProcess
from statestream.errors import DistributedError

__all__ = ["agree", "byte_channel", "default_collective", "gather_each", "share_from_0"]

T = TypeVar("T")


def agree(coll: Collective, phase: str, error: BaseException | None, *,
          outcome: str = "nothing was committed",
          committed: Callable[[], bool] | None = None) -> None:
    """Every process reports how ``phase`` went; all raise if any failed.

    One collective call when all went well on a collective with ``any_true``
    (an optional method: ``flag`` true on any rank; torch's is one all-reduce),
    else the statuses are gathered.

    ``outcome`` ends the message (what the failure means for the caller).

    ``committed`` is for the agreement after a commit: when the collective
    itself fails (a peer died or hung, so its status never came) and this
    rank did not fail, ``committed()`` says whether the checkpoint was
    committed anyway; if so the save succeeded and ``agree`` returns (with a
    RuntimeWarning naming the lost peer) instead of reporting a failed save.

    Raises:
        DistributedError: naming each failing rank and its error; the local
            error is chained when this rank is one of them. When the
            collective itself fails (a rank died), its error, which names
            the dead rank, with ``phase`` and ``outcome`` added.
    """
    if coll.world_size == 1:
        if error is not None:
            raise error
        return
    mine = _status(error)
    # A collective with ``any_true`` (torch) first says whether anyone failed, which is
    # far cheaper than gathering every status; the statuses come only when one did.
    any_true: Callable[[bool], bool] | None = getattr(coll, "any_true", None)
    try:
        if any_true is not None and not any_true(error is not None):
            return
        statuses = coll.all_gather_object(mine)
    except DistributedError as exc:
        if error is None and committed is not None and _check(committed):
            warnings.warn(f"the checkpoint was committed, but the ranks could not confirm it "
                          f"to each other: {exc}", RuntimeWarning, stacklevel=2)
            return
        raise type(exc)(f"{exc}; while agreeing on {phase}; {outcome}") from (error or exc)
    _raise_failed(phase, statuses, error, outcome)


def _status(error: BaseException | None) -> str | None:
    return None if error is None else f"{type(error).__name__}: {error}"


def _raise_failed(phase: str, statuses: list[Any], error: BaseException | None,
                  outcome: str) -> None:
    """Raise on every rank if any rank's status (None: it went well) says it failed."""
    failed = [(r, s) for r, s in enumerate(statuses) if s is not None]
    if not failed:
        return
    text = "; ".join(f"rank {r} failed during {phase}: {s}" for r, s in failed)
    failure = DistributedError(f"{text}; {outcome}")
    failure.failed_types = tuple(str(s).split(":", 1)[0] for _, s in failed)
    if error is not None:  # the precise error chained on the rank that had it
        raise failure from error
    raise failure


def gather_each(coll: Collective, phase: str, fn: Callable[[], T], *,
                outcome: str = "nothing was changed") -> list[T]:
    """Every process's ``fn()``, in rank order, or an error on every process if any
    process's ``fn`` raised: one ``all_gather_object``, which carries the error.

    For work that can fail on one process alone (its own disk, its own listing)
    right before a collective: raised there alone, it would leave the others
    waiting in that collective until its timeout. ``fn()`` is JSON-able plain data.

    Raises:
        DistributedError: naming each failing rank and its error (chained on the
            ranks that had it); with one process, ``fn``'s own error.
    """
    if coll.world_size == 1:
        return [fn()]
    value: Any = None
    error: BaseException | None = None
    try:
        value = fn()
    except Exception as exc:  # noqa: BLE001 - raised on every rank just below
        error = exc
    try:
        got = coll.all_gather_object([value, _status(error)])
    except DistributedError as exc:
        raise type(exc)(f"{exc}; while agreeing on {phase}; {outcome}") from (error or exc)
    _raise_failed(phase, [g[1] for g in got], error, outcome)
    return [g[0] for g in got]


def share_from_0(coll: Collective, phase: str, fn: Callable[[], T], *,
                 outcome: str = "nothing was changed") -> T:
    """Rank 0's ``fn()`` on every process (``fn`` runs on rank 0 only), or rank 0's
    error raised on every process: one ``broadcast_object``, which carries it.

    Raises:
        DistributedError: rank 0's error (chained on rank 0); with one process,
            ``fn``'s own error.
    """
    if coll.world_size == 1:
        return fn()
    value: Any = None
    error: BaseException | None = None
    if coll.rank == 0:
        try:
            value = fn()
        except Exception as exc:  # noqa: BLE001 - raised on every rank just below
            error = exc
    try:
        value, status = coll.broadcast_object([value, _status(error)], src=0)
    except DistributedError as exc:
        raise type(exc)(f"{exc}; while agreeing on {phase}; {outcome}") from (error or exc)
    _raise_failed(phase, [status], error, outcome)
    return value  # type: ignore[no-any-return]


def _check(committed: Callable[[], bool]) -> bool:
    try:
        return bool(committed())
    except Exception:  # cannot tell: the save is not known to be committed
        return False


def default_collective() -> Collective:
    """The collective of the running job: torch.distributed, multi-process JAX, or one process."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        if dist.get_world_size() > 1:
            from statestream.distributed._torch import TorchCollective

            return TorchCollective()
    jax = sys.modules.get("jax")
    if jax is not None:
        try:
            n = jax.process_count()
        except Exception:  # pragma: no cover - backend not initialised
            n = 1
        if n > 1:
            from statestream.distributed._jax import JaxCollective

            return JaxCollective()
    return SingleProcess()




def byte_channel(coll: Collective) -> ByteChannel | None:
    """The point-to-point byte channel of ``coll``, or None where it has none.

    torch.distributed has one (gloo send/recv); JAX's coordination service
    carries small objects only, and one process needs none.
    """
    from statestream.distributed._torch import TorchCollective

    return coll if isinstance(coll, TorchCollective) else None
