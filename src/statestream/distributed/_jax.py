"""Multi-process JAX as a Collective, through JAX's own coordination service."""

from __future__ import annotations

import base64
import collections
import itertools
import json
import threading
import time
from typing import Any

from statestream.distributed._base import seconds_option
from statestream.distributed._left import left_key, left_notes, with_notes
from statestream.distributed._liveness import Heartbeat, Watch, describe_ranks
from statestream.errors import CollectiveTimeoutError, DistributedError

__all__ = ["JaxCollective"]

_SEQS: dict[str, itertools.count[int]] = {}
#: Per channel, the keys of the operations since its last all-gather, which the last
#: process to arrive at the next all-gather deletes (see ``JaxCollective._exchange``).
_PENDING: dict[str, list[str]] = {}
#: One heartbeat per coordination-service client, by the client's id (the thread
#: holds the client until jax.distributed.shutdown() replaces it).
_BEATS: dict[int, Heartbeat] = {}
_BEATS_LOCK = threading.Lock()
#: Keys to delete, by client id: the heartbeat thread deletes them.
_TRASH: dict[int, collections.deque[str]] = {}
#: A wait checks the peers' heartbeats this often (seconds).
POLL_S = 1.0


def _alive_key(process: int) -> str:
    return f"statestream/alive/{process}"


def _start_heartbeat(client: Any, process: int) -> None:
    """Bump this process's counter in the coordination service every second, and
    delete the keys thrown away meanwhile (off the collectives' critical path)."""
    from jax._src import distributed

    with _BEATS_LOCK:
        if id(client) in _BEATS and _BEATS[id(client)].alive():
            return
        key = _alive_key(process)
        trash = _TRASH.setdefault(id(client), collections.deque())

        def beat() -> None:
            client.key_value_increment(key, 1)
            while trash:
                try:
                    client.key_value_delete(trash.popleft())
                except Exception:  # garbage left behind costs memory, not correctness
                    pass

        _BEATS[id(client)] = Heartbeat(beat, lambda: distributed.global_state.client is client,
                                       name="statestream-jax-heartbeat")


