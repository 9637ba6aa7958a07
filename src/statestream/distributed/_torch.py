"""torch.distributed as a Collective (object collectives on a gloo group)."""

from __future__ import annotations

import datetime
from typing import Any

from statestream.errors import CollectiveTimeoutError, DistributedError

__all__ = ["TorchCollective"]

_GROUPS: dict[tuple[Any, float, str], Any] = {}
#: Collectives entered so far per group (same order on every rank).
_SEQ: dict[tuple[Any, float, str], int] = {}


def _default_store() -> Any:
    """The rendezvous store of the default group, or None (diagnostics only)."""
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:
        return None


class TorchCollective:
    """Agreement through torch.distributed.

    Object collectives run on a gloo group created once per (group,
    timeout) — so they work beside NCCL — with ``timeout_s`` as its
    timeout: a rank that never arrives makes the others fail with
    :class:`CollectiveTimeoutError` instead of hanging. Barriers use
    ``monitored_barrier`` so the error names the missing ranks.

    Args:
        group: the process group of the ranks that save together (default: world).
        timeout_s: how long any rank waits for the others at each step.
    """

    def __init__(self, group: Any = None, *, timeout_s: float = 600.0,
                 channel: str = "") -> None:
        import torch.distributed as dist

        self._dist = dist
        self._group = group
        self._channel = channel
        self._timeout_s = float(timeout_s)
        key = (group, self._timeout_s, channel)
        pg = _GROUPS.get(key)
        if pg is None:
            ranks = None if group is None else dist.get_process_group_ranks(group)
            pg = dist.new_group(
                ranks=ranks, backend="gloo",
                timeout=datetime.timedelta(seconds=self._timeout_s),
            )
            _GROUPS[key] = pg
        self._pg = pg
        self._rank = dist.get_rank(pg)
        self._world = dist.get_world_size(pg)
        self._global_ranks = dist.get_process_group_ranks(pg)
        # Arrival marks in the rendezvous store: before each collective a rank
        # records how many it has entered, so a timeout can name the ranks that
        # never came (gloo's own error does not say).
        self._key = key
        self._store = _default_store()
        self._prefix = (f"statestream/arrive/{channel}/{self._timeout_s:g}/"
                        + "-".join(str(r) for r in self._global_ranks))

    def fork(self, channel: str) -> TorchCollective:
        """The same ranks on a separate gloo group (for a background save's messages).

        Collective: every rank must fork the same channel at the same point.
        """
        return TorchCollective(self._group, timeout_s=self._timeout_s, channel=channel)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world

    def _arrive(self, what: str) -> int:
        seq = _SEQ.get(self._key, 0) + 1
        _SEQ[self._key] = seq
        if self._store is not None:
            try:
                self._store.set(f"{self._prefix}/{self._global_ranks[self._rank]}",
                                f"{seq}:{what}")
            except Exception:  # diagnostics only; the collective itself decides
                self._store = None
        return seq

    def _laggards(self, seq: int) -> list[str]:
        """Ranks that have not entered collective number ``seq`` (best effort)."""
        if self._store is None:
            return []
        out = []
        for local, g in enumerate(self._global_ranks):
            if local == self._rank:
                continue
            k = f"{self._prefix}/{g}"
            try:
                if not self._store.check([k]):
                    out.append(f"rank {local} never reached a statestream collective")
                    continue
                n, _, last = self._store.get(k).decode().partition(":")
            except Exception:
                return []
            if int(n) < seq:
                out.append(f"rank {local} is still at {last} (call #{n})")
        return out

    def _wrap(self, what: str, exc: BaseException, seq: int = 0) -> BaseException:
        text = str(exc)
        if "timed out" in text.lower() or "timeout" in text.lower():
            behind = self._laggards(seq) if seq else []
            who = f" ({'; '.join(behind)})" if behind else ""
            return CollectiveTimeoutError(
                f"rank {self._rank} waited more than {self._timeout_s:g}s for the other ranks "
                f"at {what} (call #{seq}){who}: {text.splitlines()[0] if text else exc!r}. "
                "A rank crashed or never called the same statestream function; raise "
                "timeout_s if ranks are just slow"
            )
        return DistributedError(f"rank {self._rank}: {what} failed: {exc}")

    def barrier(self, name: str) -> None:
        seq = self._arrive(f"barrier '{name}'")
        try:
            self._dist.monitored_barrier(
                group=self._pg, timeout=datetime.timedelta(seconds=self._timeout_s),
                wait_all_ranks=True,
            )
        except RuntimeError as exc:
            raise self._wrap(f"barrier '{name}'", exc, seq) from exc

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self._world
        seq = self._arrive("all_gather")
        try:
            self._dist.all_gather_object(out, obj, group=self._pg)
        except RuntimeError as exc:
            raise self._wrap("all_gather", exc, seq) from exc
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        box = [obj if self._rank == src else None]
        seq = self._arrive("broadcast")
        try:
            self._dist.broadcast_object_list(box, src=self._global_ranks[src], group=self._pg)
        except RuntimeError as exc:
            raise self._wrap("broadcast", exc, seq) from exc
        return box[0]
