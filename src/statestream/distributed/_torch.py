"""torch.distributed as a Collective (object collectives on a gloo group)."""

from __future__ import annotations

import datetime
import pickle
import re
import threading
import time
import weakref
from typing import Any

from statestream.distributed._base import seconds_option
from statestream.distributed._left import left_key, left_notes, with_notes
from statestream.distributed._liveness import (
    INTERVAL_S,
    Heartbeat,
    StoreLost,
    describe_ranks,
    find_stalled,
)
from statestream.distributed._torchgroup import default_store, group_for, in_use
from statestream.errors import CollectiveTimeoutError, DistributedError

__all__ = ["TorchCollective"]

#: Collectives entered so far per group (same order on every rank).
_SEQ: dict[tuple[int | None, float, str], int] = {}
#: Bytes of every rank's object that the first round of
#: :meth:`TorchCollective.all_gather_object` carries (with its length); most objects
#: fit, and the second round is skipped.
_GATHER_BLOCK = 16 << 10
#: One heartbeat per rendezvous store, by the store's id. The store itself is not
#: kept: holding it would keep rank 0's store server (and its port) alive after
#: destroy_process_group().
_BEATS: dict[int, Heartbeat] = {}
_BEATS_LOCK = threading.Lock()
#: How long a failed collective watches the peers' heartbeats to find the dead ones.
DEAD_WINDOW_S = 3 * INTERVAL_S + 0.5
#: How long the rank that hosts the store waits, after naming the dead, for the other
#: survivors to have named them too (its exit takes the store and their evidence with it).
VERDICT_GRACE_S = DEAD_WINDOW_S + 2 * INTERVAL_S


def _alive_key(global_rank: int) -> str:
    return f"statestream/alive/{global_rank}"


def _start_heartbeat(dist: Any, store: Any) -> None:
    """Bump this rank's counter in ``store`` every second (one thread per process and store).

    The thread stops when the process group is destroyed or replaced, or the
    store becomes unreachable.
    """
    sid = id(store)
    with _BEATS_LOCK:
        if sid in _BEATS and _BEATS[sid].alive():
            return
        own = store.clone()  # its own connection: never waits behind the main thread's calls
        key = _alive_key(dist.get_rank())

        def current() -> bool:
            return bool(dist.is_initialized()) and id(default_store()) == sid

        _BEATS[sid] = Heartbeat(lambda: own.add(key, 1), current,
                                name="statestream-torch-heartbeat")


def _first_words(exc: BaseException) -> str:
    """The gist of a backend error (gloo's start with a source location and end in a hint)."""
    text = str(exc).splitlines()[0] if str(exc) else repr(exc)
    text = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*", "", text)
    return text.split(" This is typically caused", 1)[0].rstrip(". ")


