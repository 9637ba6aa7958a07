"""How processes agree: the Collective protocol and its implementations.

``default_collective()`` picks torch.distributed when a process group is
initialised, multi-process JAX when ``jax.process_count() > 1``, and a
single process otherwise. Implementations import their framework lazily.
"""

from statestream.distributed._agree import (
    agree,
    any_of,
    byte_channel,
    default_collective,
    gather_each,
    share_from_0,
)
from statestream.distributed._base import ByteChannel, Collective, SingleProcess
from statestream.distributed._jax import JaxCollective
from statestream.distributed._left import forget_left, note_left
from statestream.distributed._torch import TorchCollective

__all__ = [
    "ByteChannel",
    "Collective",
    "JaxCollective",
    "SingleProcess",
    "TorchCollective",
    "agree",
    "any_of",
    "byte_channel",
    "default_collective",
    "forget_left",
    "gather_each",
    "note_left",
    "share_from_0",
]
