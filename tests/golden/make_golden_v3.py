"""Write the format-v3 golden checkpoint into tests/golden/v3/table/.

Run from the repository root only when the golden files are meant to change
(they pin format v3; a change of format needs a new version, not new files):

    .venv/bin/python tests/golden/make_golden_v3.py

One checkpoint of :func:`golden_state`: 1,100 small arrays (so the writer picks
the array table) of several dtypes and kinds beside the v1 golden's state (0-d,
empty, scalar and byte leaves, plain values, one array under two keys: the
checked-in files hold it twice, written before NumPy arrays were tied; a rerun
now writes the second key as an alias leaf),
an array split into row blocks, and one compressed array (block checksums need
chunks over 1 MiB: tests/format/test_array_table.py covers them).
tests/format/test_golden_v3.py rebuilds the state and compares.
"""

from __future__ import annotations

import os
import shutil
import sys


def golden_state():
    """The state stored in tests/golden/v3/table."""
    import numpy as np

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from make_golden_v1 import golden_state as v1_state

    many = {f"layer{i:04d}": (np.arange(i % 7 + 1, dtype=np.float32) + i)
            for i in range(1100)}
    ints = {f"i{i}": np.full((2, i % 3), i, dtype=np.int64) for i in range(8)}
    tied = np.arange(6, dtype=np.float64).reshape(2, 3)
    return {
        "many": many,
        "ints": ints,
        "v1": v1_state(),
        "rows": np.arange(512, dtype=np.float32).reshape(64, 8),
        "zeros": np.zeros(4096, dtype=np.float32),
        "tied": {"a": tied, "b": tied},
    }


def main() -> int:
    import statestream as ss

    here = os.path.dirname(os.path.abspath(__file__))
    out = os.path.join(here, "v3", "table")
    if os.path.exists(out):
        shutil.rmtree(out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    # chunks of at most 512 bytes ("rows": 4 row blocks); "zeros": zstd
    ss.save(out, golden_state(), io=ss.IOOptions(max_chunk_bytes=512),
            compression={"zeros": "zstd"}, hashes=False)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
