"""``save_async`` and ``guard_optimizer``: entry points to the engine's save job.

The blocking phase walks, plans and snapshots the state into staging buffers
(at once with ``lazy=True``, whose snapshot runs in the background); writes,
fsyncs and the commit run in the background. Saves queue behind each other;
failures nobody asked about are printed at exit (``engine/_handle.py``).
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from typing import Any

from statestream.api._options import bool_option, path_arg
from statestream.api._save import save_options
from statestream.distributed import Collective
from statestream.engine import (
    CompressionOption,
    IOOptions,
    MemoryOptions,
    Progress,
    SaveHandle,
    start_save,
)
from statestream.errors import UnsupportedTypeError
from statestream.providers import module_provider_for, optimizer_provider_for

__all__ = ["SaveHandle", "guard_optimizer", "save_async"]


def save_async(
    path: str | os.PathLike[str],
    state: Any,
    *,
    lazy: bool = False,
    overwrite: bool = False,
    pickle_paths: Collection[str] = (),
    io: IOOptions | None = None,
    memory: MemoryOptions | None = None,
    collective: Collective | None = None,
    progress: Progress | None = None,
    meta: Mapping[str, Any] | None = None,
    compression: CompressionOption = None,
    base: str | os.PathLike[str] | None = None,
    hashes: bool = False,
    node_local: bool = False,
) -> SaveHandle:
    """Start saving ``state``; return once it is safe to mutate (or at once if lazy).

    Args:
        path, state, overwrite, pickle_paths, io, memory, progress, meta,
            compression, base, hashes, node_local: as for :func:`save`. ``memory``
            bounds the staging buffers; chunks are compressed by the background writer threads.
        lazy: return immediately and copy in the background; call
            ``handle.wait_snapshot()`` (or use :func:`guard_optimizer`) before
            mutating the state. In-place changes outside a guarded optimizer
            (``p.add_(...)`` under ``no_grad``) must wait for ``wait_snapshot()``;
            a torch tensor changed in place before its copy fails the save
            (``result()`` raises CheckpointError naming its key path) rather
            than committing a torn snapshot -- except changes torch does not
            count in the version counter: ``.data`` writes, ``fused=True``
            optimizer kernels (guard them) and BatchNorm running statistics
            updated in forward (see docs/async.md).
        collective: in a multi-process job every rank calls ``save_async``; the
            plan is agreed in the blocking phase, each rank snapshots and writes
            only the chunks it owns, and the background phase agrees and commits
            (``result()`` raises on every rank if any rank failed).

    Returns:
        A :class:`SaveHandle`; ``result()`` raises any background error.

    Raises:
        UnsupportedTypeError, CheckpointExistsError, CheckpointError (as
            :func:`save`): from the blocking phase, before anything runs in
            the background; CheckpointError also when another thread changed a
            torch tensor of the state in place while the call copied it (naming its
            key path; nothing is committed).
    """
    return start_save(path_arg(path, "path"), state, save_options(
        overwrite=overwrite, pickle_paths=pickle_paths, io=io, memory=memory,
        collective=collective, progress=progress, meta=meta, compression=compression,
        base=base, hashes=hashes, node_local=node_local), lazy=bool_option(lazy, "lazy"))


def guard_optimizer(optimizer: Any, handle: SaveHandle) -> Any:
    """Make ``optimizer.step()`` wait for a lazy snapshot of what it will change.

    The first call registers one pre-step hook on the optimizer; later calls
    (one per save) just point it at the newest handle. Before each step it
    waits only for the parameters and optimizer-state tensors of pending
    snapshots that are still being copied, and costs nothing otherwise. (It
    never removes itself while torch iterates over the hooks.)

    Returns:
        The hook's removable handle (removing it ends the guarding).

    Raises:
        UnsupportedTypeError: no provider knows how to guard this optimizer.
    """
    p = optimizer_provider_for(optimizer)
    if p is None:
        raise UnsupportedTypeError(
            f"cannot guard a {type(optimizer).__qualname__}: no provider knows its steps "
            "(torch.optim optimizers are supported)")
    return p.guard_step(optimizer, handle)


def guard_module(module: Any, handle: SaveHandle) -> Any:
    """Make ``module``'s forward pass wait for a lazy snapshot of its buffers.

    A forward pass changes buffers in place (BatchNorm's running mean and
    variance), and torch does not count those changes in the version counter
    that catches other changes made during a lazy snapshot: unguarded, such a
    change is committed torn without an error. One forward pre-hook per module
    (later calls point it at the newest handle); it waits only while a
    snapshot of the buffers is still being copied.

    Returns:
        The hook's removable handle, or None for a module without buffers.

    Raises:
        UnsupportedTypeError: no provider knows how to guard this module.
    """
    p = module_provider_for(module)
    if p is None:
        raise UnsupportedTypeError(
            f"cannot guard a {type(module).__qualname__}: no provider knows its forward "
            "passes (torch.nn modules are supported)")
    return p.guard_forward(module, handle)


def guard_state_in(state: Any, handle: SaveHandle) -> int:
    """Guard every optimizer and module among the values of ``state`` (nested dicts,
    lists and tuples): optimizer steps and forward passes wait for the lazy snapshot of
    what they change. Returns how many hooks guard it. What the manager does for lazy
    saves."""
    count = 0
    stack = [state]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        elif optimizer_provider_for(x) is not None:
            guard_optimizer(x, handle)
            count += 1
        elif module_provider_for(x) is not None:
            count += guard_module(x, handle) is not None
    return count
