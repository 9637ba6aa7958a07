"""The provider protocol: one provider per kind of array state.

A provider knows one framework and nothing about files. On save it
*prepares* a value (describes dtype/shape and snapshots it so chunks can
be copied out later); on load it *restores* a value for a target, handing
the engine destination buffers to fill and a ``finish`` that builds the
framework object.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import math
from collections.abc import Callable, Hashable, Iterable
from typing import Any, Protocol

import numpy as np

from statestream.errors import TargetMismatchError, UnsupportedTypeError
from statestream.tree import Key, KeyPath, Node, format_keypath

__all__ = [
    "ArrayProvider",
    "Destination",
    "PreparedArray",
    "ProviderCapabilities",
    "SnapshotWaiter",
    "box_slices",
    "cast_host_array",
    "find_box",
    "chunk_of_host_array",
    "copy_box_of_host_array",
    "refuse_lossy_cast",
    "row_block_chunker",
]


def find_box(
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]], start: tuple[int, ...],
    shape: tuple[int, ...],
) -> tuple[int, ...]:
    """Start of the held box containing box ``(start, shape)``."""
    for bstart, bshape in boxes:
        if all(b <= s and s + n <= b + m for b, m, s, n in zip(bstart, bshape, start, shape)):
            return bstart
    # Engine bug, not bad input: the engine asks only for boxes this process owns.
    raise TargetMismatchError(f"box {start}+{shape} is not held by this process")


def refuse_lossy_cast(host: np.ndarray, want: Any, saved: str, path: KeyPath,
                      advice: str = "") -> None:
    """Raise TargetMismatchError where casting the loaded array ``host`` (of the saved
    dtype ``saved``) to the target's dtype ``want`` would change a value. Integer targets:
    NumPy, torch and JAX wrap an integer around (2**40 into int32 is 0) and make any
    int of a NaN or a float out of range (and cut 1.5 to 1), which no caller asks
    for. Integers: one min/max pass, only where ``want`` cannot hold every value of
    ``saved``; floats: a few passes (a float array into an integer target is rare).
    A float target: :func:`_refuse_float_overflow`."""
    want = np.dtype(want)
    if host.dtype.kind == "c" and want.kind != "c":  # a real target: no imaginary part
        _refuse_unless(host.imag == 0, host, want, saved, path, advice,
                       "an imaginary part, which a cast would drop")
        host = host.real
    if want.kind == "b":  # 2, -7 and 0.5 are no bools: True only from 1
        if host.dtype.kind != "b":
            _refuse_unless((host == 0) | (host == 1), host, want, saved, path, advice,
                           "a value other than 0 and 1, which a cast would make True")
        return
    can = _int_range(want)
    if can is None:
        _refuse_float_overflow(host, want, saved, path, advice)
        return
    if not host.size:
        return
    have = _int_range(host.dtype)
    if have is not None:
        if can.min <= have.min and have.max <= can.max:
            return
        lo, hi = int(host.min()), int(host.max())
        bad: Any = lo if lo < can.min else hi if hi > can.max else None
        how = "a cast would wrap it around"
    elif saved.startswith(("float", "bfloat")):
        bad, how = _changed_float(host, can), "a cast would change it"
    else:
        return
    if bad is not None:
        raise TargetMismatchError(
            f"the checkpoint's {saved} array at key path '{format_keypath(path)}' holds "
            f"{bad}, which the target's dtype {want} cannot hold (from {can.min} to "
            f"{can.max}; {how}); "
            + (advice or f"pass a target of dtype {saved} there, or None"))


def _refuse_unless(ok: np.ndarray, host: np.ndarray, want: np.dtype, saved: str,
                   path: KeyPath, advice: str, what: str) -> None:
    """Raise TargetMismatchError naming the first value of ``host`` where ``ok`` is
    False (an imaginary part into a real target, 2 into a bool one: until 2026-12-07
    dropped and made True silently)."""
    bad = np.flatnonzero(~ok)
    if bad.size:
        raise TargetMismatchError(
            f"the checkpoint's {saved} array at key path '{format_keypath(path)}' holds "
            f"{host.reshape(-1)[bad[0]].item()!r}: {what}, into the target's dtype {want}; "
            + (advice or f"pass a target of dtype {saved} there, or None"))


def _refuse_float_overflow(host: np.ndarray, want: np.dtype, saved: str, path: KeyPath,
                           advice: str) -> None:
    """Raise TargetMismatchError where a value of ``host`` cast to the target's float dtype
    ``want`` would change past rounding: a finite one that becomes an infinity or NaN, or
    is clamped to the largest value (1e5 into float16, 1e39 into float32, 100 into
    float4_e2m1fn, whose 6 it became); a NaN or infinity where ``want`` has none (NaN
    into float4_e2m1fn became -0, inf into float8_e4m3fn NaN); zero or a negative where
    ``want`` holds only positive values (float8_e8m0fnu: NaN). Until 2026-12-07 a value
    became inf silently; until 2026-12-08 those of targets without inf were clamped.
    Rounding is a cast's business and allowed. One min/max pass, only where ``want``'s
    range is narrower than ``saved``'s or ``want`` lacks what ``host`` may hold."""
    top = _float_max(want)
    have = _float_max(host.dtype) if _int_range(host.dtype) is None else _int_range(host.dtype)
    if top is None or have is None or not host.size:
        return
    if isinstance(have, float):
        wide = have > top
    else:
        wide = not (-top <= int(have.min) and int(have.max) <= top)
    lacks = _lacks(want)
    if not wide and not lacks:
        return

    def refuse(v: Any, why: str) -> TargetMismatchError:
        return TargetMismatchError(
            f"the checkpoint's {saved} array at key path '{format_keypath(path)}' holds {v}, "
            f"which the target's dtype {want} cannot hold ({why}); "
            + (advice or f"pass a target of dtype {saved} there, or None"))

    with np.errstate(over="ignore", invalid="ignore"):
        lo, hi = host.min(), host.max()
        if not (np.isfinite(lo) and np.isfinite(hi)):  # an inf or NaN saved
            if "nan" in lacks and np.isnan(host).any():
                raise refuse("NaN", "it has no NaN: a cast would make it a number")
            if "inf" in lacks and np.isinf(host).any():
                raise refuse("an infinity", f"it has none: a cast would make it {top} or NaN")
            finite = host[np.isfinite(host)]
            if not finite.size:
                return
            lo, hi = finite.min(), finite.max()
        if "sign" in lacks and lo <= 0:
            raise refuse(lo, "it holds positive values only: a cast would make it NaN")
        if not wide:
            return
        # past the largest value by half its spacing or more: inf, NaN, or clamped
        limit = top + 2.0 ** (math.floor(math.log2(top)) - _mantissa_bits(want)) / 2
        for v in (lo, hi):
            if (abs(float(v)) >= limit or not np.isfinite(
                    cast_host_array(np.array([v], dtype=host.dtype), want)).all()):
                raise refuse(v, f"its largest finite value is {top}; a cast would make it "
                                "inf, NaN or that")


