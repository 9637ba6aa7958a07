#!/usr/bin/env python3
"""CPU seconds (user + system, every thread) and wall seconds of one incremental step.

Runs 10 incremental steps of bench_incremental's LoRA-like state in this process and
prints the medians as JSON; run it once per code version to compare two versions on
a loaded machine, where CPU time is steadier than wall time::

    PYTHONPATH=src .venv/bin/python benchmarks/bench_incremental_cpu.py default
    PYTHONPATH=/other/checkout/src .venv/bin/python benchmarks/bench_incremental_cpu.py default
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_incremental as b  # noqa: E402

import statestream as ss  # noqa: E402


def main() -> None:
    size = sys.argv[1] if len(sys.argv) > 1 else "default"
    root = tempfile.mkdtemp(prefix="bench-incr-cpu-")
    try:
        flat = b.build_state(size)
        state = b.nest(flat)
        ss.save(f"{root}/s0", state, hashes=True)
        prev = f"{root}/s0"
        wall, cpu = [], []
        for i in range(1, 11):
            b.train_step(flat, i, False)
            os.sync()
            r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            ss.save(f"{root}/s{i}", state, base=prev)
            t1, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
            wall.append(t1 - t0)
            cpu.append(r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime)
            if i > 1:  # s0 holds the frozen chunks; s(i-1) is no longer a base
                shutil.rmtree(prev)
            prev = f"{root}/s{i}"
        print(json.dumps({"size": size, "wall_s": statistics.median(wall),
                          "cpu_s": statistics.median(cpu)}))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
