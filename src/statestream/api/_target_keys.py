"""Matching a saved state's keys to a stateful target's own: a wrapper's key prefix
(``torch.compile``'s ``_orig_mod.``) on one side only, and tied values a format
wrote under one name."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

from statestream.errors import MissingKeyError, TargetMismatchError
from statestream.providers import adapters, providers, target_provider_for
from statestream.tree import Key, KeyPath, Node, format_keypath, type_name

__all__ = ["int_keyed", "naming_checkpoint", "prefix_hint", "refuse_early", "unprefixed",
           "with_target_ties"]


def unprefixed(node: Node, sub_like: Any) -> Node:
    """A saved state whose keys all carry a wrapper's prefix (an adapter's
    ``key_prefix``: ``_orig_mod.`` of a ``torch.compile``'d module's state_dict()),
    loaded into a stateful target none of whose keys does: the keys without it. The
    mapping is one to one; any other state is returned as it is."""
    if node.kind != "dict" or not node.keys or not isinstance(sub_like, dict):
        return node
    for prefix in {a.key_prefix for a in adapters() if a.key_prefix}:
        if (all(type(k) is str and k.startswith(prefix) for k in node.keys)
                and not any(type(k) is str and k.startswith(prefix) for k in sub_like)):
            keys: list[Key] = [str(k)[len(prefix):] for k in node.keys]
            return dataclasses.replace(node, keys=keys)
    return node


def with_target_ties(node: Node, sub_like: Any,
                      named_ties: list[list[str]] | None = None) -> Node:
    """A saved state that lacks a key of a stateful target whose value is tied to
    (the same memory as, or one of ``named_ties`` with) another key's that it
    holds: that key reads the same array. A tied model saved by a format that
    writes a tie once under one name (``save_pretrained``'s safetensors omit
    ``lm_head.weight``) then loads into it, also built on the meta device."""
    if node.kind != "dict" or node.keys is None or not isinstance(sub_like, dict):
        return node
    saved = {(type(k), k): c for k, c in zip(node.keys, node.children or [])}
    missing = [k for k in sub_like if (type(k), k) not in saved]
    if not missing:
        return node
    held: dict[Any, Node] = {}  # alias key of a target value -> the saved leaf
    for k, v in sub_like.items():
        c = saved.get((type(k), k))
        if c is not None and c.kind in ("array", "alias"):
            tie = _alias_key(v)
            if tie is not None:
                held.setdefault(tie, c)
    for names in named_ties or ():
        have = [saved[(str, n)] for n in names
                if (str, n) in saved and saved[(str, n)].kind in ("array", "alias")]
        for n in names if have else ():
            held.setdefault(("named", n), have[0])
    keys, kids = list(node.keys), list(node.children or [])
    for k in missing:
        c = held.get(_alias_key(sub_like[k]) or ()) or held.get(("named", k))
        if c is not None:
            keys.append(k)
            kids.append(Node("alias", array=c.array, attrs=c.attrs))
    return dataclasses.replace(node, keys=keys, children=kids)


def _alias_key(value: Any) -> Any:
    """Which memory a target value is (tied values share it), or None."""
    prov = target_provider_for(value)
    if prov is None or not prov.capabilities.aliases:
        return None
    key = prov.alias_key(value)
    return None if key is None else (prov.kind, key)


def prefix_hint(key: Key, saved: dict[tuple[type, Key], Node]) -> str:
    """A hint for a target key the checkpoint has only with (or without) a wrapper's
    key prefix: a compiled module's state_dict() saved, a plain one wanted (or back)."""
    if type(key) is not str:
        return ""
    for a in adapters():
        p = a.key_prefix
        other = key[len(p):] if p and key.startswith(p) else p + key if p else None
        if other is not None and (str, other) in saved:
            return (f"the checkpoint has it as '{other}' (a wrapper's key prefix "
                    f"'{p}', which a torch.compile'd module's state_dict() has): load "
                    "into the module itself, wrapped or not, which maps the prefix")
    return ""


def int_keyed(kids: list[tuple[Key, Node]], target_items: list[tuple[Key, Any]]) -> bool:
    """Saved keys that are all int literals ("0", "12") under a target mapping with no
    other keys than ints (a fresh optimizer's empty ``state``): a format that stores
    keys as strings (DCP) had ints there."""
    return bool(kids) and all(type(k) is str and k.isascii() and k.isdigit()
                              and str(int(k)) == k for k, _ in kids) and all(
        type(k) is int for k, _ in target_items)


def refuse_early(like: Any, sub_like: Any, node: Node, path: KeyPath, *,
                 partial: bool = False) -> None:
    """Raise, before anything is read or loaded, where stateful target ``like``'s
    ``load_state_dict`` is sure to refuse the saved state ``node`` (a module's
    missing or unexpected keys or a value that is no tensor, an optimizer's parameter
    groups that do not match, as its providers tell): found only by that call,
    the refusal would come after the load had filled the targets before it.
    ``partial``: some of a module's entries, selected by items= (none missing)."""
    for prov in providers():
        why = prov.refused_state(like, node) if prov.capabilities.state_hints else None
        if why is not None:
            raise TargetMismatchError(
                f"the checkpoint's state at key path '{format_keypath(path)}' is not one "
                f"{type_name(like)}.load_state_dict() accepts: {why}; nothing was loaded. "
                "Load into an object built like the saved one, or without a target")
    if node.kind != "dict" or node.keys is None or not isinstance(sub_like, dict):
        return
    for prov in providers():
        if not prov.capabilities.state_hints:
            continue
        missing, unexpected = prov.refused_keys(like, list(sub_like), list(node.keys))
        what = f"{type_name(like)}.load_state_dict() would refuse the checkpoint's state"
        if missing and not partial:
            saved = {(type(k), k): c for k, c in zip(node.keys, node.children or [])}
            raise MissingKeyError(
                f"key path '{format_keypath(path + (missing[0],))}' is in the target but "
                f"not in the checkpoint{_more(missing)} (it has: {_listed(node.keys)}); "
                + (prefix_hint(missing[0], saved) or f"{what} without it")
                + "; nothing was loaded"
            )
        if unexpected:
            raise TargetMismatchError(
                f"the checkpoint has key path '{format_keypath(path + (unexpected[0],))}'"
                f"{_more(unexpected)}, which the target has no place for: {what} (an "
                "unexpected key); nothing was loaded. Load into a module built like the "
                "saved one, or without a target"
            )


def _more(keys: list[Key]) -> str:
    return f" (and {len(keys) - 1} more: {_listed(keys[1:])})" if len(keys) > 1 else ""


def _listed(keys: list[Key]) -> str:
    return ", ".join(repr(k) for k in keys[:20]) + (", ..." if len(keys) > 20 else "")


@contextlib.contextmanager
def naming_checkpoint(where: str) -> Iterator[None]:
    """A target that does not match the checkpoint (``TargetMismatchError``,
    ``MissingKeyError``, raised anywhere in a load: the walk, a value built, a
    ``load_state_dict``) names checkpoint ``where`` as well as the key path: the
    same error, its message led by ``loading <where>: `` unless it names it already."""
    try:
        yield
    except (TargetMismatchError, MissingKeyError) as exc:
        msg = str(exc)
        if where not in msg:
            exc.args = (f"loading {where}: {msg}", *exc.args[1:])
        raise
