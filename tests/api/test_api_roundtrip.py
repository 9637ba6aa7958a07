"""Round trips through ss.save / ss.load: every dtype, layout, framework, container."""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import shutil

import ml_dtypes
import numpy as np
import pytest

import statestream as ss
from statestream.testing import assert_tree_equal

torch = pytest.importorskip("torch")


def _roundtrip(tmp_path, state, target=None, name="ckpt", save_kw=None, **load_kw):
    p = tmp_path / name
    ss.save(p, state, **(save_kw or {}))
    return ss.load(p, target, **load_kw)


def _rt1(tmp_path, x, target=None, **kw):
    """Round trip one leaf under key 'x'."""
    t = None if target is None else {"x": target}
    return _roundtrip(tmp_path, {"x": x}, t, **kw)["x"]


# ----------------------------------------------------------------------------- numpy

_NP_DTYPES = [
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "complex64", "complex128",
]
_ML_NAMES = [
    n for n in [
        "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
        "float8_e4m3b11fnuz", "float8_e3m4", "float8_e4m3", "float8_e8m0fnu",
        "float6_e2m3fn", "float6_e3m2fn", "float4_e2m1fn", "int2", "int4", "uint2", "uint4",
    ] if hasattr(ml_dtypes, n)
]
_ALL_DTYPES = [np.dtype(n) for n in _NP_DTYPES] + [np.dtype(getattr(ml_dtypes, n))
                                                   for n in _ML_NAMES]


def _sample(dtype, shape, seed=0):
    """Deterministic values of ``dtype``; random bits where every pattern is valid."""
    n = math.prod(shape)
    rng = np.random.default_rng(seed)
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(bool)
    if dtype.itemsize >= 2 or dtype.name.startswith(("float8", "int8", "uint8")):
        return np.frombuffer(rng.bytes(n * dtype.itemsize), dtype=dtype).reshape(shape).copy()
    vals = rng.integers(0, 2, size=shape).astype(np.float32)
    return vals.astype(dtype)


@pytest.mark.parametrize("dtype", _ALL_DTYPES, ids=str)
def test_numpy_every_dtype(tmp_path, dtype):
    a = _sample(dtype, (3, 5))
    b = _rt1(tmp_path, a)
    assert b.dtype == dtype and b.shape == (3, 5)
    assert b.tobytes() == a.tobytes()
    assert_tree_equal(b, a)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "complex64",
                                   "complex128"])
def test_numpy_float_specials_bitwise(tmp_path, dtype):
    vals = [0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 1e-45, 65504.0, 1.5]
    a = np.array(vals, dtype=dtype)
    # a NaN with a payload
    if a.dtype.itemsize in (4, 8) and a.dtype.kind == "f":
        bits = a.view(f"u{a.dtype.itemsize}")
        bits[-1] = bits[4] | 1
    b = _rt1(tmp_path, a)
    assert b.tobytes() == a.tobytes()
    assert math.copysign(1.0, float(b[1].real)) == -1.0


def test_bfloat16_and_float8_specials(tmp_path):
    state = {
        "bf": np.array([0.0, -0.0, np.inf, np.nan, 1.0 / 3], dtype=ml_dtypes.bfloat16),
        "e4": np.array([0.0, -0.0, np.nan, 448.0, -2.0], dtype=ml_dtypes.float8_e4m3fn),
        "e5": np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 57344.0],
                       dtype=ml_dtypes.float8_e5m2),
    }
    assert_tree_equal(_roundtrip(tmp_path, state), state)


def test_numpy_layouts(tmp_path):
    base = np.arange(7 * 11, dtype=np.float64).reshape(7, 11)
    state = {
        "fortran": np.asfortranarray(np.arange(24, dtype=np.int32).reshape(2, 3, 4)),
        "strided": base[::2, 1::3],
        "negative_step": base[::-1, ::-2],
        "column": base[:, 3],
        "transposed": base.T,
        "broadcast": np.broadcast_to(np.arange(4.0), (3, 4)),
        "zero_d": np.array(3.25, dtype=np.float32),
        "empty1": np.zeros((0,), dtype=np.float32),
        "empty3": np.zeros((3, 0, 2), dtype=np.int16),
    }
    out = _roundtrip(tmp_path, state)
    assert_tree_equal(out, state)
    assert out["fortran"].flags.c_contiguous
    assert out["zero_d"].shape == () and type(out["zero_d"]) is np.ndarray


