"""What a load must return for a state of tests/fuzz/_fuzz_states.py, and a bitwise diff.

``diff(expected, got)`` lists the differences by key path (at most a few):
arrays and tensors compare by dtype, shape and bytes, floats by their bits,
containers by type and keys (key types included), modules and optimizers by
their ``state_dict()``, random generators by their state.
"""

from __future__ import annotations

import math
import random
import struct
from typing import Any

import numpy as np
import torch
from _fuzz_states import (
    TORCH_DTYPES,
    TORCH_NAME,
    is_record,
    mesh,
    np_dtype,
    rebuild,
    record_fields,
)


class Loose:
    """Expected: some dict (a generator's state, loaded without a target)."""

    def __repr__(self) -> str:
        return "<a dict>"


def is_jax_array(x: Any) -> bool:
    jax = _jax_if_imported()
    return jax is not None and isinstance(x, jax.Array)


def is_jax_key(x: Any) -> bool:
    jax = _jax_if_imported()
    return is_jax_array(x) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _jax_if_imported() -> Any:
    import sys

    return sys.modules.get("jax")


GENERATORS = (random.Random, np.random.Generator, np.random.RandomState, torch.Generator)


def is_generator(x: Any) -> bool:
    return isinstance(x, GENERATORS) or is_jax_key(x)


def is_stateful(x: Any) -> bool:
    return is_generator(x) or isinstance(x, (torch.nn.Module, torch.optim.Optimizer))


def torch_to_np(t: torch.Tensor) -> np.ndarray[Any, Any]:
    t = t.detach().resolve_conj().resolve_neg()
    name = TORCH_NAME[t.dtype]
    if not t.numel():
        return np.zeros(tuple(t.shape), np_dtype(name))
    # a fresh tensor: ``contiguous()`` keeps a 1-element dim's odd stride (shape (1,),
    # stride (2,) counts as contiguous), which ``view(torch.uint8)`` refuses
    raw = t.clone(memory_format=torch.contiguous_format).reshape(-1).view(torch.uint8)
    raw = raw.numpy().copy()
    return raw.view(np_dtype(name)).reshape(tuple(t.shape))


def norm_np(a: Any) -> np.ndarray[Any, Any]:
    """A C-ordered, native-byte-order base ndarray copy of ``a``."""
    a = np.asarray(a)
    if a.dtype.byteorder not in "=|":
        a = a.astype(a.dtype.newbyteorder("="))
    return np.array(a, order="C", copy=True, subok=False)


def expect_plain(x: Any) -> Any:
    """What load without a target returns."""
    if isinstance(x, dict):
        return {k: expect_plain(v) for k, v in x.items()}
    if is_record(x):
        return {k: expect_plain(v) for k, v in record_fields(x)}
    if isinstance(x, list):
        return [expect_plain(v) for v in x]
    if isinstance(x, tuple):
        return tuple(expect_plain(v) for v in x)
    if isinstance(x, torch.Tensor):
        return torch_to_np(x)
    if is_generator(x):
        return Loose()
    if isinstance(x, (torch.nn.Module, torch.optim.Optimizer)):
        return expect_plain(x.state_dict())
    if is_jax_array(x):
        return norm_np(np.asarray(x))
    if isinstance(x, np.generic):
        return x
    if isinstance(x, np.ndarray):
        return norm_np(x)
    return x


def bits(a: Any) -> bytes:
    return np.array(a, order="C").tobytes()


def generator_state(g: Any) -> Any:
    """A comparable state of a random generator."""
    if isinstance(g, random.Random):
        return g.getstate()
    if isinstance(g, np.random.Generator):
        return repr(g.bit_generator.state)
    if isinstance(g, np.random.RandomState):
        kind, key, pos, has_gauss, gauss = g.get_state()
        return kind, key.tobytes(), pos, has_gauss, gauss
    if isinstance(g, torch.Generator):
        return bytes(g.get_state().numpy())
    import jax

    return str(jax.random.key_impl(g)), bits(jax.random.key_data(g))


