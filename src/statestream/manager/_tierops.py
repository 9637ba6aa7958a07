"""What the manager does with its local tier: open it, list both tiers, load from the best.

With several processes each node's local tier holds a node-local copy of
each step (its processes' files, plus its peer's with ``replicate_to_peers``).
Listing and loading are then collective: every process sees the steps any
node holds, and before a local load the nodes complete each other's copies
over the collective (``engine.complete_copies``: with a target or ``items``,
only with the files their processes' loads read); a step no node can complete
loads from the persistent directory.
"""

from __future__ import annotations

import itertools
import os
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from statestream import _hooks
from statestream.api import files_read, load, metadata
from statestream.api._pickles import AllowPickle
from statestream.distributed import (
    Collective,
    SingleProcess,
    agree,
    any_of,
    byte_channel,
    gather_each,
    share_from_0,
)
from statestream.engine import (
    IOOptions,
    MemoryOptions,
    NodeGroups,
    TaskHandle,
    complete_copies,
    copy_checkpoint,
    node_groups,
)
from statestream.errors import (
    CheckpointCorruptError,
    CheckpointError,
    DistributedError,
    InvalidOptionError,
)
from statestream.format import Manifest
from statestream.manager._policies import KeepLatest, KeepPolicy
from statestream.manager._steps import StepDirectory, parse_step
from statestream.manager._tier import LocalTier
from statestream.manager._tiercheck import reconcile
from statestream.manager._tierrefs import mark_damaged
from statestream.manager._tierspace import (
    copy_bytes,
    fetch_shortage,
    free_bytes,
    lacks_room,
    next_save_bytes,
)

__all__ = ["fetch_into_tier", "open_tier", "tier_load", "tier_steps"]


def open_tier(root: str, persistent: StepDirectory, keep: KeepPolicy | None,
              coll: Collective, read_only: str | None, peers: bool,
              after_persist: Callable[[], None] | None = None,
              directory_keep: KeepPolicy | None = None,
              memory_bytes: int | None = None, *,
              take_lease: Callable[[], None] | None = None) -> LocalTier:
    """Open the local tier and queue the persistence of what the last manager left.

    ``after_persist``, ``directory_keep``: see :class:`LocalTier` (the directory's
    keep policy; steps it would delete at once are not persisted, even after a crash);
    ``memory_bytes``: the manager's budget, which the persistence copies stay within;
    ``take_lease``: see :class:`LocalTier`; ``read_only``: why the directory is
    read-only (None: it is not)."""
    if read_only is not None:
        raise CheckpointError(
            f"{persistent.directory} is read-only ({read_only}): a local tier in front of "
            "it could never be persisted; open the manager without local_tier to load from it")
    multi = coll.world_size > 1
    if peers and multi and byte_channel(coll) is None:
        raise InvalidOptionError(
            f"replicate_to_peers=True needs torch.distributed to send files to peers; "
            f"{type(coll).__name__} cannot carry bytes")
    groups = node_groups(coll, root) if multi else NodeGroups(["single"], 0)
    # Persistence runs in the background: on a channel of its own.
    persist_coll, slot = _persist_channel(coll) if multi else (coll, None)
    err: BaseException | None = None
    tier: LocalTier | None = None
    try:
        local_keep = KeepLatest(2) if keep is None else keep  # a falsy policy is one too
        tier = LocalTier(root, persistent, local_keep, persist_coll, groups,
                         peers=peers and multi, after_persist=after_persist,
                         directory_keep=directory_keep,
                         memory_bytes=memory_bytes, take_lease=take_lease,
                         on_close=None if slot is None else lambda: _free_channel(slot))
    except BaseException as exc:
        err = exc
    try:
        agree(coll, "opening the local tier", err)
    except BaseException:
        if tier is not None:  # another process's failed: this one holds nothing either
            tier.close()
        elif slot is not None:
            _free_channel(slot)
        raise
    assert tier is not None

    def unpersisted() -> list[int] | None:
        if not groups.is_leader:
            return None
        tier.settle_records()
        tier.drop_unwanted()
        return tier.unpersisted()

    try:
        reconcile(tier, coll)  # copies of a save interrupted between the nodes' commits
        everyone = gather_each(coll, "settling the local tiers", unpersisted)
    except BaseException:
        tier.close()  # a tier that failed to open holds nothing
        raise
    lists = [set(x) for x in everyone if x is not None]
    # a crash after a local commit loses nothing (steps every node holds)
    for step in sorted(set.intersection(*lists)):
        tier.persist(step)
    return tier


