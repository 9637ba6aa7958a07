"""Agreement helpers over any Collective: error propagation and defaults."""

from __future__ import annotations

import hashlib
import sys
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

from statestream.distributed._base import ByteChannel, Collective, SingleProcess
from statestream.distributed._left import with_notes
from statestream.errors import DistributedError

__all__ = ["agree", "any_of", "byte_channel", "default_collective", "gather_each",
           "share_from_0"]

T = TypeVar("T")


def agree(coll: Collective, phase: str, error: BaseException | None, *,
          outcome: str = "nothing was committed",
          committed: Callable[[], bool] | None = None, check_as: str | None = None) -> None:
    """Every process reports how ``phase`` went; all raise if any failed.

    One collective call when all went well on a collective with ``max_ints`` or
    ``any_true`` (optional methods; torch's are one all-reduce), else the
    statuses are gathered. What each rank sends carries ``phase``: ranks in
    different phases (their calls paired across different operations) raise on
    every rank, naming each rank's phase (see :func:`_fast_path_ok` for the
    all-reduce).

    ``outcome`` ends the message (what the failure means for the caller).

    ``check_as`` is what the ranks compare in place of ``phase`` when ``phase`` names
    something that differs between nodes (a node-local directory, which may have
    another path on each node).

    ``committed`` is for the agreement after a commit: when the collective
    itself fails (a peer died or hung, so its status never came) and this
    rank did not fail, ``committed()`` says whether the checkpoint was
    committed anyway; if so the save succeeded and ``agree`` returns (with a
    RuntimeWarning naming the lost peer) instead of reporting a failed save.

    Raises:
        DistributedError: naming each failing rank and its error; the local
            error is chained when this rank is one of them. Naming each rank's
            phase when they differ, or the rank whose message was malformed. When the
            collective itself fails (a rank died), its error, which names
            the dead rank, with ``phase`` and ``outcome`` added.
    """
    if coll.world_size == 1:
        if error is not None:
            raise error
        return
    try:
        if _fast_path_ok(coll, check_as or phase, error is not None):
            return
        got = coll.all_gather_object(_envelope(check_as or phase, error, None))
    except DistributedError as exc:
        if error is None and committed is not None and _check(committed):
            warnings.warn(f"the checkpoint was committed, but the ranks could not confirm it "
                          f"to each other: {exc}", RuntimeWarning, stacklevel=2)
            return
        raise type(exc)(f"{exc}; while agreeing on {phase}; {outcome}") from (error or exc)
    opened = _opened(coll, phase, check_as or phase, got, error, outcome)
    _raise_failed(phase, [s for s, _ in opened], error, outcome)


def _fast_path_ok(coll: Collective, phase: str, failed: bool) -> bool:
    """Whether one cheap all-reduce showed that no rank failed and every rank is in
    ``phase`` (then nothing needs gathering).

    A collective with ``max_ints`` (torch's: one all-reduce of a few integers) reduces
    this rank's failure flag and a 63-bit hash of ``phase`` (and its negation, so the
    smallest comes back too): ranks in different phases differ in the hash, and then
    every rank gathers the phases to name them. One with only ``any_true`` cannot tell
    phases apart on the fast path (its gathered path still does).
    """
    max_ints: Callable[[list[int]], list[int]] | None = getattr(coll, "max_ints", None)
    if max_ints is not None:
        tag = _phase_tag(phase)
        top, high, neg_low = max_ints([int(failed), tag, -tag])
        return not top and high == -neg_low
    any_true: Callable[[bool], bool] | None = getattr(coll, "any_true", None)
    return any_true is not None and not any_true(failed)


def _same_first_round(coll: Collective, phase: str, error: BaseException | None) -> None:
    """The all-reduce that :func:`agree` starts with, where the collective has one.

    A collective that pairs its calls by order (torch) must see the same kind of call
    on every rank: a gather met by another rank's all-reduce waits until the
    timeout and cannot name the phases. Starting every helper with the same
    all-reduce lets a rank in ``agree`` and a rank in a gather find out that they
    differ and both go on to the gather, which names them. The all-reduce's answer
    is not needed here: the gather that follows carries everything.
    """
    if getattr(coll, "max_ints", None) is not None:
        _fast_path_ok(coll, phase, error is not None)


