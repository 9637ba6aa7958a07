"""One configuration's saves of many small torch tensors, in a fresh process (stop 50).

Usage: ``PYTHONPATH=<tree>/src python ab_child.py TENSORS SAVES {sync,lazy,async}``;
prints the median time of saves 2.. (blocking phase for lazy/async) and the first.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

import statestream as ss


def main() -> None:
    n, saves, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    torch.manual_seed(0)
    state = {f"p{i}": torch.randn(256) for i in range(n)}
    d = tempfile.mkdtemp()
    res = []
    for i in range(saves):
        p = os.path.join(d, f"c{i % 2}")
        shutil.rmtree(p, ignore_errors=True)
        time.sleep(0.3)
        t = time.perf_counter()
        if mode == "sync":
            ss.save(p, state)
            res.append(time.perf_counter() - t)
        else:
            h = ss.save_async(p, state, lazy=mode == "lazy")
            res.append(time.perf_counter() - t)
            h.result()
    shutil.rmtree(d)
    print(mode, f"{statistics.median(res[1:]):.4f}", f"first {res[0]:.4f}")


if __name__ == "__main__":
    main()
