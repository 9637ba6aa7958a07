"""Optional libraries a format needs, imported only when that format is used."""

from __future__ import annotations

import importlib
from typing import Any

from statestream.errors import CheckpointError

__all__ = ["MissingDependencyError", "require"]


class MissingDependencyError(CheckpointError, ImportError):
    """A format needs an optional library that is not installed (the message names the extra)."""


def require(module: str, extra: str, what: str) -> Any:
    """Import ``module`` or raise :class:`MissingDependencyError` naming ``statestream[extra]``."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingDependencyError(
            f"{what} needs {module.split('.')[0]}, which is not installed: "
            f"pip install 'statestream[{extra}]' ({exc})") from None