class TorchCollective:
    """Agreement through torch.distributed.

    Object collectives run on a gloo group created once per (group,
    timeout) — so they work beside NCCL — with ``timeout_s`` as its
    timeout: a rank that never arrives makes the others fail with
    :class:`CollectiveTimeoutError` instead of hanging. Barriers use
    ``monitored_barrier`` so the error names the missing ranks.

    Each process also runs one daemon thread that bumps its counter in the
    rendezvous store once a second (over a connection of its own); when a
    collective fails, the ranks whose counter stopped are named as dead.

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
        self._timeout_s = seconds_option(timeout_s, "timeout_s")
        key = (None if group is None else id(group), self._timeout_s, channel)
        pg, new = group_for(dist, key, group, self._timeout_s, channel)
        if new:
            _SEQ.pop(key, None)  # a new group: every rank counts from the start again
        # held weakly, like the store below: torch's registry holds the group while it
        # is registered, and a collective kept after destroy_process_group() (a closed
        # manager not yet collected) must not keep the group's threads running into
        # the interpreter's exit, where a gloo thread that lets go of finished work
        # holding Python tensors aborts the process
        self._pg_ref = weakref.ref(pg)
        self._rank = dist.get_rank(pg)
        self._world = dist.get_world_size(pg)
        self._global_ranks = dist.get_process_group_ranks(pg)
        # Arrival marks in the rendezvous store: before each collective a rank
        # records how many it has entered, so a timeout can name the ranks that
        # never came (gloo's own error does not say).
        self._key = key
        self._at = ""  # what this rank's latest arrival mark says it entered
        store = default_store()
        self._store_ref = weakref.ref(store) if store is not None else None
        self._prefix = (f"statestream/arrive/{channel}/{self._timeout_s:g}/"
                        + "-".join(str(r) for r in self._global_ranks))
        if store is not None and self._world > 1:
            try:  # liveness, so a failed collective can name the rank that died
                _start_heartbeat(dist, store)
            except Exception:  # diagnostics only
                pass

    @property
    def _pg(self) -> Any:
        pg = self._pg_ref()
        if pg is None:
            raise DistributedError(
                "the process group of this collective was destroyed "
                "(torch.distributed.destroy_process_group()); create a new one")
        return pg

    @property
    def _store(self) -> Any:
        """The rendezvous store (diagnostics only), or None once it is gone."""
        return self._store_ref() if self._store_ref is not None else None

    @_store.setter
    def _store(self, value: None) -> None:
        self._store_ref = None

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
        self._at = what
        if self._store is not None:
            try:
                self._store.set(f"{self._prefix}/{self._global_ranks[self._rank]}",
                                f"{seq}:{what}")
            except Exception:  # diagnostics only; the collective itself decides
                self._store = None
        return seq

    def _laggards(self, seq: int, dead: list[int]) -> list[str]:
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
            except Exception:  # diagnostics only: the store is gone, say nothing extra
                return []
            if local in dead:
                out.append(f"rank {local} died or disconnected after entering {last} "
                           f"(call #{n}); its heartbeat stopped")
            elif int(n) < seq:
                out.append(f"rank {local} is still at {last} (call #{n})")
            elif int(n) == seq and self._at and last != self._at:  # another kind of call
                out.append(f"rank {local} is at {last} (call #{n}) while this rank is at "
                           f"{self._at}: the ranks called different statestream functions")
        return out

    def _read_beat(self, local: int) -> int:
        assert self._store is not None
        return int(self._store.add(_alive_key(self._global_ranks[local]), 0))

    def _dead(self, seq: int) -> tuple[list[int], bool]:
        """Peers whose heartbeat stopped (group ranks), and whether the store is gone.

        A verdict another survivor already recorded for collective ``seq`` is
        taken as is; one found here is recorded for the others, and the
        store's host then waits for them (:meth:`_settle`).
        """
        if self._store is None:
            return [], False
        peers = [r for r in range(self._world) if r != self._rank]
        key = f"{self._prefix}/dead/{seq}"
        try:
            if seq and self._store.check([key]):
                told = [int(r) for r in self._store.get(key).decode().split(",")]
                dead = [r for r in told if r != self._rank]
                self._settle(seq, dead)
                return dead, False
            dead = find_stalled(self._read_beat, peers, window_s=DEAD_WINDOW_S)
        except StoreLost as lost:  # the dead were seen before the store's host left
            return lost.ranks, True
        except Exception:  # the rendezvous store itself is unreachable
            return [], True
        if dead and seq:
            try:
                self._store.set(key, ",".join(str(r) for r in dead))
            except Exception:  # diagnostics only
                return dead, True
        self._settle(seq, dead)
        return dead, False

    def _settle(self, seq: int, dead: list[int]) -> None:
        """Count this rank as having named ``dead``; the store's host waits for the others.

        The host's process exit takes the store with it, so a survivor still
        watching the heartbeats would lose its evidence and blame the host.
        The host waits (at most ``VERDICT_GRACE_S``) until every other live
        rank has its verdict. Best effort: diagnostics only.
        """
        if not seq or not dead or self._store is None:
            return
        key = f"{self._prefix}/judged/{seq}"
        try:
            done = int(self._store.add(key, 1))
            if self._store_host() != self._rank:
                return
            deadline = time.monotonic() + VERDICT_GRACE_S
            while done < self._world - len(dead) and time.monotonic() < deadline:
                time.sleep(0.1)
                done = int(self._store.add(key, 0))
        except Exception:
            pass

    def _store_host(self) -> int | None:
        """The group rank of global rank 0 (which hosts the store unless a launcher does)."""
        return self._global_ranks.index(0) if 0 in self._global_ranks else None

    def note_left(self, text: str) -> None:
        """Record why this rank leaves (see :mod:`._left`); diagnostics only."""
        if self._store is not None:
            self._store.set(left_key(self._global_ranks[self._rank]), text)

    def forget_left(self) -> None:
        """Clear this rank's record of why it left (a new manager opens)."""
        key = left_key(self._global_ranks[self._rank])
        if self._store is not None and self._store.check([key]):
            self._store.delete_key(key)

    def _read_left(self, global_rank: int) -> str | None:
        key = left_key(global_rank)
        store = self._store
        if store is None or not store.check([key]):
            return None
        return str(store.get(key).decode(errors="replace"))

    def peers_left(self) -> str:
        """Which peers left their manager with an error, and why (see :mod:`._left`)."""
        peers = [(r, g) for r, g in enumerate(self._global_ranks) if r != self._rank]
        return left_notes(self._read_left, peers)

    def _wrap(self, what: str, exc: BaseException, seq: int = 0) -> BaseException:
        return with_notes(self._explain(what, exc, seq), self.peers_left())

    def _explain(self, what: str, exc: BaseException, seq: int) -> BaseException:
        text = str(exc)
        where = f"{what} (call #{seq})" if seq else what
        if "timed out" in text.lower() or "timeout" in text.lower():
            dead, _ = self._dead(seq)
            behind = self._laggards(seq, dead) if seq else []
            who = f" ({'; '.join(behind)})" if behind else ""
            return CollectiveTimeoutError(
                f"rank {self._rank} waited more than {self._timeout_s:g}s for the other ranks "
                f"at {where}{who}: {_first_words(exc)}. "
                "A rank crashed or never called the same statestream function; raise "
                "timeout_s if ranks are just slow"
            )
        dead, store_gone = self._dead(seq)
        behind = self._laggards(seq, dead) if seq and not dead and not store_gone else []
        if behind:  # alive, at another call: it timed out first and closed the connection
            return CollectiveTimeoutError(
                f"rank {self._rank}'s {where} failed once another rank stopped waiting for "
                f"it ({'; '.join(behind)}): {_first_words(exc)}. A rank never called the "
                "same statestream function; raise timeout_s if ranks are just slow")
        if dead:
            then = "; then the rendezvous store became unreachable" if store_gone else ""
            return DistributedError(
                f"{describe_ranks(dead)} died or disconnected during {where} (seen from rank "
                f"{self._rank}; {'their' if len(dead) > 1 else 'its'} heartbeat stopped"
                f"{then}): {_first_words(exc)}"
            )
        host_rank = self._store_host()
        if store_gone and host_rank != self._rank:
            host = "global rank 0" if host_rank is None else f"rank {host_rank}"
            return DistributedError(
                f"{host} died or disconnected during {where} (seen from rank {self._rank}; "
                f"the rendezvous store, which {host} hosts unless a launcher such as torchrun "
                f"does, is unreachable too): {_first_words(exc)}"
            )
        return DistributedError(f"rank {self._rank}: {where} failed: {exc}")

    def barrier(self, name: str) -> None:
        seq = self._arrive(f"barrier '{name}'")
        try:
            with in_use(self._key):
                self._dist.monitored_barrier(
                    group=self._pg, timeout=datetime.timedelta(seconds=self._timeout_s),
                    wait_all_ranks=True,
                )
        except RuntimeError as exc:
            raise self._wrap(f"barrier '{name}'", exc, seq) from exc

    def any_true(self, flag: bool) -> bool:
        """Whether ``flag`` is true on any rank: one all-reduce (:meth:`max_ints`).

        ``agree`` asks this first and gathers the statuses only when some rank
        failed: an object gather pickles, gathers sizes, then bytes, and costs
        ~30 ms with 8 processes on 2 cores, this ~5 ms.
        """
        return bool(self.max_ints([int(flag)])[0])

    def max_ints(self, values: list[int]) -> list[int]:
        """The elementwise maximum over the ranks of ``values`` (int64; every rank
        passes as many): one all-reduce."""
        import torch

        t = torch.tensor(values, dtype=torch.int64)
        seq = self._arrive("all_reduce")
        try:
            with in_use(self._key):
                self._dist.all_reduce(t, op=self._dist.ReduceOp.MAX, group=self._pg)
        except RuntimeError as exc:
            raise self._wrap("all_reduce", exc, seq) from exc
        return [int(v) for v in t.tolist()]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in one round when each pickles to less than 16 KiB.

        ``torch.distributed.all_gather_object`` always takes two (the sizes, then
        the bytes); with 8 processes on 2 cores each round costs ~13 ms. Here the
        first round carries a fixed block per rank -- its object's length and first
        bytes -- and only when some object is longer does a second round carry
        the rest, padded to the longest rest (every rank knows every length by
        then, so all take the same rounds). Objects come from the job's own
        ranks (pickled, as torch's own object collectives do).
        """
        data, blocks, lengths = self._heads(obj)
        tails = self._tails(data, lengths, None)
        return _unpickled(blocks, tails, lengths)

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        """Every rank's ``obj`` on rank ``dst`` (None on the others).

        The same first round as :meth:`all_gather_object` (a 16 KiB block per
        rank, so every rank knows every length); the rest of longer objects goes
        to ``dst`` alone, and only ``dst`` unpickles. A save's records of what
        each rank wrote (one per chunk) only rank 0 needs: gathered to every rank,
        N ranks would each receive and decode all N parts.
        """
        data, blocks, lengths = self._heads(obj)
        tails = self._tails(data, lengths, dst)
        if self._rank != dst:
            return None
        return _unpickled(blocks, tails, lengths)

    def _heads(self, obj: Any) -> tuple[bytes, list[bytes], list[int]]:
        """Pickle ``obj``; gather every rank's length and first bytes (one round)."""
        import torch

        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        first = torch.zeros(_GATHER_BLOCK, dtype=torch.uint8)
        head = len(data).to_bytes(8, "little") + data[:_GATHER_BLOCK - 8]
        first[:len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        blocks = self._gather_bytes(first)
        return data, blocks, [int.from_bytes(b[:8], "little") for b in blocks]

    def _tails(self, data: bytes, lengths: list[int], dst: int | None) -> list[bytes]:
        """The bytes past the first block, padded to the longest: to every rank
        (``dst`` None) or to ``dst`` alone; none when every object fit."""
        import torch

        room = _GATHER_BLOCK - 8
        rest = max(lengths) - room
        if rest <= 0:
            return [b""] * self._world
        mine = torch.zeros(rest, dtype=torch.uint8)
        if len(data) > room:
            mine[:len(data) - room] = torch.frombuffer(bytearray(data[room:]), dtype=torch.uint8)
        return self._gather_bytes(mine) if dst is None else self._gather_to(mine, dst)

    def _gather_bytes(self, t: Any) -> list[bytes]:
        """Every rank's uint8 tensor ``t`` (the same size on every rank), as bytes."""
        import torch

        outs = [torch.empty_like(t) for _ in range(self._world)]
        seq = self._arrive("all_gather")
        try:
            with in_use(self._key):
                self._dist.all_gather(outs, t, group=self._pg)
        except RuntimeError as exc:
            raise self._wrap("all_gather", exc, seq) from exc
        return [o.numpy().tobytes() for o in outs]

    def _gather_to(self, t: Any, dst: int) -> list[bytes]:
        """Every rank's uint8 tensor ``t`` on rank ``dst`` (the others get [])."""
        import torch

        outs = [torch.empty_like(t) for _ in range(self._world)] if self._rank == dst else None
        seq = self._arrive("gather")
        try:
            with in_use(self._key):
                self._dist.gather(t, gather_list=outs, dst=self._global_ranks[dst], group=self._pg)
        except RuntimeError as exc:
            raise self._wrap("gather", exc, seq) from exc
        return [o.numpy().tobytes() for o in outs] if outs is not None else []

    def send_bytes(self, data: Any, dst: int) -> None:
        """Send the bytes of buffer ``data`` to rank ``dst`` (which calls :meth:`recv_bytes`).

        Point to point on this collective's gloo group: a peer copy's files
        travel over the job's own connections.
        """
        import torch

        if not len(memoryview(data).cast("B")):
            return
        t = torch.frombuffer(data, dtype=torch.uint8)
        try:
            with in_use(self._key):
                self._dist.send(t, dst=self._global_ranks[dst], group=self._pg)
        except RuntimeError as exc:
            raise self._wrap(f"sending bytes to rank {dst}", exc) from exc

    def recv_bytes(self, into: Any, src: int) -> None:
        """Fill the writable buffer ``into`` with what rank ``src`` sends (exactly its size)."""
        import torch

        if not len(memoryview(into).cast("B")):
            return
        t = torch.frombuffer(into, dtype=torch.uint8)
        try:
            with in_use(self._key):
                self._dist.recv(t, src=self._global_ranks[src], group=self._pg)
        except RuntimeError as exc:
            raise self._wrap(f"receiving bytes from rank {src}", exc) from exc

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        box = [obj if self._rank == src else None]
        seq = self._arrive("broadcast")
        try:
            with in_use(self._key):
                if self._rank == src or self._store is None:
                    self._dist.broadcast_object_list(box, src=self._global_ranks[src],
                                                     group=self._pg)
                else:
                    self._receive_watching(box, src, seq)
        except RuntimeError as exc:
            raise self._wrap("broadcast", exc, seq) from exc
        return box[0]

    def _receive_watching(self, box: list[Any], src: int, seq: int) -> None:
        """The receiving side of broadcast ``seq``, which waits on ``src`` alone.

        A peer that dies meanwhile breaks none of this rank's sockets, and ``src``,
        which finds it dead, raises without sending: this rank would wait until
        ``src``'s process exits (then blaming ``src``) or the timeout. So the
        receive runs on a thread while this one looks once a second for the
        verdict another survivor records for ``seq`` (:meth:`_dead`), and fails
        with it. The thread is left blocked then; the group is broken anyway.
        """
        done: list[BaseException | None] = []

        def receive() -> None:
            try:
                self._dist.broadcast_object_list(box, src=self._global_ranks[src],
                                                 group=self._pg)
                done.append(None)
            except BaseException as exc:  # noqa: BLE001 - raised on the caller's thread
                done.append(exc)

        t = threading.Thread(target=receive, name="statestream-broadcast", daemon=True)
        t.start()
        key = f"{self._prefix}/dead/{seq}"
        while True:
            t.join(INTERVAL_S)
            if done:
                if done[0] is not None:
                    raise done[0]
                return
            store = self._store
            try:
                told = store is not None and store.check([key])
            except Exception:  # the store is gone: the receive fails by itself
                told = False
            if told:
                raise RuntimeError(f"another rank recorded it while this one waited for rank "
                                   f"{src}'s broadcast")


def _unpickled(blocks: list[bytes], tails: list[bytes], lengths: list[int]) -> list[Any]:
    return [pickle.loads((b[8:8 + n] + t)[:n]) for b, t, n in zip(blocks, tails, lengths)]
