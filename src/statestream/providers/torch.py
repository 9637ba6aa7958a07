"""PyTorch tensors (CPU; any dtype NumPy/ml_dtypes can hold, bfloat16 and float8 included).

``torch`` is imported only when a torch value is seen (``sys.modules``), so
``import statestream`` works without it.
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np

from statestream._memory import fresh_bytes
from statestream.errors import TargetMismatchError, UnsupportedTypeError
from statestream.format import dtype_from_name
from statestream.providers import _torch_guards as _guards
from statestream.providers import _torch_targets
from statestream.providers._base import (
    ArrayProvider,
    Destination,
    PreparedArray,
    ProviderCapabilities,
    SnapshotWaiter,
    box_slices,
    row_block_chunker,
)
from statestream.providers._dtensor import (
    DTensorLayout,
    dtensor_layout,
    refuse_local_mismatch,
    strided_split,
)
from statestream.providers._dtensor import is_dtensor as _is_dtensor
from statestream.providers._torch_bytes import (
    TensorRows,
    byte_view,
    contiguous_bytes,
    copy_bytes_into,
    host_bytes,
)
from statestream.providers._torch_device import device_staging
from statestream.tree import KeyPath, Node, format_keypath

__all__ = ["TorchProvider"]

_NAMES = [
    "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64", "complex64", "complex128",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
]
#: dtypes torch.from_numpy accepts as they are (no reinterpreting view needed)
_NUMPY_NATIVE = frozenset({
    "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "complex64", "complex128",
})
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


def _slow_chunk(t: Any, start: tuple[int, ...], cshape: tuple[int, ...]) -> np.ndarray:
    part = t.detach()[box_slices(start, cshape)] if t.dim() else t.detach()
    return contiguous_bytes(part)


class TorchProvider(ArrayProvider):
    """Provider for ``torch.Tensor`` (and ``nn.Parameter``, DTensor, CUDA tensors)."""

    kind = "torch"
    capabilities = ProviderCapabilities(
        in_place_restore=True, mutable_values=True, pinned_memory=True, step_guards=True,
        state_hints=True, aliases=True, buffer_restore=True,
    )

    def handles(self, obj: Any) -> bool:
        torch = _torch()
        return torch is not None and isinstance(obj, torch.Tensor)

    def prepare(self, obj: Any, path: KeyPath) -> PreparedArray:
        to_name, _ = _tables()
        torch = _torch()
        if (
            (type(obj) is torch.Tensor or type(obj) is torch.nn.Parameter)
            and obj.layout == torch.strided
            and obj.device.type == "cpu"
            and not obj.is_quantized
            and not obj.is_nested  # a nested tensor may be strided too
        ):
            name = to_name.get(obj.dtype)
            if name is not None:
                return self._prepare_dense(obj, name)
        where = format_keypath(path)
        if obj.layout != torch.strided or obj.is_nested:
            raise UnsupportedTypeError(
                f"tensor at key path '{where}' " + (
                    f"is a nested tensor ({obj.layout} layout); only dense tensors are "
                    "supported, save its parts (.unbind()) or .to_padded_tensor(0)"
                    if obj.is_nested else f"has layout {obj.layout}; only dense (strided) "
                    "tensors are supported, convert with .to_dense()"))
        if obj.is_quantized:
            raise UnsupportedTypeError(
                f"tensor at key path '{where}' is quantized ({obj.dtype}); save its "
                "int_repr() and quantization parameters instead"
            )
        if _is_dtensor(obj):
            return self._prepare_dtensor(obj, path)
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
        return self._prepare_dense(obj, name)

    def _prepare_dense(self, obj: Any, name: str) -> PreparedArray:
        if (
            obj.device.type == "cpu"
            and obj.is_contiguous()
            # conj/neg bits live only on views; is_conj() is itself a torch op
            and (obj._base is None or not (obj.is_conj() or obj.is_neg()))
            and obj.numel()
        ):
            # Fast path, no torch op: torch ops release the GIL, and on a busy
            # process each one can wait a whole switch interval to get it back
            # while writer threads run; 20,000 small tensors paid seconds for that.
            shape = tuple(obj.shape)
            return PreparedArray(
                kind=self.kind, dtype=name, shape=shape, copies=False,
                chunk=TensorRows(obj, obj.data_ptr(), shape, obj.element_size(), _slow_chunk),
            )
        t = obj.detach()
        if t.is_conj():
            t = t.resolve_conj()
        if t.is_neg():
            t = t.resolve_neg()
        copies = not t.is_contiguous() or t.device.type != "cpu"
        shape = tuple(int(s) for s in t.shape)

        def general(start: tuple[int, ...], cshape: tuple[int, ...]) -> np.ndarray:
            part = t[box_slices(start, cshape)] if t.dim() else t
            if part.device.type != "cpu":
                part = part.to("cpu")
            return contiguous_bytes(part)

        def into(start: tuple[int, ...], cshape: tuple[int, ...], out: np.ndarray) -> None:
            copy_bytes_into(t[box_slices(start, cshape)] if t.dim() else t, out)

        chunk: Callable[[tuple[int, ...], tuple[int, ...]], np.ndarray] = general
        if not copies and t.numel():
            chunk = row_block_chunker(byte_view(t), shape, t.element_size(), general)
        return PreparedArray(kind=self.kind, dtype=name, shape=shape, chunk=chunk, copies=copies,
                             copy_into=into if copies and t.device.type == "cpu" else None,
                             **device_staging(t, _same_start))

    def _prepare_dtensor(self, obj: Any, path: KeyPath) -> PreparedArray:
        to_name, _ = _tables()
        where = format_keypath(path)
        layout = _layout(obj, f"DTensor at key path '{where}'")
        name = to_name.get(obj.dtype)
        if name is None:
            raise UnsupportedTypeError(
                f"DTensor at key path '{where}' has dtype {obj.dtype}, which statestream "
                "cannot store"
            )
        lshape = layout.local_shape
        local = obj.to_local().detach()
        refuse_local_mismatch(local, layout, obj, where)
        if tuple(local.shape) != lshape:  # padded local shards: keep the real part
            local = local[tuple(slice(0, n) for n in lshape)]
        shape = tuple(int(x) for x in obj.shape)

        def chunk(start: tuple[int, ...], cshape: tuple[int, ...]) -> np.ndarray:
            rel = layout.local_start(start, cshape)
            part = local[box_slices(rel, cshape)] if local.dim() else local
            if part.device.type != "cpu":
                part = part.to("cpu")
            return contiguous_bytes(part)

        return PreparedArray(
            kind=self.kind, dtype=name, shape=shape, chunk=chunk,
            copies=not local.is_contiguous() or local.device.type != "cpu",
            boxes=layout.held(), distributed=True, attrs={"dtensor": True},
            **device_staging(local, layout.local_start),
        )

    def is_target(self, like: Any) -> bool:
        return self.handles(like)

    def target_shape(self, like: Any) -> tuple[int, ...]:
        _torch_targets.refuse_layout(like)  # (every load into a tensor asks its shape first)
        try:
            return tuple(like.shape)  # a torch.Size holds ints
        except RuntimeError as exc:  # a nested tensor's parts differ in shape
            raise _torch_targets.nested_shape_error(like, exc) from None

    def restore(self, dtype: str, shape: tuple[int, ...], like: Any, path: KeyPath,
                scalar: bool = False) -> Destination:
        if like is not None and _is_dtensor(like):
            return self._restore_dtensor(dtype, shape, like, path)

        _, from_name = _tables()
        saved = from_name.get(dtype)
        if saved is None:
            raise TargetMismatchError(
                f"array at key path '{format_keypath(path)}' was saved as {dtype}, which torch "
                "has no dtype for; load it as NumPy (target=None) instead"
            )
        # Plain anonymous pages (statestream._memory says why); the tensor shares them.
        nbytes = math.prod(shape) * dtype_from_name(dtype).itemsize
        return self._restore_host(fresh_bytes(nbytes) if nbytes else None, dtype, shape, like,
                                  path)

    def restore_flat(self, dtype: str, shape: tuple[int, ...], nbytes: int, like: Any,
                     in_place: bool, memory: np.ndarray | None = None,
                     ) -> tuple[np.ndarray, Any] | None:
        """A plain CPU tensor of the saved dtype: the target's own bytes (in place), a
        tensor on ``memory`` (a mapping of the file bytes) or a fresh tensor on NumPy
        memory, as :meth:`restore` makes it."""
        saved = _tables()[1].get(dtype)
        if saved is None:
            return None
        if like is not None:
            if type(like) not in _PLAIN_TENSORS or like.dtype != saved or not like.is_cpu:
                return None
            if in_place:
                if (like.layout != _torch().strided or not like.is_contiguous()
                        or like.is_conj() or like.is_neg()):
                    return None
                return host_bytes(like), like
            if type(like) is not _torch().Tensor or like.requires_grad:
                return None  # a Parameter or a leaf that needs grad: restore() makes it
        flat = fresh_bytes(nbytes) if memory is None else memory
        if dtype in _NUMPY_NATIVE:
            return flat, _torch().from_numpy(flat.view(dtype_from_name(dtype)).reshape(shape))
        return flat, _torch().from_numpy(flat).view(saved).reshape(shape)

    def restore_on(self, dtype: str, shape: tuple[int, ...], like: Any, path: KeyPath,
                   buffer: memoryview, scalar: bool = False) -> Destination | None:
        if (like is not None and _is_dtensor(like)) or not len(buffer):
            return None
        _, from_name = _tables()
        if from_name.get(dtype) is None:
            return None  # restore() words the error
        return self._restore_host(np.frombuffer(buffer, dtype=np.uint8), dtype, shape, like,
                                  path)

    def _restore_host(self, raw: np.ndarray | None, dtype: str, shape: tuple[int, ...],
                      like: Any, path: KeyPath) -> Destination:
        """A CPU tensor on ``raw`` (the array's bytes; None when it has none), cast to
        ``like`` (a quantized target, or one of no numeric dtype, is refused)."""
        import torch

        saved = _tables()[1][dtype]
        np_dtype = dtype_from_name(dtype)
        if raw is not None:
            np_view = raw.view(np_dtype).reshape(shape)
            if dtype in _NUMPY_NATIVE:
                buf = torch.from_numpy(np_view)
            else:
                buf = torch.from_numpy(raw).view(saved).reshape(shape)
        else:
            buf = torch.empty(shape, dtype=saved)
            np_view = np.empty(shape, dtype=np_dtype)

        if like is None or (type(like) is torch.Tensor and like.dtype == saved
                            and like.device.type == "cpu" and not like.requires_grad):
            finish: Callable[[], Any] = functools.partial(_same, buf)  # most targets
        else:
            _torch_targets.refuse_target(like, dtype, path, like.dtype in _tables()[0])
            finish = functools.partial(_torch_targets.like_target, buf, like, np_view, dtype, path)
        return Destination(boxes=[((0,) * len(shape), np_view)], finish=finish)

    def restore_into(self, dtype: str, shape: tuple[int, ...], like: Any,
                     path: KeyPath) -> Destination | None:
        """Destinations in ``like``'s own memory (None when that is not possible)."""
        local = like
        layout: DTensorLayout | None = None
        if _is_dtensor(like):  # (a local tensor of another shape is refused first)
            layout = _layout(like, f"target DTensor at key path '{format_keypath(path)}'")
            local = _torch_targets.held_local(like, like.to_local(), layout.local_shape, path)
        saved = _tables()[1].get(dtype)
        if saved is None or like.dtype != saved:
            return None
        if local.device.type == "cpu" and local.numel() == 0:
            return Destination(boxes=[], finish=lambda: like)  # nothing to fill: itself
        if (local.device.type != "cpu" or local.layout != _torch().strided
                or not local.is_contiguous()):  # (a sparse CSR tensor has no is_contiguous)
            return None
        if getattr(local, "is_conj", lambda: False)() or local.is_neg():
            return None
        view = host_bytes(local).view(dtype_from_name(dtype)).reshape(tuple(local.shape))
        boxes = [((0,) * len(shape), view)] if layout is None else _layout_views(layout, view)
        return Destination(boxes=boxes, finish=lambda: like)

    def assign(self, like: Any, value: Any) -> Any | None:
        """``like.copy_(value)`` (DTensors: their local shards) for a target the load
        could not fill directly: non-contiguous, a negative or conjugate view, another
        dtype, a GPU tensor. None for what ``copy_`` cannot write: a meta, sparse,
        quantized or nested tensor, an inference tensor, overlapping memory."""
        torch = _torch()
        if (not isinstance(like, torch.Tensor) or not isinstance(value, torch.Tensor)
                or _is_dtensor(like) != _is_dtensor(value)):
            return None
        dst, src = (like.to_local(), value.to_local()) if _is_dtensor(like) else (like, value)
        if _is_dtensor(like) and dst.shape != src.shape:  # a padded shard: its real part
            dst = _torch_targets.held_local(like, dst, tuple(src.shape), ())
        if (dst.device.type == "meta" or dst.layout != torch.strided or dst.is_quantized
                or dst.is_nested or dst.shape != src.shape):
            return None
        self.before_fill([like])  # bumped before the write too, as the direct fills are
        try:
            with torch.no_grad():
                dst.copy_(src)
        except RuntimeError:  # an inference tensor, overlapping memory: a new value
            return None
        return like

    def cast_fill(self, dtype: str, shape: tuple[int, ...], like: Any, path: KeyPath) -> Any:
        """A CPU tensor target of another dtype, cast into in pieces (in place)."""
        saved = _tables()[1].get(dtype)
        if saved is None or type(like) not in _PLAIN_TENSORS or tuple(like.shape) != shape:
            return None
        return _torch_targets.cast_fill(like, saved, dtype, path)

    def before_fill(self, targets: list[Any]) -> None:
        """Bump the version counter of every tensor (and DTensor's local shard) the load
        writes in place, as ``t.copy_()`` would: it writes their bytes through a
        pointer, which torch does not see. Autograd then refuses a graph that saved
        the old values, and a lazy snapshot whose copy of one lands after this fails
        as torn (docs/async.md). Before the writes, not after: a copy that overlaps
        them lands after the bump and sees it."""
        tensors = targets + [t.to_local() for t in targets if _is_dtensor(t)]
        increment = _torch().autograd.graph.increment_version
        try:
            increment(tensors)  # one call (newer torch takes many tensors)
        except (TypeError, RuntimeError):
            for t in tensors:  # one by one: older torch takes one tensor
                with contextlib.suppress(RuntimeError):  # an inference tensor: no counter
                    increment(t)

    def _restore_dtensor(self, dtype: str, shape: tuple[int, ...], like: Any,
                         path: KeyPath) -> Destination:
        import torch
        from torch.distributed.tensor import DTensor

        layout = _layout(like, f"target DTensor at key path '{format_keypath(path)}'")
        inner = self.restore(dtype, layout.local_shape, None, path)
        like_local = like.to_local()

        # a target on the meta device gives the layout only: the shard is put on its
        # mesh's device (never left on meta, which would drop the loaded values)
        device = (_mesh_device(like.device_mesh) if like_local.device.type == "meta"
                  else like_local.device)

        def finish() -> Any:
            local = inner.finish()
            _torch_targets.refuse_lossy_casts(inner.boxes, str(like.dtype), dtype, path)
            if local.dtype != like.dtype or local.device != device:
                local = local.to(device=device, dtype=like.dtype)
            out: Any = DTensor.from_local(local, like.device_mesh, like.placements,
                                          run_check=False, shape=like.shape, stride=like.stride())
            if isinstance(like, torch.nn.Parameter):
                out = torch.nn.Parameter(out, requires_grad=like.requires_grad)
            return out

        return Destination(boxes=_layout_views(layout, inner.boxes[0][1]), finish=finish)


    # -- capabilities used by saves ---------------------------------------------------
    def alias_and_prepare(self, obj: Any,
                          path: KeyPath) -> tuple[Hashable | None, PreparedArray]:
        """The common case (a plain, dense, contiguous CPU tensor that is no view)
        with each property read once: a 20,000-tensor walk spent a third of its
        time asking torch the same questions twice."""
        if type(obj) in _PLAIN_TENSORS:
            torch = _torch()
            dev = obj.device
            if (obj.layout == torch.strided and dev.type == "cpu" and obj._base is None
                    and not obj.is_quantized and not obj.is_nested and obj.is_contiguous()):
                name = _tables()[0].get(obj.dtype)
                n = obj.numel()
                if name is not None and n:
                    shape = tuple(obj.shape)
                    ptr = obj.data_ptr()
                    key = (ptr, shape, obj.stride(), obj.dtype, dev, None)
                    return key, PreparedArray(
                        kind=self.kind, dtype=name, shape=shape, copies=False,
                        chunk=TensorRows(obj, ptr, shape, obj.element_size(), _slow_chunk))
        return self.alias_key(obj), self.prepare(obj, path)

    def alias_key(self, obj: Any) -> Hashable | None:
        """Tensors (or DTensors' local shards) over the same memory with the same
        offset, shape, strides and dtype: tied weights. None for empty tensors and
        for tensors on the meta device (no memory: every one has address 0)."""
        if type(obj) in _PLAIN_TENSORS:
            local, extra = obj, None
        elif _is_dtensor(obj):
            local, extra = obj.to_local(), (tuple(obj.shape), str(obj.placements))
        else:
            return None
        if (local.layout != _torch().strided or local.is_nested or not local.numel()
                or local.device.type == "meta"):
            return None
        key = (local.data_ptr(), tuple(local.shape), local.stride(), local.dtype,
               local.device, extra)
        if local.is_conj() or local.is_neg():  # the same memory read otherwise: no tie
            return (*key, local.is_conj(), local.is_neg())
        return key

    def memory_id(self, obj: Any) -> int | None:
        """The address of the storage the tensor (local shard) is a view of.

        The storage's, not the view's own ``data_ptr()``: a step over a flat
        parameter (FSDP1, DeepSpeed) changes every view of it saved in the state,
        and a step over views changes a flat buffer saved instead; all of them
        share one id, so a guarded step waits for all of them."""
        local = obj if type(obj) in _PLAIN_TENSORS else _local(obj)
        return int(local.data_ptr()) - int(local.storage_offset()) * int(local.element_size())

    def version(self, obj: Any) -> Callable[[], int] | None:
        """Reader of the tensor's version counter (bumped by every in-place change;
        views share their base's counter).

        A DTensor's is the sum of its own and its local shard's: an in-place op on
        the DTensor (``dt.add_()``, an FSDP2 optimizer step) bumps only its own,
        one on ``to_local()`` only the shard's (reading the shard's alone let a lazy
        save commit a DTensor changed under it, its checksums not matching)."""
        if type(obj) not in _PLAIN_TENSORS and _is_dtensor(obj):
            local = obj.to_local()
            return lambda: obj._version + local._version
        read: Callable[[], int] = functools.partial(getattr, obj, "_version")
        return read

    def pinned_alloc(self, nbytes: int) -> np.ndarray | None:
        """Page-locked host memory through torch's CUDA host allocator (None without CUDA)."""
        torch = _torch()
        if torch is None or not torch.cuda.is_available():
            return None
        t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        out: np.ndarray = t.numpy()  # shares t's memory and keeps t alive
        return out

    def is_optimizer(self, obj: Any) -> bool:
        torch = _torch()
        return torch is not None and isinstance(obj, torch.optim.Optimizer)

    def guard_step(self, optimizer: Any, save: SnapshotWaiter) -> Any:
        """One persistent pre-step hook per optimizer (providers/_torch_guards.py)."""
        return _guards.guard_step(optimizer, save)

    def is_module(self, obj: Any) -> bool:
        torch = _torch()
        return torch is not None and isinstance(obj, torch.nn.Module)

    def guard_forward(self, module: Any, save: SnapshotWaiter) -> Any:
        """One persistent forward pre-hook per module with buffers (BatchNorm's running
        statistics: its forward pass changes them in place, and torch does not count
        those changes in the version counter, so an unguarded one would go unseen);
        None for a module without buffers."""
        if next(module.buffers(), None) is None:
            return None
        return _guards.guard_forward(module, save)

    def load_options(self, obj: Any, sub_like: Any) -> dict[str, Any]:
        """``assign=True`` for a module with a tensor on the meta device (built under
        ``torch.device("meta")``, FSDP2-sharded or not): copying into a meta tensor
        does nothing, so the loaded tensors (FSDP2 shards) take the meta ones' place."""
        if not self.is_module(obj) or not isinstance(sub_like, dict):
            return {}
        for v in sub_like.values():
            local = _local(v)
            if type(local) in _PLAIN_TENSORS and local.device.type == "meta":
                return {"assign": True}
        return {}

    def refused_keys(self, obj: Any, target_keys: list[Any], saved_keys: list[Any]
                     ) -> tuple[list[Any], list[Any]]:
        """A module's missing and unexpected keys, where torch's own rules decide
        (providers/_torch_targets.py); none for an optimizer or scheduler."""
        if not self.is_module(obj):
            return [], []
        return _torch_targets.refused_keys(obj, target_keys, saved_keys)

    def refused_state(self, obj: Any, saved: Node) -> str | None:
        """A module's value that is no tensor, an optimizer's other groups: torch's rules."""
        return _torch_targets.refused_state(obj, saved)

    def tied_names(self, obj: Any) -> list[list[str]]:
        """A module's tied parameters and buffers, told by identity (so a model on the
        meta device has them too); providers/_torch_targets.py."""
        return _torch_targets.tied_names(obj) if self.is_module(obj) else []

    def keep_ties(self, obj: Any, options: dict[str, Any], ties: list[list[str]]
                  ) -> Callable[[], None] | None:
        """With ``assign=True`` torch gives each name a Parameter of its own: retie
        ``ties`` afterwards (providers/_torch_targets.py)."""
        if not options.get("assign") or not ties or not self.is_module(obj):
            return None
        return functools.partial(_torch_targets.retie, obj, ties)

    def state_hints(self, obj: Any, sub_like: Any, saved: Node,
                    shape_of: Callable[[int], tuple[int, ...]]) -> list[Any]:
        """Give a never-stepped optimizer's missing state the layout of its parameters
        (providers/_torch_targets.py)."""
        if not self.is_optimizer(obj) or not isinstance(sub_like, dict):
            return []
        return _torch_targets.optimizer_state_hints(obj, sub_like, saved, shape_of)


class _PlainTensors:
    """``torch.Tensor`` and ``nn.Parameter`` (looked up once torch is loaded; asked
    three times per tensor a save walks)."""

    _types: frozenset[type] = frozenset()

    def __contains__(self, t: type) -> bool:
        types = self._types
        if not types:
            torch = _torch()
            if torch is None:
                return False
            types = self._types = frozenset((torch.Tensor, torch.nn.Parameter))
        return t in types


_PLAIN_TENSORS = _PlainTensors()


def _local(obj: Any) -> Any:
    """A DTensor's local shard; any other tensor as it is."""
    return obj.to_local() if _is_dtensor(obj) else obj


def _same(value: Any) -> Any:
    return value


def _mesh_device(mesh: Any) -> Any:
    """The device this process's shards of a ``mesh`` live on (the CPU for gloo's)."""
    import torch

    kind = mesh.device_type
    if kind == "cpu":
        return torch.device("cpu")
    return torch.device(kind, torch.get_device_module(kind).current_device())


def _same_start(start: tuple[int, ...], shape: tuple[int, ...]) -> tuple[int, ...]:
    return start


def _layout(t: Any, what: str) -> DTensorLayout:
    """The boxes this rank holds of DTensor ``t``; refuses placements that do not say
    which data a rank holds (``Partial``: every rank holds a summand of the whole)."""
    from torch.distributed.tensor import Replicate, Shard

    for pl in t.placements:
        if not isinstance(pl, (Shard, Replicate)) and strided_split(pl) is None:
            raise UnsupportedTypeError(
                f"{what} has placement {pl}; only Shard, _StridedShard and Replicate are "
                "supported (redistribute it first, e.g. to Replicate())"
            )
    return dtensor_layout(t.shape, t.device_mesh, t.placements)


def _layout_views(layout: DTensorLayout, local: np.ndarray
                  ) -> list[tuple[tuple[int, ...], np.ndarray]]:
    """Each held box of ``layout`` paired with its view of the local array ``local``."""
    if not local.ndim:
        return [((), local)]
    return [(g, local[box_slices(loc, s)]) for g, s, loc in layout.boxes if math.prod(s)]