@pytest.mark.parametrize("dt", [">f4", ">f8", ">i2", ">i8", ">u4", ">c8", ">c16", ">f2"])
def test_numpy_big_endian_loads_little_endian(tmp_path, dt):
    a = (np.arange(12).reshape(3, 4) - 5).astype(dt)
    if a.dtype.kind == "u":
        a = np.arange(12).reshape(3, 4).astype(dt)
    b = _rt1(tmp_path, a)
    assert b.dtype == a.dtype.newbyteorder("<")
    assert b.dtype.byteorder in ("<", "=", "|")
    np.testing.assert_array_equal(b, a)
    # strided big-endian view
    c = _rt1(tmp_path, a[::2, ::-1], name="ckpt2")
    np.testing.assert_array_equal(c, a[::2, ::-1])


def test_numpy_scalars(tmp_path):
    state = {
        "f32": np.float32(1.5),
        "f64": np.float64(-0.0),
        "i8": np.int8(-7),
        "u64": np.uint64(2**64 - 1),
        "b": np.bool_(True),
        "c": np.complex64(1 - 2j),
        "bf": ml_dtypes.bfloat16(2.5),
        "nan": np.float32("nan"),
    }
    out = _roundtrip(tmp_path, state)
    assert type(out["f32"]) is np.float32 and out["f32"] == np.float32(1.5)
    assert_tree_equal(out, state)
    assert math.copysign(1.0, out["f64"]) == -1.0


# ----------------------------------------------------------------------------- torch

_TORCH_DTYPES = [
    getattr(torch, n) for n in [
        "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
        "float16", "bfloat16", "float32", "float64", "complex64", "complex128",
        "float8_e4m3fn", "float8_e5m2",
    ] if hasattr(torch, n)
]
_TORCH_TO_NP = {
    "bool": np.dtype(bool), "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
    "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
}


def _torch_sample(dtype, shape, seed=0):
    n = math.prod(shape)
    raw = np.random.default_rng(seed).bytes(n * dtype.itemsize)
    if dtype == torch.bool:
        return torch.from_numpy(np.frombuffer(raw, np.uint8) % 2 == 1).reshape(shape).clone()
    if not n:
        return torch.empty(shape, dtype=dtype)
    u8 = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return u8.view(dtype).reshape(shape).clone()


@pytest.mark.parametrize("dtype", _TORCH_DTYPES, ids=str)
def test_torch_every_dtype_with_target(tmp_path, dtype):
    t = _torch_sample(dtype, (4, 6))
    out = _rt1(tmp_path, t, target=torch.zeros(4, 6, dtype=dtype))
    assert type(out) is torch.Tensor
    assert_tree_equal(out, t)


@pytest.mark.parametrize("dtype", _TORCH_DTYPES, ids=str)
def test_torch_every_dtype_without_target_is_numpy(tmp_path, dtype):
    t = _torch_sample(dtype, (4, 6))
    out = _rt1(tmp_path, t)
    name = str(dtype).removeprefix("torch.")
    want = _TORCH_TO_NP.get(name, np.dtype(name) if name not in _TORCH_TO_NP else None)
    assert type(out) is np.ndarray
    assert out.dtype == want, (out.dtype, want)
    assert out.shape == (4, 6)
    assert out.tobytes() == t.contiguous().view(torch.uint8).numpy().tobytes()


def test_torch_bfloat16_without_target_is_ml_dtypes(tmp_path):
    t = torch.tensor([1.0, -2.5, float("inf")], dtype=torch.bfloat16)
    out = _rt1(tmp_path, t)
    assert out.dtype == np.dtype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(out.astype(np.float32), t.float().numpy())


def test_torch_views_zero_d_empty(tmp_path):
    base = torch.arange(5 * 7, dtype=torch.float32).reshape(5, 7)
    state = {
        "t": base.t(),
        "step": base[::2, 1::3],
        "narrow": base[:, 2],
        "expanded": torch.arange(3.0).expand(4, 3),
        "zero_d": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.empty(0, 3),
        "empty3": torch.empty(2, 0, 4, dtype=torch.int32),
        "conj": torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64).conj(),
        "neg": torch.tensor([1.0, -2.0]).neg().conj(),
    }
    target = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in state.items()}
    out = _roundtrip(tmp_path, state, target)
    for k, v in state.items():
        assert type(out[k]) is torch.Tensor
        assert out[k].dtype == v.dtype and out[k].shape == v.shape, k
        assert torch.equal(out[k], v.resolve_conj().resolve_neg()), k
    assert out["zero_d"].dim() == 0
    # without target the same views load as numpy arrays
    plain = ss.load(tmp_path / "ckpt")
    np.testing.assert_array_equal(plain["t"], base.t().numpy())
    np.testing.assert_array_equal(plain["conj"], state["conj"].resolve_conj().numpy())


def test_torch_parameter_target(tmp_path):
    p = torch.nn.Parameter(torch.randn(3, 2))
    for rg in (True, False):
        like = torch.nn.Parameter(torch.zeros(3, 2), requires_grad=rg)
        out = _rt1(tmp_path, p, target=like, name=f"c{rg}")
        assert isinstance(out, torch.nn.Parameter)
        assert out.requires_grad is rg
        assert torch.equal(out.detach(), p.detach())


