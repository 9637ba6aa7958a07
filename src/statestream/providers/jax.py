"""JAX arrays (single process), ``jax.ShapeDtypeStruct`` targets and JAX pytrees.

``jax`` is imported only when a JAX value is seen (``sys.modules``).
"""

from __future__ import annotations

import math
import sys
import threading
from typing import Any

import numpy as np

from statestream.errors import TargetMismatchError, UnsupportedTypeError
from statestream.providers._base import (
    ArrayProvider,
    Destination,
    PreparedArray,
    ProviderCapabilities,
    cast_host_array,
    chunk_of_host_array,
    find_box,
    refuse_lossy_cast,
)
from statestream.providers.numpy import host_destination, prepare_host_array
from statestream.tree import KeyPath, PytreeExpansion, format_keypath, type_name
from statestream.tree._flatten import DATA_FIELD_HOOKS

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


def jax_data_fields(obj: Any) -> set[str] | None:
    """The data fields of a dataclass registered as a JAX pytree node (JAX's own
    answer: ``register_dataclass(cls, data_fields=..., meta_fields=...)`` names them
    without field metadata, and its meta fields were saved, a function in one
    refused, and loaded over the target's); None if JAX is not imported or ``obj`` is
    no such node (the field metadata decide)."""
    jax = _jax()
    if jax is None:
        return None
    try:
        pairs, _ = jax.tree_util.tree_flatten_with_path(obj, is_leaf=lambda x: x is not obj)
    except Exception:  # a node whose flatten fails: the walk reports it where it applies
        return None
    names = set()
    for path, _ in pairs:
        name = getattr(path[-1], "name", None) if path else None
        if type(name) is not str:
            return None  # a leaf (not registered), or keys that are no field names
        names.add(name)
    return names


DATA_FIELD_HOOKS.append(jax_data_fields)


def rebuild_pytree(like: Any, values: list[Any]) -> Any:
    """Rebuild a custom pytree node of ``like``'s type from its children."""
    jax = _jax()
    assert jax is not None
    _, treedef = jax.tree_util.tree_flatten(like, is_leaf=lambda x: x is not like)
    return jax.tree_util.tree_unflatten(treedef, values)


