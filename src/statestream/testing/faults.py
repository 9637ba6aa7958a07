"""Fault injection for crash tests: kill the process at a named point of a save.

Example (in a child process)::

    from statestream.testing import faults
    faults.kill_at("commit.manifest_written")      # SIGKILL there
    ss.save(path, state)                           # never returns
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

from statestream import _hooks

__all__ = ["POINTS", "clear", "kill_at", "on"]

#: Every point where a fault can be injected, in the order a save reaches them.
POINTS = (
    "save.planned",
    "async.snapshot_chunk",
    "save.chunk_written",
    "save.data_synced",
    "commit.manifest_written",
    "commit.marker_written",
    "commit.renamed",
)


def on(point: str, callback: Callable[[], None], *, nth: int = 1) -> None:
    """Run ``callback`` the ``nth`` time ``point`` is reached."""
    if point not in POINTS:
        raise ValueError(f"unknown fault point {point!r}; known: {', '.join(POINTS)}")
    count = [0]

    def cb() -> None:
        count[0] += 1
        if count[0] == nth:
            callback()

    _hooks.register(point, cb)


def kill_at(point: str, *, nth: int = 1) -> None:
    """SIGKILL this process the ``nth`` time ``point`` is reached."""
    on(point, lambda: os.kill(os.getpid(), signal.SIGKILL), nth=nth)


def clear() -> None:
    """Remove all injected faults."""
    _hooks.clear()
