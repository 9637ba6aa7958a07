"""What to keep: the keep policy applied to a manager's committed steps."""

from __future__ import annotations

import math
import threading
import time
import warnings
from collections.abc import Mapping
from typing import Any

from statestream import _hooks
from statestream.api import CheckpointMetadata, metadata
from statestream.api._options import meta_option
from statestream.engine import CommittedSummary, committed_summary, referred_to_by
from statestream.errors import (
    CheckpointError,
    InvalidOptionError,
    InvalidOptionTypeError,
    StorageError,
)
from statestream.manager._policies import KeepAll, KeepPolicy, StepInfo, is_score, kept_by
from statestream.manager._steps import StepDirectory, parse_step

__all__ = ["Retention", "decode_metrics", "encode_metrics", "plain_metrics", "recorded",
           "step_info", "step_meta"]

#: listings of a directory whose steps a keep policy deletes meanwhile, at most
_RELISTS = 8

#: Non-finite metric values, which JSON cannot hold, are stored as these strings.
_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
#: A string metric that spells one of them is stored as {_STR_TAG: value}, so that it
#: comes back a string (since 2026-12-06; before, "inf" came back as the float inf).
_STR_TAG = "statestream.str"


def plain_metrics(metrics: Mapping[str, Any] | None) -> dict[str, Any]:
    """Metrics with NumPy, torch and JAX scalars (``np.float32(0.5)``, a 0-d loss
    tensor) as the Python numbers they hold; other values as given.

    Example:
        >>> import numpy as np
        >>> plain_metrics({"loss": np.float32(0.5), "n": np.int64(3), "tag": "a"})
        {'loss': 0.5, 'n': 3, 'tag': 'a'}

    Raises:
        InvalidOptionError: a metric is an array that is not 0-d (``loss`` of
            shape (1,)), naming the metric.
    """
    if metrics is not None and not isinstance(metrics, Mapping):
        raise InvalidOptionTypeError(
            f"metrics must be a mapping of names to numbers ({{'loss': 0.25}}), not "
            f"{type(metrics).__name__} {metrics!r:.80}")
    return {k: _plain(k, v) for k, v in (metrics or {}).items()}