def _phase_tag(phase: str) -> int:
    """A 63-bit hash of ``phase``, the same in every process (unlike ``hash``).

    Example:
        >>> _phase_tag("planning") == _phase_tag("planning") != _phase_tag("committing")
        True
    """
    digest = hashlib.blake2b(phase.encode("utf-8", "replace"), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _envelope(phase: str, error: BaseException | None, value: Any) -> list[Any]:
    """What a rank sends in an agreement: its phase, its status, its value."""
    return [phase, _status(error), value]


def _opened(coll: Collective, phase: str, key: str, got: Any, error: BaseException | None,
            outcome: str) -> list[tuple[str | None, Any]]:
    """Every rank's (status, value) from the gathered envelopes ``got``, each of which
    must carry ``key`` (what the ranks compare: ``phase`` or its ``check_as``).

    Raises:
        DistributedError: on every rank alike (each got the same list) when an
            envelope is malformed or the ranks were in different phases: their
            collectives paired across different operations. When some rank also
            reported a failure, the error names it (during its own phase) first:
            a rank's own argument that differs from the others' (a step number
            in the phase) makes both.
    """
    if not isinstance(got, (list, tuple)) or len(got) != coll.world_size:
        raise _out_of_step(coll, f"{phase} received {_brief(got)} from the collective, not one "
                           f"message from each of the {coll.world_size} ranks", outcome, error)
    for r, g in enumerate(got):
        if not (isinstance(g, (list, tuple)) and len(g) == 3 and isinstance(g[0], str)
                and (g[1] is None or isinstance(g[1], str))):
            raise _out_of_step(
                coll, f"rank {r} sent {_brief(g)} where {phase} expects its phase, status and "
                f"value (a rank called another statestream function, or a collective of "
                f"its own, at this point)", outcome, error)
    phases = [g[0] for g in got]
    if any(p != key for p in phases):
        where = ", ".join(f"rank {r} {'was ' if r == 0 else ''}in {p!r}"
                          for r, p in enumerate(phases))
        failed = [(r, f"{p!r}", g[1]) for r, (p, g) in enumerate(zip(phases, got))
                  if g[1] is not None]
        raise _out_of_step(coll, f"the ranks called different operations at the same point: "
                           f"{where} (every rank must call the same statestream functions "
                           f"in the same order)", outcome, error, failed)
    return [(g[1], g[2]) for g in got]


def _out_of_step(coll: Collective, text: str, outcome: str, error: BaseException | None,
                 failed: list[tuple[int, str, str]] | None = None) -> DistributedError:
    """The error of ranks out of step, after the ``failed`` ranks' failures (rank,
    its phase, its status), naming the peers that left their manager with an
    error (the usual reason why one closes while another saves)."""
    first = "".join(f"rank {r} failed during {p}: {s}; " for r, p, s in failed or [])
    msg = f"{first}ranks out of step: {text}; {outcome}"
    peers_left: Callable[[], str] | None = getattr(coll, "peers_left", None)
    if peers_left is not None:
        try:
            msg = str(with_notes(DistributedError(msg), peers_left()))
        except Exception:  # noqa: BLE001 - diagnostics only
            pass
    failure = DistributedError(msg)
    failure.failed_types = tuple(s.split(":", 1)[0] for _, _, s in failed or [])
    failure.__cause__ = error
    return failure


def _brief(obj: Any, limit: int = 120) -> str:
    text = repr(obj)
    return text if len(text) <= limit else f"{text[:limit]}... ({type(obj).__name__})"


def _status(error: BaseException | None) -> str | None:
    return None if error is None else f"{type(error).__name__}: {error}"


def _raise_failed(phase: str, statuses: list[Any], error: BaseException | None,
                  outcome: str) -> None:
    """Raise on every rank if any rank's status (None: it went well) says it failed."""
    failed = [(r, s) for r, s in enumerate(statuses) if s is not None]
    if not failed:
        return
    text = "; ".join(f"rank {r} failed during {phase}: {s}" for r, s in failed)
    failure = DistributedError(f"{text}; {outcome}")
    failure.failed_types = tuple(str(s).split(":", 1)[0] for _, s in failed)
    if error is not None:  # the precise error chained on the rank that had it
        raise failure from error
    raise failure


def gather_each(coll: Collective, phase: str, fn: Callable[[], T], *,
                outcome: str = "nothing was changed", check_as: str | None = None) -> list[T]:
    """Every process's ``fn()``, in rank order, or an error on every process if any
    process's ``fn`` raised: one ``all_gather_object``, which carries the error
    (and ``phase``, checked as :func:`agree` does).

    For work that can fail on one process alone (its own disk, its own listing)
    right before a collective: raised there alone, it would leave the others
    waiting in that collective until its timeout. ``fn()`` is JSON-able plain data.

    Raises:
        DistributedError: naming each failing rank and its error (chained on the
            ranks that had it); with one process, ``fn``'s own error.
    """
    if coll.world_size == 1:
        return [fn()]
    value: Any = None
    error: BaseException | None = None
    try:
        value = fn()
    except Exception as exc:  # noqa: BLE001 - raised on every rank just below
        error = exc
    try:
        _same_first_round(coll, check_as or phase, error)
        got = coll.all_gather_object(_envelope(check_as or phase, error, value))
    except DistributedError as exc:
        raise type(exc)(f"{exc}; while agreeing on {phase}; {outcome}") from (error or exc)
    opened = _opened(coll, phase, check_as or phase, got, error, outcome)
    _raise_failed(phase, [s for s, _ in opened], error, outcome)
    return [v for _, v in opened]


def share_from_0(coll: Collective, phase: str, fn: Callable[[], T], *,
                 outcome: str = "nothing was changed") -> T:
    """Rank 0's ``fn()`` on every process (``fn`` runs on rank 0 only), or rank 0's
    error raised on every process: one ``all_gather_object`` (small objects: one
    round on torch, like a broadcast), which carries it and every rank's ``phase``,
    checked as :func:`agree` does, so ranks out of step fail on every rank (a
    broadcast would tell only the receivers).

    Raises:
        DistributedError: rank 0's error (chained on rank 0); with one process,
            ``fn``'s own error.
    """
    if coll.world_size == 1:
        return fn()
    value: Any = None
    error: BaseException | None = None
    if coll.rank == 0:
        try:
            value = fn()
        except Exception as exc:  # noqa: BLE001 - raised on every rank just below
            error = exc
    try:  # gathered, not broadcast: every rank sees every rank's phase
        _same_first_round(coll, phase, error)
        got = coll.all_gather_object(_envelope(phase, error, value))
    except DistributedError as exc:
        raise type(exc)(f"{exc}; while agreeing on {phase}; {outcome}") from (error or exc)
    status, value = _opened(coll, phase, phase, got, error, outcome)[0]
    _raise_failed(phase, [status], error, outcome)
    return value  # type: ignore[no-any-return]


def any_of(coll: Collective, phase: str, flag: bool) -> bool:
    """Whether ``flag`` is true on any process, with ``phase`` checked as
    :func:`agree` does: one all-reduce on a collective with ``max_ints`` (torch),
    else one all-gather.

    Raises:
        DistributedError: on every process when they were in different phases or
            a message was malformed (their collectives paired across operations).
    """
    if coll.world_size == 1:
        return bool(flag)
    outcome = "nothing was changed"
    max_ints: Callable[[list[int]], list[int]] | None = getattr(coll, "max_ints", None)
    try:
        if max_ints is not None:
            tag = _phase_tag(phase)
            top, high, neg_low = max_ints([int(bool(flag)), tag, -tag])
            if high == -neg_low:
                return bool(top)
        got = coll.all_gather_object(_envelope(phase, None, bool(flag)))
    except DistributedError as exc:
        raise type(exc)(f"{exc}; while agreeing on {phase}; {outcome}") from exc
    return any(bool(v) for _, v in _opened(coll, phase, phase, got, None, outcome))


def _check(committed: Callable[[], bool]) -> bool:
    try:
        return bool(committed())
    except Exception:  # cannot tell: the save is not known to be committed
        return False


def default_collective() -> Collective:
    """The collective of the running job: torch.distributed, multi-process JAX, or one process."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        if dist.get_world_size() > 1:
            from statestream.distributed._torch import TorchCollective

            return TorchCollective()
    jax = sys.modules.get("jax")
    if jax is not None:
        try:
            n = jax.process_count()
        except Exception:  # pragma: no cover - backend not initialised
            n = 1
        if n > 1:
            from statestream.distributed._jax import JaxCollective

            return JaxCollective()
    return SingleProcess()




def byte_channel(coll: Collective) -> ByteChannel | None:
    """The point-to-point byte channel of ``coll``, or None where it has none.

    torch.distributed has one (gloo send/recv); JAX's coordination service
    carries small objects only, and one process needs none.
    """
    from statestream.distributed._torch import TorchCollective

    return coll if isinstance(coll, TorchCollective) else None
