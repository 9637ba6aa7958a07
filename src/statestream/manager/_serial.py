"""One call of a CheckpointManager at a time, whatever threads make them.

A training job's threads share its manager: the training loop saves while a
watchdog or an evaluation thread calls ``wait``, ``load`` or ``close``. Each of
those calls reads and changes the save in flight (``_inflight``) and the
manager's open state, so they run one after the other: a ``close`` or ``wait``
that comes while ``save`` is starting a save waits for that save too, and a
``save`` that comes after a ``close`` raises (before 2026-12-06 ``close`` returned
while another thread's ``save`` was still starting one, which then ran on a closed
manager that had released the directory, and no keep policy saw it).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

__all__ = ["Serial", "one_at_a_time"]

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
