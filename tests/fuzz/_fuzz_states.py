"""Random states for the round-trip campaign (tests/fuzz/_fuzz_campaign.py).

Importing this module has no side effect: the JAX mesh is made on first use,
and the campaign's subprocess sets ``JAX_ENABLE_X64`` and ``XLA_FLAGS`` (8 CPU
devices) before JAX starts a backend. Everything is drawn from one
``random.Random``, so a seed replays its state exactly.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import random
from collections.abc import Callable, Iterator
from typing import Any

import ml_dtypes
import numpy as np
import torch

NP_DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
             "float16", "float32", "float64", "complex64", "complex128", "bfloat16",
             "float8_e3m4", "float8_e4m3", "float8_e4m3b11fnuz", "float8_e4m3fn",
             "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
             "float6_e2m3fn", "float6_e3m2fn", "float4_e2m1fn", "int2", "int4", "uint2", "uint4"]
SUBBITS = {"float6_e2m3fn": 6, "float6_e3m2fn": 6, "float4_e2m1fn": 4, "int2": 2, "int4": 4,
           "uint2": 2, "uint4": 4}
TORCH_DTYPES: dict[str, torch.dtype] = {
    "bool": torch.bool, "uint8": torch.uint8, "int8": torch.int8, "int16": torch.int16,
    "int32": torch.int32, "int64": torch.int64, "uint16": torch.uint16, "uint32": torch.uint32,
    "uint64": torch.uint64, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float32": torch.float32, "float64": torch.float64, "complex64": torch.complex64,
    "complex128": torch.complex128, "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2, "float8_e4m3fnuz": torch.float8_e4m3fnuz,
    "float8_e5m2fnuz": torch.float8_e5m2fnuz}
if hasattr(torch, "float8_e8m0fnu"):
    TORCH_DTYPES["float8_e8m0fnu"] = torch.float8_e8m0fnu
TORCH_NAME = {v: k for k, v in TORCH_DTYPES.items()}
JAX_DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
              "float16", "float32", "float64", "complex64", "complex128", "bfloat16",
              "float8_e4m3fn", "float8_e5m2", "int4", "uint4"]

FLOATS = [0.0, -0.0, 1.5, float("nan"), -float("nan"), float("inf"), float("-inf"), 5e-324,
          1.7976931348623157e308, -2.5e-10]
INTS = [0, 1, -1, 2**63, 2**64 + 5, -(2**70), 3**200, 2**31 - 1, -(2**63)]
STRS = ["", "a", "caf\u00e9", "\U0001f600", "a/b", "~0", "~1", "\ud800", "x" * 50, "\x00",
        "e\u0301", "\u202eRTL", "line\nbreak"]
KEYS = ["a", "b", "w", "a/b", "~", "~1", "", "\u00e9\u00e8", "0", "1", "model", "x.y", "/",
        "~0~1", "layers.0.weight", ".", "..", " ", "a b", "\x00", "\U0001f600", "\u00e9",
        "e\u0301", "\u202e", "\ud800", "k" * 300, "\u00fc" * 200, "-1", "__class__", "a//b"]
IKEYS = [0, 1, -1, 7, 2**70, -(2**64)]


NT = collections.namedtuple("NT", ["a", "b"])


@dataclasses.dataclass
class DC:
    """A dataclass node."""

    x: Any
    y: Any


@functools.cache
def pytree_class() -> type:
    """A JAX pytree (a registered dataclass with a static field), registered on first use."""
    import jax

    @jax.tree_util.register_dataclass
    @dataclasses.dataclass
    class PT:
        w: Any
        v: Any
        tag: str = dataclasses.field(default="s", metadata={"static": True})

    return PT


def is_record(x: Any) -> bool:
    """A namedtuple, dataclass or pytree node of these states."""
    return isinstance(x, (NT, DC)) or (pytree_class.cache_info().currsize > 0
                                      and type(x) is pytree_class())


def record_fields(x: Any) -> list[tuple[str, Any]]:
    if isinstance(x, NT):
        return list(zip(x._fields, x))
    if isinstance(x, DC):
        return [("x", x.x), ("y", x.y)]
    return [("w", x.w), ("v", x.v)]


def rebuild(x: Any, values: list[Any]) -> Any:
    """A record of x's type (and static fields) with these field values."""
    if isinstance(x, (NT, DC)):
        return type(x)(*values)
    return type(x)(*values, tag=x.tag)


