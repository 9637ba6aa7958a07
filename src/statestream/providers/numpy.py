"""NumPy arrays and scalars (including ml_dtypes bfloat16 / float8)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from statestream.errors import TargetMismatchError, UnsupportedTypeError
from statestream.format import dtype_from_name, dtype_name
from statestream.providers._base import (
    ArrayProvider,
    Destination,
    PreparedArray,
    ProviderCapabilities,
    chunk_of_host_array,
    row_block_chunker,
)
from statestream.tree import KeyPath, format_keypath

__all__ = ["NumpyProvider", "host_destination", "prepare_host_array"]


def prepare_host_array(arr: np.ndarray, path: KeyPath, kind: str,
                       attrs: dict[str, Any] | None = None) -> PreparedArray:
    """Prepare a host NumPy array (any layout, any byte order) for writing."""
    name = dtype_name(arr.dtype)
    if name is None:
        raise UnsupportedTypeError(
            f"array at key path '{format_keypath(path)}' has dtype {arr.dtype}, which "
            "statestream cannot store; cast it to a numeric dtype"
        )
    copies = not arr.flags.c_contiguous or arr.dtype.byteorder == ">"
    shape = tuple(int(s) for s in arr.shape)

    def general(start: tuple[int, ...], cshape: tuple[int, ...]) -> np.ndarray:
        return chunk_of_host_array(arr, start, cshape)

    chunk: Callable[[tuple[int, ...], tuple[int, ...]], np.ndarray] = general
    if not copies and arr.size:
        flat = arr.reshape(-1).view(np.uint8)
        chunk = row_block_chunker(flat, shape, arr.dtype.itemsize, general)
    return PreparedArray(
        kind=kind, dtype=name, shape=shape, chunk=chunk, copies=copies, attrs=attrs
    )


def host_destination(dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """A fresh host array to read a saved array into."""
    return np.empty(shape, dtype=dtype_from_name(dtype))


class NumpyProvider(ArrayProvider):
    """Provider for ``numpy.ndarray`` and NumPy scalars."""

    kind = "numpy"
    capabilities = ProviderCapabilities(in_place_restore=True, buffer_restore=True)

    def handles(self, obj: Any) -> bool:
        return isinstance(obj, (np.ndarray, np.generic))

    def prepare(self, obj: Any, path: KeyPath) -> PreparedArray:
        if isinstance(obj, np.generic):
            return prepare_host_array(np.asarray(obj), path, self.kind, {"scalar": True})
        if obj.dtype.hasobject or obj.dtype.fields is not None:
            raise UnsupportedTypeError(
                f"array at key path '{format_keypath(path)}' has dtype {obj.dtype}; object "
                "and structured arrays are not supported (pickle it via pickle_paths)"
            )
        return prepare_host_array(obj, path, self.kind)

    def is_target(self, like: Any) -> bool:
        return isinstance(like, (np.ndarray, np.generic))

    def target_shape(self, like: Any) -> tuple[int, ...]:
        return tuple(int(s) for s in np.shape(like))

    def restore_into(self, dtype: str, shape: tuple[int, ...], like: Any,
                     path: KeyPath) -> Destination | None:
        """Destinations in ``like``'s own memory (None when that is not possible)."""
        if (
            not isinstance(like, np.ndarray)
            or like.dtype != dtype_from_name(dtype)
            or not like.flags.c_contiguous
            or not like.flags.writeable
            or like.size == 0
        ):
            return None
        return Destination(boxes=[((0,) * len(shape), like)], finish=lambda: like)

    def restore_flat(self, dtype: str, shape: tuple[int, ...], nbytes: int, like: Any,
                     in_place: bool) -> tuple[np.ndarray, Any] | None:
        dt = dtype_from_name(dtype)
        if like is not None:
            if type(like) is not np.ndarray or like.dtype != dt:
                return None  # a cast, a scalar or a subclass: the general path
            if in_place:
                if not (like.flags.c_contiguous and like.flags.writeable):
                    return None
                return like.reshape(-1).view(np.uint8), like
        flat = np.empty(nbytes, dtype=np.uint8)
        return flat, flat.view(dt).reshape(shape)

    def restore(self, dtype: str, shape: tuple[int, ...], like: Any, path: KeyPath,
                scalar: bool = False) -> Destination:
        return self._restore(host_destination(dtype, shape), dtype, like, path, scalar)

    def restore_on(self, dtype: str, shape: tuple[int, ...], like: Any, path: KeyPath,
                   buffer: memoryview, scalar: bool = False) -> Destination | None:
        dest = np.frombuffer(buffer, dtype=dtype_from_name(dtype)).reshape(shape)
        return self._restore(dest, dtype, like, path, scalar)

    def _restore(self, dest: np.ndarray, dtype: str, like: Any, path: KeyPath,
                 scalar: bool) -> Destination:
        shape = dest.shape
        want = None if like is None else np.asarray(like).dtype
        if like is not None and isinstance(like, np.generic):
            scalar = True

        def finish() -> Any:
            out = dest
            if want is not None and want != out.dtype:
                try:
                    out = out.astype(want)
                except (TypeError, ValueError) as exc:
                    raise TargetMismatchError(
                        f"cannot cast saved {dtype} array at key path '{format_keypath(path)}' "
                        f"to the target's dtype {want}: {exc}"
                    ) from exc
            return out[()] if scalar else out

        return Destination(boxes=[((0,) * len(shape), dest)], finish=finish)