#: Persistence channels used by this process's open tiers (see _persist_channel).
_BUSY: set[int] = set()
_BUSY_LOCK = threading.Lock()


def _persist_channel(coll: Collective) -> tuple[Collective, int]:
    """A channel of its own for a new tier's persistence (a gloo group, a JAX key
    sequence): every tier's background collectives run on their own thread, so
    two managers' would cross-match on a shared one. Collective: the lowest
    channel no process of ``coll`` uses for an open tier (every process picks
    the same one whatever managers each holds open); freed when the tier's
    persistence thread ends, and reused by a later manager."""
    with _BUSY_LOCK:
        mine = sorted(_BUSY)
    busy = set().union(*map(set, gather_each(coll, "picking a channel for persistence",
                                             lambda: mine)))
    slot = next(i for i in itertools.count() if i not in busy)
    with _BUSY_LOCK:
        _BUSY.add(slot)
    try:
        return coll.fork(f"statestream-persist-{slot}"), slot
    except BaseException:
        _free_channel(slot)
        raise


def _free_channel(slot: int) -> None:
    with _BUSY_LOCK:
        _BUSY.discard(slot)


def tier_steps(tier: LocalTier, coll: Collective,
               persistent: Callable[[], list[int]]) -> list[int]:
    """Steps committed in any node's local tier or listed in the persistent directory.

    ``persistent``: lists the directory's steps without retired ones; rank 0,
    which applies the directory's keep policy, speaks for it. A local step kept
    only because a kept local step refers to it is left out once persisted.
    Collective with several processes (every process gets the same list): each
    node's leader, which applies the local keep policy, speaks for its directory
    (another process could list a step its leader is deleting). When the
    directory cannot be listed (its store is down), every process warns alike
    and the local tiers' steps are the list (rank 0 raising alone would leave
    the others waiting in the collective).
    """

    def mine() -> tuple[list[int], list[int], str]:
        local: list[int] = []
        if tier.groups.is_leader:  # its node's disk: an error raises on every process
            local = sorted(set(tier.retention.listed()) | set(tier.unpersisted()))
        listed: list[int] = []
        failed = ""
        if coll.rank == 0:
            try:
                listed = persistent()
            except CheckpointError as exc:  # the store is down: what the local tiers hold
                failed = str(exc)
        return local, listed, failed

    out: set[int] = set()
    for steps, listed, failed in gather_each(coll, "listing the steps", mine):
        out.update(steps, listed)
        if failed:
            warnings.warn(f"could not list the steps of {tier.persistent.directory}: {failed}; "
                          "listing the steps the local tier holds only", RuntimeWarning,
                          stacklevel=3)
    return sorted(out)


class _Reads:
    """The files this process's load of a step reads, of the step and of each step
    it refers to (:func:`statestream.api.files_read`), for ``complete_copies``."""

    def __init__(self, target: Any, items: Sequence[str] | None,
                 allow_pickle: AllowPickle) -> None:
        self._args = (target, items, allow_pickle)
        #: checkpoint name ("" for the step) -> file indices; None: not known (all)
        self._found: dict[str, set[int]] | None = None

    def of_step(self, m: Manifest) -> set[int]:
        target, items, allow_pickle = self._args
        self._found = files_read(m, target, items=items, allow_pickle=allow_pickle)
        return self._found.get("", set())

    def of_base(self, name: str) -> Callable[[Manifest], set[int] | None]:
        def pick(_: Manifest) -> set[int] | None:
            return None if self._found is None else self._found.get(name, set())

        return pick


def _complete_bases(tier: LocalTier, step: int, coll: Collective,
                    reads: _Reads | None) -> bool:
    """Complete every node's copy of each step ``step`` refers to (an incremental
    step's chunks may live in files another node's processes wrote); collective.

    References are flattened, so the direct bases hold every chunk referred to.
    False on every rank if one cannot be completed (load from the directory).
    """
    bases = share_from_0(coll, f"finding the steps that step {step} refers to",
                         lambda: tier.retention.bases_of(step))
    if bases is None:
        return False
    channel = byte_channel(coll)
    return all(complete_copies(coll, channel, tier.groups, tier.path(b),
                               None if reads is None else reads.of_base(_name(tier, b)))
               for b in bases)


def _name(tier: LocalTier, step: int) -> str:
    """The directory name of ``step`` (a reference's ``base``)."""
    return os.path.basename(tier.path(step))


