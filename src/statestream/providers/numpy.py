"""NumPy arrays and scalars (including ml_dtypes bfloat16 / float8)."""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np

from statestream._memory import MAP_MIN_BYTES, fresh_bytes
from statestream.errors import TargetMismatchError, UnsupportedTypeError
from statestream.format import dtype_from_name, dtype_name
from statestream.providers._base import (
    ArrayProvider,
    Destination,
    PreparedArray,
    ProviderCapabilities,
    cast_host_array,
    chunk_of_host_array,
    copy_box_of_host_array,
    refuse_lossy_cast,
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
    if not copies and arr.size:
        return _prepared_in_place(arr, name, shape, kind, attrs)
    return PreparedArray(kind=kind, dtype=name, shape=shape,
                         chunk=functools.partial(chunk_of_host_array, arr), copies=copies,
                         attrs=attrs,
                         copy_into=functools.partial(copy_box_of_host_array, arr) if copies
                         else None)


def _prepared_in_place(arr: np.ndarray, name: str, shape: tuple[int, ...], kind: str,
                       attrs: dict[str, Any] | None = None) -> PreparedArray:
    """A non-empty, C-contiguous, little-endian array: row blocks are slices of its bytes."""
    return PreparedArray(
        kind=kind, dtype=name, shape=shape, copies=False, attrs=attrs,
        chunk=row_block_chunker(arr.reshape(-1).view(np.uint8), shape, arr.dtype.itemsize,
                                functools.partial(chunk_of_host_array, arr)),
    )


#: typed for any buffer exporter (numpy's stubs declare no ``__buffer__`` before 3.12)
_byte_at: Callable[[Any], ctypes.c_byte] = ctypes.c_byte.from_buffer


def _address(arr: np.ndarray, contiguous: bool) -> int:
    """The address of ``arr``'s first element. The writable buffer of a C-contiguous
    array that has no base starts there, and ctypes reads it in a fifth of the time
    ``__array_interface__`` takes (0.2 vs 1 us, once per array of a save). Only
    without a base: asking a view of ``np.broadcast_arrays`` whether it is writable,
    or for a writable buffer, warns."""
    if contiguous and arr.base is None:
        try:
            return ctypes.addressof(_byte_at(arr))
        except (TypeError, ValueError, BufferError):  # read-only after all
            pass
    address: int = arr.__array_interface__["data"][0]
    return address


def host_destination(dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """A fresh host array to read a saved array into."""
    dt = dtype_from_name(dtype)
    nbytes = math.prod(shape) * dt.itemsize
    if nbytes < MAP_MIN_BYTES:  # one object, not three (a load of 1M small arrays)
        return np.empty(shape, dtype=dt)
    return fresh_bytes(nbytes).view(dt).reshape(shape)


class _Same:
    """``finish`` of a value that is its destination as read: ~50 bytes, where a
    closure over the casting path's five variables took ~320 (per array of a load)."""

    __slots__ = ("value",)

    def __init__(self, value: np.ndarray) -> None:
        self.value = value

    def __call__(self) -> np.ndarray:
        return self.value


class NumpyProvider(ArrayProvider):
    """Provider for ``numpy.ndarray`` and NumPy scalars."""

    kind = "numpy"
    capabilities = ProviderCapabilities(in_place_restore=True, buffer_restore=True,
                                        aliases=True)

    def handles(self, obj: Any) -> bool:
        return isinstance(obj, (np.ndarray, np.generic))

    def prepare(self, obj: Any, path: KeyPath) -> PreparedArray:
        if isinstance(obj, np.generic):
            return prepare_host_array(np.asarray(obj), path, self.kind, {"scalar": True})
        if isinstance(obj, np.ma.MaskedArray):  # its data alone: the mask would be lost
            raise UnsupportedTypeError(
                f"array at key path '{format_keypath(path)}' is a masked array; statestream "
                "stores no mask: save its .data and np.ma.getmaskarray(...) as two arrays "
                "(or .filled(...))")
        if obj.dtype.hasobject or obj.dtype.fields is not None:
            raise UnsupportedTypeError(
                f"array at key path '{format_keypath(path)}' has dtype {obj.dtype}; object "
                "and structured arrays are not supported (pickle it via pickle_paths)"
            )
        if type(obj) is not np.ndarray:  # np.matrix, np.memmap, ...: the same memory
            # as a plain ndarray; a matrix stays 2-D when reshaped or indexed, which
            # the chunking of its rows does not expect
            obj = obj.view(np.ndarray)
        return prepare_host_array(obj, path, self.kind)

    def alias_and_prepare(self, obj: Any,
                          path: KeyPath) -> tuple[Hashable | None, PreparedArray]:
        """The common case (a plain, non-empty, C-contiguous, little-endian ndarray of a
        dtype statestream stores) with its type, dtype, shape and layout read once."""
        if type(obj) is np.ndarray and obj.size and obj.flags.c_contiguous:
            dt = obj.dtype
            name = dtype_name(dt) if dt.byteorder != ">" else None
            if name is not None:  # else refused or big-endian: prepare decides
                shape = obj.shape
                key = (_address(obj, True), shape, obj.strides, dt)
                return key, _prepared_in_place(obj, name, shape, self.kind)
        return self.alias_key(obj), self.prepare(obj, path)

    def alias_key(self, obj: Any) -> Hashable | None:
        """Plain ndarrays over the same memory with the same shape, strides and dtype
        (one array under two keys, or a view of all of it): stored once. None for empty
        arrays, for ndarray subclasses (``np.memmap``: stored under each key, as
        before; masked arrays are refused) and for NumPy scalars (immutable values
        that load as scalars, which an alias leaf does not record)."""
        if type(obj) is not np.ndarray or not obj.size:
            return None
        return (_address(obj, obj.flags.c_contiguous), obj.shape, obj.strides, obj.dtype)

    def is_target(self, like: Any) -> bool:
        return isinstance(like, (np.ndarray, np.generic))

    def target_shape(self, like: Any) -> tuple[int, ...]:
        return tuple(int(s) for s in np.shape(like))

    def restore_into(self, dtype: str, shape: tuple[int, ...], like: Any,
                     path: KeyPath) -> Destination | None:
        """Destinations in ``like``'s own memory (None when that is not possible)."""
        if not isinstance(like, np.ndarray) or like.dtype != dtype_from_name(dtype):
            return None
        if like.size == 0:
            return Destination(boxes=[], finish=lambda: like)  # nothing to fill: itself
        if not like.flags.c_contiguous or not like.flags.writeable:
            return None
        return Destination(boxes=[((0,) * len(shape), like)], finish=lambda: like)

    def assign(self, like: Any, value: Any) -> Any | None:
        """Copy ``value`` into a writable ndarray target (non-contiguous, another dtype:
        :meth:`_restore` cast and checked the values already)."""
        if not isinstance(like, np.ndarray) or not like.flags.writeable:
            return None
        np.copyto(like, value, casting="unsafe")
        return like

    def cast_fill(self, dtype: str, shape: tuple[int, ...], like: Any, path: KeyPath,
                  ) -> tuple[Callable[[np.ndarray], None],
                             Callable[[tuple[slice, ...], np.ndarray], None]] | None:
        """For an in-place load into a writable ndarray of another dtype, read in
        pieces (api/_castfill.py): (check a piece as :meth:`_restore` checks the whole
        array, cast a piece into its box of ``like``); None where NumPy cannot cast
        the saved dtype to ``like``'s (the general path says so)."""
        saved = dtype_from_name(dtype)
        if (type(like) is not np.ndarray or not like.flags.writeable or like.dtype == saved
                or tuple(like.shape) != shape):
            return None
        want = like.dtype
        real = saved.kind == "c" and want.kind != "c"
        probe = np.zeros(1, dtype=saved)
        try:  # (ml_dtypes casts some pairs of its dtypes only through float32)
            np.copyto(np.empty(1, dtype=want), probe.real if real else probe, casting="unsafe")
        except (TypeError, ValueError):
            return None

        def check(piece: np.ndarray) -> None:
            refuse_lossy_cast(piece, want, dtype, path)

        def write(box: tuple[slice, ...], piece: np.ndarray) -> None:
            np.copyto(like[box], piece.real if real else piece, casting="unsafe")

        return check, write

    def restore_flat(self, dtype: str, shape: tuple[int, ...], nbytes: int, like: Any,
                     in_place: bool, memory: np.ndarray | None = None,
                     ) -> tuple[np.ndarray, Any] | None:
        dt = dtype_from_name(dtype)
        if like is not None:
            if type(like) is not np.ndarray or like.dtype != dt:
                return None  # a cast, a scalar or a subclass: the general path
            if in_place:
                if not (like.flags.c_contiguous and like.flags.writeable):
                    return None
                return like.reshape(-1).view(np.uint8), like
        flat = fresh_bytes(nbytes) if memory is None else memory
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
        if not scalar and (want is None or want == dest.dtype):
            return Destination(boxes=[((0,) * len(shape), dest)], finish=_Same(dest))

        def finish() -> Any:
            out = dest
            if want is not None and want != out.dtype:
                refuse_lossy_cast(out, want, dtype, path)
                if out.dtype.kind == "c" and want.kind != "c":
                    out = out.real  # (no imaginary part, checked: no ComplexWarning)
                try:
                    out = cast_host_array(out, want)
                except (TypeError, ValueError) as exc:
                    raise TargetMismatchError(
                        f"cannot cast saved {dtype} array at key path '{format_keypath(path)}' "
                        f"to the target's dtype {want}: {exc}"
                    ) from exc
            return out[()] if scalar else out

        return Destination(boxes=[((0,) * len(shape), dest)], finish=finish)
