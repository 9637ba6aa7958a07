"""A manager's save in flight: one background save at most, and its step.

Waiting for it ends it either way: a commit is reported (``committed(step)``), a
failure is reported (``failed(step, exc)``) and raised once, and the manager has no
save in flight after. An interrupted wait (KeyboardInterrupt while the save runs)
leaves it in flight: the save is still running, so the next ``save``, ``wait`` or
``close`` waits for it again (an interrupted ``close`` does not close: the manager
keeps its directory while the save writes there). ``settle`` waits without ending
it: a failure stays for the next ``save``, ``wait`` or ``close`` to raise
(``CheckpointManager.load`` waits for the commit this way and then reads what is
committed).
"""

from __future__ import annotations

from collections.abc import Callable

from statestream.api import SaveHandle

__all__ = ["InFlight"]


class InFlight:
    """The handle and step of a manager's background save (``None``: none)."""

    def __init__(self) -> None:
        self.handle: SaveHandle | None = None
        self.step: int | None = None

    def steps(self) -> set[int]:
        """The step in flight, as a set (empty with none)."""
        return set() if self.step is None else {self.step}

    def running(self) -> bool:
        """Whether a save is in flight whose outcome was not reported yet: still
        running, or ended while a Ctrl-C ended the wait for it (its commit not yet
        recorded, its step not yet queued for the local tier)."""
        return self.handle is not None

    def wait(self, committed: Callable[[int], None],
             failed: Callable[[int | None, BaseException], None]) -> None:
        """Wait for the save; report its commit or its failure, and forget it.

        ``failed`` runs before the failure is raised (it may raise another error in
        its place: a full local tier names the step).
        """
        h = self.handle
        if h is None:
            return
        try:
            h.result()
        except BaseException as exc:
            if exc is not h.error():  # the wait was interrupted, not the save (which may
                raise  # have committed meanwhile: its commit is reported at the next wait)
            step, self.handle, self.step = self.step, None, None
            failed(step, exc)
            raise
        if self.step is not None:
            committed(self.step)
        self.handle, self.step = None, None

    def settle(self) -> None:
        """Wait for the save to end; its error stays (the handle stays in flight
        and raises it again at the next :meth:`wait`)."""
        h = self.handle
        if h is None:
            return
        try:
            h.result()
        except BaseException as exc:
            if exc is not h.error():
                raise  # the wait was interrupted, not the save
