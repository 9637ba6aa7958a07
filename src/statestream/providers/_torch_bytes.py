"""Bytes of CPU tensors as NumPy arrays: views where they are contiguous, else copies."""

from __future__ import annotations

from typing import Any

import numpy as np

from statestream._memory import fresh_bytes

__all__ = ["byte_view", "contiguous_bytes", "copy_bytes_into", "host_bytes"]


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

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor
        self.storage = tensor.untyped_storage()
        n = tensor.numel() * tensor.element_size()
        self.__array_interface__ = {
            "data": (tensor.data_ptr(), False),
            "shape": (n,),
            "typestr": "|u1",
            "version": 3,
        }


def host_bytes(t: Any) -> np.ndarray:
    """1-D uint8 view of a contiguous, non-empty CPU tensor without calling torch ops."""
    holder = _HostMemory(t)
    out = np.asarray(holder)
    del holder.__array_interface__  # read once; the view keeps the holder alive
    return out


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