@functools.cache
def mesh() -> Any:
    """The 8-device mesh (made on first use: the subprocess has set XLA_FLAGS by then)."""
    import jax
    from jax.sharding import Mesh

    return Mesh(np.array(jax.devices()[:8]), ("x",))


def np_dtype(name: str) -> np.dtype[Any]:
    if name != "bool" and hasattr(ml_dtypes, name) and not hasattr(np, name):
        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


def rand_array(rng: random.Random, name: str, shape: tuple[int, ...]) -> np.ndarray[Any, Any]:
    """Random bits of dtype ``name`` (valid bit patterns only), some NaN/-inf/-0.0."""
    dt = np_dtype(name)
    n = int(np.prod(shape)) if shape else 1
    raw = np.frombuffer(rng.randbytes(n * dt.itemsize), np.uint8).copy()
    if name == "bool":
        raw &= 1
    elif name in SUBBITS:
        raw &= (1 << SUBBITS[name]) - 1
    a = raw.view(dt).reshape(shape)
    if dt.kind == "f" and n and rng.random() < 0.5:
        flat = a.reshape(-1)
        for v in (float("nan"), float("-inf"), -0.0):
            try:
                flat[rng.randrange(n)] = v
            except (ValueError, OverflowError):
                pass
    return a


def rand_shape(rng: random.Random) -> tuple[int, ...]:
    if rng.random() < 0.03:
        return rng.choice([(300, 1100), (2100, 130)])
    return rng.choice([(), (0,), (3,), (2, 3), (4, 0, 2), (5, 4), (2, 3, 4), (1,), (17,),
                       (8, 3), (16,), (0, 0), (3, 0), (1, 1, 1, 1), (2, 1, 3, 1, 2)])


def _np_form(rng: random.Random, name: str, a: np.ndarray[Any, Any]) -> Any:
    form = rng.choice(["plain", "plain", "noncontig", "fortran", "swapped", "readonly",
                       "broadcast", "scalar", "transpose", "reversed", "broadcast0",
                       "swapped_view", "matrix", "from_jax"])
    if form == "noncontig" and a.ndim:
        return rand_array(rng, name, (a.shape[0] * 2,) + a.shape[1:])[::2]
    if form == "fortran" and a.ndim >= 2:
        return np.asfortranarray(a)
    swappable = a.dtype.kind in "iufc" and a.dtype.itemsize > 1 and \
        a.dtype.type.__module__ == "numpy"
    if form == "swapped" and swappable:
        return a.astype(a.dtype.newbyteorder(">"))
    if form == "swapped_view" and swappable and a.ndim:
        return a.astype(a.dtype.newbyteorder(">"))[::-1]
    if form == "readonly":
        a = a.copy()
        a.flags.writeable = False
        return a
    if form == "broadcast":
        return np.broadcast_to(rand_array(rng, name, (1, 3)), (1000, 3))
    if form == "broadcast0":  # every stride 0
        return np.broadcast_to(rand_array(rng, name, ()), rng.choice([(4,), (3, 5), (0, 2)]))
    if form == "scalar":
        return rand_array(rng, name, ())[()]
    if form == "transpose" and a.ndim >= 2:
        return a.T
    if form == "reversed" and a.ndim:
        return a[::-1, ...] if a.ndim == 1 or rng.random() < 0.5 else a[..., ::-2]
    if form == "from_jax" and name in ("float32", "int32", "uint8", "bfloat16"):
        import jax

        return np.asarray(jax.device_put(a))  # read-only, over JAX's buffer
    if form == "matrix" and a.ndim == 2 and name in ("float32", "int64", "float64"):
        return np.asmatrix(a)
    return a


