"""When a manager saves: its save policy, decided by rank 0, and preemption (SIGTERM).

Rank 0 decides (for either answer about preemption) and every rank gets its
answer, so the ranks save the same steps; a SIGTERM seen by any rank counts on
all of them. :meth:`SaveDecisions.reached_preemption` stays consistent with the
last decision: if ``save(step)`` decided without the signal (it came just after),
the preemption is reported at the next step, whose save sees it.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Mapping
from types import FrameType
from typing import Any

from statestream.distributed import Collective, gather_each
from statestream.manager._policies import SaveContext, SavePolicy
from statestream.manager._retention import plain_metrics
from statestream.manager._steps import check_forward

__all__ = ["SaveDecisions"]


class SaveDecisions:
    """The save decisions of one manager.

    ``skip(step)``: the manager's own reasons not to save ``step`` (it is the last
    step saved, or a save of it is in flight); ``last()``: the last step saved and
    when (for the policy's :class:`SaveContext`).
    """

    def __init__(self, policy: SavePolicy | None, coll: Collective,
                 skip: Callable[[int], bool],
                 last: Callable[[], tuple[int | None, float | None]]) -> None:
        self._policy = policy
        self._coll = coll
        self._skip = skip
        self._last = last
        self.preempted = threading.Event()
        self._old_handler: Any = None
        #: (step, preempted) as seen by the last decision; keeps
        #: reached_preemption(step) consistent with save(step) (see there).
        self._decided: tuple[int, bool] | None = None

    def _decide(self, step: int, preempted: bool) -> bool:
        if self._skip(step):
            return False
        if self._policy is None:
            return True
        last_step, last_time = self._last()
        return bool(self._policy.should_save(
            SaveContext(step, last_step, last_time, preempted, time.time())))

    def should_save(self, step: int, check: Callable[[], int] | None = None) -> bool:
        """Whether ``step`` is saved (collective: rank 0 decides; a save policy that
        raises there raises on every rank). ``check()``, run first on every rank,
        returns the step as checked (its error, on any rank, raises on every rank)."""

        def mine() -> tuple[bool, tuple[bool, bool] | None]:
            nonlocal step
            if check is not None:
                step = check()
            return self.preempted.is_set(), ((self._decide(step, False),
                                              self._decide(step, True))
                                             if self._coll.rank == 0 else None)

        got = gather_each(self._coll, f"deciding whether to save step {step}", mine)
        flag = any(f for f, _ in got)
        choices = got[0][1]
        if flag:
            self.preempted.set()
        assert choices is not None
        self._decided = (step, flag)
        return bool(choices[1] if flag else choices[0])

    def decide_save(self, step: Any, metrics: Mapping[str, Any] | None, force: bool,
                    directory: str) -> tuple[int, dict[str, Any]] | None:
        """The step and metrics of a save to ``directory``, checked, if it is saved
        (None: it is not). Checked on every rank inside the save decision's collective
        (a forced save's own), so a step or metrics wrong on one rank raise on all.

        Raises:
            CheckpointError: ``step`` is older than the last step saved.
            InvalidOptionError: ``step`` is not a step number.
        """
        checked: list[Any] = [step, metrics]

        def check() -> int:
            checked[:] = [check_forward(step, self._last()[0], directory),
                          plain_metrics(metrics)]
            return int(checked[0])

        if force:
            gather_each(self._coll, f"checking step {step}", check)
            self.forced(checked[0])  # saved whatever the signal says
        elif not self.should_save(step, check):
            return None
        return checked[0], checked[1]

    def forced(self, step: int) -> None:
        """``step`` is saved whatever the policy or the signal says."""
        self._decided = (step, True)

    def reached_preemption(self, step: int) -> bool:
        """True (on every rank) once SIGTERM arrived on any; collective."""
        flag = self.preempted.is_set()
        if self._coll.world_size > 1:
            flag = any(self._coll.all_gather_object(flag))
            if flag:
                self.preempted.set()
        if flag and self._decided is not None and self._decided == (step, False):
            return False
        return flag

    def install_sigterm(self) -> None:
        def handler(signum: int, frame: FrameType | None) -> None:
            self.preempted.set()

        self._old_handler = signal.signal(signal.SIGTERM, handler)

    def restore_sigterm(self) -> None:
        if self._old_handler is not None:
            signal.signal(signal.SIGTERM, self._old_handler)
            self._old_handler = None
