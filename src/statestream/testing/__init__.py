"""Test helpers for statestream users and its own test suite.

``statestream.testing.strategies`` (needs ``hypothesis``, imported on first use)
holds Hypothesis strategies for states
(trees of arrays and plain values, dtypes, shapes) and
:func:`assert_tree_equal`, an exact (bitwise) comparison of two states.
"""

from typing import Any

_STRATEGY_NAMES = frozenset({
    "SUPPORTED_DTYPE_NAMES", "array_leaves", "arrays", "assert_tree_equal", "dict_keys",
    "dtypes", "leaves", "plain_values", "shapes", "trees",
})


def __getattr__(name: str) -> Any:
    # Hypothesis is imported only when a strategy is asked for, so the fault
    # hooks and the storage suite work without it.
    if name in _STRATEGY_NAMES:
        from statestream.testing import strategies

        return getattr(strategies, name)
    raise AttributeError(f"module 'statestream.testing' has no attribute {name!r}")


__all__ = [
    "SUPPORTED_DTYPE_NAMES",
    "array_leaves",
    "arrays",
    "assert_tree_equal",
    "dict_keys",
    "dtypes",
    "leaves",
    "plain_values",
    "shapes",
    "trees",
]
