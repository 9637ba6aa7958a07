"""Named points in the save path where tests can inject faults (e.g. SIGKILL).

``statestream.testing.faults`` registers callbacks; with none registered a
point costs one dict lookup. Points: ``save.planned``, ``save.chunk_written``,
``save.data_synced``, ``commit.manifest_written``, ``commit.marker_written``,
``commit.renamed``, ``async.snapshot_chunk``, ``async.warming`` (a committed async
save, having let go of the state, maps staging buffers for the next),
``save.plan_reused`` (a multi-process save reuses the plan of an earlier save of the
same structure); deletion: ``delete.uncommitted``
(a local checkpoint's commit marker is gone, its data not yet) and
``manager.step_deleted``; a manager's local tier: ``tier.persist`` (a step's
persistence begins, a saved step's or an earlier one's retried), ``tier.persisted``
(the saved step committed), ``tier.caught_up`` (after it, the earlier unpersisted
steps too, and the directory's keep policy applied).
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["fire", "register", "clear"]

_HOOKS: dict[str, list[Callable[[], None]]] = {}


def fire(name: str) -> None:
    """Run the callbacks registered for point ``name``."""
    cbs = _HOOKS.get(name)
    if cbs:
        for cb in list(cbs):
            cb()


def register(name: str, cb: Callable[[], None]) -> None:
    """Call ``cb`` whenever point ``name`` is reached."""
    _HOOKS.setdefault(name, []).append(cb)


def clear() -> None:
    """Remove every registered callback."""
    _HOOKS.clear()
