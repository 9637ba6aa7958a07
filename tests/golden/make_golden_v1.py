"""Write the format-v1 golden checkpoint into tests/golden/v1/basic/.

Run from the repository root only when the golden files are meant to change
(they pin format v1; a change of format needs a new version, not new files):

    .venv/bin/python tests/golden/make_golden_v1.py

tests/api/test_api_golden.py rebuilds the same state independently and
compares it with what these files hold.
"""

from __future__ import annotations

import math
import os
import shutil
import sys


def golden_state():
    """The representative state stored in tests/golden/v1/basic."""
    import ml_dtypes
    import numpy as np

    return {
        "params": {
            "w": (np.arange(12, dtype=np.float32).reshape(3, 4) * 0.25 - 1.0),
            "b": np.array([-(2**62), -1, 0, 1, 2**62], dtype=np.int64),
            "bf": np.array([1.0, -2.5, math.inf, -math.inf, math.nan, 0.0, -0.0, 1 / 3],
                           dtype=ml_dtypes.bfloat16),
        },
        "zero_d": np.array(7.5, dtype=np.float64),
        "empty": np.zeros((0, 3), dtype=np.float32),
        "scalar": np.float32(1.5),
        "plain": {
            "none": None, "t": True, "f": False, "i": 42, "neg": -7, "big": 2**100,
            "x": 0.1, "nan": math.nan, "ninf": -math.inf, "nz": -0.0,
            "s": "h\u00e9llo \U0001f600", "bytes": b"\x00\x01\xff", "empty_bytes": b"",
        },
        "nested": {
            "list": [1, [2, (3, "x")], {"k": np.arange(3, dtype=np.uint8)}],
            "tuple": (np.ones(2, dtype=np.int16),),
            "empty": {"d": {}, "l": [], "t": ()},
        },
        "a/b": {"c.d": 1, "~": np.array([True, False])},
        "intkeys": {0: "zero", 1: "one"},
    }


def main() -> int:
    import statestream as ss

    here = os.path.dirname(os.path.abspath(__file__))
    out = os.path.join(here, "v1", "basic")
    if os.path.exists(out):
        shutil.rmtree(out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    ss.save(out, golden_state())
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