@functools.lru_cache(maxsize=64)
def _lacks(want: np.dtype) -> frozenset[str]:
    """What of NaN, infinities and negative values the float dtype ``want`` cannot hold
    (ml_dtypes' small floats: float4_e2m1fn none of the first two, float8_e4m3fn no
    infinity, float8_e8m0fnu no infinity and no sign)."""
    probe = cast_host_array(np.array([np.nan, np.inf, -1.0], dtype=np.float32), want)
    got = probe.astype(np.float32)
    return frozenset(name for name, ok in (("nan", np.isnan(got[0])), ("inf", got[1] == np.inf),
                                           ("sign", got[2] == -1.0)) if not ok)


def _mantissa_bits(dtype: np.dtype) -> int:
    """Stored mantissa bits of a float dtype (NumPy's or ml_dtypes')."""
    if dtype.type in (np.float16, np.float32, np.float64, np.longdouble):
        return int(np.finfo(dtype).nmant)
    import ml_dtypes

    return int(ml_dtypes.finfo(dtype).nmant)  # type: ignore[no-untyped-call]


def cast_host_array(host: np.ndarray, want: Any) -> np.ndarray:
    """``host.astype(want)``, through float32 where ml_dtypes has no cast between the two
    (float8_e8m0fnu and any other float8/float6/float4 or int4/int2, int4 and uint4,
    int4 and float6_e2m3fn: TypeError 'Cannot cast array data ... according to the rule
    unsafe' until 2026-12-08). Exact: every value of a real dtype of 16 bits or fewer is
    a float32, so the value is rounded once, into ``want``, as a direct cast would be."""
    try:
        return host.astype(want)
    except TypeError:
        if host.dtype.itemsize > 2 or host.dtype.kind == "c":
            raise
        return host.astype(np.float32).astype(want)


