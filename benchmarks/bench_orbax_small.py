"""Reading an Orbax checkpoint of many small arrays: ss.convert and ss.load against
orbax's own restore, in one process (warm page cache), medians of ``--repeats``.

Each array costs a fixed amount on every path (orbax opens a tensorstore per array for
its metadata, statestream opens it again to read it), so this is where reading Orbax
costs most per byte.

Usage (from the repo root)::

    PYTHONPATH=src .venv/bin/python benchmarks/bench_orbax_small.py --arrays 2000 --repeats 3
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arrays", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    warnings.simplefilter("ignore")
    import numpy as np
    import orbax.checkpoint as ocp

    import statestream as ss

    d = Path(tempfile.mkdtemp(prefix="bench-orbax-small-"))
    try:
        ck = ocp.StandardCheckpointer()
        ck.save(d / "o", {f"layer{i}": {"w": np.full((32, 32), i, np.float32)}
                          for i in range(a.arrays)})
        ck.wait_until_finished()
        times: dict[str, list[float]] = {"ss.convert": [], "ss.load": [], "orbax restore": []}
        for _ in range(a.repeats):
            shutil.rmtree(d / "out", ignore_errors=True)
            t = time.perf_counter()
            ss.convert(d / "o", d / "out")
            times["ss.convert"].append(time.perf_counter() - t)
            t = time.perf_counter()
            ss.load(d / "o")
            times["ss.load"].append(time.perf_counter() - t)
            t = time.perf_counter()
            ocp.StandardCheckpointer().restore(d / "o")
            times["orbax restore"].append(time.perf_counter() - t)
        print(f"command: `{' '.join([Path(sys.executable).name] + sys.argv)}`")
        print(f"{a.arrays} arrays of 4 KiB, medians [min-max] of {a.repeats}, s")
        for k, v in times.items():
            print(f"| {k} | {statistics.median(v):.2f} [{min(v):.2f}-{max(v):.2f}] |")
    finally:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