def _plain(name: str, value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    shape = getattr(value, "shape", None)
    item = getattr(value, "item", None)
    if callable(item) and shape == ():  # one number
        return item()
    if shape is not None:  # an array: stored as is, it failed later as "meta" not JSON-able
        raise InvalidOptionError(
            f"metric {name!r} is a {type(value).__name__} of shape {tuple(shape)}, not a "
            "number: pass a scalar (a 0-d array, e.g. loss.mean() or loss.reshape(()))"
        )
    return value


def encode_metrics(metrics: Mapping[str, Any] | None) -> dict[str, Any]:
    """Metrics as the manifest stores them (a NaN loss must not fail the save).

    Example:
        >>> encode_metrics({"loss": float("nan"), "acc": 0.5})
        {'loss': 'nan', 'acc': 0.5}
    """
    out: dict[str, Any] = {}
    for k, v in (metrics or {}).items():
        if isinstance(v, float) and not math.isfinite(v):
            v = "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
        elif isinstance(v, str) and v in _NON_FINITE:
            v = {_STR_TAG: v}
        out[k] = v
    return out


def step_meta(step: int, metrics: Mapping[str, Any] | None,
              metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    """What a manager's save records of ``step`` in its checkpoint's ``meta``;
    ``metadata`` that is not a mapping is an ``InvalidOptionTypeError`` naming it."""
    return {"step": step, "time": time.time(), "metrics": encode_metrics(metrics),
            "metadata": dict(meta_option(metadata, "metadata") or {})}


def decode_metrics(stored: Mapping[str, Any]) -> dict[str, Any]:
    """The metrics a step was saved with (the inverse of :func:`encode_metrics`).

    Example:
        >>> decode_metrics(encode_metrics({"loss": float("inf"), "note": "inf"}))
        {'loss': inf, 'note': 'inf'}
    """
    return {k: _decode_metric(v) for k, v in stored.items()}


def _decode_metric(v: Any) -> Any:
    if isinstance(v, str):
        return _NON_FINITE.get(v, v)
    if isinstance(v, dict) and len(v) == 1 and isinstance(v.get(_STR_TAG), str):
        return v[_STR_TAG]
    return v


def recorded(path: str) -> CheckpointMetadata | CommittedSummary:
    """What the manifest of the step at ``path`` records (``meta``, ``bases``,
    ``total_bytes``): from this process's own save of it while that manifest is still
    the one committed (not decoded again), else read.

    Raises:
        StorageError: the store failed.
        CheckpointError: the step cannot be read.
    """
    known = committed_summary(path)
    return known if known is not None else metadata(path)


def step_info(path: str, step: int) -> dict[str, Any]:
    """Recorded metadata of the step at ``path``: wall time, metrics, size, user metadata,
    and the checkpoints it refers to (``bases``: an incremental save's).

    A step saved by other means (``ss.save(..., meta=...)``) may record a ``time`` that
    is not a number or ``metrics`` that are not a mapping: such a time is replaced by
    the checkpoint's creation time, such metrics by ``{}``, with a RuntimeWarning naming
    the step. Before 2026-12-07 they raised a bare ValueError, TypeError or
    AttributeError from every save of its manager (and from its open, with a keep
    policy other than ``KeepAll``).
    """
    md = recorded(path)
    user, odd = md.meta.get("user", {}), []
    if not isinstance(user, Mapping):
        user, odd = {}, [f"user metadata {user!r:.60}"]
    created = md.meta.get("created_unix")
    created = created if _is_time(created) else None
    when = user.get("time", created)
    if when is not None and not _is_time(when):
        when, odd = created, [*odd, f"a 'time' of {when!r:.60}"]
    metrics = user.get("metrics", {})
    if not isinstance(metrics, Mapping):
        metrics, odd = {}, [*odd, f"'metrics' of {metrics!r:.60}"]
    if odd:
        warnings.warn(
            f"step {step} ({path}) records {' and '.join(odd)}, not as a CheckpointManager's "
            "save records them (a step saved by other means, e.g. ss.save(..., meta=...)): "
            "ignored (the keep policy, best_step and step_info see its creation time for "
            "such a time, no metrics for such metrics)", RuntimeWarning, stacklevel=3)
    return {
        "step": step,
        "time": when,
        "metrics": decode_metrics(metrics),
        "metadata": user.get("metadata", {}),
        "nbytes": md.total_bytes,
        "bases": list(md.bases),
    }


def _is_time(value: Any) -> bool:
    """A wall time as a manager records it: a finite number of seconds."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


class Retention:
    """Applies a keep policy; caches each committed step's :class:`StepInfo`.

    A committed step only changes through the manager's own saves, which call
    :meth:`forget` first.

    Incremental steps refer to chunks of older steps (their manifests'
    ``bases``, flattened: every step a step reads). A step the policy drops but
    a kept step still refers to is *retired*: kept on storage, not listed; it is
    deleted once no kept step refers to it. What a retired step refers to is
    not kept for it (it is kept for its own chunks only). Which steps are
    retired is recomputed from the manifests (never recorded elsewhere), so a
    restarted manager sees the same.
    Deletions go newest first: references point to older steps, so a
    deletion killed halfway never leaves a committed step referring to a
    deleted one.

    A step whose manifest cannot be read (damaged, or a read that failed once:
    EIO, a store that timed out) is never deleted here -- deleting a damaged
    step is the caller's decision, and a transient error must not cost a good
    one -- and neither is any step older than it, since what it refers to is
    unknown. The policy sees the readable steps; the next apply reads again.

    A step the policy drops that a committed checkpoint beside the steps but not a
    step refers to (a user's ``ss.save(..., base=mgr.step_path(s))``) is retired too,
    until nothing refers to it: those siblings' manifest heads are read only when
    a step would be deleted or listed although the policy drops it.
    """

    def __init__(self, policy: KeepPolicy, steps: StepDirectory) -> None:
        self._policy = policy
        self._steps = steps
        self._infos: dict[int, StepInfo] = {}
        self._bases: dict[int, list[int]] = {}
        self._lock = threading.Lock()
        #: deletions begun by :meth:`apply`: a listing that one overlapped is retaken
        self._deletions = 0
        #: unreadable steps already warned about, and why each could not be read
        self._warned: set[int] = set()
        #: steps referring to a step not committed, kept and warned about
        self._warned_broken: set[int] = set()
        self._why: dict[int, str] = {}
        #: steps whose deletion failed after their commit marker was removed: no
        #: listing shows them again (they are not committed), so apply retries them
        self._unfinished: set[int] = set()
        #: (sibling, step) pairs already warned about: a step kept for a non-step sibling
        self._warned_held: set[tuple[str, int]] = set()

    def forget(self, step: int) -> None:
        with self._lock:
            self._infos.pop(step, None)
            self._bases.pop(step, None)

    def _read(self, step: int) -> tuple[StepInfo | None, list[int]]:
        """(info, the steps it refers to) of ``step``, cached; (None, []) if unreadable.

        Locked: a local tier's persistence asks for bases from its own thread.
        """
        with self._lock:
            si = self._infos.get(step)
            if si is None:
                try:
                    info = step_info(self._steps.path(step), step)
                except CheckpointError as exc:
                    self._why[step] = str(exc)
                    return None, []  # unreadable: the policy does not see it, apply keeps it
                si = StepInfo(step, float(info["time"] or 0.0), dict(info["metrics"]),
                              int(info["nbytes"]))
                self._infos[step] = si
                # a base that is not a step of this directory cannot be deleted by it
                self._bases[step] = [b for b in map(parse_step, info["bases"])
                                     if b is not None]
            return si, list(self._bases[step])

    def _info(self, step: int) -> StepInfo | None:
        return self._read(step)[0]

    def bases_of(self, step: int) -> list[int] | None:
        """The steps ``step`` refers to (its manifest's ``bases``); None if unreadable."""
        si, bases = self._read(step)
        return None if si is None else bases

    def infos(self) -> list[StepInfo]:
        """The listed steps' infos, ascending (unreadable and retired steps left out)."""
        listed = set(self.listed())
        return [si for si in map(self._info, self._steps.steps())
                if si is not None and si.step in listed]

    def best(self, metric: str, mode: str) -> int | None:
        """The listed step with the lowest (``"min"``) or highest (``"max"``) ``metric``;
        steps without it (or with NaN, an infinity) do not count; on a tie the earliest wins."""
        scored = [(float(si.metrics[metric]), si.step) for si in self.infos()
                  if is_score(si.metrics.get(metric))]
        if not scored:
            return None
        if mode == "min":
            return min(scored)[1]
        return min((-v, s) for v, s in scored)[1]

    def listed(self) -> list[int]:
        """The committed steps, without the retired ones (see the class docstring) and
        without a step that refers to a step no longer committed (a retired step whose
        own bases were deleted: it cannot be loaded), unless it is the newest."""
        if isinstance(self._policy, KeepAll):
            return self._steps.steps()
        steps, read, others = self._list_and_read()
        keep, needed = self._plan(steps, set(), read=read)
        try:  # dropped, but a checkpoint that is not a step refers to it: retired
            dropped = [s for s in steps if s not in keep and s not in needed]
            needed |= set(self._held(dropped, others))
        except StorageError:
            pass  # cannot tell: listed, as a step not deleted yet is
        broken = self._broken(steps)
        return [s for s in steps if s not in needed and (s not in broken or s == steps[-1])]

    def retired(self) -> list[tuple[int, list[int]]]:
        """(step, the steps it refers to) of each committed step :meth:`listed` leaves
        out that can be loaded as far as a listing tells (its manifest reads, and what
        it refers to is committed): a resume's last resort when every listed step is
        damaged (a retired step is a full checkpoint: its own chunks, and its bases')."""
        steps, read, _ = self._list_and_read()
        listed, have = set(self.listed()), set(steps)
        return [(s, bases) for s, (si, bases) in read.items()
                if s not in listed and si is not None and have.issuperset(bases)]

    def _list_and_read(self) -> tuple[list[int], dict[int, tuple[StepInfo | None, list[int]]],
                                      list[str]]:
        """The committed steps, ascending, each read (:meth:`_read`), as they were at
        one moment although :meth:`apply` may delete steps on another thread (a
        save's, a local tier's persistence worker's); and the directory's other
        entries (:meth:`StepDirectory.listing`).

        A listing that a deletion overlapped is taken again: it could hold a step
        deleted before its manifest was read (which looks damaged), or miss every
        step (the names listed before a newer step appeared, the older one's commit
        marker checked after its deletion). A keep policy deletes only after a newer
        step committed, so a listing begun after the deletion holds that step.
        Before 2026-12-06 ``steps()`` on another thread then kept a deleted step,
        with every older one, and warned that it was damaged, or returned ``[]``.
        """
        for _ in range(_RELISTS):
            began = self._deletions
            steps, others = self._steps.listing()
            read = {s: self._read(s) for s in steps}
            gone = {s for s, r in read.items() if r[0] is None and not self._committed(s)}
            if not gone and self._deletions == began:
                return steps, read, others
        kept = [s for s in steps if s not in gone]  # deleting faster than listing
        return kept, {s: read[s] for s in kept}, others

    def _committed(self, step: int) -> bool:
        try:
            return self._steps.is_committed(step)
        except OSError:  # cannot tell (a store that is down): unreadable, as before
            return True

    def dropped_by(self, policy: KeepPolicy, steps: list[int], protected: set[int],
                   through: set[int] | frozenset[int] = frozenset()) -> list[int]:
        """The ``steps`` (committed here) that ``policy`` drops and no step it keeps
        refers to, as :meth:`apply` would see them if they were all there is; the
        newest, the ``protected``, the unreadable ones and every step older than
        an unreadable one are kept. A step of ``through`` that a kept step refers to
        keeps what it refers to too (a local tier copies it to the directory, which
        needs its bases there)."""
        keep, needed = self._plan(sorted(steps), protected, policy, through)
        return [s for s in sorted(steps) if s not in keep and s not in needed]

    def _broken(self, steps: list[int]) -> set[int]:
        """The readable ``steps`` that refer to a step not among them."""
        have = set(steps)
        return {s for s in steps if any(b not in have for b in self._read(s)[1])}

    def _plan(self, steps: list[int], protected: set[int], policy: KeepPolicy | None = None,
              through: set[int] | frozenset[int] = frozenset(),
              read: dict[int, tuple[StepInfo | None, list[int]]] | None = None,
              ) -> tuple[set[int], set[int]]:
        """(kept, referred to by a kept step but not kept itself).

        Kept: what the policy keeps of the readable steps that refer to no missing
        step, a step that refers to a missing one while the policy would keep it if
        it were good (damaged, not unwanted: warned about), the ``protected``, the
        newest, and every step up to the newest unreadable one (references point to
        older steps, so what an unreadable step needs is among those).
        References are flattened (a step's manifest names every checkpoint it
        reads chunks from, each holding them itself), so
        a kept step needs its own bases only, not theirs: those are deleted once
        nothing kept refers to them, and a retired step whose bases are gone is
        never listed nor a base: it cannot be loaded.
        """
        if read is None:
            read = {s: self._read(s) for s in steps}
        policy = self._policy if policy is None else policy
        broken = self._broken(steps)
        readable = [si for si, _ in read.values() if si is not None]
        keep = kept_by(policy, [si for si in readable if si.step not in broken])
        if broken:  # damaged, not unwanted: deleted only once the policy drops it
            held = broken & kept_by(policy, readable)
            self._warn_broken(held, set(steps))
            keep |= held
        keep |= protected
        if steps:
            keep.add(steps[-1])  # never the last good step
        unreadable = [s for s in steps if read[s][0] is None]
        if unreadable:
            self._warn_unreadable(unreadable, steps)
            keep.update(s for s in steps if s <= unreadable[-1])
        needed: set[int] = set()
        todo = [s for s in steps if s in keep]
        while todo:
            s = todo.pop()
            for b in (read[s] if s in read else self._read(s))[1]:
                if b not in needed:
                    needed.add(b)
                    if b in through:
                        todo.append(b)
        return keep, needed - keep

    def _warn_broken(self, held: set[int], have: set[int]) -> None:
        """Warn once per step (per manager) that it refers to a step not committed."""
        for s in sorted(held - self._warned_broken):
            self._warned_broken.add(s)
            gone = [b for b in self._read(s)[1] if b not in have]
            warnings.warn(
                f"step {s} in {self._steps.directory} refers to step {gone[0]}, which is "
                "not committed there (removed by hand, or by a keep policy while step "
                f"{s} was retired): it cannot be loaded. "
                "The keep policy keeps it as long as it would keep it if it were good; "
                f"restore step {gone[0]}, or delete step {s} yourself",
                RuntimeWarning, stacklevel=6)

    def _warn_unreadable(self, unreadable: list[int], steps: list[int]) -> None:
        """Warn once per step (per manager) that it, and what is older, is kept."""
        new = [s for s in unreadable if s not in self._warned]
        if not new:
            return
        self._warned.update(new)
        held = [s for s in steps if s < unreadable[-1] and s not in unreadable]
        also = f", and so do the steps before it ({held})" if held else ""
        names = (f"step {new[0]}" if len(new) == 1
                 else "steps " + ", ".join(map(str, new)))
        warnings.warn(
            f"the keep policy cannot read {names} in {self._steps.directory} "
            f"({self._why.get(new[0], 'unreadable')}): "
            f"{'it stays' if len(new) == 1 else 'they stay'}{also}, since what "
            f"{'it refers' if len(new) == 1 else 'they refer'} to is unknown; delete a "
            "damaged step yourself once you no longer need it", RuntimeWarning, stacklevel=6)

    def apply(self, protected: set[int]) -> list[int]:
        """Delete the committed steps the policy drops and no kept step refers to,
        nor a committed checkpoint beside them that is not a step (:meth:`_held`).

        The latest committed step and the ``protected`` ones are always kept, and
        so is a step whose manifest cannot be read, with every older one (see the
        class docstring).
        Returns the deleted steps (newest first, the order of deletion).

        A deletion that fails (a step on a read-only mount, a store that is
        down) warns and stops there: the steps not deleted yet stay (an older
        one may hold chunks the failed one refers to) and the next apply tries
        again; so does a listing that fails (nothing is deleted). Cleaning up
        must not stop the saves of a training job.

        Warns:
            RuntimeWarning: a step could not be deleted (names it and the cause),
                or the directory could not be listed (or a checkpoint there that is not
                a step read); a dropped step is kept for a checkpoint that is not a
                step (once per checkpoint and step).
        """
        self._finish_deletions()
        try:
            steps, read, others = self._list_and_read()
        except OSError as exc:  # StorageError included: a store that is down
            _warn_not_listed(self._steps.directory, exc)
            return []
        if len(steps) <= 1:
            return []
        keep, needed = self._plan(steps, protected, read=read)
        dropped = [s for s in reversed(steps) if s not in keep and s not in needed]
        try:
            held = self._held(dropped, others)
        except StorageError as exc:  # what those checkpoints refer to is unknown
            _warn_not_listed(self._steps.directory, exc, "read the checkpoints in "
                             f"{self._steps.directory} that are not steps (one may "
                             "refer to a step it drops)")
            return []
        self._warn_held(held)
        dropped = [s for s in dropped if s not in held]
        for i, s in enumerate(dropped):
            self.forget(s)
            with self._lock:
                self._deletions += 1
            try:
                self._steps.delete(s)  # marker first, then data
            except OSError as exc:  # StorageError included
                if self._uncommitted(s):
                    self._unfinished.add(s)
                _warn_not_deleted(self._steps.path(s), dropped[i + 1:], exc)
                return dropped[:i]
            self.forget(s)  # read again on another thread meanwhile (a listing)
            _hooks.fire("manager.step_deleted")
        return dropped

    def _held(self, steps: list[int], others: list[str]) -> dict[int, list[str]]:
        """Which of ``steps`` a committed checkpoint among ``others`` (the directory's
        entries that are not steps) refers to, each with those checkpoints. Reads
        their manifests' heads (``referred_to_by``), only where neither is empty.

        Raises:
            StorageError: the store failed reading one.
        """
        if not steps or not others:
            return {}
        names = {self._steps.name(s): s for s in steps}
        held: dict[int, list[str]] = {}
        for other in others:
            for name in referred_to_by(self._steps.storage,
                                       f"{self._steps.directory}/{other}", names):
                held.setdefault(names[name], []).append(other)
        return held

    def _warn_held(self, held: dict[int, list[str]]) -> None:
        """Warn once per (checkpoint, step) pair (per manager) that the step is kept
        for a checkpoint that is not a step."""
        for s, deps in sorted(held.items()):
            new = [d for d in deps if (d, s) not in self._warned_held]
            if not new:
                continue
            self._warned_held.update((d, s) for d in new)
            warnings.warn(
                f"the keep policy keeps step {s} ({self._steps.path(s)}), which it drops: "
                f"{', '.join(new)} in {self._steps.directory}, not a step, refers to its "
                "chunks (an incremental checkpoint saved with base=...), and could not be "
                f"loaded without it. Step {s} is no longer listed; it is deleted once "
                "nothing refers to it (delete that checkpoint, or convert it to a full one "
                "with ss.convert)", RuntimeWarning, stacklevel=5)

    def _uncommitted(self, step: int) -> bool:
        try:
            return not self._steps.is_committed(step)
        except OSError:  # cannot tell: a committed step is listed, and retried, anyway
            return False

    def _finish_deletions(self) -> None:
        """Delete again what a failed deletion left after removing a step's commit
        marker (a step that is not committed is never listed, so nothing else would
        until a manager opens the directory); it warns again while that fails."""
        for s in sorted(self._unfinished, reverse=True):
            try:
                if self._uncommitted(s):
                    self._steps.delete(s)
            except OSError as exc:  # StorageError included
                _warn_not_deleted(self._steps.path(s), [], exc)
                return
            self._unfinished.discard(s)


def _warn_not_deleted(path: str, later: list[int], exc: BaseException) -> None:
    also = f"; steps {later} stay too until it is gone" if later else ""
    warnings.warn(
        f"the keep policy could not delete {path} ({exc}): it stays, and deleting it is "
        f"tried again after the next save{also}", RuntimeWarning, stacklevel=5)


def _warn_not_listed(directory: str, exc: BaseException, what: str | None = None) -> None:
    warnings.warn(
        f"the keep policy could not {what or f'list {directory}'} ({exc}): nothing is "
        "deleted there now; it is tried again after the next save", RuntimeWarning,
        stacklevel=5)
