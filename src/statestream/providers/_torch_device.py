"""Device-to-host copies of CUDA tensors for a save: a side stream per device and
the stager the engine calls for each box (split from providers/torch.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from statestream.providers._base import box_slices

__all__ = ["device_staging"]

_SIDE_STREAMS: dict[Any, Any] = {}


def _side_stream(device: Any) -> Any:
    """One copy stream per CUDA device, shared by every save in the process."""
    import torch

    s = _SIDE_STREAMS.get(device)
    if s is None:
        s = _SIDE_STREAMS[device] = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
    return s


def device_staging(t: Any, local_start: Callable[[tuple[int, ...], tuple[int, ...]],
                                                  tuple[int, ...]]) -> dict[str, Any]:
    """PreparedArray fields for a CUDA tensor: its device and an async stager.

    ``stage`` copies a box device-to-host on a side stream into the engine's
    (page-locked, reused) staging buffer and returns the wait for its event.
    The side stream first waits for the stream that was current when the
    save began (captured here, on the caller's thread), so the copy sees every
    kernel the caller had queued; the source's memory is marked as used by
    the side stream so the caching allocator cannot hand it out before the
    copy has run. Non-CUDA tensors get no stager.
    """
    if t.device.type != "cuda":
        return {}
    import torch

    producer = torch.cuda.current_stream(t.device)

    def stage(start: tuple[int, ...], cshape: tuple[int, ...],
              out: np.ndarray) -> Callable[[], None]:
        rel = local_start(start, cshape)
        part = t[box_slices(rel, cshape)] if t.dim() else t
        side = _side_stream(t.device)
        side.wait_stream(producer)
        with torch.cuda.stream(side):
            src = part.contiguous().reshape(-1).view(torch.uint8)
            torch.from_numpy(out).copy_(src, non_blocking=True)
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(side)
        t.record_stream(side)
        return done.synchronize  # type: ignore[no-any-return]

    return {"device": str(t.device), "stage": stage}
