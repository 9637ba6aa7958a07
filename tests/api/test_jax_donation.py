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
