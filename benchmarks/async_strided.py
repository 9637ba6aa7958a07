#!/usr/bin/env python3
"""``save_async`` of a state of transposed (non-contiguous) torch tensors: blocking and
total time of three saves in one process, and its peak RSS.

Such arrays are copied chunk by chunk (their bytes are not contiguous in memory); since
stop 46 those copies are charged to the memory budget and written straight into the
staging buffers. Run each tree in a fresh process, in turns (ABBA), e.g.::

    PYTHONPATH=/tmp/base/src .venv/bin/python benchmarks/async_strided.py /tmp/ck
    PYTHONPATH=src .venv/bin/python benchmarks/async_strided.py /tmp/ck
"""

from __future__ import annotations

import resource
import shutil
import sys
import time

import torch

import statestream as ss


def main() -> None:
    directory = sys.argv[1] if len(sys.argv) > 1 else "bench-data-strided"
    torch.manual_seed(0)
    state = {f"w{i}": torch.randn(2048, 8192).t() for i in range(4)}  # 4 x 64 MiB
    runs = []
    for _ in range(3):
        shutil.rmtree(directory, ignore_errors=True)
        t0 = time.perf_counter()
        handle = ss.save_async(directory, state)
        t1 = time.perf_counter()
        handle.result()
        runs.append((t1 - t0, time.perf_counter() - t0))
    shutil.rmtree(directory, ignore_errors=True)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    print(" ".join(f"{b:.2f}/{t:.2f}" for b, t in runs), f"(blocking/total s), peak RSS {rss} MiB")


if __name__ == "__main__":
    main()