# ------------------------------------------------------------------ diff
class Differ:
    """Collects differences; ``sharding`` says whether JAX shardings must match."""

    def __init__(self, sharding: bool = True, limit: int = 6) -> None:
        self.out: list[str] = []
        self.sharding, self.limit = sharding, limit

    def add(self, msg: str) -> None:
        self.out.append(msg[:400])

    def run(self, exp: Any, got: Any, p: str = "") -> list[str]:
        if len(self.out) >= self.limit:
            return self.out
        for test, method in self._dispatch():
            if test(exp):
                method(exp, got, p)
                return self.out
        self.leaf(exp, got, p)
        return self.out

    def _dispatch(self) -> list[tuple[Any, Any]]:
        return [
            (lambda e: isinstance(e, Loose), self.loose),
            (lambda e: isinstance(e, dict), self.mapping),
            (is_record, self.record),
            (lambda e: type(e) in (list, tuple), self.sequence),
            (is_generator, self.generator),
            (lambda e: isinstance(e, (torch.nn.Module, torch.optim.Optimizer)), self.stateful),
            (lambda e: isinstance(e, np.generic), self.scalar),
            (lambda e: isinstance(e, np.ndarray), self.ndarray),
            (lambda e: isinstance(e, torch.Tensor), self.tensor),
            (is_jax_array, self.jax_array),
            (lambda e: type(e) is float, self.float_),
        ]

    def loose(self, exp: Any, got: Any, p: str) -> None:
        if not isinstance(got, dict):
            self.add(f"{p}: type {type(got).__name__} != dict")

    def mapping(self, exp: dict[Any, Any], got: Any, p: str) -> None:
        if type(got) is not dict:
            self.add(f"{p}: type {type(got).__name__} != dict")
        elif list(exp) != list(got) or [type(k) for k in exp] != [type(k) for k in got]:
            self.add(f"{p}: keys {list(got)!r} != {list(exp)!r}")
        else:
            for k in exp:
                self.run(exp[k], got[k], f"{p}/{k!r}")

    def record(self, exp: Any, got: Any, p: str) -> None:
        if type(got) is not type(exp):
            self.add(f"{p}: type {type(got).__name__} != {type(exp).__name__}")
            return
        for (k, a), (_, b) in zip(record_fields(exp), record_fields(got)):
            self.run(a, b, f"{p}/{k}")

    def sequence(self, exp: Any, got: Any, p: str) -> None:
        if type(got) is not type(exp):
            self.add(f"{p}: type {type(got).__name__} != {type(exp).__name__}")
        elif len(exp) != len(got):
            self.add(f"{p}: len {len(got)} != {len(exp)}")
        else:
            for i, (a, b) in enumerate(zip(exp, got)):
                self.run(a, b, f"{p}/{i}")

    def generator(self, exp: Any, got: Any, p: str) -> None:
        if type(got) is not type(exp) and not (is_jax_key(exp) and is_jax_key(got)):
            self.add(f"{p}: type {type(got).__name__} != {type(exp).__name__}")
        elif generator_state(got) != generator_state(exp):
            self.add(f"{p}: {type(exp).__name__} state differs")

    def stateful(self, exp: Any, got: Any, p: str) -> None:
        if type(got) is not type(exp):
            self.add(f"{p}: type {type(got).__name__} != {type(exp).__name__}")
        else:
            self.run(expect_plain(exp.state_dict()), expect_plain(got.state_dict()),
                     f"{p}.state_dict()")

    def scalar(self, exp: np.generic, got: Any, p: str) -> None:
        if not isinstance(got, np.generic) or got.dtype != norm_np(exp).dtype or bits(
                np.asarray(got)) != bits(norm_np(exp)):
            self.add(f"{p}: scalar {got!r} ({type(got).__name__}) != {exp!r} "
                     f"({type(exp).__name__}, {exp.dtype})")

    def ndarray(self, exp: np.ndarray[Any, Any], got: Any, p: str) -> None:
        if type(got) is not np.ndarray:
            self.add(f"{p}: type {type(got).__name__} != ndarray")
        elif got.dtype != exp.dtype or got.shape != exp.shape:
            self.add(f"{p}: {got.dtype}{got.shape} != {exp.dtype}{exp.shape}")
        elif bits(norm_np(got)) != bits(exp):
            self.add(f"{p}: bytes differ ({exp.dtype}{exp.shape}) got {got!r} exp {exp!r}")

    def tensor(self, exp: torch.Tensor, got: Any, p: str) -> None:
        if not isinstance(got, torch.Tensor):
            self.add(f"{p}: type {type(got).__name__} != torch.Tensor")
        elif got.dtype != exp.dtype or got.shape != exp.shape:
            self.add(f"{p}: {got.dtype}{tuple(got.shape)} != {exp.dtype}{tuple(exp.shape)}")
        elif bits(torch_to_np(got)) != bits(torch_to_np(exp)):
            self.add(f"{p}: tensor bytes differ")
        elif type(exp) is not type(got) and type(got) is not torch.nn.Parameter:
            self.add(f"{p}: tensor type {type(got).__name__} != {type(exp).__name__}")

    def jax_array(self, exp: Any, got: Any, p: str) -> None:
        if not is_jax_array(got):
            self.add(f"{p}: type {type(got).__name__} != jax.Array")
        elif got.dtype != exp.dtype or got.shape != exp.shape:
            self.add(f"{p}: {got.dtype}{got.shape} != {exp.dtype}{exp.shape}")
        elif bits(np.asarray(got)) != bits(np.asarray(exp)):
            self.add(f"{p}: jax bytes differ")
        elif self.sharding and not got.sharding.is_equivalent_to(exp.sharding, exp.ndim):
            self.add(f"{p}: sharding {got.sharding} != {exp.sharding}")

    def float_(self, exp: float, got: Any, p: str) -> None:
        same = type(got) is float and (struct.pack("<d", exp) == struct.pack("<d", got) or (
            math.isnan(exp) and math.isnan(got) and math.copysign(1, exp) == math.copysign(
                1, got)))
        if not same:
            self.add(f"{p}: {got!r} ({type(got).__name__}) != {exp!r}")

    def leaf(self, exp: Any, got: Any, p: str) -> None:
        try:
            bad = type(got) is not type(exp) or bool(exp != got)
        except Exception:  # noqa: BLE001 - any failure to compare is a difference
            bad = True
        if bad:
            self.add(f"{p}: {got!r} ({type(got).__name__}) != {exp!r} ({type(exp).__name__})")


