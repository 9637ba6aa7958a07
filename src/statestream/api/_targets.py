"""What a target at a key path can take of a saved value that is not an array.

The refusals name the key path and what to pass instead (a target that would be
returned untouched, or a value of another kind); the one conversion is a saved
Python number into a 0-d array target (NumPy, torch, JAX: a step kept as a 0-d
tensor; a fresh flax ``TrainState``'s ``step``, which ``jax.eval_shape`` makes a
``ShapeDtypeStruct``).
"""

from __future__ import annotations

from typing import Any

from statestream.api._job import Build, _Job
from statestream.api._kinds import structured
from statestream.api._select import NO_TARGET
from statestream.errors import TargetMismatchError
from statestream.providers import target_provider_for
from statestream.tree import KeyPath, Node, format_keypath

__all__ = [
    "dtype_checked",
    "number_into_array",
    "refuse_array_target",
    "refuse_structured",
    "saved_plain",
]


def number_into_array(node: Node, like: Any, path: KeyPath, job: _Job) -> Build | None:
    """A saved Python number (``"step": 3``; a fresh flax ``TrainState``'s ``step=0``)
    into a 0-d array target: a NumPy scalar or 0-d array, a 0-d torch tensor, a 0-d JAX
    array (``jax.eval_shape`` of that state makes it a ``ShapeDtypeStruct``). The value
    comes back of the target's dtype (and device, sharding), filling the target itself
    with ``in_place=True`` where it is writable, as for a saved 0-d array; refused,
    naming the key path, where the cast would change it (beyond rounding a float): a
    float with a fractional part, or a value out of range, into an integer target; a
    number other than 0 or 1 into a bool one; a finite float into a float dtype it
    overflows. Numbers into NumPy and torch targets were refused ('the target has an
    array') until 2026-12-07; into JAX ones until 2026-11."""
    if node.kind not in ("int", "float", "bool") or like is NO_TARGET:
        return None
    provider = target_provider_for(like)
    if provider is None or tuple(provider.target_shape(like)):
        return None
    v = node.value
    dtype = {"bool": "bool", "float": "float64"}.get(node.kind, "int64")
    if node.kind == "int" and not -2**63 <= v < 2**64:
        return None  # no NumPy integer holds it: refused as before
    if node.kind == "int" and v >= 2**63:
        dtype = "uint64"
    noun = {"numpy": "NumPy array", "torch": "torch tensor", "jax": "JAX array"}
    what = (f"0-d {str(like.dtype).removeprefix('torch.')} "
            f"{noun.get(provider.kind, provider.kind + ' array')}")

    def refused(exc: Exception | None) -> TargetMismatchError:
        return TargetMismatchError(
            f"the checkpoint's {node.kind} at key path '{format_keypath(path)}' is {v!r}, "
            f"which the target's {what} cannot hold without changing it; pass None there for "
            f"the saved {node.kind}, or a target of a dtype that holds it")

    if str(like.dtype).removeprefix("torch.") == "bool" and v not in (0, 1):
        raise refused(None)
    dest = job.copied_in(provider, like, provider.restore(dtype, (), like, path))

    def build() -> Any:
        for _, buf in dest.boxes:
            buf[...] = v
        try:
            return dest.finish()
        except TargetMismatchError as exc:  # (its text is about a saved array)
            raise refused(exc) from exc

    return build


def refuse_array_target(node: Node, like: Any, path: KeyPath) -> None:
    """Raise where an array target meets a saved stateful value whose state is no
    array (a typed JAX key into a raw uint32 key: it said the checkpoint held a
    dict there, the key's state, naming neither the key nor what to do)."""
    child = node.children[0] if node.children else None
    if (like is NO_TARGET or child is None or child.kind in ("array", "alias")
            or target_provider_for(like) is None):
        return
    hint = ("; load it into a typed key target (jax.random.key(0)), or None, and take "
            "jax.random.key_data of it" if node.type_name == "jax.random.key" else "")
    raise TargetMismatchError(
        f"the target has an array at key path '{format_keypath(path)}' but the checkpoint "
        f"holds a {node.type_name} there{hint}")


def refuse_structured(like: Any, k: str, path: KeyPath) -> None:
    """Raise where target ``like`` takes more than the plain value (kind ``k``) saved."""
    what = structured(like) if like is not NO_TARGET else None
    if what is not None:
        raise TargetMismatchError(
            f"the target has {what} at key path '{format_keypath(path)}' but the "
            f"checkpoint holds a {k} there; pass None there for whatever was saved, or "
            "leave the key out of the target"
        )


def dtype_checked(build: Build, like: Any, path: KeyPath) -> Build:
    """``build``, whose value must have the dtype target ``like`` describes (an rbg key
    where a ``jax.ShapeDtypeStruct`` says unsafe_rbg: the same uint32[4] data)."""
    want = getattr(like, "dtype", None)

    def checked() -> Any:
        value = build()
        got = getattr(value, "dtype", None)
        if want is not None and got is not None and got != want:
            raise TargetMismatchError(
                f"the target at key path '{format_keypath(path)}' describes a {want} value, "
                f"the checkpoint holds a {got} one: pass None there for the saved value")
        return value

    return checked


def saved_plain(node: Node) -> dict[str, Any]:
    """The plain values (str, int, float, bool, None) of a saved mapping node by key:
    what an adapter's ``refuse_saved`` sees of a saved state before its arrays."""
    if node.keys is None or node.children is None:
        return {}
    return {str(k): c.value for k, c in zip(node.keys, node.children)
            if c.kind in ("none", "bool", "int", "float", "str")}