def _float_max(dtype: np.dtype) -> float | None:
    """The largest finite value of a real float dtype (NumPy's or ml_dtypes': bfloat16,
    float8_*; some of those have NumPy's kind 'f', others 'V'), or None for any other."""
    if dtype.kind not in ("f", "V") or not dtype.name.startswith(("float", "bfloat")):
        return None
    if dtype.type in (np.float16, np.float32, np.float64, np.longdouble):
        return float(np.finfo(dtype).max)
    try:
        import ml_dtypes

        return float(ml_dtypes.finfo(dtype).max)  # type: ignore[no-untyped-call]
    except (ImportError, ValueError):  # an ml_dtypes float it cannot describe
        return None


def _int_range(dtype: np.dtype) -> Any:
    """The range (``min``, ``max``) of an integer dtype, or None: NumPy's own
    (kind 'i'/'u') and ml_dtypes' narrow ones (int4, uint4, int2, uint2: kind 'V',
    so an int4 target wrapped values around unchecked: 9 came back as -7)."""
    if dtype.kind in "iu":
        return np.iinfo(dtype)
    if dtype.kind == "V" and dtype.name.startswith(("int", "uint")):
        import ml_dtypes

        try:
            return ml_dtypes.iinfo(dtype)  # type: ignore[no-untyped-call]
        except ValueError:  # pragma: no cover - an ml_dtypes integer it cannot describe
            return None
    return None


def _changed_float(host: np.ndarray, can: Any) -> Any:
    """A value of float array ``host`` that an integer of range ``can`` cannot hold
    exactly (NaN, an infinity, out of range, a fraction), or None."""
    f = host if host.dtype.kind == "f" else host.astype(np.float32)  # (bfloat16, float8)
    finite = np.isfinite(f)
    if not finite.all():
        return f[~finite][0]
    lo, hi = float(f.min()), float(f.max())
    if lo < can.min or hi > can.max:
        return lo if lo < can.min else hi
    frac = f != np.trunc(f)
    return f[frac][0] if frac.any() else None


def box_slices(start: tuple[int, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    """Index expression selecting the box ``[start, start + shape)``."""
    return tuple(slice(s, s + n) for s, n in zip(start, shape))


def chunk_of_host_array(
    arr: np.ndarray, start: tuple[int, ...], shape: tuple[int, ...]
) -> np.ndarray:
    """Little-endian, C-contiguous bytes (1-D uint8) of a box of a host array.

    No copy when the box is already contiguous and little-endian.
    """
    part = arr[box_slices(start, shape)] if arr.ndim else arr.reshape(1)
    if part.dtype.byteorder == ">":
        part = part.astype(part.dtype.newbyteorder("<"))
    part = np.ascontiguousarray(part)
    return part.reshape(-1).view(np.uint8)


def copy_box_of_host_array(arr: np.ndarray, start: tuple[int, ...], shape: tuple[int, ...],
                           out: np.ndarray) -> None:
    """Write what :func:`chunk_of_host_array` returns into ``out`` (1-D uint8 of its
    size), straight from the array (strided, byte-swapped) with no copy between."""
    part = arr[box_slices(start, shape)] if arr.ndim else arr.reshape(1)
    np.copyto(out.view(part.dtype.newbyteorder("<")).reshape(part.shape), part,
              casting="equiv")


def row_block_chunker(
    flat: np.ndarray,
    shape: tuple[int, ...],
    itemsize: int,
    fallback: Callable[[tuple[int, ...], tuple[int, ...]], np.ndarray],
) -> Callable[[tuple[int, ...], tuple[int, ...]], np.ndarray]:
    """Chunk reader over the flat bytes of a C-contiguous array.

    Boxes that are row blocks (full extent on every axis but the first) are
    plain byte ranges of ``flat`` and come back as zero-copy slices; any
    other box goes to ``fallback``.
    """
    return _RowBlocks(flat, shape, math.prod(shape[1:]) * itemsize, fallback)


class _RowBlocks:
    """:func:`row_block_chunker`'s reader: one small object per array (a closure
    with its cells took ~3x the memory, and a save holds one per leaf)."""

    __slots__ = ("flat", "shape", "row_bytes", "fallback")

    def __init__(self, flat: np.ndarray, shape: tuple[int, ...], row_bytes: int,
                 fallback: Callable[[tuple[int, ...], tuple[int, ...]], np.ndarray]) -> None:
        self.flat = flat
        self.shape = shape
        self.row_bytes = row_bytes
        self.fallback = fallback

    def __call__(self, start: tuple[int, ...], cshape: tuple[int, ...]) -> np.ndarray:
        shape = self.shape
        if not shape:
            return self.flat
        if cshape[1:] == shape[1:]:
            a = start[0] * self.row_bytes
            return self.flat[a : a + cshape[0] * self.row_bytes]
        return self.fallback(start, cshape)


@dataclasses.dataclass(slots=True)
class PreparedArray:
    """A leaf ready to be written: its metadata plus a way to read its bytes.

    ``chunk(start, shape)`` returns the box's bytes as a 1-D uint8 array,
    C order, little-endian. It may be called from engine worker threads.
    ``copies`` says whether ``chunk`` allocates (so the engine charges the
    memory budget for it).
    """

    kind: str
    dtype: str
    shape: tuple[int, ...]
    chunk: Callable[[tuple[int, ...], tuple[int, ...]], np.ndarray]
    copies: bool
    attrs: dict[str, Any] | None = None
    #: Boxes (start, shape) of the global array this process holds; None means
    #: all of it. ``chunk`` accepts any box inside one of them.
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]] | None = None
    #: True when the array is sharded/replicated by its framework (DTensor,
    #: sharded jax.Array), so several processes hold parts of one global array.
    distributed: bool = False
    #: Where the array lives ("cpu", or e.g. "cuda:0"); device arrays are
    #: staged through page-locked buffers.
    device: str = "cpu"
    #: For device arrays: ``stage(start, shape, out)`` starts copying the box's
    #: bytes into ``out`` (1-D uint8 of exactly its size, page-locked when
    #: possible) and returns a function that blocks until they have landed.
    #: None: the engine copies ``chunk(start, shape)`` into ``out`` itself.
    stage: Callable[[tuple[int, ...], tuple[int, ...], np.ndarray],
                    Callable[[], None]] | None = None
    #: For host arrays whose ``chunk`` copies: ``copy_into(start, shape, out)``
    #: writes the box's bytes (as ``chunk`` gives them) into ``out`` (1-D uint8 of
    #: exactly its size) without a copy of its own, so that a snapshot's copy into
    #: a staging buffer allocates nothing outside the budget. None: the engine
    #: copies ``chunk(start, shape)`` into ``out``.
    copy_into: Callable[[tuple[int, ...], tuple[int, ...], np.ndarray], None] | None = None

    @property
    def nbytes(self) -> int:
        from statestream.format import itemsize_of

        return math.prod(self.shape) * itemsize_of(self.dtype)


