"""Arguments checked where they enter: an option of the wrong type is an
:class:`~statestream.InvalidOptionTypeError` naming it, before anything runs (it was an
``AttributeError`` from deep inside the engine, or a string of key paths taken one
character at a time)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from statestream.engine import IOOptions, MemoryOptions
from statestream.errors import InvalidOptionError, InvalidOptionTypeError
from statestream.format import MAX_ARRAYS
from statestream.tree import parse_keypath

__all__ = ["allow_pickle_option", "bool_option", "collective_option", "io_options",
           "key_paths", "max_arrays_option", "memory_options", "meta_option", "path_arg",
           "path_option", "progress_option"]


def _shown(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:80]}{'...' if len(text) > 80 else ''}"


def io_options(io: Any) -> IOOptions:
    """``io`` itself, or ``IOOptions()`` for None."""
    if io is None:
        return IOOptions()
    if not isinstance(io, IOOptions):
        raise InvalidOptionTypeError(
            f"io must be an ss.IOOptions (e.g. ss.IOOptions(num_threads=8)), not {_shown(io)}")
    return io


def memory_options(memory: Any) -> MemoryOptions:
    """``memory`` itself, or ``MemoryOptions()`` for None."""
    if memory is None:
        return MemoryOptions()
    if not isinstance(memory, MemoryOptions):
        raise InvalidOptionTypeError(
            "memory must be an ss.MemoryOptions (e.g. "
            f"ss.MemoryOptions(memory_budget_bytes=1 << 30)), not {_shown(memory)}")
    return memory


def key_paths(value: Any, name: str) -> list[str] | None:
    """Key paths given as a collection of str, or one str (a single key path); None
    stays None."""
    if value is None:
        return None
    if isinstance(value, str):
        return [value]
    paths = list(value) if isinstance(value, Iterable) else None
    if paths is None or not all(isinstance(p, str) for p in paths):
        raise InvalidOptionTypeError(
            f"{name} takes key paths (str, e.g. ['params', 'opt/state']), not {_shown(value)}")
    return paths


def progress_option(progress: Any) -> Any:
    """``progress``: None or a callable ``progress(bytes_done, bytes_total)``."""
    if progress is not None and not callable(progress):
        raise InvalidOptionTypeError(
            f"progress must be a callable progress(bytes_done, bytes_total), not "
            f"{_shown(progress)}")
    return progress


def collective_option(collective: Any) -> Any:
    """``collective``: None or an object with the Collective protocol's rank and
    world_size (e.g. ss.TorchCollective())."""
    if collective is not None and not all(
            hasattr(collective, a) for a in ("rank", "world_size", "barrier")):
        raise InvalidOptionTypeError(
            "collective must be a statestream Collective (e.g. ss.TorchCollective(), "
            f"or None for the default), not {_shown(collective)}")
    return collective


def path_arg(value: Any, name: str) -> str | os.PathLike[str]:
    """A path or URL that must be given (str or os.PathLike)."""
    if not isinstance(value, (str, os.PathLike)):
        raise InvalidOptionTypeError(
            f"{name} must be a path or URL (str or os.PathLike), not {_shown(value)}")
    return value


def path_option(value: Any, name: str) -> str | os.PathLike[str] | None:
    """A path or URL (str or os.PathLike), or None."""
    return None if value is None else path_arg(value, name)


def bool_option(value: Any, name: str) -> bool:
    """``value`` as a bool: True, False or a NumPy bool (not any truthy value)."""
    if not isinstance(value, (bool, np.bool_)):
        raise InvalidOptionTypeError(f"{name} must be True or False, not {_shown(value)}")
    return bool(value)


def max_arrays_option(value: Any) -> int:
    """``load``'s ``max_arrays``: None for the format's :data:`MAX_ARRAYS` (every
    checkpoint a save can write loads), or an int from 1 to it (tighter, for
    checkpoints from elsewhere)."""
    if value is None:
        return MAX_ARRAYS
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise InvalidOptionTypeError(
            f"max_arrays must be an int (arrays a manifest may hold) or None, not {_shown(value)}")
    if not 1 <= value <= MAX_ARRAYS:
        raise InvalidOptionError(
            f"max_arrays must be from 1 to {MAX_ARRAYS} (the format's limit), not {value}")
    return int(value)


def allow_pickle_option(value: Any) -> bool | list[str]:
    """``load``'s ``allow_pickle``: True, False, or the trusted key paths (a collection
    of str, or one str)."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    paths = ([value] if isinstance(value, str)
             else list(value) if isinstance(value, Iterable) else None)
    if paths is None or not all(isinstance(p, str) for p in paths):
        raise InvalidOptionTypeError(
            "allow_pickle takes True, False or key paths (str, e.g. ['extra/tok']), not "
            f"{_shown(value)}")
    for p in paths:  # trusting every leaf is said with True, never by a key path
        if not parse_keypath(p):
            raise InvalidOptionError(
                f"allow_pickle key path {p!r} names the root: it would trust every pickle "
                "leaf of the checkpoint, not a top-level key of that name. Pass "
                "allow_pickle=True if you trust them all")
    return paths


def meta_option(meta: Any, name: str = "meta") -> Mapping[str, Any] | None:
    """``save``'s ``meta``: None or a mapping (its contents are checked as JSON when
    the save begins)."""
    if meta is not None and not isinstance(meta, Mapping):
        raise InvalidOptionTypeError(
            f"{name} must be a mapping of str keys to JSON values (e.g. {{'epoch': 3}}) or None, "
            f"not {_shown(meta)}")
    return meta
