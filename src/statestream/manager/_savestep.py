"""A manager's save of one step: ``ss.save`` (or ``ss.save_async``) with the check that
the manager may still commit in its directory, made as the save commits.

The manager's lease is checked before a save starts, but a save may run for long: its
renewals may fail meanwhile (dropped requests, a paused process), and another manager
take the directory over once the ttl passed, removing this save's staged data as a
leftover. Until 2026-12-08 the save committed all the same: its marker named a manifest
that was gone, and the other manager listed a damaged step (its latest).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from statestream.api._save import save_options
from statestream.engine import SaveHandle, SaveOptions, run_save, start_save

__all__ = ["save_step", "start_step"]


def _options(before_commit: Callable[[], None] | None, options: dict[str, Any]) -> SaveOptions:
    return dataclasses.replace(save_options(pickle_paths=(), progress=None, **options),
                               before_commit=before_commit)


def save_step(path: str, state: Any, before_commit: Callable[[], None] | None,
              **options: Any) -> None:
    """``ss.save(path, state, **options)``, calling ``before_commit`` on the process
    that commits, last before the commit (raising fails the save: nothing is
    committed, the staged data is removed, as after any failed commit)."""
    run_save(path, state, _options(before_commit, options))


def start_step(path: str, state: Any, before_commit: Callable[[], None] | None, *,
               lazy: bool, **options: Any) -> SaveHandle:
    """``ss.save_async(path, state, lazy=lazy, **options)``, with ``before_commit``
    as for :func:`save_step` (called on the save's background thread)."""
    return start_save(path, state, _options(before_commit, options), lazy=lazy)