def load_step(tier: LocalTier | None, path: str, step: int, target: Any, *,
              items: Sequence[str] | None, allow_pickle: AllowPickle, io: IOOptions | None,
              memory: MemoryOptions | None, collective: Collective, fetch: bool,
              max_arrays: int) -> Any:
    """A manager's load of ``step`` (at ``path`` in its directory): through the local
    tier where it has one (:func:`tier_load`), else ``load``."""
    if tier is not None:
        return tier_load(tier, step, target, items=items, allow_pickle=allow_pickle, io=io,
                         memory=memory, collective=collective, fetch=fetch,
                         max_arrays=max_arrays)
    return load(path, target, items=items, allow_pickle=allow_pickle, io=io, memory=memory,
                collective=collective, max_arrays=max_arrays)


def tier_load(tier: LocalTier, step: int, target: Any, *, items: Sequence[str] | None,
              allow_pickle: AllowPickle, io: IOOptions | None, memory: MemoryOptions | None,
              collective: Collective, fetch: bool = False, max_arrays: int | None = None) -> Any:
    """Load ``step`` from the local tier if it holds a copy that verifies, else persistent.

    Each process reads on its own (``load`` agrees only on errors), so a
    process whose local copy is damaged falls back alone, with a warning.
    With several nodes, copies that cannot be completed (a node's copy damaged,
    the nodes' copies of different saves, files no node holds) load from the
    directory on every process; without a persisted copy that is damage
    (``CheckpointCorruptError``: a resume goes back a step).
    ``fetch``: loaded from the persistent directory, ``step`` (an incremental
    manager's newest: a resume on a new machine) is then copied into the tier in
    the background (:func:`fetch_into_tier`), so the next save can refer to it.
    ``max_arrays``: ``load``'s, for either copy.
    """
    one = SingleProcess()
    result: Any = None
    err: BaseException | None = None
    had = tier.is_committed(step)
    from_persistent = not tier.holds(step)
    completed = False  # every node's copy completed (the same on every process)
    if collective.world_size > 1:
        from_persistent, err = _complete_step(tier, step, target, items, allow_pickle,
                                              collective)
        completed = not from_persistent and err is None
    if not from_persistent and err is None:
        try:
            result = load(tier.path(step), target, items=items, allow_pickle=allow_pickle,
                          io=io, memory=memory, collective=one, max_arrays=max_arrays)
        except CheckpointCorruptError as exc:
            from_persistent, err = _damaged(
                tier, step, exc, f"the local copy of step {step} ({tier.path(step)}) is damaged")
        except BaseException as exc:
            err = exc
    if from_persistent and err is None:
        try:
            result = load(tier.persistent.path(step), target, items=items,
                          allow_pickle=allow_pickle, io=io, memory=memory, collective=one,
                          max_arrays=max_arrays)
        except BaseException as exc:
            err = exc
    agree(collective, "loading", err, outcome="no process returns a result")
    if completed:
        _settle_restored(tier, step, had, collective)
    if from_persistent and fetch:  # a resume on a new machine: keep a local copy
        fetch_into_tier(tier, step)
    return result


def _complete_step(tier: LocalTier, step: int, target: Any, items: Sequence[str] | None,
                   allow_pickle: AllowPickle,
                   coll: Collective) -> tuple[bool, BaseException | None]:
    """Complete every node's copy of ``step`` and of its bases (collective); returns
    (load from the directory, the error to raise instead of loading)."""
    # with a target (or items), each node fetches only what its processes read
    reads = None if target is None and items is None else _Reads(target, items, allow_pickle)
    if _no_room_to_restore(tier, step, coll):
        return True, None
    try:
        ok = complete_copies(coll, byte_channel(coll), tier.groups, tier.path(step),
                             None if reads is None else reads.of_step)
        ok = ok and _complete_bases(tier, step, coll, reads)
    except CheckpointCorruptError as exc:  # raised on every process alike
        return _damaged(tier, step, exc, f"the nodes' local copies of step {step} cannot "
                        "be completed")
    except DistributedError as exc:  # agreed: raised on every process alike
        if getattr(exc, "failed_types", None) is None:
            raise
        return _not_restored(tier, step, exc, coll)
    if ok and tier.holds(step):  # its bases too (a local base may be retired)
        return False, None
    # a node holds it, none can complete it (files no node holds; every process
    # knows ok alike), and the directory lacks it: unloadable, not merely missing
    held = any_of(coll, f"looking for a node's copy of step {step}", tier.is_committed(step))
    if held and byte_channel(coll) is not None and not _might_hold(tier, step):
        return True, CheckpointCorruptError(
            f"step {step} cannot be loaded: the nodes' local copies of it cannot be "
            f"completed (a file of it is on no node: a save of it was interrupted, or a "
            f"node lost its disk) and {tier.persistent.directory} does not hold it")
    return True, None


