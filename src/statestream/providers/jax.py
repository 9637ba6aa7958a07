"""JAX arrays (single process), ``jax.ShapeDtypeStruct`` targets and JAX pytrees.

``jax`` is imported only when a JAX value is seen (``sys.modules``).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from statestream.errors import TargetMismatchError
from statestream.providers._base import Destination, PreparedArray
from statestream.providers.numpy import host_destination, prepare_host_array
from statestream.tree import KeyPath, PytreeExpansion, format_keypath, type_name

__all__ = ["JaxProvider", "expand_pytree"]


def _jax() -> Any:
    return sys.modules.get("jax")


def _key_str(k: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def expand_pytree(obj: Any) -> PytreeExpansion | None:
    """Split a JAX-registered custom pytree node into named children (one level)."""
    jax = _jax()
    if jax is None:
        return None
    tu = jax.tree_util
    if tu.all_leaves([obj]):
        return None
    pairs, _ = tu.tree_flatten_with_path(obj, is_leaf=lambda x: x is not obj)
    keys = [_key_str(p[-1]) if p else "" for p, _ in pairs]
    return PytreeExpansion(type_name(obj), keys, [c for _, c in pairs])


def rebuild_pytree(like: Any, values: list[Any]) -> Any:
    """Rebuild a custom pytree node of ``like``'s type from its children."""
    jax = _jax()
    assert jax is not None
    _, treedef = jax.tree_util.tree_flatten(like, is_leaf=lambda x: x is not like)
    return jax.tree_util.tree_unflatten(treedef, values)


class JaxProvider:
    """Provider for ``jax.Array`` values and ``jax.ShapeDtypeStruct`` targets."""

    kind = "jax"

    def handles(self, obj: Any) -> bool:
        jax = _jax()
        return jax is not None and isinstance(obj, jax.Array)

    def prepare(self, obj: Any, path: KeyPath) -> PreparedArray:
        # On the CPU this is a zero-copy view of the device buffer; holding the
        # reference keeps the (immutable) array alive until the save is done.
        host = np.asarray(obj)
        return prepare_host_array(host, path, self.kind)

    def is_target(self, like: Any) -> bool:
        jax = _jax()
        return jax is not None and isinstance(like, (jax.Array, jax.ShapeDtypeStruct))

    def target_shape(self, like: Any) -> tuple[int, ...]:
        return tuple(int(s) for s in like.shape)

    def restore(self, dtype: str, shape: tuple[int, ...], like: Any, path: KeyPath) -> Destination:
        import jax

        dest = host_destination(dtype, shape)

        def finish() -> Any:
            out = dest
            sharding = None
            if like is not None:
                if np.dtype(like.dtype) != out.dtype:
                    try:
                        out = out.astype(like.dtype)
                    except (TypeError, ValueError) as exc:
                        raise TargetMismatchError(
                            f"cannot cast saved {dtype} array at key path "
                            f"'{format_keypath(path)}' to {like.dtype}: {exc}"
                        ) from exc
                sharding = getattr(like, "sharding", None)
            if sharding is not None:
                return jax.device_put(out, sharding)
            return jax.device_put(out)

        return Destination(boxes=[((0,) * len(shape), dest)], finish=finish)
