"""``_tiles_exactly`` against a brute-force count of every element, on random layouts that
take each of its paths (one axis, a few boxes pairwise, many boxes by corner charges)."""

from __future__ import annotations

import numpy as np
import pytest

from statestream.format._tiles import _tiles_exactly


def _brute(starts: np.ndarray, ends: np.ndarray, shape: tuple[int, ...]) -> bool:
    count = np.zeros(shape, np.int64)
    for s, e in zip(starts, ends):
        count[tuple(slice(a, b) for a, b in zip(s, e))] += 1
    return bool(np.all(count <= 1))


def _grid(rng: np.random.Generator, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """A random exact tiling by a grid of cuts per axis."""
    cuts = [np.unique(np.concatenate([[0, n], rng.integers(1, n, size=rng.integers(0, 4))]))
            for n in shape]
    boxes = np.stack(np.meshgrid(*[np.arange(len(c) - 1) for c in cuts], indexing="ij"),
                     -1).reshape(-1, len(shape))
    starts = np.array([[cuts[a][i] for a, i in enumerate(b)] for b in boxes], np.int64)
    ends = np.array([[cuts[a][i + 1] for a, i in enumerate(b)] for b in boxes], np.int64)
    return starts, ends


@pytest.mark.parametrize("ndim", [1, 2, 3])
def test_random_layouts_agree_with_a_brute_force_count(ndim: int) -> None:
    rng = np.random.default_rng(ndim)
    for _ in range(300):
        shape = tuple(int(x) for x in rng.integers(2, 9, size=ndim))
        starts, ends = _grid(rng, shape)
        assert _tiles_exactly(starts, ends, shape)
        if len(starts) < 2:
            continue
        # move one box's start or end by one along one axis: often an overlap
        s2, e2 = starts.copy(), ends.copy()
        i, ax = int(rng.integers(len(s2))), int(rng.integers(ndim))
        if rng.random() < 0.5 and s2[i, ax] > 0:
            s2[i, ax] -= 1
        elif e2[i, ax] < shape[ax]:
            e2[i, ax] += 1
        assert _tiles_exactly(s2, e2, shape) == _brute(s2, e2, shape)