def _no_room_to_restore(tier: LocalTier, step: int, coll: Collective) -> bool:
    """Whether a node's tier lacks ``step`` and the room for a copy of it beside the
    next save (less than twice what the next save is expected to take,
    ``_tierspace.next_save_bytes``), while the directory holds it: a tier too small
    for its keep policy dropped it for room, and a copy from a peer would fill it
    again (the next save would then drop its newest step). The step then loads from
    the directory on every process, with a warning. Collective: one gather, and one
    broadcast (rank 0 asks the directory) only when a tier is short."""

    def mine() -> list[Any] | None:  # [holds it, short of room for a copy of it]
        if not tier.groups.is_leader:
            return None
        if tier.is_committed(step):
            return [True, None]
        steps, free = tier.steps(), free_bytes(tier.root)
        if not steps or free is None or free >= 2 * next_save_bytes(tier, steps):
            return [False, None]
        return [False, f"{tier.root} (rank {coll.rank}, {free} bytes free)"]

    if len(tier.groups.leaders()) < 2:
        return False  # no peer to copy from
    nodes = [x for x in gather_each(coll, f"finding the room for step {step} in the local "
                                    "tiers", mine, outcome="nothing was loaded") if x]
    short = [s for _, s in nodes if s]
    if (not short or not any(h for h, _ in nodes)
            or not share_from_0(coll, f"finding step {step} in the directory",
                                lambda: _is_committed(tier.persistent, step))):
        return False
    warnings.warn(
        f"step {step} was not copied into the local tier {', '.join(short)} from its "
        "peer's copy: the tier has no room for it beside the next save (a tier too small "
        "for its keep policy drops persisted steps for room); it is loaded from "
        f"{tier.persistent.directory} instead",
        RuntimeWarning, stacklevel=5)
    return True


def _not_restored(tier: LocalTier, step: int, exc: DistributedError,
                  coll: Collective) -> tuple[bool, BaseException | None]:
    """Completing the nodes' copies of ``step`` failed on every process with ``exc``.
    When that was a lack of room in a node's local tier (one too small for its keep
    policy drops persisted copies, and a peer's copy would fill it again) and the
    directory holds the step, it loads from there on every process, with a warning
    naming the full tiers; else (False, ``exc``): raised on every process.
    Collective."""

    def mine() -> list[Any]:
        full = tier.root if lacks_room(exc) else None
        return [full, _is_committed(tier.persistent, step) if coll.rank == 0 else None]

    got = gather_each(coll, f"finding why step {step}'s local copies were not completed",
                      mine, outcome="nothing was loaded")
    full = sorted({f"{root} (rank {r})" for r, (root, _) in enumerate(got) if root})
    if not full or not got[0][1]:
        return False, exc
    warnings.warn(
        f"step {step} was not copied into the local tier {', '.join(full)} from its "
        f"peer's copy: the tier is full ({exc}); it is loaded from "
        f"{tier.persistent.directory} instead", RuntimeWarning, stacklevel=5)
    return True, None


def _settle_restored(tier: LocalTier, step: int, had: bool, coll: Collective) -> None:
    """A node's copy of ``step`` restored from its peers (it ``had`` none), and
    loaded, has no record of being persisted; when another node records it
    persisted, they forget that record: unpersisted on every node, the next
    persistence records it (the directory holds it) or persists it again (the
    directory lost it), and no node keeps it alone, unpersisted, forever.
    Collective (after a load that every process got through)."""
    mine = [not had, tier.is_persisted(step)] if tier.groups.is_leader else None
    nodes = [x for x in gather_each(coll, f"settling the restored copies of step {step}",
                                    lambda: mine) if x is not None]
    if not (any(f for f, _ in nodes) and any(p for _, p in nodes)):
        return
    try:
        if tier.groups.is_leader and tier.is_persisted(step):
            tier.records.forget(step)
    except CheckpointError:
        pass  # still recorded here: no process persists it (LocalTier._take agrees)


def _might_hold(tier: LocalTier, step: int) -> bool:
    """Whether the persistent directory holds ``step`` committed, or cannot tell."""
    try:
        return tier.persistent.is_committed(step)
    except CheckpointError:
        return True  # the load from there says what is wrong


