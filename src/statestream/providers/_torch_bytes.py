"""Bytes of CPU tensors as NumPy arrays: views where they are contiguous, else copies."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from statestream._memory import fresh_bytes

__all__ = ["TensorRows", "byte_view", "contiguous_bytes", "copy_bytes_into", "host_bytes"]


def byte_view(t: Any) -> np.ndarray:
    """1-D uint8 NumPy view of a contiguous CPU tensor's bytes (no copy)."""
    import torch

    flat = t.reshape(-1)
    if flat.numel() == 0:
        return np.empty(0, dtype=np.uint8)
    if flat.stride(0) != 1:  # one element with an odd stride still counts as contiguous
        flat = flat.as_strided((1,), (1,))
    out: np.ndarray = flat.view(torch.uint8).numpy()
    return out


class _HostMemory:
    """Exposes a CPU tensor's bytes to NumPy and keeps its memory alive: the storage,
    not only the tensor, since ``p.data = other`` (or ``module.double()``) gives the
    same tensor object other memory and frees the old, which a lazy snapshot may not
    have read yet (it read freed memory: a crash, or bytes never in the state)."""

    __slots__ = ("__array_interface__", "storage", "tensor")

    def __init__(self, tensor: Any, storage: Any, ptr: int, nbytes: int) -> None:
        self.tensor = tensor
        self.storage = storage
        self.__array_interface__ = {
            "data": (ptr, False),
            "shape": (nbytes,),
            "typestr": "|u1",
            "version": 3,
        }


def _view(tensor: Any, storage: Any, ptr: int, nbytes: int) -> np.ndarray:
    holder = _HostMemory(tensor, storage, ptr, nbytes)
    out = np.asarray(holder)
    del holder.__array_interface__  # read once; the view keeps the holder alive
    return out


def host_bytes(t: Any) -> np.ndarray:
    """1-D uint8 view of a contiguous, non-empty CPU tensor without calling torch ops."""
    return _view(t, t.untyped_storage(), t.data_ptr(), t.numel() * t.element_size())


class TensorRows:
    """Chunk reader over a contiguous, non-empty CPU tensor's bytes (as
    ``row_block_chunker`` over :func:`host_bytes`), whose NumPy view is made when
    its first chunk is read, by the thread that reads it.

    The walk records only where the bytes are and keeps their storage alive (see
    :class:`_HostMemory`): making the view took 1.8 us of the ~12 us a small
    tensor costs the walk, which is all a lazy save blocks for. Two threads
    reading chunks of one array at once may each make a view; both are right.
    """

    __slots__ = ("tensor", "storage", "ptr", "nbytes", "shape", "row_bytes", "flat",
                 "fallback")

    def __init__(self, tensor: Any, ptr: int, shape: tuple[int, ...], itemsize: int,
                 fallback: Callable[[Any, tuple[int, ...], tuple[int, ...]], np.ndarray]
                 ) -> None:
        self.tensor = tensor
        self.storage = tensor.untyped_storage()
        self.ptr = ptr  # tensor.data_ptr(), which the caller read already
        self.row_bytes = row = math.prod(shape[1:]) * itemsize
        self.nbytes = shape[0] * row if shape else itemsize
        self.shape = shape
        self.flat: np.ndarray | None = None
        self.fallback = fallback

    def __call__(self, start: tuple[int, ...], cshape: tuple[int, ...]) -> np.ndarray:
        flat = self.flat
        if flat is None:
            flat = self.flat = _view(self.tensor, self.storage, self.ptr, self.nbytes)
        shape = self.shape
        if not shape:
            return flat
        if cshape[1:] == shape[1:]:
            a = start[0] * self.row_bytes
            return flat[a : a + cshape[0] * self.row_bytes]
        return self.fallback(self.tensor, start, cshape)


def contiguous_bytes(part: Any) -> np.ndarray:
    """The bytes of the CPU tensor ``part`` in C order: a view when it is contiguous,
    else a copy into memory NumPy allocates.

    Not ``part.contiguous()``: the writer threads' copies, freed as soon as they are
    written, stayed in the C library's per-thread heaps when torch allocated them
    (a transposed 512 MiB tensor saved under a 32 MiB budget peaked at +358 MiB;
    NumPy's copies of a transposed NumPy array: +64).
    """
    if part.is_contiguous():
        return byte_view(part)
    out = fresh_bytes(part.numel() * part.element_size())
    copy_bytes_into(part, out)
    return out


def copy_bytes_into(part: Any, out: np.ndarray) -> None:
    """Write what :func:`contiguous_bytes` returns for the CPU tensor ``part`` into
    ``out`` (1-D uint8 of its size), with no copy between."""
    import torch

    if out.size:
        torch.from_numpy(out).view(part.dtype).view(part.shape).copy_(part)
