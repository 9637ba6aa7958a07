"""The Collective protocol: how processes agree (barriers, gathers, broadcasts).

Implementations use the framework's own runtime (torch.distributed, JAX);
statestream never opens sockets of its own.
"""

from __future__ import annotations

import math
from typing import Any, Protocol, TypeVar

from statestream.errors import InvalidOptionError, InvalidOptionTypeError

__all__ = ["ByteChannel", "Collective", "SingleProcess", "seconds_option"]

T = TypeVar("T")


class Collective(Protocol):
    """What save/load need from a group of processes.

    Three methods are optional, used when a collective has them:
    ``max_ints(values) -> list[int]`` (the elementwise maximum over the processes;
    agreements reduce their failure flag and a hash of their phase with it before
    gathering anything), ``any_true(flag) -> bool`` (whether ``flag`` is true on any
    process; the same without the phase check) and ``gather_object(obj, dst=0)`` (every
    process's ``obj`` in rank order on ``dst``, None on the others; a save's
    records of what each process wrote go to rank 0 alone with it).
    """

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def barrier(self, name: str) -> None:
        """Wait until every process reached the barrier called ``name``."""
        ...

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every process's ``obj`` (JSON-able plain data), in rank order."""
        ...

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """``obj`` from process ``src`` on every process."""
        ...

    def fork(self, channel: str) -> Collective:
        """The same processes on a separate message channel (collective call)."""
        ...


class ByteChannel(Protocol):
    """Point-to-point bytes between the processes of a collective (peer copies).

    Both sides call at the same point: ``send_bytes(buf, dst)`` on one rank,
    ``recv_bytes(into, src)`` with a buffer of exactly that size on the other.
    """

    @property
    def rank(self) -> int: ...

    def send_bytes(self, data: Any, dst: int) -> None: ...

    def recv_bytes(self, into: Any, src: int) -> None: ...


class SingleProcess:
    """The trivial collective of one process.

    Example:
        >>> c = SingleProcess()
        >>> c.rank, c.world_size, c.all_gather_object({"x": 1})
        (0, 1, [{'x': 1}])
    """

    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    def barrier(self, name: str) -> None:
        return None

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        return [obj]

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return obj

    def fork(self, channel: str) -> SingleProcess:
        return self


def seconds_option(value: Any, name: str) -> float:
    """``value`` as a finite number of seconds > 0: a caller's mistake (``-1``, NaN,
    ``inf``, a str) is refused where it enters, not by the first wait it sets.

    Example:
        >>> seconds_option(600, "timeout_s")
        600.0
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidOptionTypeError(
            f"{name} must be a number of seconds, not {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise InvalidOptionError(f"{name} must be a finite number of seconds > 0, not {value}")
    return float(value)
