"""Built-in state adapters: random number generators, typed JAX keys, compiled modules.

Each saves a value's exact state as plain values and arrays (no pickle)
and restores it, so that the stream of numbers after a load continues
exactly where it was saved. torch and JAX are looked up in ``sys.modules``
only, never imported here.
"""

from __future__ import annotations

import functools
import random
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from statestream.errors import CheckpointCorruptError, TargetMismatchError
from statestream.providers._adapters import StateAdapter
from statestream.tree import KeyPath, format_keypath, type_name

__all__ = [
    "CompiledModuleAdapter",
    "JaxKeyAdapter",
    "NumpyBitGeneratorAdapter",
    "NumpyGeneratorAdapter",
    "NumpyRandomStateAdapter",
    "PythonRandomAdapter",
    "TorchGeneratorAdapter",
]

#: NumPy bit generators a checkpoint may name (looked up in numpy.random, nothing else)
_BIT_GENERATORS = ("PCG64", "PCG64DXSM", "MT19937", "Philox", "SFC64")


#: The key of a bit generator's saved state that holds its seed sequence (what
#: ``spawn()`` derives children from); saved since 2026-12-06, absent before.
_SEED_SEQ = "seed_seq"


def _with_seed_seq(bg: Any) -> dict[str, Any]:
    """``bg.state`` plus its seed sequence (entropy, spawn key, pool size, children
    spawned so far), without which ``spawn()`` after a load gives other children."""
    state = dict(bg.state)
    seq = getattr(bg, "seed_seq", None)
    if isinstance(seq, np.random.SeedSequence):
        entropy: Any = seq.entropy  # (NumPy's stubs: int | Sequence[int])
        state[_SEED_SEQ] = {
            # an int, or a NumPy one (``default_rng(np.int64(5))``, a 0-d array): an
            # int; a sequence of them: a list
            "entropy": entropy if entropy is None else int(entropy)
            if np.ndim(entropy) == 0 else [int(e) for e in entropy],
            "spawn_key": [int(k) for k in seq.spawn_key], "pool_size": int(seq.pool_size),
            "n_children_spawned": int(seq.n_children_spawned)}
    return state


#: NumPy's smallest (and default) entropy pool, and the largest a checkpoint may name:
#: mixing costs pool_size x (pool_size + entropy words), and NumPy takes any size (a
#: manifest's 40,000 took 9 s, 10^6 half an hour, 2^40 asked for 4 TiB)
_POOL_SIZES = (4, 4096)
#: uint32 words an entropy or a spawn key may take (NumPy writes 4 for its own entropy,
#: one per spawn; converting an int of 2^16 words took 21 s)
_MAX_SEED_WORDS = 1024


