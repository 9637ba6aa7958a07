"""PyTorch tensors (CPU; any dtype NumPy/ml_dtypes can hold, bfloat16 and float8 included).

``torch`` is imported only when a torch value is seen (``sys.modules``), so
``import statestream`` works without it.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from statestream.errors import TargetMismatchError, UnsupportedTypeError
from statestream.format import dtype_from_name
from statestream.providers._base import Destination, PreparedArray, box_slices
from statestream.tree import KeyPath, format_keypath

__all__ = ["TorchProvider"]

_NAMES = [
    "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64", "complex64", "complex128",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
]
_TO_NAME: dict[Any, str] = {}
_FROM_NAME: dict[str, Any] = {}


def _tables() -> tuple[dict[Any, str], dict[str, Any]]:
    if not _TO_NAME:
        import torch

        for n in _NAMES:
            t = getattr(torch, n, None)
            if t is not None:
                _TO_NAME[t] = n
                _FROM_NAME[n] = t
    return _TO_NAME, _FROM_NAME


def _torch() -> Any:
    return sys.modules.get("torch")


def _byte_view(t: Any) -> np.ndarray:
    """1-D uint8 NumPy view of a contiguous CPU tensor's bytes (no copy)."""
    import torch

    flat = t.reshape(-1)
    if flat.numel() == 0:
        return np.empty(0, dtype=np.uint8)
    return flat.view(torch.uint8).numpy()


class TorchProvider:
    """Provider for ``torch.Tensor`` (and ``nn.Parameter``)."""

    kind = "torch"

    def handles(self, obj: Any) -> bool:
        torch = _torch()
        return torch is not None and isinstance(obj, torch.Tensor)

    def prepare(self, obj: Any, path: KeyPath) -> PreparedArray:
        to_name, _ = _tables()
        where = format_keypath(path)
        if obj.layout != _torch().strided:
            raise UnsupportedTypeError(
                f"tensor at key path '{where}' has layout {obj.layout}; only dense (strided) "
                "tensors are supported, convert with .to_dense()"
            )
        if obj.is_quantized:
            raise UnsupportedTypeError(
                f"tensor at key path '{where}' is quantized ({obj.dtype}); save its "
                "int_repr() and quantization parameters instead"
            )
        if type(obj).__name__ == "DTensor":
            raise UnsupportedTypeError(
                f"tensor at key path '{where}' is a DTensor; distributed tensors are not "
                "supported by this statestream version"
            )
        if obj.device.type == "meta":
            raise UnsupportedTypeError(
                f"tensor at key path '{where}' lives on the meta device and holds no data"
            )
        name = to_name.get(obj.dtype)
        if name is None:
            raise UnsupportedTypeError(
                f"tensor at key path '{where}' has dtype {obj.dtype}, which statestream "
                "cannot store; cast it first"
            )
        t = obj.detach()
        if t.is_conj():
            t = t.resolve_conj()
        if t.is_neg():
            t = t.resolve_neg()
        copies = not t.is_contiguous() or t.device.type != "cpu"

        def chunk(start: tuple[int, ...], shape: tuple[int, ...]) -> np.ndarray:
            part = t[box_slices(start, shape)] if t.dim() else t
            if part.device.type != "cpu":
                part = part.to("cpu")
            return _byte_view(part.contiguous())

        return PreparedArray(
            kind=self.kind, dtype=name, shape=tuple(int(s) for s in t.shape), chunk=chunk,
            copies=copies,
        )

    def is_target(self, like: Any) -> bool:
        return self.handles(like)

    def target_shape(self, like: Any) -> tuple[int, ...]:
        return tuple(int(s) for s in like.shape)

    def restore(self, dtype: str, shape: tuple[int, ...], like: Any, path: KeyPath) -> Destination:
        import torch

        _, from_name = _tables()
        saved = from_name.get(dtype)
        if saved is None:
            raise TargetMismatchError(
                f"array at key path '{format_keypath(path)}' was saved as {dtype}, which torch "
                "has no dtype for; load it as NumPy (target=None) instead"
            )
        buf = torch.empty(shape, dtype=saved)
        np_view = _byte_view(buf).view(dtype_from_name(dtype)).reshape(shape)

        def finish() -> Any:
            out = buf
            if like is not None:
                if like.dtype != out.dtype or like.device != out.device:
                    out = out.to(device=like.device, dtype=like.dtype)
                if isinstance(like, torch.nn.Parameter):
                    out = torch.nn.Parameter(out, requires_grad=like.requires_grad)
            return out

        return Destination(boxes=[((0,) * len(shape), np_view)], finish=finish)