class JaxProvider(ArrayProvider):
    """Provider for ``jax.Array`` values and ``jax.ShapeDtypeStruct`` targets."""

    kind = "jax"
    capabilities = ProviderCapabilities(lazy_private_copy=True)

    def handles(self, obj: Any) -> bool:
        jax = _jax()
        return jax is not None and isinstance(obj, jax.Array)

    def prepare(self, obj: Any, path: KeyPath) -> PreparedArray:
        jax = _jax()
        _check_not_deleted(obj, f"at key path '{format_keypath(path)}': ")
        shards = getattr(obj, "addressable_shards", None)
        if not shards and not getattr(obj, "is_fully_addressable", True):
            # a global array on other processes' devices only: this one holds none of
            # it (they write it); reading it here would fetch from devices it cannot see
            first = prepare_host_array(np.empty((0,), dtype=np.dtype(obj.dtype)), path,
                                       self.kind)
            return PreparedArray(kind=self.kind, dtype=first.dtype,
                                 shape=tuple(int(x) for x in obj.shape),
                                 chunk=_holds_nothing, copies=False, boxes=[],
                                 distributed=True)
        if not shards or (len(shards) == 1 and jax.process_count() == 1):
            if _host_view_is_free(obj):
                # On the CPU this is a zero-copy view of the device buffer; holding the
                # reference keeps the (immutable) array alive until the save is done.
                return prepare_host_array(np.asarray(obj), path, self.kind)
            return _prepared_on_device(obj, path, self.kind)
        shape = tuple(int(x) for x in obj.shape)
        # Sharded or replicated: one host view per distinct box this process holds
        # (the lowest replica of each), never the whole gathered array.
        held: dict[tuple[tuple[int, ...], tuple[int, ...]], Any] = {}
        order = sorted(shards, key=lambda sh: sh.replica_id)
        for sh in order:
            box = _index_box(sh.index, shape)
            if box not in held and math.prod(box[1]) > 0:
                held[box] = sh
        host: dict[tuple[int, ...], np.ndarray] = {}
        # the dtype checked and named on an empty host array: reading a shard here
        # (a device-to-host copy on a GPU) only for its dtype was a second copy
        first = prepare_host_array(np.empty((0,), dtype=np.dtype(obj.dtype)), path, self.kind)
        boxes = list(held)
        by_start = {b[0]: sh for b, sh in held.items()}

        def chunk(start: tuple[int, ...], cshape: tuple[int, ...]) -> np.ndarray:
            bstart = find_box(boxes, start, cshape)
            arr = host.get(bstart)
            if arr is None:
                arr = host.setdefault(bstart, np.asarray(by_start[bstart].data))
            rel = tuple(a - b for a, b in zip(start, bstart))
            return chunk_of_host_array(arr, rel, cshape)

        return PreparedArray(
            kind=self.kind, dtype=first.dtype, shape=shape, chunk=chunk, copies=False,
            boxes=boxes, distributed=True,
        )

    def private_copy(self, obj: Any) -> Any:
        """A private device copy: a donated buffer is freed by the step that donates
        it, so a lazy snapshot reads this copy, never the original."""
        _check_not_deleted(obj)
        return obj.copy()

    def is_target(self, like: Any) -> bool:
        jax = _jax()
        return jax is not None and isinstance(like, (jax.Array, jax.ShapeDtypeStruct))

    def target_shape(self, like: Any) -> tuple[int, ...]:
        return tuple(int(s) for s in like.shape)

    def restore(self, dtype: str, shape: tuple[int, ...], like: Any, path: KeyPath,
                scalar: bool = False) -> Destination:
        import jax

        if like is not None and jax.numpy.issubdtype(like.dtype, jax.dtypes.prng_key):
            raise TargetMismatchError(
                f"the target at key path '{format_keypath(path)}' is a typed PRNG key array "
                f"({like.dtype}), the checkpoint holds a plain {dtype}{list(shape)} array: "
                "load it into a uint32 target and make keys of it with "
                "jax.random.wrap_key_data")
        sharding = getattr(like, "sharding", None) if like is not None else None
        if sharding is not None and (not _single_device(sharding)
                                     or not getattr(sharding, "is_fully_addressable", True)):
            # (one device of another process: this one holds nothing of it, reads nothing)
            return self._restore_sharded(dtype, shape, like, sharding, path)
        dest = host_destination(dtype, shape)

        def finish() -> Any:
            out = dest
            sharding = None
            # what a device_put makes of it (int64 is int32 unless jax_enable_x64)
            refuse_lossy_cast(out, _canonical(out.dtype if like is None else like.dtype),
                                dtype, path, _x64_advice(like, dtype))
            if like is not None:
                if np.dtype(like.dtype) != out.dtype:
                    try:
                        out = cast_host_array(out, like.dtype)
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

    def _restore_sharded(self, dtype: str, shape: tuple[int, ...], like: Any, sharding: Any,
                         path: KeyPath) -> Destination:
        import jax

        try:
            index_map = sharding.addressable_devices_indices_map(shape)
        except ValueError as exc:  # e.g. a dimension the mesh axis does not divide
            raise TargetMismatchError(
                f"the target sharding at key path '{format_keypath(path)}' cannot hold the "
                f"saved {dtype}{list(shape)} array: {exc}"
            ) from exc
        bufs: dict[tuple[tuple[int, ...], tuple[int, ...]], np.ndarray] = {}
        per_device = []
        for device, index in index_map.items():
            box = _index_box(index, shape)
            if box not in bufs:
                bufs[box] = host_destination(dtype, box[1])
            per_device.append((device, box))
        want = np.dtype(like.dtype)
        canonical = _canonical(want)
        # each shard in the target's memory (a host-offloaded "pinned_host" state too)
        memory_kind = getattr(sharding, "memory_kind", None)

        def finish() -> Any:
            arrays = []
            for device, box in per_device:
                host = bufs[box]
                refuse_lossy_cast(host, canonical, dtype, path, _x64_advice(like, dtype))
                if host.dtype != want:
                    host = cast_host_array(host, want)
                place = jax.sharding.SingleDeviceSharding(device, memory_kind=memory_kind)
                arrays.append(jax.device_put(host, place))
            if not arrays:  # a sharding over other processes' devices only
                return jax.make_array_from_single_device_arrays(shape, sharding, arrays,
                                                                dtype=canonical)
            return jax.make_array_from_single_device_arrays(shape, sharding, arrays)

        return Destination(boxes=[(b[0], buf) for b, buf in bufs.items()], finish=finish)


def _holds_nothing(start: tuple[int, ...], shape: tuple[int, ...]) -> np.ndarray:
    # Engine bug, not bad input: the plan gives a process only boxes it holds.
    raise ValueError(f"box {start}+{shape} is not held by this process")


