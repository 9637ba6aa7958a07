"""Tests for statestream.providers.jax (JaxProvider, expand_pytree, rebuild_pytree)."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest

from statestream.errors import UnsupportedTypeError
from statestream.providers import (
    JaxProvider,
    array_provider_for,
    expand_pytree,
    provider_by_kind,
    rebuild_pytree,
    target_provider_for,
)

jax = pytest.importorskip("jax")
jnp = jax.numpy

P = JaxProvider()


@pytest.mark.parametrize(
    "arr",
    [
        jnp.arange(24, dtype=jnp.float32).reshape(4, 6),
        jnp.arange(24, dtype=jnp.float32).reshape(4, 6).T,  # a transposed (new) array
        jnp.arange(10, dtype=jnp.int32)[::3],
        jnp.asarray(2.5, dtype=jnp.float32),
        jnp.zeros((0, 3), jnp.float16),
        jnp.arange(6, dtype=jnp.bfloat16).reshape(2, 3),
        jnp.array([True, False]),
        jnp.array([1 + 2j], dtype=jnp.complex64),
    ],
)
def test_prepare_bytes(arr: Any) -> None:
    host = np.asarray(arr)
    prep = P.prepare(arr, ("j",))
    assert prep.kind == "jax"
    assert prep.shape == tuple(arr.shape)
    assert prep.copies is False
    assert prep.dtype == ("bfloat16" if host.dtype == ml_dtypes.bfloat16 else host.dtype.name)
    assert prep.chunk((0,) * host.ndim, host.shape).tobytes() == host.tobytes()
    if host.ndim == 2 and host.shape[0] > 1:
        assert prep.chunk((1, 0), (host.shape[0] - 1, host.shape[1])).tobytes() == \
            host[1:].tobytes()
        assert prep.chunk((0, 1), (host.shape[0], host.shape[1] - 1)).tobytes() == \
            np.ascontiguousarray(host[:, 1:]).tobytes()


@pytest.mark.parametrize("lazy", [False, True])
def test_an_accelerator_array_is_read_to_the_host_by_its_first_chunk(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch, lazy: bool) -> None:
    """Off the CPU, np.asarray of a single-device array is a device-to-host copy: prepare
    (the walk, all a lazy save blocks for) only starts it (copy_to_host_async), and the
    first chunk read waits for it, once. Run on the CPU with the device check forced."""
    import statestream as ss
    from statestream.providers import jax as pj

    monkeypatch.setattr(pj, "_host_view_is_free", lambda obj: False)
    reads: list[Any] = []
    real = pj._to_host
    monkeypatch.setattr(pj, "_to_host", lambda obj: reads.append(obj) or real(obj))
    arr = jnp.arange(24, dtype=jnp.float32).reshape(4, 6)
    prep = P.prepare(arr, ("j",))
    assert reads == [] and prep.dtype == "float32" and prep.copies is False
    assert prep.chunk((1, 0), (3, 6)).tobytes() == np.asarray(arr)[1:].tobytes()
    assert prep.chunk((0, 0), (1, 6)).tobytes() == np.asarray(arr)[:1].tobytes()
    assert len(reads) == 1
    state = {"w": jnp.arange(1 << 16, dtype=jnp.bfloat16).reshape(256, 256),
             "s": jnp.asarray(3, jnp.int32)}
    ss.save_async(tmp_path / "c", state, lazy=lazy,
                  io=ss.IOOptions(max_chunk_bytes=16 << 10)).result()
    got = ss.load(tmp_path / "c")
    for k, v in state.items():
        assert np.asarray(got[k]).tobytes() == np.asarray(v).tobytes(), k


def test_restore_default_is_a_jax_array() -> None:
    dest = P.restore("float32", (2, 2), None, ("j",))
    ((start, buf),) = dest.boxes
    assert start == (0, 0) and buf.dtype == np.float32
    buf[...] = [[1, 2], [3, 4]]
    out = dest.finish()
    assert isinstance(out, jax.Array) and out.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(out), [[1, 2], [3, 4]])


def test_restore_casts_to_shape_dtype_struct() -> None:
    like = jax.ShapeDtypeStruct((3,), jnp.bfloat16)
    assert P.is_target(like) and P.target_shape(like) == (3,)
    dest = P.restore("float32", (3,), like, ("j",))
    dest.boxes[0][1][...] = [1.0, 2.0, 3.0]
    out = dest.finish()
    assert isinstance(out, jax.Array) and out.dtype == jnp.bfloat16
    assert np.asarray(out, dtype=np.float32).tolist() == [1.0, 2.0, 3.0]


def test_restore_keeps_target_sharding() -> None:
    like = jnp.zeros(4, jnp.int32)
    dest = P.restore("int32", (4,), like, ("j",))
    dest.boxes[0][1][...] = np.arange(4)
    out = dest.finish()
    assert out.sharding == like.sharding
    assert np.asarray(out).tolist() == [0, 1, 2, 3]


def test_restore_scalar_and_empty() -> None:
    dest = P.restore("int32", (), None, ())
    dest.boxes[0][1][...] = 5
    out = dest.finish()
    assert out.shape == () and int(out) == 5
    assert P.restore("float32", (0, 2), None, ()).finish().shape == (0, 2)


def test_handles_and_registry() -> None:
    a = jnp.ones(3)
    assert P.handles(a) and not P.handles(np.ones(3))
    assert not P.is_target(np.ones(3))
    assert isinstance(array_provider_for(a), JaxProvider)
    assert isinstance(target_provider_for(a), JaxProvider)
    assert isinstance(target_provider_for(jax.ShapeDtypeStruct((1,), jnp.float32)), JaxProvider)
    assert isinstance(provider_by_kind("jax"), JaxProvider)


def test_unsupported_dtype_names_key_path() -> None:
    # float0 (the tangent dtype of integers) has no manifest name
    f0 = np.zeros(2, dtype=jax.dtypes.float0)
    with pytest.raises(UnsupportedTypeError, match="key path 'g/x'"):
        P.prepare(_Float0(f0), ("g", "x"))


class _Float0:
    """Array-like that np.asarray turns into a float0 array (jax.Array cannot hold one)."""

    def __init__(self, a: np.ndarray) -> None:
        self._a = a

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return self._a


@jax.tree_util.register_pytree_with_keys_class
class Pair:
    def __init__(self, left: Any, right: Any) -> None:
        self.left, self.right = left, right

    def tree_flatten_with_keys(self) -> Any:
        ga = jax.tree_util.GetAttrKey
        return ((ga("left"), self.left), (ga("right"), self.right)), "aux"

    def tree_flatten(self) -> Any:
        return (self.left, self.right), "aux"

    @classmethod
    def tree_unflatten(cls, aux: Any, children: Any) -> Pair:
        assert aux == "aux"
        return cls(*children)


def test_expand_and_rebuild_pytree() -> None:
    p = Pair(jnp.ones(2), {"k": 1})
    exp = expand_pytree(p)
    assert exp is not None
    assert exp.keys == ["left", "right"]
    assert exp.type_name.endswith("Pair")
    assert exp.children[0] is p.left and exp.children[1] is p.right
    back = rebuild_pytree(p, ["L", {"k": 2}])
    assert isinstance(back, Pair) and back.left == "L" and back.right == {"k": 2}


def test_expand_builtin_containers_one_level() -> None:
    exp = expand_pytree({"a": [1, 2], "b": 3})
    assert exp is not None and exp.keys == ["a", "b"] and exp.children == [[1, 2], 3]
    exp = expand_pytree((4, 5))
    assert exp is not None and exp.keys == ["0", "1"]


def test_expand_leaves_is_none() -> None:
    assert expand_pytree(jnp.ones(2)) is None
    assert expand_pytree(3) is None
    assert expand_pytree("s") is None


@jax.tree_util.register_pytree_with_keys_class
class Mixed:
    """A node whose children's path keys are 1 and "1": both named "1"."""

    def __init__(self, a: Any, b: Any) -> None:
        self.a, self.b = a, b

    def tree_flatten_with_keys(self) -> Any:
        dk = jax.tree_util.DictKey
        return ((dk(1), self.a), (dk("1"), self.b)), None

    def tree_flatten(self) -> Any:
        return (self.a, self.b), None

    @classmethod
    def tree_unflatten(cls, aux: Any, children: Any) -> Mixed:
        return cls(*children)


def test_a_pytree_whose_children_share_a_name_is_refused_when_saved(tmp_path: Any) -> None:
    """Such a save committed a tree node with one key twice, which loaded with one
    child dropped (and is now refused by every load): the save refuses it, naming it."""
    import statestream as ss

    with pytest.raises(UnsupportedTypeError, match=r"Mixed at key path 'm' has two "
                       r"children named '1'"):
        ss.save(tmp_path / "c", {"m": Mixed(np.zeros(2), np.ones(2))})
    assert not (tmp_path / "c").exists()