def _seed_words(v: Any, key: str, path: KeyPath, one: bool) -> int:
    """The uint32 words of a saved entropy (``one``: an int or a list of them) or spawn
    key (a list), after checking it is one and within :data:`_MAX_SEED_WORDS`."""
    where = f"key path '{format_keypath((*path, _SEED_SEQ, key))}'"
    items = [v] if one and type(v) is int else v
    if type(items) is not list or any(type(x) is not int or x < 0 for x in items):
        raise CheckpointCorruptError(
            f"the NumPy seed sequence's {key} at {where} is not "
            f"{'a non-negative int or a list of them' if one else 'a list of non-negative ints'}")
    words = 0
    for x in items:
        words += max(1, -(-x.bit_length() // 32))
        if words > _MAX_SEED_WORDS:
            raise CheckpointCorruptError(
                f"the NumPy seed sequence's {key} at {where} holds more than "
                f"{_MAX_SEED_WORDS} 32-bit words (refusing to mix them)")
    return words


def _seed_int(v: Any, key: str, path: KeyPath, lo: int, hi: int) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise CheckpointCorruptError(
            f"the NumPy seed sequence's {key} at key path "
            f"'{format_keypath((*path, _SEED_SEQ, key))}' is {v!r:.40}, not an int in "
            f"[{lo}, {hi}]")
    return v


def _seed_seq(saved: Any, path: KeyPath) -> Any:
    """The saved seed sequence, its sizes bounded first (NumPy's cost grows with the
    square of ``pool_size`` and of an entropy int's size).

    Raises:
        CheckpointCorruptError: a value outside what NumPy writes, naming its key path.
    """
    if saved is None:
        return None
    try:
        entropy, spawn_key = saved["entropy"], saved["spawn_key"]
        pool, spawned = saved["pool_size"], saved["n_children_spawned"]
    except (KeyError, TypeError) as exc:
        raise TargetMismatchError(f"the NumPy seed sequence at key path "
                                  f"'{format_keypath(path)}' is not one: {exc}") from None
    if entropy is not None:
        _seed_words(entropy, "entropy", path, one=True)
    _seed_words(spawn_key, "spawn_key", path, one=False)
    _seed_int(pool, "pool_size", path, *_POOL_SIZES)
    # (NumPy keeps it as a uint32; at 2^32 - 1 its next spawn() fails)
    _seed_int(spawned, "n_children_spawned", path, 0, (1 << 32) - 2)
    try:
        return np.random.SeedSequence(entropy, spawn_key=tuple(spawn_key), pool_size=pool,
                                      n_children_spawned=spawned)
    except (TypeError, ValueError, OverflowError) as exc:
        raise TargetMismatchError(f"the NumPy seed sequence at key path "
                                  f"'{format_keypath(path)}' is not one: {exc}") from None


#: Per bit generator, what NumPy takes from a state unchecked: indexes into its
#: buffers, bounded here (an MT19937 ``pos`` of 10^9 or a Philox ``buffer_pos`` of
#: -10^8 loaded, and the first draw read out of bounds or crashed the interpreter),
#: and the lengths of the arrays it copies those buffers from.
_POSITIONS: dict[str, tuple[tuple[tuple[str, ...], int, int], ...]] = {
    "MT19937": ((("state", "pos"), 0, 624),),
    "Philox": ((("buffer_pos",), 0, 4),),
}
_WORDS: dict[str, tuple[tuple[tuple[str, ...], int], ...]] = {
    "MT19937": ((("state", "key"), 624),),
    "Philox": ((("buffer",), 4), (("state", "counter"), 4), (("state", "key"), 2)),
    "SFC64": ((("state", "state"), 4),),
}


def _check_positions(state: dict[str, Any], path: KeyPath) -> None:
    """Refuse a bit generator state whose buffer indexes or flags NumPy would take out
    of range (see :data:`_POSITIONS`), or whose arrays are not the words it copies.

    Raises:
        CheckpointCorruptError: naming the value's key path.
    """
    name = state.get("bit_generator")
    flags = tuple(((k,), 0, 1) for k in ("has_uint32", "has_gauss") if k in state)
    for keys, lo, hi in (*_POSITIONS.get(name, ()), *flags):  # type: ignore[arg-type]
        v: Any = state
        for k in keys:
            v = v.get(k) if isinstance(v, dict) else None
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not lo <= v <= hi:
            raise CheckpointCorruptError(
                f"the NumPy {name} state's {'/'.join(keys)} at key path "
                f"'{format_keypath((*path, *keys))}' is {v!r:.40}, not an int in [{lo}, {hi}]")
    for keys, n in _WORDS.get(name, ()):  # type: ignore[arg-type]
        v = state
        for k in keys:
            v = v.get(k) if isinstance(v, dict) else None
        if np.shape(v) != (n,):
            raise CheckpointCorruptError(
                f"the NumPy {name} state's {'/'.join(keys)} at key path "
                f"'{format_keypath((*path, *keys))}' is not {n} words")


def _restore(bg: Any, state: Any, path: KeyPath) -> Any:
    """Put a saved state (with or without its seed sequence) into the bit generator."""
    state = dict(state)
    seq = _seed_seq(state.pop(_SEED_SEQ, None), path)
    if state.get("bit_generator") != type(bg).__name__:
        raise TargetMismatchError(
            f"the NumPy generator at key path '{format_keypath(path)}' was saved with bit "
            f"generator {state.get('bit_generator')!r:.40}, the target's is "
            f"{type(bg).__name__}: load into a generator of that kind, or with None")
    _check_positions(state, path)
    if seq is None:
        bg.state = state
    else:  # BitGenerator.__setstate__ takes (state, seed sequence) since NumPy 1.25
        bg.__setstate__((state, seq))
    return bg


def _staged(bg: Any, state: Any, path: KeyPath, call: Callable[[], Any]
            ) -> Callable[[], Any] | None:
    """``call`` once ``state`` went into a fresh bit generator of ``bg``'s kind (a
    check); None (set at once) for a kind that cannot be made without arguments."""
    try:
        fresh = type(bg)()
    except Exception:  # (a subclass of its own)
        return None
    _restore(fresh, state, path)
    return call


def _bit_generator(state: Any, path: KeyPath) -> Any:
    name = state.get("bit_generator") if isinstance(state, dict) else None
    if name not in _BIT_GENERATORS:
        raise TargetMismatchError(
            f"the NumPy generator state at key path '{format_keypath(path)}' names bit "
            f"generator {name!r:.60}, not one of {', '.join(_BIT_GENERATORS)}"
        )
    return _restore(getattr(np.random, name)(), state, path)


class NumpyBitGeneratorAdapter(StateAdapter):
    """``numpy.random.PCG64`` & co.: their ``.state`` dict and seed sequence."""

    name = "numpy.random.BitGenerator"

    def handles(self, obj: Any) -> bool:
        return isinstance(obj, np.random.BitGenerator)

    def get_state(self, obj: Any) -> Any:
        return _with_seed_seq(obj)

    def target_state(self, obj: Any) -> Any:
        # nothing to match: the saved state loads as it is, with or without the seed
        # sequence (older checkpoints), and _restore names another bit generator
        return {}

    def set_state(self, obj: Any, state: Any, path: KeyPath) -> Any:
        return _restore(obj, state, path)

    def staged(self, obj: Any, state: Any, path: KeyPath) -> Callable[[], Any] | None:
        return _staged(obj, state, path, functools.partial(_restore, obj, state, path))

    def new(self, state: Any, path: KeyPath) -> Any:
        return _bit_generator(state, path)


class NumpyGeneratorAdapter(StateAdapter):
    """``numpy.random.Generator``: its bit generator's state and seed sequence."""

    name = "numpy.random.Generator"

    def handles(self, obj: Any) -> bool:
        return isinstance(obj, np.random.Generator)

    def get_state(self, obj: Any) -> Any:
        return _with_seed_seq(obj.bit_generator)

    def target_state(self, obj: Any) -> Any:
        return {}  # as NumpyBitGeneratorAdapter's

    def set_state(self, obj: Any, state: Any, path: KeyPath) -> Any:
        _restore(obj.bit_generator, state, path)
        return obj

    def staged(self, obj: Any, state: Any, path: KeyPath) -> Callable[[], Any] | None:
        return _staged(obj.bit_generator, state, path,
                       functools.partial(self.set_state, obj, state, path))

    def new(self, state: Any, path: KeyPath) -> Any:
        return np.random.Generator(_bit_generator(state, path))


class NumpyRandomStateAdapter(StateAdapter):
    """Legacy ``numpy.random.RandomState``: ``get_state(legacy=False)``."""

    name = "numpy.random.RandomState"

    def handles(self, obj: Any) -> bool:
        return isinstance(obj, np.random.RandomState)

    def get_state(self, obj: Any) -> Any:
        return obj.get_state(legacy=False)

    def set_state(self, obj: Any, state: Any, path: KeyPath) -> Any:
        if isinstance(state, dict):
            _check_positions(state, path)
        obj.set_state(state)
        return obj

    def staged(self, obj: Any, state: Any, path: KeyPath) -> Callable[[], Any]:
        self.new(state, path)  # a check: a fresh one takes it
        return functools.partial(self.set_state, obj, state, path)

    def new(self, state: Any, path: KeyPath) -> Any:
        return self.set_state(np.random.RandomState(), state, path)


class PythonRandomAdapter(StateAdapter):
    """``random.Random`` (not ``SystemRandom``, which has no state)."""

    name = "random.Random"

    def handles(self, obj: Any) -> bool:
        return isinstance(obj, random.Random) and not isinstance(obj, random.SystemRandom)

    def get_state(self, obj: Any) -> Any:
        version, internal, gauss_next = obj.getstate()
        return {"version": version, "internal": np.array(internal, dtype=np.uint32),
                "gauss_next": gauss_next}

    def set_state(self, obj: Any, state: Any, path: KeyPath) -> Any:
        internal = tuple(int(x) for x in np.asarray(state["internal"]).reshape(-1))
        gauss = state["gauss_next"]
        obj.setstate((state["version"], internal, None if gauss is None else float(gauss)))
        return obj

    def staged(self, obj: Any, state: Any, path: KeyPath) -> Callable[[], Any]:
        self.new(state, path)  # a check: a fresh one takes it
        return functools.partial(self.set_state, obj, state, path)

    def new(self, state: Any, path: KeyPath) -> Any:
        return self.set_state(random.Random(), state, path)


class TorchGeneratorAdapter(StateAdapter):
    """``torch.Generator``: its device and ``get_state()`` bytes."""

    name = "torch.Generator"
    module = "torch"

    def handles(self, obj: Any) -> bool:
        torch = sys.modules.get("torch")
        return torch is not None and isinstance(obj, torch.Generator)

    def get_state(self, obj: Any) -> Any:
        return {"device": str(obj.device), "state": obj.get_state()}

    def set_state(self, obj: Any, state: Any, path: KeyPath) -> Any:
        import torch

        obj.set_state(torch.as_tensor(np.asarray(state["state"]), dtype=torch.uint8))
        return obj

    def staged(self, obj: Any, state: Any, path: KeyPath) -> Callable[[], Any]:
        import torch

        self.set_state(torch.Generator(device=obj.device), state, path)  # a check
        return functools.partial(self.set_state, obj, state, path)

    def new(self, state: Any, path: KeyPath) -> Any:
        import torch

        return self.set_state(torch.Generator(device=str(state["device"])), state, path)


class CompiledModuleAdapter(StateAdapter):
    """A ``torch.compile``'d module saves and loads as the module it wraps.

    Its ``state_dict()`` keys carry an ``_orig_mod.`` prefix; saving the
    wrapped module's state instead makes a compiled and a plain module
    interchangeable, in either direction. A ``state_dict()`` saved as a dict
    (either module's) loads into either module too: the load maps the prefix.
    """

    module = "torch"
    key_prefix = "_orig_mod."

    def handles(self, obj: Any) -> bool:
        mod = sys.modules.get("torch._dynamo.eval_frame")
        cls = getattr(mod, "OptimizedModule", None) if mod is not None else None
        return cls is not None and isinstance(obj, cls)

    def node_name(self, obj: Any) -> str:
        return type_name(obj._orig_mod)

    def get_state(self, obj: Any) -> Any:
        return obj._orig_mod.state_dict()

    def wrapped(self, obj: Any) -> Any:
        return obj._orig_mod

    def set_state(self, obj: Any, state: Any, path: KeyPath) -> Any:
        obj._orig_mod.load_state_dict(state)
        return obj


class NnxAdapter(StateAdapter):
    """A flax NNX module, optimizer or other ``nnx.Pytree`` saves as ``nnx.state(obj)``
    and loads in place with ``nnx.update``, as a torch module does with its
    ``state_dict()``.

    Saved as a JAX pytree, a module also recorded flax's bookkeeping (an empty
    ``_pytree__state`` entry per module), so a module's checkpoint and one of its
    ``nnx.state`` (what flax's docs save) had different key paths: the state's did not
    load into the module ("'model/_pytree__state' is in the target but not in the
    checkpoint"), and a load built a new module instead of filling the one given. Now
    both save the same tree, and either loads into a module or its state.
    """

    module = "flax.nnx"
    plain_state = True

    def handles(self, obj: Any) -> bool:
        nnx = sys.modules.get("flax.nnx")
        cls = getattr(nnx, "Pytree", None) or getattr(nnx, "Object", None)
        return cls is not None and isinstance(obj, cls)

    def node_name(self, obj: Any) -> str:
        return type_name(obj)

    def get_state(self, obj: Any) -> Any:
        from flax import nnx

        return nnx.state(obj)

    def set_state(self, obj: Any, state: Any, path: KeyPath) -> Any:
        from flax import nnx

        nnx.update(obj, state)
        return obj

    def staged(self, obj: Any, state: Any, path: KeyPath) -> Callable[[], Any]:
        return functools.partial(self.set_state, obj, state, path)


class JaxKeyAdapter(StateAdapter):
    """Typed JAX keys (``jax.random.key``): their key data and the impl's name."""

    name = "jax.random.key"
    module = "jax"

    def handles(self, obj: Any) -> bool:
        jax = sys.modules.get("jax")
        return (jax is not None and isinstance(obj, jax.Array)
                and jax.dtypes.issubdtype(obj.dtype, jax.dtypes.prng_key))

    def get_state(self, obj: Any) -> Any:
        import jax

        return {"impl": str(jax.random.key_impl(obj)), "data": jax.random.key_data(obj)}

    def set_state(self, obj: Any, state: Any, path: KeyPath) -> Any:
        import jax

        want = str(jax.random.key_impl(obj))
        if str(state["impl"]) != want:
            # rbg and unsafe_rbg keys hold the same uint32[4] data: the saved impl's
            # key came back where the target asked for the other
            raise TargetMismatchError(
                f"the target at key path '{format_keypath(path)}' is a {want} key, the "
                f"checkpoint holds a {state['impl']} key: pass a key of that impl there, "
                "or None for the saved key")
        return self.new(state, path)  # keys are immutable: a new one

    def new(self, state: Any, path: KeyPath) -> Any:
        import jax

        return jax.random.wrap_key_data(state["data"], impl=str(state["impl"]))

    def refuse_saved(self, saved: dict[str, Any], like: Any, path: KeyPath) -> None:
        """A key of another impl than the target's (a key or its ShapeDtypeStruct) is
        refused naming both impls; a threefry key (uint32[2] data) into an rbg target
        (uint32[4]) was a shape mismatch at 'key/data', naming neither."""
        import jax

        impl, want = saved.get("impl"), getattr(like, "dtype", None)
        if not isinstance(impl, str) or want is None:
            return
        try:
            got = jax.random.key(0, impl=impl).dtype
        except (TypeError, ValueError):
            return  # an impl this JAX lacks: the load of the key says so
        if got != want:
            what = (f"is a {jax.random.key_impl(like)}" if isinstance(like, jax.Array)
                    else f"describes a {want}")
            raise TargetMismatchError(
                f"the target at key path '{format_keypath(path)}' {what} key, the "
                f"checkpoint holds a {impl} key: pass a key of that impl there, or None "
                "for the saved key")

    def abstract_state(self, like: Any) -> Any:
        """A ``jax.ShapeDtypeStruct`` of a key dtype: its key data's shape, dtype and
        sharding (the key's, with the key data's trailing axes unsharded)."""
        jax = sys.modules.get("jax")
        if (jax is None or not isinstance(like, jax.ShapeDtypeStruct)
                or not jax.dtypes.issubdtype(like.dtype, jax.dtypes.prng_key)):
            return None
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(like.shape, like.dtype))
        sharding = _key_data_sharding(getattr(like, "sharding", None), data.ndim)
        return {"impl": None,
                "data": jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=sharding)}


def _key_data_sharding(sharding: Any, ndim: int) -> Any:
    """The sharding of the key data of keys laid out by ``sharding`` (None: the
    default device, for a sharding that cannot be extended to the data's axes)."""
    from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

    if isinstance(sharding, SingleDeviceSharding):
        return sharding
    if isinstance(sharding, NamedSharding):
        spec = tuple(sharding.spec)
        full = PartitionSpec(*spec, *[None] * (ndim - len(spec)))  # type: ignore[no-untyped-call]
        return NamedSharding(sharding.mesh, full, memory_kind=sharding.memory_kind)
    return None