def test_torch_target_dtype_differs(tmp_path):
    t = torch.randn(8, 3, dtype=torch.float32)
    out = _rt1(tmp_path, t, target=torch.zeros(8, 3, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, t.to(torch.bfloat16))
    # and a numpy target casts too
    out2 = ss.load(tmp_path / "ckpt", {"x": np.zeros((8, 3), np.float64)})["x"]
    assert out2.dtype == np.float64
    np.testing.assert_array_equal(out2, t.numpy().astype(np.float64))


def test_numpy_saved_torch_target(tmp_path):
    a = np.arange(6, dtype=np.int64).reshape(2, 3)
    out = _rt1(tmp_path, a, target=torch.empty(2, 3, dtype=torch.int64))
    assert type(out) is torch.Tensor
    assert torch.equal(out, torch.from_numpy(a))


# ----------------------------------------------------------------------------- jax


def test_jax_arrays(tmp_path):
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    x = jnp.arange(12, dtype=jnp.float32).reshape(3, 4) * 0.5
    y = jnp.array([1, 2, 3], dtype=jnp.int32)
    bf = jnp.array([1.0, 2.5, -3.0], dtype=jnp.bfloat16)
    state = {"x": x, "y": y, "bf": bf, "s": jnp.float32(7.0)}
    ss.save(tmp_path / "c", state)

    like = {"x": jnp.zeros((3, 4), jnp.float32), "y": jnp.zeros(3, jnp.int32),
            "bf": jnp.zeros(3, jnp.bfloat16), "s": jnp.zeros((), jnp.float32)}
    out = ss.load(tmp_path / "c", like)
    for k in state:
        assert isinstance(out[k], jax.Array), k
        assert out[k].dtype == state[k].dtype and out[k].shape == state[k].shape
        np.testing.assert_array_equal(np.asarray(out[k]), np.asarray(state[k]))

    sds = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in state.items()}
    out2 = ss.load(tmp_path / "c", sds)
    for k in state:
        assert isinstance(out2[k], jax.Array)
        assert_tree_equal(out2[k], state[k])

    plain = ss.load(tmp_path / "c")
    for k in state:
        assert type(plain[k]) is np.ndarray
        assert_tree_equal(plain[k], np.asarray(state[k]))
    assert plain["bf"].dtype == np.dtype(ml_dtypes.bfloat16)


def test_jax_registered_pytree(tmp_path):
    jax = pytest.importorskip("jax")
    jnp = jax.numpy

    @jax.tree_util.register_pytree_node_class
    class Pair:
        def __init__(self, a, b):
            self.a, self.b = a, b

        def tree_flatten(self):
            return (self.a, self.b), None

        @classmethod
        def tree_unflatten(cls, aux, children):
            return cls(*children)

    @jax.tree_util.register_dataclass
    @dataclasses.dataclass
    class Opt:
        mu: jax.Array
        count: jax.Array

    state = {"p": Pair(jnp.arange(3.0), jnp.ones((2, 2))),
             "o": Opt(mu=jnp.full((4,), 2.0), count=jnp.array(5, jnp.int32))}
    ss.save(tmp_path / "c", state)
    like = {"p": Pair(jnp.zeros(3), jnp.zeros((2, 2))),
            "o": Opt(mu=jnp.zeros(4), count=jnp.array(0, jnp.int32))}
    out = ss.load(tmp_path / "c", like)
    assert type(out["p"]) is Pair and type(out["o"]) is Opt
    assert_tree_equal(out["p"].a, state["p"].a)
    assert_tree_equal(out["p"].b, state["p"].b)
    assert_tree_equal(out["o"].mu, state["o"].mu)
    assert_tree_equal(out["o"].count, state["o"].count)
    # without a target: plain dicts of numpy arrays
    plain = ss.load(tmp_path / "c")
    assert isinstance(plain["p"], dict) and isinstance(plain["o"], dict)
    np.testing.assert_array_equal(plain["o"]["mu"], np.full((4,), 2.0, np.float32))


# ----------------------------------------------------------------------------- plain values


