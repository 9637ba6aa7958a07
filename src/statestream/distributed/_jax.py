"""Multi-process JAX as a Collective, through JAX's own coordination service."""

from __future__ import annotations

import base64
import itertools
import json
from typing import Any

from statestream.errors import CollectiveTimeoutError, DistributedError

__all__ = ["JaxCollective"]

_SEQS: dict[str, itertools.count[int]] = {}


class JaxCollective:
    """Agreement through the key-value store and barriers of ``jax.distributed``.

    Objects are JSON-encoded plain data. Every operation gets a fresh key
    prefix (all processes call statestream functions in the same order).

    Args:
        timeout_s: how long any process waits for the others at each step.
    """

    def __init__(self, *, timeout_s: float = 600.0, channel: str = "") -> None:
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

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world

    def fork(self, channel: str) -> JaxCollective:
        """The same processes with their own key sequence (for a background save)."""
        return JaxCollective(timeout_s=self._timeout_s, channel=channel)

    def _key(self, name: str) -> str:
        return f"statestream/{self._channel}/{next(self._seq)}/{name}"

    def _fail(self, what: str, exc: BaseException,
              missing: list[int] | None = None) -> BaseException:
        text = str(exc)
        if "deadline" in text.lower() or "timed out" in text.lower() or "timeout" in text.lower():
            who = ""
            if missing:
                names = ", ".join(str(r) for r in missing)
                who = f" (process{'es' if len(missing) > 1 else ''} {names} never arrived)"
            return CollectiveTimeoutError(
                f"process {self._rank} waited more than {self._timeout_s:g}s for the other "
                f"processes at {what}{who}. A process crashed or never called the same "
                "statestream function; raise timeout_s if processes are just slow"
            )
        return DistributedError(f"process {self._rank}: {what} failed: {exc}")

    def barrier(self, name: str) -> None:
        key = self._key(f"barrier/{name}")
        try:
            self._client.wait_at_barrier(key, self._timeout_ms)
        except Exception as exc:
            raise self._fail(f"barrier '{name}'", exc) from exc

    def all_gather_object(self, obj: Any) -> list[Any]:
        key = self._key("gather")
        data = base64.b64encode(json.dumps(obj).encode()).decode()
        r = self._rank
        try:
            self._client.key_value_set(f"{key}/{self._rank}", data)
            out = []
            for r in range(self._world):
                raw = self._client.blocking_key_value_get(f"{key}/{r}", self._timeout_ms)
                out.append(json.loads(base64.b64decode(raw)))
        except Exception as exc:
            raise self._fail("all_gather", exc, self._absent(key, r)) from exc
        return out

    def _absent(self, key: str, first: int) -> list[int]:
        """Processes whose all_gather entry is missing (``first`` timed out already)."""
        missing = [first]
        for r in range(first + 1, self._world):
            try:  # the wait already expired: give each of the others a moment only
                self._client.blocking_key_value_get(f"{key}/{r}", 100)
            except Exception:
                missing.append(r)
        return missing

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        key = self._key("bcast")
        try:
            if self._rank == src:
                self._client.key_value_set(key, base64.b64encode(json.dumps(obj).encode()).decode())
                return obj
            raw = self._client.blocking_key_value_get(key, self._timeout_ms)
            return json.loads(base64.b64decode(raw))
        except Exception as exc:
            raise self._fail("broadcast", exc, [src] if self._rank != src else None) from exc
