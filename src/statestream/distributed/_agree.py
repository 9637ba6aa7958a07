"""Agreement helpers over any Collective: error propagation and defaults."""

from __future__ import annotations

import sys
from typing import Any

from statestream.distributed._base import Collective, SingleProcess
from statestream.errors import CheckpointError, DistributedError

__all__ = ["agree", "default_collective"]


def agree(coll: Collective, phase: str, error: BaseException | None, *,
          outcome: str = "nothing was committed") -> None:
    """Every process reports how ``phase`` went; all raise if any failed.

    ``outcome`` ends the message (what the failure means for the caller).

    Raises:
        DistributedError: naming each failing rank and its error; the local
            error is chained when this rank is one of them.
    """
    if coll.world_size == 1:
        if error is not None:
            raise error
        return
    mine: Any = None
    if error is not None:
        mine = f"{type(error).__name__}: {error}"
    statuses = coll.all_gather_object(mine)
    failed = [(r, s) for r, s in enumerate(statuses) if s is not None]
    if not failed:
        return
    if error is not None and len(failed) == 1 and isinstance(error, CheckpointError):
        # Keep the precise error type on the failing rank, naming the rank.
        raise DistributedError(
            f"rank {coll.rank} failed during {phase}: {failed[0][1]}; {outcome}"
        ) from error
    text = "; ".join(f"rank {r} failed during {phase}: {s}" for r, s in failed)
    exc = DistributedError(f"{text}; {outcome}")
    if error is not None:
        raise exc from error
    raise exc


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


