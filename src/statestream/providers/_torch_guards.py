"""Hooks that make torch's state changers wait for a lazy snapshot of what they change.

An optimizer step changes its parameters and state tensors; a module's forward pass
changes its buffers (BatchNorm's running statistics, which torch's version counter
does not count). Both get the same mechanism: one persistent hook per object, which
waits for the pending saves' copies of those tensors, costs nothing once they are
done, and never removes itself while torch iterates over the hooks.
"""

from __future__ import annotations

import importlib
import weakref
from collections.abc import Callable
from typing import Any

from statestream.providers._base import SnapshotWaiter

__all__ = ["guard_forward", "guard_step"]

#: object -> [its hook's removable handle, the saves it waits for]
_STEP_GUARDS: weakref.WeakKeyDictionary[Any, list[Any]] = weakref.WeakKeyDictionary()
_FORWARD_GUARDS: weakref.WeakKeyDictionary[Any, list[Any]] = weakref.WeakKeyDictionary()


def _guard(registry: weakref.WeakKeyDictionary[Any, list[Any]], obj: Any,
           save: SnapshotWaiter, hooks: Any, register: Callable[[Callable[[Any], None]], Any],
           tensors_of: Callable[[Any], list[Any]]) -> Any:
    """The removable handle of ``obj``'s one hook, now also waiting for ``save``.

    ``hooks``: the object's registered hooks (None: cannot tell); an entry whose
    hook the caller removed gets a fresh hook, or ``save`` would be guarded by
    nothing. ``register(wait)`` registers a hook calling ``wait(obj)``.
    """
    entry = registry.get(obj)
    if entry is not None and (hooks is None or entry[0].id in hooks):
        entry[1].append(save)
        return entry[0]
    pending: list[SnapshotWaiter] = [save]

    def wait(target: Any) -> None:
        live = [h for h in pending if not h.snapshot_done()]
        pending[:] = live
        if live:
            tensors = tensors_of(target)
            for h in live:
                h.wait_for(tensors)

    removable = register(wait)
    registry[obj] = [removable, pending]
    return removable


def guard_step(optimizer: Any, save: SnapshotWaiter) -> Any:
    """A pre-step hook: ``optimizer.step()`` waits for ``save``'s copies of what it changes."""
    return _guard(_STEP_GUARDS, optimizer, save,
                  getattr(optimizer, "_optimizer_step_pre_hooks", None),
                  lambda wait: optimizer.register_step_pre_hook(lambda o, a, k: wait(o)),
                  _optimizer_tensors)


def guard_forward(module: Any, save: SnapshotWaiter) -> Any:
    """A forward pre-hook: ``module(x)`` waits for ``save``'s copies of its buffers. It runs
    as Python even inside a compiled model (traced, the waits would be gone)."""
    torch: Any = importlib.import_module("torch")
    return _guard(_FORWARD_GUARDS, module, save, module._forward_pre_hooks,
                  lambda wait: module.register_forward_pre_hook(
                      torch.compiler.disable(lambda m, a: wait(m))),
                  lambda m: list(m.buffers()))


def _optimizer_tensors(opt: Any) -> list[Any]:
    """The parameters and state tensors an optimizer step changes in place."""
    import torch

    tensors: list[Any] = [p for g in opt.param_groups for p in g["params"]]
    for st in opt.state.values():
        tensors.extend(v for v in st.values() if isinstance(v, torch.Tensor))
    return tensors