def diff(exp: Any, got: Any, sharding: bool = True) -> list[str]:
    return Differ(sharding).run(exp, got)


# ------------------------------------------------------------------ targets
def _fresh(rng: random.Random, x: Any) -> Any:
    """A stateful object of x's kind in another state (the target a resume would build)."""
    if isinstance(x, random.Random):
        return random.Random(rng.randrange(1 << 30))
    if isinstance(x, np.random.Generator):
        return np.random.default_rng(rng.randrange(1 << 30))
    if isinstance(x, np.random.RandomState):
        return np.random.RandomState(rng.randrange(1 << 30))
    if isinstance(x, torch.Generator):
        return torch.Generator()
    if is_jax_key(x):
        import jax

        return jax.random.key(rng.randrange(1 << 30))
    if isinstance(x, torch.nn.Module):
        import copy

        m = copy.deepcopy(x)
        with torch.no_grad():
            for t in m.state_dict().values():
                t.zero_() if t.is_floating_point() else None
        return m
    return None


def _leaf_target(rng: random.Random, x: Any, mode: str) -> Any:
    if mode == "none":
        return None
    if is_stateful(x):
        return _fresh(rng, x)
    if isinstance(x, torch.Tensor):
        if mode == "cross":
            return np.zeros(tuple(x.shape), np_dtype(TORCH_NAME[x.dtype]))
        if isinstance(x, torch.nn.Parameter):
            t = torch.zeros(tuple(x.shape), dtype=x.dtype)
            return torch.nn.Parameter(t, requires_grad=x.requires_grad)
        return _strided(rng, tuple(x.shape), lambda s: torch.zeros(s, dtype=x.dtype))
    if is_jax_array(x):
        return _jax_target(rng, x, mode)
    if isinstance(x, np.ndarray):
        dt = norm_np(x[:0] if x.ndim else x).dtype
        if mode == "cross" and dt.name in TORCH_DTYPES:
            return torch.zeros(x.shape, dtype=TORCH_DTYPES[dt.name])
        return _strided(rng, x.shape, lambda s: np.zeros(s, dt))
    return None if rng.random() < 0.5 else x


def _strided(rng: random.Random, shape: tuple[int, ...], zeros: Any) -> Any:
    """``zeros(shape)``, or a quarter of the time a non-contiguous view of that shape
    (transposed, or every other row), which an in-place load fills by a copy."""
    if not shape or not math.prod(shape) or rng.random() >= 0.25:
        return zeros(shape)
    if len(shape) > 1 and rng.random() < 0.5:
        z = zeros(shape[::-1])
        if isinstance(z, torch.Tensor):
            return z.permute(*reversed(range(len(shape))))
        return z.transpose()
    return zeros((2 * shape[0],) + shape[1:])[::2]


