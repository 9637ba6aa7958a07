"""Which ranks are still alive: heartbeats in the job's own key-value store.

A collective that fails because a peer died says little (gloo: "connection
reset by peer", from whichever socket broke first) or nothing (a JAX
key-value wait just waits). So every process that uses a multi-process
collective runs one daemon thread that bumps its own counter in the job's
key-value store (torch.distributed's rendezvous store, JAX's coordination
service) every ``interval_s``. A rank whose counter stops moving while the
others' move has died or lost its connection; the collectives name it.

Nothing here decides whether a collective failed — only who is to blame.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections.abc import Callable, Sequence

__all__ = ["Heartbeat", "StoreLost", "Watch", "describe_ranks", "find_stalled"]

#: Seconds between two beats of one process. One tiny store write each.
INTERVAL_S = 1.0
#: How long interpreter exit waits for a beat in flight (see ``_stop_at_exit``).
EXIT_JOIN_S = 10.0

_LIVE: weakref.WeakSet[Heartbeat] = weakref.WeakSet()


class Heartbeat:
    """A daemon thread that calls ``beat()`` every ``interval_s`` until it fails.

    ``alive()`` says whether the thread still runs; it stops for good when a
    beat raises (the store is gone) or ``keep_going()`` turns false (the
    framework's runtime was shut down).
    """

    def __init__(self, beat: Callable[[], object], keep_going: Callable[[], bool], *,
                 interval_s: float = INTERVAL_S, name: str = "statestream-heartbeat") -> None:
        self._beat = beat
        self._keep_going = keep_going
        self._interval_s = interval_s
        self._stop = threading.Event()
        self.error: BaseException | None = None
        beat()  # the first beat on the caller's thread: a broken store fails loudly here
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        _LIVE.add(self)

    def _run(self) -> None:
        try:
            while not self._stop.wait(self._interval_s):
                try:
                    if not self._keep_going():
                        return
                    self._beat()
                except BaseException as exc:  # noqa: BLE001 - the store is gone; stop beating
                    self.error = exc
                    return
        finally:
            # what beat() holds (a connection to the store, which on the store's host
            # keeps its server running) goes with the thread, not with this object
            self._beat = self._keep_going = _never

    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        self._stop.set()


def _never() -> bool:
    return False


def _stop_at_exit() -> None:
    """Stop every heartbeat and wait for a beat in flight before the interpreter
    finalizes. A daemon thread that comes back from the store's C++ client while
    the interpreter finalizes is unwound from inside it, which aborts the process
    ("terminate called without an active exception") after a job that succeeded."""
    beats = list(_LIVE)
    for hb in beats:
        hb.stop()
    for hb in beats:
        hb._thread.join(EXIT_JOIN_S)


atexit.register(_stop_at_exit)


class Watch:
    """Observes other processes' beat counters over time (clock-free: local time only).

    ``read(rank)`` returns a rank's counter (0 or None: it never beat). A rank
    is *stalled* once its counter has not moved for ``dead_after_s`` seconds
    of this watch's own observation.
    """

    def __init__(self, read: Callable[[int], int | None], ranks: Sequence[int]) -> None:
        self._read = read
        self.start = time.monotonic()
        #: rank -> (last counter value, when it last changed, whether it moved at all)
        self._seen: dict[int, tuple[int | None, float, bool]] = {
            r: (read(r), self.start, False) for r in ranks
        }

    def update(self) -> None:
        now = time.monotonic()
        for r, (old, since, moved) in list(self._seen.items()):
            v = self._read(r)
            self._seen[r] = (v, now, True) if v != old else (old, since, moved)

    def stalled(self, dead_after_s: float) -> list[int]:
        """Ranks that beat at some point but not during the last ``dead_after_s`` seconds."""
        now = time.monotonic()
        return [r for r, (v, since, _) in sorted(self._seen.items())
                if v and now - since >= dead_after_s]

    def unmoved(self) -> list[int]:
        """Ranks that beat before this watch began but not since."""
        return [r for r, (v, _, moved) in sorted(self._seen.items()) if v and not moved]


class StoreLost(Exception):
    """The store went away while :func:`find_stalled` watched (its host exited).

    ``ranks``: those that had not beaten during the observation, which lasted
    long enough that a live rank would have.
    """

    def __init__(self, ranks: list[int]) -> None:
        super().__init__(f"the store went away; {describe_ranks(ranks)} had stopped beating")
        self.ranks = ranks


def find_stalled(read: Callable[[int], int | None], ranks: Sequence[int], *,
                 window_s: float, poll_s: float = 0.25,
                 min_seen_s: float = 2 * INTERVAL_S) -> list[int]:
    """Ranks among ``ranks`` that beat before but not within the next ``window_s``.

    Returns as soon as every such rank has beaten again, so healthy peers cost
    about one beat interval and a dead one ``window_s``. Ranks that never beat
    (no statestream collective yet, or a store without them) are not named.

    Raises:
        StoreLost: ``read`` failed after at least ``min_seen_s`` of watching
            (a peer that found the dead rank first exited, taking the store
            with it), naming the ranks that had not beaten meanwhile.
        Exception: ``read``'s own error otherwise (the store is unreachable).
    """
    watch = Watch(read, ranks)
    deadline = watch.start + window_s
    while True:
        time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))
        try:
            watch.update()
        except Exception as exc:
            seen = watch.unmoved()
            if seen and time.monotonic() - watch.start >= min_seen_s:
                raise StoreLost(seen) from exc
            raise
        pending = watch.unmoved()
        if not pending or time.monotonic() >= deadline:
            return pending


def describe_ranks(ranks: Sequence[int], word: str = "rank") -> str:
    """``rank 1`` / ``ranks 1, 3`` (``processes 1, 3``)."""
    if len(ranks) != 1:
        word += "es" if word.endswith("s") else "s"
    return f"{word} {', '.join(str(r) for r in ranks)}"
