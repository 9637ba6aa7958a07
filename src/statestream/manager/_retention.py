"""What to keep: the keep policy applied to a manager's committed steps."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from statestream.api import metadata
from statestream.errors import CheckpointError
from statestream.manager._policies import KeepPolicy, StepInfo
from statestream.manager._steps import StepDirectory

__all__ = ["Retention", "decode_metrics", "encode_metrics", "step_info"]

#: Non-finite metric values, which JSON cannot hold, are stored as these strings.
_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def encode_metrics(metrics: Mapping[str, Any] | None) -> dict[str, Any]:
    """Metrics as the manifest stores them (a NaN loss must not fail the save).

    Example:
        >>> encode_metrics({"loss": float("nan"), "acc": 0.5})
        {'loss': 'nan', 'acc': 0.5}
    """
    out: dict[str, Any] = {}
    for k, v in (metrics or {}).items():
        if isinstance(v, float) and not math.isfinite(v):
            v = "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
        out[k] = v
    return out


def decode_metrics(stored: Mapping[str, Any]) -> dict[str, Any]:
    """The metrics a step was saved with (the inverse of :func:`encode_metrics`)."""
    return {k: _NON_FINITE.get(v, v) if isinstance(v, str) else v for k, v in stored.items()}


def step_info(path: str, step: int) -> dict[str, Any]:
    """Recorded metadata of the step at ``path``: wall time, metrics, size, user metadata."""
    md = metadata(path)
    user = md.meta.get("user", {})
    return {
        "step": step,
        "time": user.get("time", md.meta.get("created_unix")),
        "metrics": decode_metrics(user.get("metrics", {})),
        "metadata": user.get("metadata", {}),
        "nbytes": md.total_bytes,
    }


class Retention:
    """Applies a keep policy; caches each committed step's :class:`StepInfo`.

    A committed step only changes through the manager's own saves, which call
    :meth:`forget` first.
    """

    def __init__(self, policy: KeepPolicy, steps: StepDirectory) -> None:
        self._policy = policy
        self._steps = steps
        self._infos: dict[int, StepInfo] = {}

    def forget(self, step: int) -> None:
        self._infos.pop(step, None)

    def _info(self, step: int) -> StepInfo | None:
        si = self._infos.get(step)
        if si is None:
            try:
                info = step_info(self._steps.path(step), step)
            except CheckpointError:
                return None  # unreadable: the policy does not see it, nothing deletes it
            si = StepInfo(step, float(info["time"] or 0.0), dict(info["metrics"]),
                          int(info["nbytes"]))
            self._infos[step] = si
        return si

    def infos(self) -> list[StepInfo]:
        """The committed steps' infos, ascending (unreadable steps left out)."""
        return [si for si in map(self._info, self._steps.steps()) if si is not None]

    def apply(self, protected: set[int]) -> list[int]:
        """Delete the committed steps the policy drops; return them.

        The latest committed step and the ``protected`` ones are always kept.
        """
        steps = self._steps.steps()
        if len(steps) <= 1:
            return []
        infos = [si for si in map(self._info, steps) if si is not None]
        keep = set(self._policy.keep(infos)) | protected
        keep.add(steps[-1])  # never the last good step
        dropped = [s for s in steps if s not in keep]
        for s in dropped:
            self.forget(s)
            self._steps.delete(s)  # marker first, then data
        return dropped