@dataclasses.dataclass(slots=True)
class Destination:
    """Where a restored array's bytes go, and how to build the final value.

    ``boxes`` pairs each global box start with a writable host array of the
    saved dtype and the box's shape; the engine fills them. ``finish()``
    then returns the framework value (casting / moving devices as needed).
    """

    boxes: list[tuple[tuple[int, ...], np.ndarray]]
    finish: Callable[[], Any]


@dataclasses.dataclass(frozen=True, slots=True)
class ProviderCapabilities:
    """What a provider can do beyond the required methods (asked, never probed).

    Attributes:
        in_place_restore: :meth:`ArrayProvider.restore_into` may load into the
            target's own memory; :meth:`ArrayProvider.before_fill` is told which
            targets a load is about to write.
        mutable_values: values can change in place after a lazy snapshot
            started; :meth:`ArrayProvider.memory_id` and
            :meth:`ArrayProvider.version` say which memory a value uses and
            whether it changed.
        lazy_private_copy: a lazy snapshot must snapshot
            :meth:`ArrayProvider.private_copy` of a value, not the value (JAX:
            a donated buffer is freed by the step that donates it).
        pinned_memory: :meth:`ArrayProvider.pinned_alloc` gives page-locked
            host buffers for device-to-host staging copies.
        step_guards: :meth:`ArrayProvider.guard_step` can make an optimizer's
            step, and :meth:`ArrayProvider.guard_forward` a module's forward
            pass (which changes its buffers), wait for a lazy snapshot of what
            they will change.
        state_hints: :meth:`ArrayProvider.state_hints` can type the missing
            entries of a stateful target (a never-stepped optimizer); the hints
            are layouts, never loaded into in place. :meth:`ArrayProvider.load_options`
            gives the keyword arguments of the target's ``load_state_dict``.
        aliases: :meth:`ArrayProvider.alias_key` says which values are views of
            exactly the same memory (tied weights), so they are stored once.
        buffer_restore: :meth:`ArrayProvider.restore_on` can build a value on
            host memory the loader provides (a private mapping of the file).
    """

    in_place_restore: bool = False
    mutable_values: bool = False
    lazy_private_copy: bool = False
    pinned_memory: bool = False
    step_guards: bool = False
    state_hints: bool = False
    aliases: bool = False
    buffer_restore: bool = False


