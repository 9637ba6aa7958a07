"""The ``statestream`` command line (``inspect``, ``verify``)."""

from statestream.cli._main import main

__all__ = ["main"]
