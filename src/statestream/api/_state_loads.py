"""The last step of a load into a target: the calls that put the loaded state into
objects the target holds (``load_state_dict``, a generator's state), once every value
is built: those that may refuse first, in tree order, then the checked ones (a
generator's). A call that still fails then is reported with what it leaves: which
objects were loaded before it, which were not."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from statestream.errors import CheckpointError, TargetMismatchError
from statestream.tree import KeyPath, format_keypath

__all__ = ["StateLoad", "run_state_loads"]


@dataclasses.dataclass(frozen=True, slots=True)
class StateLoad:
    """One object of the target to load: ``call()`` puts the state into it (raising
    what the object raises); ``what`` names the call (``torch.nn...Linear.load_state_dict()``)."""

    path: KeyPath
    what: str
    call: Callable[[], object]
    #: checked already (a generator's state, put into a fresh one of its kind): the
    #: call cannot refuse, and is made after every call that can
    checked: bool = False


def run_state_loads(loads: list[StateLoad], in_place: bool = False) -> None:
    """Make every call, those that may refuse first, each group in tree order; the first
    that raises stops the rest and raises a TargetMismatchError that says which objects
    already hold the checkpoint's state (``in_place``: the reads wrote into the target's
    own tensors, those of the objects not loaded too)."""
    loads = sorted(loads, key=lambda x: x.checked)  # (stable)
    for i, load in enumerate(loads):
        try:
            load.call()
        except CheckpointError as exc:
            exc.args = (f"{exc}{_left(loads, i, in_place)}", *exc.args[1:])
            raise
        except Exception as exc:
            raise TargetMismatchError(
                f"{load.what} at key path '{format_keypath(load.path)}' rejected the "
                f"checkpoint's state: {type(exc).__name__}: {exc}{_left(loads, i, in_place)}"
            ) from exc


def _paths(loads: list[StateLoad]) -> str:
    shown = ", ".join(f"'{format_keypath(x.path)}'" for x in loads[:10])
    return shown + (f" and {len(loads) - 10} more" if len(loads) > 10 else "")


def _left(loads: list[StateLoad], i: int, in_place: bool) -> str:
    """What a failure of call ``i`` leaves: the objects loaded before it keep the
    checkpoint's state (a load cannot take that back); the failing one holds what its
    own call left (a torch module: the tensors it copied before it raised; a torch
    optimizer: its state as it was); those after it were not touched."""
    done, failed, after = loads[:i], loads[i], loads[i + 1:]
    parts = []
    if done:
        parts.append(f"{_paths(done)} (before it) {_were(done)} loaded with the "
                     "checkpoint's state, which a load cannot undo")
    parts.append(f"'{format_keypath(failed.path)}' holds what the failed call left of it")
    if after:
        parts.append(f"{_paths(after)} (due after it) {_were(after)} not loaded"
                     + (" (with in_place=True the reads may have written the checkpoint's "
                        "values into their tensors and arrays already)" if in_place else ""))
    return ("\nThe load stopped there" + (", leaving the target partly loaded" if done else "")
            + ": " + "; ".join(parts) + ".")


def _were(loads: list[StateLoad]) -> str:
    return "was" if len(loads) == 1 else "were"