def _canonical(dtype: Any) -> Any:
    """The dtype a JAX array of ``dtype`` gets (64-bit ones are 32-bit unless
    ``jax_enable_x64``)."""
    import jax

    return jax.dtypes.canonicalize_dtype(dtype)


_WIDE = frozenset({"int64", "uint64", "float64", "complex128"})


def _x64_advice(like: Any, saved: str) -> str:
    """What to do about a JAX array that cannot hold the saved values: without
    ``jax_enable_x64`` no JAX array holds 64 bits, so a wider target is no answer."""
    if _canonical(np.int64) == np.int64 or saved not in _WIDE:
        # the default: a wider target (x64 is no answer for int32 into uint32, or for
        # bfloat16 into int4: JAX holds those without it)
        return ""
    return (f"JAX makes {saved} arrays 32-bit unless jax_enable_x64 is set: set it "
            "(jax.config.update('jax_enable_x64', True)), or load the array as NumPy (a "
            "NumPy target there)")


def _host_view_is_free(obj: Any) -> bool:
    """Whether ``np.asarray(obj)`` is a view of the array's own memory (its device is
    the CPU), not a device-to-host copy."""
    try:
        return all(d.platform == "cpu" for d in obj.devices())
    except Exception:  # a tracer, or an array type without devices()
        return True


def _to_host(obj: Any) -> np.ndarray:
    return np.asarray(obj)


def _prepared_on_device(obj: Any, path: KeyPath, kind: str) -> PreparedArray:
    """A single-device array on an accelerator: its device-to-host copy starts now
    (``copy_to_host_async``) and is waited for by the first chunk read, on the
    writer or snapshot thread, so the walk (a lazy save's whole blocking phase)
    never waits for it."""
    first = prepare_host_array(np.empty((0,), dtype=np.dtype(obj.dtype)), path, kind)
    start = getattr(obj, "copy_to_host_async", None)
    if start is not None:
        start()
    host: list[np.ndarray] = []
    lock = threading.Lock()

    def chunk(at: tuple[int, ...], cshape: tuple[int, ...]) -> np.ndarray:
        with lock:
            if not host:
                host.append(_to_host(obj))
        return chunk_of_host_array(host[0], at, cshape)

    shape = tuple(int(x) for x in obj.shape)
    return PreparedArray(kind=kind, dtype=first.dtype, shape=shape, chunk=chunk, copies=False)


def _check_not_deleted(obj: Any, where: str = "") -> None:
    """Raise UnsupportedTypeError if ``obj``'s buffers are gone (JAX's own error names
    neither the key path nor the cause), or if it is a tracer (a save inside a jitted,
    grad or vmapped function: is_deleted() raised JAX's ConcretizationTypeError)."""
    tracer = getattr(getattr(_jax(), "core", None), "Tracer", None)
    if tracer is not None and isinstance(obj, tracer):
        raise UnsupportedTypeError(
            f"{where}the jax.Array ({obj.dtype}{list(obj.shape)}) is a tracer: the save "
            "runs inside a function that JAX transforms (jax.jit, grad, vmap, scan), where "
            "arrays hold no values. Save outside it, with the arrays it returns")
    deleted = getattr(obj, "is_deleted", None)
    if deleted is not None and deleted():
        raise UnsupportedTypeError(
            f"{where}the jax.Array ({obj.dtype}{list(obj.shape)}) has been deleted: "
            "its buffers were donated to a jitted step (donate_argnums) or freed with "
            ".delete(), so it holds no data. Save the state before the step that donates "
            "it (a save_async or a manager's save returns before that step may run)"
        )


def _single_device(sharding: Any) -> bool:
    try:
        return len(sharding.device_set) == 1
    except Exception:  # pragma: no cover - unusual sharding types
        # A sharding without a device set is treated as multi-device: the sharded
        # path then asks it for its index map and raises if it cannot say.
        return False


def _index_box(index: Any, shape: tuple[int, ...]
               ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(start, shape) of the box a shard's index (tuple of slices) selects."""
    start, size = [], []
    for sl, n in zip(tuple(index) + (slice(None),) * (len(shape) - len(index)), shape):
        a, b, step = sl.indices(n)
        if step != 1:
            raise TargetMismatchError(f"strided shard index {index} is not supported")
        start.append(a)
        size.append(max(0, b - a))
    return tuple(start), tuple(size)