def _damaged(tier: LocalTier, step: int, exc: CheckpointCorruptError,
             what: str) -> tuple[bool, BaseException | None]:
    """The local copy of ``step`` is damaged (``what``, ``exc``): load the persisted
    copy (with a warning) if the directory holds one, else raise the damage. Either
    way the local copy is no incremental save's base from then on: a chunk left
    unchanged would refer to its damaged bytes, and every later local copy (loaded
    from the tier first) would be damaged too. Neither is the copy of a step it
    refers to that holds the damage, nor any step that refers to that one
    (:func:`mark_damaged`, :func:`refers_to_damage`)."""
    mark_damaged(tier, step, exc)
    if not _is_committed(tier.persistent, step):
        return False, exc
    warnings.warn(f"{what} ({exc}); loading the persisted copy "
                  f"{tier.persistent.path(step)} instead", RuntimeWarning, stacklevel=4)
    return True, None


def _is_committed(directory: StepDirectory, step: int) -> bool:
    """Whether ``directory`` holds ``step`` committed (False: it cannot tell, e.g.
    its store is down; the caller reports what it knows instead of raising alone)."""
    try:
        return directory.is_committed(step)
    except CheckpointError:
        return False


def fetch_into_tier(tier: LocalTier, step: int) -> TaskHandle | None:
    """Copy ``step``, loaded from the persistent directory, into ``tier`` in the
    background, with every step it refers to, each recorded as persisted.

    So the next save of an incremental manager on a new machine refers to it
    instead of writing everything, and the next load of it reads the local
    disk. Each node's leader copies into its node's tier; with several nodes a
    node's copy holds, as a node-local save leaves it, the manifest and its
    own processes' files (``data/r<rank>-*``): committed, whole with the other
    nodes' copies. An optimisation: a tier without room for the copy beside the
    next save (``_tierspace.fetch_shortage``) is left as it is, and a failure
    (a copy that did not fit included) removes what this copy put there; either
    warns once.
    """
    if not tier.groups.is_leader or tier.tasks.closed:  # a closed manager's load
        return None
    own = tuple(f"data/r{r}-" for r in tier.groups.members())
    files = None if len(tier.groups.leaders()) == 1 else (lambda n: n.startswith(own))

    def task() -> None:
        copied: list[int] = []
        try:
            todo = [s for s in _fetch_order(tier.persistent, step) if not tier.is_committed(s)]
            sizes = {s: copy_bytes(metadata(tier.persistent.path(s)).files, files)
                     for s in todo}
            short = fetch_shortage(tier, sizes)
            if short is not None:
                warnings.warn(f"step {step} was not copied from {tier.persistent.directory} "
                              f"into the local tier {tier.root}: {short}; its loads read "
                              "the directory, and the next save cannot refer to it",
                              RuntimeWarning, stacklevel=2)
                return
            for s in todo:
                # a base is needed for its own chunks only; its own bases may be gone
                copy_checkpoint(tier.persistent.path(s), tier.path(s), files=files,
                                memory_bytes=tier.memory_bytes, require_bases=s == step)
                copied.append(s)
                tier.records.record(s)
            _hooks.fire("tier.fetched")
        except Exception as exc:  # noqa: BLE001 - an optimisation: warn, go on
            left = _unfetch(tier, copied)
            full = " (the local tier is full)" if lacks_room(exc) else ""
            warnings.warn(f"could not copy step {step} from {tier.persistent.directory} into "
                          f"the local tier {tier.root}{full} ({exc}); {left}the next save "
                          "writes everything", RuntimeWarning, stacklevel=2)

    return tier.tasks.submit(task, f"fetching step {step} into {tier.root}")


def _unfetch(tier: LocalTier, copied: list[int]) -> str:
    """Remove the steps a failed fetch copied into ``tier`` (a step's bases, copied
    before it), newest first; what could not be removed, as the warning says it."""
    left = []
    for s in reversed(copied):
        try:
            tier.dir.delete(s)
        except OSError:  # StorageError included
            left.append(s)
            continue
        tier.records.forget(s)
        tier.retention.forget(s)
    return f"the copied steps {left} could not be removed from it; " if left else ""


def _fetch_order(persistent: StepDirectory, step: int) -> list[int]:
    """The steps ``step`` refers to, oldest first, then ``step``: references are
    flattened, so those hold every chunk it reads (what they refer to themselves
    may be deleted already: they are retired there)."""
    bases = [b for b in map(parse_step, metadata(persistent.path(step)).bases) if b is not None]
    return [*sorted(bases), step]
