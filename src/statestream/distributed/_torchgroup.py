"""statestream's own gloo groups for :class:`TorchCollective`, and their end.

One group is made per (id of the user's group, timeout, channel) and held only
weakly: torch's registry holds it while it is registered, so
``destroy_process_group()`` ends it. A job that never calls that (a script whose
collective is a module global) kept the group, and its worker threads, into the
interpreter's finalization; a gloo worker that lets go of a finished collective's
work (holding Python tensors) after that began cannot take the GIL, and the
process aborted ("terminate called without an active exception") after a job
that had succeeded: about once in 20 runs of a two-rank save and load on a loaded
machine. So at exit, before finalization, every group of ours that no collective
is using and none has failed on is destroyed: its threads finish and are joined
while Python still runs. A failed group is left as it is (a thread may still
wait on it, and its end would wait for that); a forked child forgets them all.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import sys
import threading
import weakref
from collections.abc import Iterator
from typing import Any

from statestream.errors import CollectiveTimeoutError, InvalidOptionError

__all__ = ["default_store", "group_for", "in_use", "registered"]

Key = tuple[int | None, float, str]

#: The gloo group made for each (id of the user's group, timeout, channel), held
#: weakly: torch holds it while it is registered, and a group kept after
#: destroy_process_group() would keep rank 0's store server (and its port) alive.
_GROUPS: dict[Key, weakref.ref[Any]] = {}
#: Statestream collectives in progress per group (threads of a background save too).
_BUSY: dict[Key, int] = {}
#: Groups a collective failed on: left alone at exit.
_BROKEN: set[Key] = set()
_LOCK = threading.Lock()


def group_for(dist: Any, key: Key, group: Any, timeout_s: float,
              channel: str) -> tuple[Any, bool]:
    """The gloo group of ``key``, made now when there is none (or it was destroyed):
    the group, and whether it is new."""
    ref = _GROUPS.get(key)
    pg = ref() if ref is not None else None
    if pg is not None and registered(dist, pg):
        return pg, False
    pg = _gloo_group(dist, group, timeout_s, channel)  # none, or a group of an old job
    with _LOCK:
        _GROUPS[key] = weakref.ref(pg)
        _BROKEN.discard(key)
    return pg, True


@contextlib.contextmanager
def in_use(key: Key) -> Iterator[None]:
    """Around one collective on ``key``'s group: a group in use, or one a collective
    failed on, is not destroyed at exit."""
    with _LOCK:
        _BUSY[key] = _BUSY.get(key, 0) + 1
    done = False
    try:
        yield
        done = True
    finally:
        with _LOCK:
            _BUSY[key] -= 1
            if not done:
                _BROKEN.add(key)


def _release_at_exit() -> None:
    """Destroy our idle, sound groups before the interpreter finalizes (see the module)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return
    with _LOCK:
        idle = [ref() for key, ref in _GROUPS.items()
                if not _BUSY.get(key) and key not in _BROKEN]
        _GROUPS.clear()
    for pg in idle:
        try:
            if pg is not None and registered(dist, pg):
                dist.destroy_process_group(pg)
        except Exception:  # torch's own state at exit: nothing better to do than leave it
            pass


def _forget_in_child() -> None:
    """A forked child has none of the groups' threads: it must not end them at exit."""
    global _LOCK
    _LOCK = threading.Lock()
    _GROUPS.clear()
    _BUSY.clear()
    _BROKEN.clear()


atexit.register(_release_at_exit)
os.register_at_fork(after_in_child=_forget_in_child)


def registered(dist: Any, pg: Any) -> bool:
    try:
        dist.get_rank(pg)
        return True
    except (ValueError, RuntimeError):
        return False


def default_store() -> Any:
    """The rendezvous store of the default group, or None (diagnostics only)."""
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:  # no store (not initialised, another backend): no diagnostics then
        return None


def _gloo_group(dist: Any, group: Any, timeout_s: float, channel: str) -> Any:
    """A gloo group over ``group``'s ranks (the job's when None).

    Only a subgroup's own ranks call this (``use_local_synchronization``): torch's
    plain ``new_group`` must be entered by every rank of the job, and one the other
    ranks did not enter leaves the members counting groups differently from them, so
    the job's next group (a user's, a device mesh's) hangs.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    if group is None:
        return dist.new_group(ranks=None, backend="gloo", timeout=timeout)
    if not isinstance(group, dist.ProcessGroup) or dist.get_rank(group) < 0:
        raise InvalidOptionError(
            f"TorchCollective(group=...): this process (rank {dist.get_rank()} of the job) "
            "is not a member of the group; create the collective (and save or load with "
            "it) only on the group's ranks"
        )
    ranks = dist.get_process_group_ranks(group)
    _align_group_counts(dist, ranks, f"{group.group_name}/{timeout_s:g}/{channel}", timeout_s)
    return dist.new_group(ranks=ranks, backend="gloo", timeout=timeout,
                          use_local_synchronization=True)


#: Subgroup gloo groups created so far per (user group, timeout, channel) in this process.
_ALIGNED: dict[str, int] = {}


def _align_group_counts(dist: Any, ranks: list[int], tag: str, timeout_s: float) -> None:
    """Bring every member of ``ranks`` to the same number of registered process groups.

    torch names a ``use_local_synchronization`` group after its ranks and the number
    of groups the calling process has registered; that number differs between
    processes that belong to different groups (ranks 0 and 1 of a job with a group
    [1, 3]), and members that name the group differently wait for each other forever.
    Each member posts its count in the rendezvous store; those below the largest
    register one single-rank group per missing one.
    """
    from torch.distributed import distributed_c10d as c10d

    store = default_store()
    names = getattr(getattr(c10d, "_world", None), "pg_names", None)
    if store is None or names is None:  # another torch: nothing to align by
        return
    seq = _ALIGNED[tag] = _ALIGNED.get(tag, 0) + 1
    prefix = f"statestream/groups/{tag}/{seq}"
    me = dist.get_rank()
    mine = len(names)
    store.set(f"{prefix}/{me}", str(mine))
    keys = [f"{prefix}/{r}" for r in ranks]
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except Exception as exc:  # the store's timeout: name who never came
        missing = [r for r, k in zip(ranks, keys) if not store.check([k])]
        raise CollectiveTimeoutError(
            f"TorchCollective(group=...) on rank {me} of the job waited more than "
            f"{timeout_s:g}s for ranks {missing} of the group to create it too"
        ) from exc
    for _ in range(max(int(store.get(k)) for k in keys) - mine):
        dist.new_group([me], backend="gloo", use_local_synchronization=True)