def test_plain_values(tmp_path):
    state = {
        "none": None, "t": True, "f": False,
        "zero": 0, "neg": -17, "big": 10**5000, "bigneg": -(2**4000), "i64": 2**63,
        "nan": float("nan"), "negnan": -float("nan"), "inf": float("inf"),
        "ninf": float("-inf"), "nzero": -0.0,
        "tiny": 5e-324, "pi": math.pi,
        "s": "héllo wörld \U0001f600 \u4e2d\u6587", "surrogate": "a\ud800b", "empty_s": "",
        "nul": "a\x00b",
        "bytes_empty": b"", "bytes_mib": os.urandom(1 << 20), "bytes_small": b"\x00\xff",
    }
    out = _roundtrip(tmp_path, state)
    assert_tree_equal(out, state)
    assert out["big"] == 10**5000 and out["bigneg"] == -(2**4000)
    assert math.isnan(out["nan"]) and math.isnan(out["negnan"])  # plain NaN: no sign kept
    assert math.copysign(1.0, out["nzero"]) == -1.0
    assert out["inf"] == math.inf and out["ninf"] == -math.inf
    assert out["t"] is True and out["f"] is False and out["none"] is None
    assert out["surrogate"] == "a\ud800b"
    assert type(out["bytes_mib"]) is bytes and len(out["bytes_mib"]) == 1 << 20


# ----------------------------------------------------------------------------- containers

Point = collections.namedtuple("Point", ["x", "y"])


@dataclasses.dataclass
class Config:
    lr: float
    steps: int
    w: np.ndarray
    tags: list = dataclasses.field(default_factory=list)


def _container_state():
    return {
        "nested": {"a": [1, (2.0, "three"), {"b": np.arange(3)}], "c": ((), [], {})},
        "nt": Point(np.float32(1.0), np.arange(2)),
        "dc": Config(lr=0.1, steps=3, w=np.ones((2, 2)), tags=["x", "y"]),
        "intkeys": {0: "zero", 1: np.array([1.0]), -5: None, 2**70: "huge"},
        "mixed": {1: "int one", "1": "str one"},
        "unicode": {"\u00e9t\u00e9": 1, "\U0001f600": 2, "\u4e2d": [3]},
        "weird": {"a/b": 1, "c.d": 2, "~": 3, "~1": 4, "/": 5, "..": 6, ".": 7, "": 8},
        "empty_dict": {}, "empty_list": [], "empty_tuple": (),
    }


def test_containers_without_target(tmp_path):
    state = _container_state()
    out = _roundtrip(tmp_path, state)
    expected = dict(state)
    expected["nt"] = {"x": state["nt"].x, "y": state["nt"].y}
    expected["dc"] = {"lr": 0.1, "steps": 3, "w": state["dc"].w, "tags": ["x", "y"]}
    assert_tree_equal(out, expected)
    assert type(out["nested"]["a"][1]) is tuple


def test_containers_with_target(tmp_path):
    state = _container_state()
    ss.save(tmp_path / "c", state)
    like = {
        "nt": Point(np.float32(0), np.zeros(2, dtype=np.int64)),
        "dc": Config(lr=0.0, steps=0, w=np.zeros((2, 2)), tags=["", ""]),
        "nested": {"a": [0, (0.0, ""), {"b": np.zeros(3, dtype=np.int64)}], "c": ((), [], {})},
    }
    out = ss.load(tmp_path / "c", like)
    assert type(out["nt"]) is Point
    assert type(out["dc"]) is Config
    assert_tree_equal(out["nt"], state["nt"])
    assert_tree_equal(out["dc"], state["dc"])
    assert_tree_equal(out["nested"], state["nested"])
    assert set(out) == set(like)


def test_keys_with_slash_load_by_items(tmp_path):
    state = {"a/b": {"x": 1}, "c.d": 2, "~": 3}
    ss.save(tmp_path / "c", state)
    assert ss.load(tmp_path / "c", items=["a/b"]) == {"a/b": {"x": 1}}
    assert ss.load(tmp_path / "c", items=["~"]) == {"~": 3}


# ----------------------------------------------------------------------------- stateful