def _jax_target(rng: random.Random, x: Any, mode: str) -> Any:
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    if mode == "cross":
        return np.zeros(x.shape, x.dtype)
    shs = [NamedSharding(mesh(), P())]
    if x.ndim and x.shape[0] % 8 == 0 and x.shape[0]:
        shs.append(NamedSharding(mesh(), P("x")))
    if x.ndim == 2 and x.shape[1] % 8 == 0 and x.shape[1]:
        shs.append(NamedSharding(mesh(), P(None, "x")))
    sh = rng.choice(shs)
    if rng.random() < 0.5:
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)
    return jax.device_put(np.zeros(x.shape, x.dtype), sh)


def target_of(rng: random.Random, x: Any, mode: str) -> Any:
    """A target like ``x``: mode same (its kinds), none (all None), cross (NumPy for torch
    and JAX, torch for NumPy)."""
    if isinstance(x, dict):
        return {k: target_of(rng, v, mode) for k, v in x.items()}
    if is_record(x):
        return rebuild(x, [target_of(rng, v, mode) for _, v in record_fields(x)])
    if isinstance(x, list):
        return [target_of(rng, v, mode) for v in x]
    if isinstance(x, tuple):
        return tuple(target_of(rng, v, mode) for v in x)
    return _leaf_target(rng, x, mode)


def prune(rng: random.Random, t: Any) -> Any:
    """``t`` with some dict entries left out (a target that covers part of the state)."""
    if isinstance(t, dict):
        return {k: prune(rng, v) for k, v in t.items() if rng.random() < 0.7}
    if type(t) in (list, tuple):
        return type(t)(prune(rng, v) for v in t)
    return t


def _none_target(x: Any) -> Any:
    """What a None in the target gives for a saved x: the kind it was saved as."""
    if isinstance(x, np.generic) or is_generator(x):
        return x
    if isinstance(x, np.ndarray):
        return norm_np(x)
    if isinstance(x, torch.Tensor):
        return x.detach().contiguous()
    if isinstance(x, (torch.nn.Module, torch.optim.Optimizer)):
        return expect_none(x.state_dict())
    return x


def expect_none(x: Any) -> Any:
    """A whole subtree loaded into a None target."""
    if isinstance(x, dict):
        return {k: expect_none(v) for k, v in x.items()}
    if is_record(x):
        return {k: expect_none(v) for k, v in record_fields(x)}
    if isinstance(x, list):
        return [expect_none(v) for v in x]
    if isinstance(x, tuple):
        return tuple(expect_none(v) for v in x)
    return _none_target(x)


def _into_tensor(x: Any, t: torch.Tensor) -> torch.Tensor:
    src = np.array(expect_plain(x))
    r = t.detach().clone(memory_format=torch.contiguous_format)
    if src.size:
        r.reshape(-1).view(torch.uint8).copy_(torch.from_numpy(src.reshape(-1).view(np.uint8)))
    if isinstance(t, torch.nn.Parameter):
        return torch.nn.Parameter(r, requires_grad=t.requires_grad)
    return r


def expect_target(x: Any, t: Any) -> Any:
    """Expected result of loading x into target t."""
    if isinstance(x, dict) and isinstance(t, dict):  # a target covering part loads that part
        return {k: expect_target(v, t[k]) for k, v in x.items() if k in t}
    if is_record(x):
        return rebuild(t, [expect_target(v, tv) for (_, v), (_, tv) in zip(
            record_fields(x), record_fields(t))])
    if isinstance(x, (list, tuple)):
        return type(x)(expect_target(v, tv) for v, tv in zip(x, t))
    if t is None:
        return _none_target(x)
    if is_stateful(x):
        return x
    if isinstance(t, torch.Tensor):
        return _into_tensor(x, t)
    if isinstance(t, np.ndarray):
        return norm_np(np.asarray(expect_plain(x)))
    if is_jax_array(t) or type(t).__name__ == "ShapeDtypeStruct":
        import jax

        return jax.device_put(np.asarray(x), t.sharding)
    return x
