"""What loading into torch objects needs beyond their tensors: the ties of a module
(restored after ``load_state_dict(..., assign=True)``) and the layout a never-stepped
optimizer's missing state should take. Used by :class:`TorchProvider`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from statestream.providers._dtensor import is_dtensor
from statestream.tree import Node

__all__ = ["optimizer_state_hints", "retie", "tied_names"]


def tied_names(module: Any) -> list[list[str]]:
    """The names of a module's tied parameters (or buffers), one list per tie: the
    same Parameter under several names (an embedding and an output layer). Told by
    identity, so a model on the meta device has them too. DTensor (FSDP2) ties are
    left to the framework."""
    groups: list[list[str]] = []
    for named in (module.named_parameters(remove_duplicate=False),
                  module.named_buffers(remove_duplicate=False)):
        seen: dict[int, tuple[Any, list[str]]] = {}
        for name, t in named:
            seen.setdefault(id(t), (t, []))[1].append(name)
        groups += [names for t, names in seen.values()
                   if len(names) > 1 and not is_dtensor(t)]
    return groups


def retie(module: Any, ties: list[list[str]]) -> None:
    """Set every name of each tie to what its first name holds. With ``assign=True``
    torch gives each name a Parameter of its own, so tied parameters came back
    untied (as after ``load_state_dict(..., assign=True)`` itself)."""
    for names in ties:
        try:
            first = module.get_parameter(names[0])
        except AttributeError:
            first = module.get_buffer(names[0])
        for name in names[1:]:
            mod, _, attr = name.rpartition(".")
            setattr(module.get_submodule(mod), attr, first)


def optimizer_state_hints(opt: Any, sub_like: dict[str, Any], saved: Node,
                          shape_of: Callable[[int], tuple[int, ...]]) -> list[Any]:
    """Give a never-stepped optimizer's missing state the layout of its parameters.

    A fresh optimizer has no per-parameter state yet, so nothing says that a
    saved ``exp_avg`` should come back sharded like its (FSDP2/DTensor)
    parameter. Each saved state tensor with its parameter's shape gets that
    parameter as its target: same type, dtype, device and placements. The
    hints share the parameters' memory; the load (told by the returned list)
    never fills them in place, so ``in_place=True`` cannot overwrite a weight.
    """
    hinted: list[Any] = []
    hints = sub_like.get("state")
    state_node = saved.child("state")
    params = [p for g in opt.param_groups for p in g.get("params", [])]
    if not isinstance(hints, dict) or not params or state_node is None:
        return hinted
    for idx, per_param in zip(state_node.keys or [], state_node.children or []):
        if type(idx) is not int or not 0 <= idx < len(params) or idx in hints:
            continue
        shape = tuple(params[idx].shape)
        entry = {name: params[idx].detach()
                 for name, leaf in zip(per_param.keys or [], per_param.children or [])
                 if leaf.kind == "array" and leaf.array is not None and shape
                 and shape_of(leaf.array) == shape}
        if entry:
            hints[idx] = entry
            hinted.extend(entry.values())
    return hinted
