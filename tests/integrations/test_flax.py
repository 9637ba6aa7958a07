"""Flax / optax states as people hold them: linen TrainState, NNX state, optax states."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
optax = pytest.importorskip("optax")
flax = pytest.importorskip("flax")

from flax import linen as nn  # noqa: E402
from flax import nnx, struct  # noqa: E402
from flax.training import train_state  # noqa: E402

import statestream as ss  # noqa: E402

pytestmark = pytest.mark.timeout(180)


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(1)(nn.tanh(nn.Dense(8)(x)))


def make_state(seed: int) -> train_state.TrainState:
    m = MLP()
    params = m.init(jax.random.PRNGKey(seed), jnp.ones((1, 4)))["params"]
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
    return train_state.TrainState.create(apply_fn=m.apply, params=params, tx=tx)


@jax.jit
def train_step(state, x, y):
    def loss_fn(p):
        return jnp.mean((state.apply_fn({"params": p}, x) - y) ** 2)

    grads = jax.grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads)


def batch(i: int):
    x = jax.random.normal(jax.random.PRNGKey(100 + i), (8, 4))
    return x, jnp.sin(x.sum(axis=1, keepdims=True))


def assert_trees_equal(a, b) -> None:
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    assert ta == tb
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        assert np.asarray(x).dtype == np.asarray(y).dtype


def test_train_state_saves_without_its_functions_and_resumes_exactly(tmp_path):
    state = make_state(0)
    for i in range(3):
        state = train_step(state, *batch(i))
    ss.save(tmp_path / "ts", state)
    md = ss.metadata(tmp_path / "ts")
    assert set(md.tree) == {"step", "params", "opt_state"}  # apply_fn, tx: not state

    fresh = make_state(1)  # other weights: the load must replace them
    got = ss.load(tmp_path / "ts", target=fresh)
    assert isinstance(got, train_state.TrainState)
    assert got.apply_fn is fresh.apply_fn and got.tx is fresh.tx  # the target's
    assert int(got.step) == 3
    assert_trees_equal(state.params, got.params)
    assert_trees_equal(state.opt_state, got.opt_state)
    assert isinstance(got.params["Dense_0"]["kernel"], jax.Array)

    # continuing from the loaded state is bitwise the continuation of the original
    a, b = state, got
    for i in range(3, 6):
        a, b = train_step(a, *batch(i)), train_step(b, *batch(i))
    assert_trees_equal(a.params, b.params)

    # without a target: plain containers of the state fields
    plain = ss.load(tmp_path / "ts")
    assert set(plain) == {"step", "params", "opt_state"}


def test_a_fresh_train_state_loads_into_its_abstract_target(tmp_path):
    # TrainState.create's step=0 is a Python int; jax.eval_shape(make_state) makes it a
    # 0-d ShapeDtypeStruct, and the load refused it ("the target has an array at key
    # path 'step' but the checkpoint holds a int there")
    state = make_state(0)
    ss.save(tmp_path / "ts", state)
    got = ss.load(tmp_path / "ts", target=jax.eval_shape(lambda: make_state(1)))
    assert isinstance(got.step, jax.Array) and got.step.dtype == jnp.int32
    assert int(got.step) == 0
    assert_trees_equal(state.params, got.params)
    got = train_step(got, *batch(0))  # trains on, as the state it was saved from
    assert int(got.step) == 1
    ss.save(tmp_path / "n", {"f": 2.5, "neg": -1})
    with pytest.raises(ss.TargetMismatchError, match="the checkpoint's float at key path 'f' "
                       "is 2.5, which the target's 0-d int32 JAX array cannot hold"):
        ss.load(tmp_path / "n", {"f": jax.ShapeDtypeStruct((), jnp.int32)}, items=["f"])
    with pytest.raises(ss.TargetMismatchError, match="key path 'neg' is -1"):
        ss.load(tmp_path / "n", {"neg": jnp.zeros((), jnp.uint8)}, items=["neg"])
    with pytest.raises(ss.TargetMismatchError, match="holds a int there"):  # not 0-d
        ss.load(tmp_path / "n", {"neg": jnp.zeros((1,), jnp.int32)}, items=["neg"])


def test_static_fields_of_plain_and_jax_dataclasses(tmp_path):
    @struct.dataclass
    class Holder:
        w: jax.Array
        name: str = struct.field(pytree_node=False, default="static")

    @dataclasses.dataclass
    class Registered:
        w: np.ndarray
        fn: object = dataclasses.field(default=print, metadata={"static": True})

    jax.tree_util.register_dataclass(Registered)
    ss.save(tmp_path / "d", {"h": Holder(jnp.arange(3.0), "saved-name"),
                             "r": Registered(np.ones(2), fn=len)})
    assert ss.metadata(tmp_path / "d").tree == {
        "h": {"w": ss.metadata(tmp_path / "d").tree["h"]["w"]},
        "r": {"w": ss.metadata(tmp_path / "d").tree["r"]["w"]},
    }
    got = ss.load(tmp_path / "d", target={"h": Holder(jnp.zeros(3), "target-name"),
                                          "r": Registered(np.zeros(2), fn=abs)})
    assert got["h"].name == "target-name" and got["r"].fn is abs
    np.testing.assert_array_equal(got["h"].w, [0.0, 1.0, 2.0])
    np.testing.assert_array_equal(got["r"].w, [1.0, 1.0])


def test_meta_fields_named_to_register_dataclass_are_not_state(tmp_path):
    # register_dataclass(cls, data_fields=[...], meta_fields=[...]) marks no field
    # metadata: its meta fields were saved (a function in one was refused) and a load
    # put the saved ones over the target's
    @dataclasses.dataclass
    class Layer:
        w: jax.Array
        act: object
        name: str

    jax.tree_util.register_dataclass(Layer, data_fields=["w"], meta_fields=["act", "name"])
    ss.save(tmp_path / "d", {"l": Layer(jnp.arange(2.0), jax.nn.relu, "saved")})
    assert set(ss.metadata(tmp_path / "d").tree["l"]) == {"w"}
    got = ss.load(tmp_path / "d", {"l": Layer(jnp.zeros(2), jax.nn.gelu, "target")})["l"]
    assert got.act is jax.nn.gelu and got.name == "target"
    np.testing.assert_array_equal(got.w, [0.0, 1.0])
    abstract = jax.eval_shape(lambda: Layer(jnp.zeros(2), jax.nn.gelu, "target"))
    assert ss.load(tmp_path / "d", {"l": abstract})["l"].name == "target"


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.lin = nnx.Linear(4, 8, rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.blocks = nnx.List([nnx.Linear(8, 8, rngs=rngs) for _ in range(2)])
        self.out = nnx.Linear(8, 1, rngs=rngs)
        # (no nnx.Dropout(rngs=...): a model holding typed JAX keys waits for the
        # generators item of issue 12)

    def __call__(self, x):
        h = self.bn(nnx.relu(self.lin(x)))
        for b in self.blocks:
            h = nnx.relu(b(h))
        return self.out(h)


def test_nnx_state_round_trips(tmp_path):
    model = Net(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, x, y):
        def loss_fn(m):
            return jnp.mean((m(x) - y) ** 2)

        grads = nnx.grad(loss_fn)(model)
        opt.update(model, grads)

    for i in range(3):
        step(model, opt, *batch(i))
    ss.save(tmp_path / "nnx", {"model": nnx.state(model), "opt": nnx.state(opt)})

    model2 = Net(nnx.Rngs(7))
    opt2 = nnx.Optimizer(model2, optax.adam(1e-2), wrt=nnx.Param)
    got = ss.load(tmp_path / "nnx", target={"model": nnx.state(model2), "opt": nnx.state(opt2)})
    assert isinstance(got["model"], nnx.State)
    nnx.update(model2, got["model"])
    nnx.update(opt2, got["opt"])
    assert_trees_equal(nnx.state(model), nnx.state(model2))
    assert_trees_equal(nnx.state(opt), nnx.state(opt2))  # incl. the step count and RNG counts

    for i in range(3, 5):
        step(model, opt, *batch(i))
        step(model2, opt2, *batch(i))
    assert_trees_equal(nnx.state(model), nnx.state(model2))


def test_nnx_modules_and_optimizers_save_as_their_state_and_load_in_place(tmp_path):
    """A module saved as it is recorded flax's bookkeeping ('model/_pytree__state' per
    module), so its checkpoint and its nnx.state's had other key paths: the state's
    did not load into the module, and a module's load built a new module instead of
    filling the one given. Both now save nnx.state's tree; either loads into either."""
    model = Net(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    grads = nnx.grad(lambda m: jnp.mean((m(batch(0)[0]) - batch(0)[1]) ** 2))(model)
    opt.update(model, grads)
    ss.save(tmp_path / "objects", {"model": model, "opt": opt})
    ss.save(tmp_path / "states", {"model": nnx.state(model), "opt": nnx.state(opt)})
    assert "_pytree__state" not in ss.metadata(tmp_path / "objects").tree["model"]
    def shapes(name):
        return {p: a.shape for p, a in ss.metadata(tmp_path / name).leaves()}

    assert shapes("objects") == shapes("states") and "model/lin/kernel/value" in shapes("states")
    for saved in ("objects", "states"):
        model2 = Net(nnx.Rngs(7))
        opt2 = nnx.Optimizer(model2, optax.adam(1e-2), wrt=nnx.Param)
        got = ss.load(tmp_path / saved, target={"model": model2, "opt": opt2})
        assert got["model"] is model2 and got["opt"] is opt2  # filled in place
        assert_trees_equal(nnx.state(model), nnx.state(model2))
        assert_trees_equal(nnx.state(opt), nnx.state(opt2))
        got = ss.load(tmp_path / saved, target={"model": nnx.state(Net(nnx.Rngs(8)))})
        assert_trees_equal(nnx.state(model), got["model"])
    abstract = nnx.eval_shape(lambda: Net(nnx.Rngs(0)))  # nothing allocated before the load
    got = ss.load(tmp_path / "objects", target={"model": abstract})
    assert got["model"] is abstract
    assert_trees_equal(nnx.state(model), nnx.state(abstract))
    part = Net(nnx.Rngs(9))
    before = np.asarray(part.out.kernel[...])
    ss.load(tmp_path / "objects", target={"model": part}, items=["model/lin"])
    np.testing.assert_array_equal(part.lin.kernel[...], model.lin.kernel[...])
    np.testing.assert_array_equal(part.out.kernel[...], before)  # not selected: as it was


def test_items_inside_an_nnx_state_target(tmp_path):
    # an nnx.State is a JAX pytree, not a dict: items= below it was refused ("at 'model'
    # it has a flax.nnx.statelib.State, which has no entry 'lin'", which it has)
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(3, 4, rngs=rngs)
            self.out = nnx.Linear(4, 1, rngs=rngs)

    model = Net(nnx.Rngs(0))
    ss.save(tmp_path / "c", {"model": nnx.state(model)})
    fresh = nnx.state(Net(nnx.Rngs(1)))
    got = ss.load(tmp_path / "c", {"model": fresh}, items=["model/lin/kernel"])
    assert list(got["model"]["lin"]) == ["kernel"]
    kernel = got["model"]["lin"]["kernel"]
    assert isinstance(kernel, nnx.Param)
    np.testing.assert_array_equal(kernel[...], model.lin.kernel[...])
    got = ss.load(tmp_path / "c", {"model": fresh}, items=["model/out"])
    np.testing.assert_array_equal(got["model"]["out"]["bias"][...], model.out.bias[...])


def test_nnx_dropout_keys_continue_after_a_load(tmp_path):
    """Typed JAX keys inside NNX state (Dropout's rngs) save and restore the stream."""

    class Net(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.lin = nnx.Linear(4, 4, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            return self.drop(self.lin(x))

    x = jnp.ones((2, 4))
    a = Net(nnx.Rngs(0))
    a(x)  # advance the dropout stream once before saving
    ss.save(str(tmp_path / "ck"), {"model": nnx.state(a)})
    b = Net(nnx.Rngs(1))  # other weights, other stream
    got = ss.load(str(tmp_path / "ck"), target={"model": nnx.state(b)})
    nnx.update(b, got["model"])
    for _ in range(3):  # the same masks, step after step
        assert np.array_equal(np.asarray(a(x)), np.asarray(b(x)))
