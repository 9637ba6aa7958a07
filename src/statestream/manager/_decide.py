"""When a manager saves: its save policy, decided by rank 0, and preemption (SIGTERM).

Rank 0 decides (for either answer about preemption) and every rank gets its
answer, so the ranks save the same steps; a SIGTERM seen by any rank counts on
all of them. :meth:`SaveDecisions.reached_preemption` stays consistent with the
last decision: if ``save(step)`` decided without the signal (it came just after),
the preemption is reported at the next step, whose save sees it.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from types import FrameType
from typing import Any

from statestream.api import SaveHandle
from statestream.distributed import Collective, any_of, gather_each
from statestream.errors import InvalidOptionError
from statestream.manager._policies import SaveContext, SavePolicy
from statestream.manager._retention import plain_metrics
from statestream.manager._steps import check_forward

__all__ = ["LastSaveTime", "SaveDecisions", "check_can_arm"]


class LastSaveTime:
    """When a manager last saved, as its save policy counts it (``last_saved_time``):
    a background save that failed does not count, so a time-based policy
    (``EveryNSeconds``) saves at the next call instead of a period after the failure.
    Before 2026-12-07 it counted from the failed save: an hour's ``EveryNSeconds`` saved
    nothing for an hour (the failure was not even raised, since no save was started).
    """

    def __init__(self) -> None:
        self._time: float | None = None
        self._before: float | None = None  # when the save before the one in flight began

    def started(self, now: float) -> None:
        """A save began at ``now`` (it may still fail in the background)."""
        self._before, self._time = self._time, now

    def failed(self) -> None:
        """The save in flight failed (its error was raised): it never counted."""
        self._time = self._before

    def counted(self, inflight: SaveHandle | None) -> float | None:
        """The time to count from, ``inflight`` being the manager's save in flight."""
        return self._before if inflight is not None and inflight.failed() else self._time


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
            flag = any_of(self._coll, f"checking for a preemption at step {step}", flag)
            if flag:
                self.preempted.set()
        if flag and self._decided is not None and self._decided == (step, False):
            return False
        return flag

    def install_sigterm(self) -> None:
        """Arm this manager's preemption flag (main thread: ``signal.signal``)."""
        _arm(self.preempted)

    def restore_sigterm(self) -> None:
        _disarm(self.preempted)


# One SIGTERM handler per process, whatever the number of managers: it sets the flag
# of every open manager with ``preemption=True``, then calls the handler it replaced
# (a framework's or the user's; not the default action, which would end the job
# before it saves). Closing a manager disarms its flag alone; the last one to close
# puts the replaced handler back, unless someone else's handler has replaced ours.
# Python lets only the main thread install a handler: a manager opened on another
# thread arms its flag only where ours is installed already (check_can_arm), and one
# closed on another thread leaves ours in place, to put the replaced one back on the
# main thread when the next SIGTERM comes (until 2026-12-06 such a close raised
# ValueError and kept the directory's lease until the process ended).
_ARMED: list[threading.Event] = []
_REPLACED: list[Any] = []  # [the handler ours replaced], while ours is installed
_SIGNAL_LOCK = threading.Lock()


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def check_can_arm() -> None:
    """Raise unless :func:`_arm` can arm a flag on this thread (before a manager
    takes its directory's lease: one that cannot arm holds nothing)."""
    if not _main_thread() and signal.getsignal(signal.SIGTERM) is not _on_sigterm:
        raise InvalidOptionError(
            "CheckpointManager(preemption=True) installs a SIGTERM handler, and Python lets "
            f"only the main thread install one; this is {threading.current_thread().name!r}. "
            "Open it on the main thread (or open a manager with preemption=True there "
            "first: later ones share its handler from any thread)")


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    flags = list(_ARMED)
    for flag in flags:
        flag.set()
    previous = _REPLACED[0] if _REPLACED else None
    if not flags and previous is not None and _SIGNAL_LOCK.acquire(blocking=False):
        # every manager closed, the last one off the main thread: put the replaced
        # handler back now (this runs on the main thread) and let it have the signal
        try:
            signal.signal(signal.SIGTERM, previous)
            _REPLACED.clear()
        finally:
            _SIGNAL_LOCK.release()
        if previous == signal.SIG_DFL:
            os.kill(os.getpid(), signum)  # the default action: end the process
            return
    if callable(previous):
        previous(signum, frame)


def _arm(flag: threading.Event) -> None:
    with _SIGNAL_LOCK:
        current = signal.getsignal(signal.SIGTERM)
        if current is not _on_sigterm:  # first manager, or another handler took over
            check_can_arm()
            signal.signal(signal.SIGTERM, _on_sigterm)
            _REPLACED[:] = [current]
        if not any(f is flag for f in _ARMED):
            _ARMED.append(flag)


def _disarm(flag: threading.Event) -> None:
    with _SIGNAL_LOCK:
        _ARMED[:] = [f for f in _ARMED if f is not flag]
        if _ARMED or not _REPLACED or not _main_thread():
            return  # off the main thread: ours stays, and puts it back (_on_sigterm)
        if signal.getsignal(signal.SIGTERM) is _on_sigterm:
            signal.signal(signal.SIGTERM, _REPLACED[0])
        _REPLACED.clear()
