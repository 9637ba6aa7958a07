"""``ss.verify`` of a hashed checkpoint, hot (stop 50).

Usage: ``python verify_bench.py DIR make`` once, then
``PYTHONPATH=<tree>/src python verify_bench.py DIR <label>`` per tree.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import numpy as np

import statestream as ss


def make(p: str) -> None:
    rng = np.random.default_rng(0)
    ss.save(p, {f"w{i}": rng.standard_normal(16 << 20).astype(np.float32) for i in range(16)},
            hashes=True, overwrite=True)
    ss.save(p + "-z", {f"w{i}": rng.integers(0, 16, 16 << 20).astype(np.float32)
                       for i in range(4)}, hashes=True, compression="zstd", overwrite=True)


def main() -> None:
    p, label = sys.argv[1], sys.argv[2]
    if label == "make":
        make(p)
        return
    for path in (p, p + "-z"):
        ts = []
        for _ in range(4):
            t = time.perf_counter()
            r = ss.verify(path)
            ts.append(time.perf_counter() - t)
            assert r.ok
        runs = " ".join(f"{x:.3f}" for x in ts)
        print(label, os.path.basename(path), f"verify median {statistics.median(ts[1:]):.3f} s "
              f"({runs})")


if __name__ == "__main__":
    main()