def _assert_state_dict_equal(a, b, path=""):
    if isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), path
    elif isinstance(b, dict):
        assert isinstance(a, dict) and list(a) == list(b), (path, list(a), list(b))
        for k in b:
            _assert_state_dict_equal(a[k], b[k], f"{path}/{k}")
    elif isinstance(b, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_state_dict_equal(x, y, f"{path}/{i}")
    else:
        assert type(a) is type(b) and a == b, (path, a, b)


def _make_training(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 2)
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return model, opt, sched


class Counter:
    """A custom object following the state_dict protocol."""

    def __init__(self):
        self.n = 0
        self.history = []
        self.rng = np.zeros(4, dtype=np.uint32)

    def state_dict(self):
        return {"n": self.n, "history": list(self.history), "rng": self.rng.copy()}

    def load_state_dict(self, sd):
        self.n = sd["n"]
        self.history = list(sd["history"])
        self.rng = sd["rng"]


def test_stateful_torch_objects(tmp_path):
    model, opt, sched = _make_training(0)
    model.train()
    x = torch.randn(16, 4)
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    sched.step()
    counter = Counter()
    counter.n, counter.history, counter.rng[:] = 3, [1.5, "two"], [1, 2, 3, 2**32 - 1]
    ss.save(tmp_path / "c", {"model": model, "opt": opt, "sched": sched, "counter": counter,
                             "step": 1})

    model2, opt2, sched2 = _make_training(1)
    counter2 = Counter()
    target = {"model": model2, "opt": opt2, "sched": sched2, "counter": counter2, "step": 0}
    out = ss.load(tmp_path / "c", target)
    assert out["model"] is model2 and out["opt"] is opt2 and out["sched"] is sched2
    assert out["counter"] is counter2 and out["step"] == 1
    _assert_state_dict_equal(model2.state_dict(), model.state_dict())
    _assert_state_dict_equal(opt2.state_dict(), opt.state_dict())
    assert sched2.last_epoch == sched.last_epoch == 1
    assert sched2.state_dict() == sched.state_dict()
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert counter2.n == 3 and counter2.history == [1.5, "two"]
    np.testing.assert_array_equal(counter2.rng, counter.rng)
    # training continues identically from both
    model.eval(), model2.eval()
    assert torch.equal(model(x), model2(x))

    # without a target: plain dicts of numpy arrays
    plain = ss.load(tmp_path / "c")
    assert set(plain["model"]) == set(model.state_dict())
    np.testing.assert_array_equal(plain["model"]["0.weight"],
                                  model.state_dict()["0.weight"].numpy())
    assert plain["sched"]["last_epoch"] == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["same", "cast"])
def test_plain_tensor_target_that_requires_grad_comes_back_requiring_grad(tmp_path, dtype):
    # a learnable leaf outside any module (SAC's log_alpha): a Parameter target kept
    # requires_grad, a plain tensor target used to lose it
    ss.save(tmp_path / "c", {"log_alpha": torch.tensor([0.25, -1.0]), "frozen": torch.ones(2)})
    like = {"log_alpha": torch.zeros(2, dtype=dtype, requires_grad=True),
            "frozen": torch.zeros(2, dtype=dtype)}
    out = ss.load(tmp_path / "c", like)
    assert out["log_alpha"].requires_grad and out["log_alpha"].is_leaf
    assert out["log_alpha"].dtype == dtype and out["log_alpha"].tolist() == [0.25, -1.0]
    assert not out["frozen"].requires_grad
    out["log_alpha"].sum().backward()
    assert out["log_alpha"].grad.tolist() == [1.0, 1.0]


def test_load_into_a_meta_model_state_dict_then_assign(tmp_path):
    # meta-device init: the target gives shapes and dtypes, the data comes back on
    # the CPU (it used to be moved to the meta device, i.e. dropped)
    model, _, _ = _make_training(0)
    ss.save(tmp_path / "c", {"model": model})
    with torch.device("meta"):
        meta_model = _make_training(1)[0]
    got = ss.load(tmp_path / "c", {"model": meta_model.state_dict()})["model"]
    meta_model.load_state_dict(got, assign=True)
    assert all(t.device.type == "cpu" for t in meta_model.state_dict().values())
    _assert_state_dict_equal(meta_model.state_dict(), model.state_dict())


def test_load_into_a_meta_model_itself_assigns(tmp_path):
    # the module as the target: copying into meta parameters does nothing (torch only
    # warns), so the loaded tensors take their place (load_state_dict(assign=True))
    model, _, _ = _make_training(0)
    ss.save(tmp_path / "c", {"model": model})
    with torch.device("meta"):
        meta_model = _make_training(1)[0]
    out = ss.load(tmp_path / "c", {"model": meta_model})
    assert out["model"] is meta_model
    assert all(t.device.type == "cpu" for t in meta_model.state_dict().values())
    _assert_state_dict_equal(meta_model.state_dict(), model.state_dict())
    assert all(isinstance(p, torch.nn.Parameter) and p.requires_grad
               for p in meta_model.parameters())
    x = torch.randn(5, 4)
    assert torch.equal(meta_model(x), model(x))


class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.ones(4))
        self.inner = torch.nn.Module()
        self.inner.register_buffer("scale", self.scale)  # a tied buffer too


def test_a_tied_meta_model_stays_tied_when_loaded(tmp_path):
    # load_state_dict(assign=True) gives each name a Parameter of its own (torch
    # itself unties them); the load ties them again, as the target had them
    model = _Tied()
    with torch.no_grad():
        model.scale.mul_(3)
    ss.save(tmp_path / "c", {"model": model})
    with torch.device("meta"):
        meta = _Tied()
    assert meta.head.weight is meta.emb.weight
    ss.load(tmp_path / "c", {"model": meta})
    assert meta.head.weight is meta.emb.weight and meta.inner.scale is meta.scale
    assert len(list(meta.parameters())) == 1 and meta.emb.weight.device.type == "cpu"
    assert torch.equal(meta.emb.weight, model.emb.weight)
    assert torch.equal(meta.scale, torch.full((4,), 3.0))
    opt = torch.optim.SGD(meta.parameters(), lr=0.1)
    meta.head(meta.emb(torch.arange(3))).sum().backward()
    opt.step()
    assert torch.equal(meta.head.weight, meta.emb.weight)  # one parameter, one step


@pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
], ids=["adamw", "sgd-momentum"])
def test_in_place_load_into_a_fresh_optimizer_keeps_the_weights(tmp_path, make_opt):
    # A never-stepped optimizer's state is typed by its parameters (state hints);
    # an in-place load used to read exp_avg/momentum_buffer into the parameters'
    # own memory: the weights were overwritten and the load failed a checksum.
    model, _, _ = _make_training(0)
    opt = make_opt(model.parameters())
    model(torch.randn(16, 4)).pow(2).mean().backward()
    opt.step()
    ss.save(tmp_path / "c", {"model": model, "opt": opt})

    model2, _, _ = _make_training(1)
    opt2 = make_opt(model2.parameters())
    weights = [p.data_ptr() for p in model2.parameters()]
    ss.load(tmp_path / "c", {"model": model2, "opt": opt2}, in_place=True)
    assert [p.data_ptr() for p in model2.parameters()] == weights  # filled in place
    _assert_state_dict_equal(model2.state_dict(), model.state_dict())
    _assert_state_dict_equal(opt2.state_dict(), opt.state_dict())
    state_ptrs = {v.data_ptr() for s in opt2.state.values() for v in s.values()
                  if isinstance(v, torch.Tensor) and v.dim()}
    assert state_ptrs and not state_ptrs & set(weights)


# ----------------------------------------------------------------------------- partial loads


def _two_part_state():
    return {
        "params": {"w": np.arange(256, dtype=np.float32), "b": np.ones(4, dtype=np.float64)},
        "opt": {"m": np.full(1 << 18, 3, dtype=np.float32), "count": 5},
        "meta": {"name": "run"},
    }


def test_partial_target_loads_only_that_part(tmp_path):
    state = _two_part_state()
    ss.save(tmp_path / "c", state)
    seen = []
    out = ss.load(tmp_path / "c", {"params": {"w": np.zeros(256, dtype=np.float32)}},
                  progress=lambda done, total: seen.append(total))
    assert list(out) == ["params"] and list(out["params"]) == ["w"]
    np.testing.assert_array_equal(out["params"]["w"], state["params"]["w"])
    assert seen and max(seen) < state["opt"]["m"].nbytes  # the optimizer moment was not read


def _entry_offset(ckpt, path_keys):
    """(file name, offset, nbytes) of the first chunk of the array at ``path_keys``."""
    doc = json.loads((ckpt / "manifest.json").read_bytes())
    node = doc["tree"]
    for k in path_keys:
        node = node["c"][node["k"].index(k)]
    a = doc["arrays"][node["a"]]
    f, off, nb = a["chunks"][0][:3]
    return doc["files"][f][0], off, nb