def rand_numpy(rng: random.Random, name: str | None = None) -> Any:
    name = name or rng.choice(NP_DTYPES)
    return _np_form(rng, name, rand_array(rng, name, rand_shape(rng)))


def np_to_torch(a: Any, name: str) -> torch.Tensor:
    a = np.asarray(a)
    if a.size == 0:
        return torch.empty(a.shape, dtype=TORCH_DTYPES[name])
    raw = torch.frombuffer(bytearray(np.ascontiguousarray(a).tobytes()), dtype=torch.uint8)
    return raw.view(TORCH_DTYPES[name]).reshape(a.shape).clone()


def _torch_form(rng: random.Random, name: str, t: torch.Tensor) -> torch.Tensor:
    form = rng.choice(["plain", "plain", "view", "transpose", "expand", "channels_last",
                       "param", "grad", "nonleaf", "offset", "expand0", "unsqueezed", "conj",
                       "neg"])
    floating = t.is_floating_point()
    if form == "view" and t.ndim and t.shape[0] > 1:
        return t[1:]
    if form == "transpose" and t.ndim >= 2:
        return t.t() if t.ndim == 2 else t.transpose(0, 1)
    if form == "expand":
        return t.reshape(-1)[:1].expand(64, 1) if t.numel() else t
    if form == "expand0":  # a 0-d tensor expanded: every stride 0
        return t.reshape(-1)[0].expand(rng.choice([(3,), (2, 4)])) if t.numel() else t
    if form == "channels_last" and name != "bool":
        return np_to_torch(rand_array(rng, name, (2, 3, 2, 2)), name).contiguous(
            memory_format=torch.channels_last)
    if form == "param" and floating:
        return torch.nn.Parameter(t.clone(), requires_grad=rng.random() < 0.5)
    grad_ok = name in ("float32", "float64", "float16", "bfloat16")
    if form == "grad" and grad_ok:
        return t.clone().requires_grad_(True)
    if form == "nonleaf" and grad_ok:  # has a grad_fn, as an activation would
        return t.clone().requires_grad_(True) * 1
    if form == "offset" and t.numel() > 2:  # a view into the middle of a bigger storage
        return t.reshape(-1)[1:-1]
    if form == "unsqueezed":
        return t.unsqueeze(0)
    if form == "conj" and t.is_complex():  # a lazy conjugate: the bytes are not conjugated
        return t.conj()
    if form == "neg" and (t.is_complex() or floating) and name in ("float32", "float64",
                                                                    "complex64"):
        return torch._neg_view(t)  # a lazy negation, as torch makes for conj().imag
    return t


def rand_torch(rng: random.Random, name: str | None = None) -> torch.Tensor:
    name = name or rng.choice(list(TORCH_DTYPES))
    t = np_to_torch(rand_array(rng, name, rand_shape(rng)), name)
    return _torch_form(rng, name, t)


def rand_jax(rng: random.Random) -> Any:
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    name = rng.choice(JAX_DTYPES)
    shape = rng.choice([(8,), (16, 3), (8, 2), (3,), (), (0,), (0, 8), (8, 0), (1, 1)])
    a = rand_array(rng, name, shape)
    if shape and shape[0] % 8 == 0 and shape[0] and rng.random() < 0.7:
        sh = NamedSharding(mesh(), P("x"))
    elif len(shape) == 2 and shape[1] % 8 == 0 and shape[1] and rng.random() < 0.7:
        sh = NamedSharding(mesh(), P(None, "x"))
    else:
        sh = NamedSharding(mesh(), P())
    return jax.device_put(a, sh)


