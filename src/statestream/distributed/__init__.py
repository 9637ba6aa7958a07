"""How processes agree: the Collective protocol and its implementations."""

from statestream.distributed._base import Collective, SingleProcess

__all__ = ["Collective", "SingleProcess"]