def test_items_loads_only_that_checkpointable(tmp_path):
    state = _two_part_state()
    c = tmp_path / "c"
    ss.save(c, state)
    out = ss.load(c, items=["params"])
    assert list(out) == ["params"]
    assert_tree_equal(out["params"], state["params"])
    # damage the optimizer's bytes: loading params alone still works (they are not read)
    name, off, nb = _entry_offset(c, ["opt", "m"])
    with open(c / name, "r+b") as f:
        f.seek(off + nb // 2)
        f.write(b"\x01\x02\x03")
    out = ss.load(c, items=["params"])
    assert_tree_equal(out["params"], state["params"])
    out = ss.load(c, items=["params", "meta"], target={"params": {"b": np.zeros(4)}})
    assert list(out) == ["params", "meta"] and list(out["params"]) == ["b"]
    assert out["meta"] == {"name": "run"}
    with pytest.raises(ss.ChecksumMismatchError):
        ss.load(c, items=["opt"])


def test_metadata_reads_no_data(tmp_path):
    state = _two_part_state()
    state["params"]["bf"] = np.zeros((2, 3), dtype=ml_dtypes.bfloat16)
    state["t"] = torch.zeros(5, 2, dtype=torch.float16)
    state["blob"] = b"abc"
    c = tmp_path / "c"
    ss.save(c, state, io=ss.IOOptions(max_chunk_bytes=1 << 16))
    shutil.rmtree(c / "data")
    md = ss.metadata(c)
    assert md.format_version == 1
    w = md.tree["params"]["w"]
    assert isinstance(w, ss.ArrayMetadata)
    assert (w.shape, w.dtype, w.nbytes, w.kind) == ((256,), "float32", 1024, "numpy")
    assert md.tree["params"]["bf"].dtype == "bfloat16" and md.tree["params"]["bf"].nbytes == 12
    m = md.tree["opt"]["m"]
    assert m.nbytes == 4 << 18 and m.num_chunks == (4 << 18) // (1 << 16)
    assert md.tree["opt"]["count"] == 5
    assert (md.tree["t"].kind, md.tree["t"].dtype, md.tree["t"].shape) == ("torch", "float16",
                                                                            (5, 2))
    assert md.tree["blob"].kind == "bytes" and md.tree["blob"].nbytes == 3
    assert md.total_bytes == sum(a.nbytes for _, a in md.leaves()
                                 if isinstance(a, ss.ArrayMetadata))
    assert dict(md.leaves())["params/w"] == w
    with pytest.raises(ss.CheckpointCorruptError):
        ss.load(c)


# ----------------------------------------------------------------------------- chunks, budget


def test_large_array_many_chunks_tiny_budget(tmp_path):
    rng = np.random.default_rng(1)
    big = rng.standard_normal(100 * 1024 // 8)  # 100 KiB of float64
    small = {f"s{i}": rng.integers(0, 100, size=(i % 5,)).astype(np.int16) for i in range(300)}
    state = {"big": big, "small": small, "nc": big.reshape(128, 100)[::3, ::7],
             "be": big[:1000].astype(">f8")}
    c = tmp_path / "c"
    ss.save(c, state, io=ss.IOOptions(max_chunk_bytes=1024, num_threads=3),
            memory=ss.MemoryOptions(memory_budget_bytes=1))
    md = ss.metadata(c)
    assert md.tree["big"].num_chunks >= 100
    assert 1 <= len(md.files) <= 3
    assert len(os.listdir(c / "data")) == len(md.files)
    for budget in (1, 1000, None):
        out = ss.load(c, memory=ss.MemoryOptions(memory_budget_bytes=budget),
                      io=ss.IOOptions(max_request_bytes=4096, num_threads=2))
        assert_tree_equal(out, state)
    # loading into a strided / Fortran destination through a tiny budget
    tgt = {"big": np.zeros(big.shape), "nc": np.zeros(state["nc"].shape, order="F")}
    out = ss.load(c, tgt, memory=ss.MemoryOptions(memory_budget_bytes=1))
    assert_tree_equal(out["nc"], state["nc"])
    assert_tree_equal(out["big"], big)
    assert ss.verify(c, memory=ss.MemoryOptions(memory_budget_bytes=1)).ok


def test_many_small_arrays_packed_into_few_files(tmp_path):
    state = {f"a{i}": np.full((3,), i, dtype=np.int32) for i in range(2000)}
    c = tmp_path / "c"
    ss.save(c, state)
    md = ss.metadata(c)
    assert len(md.files) == 1
    assert_tree_equal(ss.load(c), state)


def test_non_contiguous_torch_tiny_budget(tmp_path):
    t = torch.arange(200 * 50, dtype=torch.float32).reshape(200, 50)
    state = {"t": t.t()[::2], "p": t[:, ::3]}
    c = tmp_path / "c"
    ss.save(c, state, io=ss.IOOptions(max_chunk_bytes=512),
            memory=ss.MemoryOptions(memory_budget_bytes=1))
    out = ss.load(c, {k: torch.empty(v.shape) for k, v in state.items()},
                  memory=ss.MemoryOptions(memory_budget_bytes=1))
    for k in state:
        assert torch.equal(out[k], state[k])


# ----------------------------------------------------------------------------- overwrite


def test_overwrite(tmp_path):
    c = tmp_path / "c"
    ss.save(c, {"v": 1, "a": np.zeros(3)})
    with pytest.raises(ss.CheckpointExistsError) as ei:
        ss.save(c, {"v": 2})
    assert isinstance(ei.value, FileExistsError) and isinstance(ei.value, ss.CheckpointError)
    assert str(c) in str(ei.value)
    assert ss.load(c)["v"] == 1
    ss.save(c, {"v": 3, "b": np.ones(2)}, overwrite=True)
    out = ss.load(c)
    assert out["v"] == 3 and list(out) == ["v", "b"]
    assert ss.verify(c).ok
    # no temp dirs or old copies left behind
    assert sorted(os.listdir(tmp_path)) == ["c"]


def test_overwrite_empty_dir_allowed_but_not_foreign_dir(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ss.CheckpointExistsError):
        ss.save(empty, {"v": 1})
    ss.save(empty, {"v": 1}, overwrite=True)
    assert ss.load(empty) == {"v": 1}

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("precious")
    (foreign / "sub").mkdir()
    (foreign / "sub" / "x.bin").write_bytes(b"\x00" * 10)
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(ss.CheckpointExistsError):
        ss.save(foreign, {"v": 2}, overwrite=True)
    assert (foreign / "notes.txt").read_text() == "precious"
    assert (foreign / "sub" / "x.bin").read_bytes() == b"\x00" * 10
    assert sorted(os.listdir(foreign)) == ["notes.txt", "sub"]
    assert sorted(os.listdir(tmp_path)) == before

    # a plain file is not replaced either
    f = tmp_path / "file"
    f.write_bytes(b"keep")
    with pytest.raises(ss.CheckpointExistsError):
        ss.save(f, {"v": 1}, overwrite=True)
    assert f.read_bytes() == b"keep"


def test_save_accepts_str_and_pathlike(tmp_path):
    ss.save(str(tmp_path / "s"), {"a": 1})
    assert ss.load(str(tmp_path / "s")) == {"a": 1}
    assert ss.load(tmp_path / "s") == {"a": 1}


def test_concurrent_saves_to_one_path(tmp_path):
    """Two saves racing for one new path: exactly one wins, the other is told, nothing leaks."""
    import threading

    results = []
    states = [{"who": i, "a": np.full(1 << 18, i, dtype=np.float64)} for i in range(2)]

    def go(i):
        try:
            ss.save(tmp_path / "race", states[i])
            results.append(("ok", i))
        except ss.CheckpointExistsError:
            results.append(("exists", i))

    threads = [threading.Thread(target=go, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r for r, _ in results) == ["exists", "ok"]
    winner = next(i for r, i in results if r == "ok")
    assert_tree_equal(ss.load(tmp_path / "race"), states[winner])
    assert os.listdir(tmp_path) == ["race"]


@pytest.mark.parametrize("state", [
    {}, [], (), np.arange(3.0), [1, "two", np.int8(3)], 5, None, b"raw", "text",
], ids=lambda s: type(s).__name__)
def test_non_dict_roots(tmp_path, state):
    c = tmp_path / "c"
    ss.save(c, state)
    assert_tree_equal(ss.load(c), state)
    assert ss.verify(c).ok


def test_stateful_root(tmp_path):
    m = torch.nn.Linear(3, 2)
    ss.save(tmp_path / "c", m)
    m2 = torch.nn.Linear(3, 2)
    assert ss.load(tmp_path / "c", m2) is m2
    _assert_state_dict_equal(m2.state_dict(), m.state_dict())
    assert list(ss.load(tmp_path / "c", items=["bias"])) == ["bias"]


def test_load_in_place_fills_the_target_objects(tmp_path) -> None:
    torch = pytest.importorskip("torch")
    path = tmp_path / "ck"
    ss.save(path, {"a": torch.arange(10.0), "n": np.arange(5), "b": torch.ones(3).bfloat16(),
                   "other_dtype": torch.arange(4.0)})
    target = {"a": torch.zeros(10), "n": np.zeros(5, np.int64),
              "b": torch.zeros(3).bfloat16(), "other_dtype": torch.zeros(4, dtype=torch.float64)}
    out = ss.load(path, target=target, in_place=True)
    assert out["a"] is target["a"] and torch.equal(target["a"], torch.arange(10.0))
    assert out["n"] is target["n"] and np.array_equal(target["n"], np.arange(5))
    assert out["b"] is target["b"] and torch.equal(target["b"], torch.ones(3).bfloat16())
    # another dtype: cast, then copied into the target (tests/api/test_in_place_copies.py)
    assert out["other_dtype"] is target["other_dtype"]
    assert torch.equal(target["other_dtype"], torch.arange(4.0, dtype=torch.float64))
    # without in_place the target is never modified
    fresh = {"a": torch.zeros(10)}
    out2 = ss.load(path, target=fresh)
    assert out2["a"] is not fresh["a"] and torch.equal(fresh["a"], torch.zeros(10))


def test_load_in_place_returns_empty_target_arrays_themselves(tmp_path) -> None:
    """An empty NumPy target came back as a new empty array under in_place=True (a torch
    target came back as itself), though the docstring says in_place returns the target's
    own objects (found by tests/fuzz/test_randomized_roundtrip.py, seed 200021)."""
    torch = pytest.importorskip("torch")
    path = tmp_path / "ck"
    ss.save(path, {"n0": np.zeros((0,), np.float32), "n2": np.zeros((4, 0, 2), np.int16),
                   "t": torch.zeros(0, 3), "n": np.arange(3)})
    target = {"n0": np.zeros((0,), np.float32), "n2": np.zeros((4, 0, 2), np.int16),
              "t": torch.zeros(0, 3), "n": np.zeros(3, np.int64)}
    out = ss.load(path, target=target, in_place=True)
    for k in target:
        assert out[k] is target[k], k
    cast = {"n0": np.zeros((0,), np.float64)}  # a dtype change: cast, copied in, itself
    out = ss.load(path, target=cast, in_place=True, items=["n0"])
    assert out["n0"] is cast["n0"] and out["n0"].dtype == np.float64
