"""Test helpers for statestream users and its own test suite (needs ``hypothesis``).

``statestream.testing.strategies`` holds Hypothesis strategies for states
(trees of arrays and plain values, dtypes, shapes) and
:func:`assert_tree_equal`, an exact (bitwise) comparison of two states.
"""

from statestream.testing.strategies import (
    SUPPORTED_DTYPE_NAMES,
    array_leaves,
    arrays,
    assert_tree_equal,
    dict_keys,
    dtypes,
    leaves,
    plain_values,
    shapes,
    trees,
)

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
