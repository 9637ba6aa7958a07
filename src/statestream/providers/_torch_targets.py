"""What loading into torch objects needs beyond their tensors: the ties of a module
(restored after ``load_state_dict(..., assign=True)``), the layout a never-stepped
optimizer's missing state should take, and which tensor targets nothing loads into.
Used by :class:`TorchProvider`."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from statestream.errors import TargetMismatchError
from statestream.format import dtype_from_name
from statestream.providers._base import refuse_lossy_cast
from statestream.providers._dtensor import is_dtensor
from statestream.tree import KeyPath, Node, format_keypath

__all__ = ["cast_fill", "like_target", "nested_shape_error", "optimizer_state_hints",
           "refuse_layout", "refuse_lossy_casts", "refuse_target", "refused_keys",
           "refused_state", "retie", "tied_names"]


def refuse_target(like: Any, dtype: str, path: KeyPath, stored: bool) -> None:
    """Raise TargetMismatchError, naming the key path, for a tensor target that a saved
    ``dtype`` array cannot be cast into (torch's own errors name neither): a quantized
    tensor, or a dtype that is no number (``bits8``, ``uint1``-``uint7``; ``stored``:
    statestream stores ``like``'s dtype, so it is one)."""
    where = format_keypath(path)
    if like.is_quantized:
        raise TargetMismatchError(
            f"the target at key path '{where}' is a quantized tensor ({like.dtype}); "
            f"statestream loads into plain tensors: load the saved {dtype} array into a "
            "float tensor (or None there) and quantize it (torch.quantize_per_tensor)")
    dt = like.dtype
    if not (stored or dt.is_floating_point or dt.is_complex):
        raise TargetMismatchError(
            f"the target at key path '{where}' has dtype {dt}, which torch cannot cast "
            f"the saved {dtype} array to; pass a tensor of a numeric dtype (or None there)")


def refuse_lossy_casts(boxes: list[tuple[Any, Any]], want: str, dtype: str,
                       path: KeyPath) -> None:
    """:func:`~statestream.providers._base.refuse_lossy_cast` of the loaded host arrays
    ``boxes`` (saved as ``dtype``) for a target of torch dtype ``want``
    (``str(torch.int32)``): integers, and floats (a finite value a narrower float
    makes inf: until 2026-12-07 unchecked)."""
    name = want.removeprefix("torch.")
    try:
        np_want = np.dtype(name) if name in _INTS else dtype_from_name(name)
    except KeyError:  # (complex, bool, a dtype statestream does not store)
        return
    for _, host in boxes:
        refuse_lossy_cast(host, np_want, dtype, path)


_INTS = frozenset(f"{u}int{b}" for u in ("", "u") for b in (8, 16, 32, 64))


def refuse_layout(like: Any) -> None:
    """Raise TargetMismatchError for a tensor target that is not dense: a nested one
    (whose parts may differ in shape; a jagged one's shape, ``(2, j1, 5)``, holds a
    symbolic size, which read as a plain shape mismatch), or a sparse one (COO, CSR,
    CSC, BSR, BSC), which would get a dense tensor in its place: a save never stores
    one (it refuses sparse tensors), so no checkpoint holds what it is."""
    import torch

    if getattr(like, "is_nested", False):
        raise _nested(like)
    if like.layout in (torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr,
                       torch.sparse_bsc):
        raise TargetMismatchError(
            f"a sparse tensor ({like.layout}); statestream saves and loads dense tensors only (a "
            "save refuses sparse ones), and would return a dense tensor in its place: pass "
            "a dense tensor there (target.to_dense(), or None for the saved array), then "
            f"convert what loads (.to_sparse(layout={like.layout}))")


def nested_shape_error(like: Any, exc: Exception) -> TargetMismatchError:
    """The error for a tensor target without one shape (``like.shape`` raised ``exc``):
    a nested tensor, whose parts may differ in shape."""
    if getattr(like, "is_nested", False):
        return _nested(like)
    return TargetMismatchError(
        f"a tensor whose shape torch cannot give ({exc}); statestream loads into dense "
        "tensors: pass one there (or None for the saved array)")


def _nested(like: Any) -> TargetMismatchError:
    return TargetMismatchError(
        f"a nested tensor ({like.layout} layout; its parts may differ in shape); "
        "statestream loads into dense tensors: pass one there (or None for the saved array)")


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


def refused_keys(module: Any, target_keys: list[Any], saved_keys: list[Any]
                 ) -> tuple[list[str], list[str]]:
    """The keys ``module.load_state_dict`` (strict) is sure to refuse, told before it
    is called: (its keys the saved state lacks, saved keys it has no place for).

    Only where torch's own loading decides, by its rules: a module anywhere in the
    tree with load or state_dict hooks, or its own ``_load_from_state_dict``,
    ``state_dict`` or ``load_state_dict`` (FSDP, lazy modules, a custom loader that
    maps old keys), may accept any keys, so nothing is refused here then. The
    norms' own loaders are torch's: a BatchNorm's missing ``num_batches_tracked``
    is filled in (a state without torch's ``_metadata`` is of version 1).
    """
    import torch

    base = torch.nn.Module
    if type(module).load_state_dict is not base.load_state_dict or any(
            not _plain_loader(m, base) for m in module.modules()):
        return [], []
    saved = {k for k in saved_keys if type(k) is str}
    target = {k for k in target_keys if type(k) is str}
    missing = [k for k in target_keys if type(k) is str and k not in saved
               and _expected(module, k, base, torch.nn.modules.batchnorm._NormBase)]
    unexpected = [k for k in saved_keys
                  if type(k) is str and k not in target and _unexpected(module, k, base)]
    return missing, unexpected


def _plain_loader(m: Any, base: Any) -> bool:
    """Whether module ``m`` saves and loads its own state as ``torch.nn.Module`` does."""
    from torch.nn.modules.batchnorm import _NormBase
    from torch.nn.modules.instancenorm import _InstanceNorm

    own = type(m)._load_from_state_dict
    return (own in (base._load_from_state_dict, _NormBase._load_from_state_dict,
                    _InstanceNorm._load_from_state_dict)
            and type(m).state_dict is base.state_dict
            and type(m)._save_to_state_dict is base._save_to_state_dict
            and not any(getattr(m, h, None) for h in (
                "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks",
                "_state_dict_hooks", "_state_dict_pre_hooks")))


def _local_state(m: Any) -> set[str]:
    """What a module's ``_load_from_state_dict`` loads itself (torch's ``local_state``)."""
    buffers = {k for k, v in m._buffers.items()
               if v is not None and k not in m._non_persistent_buffers_set}
    return buffers | {k for k, v in m._parameters.items() if v is not None}


def _own_extra_state(m: Any, base: Any) -> bool:
    return type(m).set_extra_state is not base.set_extra_state


def _expected(module: Any, key: str, base: Any, norm: Any) -> bool:
    """Whether torch reports ``key`` missing when the state lacks it."""
    m, rest = module, key
    while True:
        head, dot, rest = rest.partition(".")
        if not dot:
            if head == "_extra_state":
                return _own_extra_state(m, base)
            if (isinstance(m, norm) and head == "num_batches_tracked"
                    and m.track_running_stats):
                return False  # filled in from the module's own
            return head in _local_state(m)
        m = m._modules.get(head)
        if m is None:
            return False


def _unexpected(module: Any, key: str, base: Any) -> bool:
    """Whether torch reports saved ``key`` unexpected (``_load_from_state_dict``'s rule)."""
    m, rest = module, key
    while True:
        if rest == "_extra_state":
            return not _own_extra_state(m, base)
        head, dot, rest = rest.partition(".")
        if not dot:
            return head not in _local_state(m)
        if head not in m._modules:
            return True
        m = m._modules[head]
        if m is None:
            return False


def refused_state(obj: Any, saved: Node) -> str | None:
    """Why ``obj.load_state_dict`` (a module's, strict, or an optimizer's) is sure to
    refuse the saved state ``saved`` for more than its keys, told before it is called;
    None where it accepts it or only the call can tell (the same conditions as
    :func:`refused_keys` for a module; for an optimizer, torch's own
    ``load_state_dict`` with no load pre-hook, which may rewrite the state)."""
    torch = sys.modules.get("torch")  # (never imported here: no torch, no torch object)
    if torch is None:
        return None
    if isinstance(obj, torch.nn.Module):
        base = torch.nn.Module
        if type(obj).load_state_dict is not base.load_state_dict or any(
                not _plain_loader(m, base) for m in obj.modules()):
            return None
        for key, c in zip(saved.keys or [], saved.children or []):
            if type(key) is str and c.kind not in ("array", "alias") and _holds_tensor(obj, key):
                return (f"'{key}' is {_a(c.kind)} in the checkpoint, a tensor in the module "
                        "(torch copies only a tensor into its parameters and buffers)")
        return None
    sched = torch.optim.lr_scheduler
    if any(type(obj).load_state_dict is c.load_state_dict for c in (sched.LambdaLR,
                                                                     sched.MultiplicativeLR)):
        return _refused_lambdas(obj, saved)
    if any(type(obj).load_state_dict is c.load_state_dict for c in (sched.SequentialLR,
                                                                     sched.ChainedScheduler)):
        return _refused_chain(obj, saved)
    opt = torch.optim.Optimizer
    if (not isinstance(obj, opt) or type(obj).load_state_dict is not opt.load_state_dict
            or obj._optimizer_load_state_dict_pre_hooks):
        return None
    return _refused_groups(obj, saved)


def _refused_chain(sched: Any, saved: Node) -> str | None:
    """What a SequentialLR's (ChainedScheduler's) ``load_state_dict`` raises on, after it
    has taken the rest of the state and loaded the schedulers before: no
    ``_schedulers``, more of them than its own, or one its scheduler refuses."""
    subs = saved.child("_schedulers") if saved.kind == "dict" else None
    if subs is None:
        return "it has no '_schedulers' (the state of a scheduler of schedulers has them)"
    kids = subs.children or [] if subs.kind in ("list", "tuple") else None
    if kids is None:
        return None
    if len(kids) > len(sched._schedulers):
        return (f"its '_schedulers' hold the states of {len(kids)} schedulers, the "
                f"scheduler has {len(sched._schedulers)}")
    for i, (own, kid) in enumerate(zip(sched._schedulers, kids)):
        why = refused_state(own, kid)
        if why is not None:
            return f"its '_schedulers' item {i}: {why}"
    return None


def _refused_lambdas(sched: Any, saved: Node) -> str | None:
    """What a LambdaLR's (MultiplicativeLR's) ``load_state_dict`` raises on, after it
    has taken the rest of the state: no ``lr_lambdas``, or the state of a callable
    object at an index past its own lambdas."""
    lams = saved.child("lr_lambdas") if saved.kind == "dict" else None
    if lams is None:
        return "it has no 'lr_lambdas' (a LambdaLR's state has them)"
    kids = lams.children or [] if lams.kind in ("list", "tuple") else None
    if kids is None:
        return None  # (what torch makes of it is its own affair)
    held = [i for i, c in enumerate(kids) if c.kind != "none"]
    if held and held[-1] >= len(sched.lr_lambdas):
        return (f"its 'lr_lambdas' hold the state of a callable at index {held[-1]}, the "
                f"scheduler has {len(sched.lr_lambdas)} lr_lambdas (one per parameter "
                "group)")
    return None


def _holds_tensor(module: Any, key: str) -> bool:
    """Whether ``key`` names a parameter or persistent buffer that torch copies into."""
    head, dot, rest = key.partition(".")
    if not dot:
        return head in _local_state(module)
    sub = module._modules.get(head)
    return sub is not None and _holds_tensor(sub, rest)


def _refused_groups(opt: Any, saved: Node) -> str | None:
    """What a torch optimizer's ``load_state_dict`` checks before it changes anything:
    a ``state`` dict, and ``param_groups`` of as many groups of as many parameters."""
    state, groups = saved.child("state"), saved.child("param_groups")
    if saved.kind != "dict" or state is None or groups is None:
        return "it has no 'state' or no 'param_groups' (a torch optimizer's state has both)"
    if state.kind != "dict":
        return f"its 'state' is {_a(state.kind)}, not a dict"
    if groups.kind not in ("list", "tuple"):
        return f"its 'param_groups' is {_a(groups.kind)}, not a list"
    have = [len(g.get("params", ())) for g in opt.param_groups]
    sizes: list[int | None] = []
    for g in groups.children or []:
        params = g.child("params") if g.kind == "dict" else None
        sizes.append(len(params.children or []) if params is not None
                     and params.kind in ("list", "tuple") else None)
    if None in sizes:
        return "one of its 'param_groups' is not a dict with a list of 'params'"
    if sizes != have:
        return (f"its {len(sizes)} parameter groups hold {sizes} parameters, the "
                f"optimizer's {len(have)} hold {have} (torch matches them group by group, "
                "parameter by parameter)")
    return None


def _a(kind: str) -> str:
    return f"{'an' if kind[:1] in ('a', 'e', 'i', 'o', 'u') else 'a'} {kind}"


def held_local(like: Any, local: Any, want: tuple[int, ...], path: KeyPath) -> Any:
    """The part of DTensor ``like``'s local tensor ``local`` that an in-place load
    fills: all of it where it has the shape ``want`` its placements give this rank, the
    leading part of a padded shard (larger along a sharded dim). Any other shape is
    refused: filling it would leave the target wrong, and returning a new DTensor in its
    place (as loads did until 2026-12-07) left the model's own parameter unloaded."""
    have = tuple(int(n) for n in local.shape)
    if have == want:
        return local
    sharded = {pl.dim % len(want) for pl in like.placements
               if getattr(pl, "dim", None) is not None and len(want)}
    if len(have) == len(want) and all(
            a == b or (a > b and d in sharded) for d, (a, b) in enumerate(zip(have, want))):
        return local[tuple(slice(0, n) for n in want)]
    raise TargetMismatchError(
        f"the target DTensor at key path '{format_keypath(path)}' (global shape "
        f"{list(like.shape)}, placements {tuple(like.placements)}) has a local tensor of "
        f"shape {list(have)} on this rank, but its placements give this rank a shard of "
        f"shape {list(want)}: in_place=True cannot fill it (from_local with run_check=False "
        "and a wrong shape?); pass a DTensor whose local tensor is its shard, or load "
        "without in_place")


def like_target(loaded: Any, like: Any, host: np.ndarray, dtype: str, path: KeyPath) -> Any:
    """The loaded CPU tensor (on ``host``, saved as ``dtype``) as ``like`` is: its dtype
    (never wrapping an integer around), device, Parameter-ness and ``requires_grad``. A
    target on the meta device gives shape and dtype only (it holds no data, so the
    tensor stays on the CPU, ready for ``load_state_dict(..., assign=True)``)."""
    import torch

    refuse_lossy_casts([((), host)], str(like.dtype), dtype, path)
    out = loaded
    device = out.device if like.device.type == "meta" else like.device
    if like.dtype != out.dtype or device != out.device:
        out = out.to(device=device, dtype=like.dtype)
    if isinstance(like, torch.nn.Parameter):
        out = torch.nn.Parameter(out, requires_grad=like.requires_grad)
    elif like.requires_grad:
        out.requires_grad_(True)
    return out


def cast_fill(like: Any, saved: Any, dtype: str, path: KeyPath,
              ) -> tuple[Callable[[np.ndarray], None],
                         Callable[[tuple[slice, ...], np.ndarray], None]] | None:
    """For an in-place load into a plain CPU tensor of another dtype than the saved
    one (torch ``saved``), read in pieces: (check a piece as :func:`like_target`
    checks the whole array, cast a piece into its box of ``like`` by ``copy_``); None
    for a target the general path handles (or refuses): no strided CPU tensor of a
    number dtype, a conjugate or negative view, an inference tensor, overlapping."""
    import torch

    want = like.dtype
    name = str(want).removeprefix("torch.")
    if (want == saved or like.device.type != "cpu" or like.layout != torch.strided
            or like.is_quantized or getattr(like, "is_nested", False)
            or not (want.is_floating_point or want.is_complex or name in _INTS
                    or want == torch.bool)
            or like.is_conj() or like.is_neg() or like.is_inference()
            or any(st == 0 and n > 1 for st, n in zip(like.stride(), like.shape))):
        return None

    def check(piece: np.ndarray) -> None:
        refuse_lossy_casts([((), piece)], str(want), dtype, path)

    def write(box: tuple[slice, ...], piece: np.ndarray) -> None:
        src = torch.from_numpy(piece.reshape(-1).view(np.uint8)).view(saved)
        with torch.no_grad():
            like[box].copy_(src.reshape(piece.shape))

    return check, write
