"""One call of a CheckpointManager at a time, whatever threads make them.

A training job's threads share its manager: the training loop saves while a
watchdog or an evaluation thread calls ``wait``, ``load`` or ``close``. Each of
those calls reads and changes the save in flight (``_flight``) and the
manager's open state, so they run one after the other: a ``close`` or ``wait``
that comes while ``save`` is starting a save waits for that save too, and a
``save`` that comes after a ``close`` raises (before 2026-12-06 ``close`` returned
while another thread's ``save`` was still starting one, which then ran on a closed
manager that had released the directory, and no keep policy saw it).

``should_save`` and ``reached_preemption`` read and change the save decision that
``save`` records (which step was decided, whether a preemption was seen), so they
take the lock too. ``steps`` and ``latest_step`` take it with several processes,
where they are collectives (a local tier's listing is gathered): a call on another
thread then never runs its collective between two of a save's (before 2026-12-06
it could, and the ranks' messages no longer matched). With one process they do not
wait for a save: the listing itself is one moment (``_retention.py``).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from statestream.distributed import Collective

__all__ = ["Serial", "one_at_a_time", "one_at_a_time_if_collective"]

_F = TypeVar("_F", bound=Callable[..., Any])


class Serial(Protocol):
    #: held (re-entrantly: ``close`` calls ``wait``) for the length of each call
    _calls: threading.RLock


def one_at_a_time(method: _F) -> _F:
    """Run the decorated method holding its object's ``_calls`` lock."""

    @functools.wraps(method)
    def serialized(self: Serial, *args: Any, **kwargs: Any) -> Any:
        with self._calls:
            return method(self, *args, **kwargs)

    return serialized  # type: ignore[return-value]


class _Collective(Serial, Protocol):
    _coll: Collective


def one_at_a_time_if_collective(method: _F) -> _F:
    """:func:`one_at_a_time` when the object's collective (``_coll``) has several
    processes; with one, the method runs at once."""

    @functools.wraps(method)
    def serialized(self: _Collective, *args: Any, **kwargs: Any) -> Any:
        if self._coll.world_size > 1:
            with self._calls:
                return method(self, *args, **kwargs)
        return method(self, *args, **kwargs)

    return serialized  # type: ignore[return-value]
