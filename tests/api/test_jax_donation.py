"""JAX training loops that donate their state (``jax.jit(..., donate_argnums=0)``).

A donated array is deleted by the step it is donated to. Saving such an array
(the state *before* the step, passed after it ran) cannot work; the error must
say which key path and why, on every path into the walk: ``ss.save``,
``ss.save_async`` and a lazy ``save_async`` (which takes a private copy first).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import statestream as ss

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")


def _save(path: Path, state: object, mode: str) -> None:
    if mode == "sync":
        ss.save(path, state)
    else:
        ss.save_async(path, state, lazy=mode == "lazy").result(timeout=120)


@pytest.mark.parametrize("mode", ["sync", "async", "lazy"])
def test_a_donated_array_is_refused_naming_its_key_path(tmp_path: Path, mode: str) -> None:
    step = jax.jit(lambda s: jax.tree.map(lambda a: a + 1, s), donate_argnums=0)
    old = {"params": {"w": jnp.arange(64, dtype=jnp.float32), "b": jnp.ones(3)}}
    new = step(old)
    assert old["params"]["w"].is_deleted()  # donation is effective on the CPU
    with pytest.raises(ss.UnsupportedTypeError) as info:
        _save(tmp_path / "old", {"step": 1, **old}, mode)
    msg = str(info.value)
    assert "key path 'params/" in msg and "donated" in msg and "has been deleted" in msg
    assert not os.path.exists(tmp_path / "old")
    # the state the step returned saves as usual
    _save(tmp_path / "new", new, mode)
    got = ss.load(tmp_path / "new")
    assert np.array_equal(np.asarray(got["params"]["w"]), np.arange(64, dtype=np.float32) + 1)


@pytest.mark.parametrize("mode", ["sync", "lazy"])
def test_an_array_deleted_by_hand_is_refused_naming_its_key_path(tmp_path: Path,
                                                                 mode: str) -> None:
    x = jnp.zeros((4, 4), jnp.bfloat16)
    x.delete()
    with pytest.raises(ss.UnsupportedTypeError, match=r"key path 'opt/0/mu'.*bfloat16\[4, 4\]"):
        _save(tmp_path / "c", {"opt": [{"mu": x}]}, mode)


@pytest.mark.parametrize("mode", ["sync", "lazy"])
def test_a_save_inside_a_jitted_function_is_refused_naming_its_key_path(
        tmp_path: Path, mode: str) -> None:
    # the arrays there are tracers: JAX's ConcretizationTypeError came out of the
    # deleted-array check, naming no key path
    @jax.jit
    def step(x: jax.Array) -> jax.Array:
        _save(tmp_path / "c", {"params": {"w": x}, "key": jax.random.key(0)}, mode)
        return x + 1

    with pytest.raises(ss.UnsupportedTypeError,
                       match=r"key path 'params/w': the jax\.Array \(float32\[3\]\) is a tracer"):
        step(jnp.ones(3))
    assert not os.path.exists(tmp_path / "c")


def test_a_committed_async_save_lets_go_of_the_state_before_warming_staging(
        tmp_path: Path) -> None:
    """After the commit the background thread maps staging buffers for the next save;
    it must not hold host views of the state meanwhile: on the CPU, JAX does not donate
    a buffer something else still views (the step copies instead)."""
    import threading

    from statestream import _hooks

    step = jax.jit(lambda s: jax.tree.map(lambda a: a + 1, s), donate_argnums=0)
    state = {"w": jnp.arange(1 << 16, dtype=jnp.float32)}
    seen: list[bool] = []
    done = threading.Event()

    def donate_now() -> None:  # runs on the background thread, the job still alive
        old = state["w"]
        state.update(step(state))
        seen.append(old.is_deleted())
        done.set()

    _hooks.register("async.warming", donate_now)
    try:
        ss.save_async(tmp_path / "c", {"w": state["w"]}).result(timeout=120)
        assert done.wait(60)  # the warming runs after result() returns
    finally:
        _hooks.clear()
    assert seen == [True]
    np.testing.assert_array_equal(np.asarray(ss.load(tmp_path / "c")["w"]),
                                  np.arange(1 << 16, dtype=np.float32))