def rand_stateful(rng: random.Random, kinds: list[str]) -> Any:
    """A module, an optimizer or a random generator, of the frameworks in ``kinds``."""
    choices: list[Callable[[], Any]] = [
        lambda: random.Random(rng.randrange(1 << 30)),
        lambda: np.random.default_rng(rng.randrange(1 << 30)),
        lambda: np.random.RandomState(rng.randrange(1 << 30)),
    ]
    if "torch" in kinds:
        choices += [lambda: torch.Generator().manual_seed(rng.randrange(1 << 30)),
                    lambda: _module(rng), lambda: _optimizer(rng)]
    if "jax" in kinds:
        import jax

        choices.append(lambda: jax.random.key(rng.randrange(1 << 30)))
    return rng.choice(choices)()


def _module(rng: random.Random) -> torch.nn.Module:
    torch.manual_seed(rng.randrange(1 << 30))
    m = rng.choice([lambda: torch.nn.Linear(3, 2), lambda: torch.nn.BatchNorm1d(3),
                    lambda: torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(),
                                                torch.nn.Linear(2, 1, bias=False)),
                    lambda: torch.nn.Embedding(4, 3), _tied_lm])()
    if rng.random() < 0.3:
        m = m.to(rng.choice([torch.float64, torch.bfloat16, torch.float16]))
    return m


def _tied_lm() -> torch.nn.Module:
    """An embedding and an output layer that share their weight (tied weights)."""
    m = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
    m[1].weight = m[0].weight
    return m


def _optimizer(rng: random.Random) -> torch.optim.Optimizer:
    torch.manual_seed(rng.randrange(1 << 30))
    m = torch.nn.Linear(3, 2)
    opt: torch.optim.Optimizer = rng.choice([
        lambda: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
        lambda: torch.optim.Adam(m.parameters(), lr=1e-3),
        lambda: torch.optim.AdamW(m.parameters(), lr=1e-3, amsgrad=True)])()
    for _ in range(rng.randrange(3)):
        m(torch.ones(1, 3)).sum().backward()
        opt.step()
    return opt


def rand_leaf(rng: random.Random, kinds: list[str]) -> Any:
    makers: dict[str, Callable[[random.Random], Any]] = {
        "numpy": rand_numpy, "torch": rand_torch, "jax": rand_jax}
    r = rng.random()
    if r < 0.35:
        return makers[rng.choice(kinds)](rng)
    if r < 0.4:
        return rand_stateful(rng, kinds)
    return rng.choice([None, True, False, rng.choice(INTS), rng.choice(FLOATS),
                       rng.choice(STRS), rng.randbytes(rng.randrange(5)),
                       makers[rng.choice(kinds)](rng)])


def rand_key(rng: random.Random, allow_int_keys: bool) -> Any:
    if allow_int_keys and rng.random() < 0.25:
        return rng.choice(IKEYS)
    return rng.choice(KEYS)


def rand_tree(rng: random.Random, depth: int, kinds: list[str],
              allow_int_keys: bool = True) -> Any:
    if depth <= 0 or rng.random() < 0.25:
        return rand_leaf(rng, kinds)
    c = rng.random()
    n = rng.randrange(0, 4)
    sub = functools.partial(rand_tree, rng, depth - 1, kinds, allow_int_keys)
    if c < 0.5:
        return {rand_key(rng, allow_int_keys): sub() for _ in range(n)}
    if c < 0.7:
        return [sub() for _ in range(n)]
    if c < 0.85:
        return tuple(sub() for _ in range(n))
    if c < 0.93:
        return NT(sub(), sub())
    if "jax" in kinds and rng.random() < 0.5:
        return pytree_class()(sub(), sub(), tag=rng.choice(["s", "t"]))
    return DC(sub(), sub())


def deep_chain(rng: random.Random, kinds: list[str], depth: int) -> Any:
    """``depth`` nested dicts (or lists) around one leaf."""
    x = rand_leaf(rng, kinds)
    for _ in range(depth):
        x = {rand_key(rng, True): x} if rng.random() < 0.8 else [x]
    return x