class SnapshotWaiter(Protocol):
    """A save in flight, as a step guard sees it (a ``SaveHandle``)."""

    def snapshot_done(self) -> bool: ...

    def wait_for(self, values: Iterable[Any]) -> None: ...


class ArrayProvider(abc.ABC):
    """One kind of array state (numpy, torch, jax, ...): the same shape for each.

    A new framework is one subclass, registered with
    :func:`statestream.register_provider`. The abstract methods are required;
    the others are asked for only when :attr:`capabilities` says so.
    """

    #: recorded in the manifest as the leaf's ``kind``
    kind: str = ""
    capabilities: ProviderCapabilities = ProviderCapabilities()

    @abc.abstractmethod
    def handles(self, obj: Any) -> bool:
        """True if ``obj`` is a value of this provider's framework."""

    @abc.abstractmethod
    def prepare(self, obj: Any, path: KeyPath) -> PreparedArray:
        """Describe ``obj`` and snapshot it for writing."""

    @abc.abstractmethod
    def is_target(self, like: Any) -> bool:
        """True if ``like`` (a target leaf) asks for this framework's type."""

    @abc.abstractmethod
    def target_shape(self, like: Any) -> tuple[int, ...]:
        """Global shape the target expects."""

    @abc.abstractmethod
    def restore(self, dtype: str, shape: tuple[int, ...], like: Any, path: KeyPath,
                scalar: bool = False) -> Destination:
        """Allocate destinations for a saved array, typed after ``like`` (or defaults).

        ``scalar``: the array was saved from a scalar (0-d) value.
        """

    # -- capabilities ---------------------------------------------------------------
    def restore_into(self, dtype: str, shape: tuple[int, ...], like: Any,
                     path: KeyPath) -> Destination | None:
        """Destinations in ``like``'s own memory, or None (``in_place_restore``)."""
        return None

    def assign(self, like: Any, value: Any) -> Any | None:
        """Copy ``value`` (what :meth:`restore` built for target ``like``: its shape,
        dtype and device) into ``like``'s own memory and return ``like``; None where
        ``like`` cannot be written (immutable, read-only, on no real device). An
        in-place load calls it for targets :meth:`restore_into` could not fill
        (``in_place_restore``), once every array was read and checked. Optional:
        default None (the load returns ``value``)."""
        return None

    def before_fill(self, targets: list[Any]) -> None:
        """Called once per load, after its walk and before any byte is read, with the
        targets whose own memory the load writes (``in_place_restore``: those whose
        :meth:`restore_into` or in-place :meth:`restore_flat` gave their memory). The
        load writes through that memory, unseen by the framework: one that counts
        in-place changes (torch's version counter, which autograd and a lazy
        snapshot check) is told here. Optional: default nothing."""
        return None

    def restore_on(self, dtype: str, shape: tuple[int, ...], like: Any, path: KeyPath,
                   buffer: memoryview, scalar: bool = False) -> Destination | None:
        """:meth:`restore`, but on ``buffer`` (writable, exactly the array's bytes, C
        order) instead of fresh memory; None when not possible (``buffer_restore``)."""
        return None

    def restore_flat(self, dtype: str, shape: tuple[int, ...], nbytes: int, like: Any,
                     in_place: bool, memory: np.ndarray | None = None,
                     ) -> tuple[np.ndarray, Any] | None:
        """The common restore in one call: ``(flat, value)``, where ``flat`` is a 1-D
        uint8 host buffer of exactly ``nbytes`` (> 0) that the array's raw bytes, C
        order, fill, and ``value`` is what the load returns once they are in: no cast,
        no device, nothing left to do. ``in_place``: ``flat`` is ``like``'s own memory
        (which :meth:`restore_into` would use), else ``memory`` when given (a writable
        1-D uint8 private mapping of the array's file bytes, never given with
        ``in_place`` and a target), else fresh. None when the general path
        (:meth:`restore`, :meth:`restore_into`) is needed. Optional: default None.
        """
        return None

    def alias_key(self, obj: Any) -> Hashable | None:
        """A key equal for two values exactly when they are the same array in the same
        memory (same memory, offset, shape, strides and dtype), or None (``aliases``)."""
        return None

    def alias_and_prepare(self, obj: Any,
                          path: KeyPath) -> tuple[Hashable | None, PreparedArray]:
        """:meth:`alias_key` and :meth:`prepare` in one call (asked only when
        ``capabilities.aliases``); a provider may override it to read the value's
        properties once. The result of ``prepare`` is dropped when ``obj`` is tied."""
        return self.alias_key(obj), self.prepare(obj, path)

    def private_copy(self, obj: Any) -> Any:
        """A copy of ``obj`` that nothing else can free or change (``lazy_private_copy``)."""
        return obj

    def memory_id(self, obj: Any) -> int | None:
        """Identity of the memory ``obj`` (a value this provider handles) uses
        (``mutable_values``), None if it cannot tell."""
        return None

    def version(self, obj: Any) -> Callable[[], int] | None:
        """A reader of ``obj``'s in-place modification counter (``mutable_values``)."""
        return None

    def pinned_alloc(self, nbytes: int) -> np.ndarray | None:
        """A page-locked 1-D uint8 host buffer, or None when none can be had."""
        return None

    def guard_step(self, optimizer: Any, save: SnapshotWaiter) -> Any:
        """Before each step of ``optimizer``, wait for ``save``'s snapshot of the values
        the step changes (``step_guards``).

        Returns a removable handle; one hook per optimizer, however often it
        is called (later calls add the save to the existing hook).
        """
        raise UnsupportedTypeError(f"{type(self).__qualname__} cannot guard optimizer steps")

    def is_optimizer(self, obj: Any) -> bool:
        """True if ``obj`` is an optimizer :meth:`guard_step` can guard."""
        return False

    def guard_forward(self, module: Any, save: SnapshotWaiter) -> Any:
        """Before each forward pass of ``module``, wait for ``save``'s snapshot of the
        module's buffers, which a forward pass may change (``step_guards``).

        Returns a removable handle, or None when the module has no buffers
        (nothing a forward pass changes); one hook per module, however often
        it is called.
        """
        raise UnsupportedTypeError(f"{type(self).__qualname__} cannot guard forward passes")

    def is_module(self, obj: Any) -> bool:
        """True if ``obj`` is a module :meth:`guard_forward` can guard."""
        return False

    def state_hints(self, obj: Any, sub_like: Any, saved: Node,
                    shape_of: Callable[[int], tuple[int, ...]]) -> list[Any]:
        """Fill in the target ``sub_like`` of stateful ``obj`` from what was saved.

        Returns the hint values placed. A hint gives a layout (type, dtype,
        device, sharding) only, and may be a view of other state (a
        parameter): a load never writes into its memory, even ``in_place``.
        """
        return []

    def load_options(self, obj: Any, sub_like: Any) -> dict[str, Any]:
        """Keyword arguments for stateful ``obj``'s ``load_state_dict`` (``sub_like``:
        its ``state_dict()``); ``{}`` for the call as it is (``state_hints``)."""
        return {}

    def refused_keys(self, obj: Any, target_keys: list[Key], saved_keys: list[Key]
                     ) -> tuple[list[Key], list[Key]]:
        """The keys stateful ``obj``'s ``load_state_dict`` is sure to refuse, told
        before the load reads anything: (``target_keys``, its ``state_dict()``'s,
        that the saved state lacks; ``saved_keys`` it has no place for). Empty
        lists where only the call can tell (``state_hints``): an optimizer's
        fresh ``state_dict()`` is only a hint of what it accepts."""
        return [], []

    def refused_state(self, obj: Any, saved: Node) -> str | None:
        """Why stateful ``obj``'s ``load_state_dict`` is sure to refuse the saved state
        ``saved`` (its ``state_dict()`` as the manifest holds it) for more than its keys
        (a value of a kind it cannot take, a structure it checks), told before the load
        reads anything; None where it accepts it or only the call can tell
        (``state_hints``)."""
        return None

    def tied_names(self, obj: Any) -> list[list[str]]:
        """Names of stateful ``obj``'s ``state_dict()`` that are one value (ties), one
        list per tie; told by the object itself, not by memory (``state_hints``)."""
        return []

    def keep_ties(self, obj: Any, options: dict[str, Any], ties: list[list[str]]
                  ) -> Callable[[], None] | None:
        """Called before ``obj.load_state_dict(..., **options)`` with the ``ties``
        :meth:`tied_names` found: a function to call after it that restores what
        that call undid (tied parameters, which ``assign=True`` replaces one by
        one); None when there is nothing to restore."""
        return None