def _is_deadline(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "deadline" in text or "timed out" in text or "timeout" in text


class JaxCollective:
    """Agreement through the key-value store and barriers of ``jax.distributed``.

    Objects are JSON-encoded plain data. Every operation gets a fresh key
    prefix (all processes call statestream functions in the same order).

    Each process bumps a heartbeat counter in the coordination service every
    second; a process waiting for a peer whose heartbeat has not moved for
    ``dead_after_s`` stops waiting and names it as dead (JAX itself notices a
    dead process only after its ``heartbeat_timeout_seconds``, 100 by default,
    and then terminates every process).

    Args:
        timeout_s: how long any process waits for the others at each step.
        dead_after_s: how long a peer's heartbeat may stand still before a
            process waiting for it gives up, naming it. Keep it well above
            any pause of a live process (a stopped process, a thread holding
            the GIL that long) and below JAX's own heartbeat timeout.
    """

    def __init__(self, *, timeout_s: float = 600.0, channel: str = "",
                 dead_after_s: float = 30.0) -> None:
        timeout_s = seconds_option(timeout_s, "timeout_s")
        seconds_option(dead_after_s, "dead_after_s")
        import jax
        from jax._src import distributed

        client = distributed.global_state.client
        if client is None:
            raise DistributedError(
                "JAX runs several processes but jax.distributed.initialize() was not called"
            )
        self._client = client
        self._rank = int(jax.process_index())
        self._world = int(jax.process_count())
        self._timeout_ms = int(timeout_s * 1000)
        self._timeout_s = timeout_s
        self._channel = channel
        self._seq = _SEQS.setdefault(channel, itertools.count())
        self._dead_after_s = dead_after_s
        if self._world > 1:
            try:  # liveness, so a wait can name the process that died
                _start_heartbeat(client, self._rank)
            except Exception:  # diagnostics only
                pass

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world

    def fork(self, channel: str) -> JaxCollective:
        """The same processes with their own key sequence (for a background save)."""
        return JaxCollective(timeout_s=self._timeout_s, channel=channel,
                             dead_after_s=self._dead_after_s)

    def _key(self, name: str) -> str:
        return f"statestream/{self._channel}/{next(self._seq)}/{name}"

    def note_left(self, text: str) -> None:
        """Record why this process leaves (see :mod:`._left`); diagnostics only."""
        self._client.key_value_set(left_key(self._rank), text, allow_overwrite=True)

    def forget_left(self) -> None:
        """Clear this process's record of why it left (a new manager opens)."""
        if not self._missing(left_key(self._rank)):
            self._client.key_value_delete(left_key(self._rank))

    def peers_left(self) -> str:
        """Which peers left their manager with an error, and why (see :mod:`._left`)."""
        return self._left_notes()

    def _left_notes(self) -> str:
        def read(process: int) -> str | None:
            key = left_key(process)
            return None if self._missing(key) else str(self._client.key_value_try_get(key))

        peers = [(r, r) for r in range(self._world) if r != self._rank]
        return left_notes(read, peers, "process")

    def _fail(self, what: str, exc: BaseException,
              missing: list[int] | None = None, dead: list[int] | None = None) -> BaseException:
        err = self._explain(what, exc, missing, dead)
        return with_notes(err, self._left_notes())

    def _explain(self, what: str, exc: BaseException,
                 missing: list[int] | None, dead: list[int] | None) -> BaseException:
        if _is_deadline(exc):
            who = ""
            gone = [r for r in missing or [] if r in (dead or [])]
            late = [r for r in missing or [] if r not in gone]
            parts = []
            if gone:
                parts.append(f"{describe_ranks(gone, 'process')} died or disconnected "
                             f"(heartbeat stopped)")
            if late:
                parts.append(f"{describe_ranks(late, 'process')} never arrived")
            if parts:
                who = f" ({'; '.join(parts)})"
            return CollectiveTimeoutError(
                f"process {self._rank} waited more than {self._timeout_s:g}s for the other "
                f"processes at {what}{who}. A process crashed or never called the same "
                "statestream function; raise timeout_s if processes are just slow"
            )
        if self._rank != 0 and "unavailable" in str(exc).lower():
            # the coordination service runs in process 0: unreachable means it is gone
            return DistributedError(
                f"process 0 died or disconnected during {what} (seen from process "
                f"{self._rank}; the coordination service it hosts is unreachable): {exc}"
            )
        return DistributedError(f"process {self._rank}: {what} failed: {exc}")

    def _peer_beat(self, process: int) -> int:
        return int(self._client.key_value_increment(_alive_key(process), 0))

    def _missing(self, key: str) -> bool:
        try:
            self._client.key_value_try_get(key)
            return False
        except Exception:  # the client raises when the key is absent: that is the answer
            return True

    def _wait(self, key: str, what: str, pending: dict[int, str], deadline: float,
              watch: list[Watch]) -> str:
        """The value of ``key``, waiting until ``deadline``; fail early if a peer in
        ``pending`` (process -> the key it has to set) stopped beating before it
        set its key.

        ``watch`` holds the heartbeat watch of this operation, created the first
        time a wait runs longer than :data:`POLL_S` (fast waits cost one request).
        """
        while True:
            left = deadline - time.monotonic()
            step = max(0.001, min(left, POLL_S))
            try:
                return str(self._client.blocking_key_value_get(key, int(step * 1000)))
            except Exception as exc:
                if not _is_deadline(exc) or time.monotonic() >= deadline:
                    raise
            peers = [r for r in pending if r != self._rank]
            if not watch:
                watch.append(Watch(self._peer_beat, peers))
                continue
            watch[0].update()
            dead = [r for r in watch[0].stalled(self._dead_after_s)
                    if r in pending and self._missing(pending[r])]
            if dead:
                raise with_notes(DistributedError(
                    f"{describe_ranks(dead, 'process')} "
                    f"died or disconnected during {what} (seen from process {self._rank}; "
                    f"{'their' if len(dead) > 1 else 'its'} heartbeat stopped "
                    f"{self._dead_after_s:g}s ago)"
                ), self._left_notes())

    def barrier(self, name: str) -> None:
        key = self._key(f"barrier/{name}")
        try:
            self._client.wait_at_barrier(key, self._timeout_ms)
        except Exception as exc:
            raise self._fail(f"barrier '{name}'", exc) from exc

    def all_gather_object(self, obj: Any) -> list[Any]:
        key = self._key("gather")
        older, _PENDING[self._channel] = _PENDING.get(self._channel, []), [key]
        out = self._exchange(key, obj, "all_gather", read=True, delete=older)
        assert out is not None
        return out

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        """Every process's ``obj`` on process ``dst`` (None on the others): each
        sets its key and only ``dst`` reads them (an all-gather has every process
        read every key)."""
        key = self._key("gather1")
        out = self._exchange(key, obj, what="gather", read=self._rank == dst, delete=[])
        if out is not None:  # read by dst alone, which is done with them
            self._delete([key])
        return out

    def _exchange(self, key: str, obj: Any, what: str, *, read: bool,
                  delete: list[str]) -> list[Any] | None:
        """Set this process's ``obj`` under ``key``; with ``read``, wait for every
        process's and return them in rank order (else None).

        A constant number of requests per process, whatever the number of
        processes: each sets its entry (``key/d/<rank>``) and counts itself in
        (``key/n``); the last to arrive reads every entry with one directory read
        and sets them all, in rank order, as ``key/done``, which the readers wait
        for. Then it deletes the keys ``delete`` names: the coordination service
        keeps every key until the job ends, and once every process has arrived
        here every process is done with the operations before (each takes a
        channel's operations one after the other).
        """
        data = base64.b64encode(json.dumps(obj).encode()).decode()
        deadline = time.monotonic() + self._timeout_s
        watch: list[Watch] = []
        entries = f"{key}/d/"
        try:
            self._client.key_value_set(f"{entries}{self._rank}", data)
            raw = None
            if int(self._client.key_value_increment(f"{key}/n", 1)) == self._world:
                got = {int(k.rsplit("/", 1)[1]): v
                       for k, v in self._client.key_value_dir_get(entries)}
                if sorted(got) != list(range(self._world)):
                    raise DistributedError(
                        f"process {self._rank}: {what} found the entries of processes "
                        f"{sorted(got)}, not of all {self._world}")
                raw = json.dumps([got[r] for r in range(self._world)])
                self._client.key_value_set(f"{key}/done", raw)
                self._delete(delete)  # by the heartbeat thread
            if not read:
                return None
            if raw is None:
                pending = {q: f"{entries}{q}" for q in range(self._world)}
                raw = self._wait(f"{key}/done", what, pending, deadline, watch)
        except DistributedError:
            raise
        except Exception as exc:
            dead = watch[0].stalled(self._dead_after_s) if watch else []
            raise self._fail(what, exc, self._absent(entries), dead) from exc
        return [json.loads(base64.b64decode(v)) for v in json.loads(raw)]

    def _absent(self, entries: str) -> list[int]:
        """Processes without an entry under ``entries`` (after a wait timed out)."""
        try:
            have = {int(k.rsplit("/", 1)[1])
                    for k, _ in self._client.key_value_dir_get(entries)}
        except Exception:  # the service itself is gone: nothing to tell
            return []
        return [r for r in range(self._world) if r not in have]

    def _delete(self, keys: list[str]) -> None:
        """Have the heartbeat thread delete ``keys`` (within a second)."""
        _TRASH.setdefault(id(self._client), collections.deque()).extend(keys)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        key = self._key("bcast")
        _PENDING.setdefault(self._channel, []).append(key)  # the same list on every process
        watch: list[Watch] = []
        try:
            if self._rank == src:
                self._client.key_value_set(key, base64.b64encode(json.dumps(obj).encode()).decode())
                return obj
            raw = self._wait(key, "broadcast", {src: key}, time.monotonic() + self._timeout_s,
                             watch)
            return json.loads(base64.b64decode(raw))
        except DistributedError:
            raise
        except Exception as exc:
            dead = watch[0].stalled(self._dead_after_s) if watch else []
            raise self._fail("broadcast", exc, [src] if self._rank != src else None,
                             dead) from exc