def walk(x: Any, p: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """(key path, leaf) pairs, depth first; records by field name."""
    if isinstance(x, dict):
        for k, v in x.items():
            yield from walk(v, p + (k,))
    elif is_record(x):
        for k, v in record_fields(x):
            yield from walk(v, p + (k,))
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            yield from walk(v, p + (i,))
    else:
        yield p, x


def add_ties(rng: random.Random, state: dict[Any, Any]) -> dict[Any, Any]:
    """Tie some arrays: the same object under two keys, or a second view of its storage."""
    leaves = [v for _, v in walk(state) if isinstance(v, (np.ndarray, torch.Tensor))]
    if not leaves or rng.random() >= 0.5:
        return state
    v = rng.choice(leaves)
    how = rng.choice(["same", "same", "view", "reshape", "other_framework"])
    if how == "other_framework":  # torch.from_numpy / .numpy(): one memory, two kinds
        v = _other_framework_view(v)
    elif how == "view" and v.ndim and v.shape[0] > 1:
        v = v[1:]
    elif how == "reshape" and (v.is_contiguous() if isinstance(v, torch.Tensor)
                               else v.flags.c_contiguous):
        v = v.reshape(-1)
    state["tied"] = v
    if rng.random() < 0.3:
        state["tied2"] = {"deep": [v]}
    return state


def _other_framework_view(v: Any) -> Any:
    """The same memory as a tensor of the other framework, where one can be had."""
    if isinstance(v, np.ndarray):
        if type(v) is np.ndarray and v.dtype.isnative and v.dtype.name in TORCH_DTYPES and \
                v.flags.writeable and v.dtype.type.__module__ == "numpy" and \
                min(v.strides, default=0) >= 0:
            return torch.from_numpy(v)
        return v
    if not v.requires_grad and not v.is_neg() and not v.is_conj() and v.dtype in (
            torch.float32, torch.int64, torch.uint8, torch.bool, torch.float64, torch.int16):
        return v.numpy()
    return v


def rand_state(rng: random.Random, kinds: list[str], depth: int = 3,
               allow_int_keys: bool = True) -> dict[Any, Any]:
    state = {rng.choice(KEYS): rand_tree(rng, depth, kinds, allow_int_keys)
             for _ in range(rng.randrange(1, 4))}
    if rng.random() < 0.05:
        state["deep"] = deep_chain(rng, kinds, rng.choice([20, 60, 120]))
    return add_ties(rng, state)


def _bad_values() -> dict[str, Callable[[], Any]]:
    import datetime
    import decimal

    return {
        "datetime64 array": lambda: np.array(["2020-01-01"], "datetime64[D]"),
        "str array": lambda: np.array(["a", "bc"]),
        "object array": lambda: np.array([1, "a"], dtype=object),
        "structured array": lambda: np.zeros(3, dtype=[("a", "i4"), ("b", "f8")]),
        "masked array": lambda: np.ma.array([1, 2], mask=[0, 1]),
        "complex": lambda: 1 + 2j,
        "set": lambda: {1, 2},
        "bytearray": lambda: bytearray(b"ab"),
        "decimal": lambda: decimal.Decimal("1.5"),
        "datetime": lambda: datetime.datetime(2020, 1, 1),
        "sparse tensor": lambda: torch.eye(3).to_sparse(),
        "complex32 tensor": lambda: torch.zeros(2, dtype=torch.complex32),
        "meta tensor": lambda: torch.zeros(2, device="meta"),
        "tuple key": lambda: {(1, 2): 3},
        "bool key": lambda: {True: 1},
        "numpy int key": lambda: {np.int64(3): 1},
        "torch dtype": lambda: torch.float32,
        "function": lambda: len,
        "too deep": lambda: _deep(300),
    }


def _deep(n: int) -> Any:
    x: Any = 1
    for _ in range(n):
        x = {"d": x}
    return x


def bad_value(rng: random.Random) -> tuple[str, Any, Any]:
    """(what, a value save must refuse, the key to put it under)."""
    what, make = rng.choice(sorted(_bad_values().items()))
    return what, make(), rng.choice(["x", 3, "y.z"])
