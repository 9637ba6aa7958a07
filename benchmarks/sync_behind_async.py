"""Peak memory of a synchronous ``ss.save`` (or ``ss.load``) started while a
``save_async`` is in flight.

A 1 GiB state, a 256 MiB budget (both saves): ``h = save_async(a, state)``, then at
once ``save(b, other)``, then ``h.result()``. Reports VmHWM growth over the state
(a fresh process per run) and the host pool's high-water mark of lent staging bytes.
``other`` is the same state (``contiguous``: written straight from it), or a
transposed view of it (``transposed``: every chunk of the sync save is a copy, charged
to its budget). ``load``: instead of the sync save, ``ss.load`` of a zstd-compressed
256 MiB checkpoint saved beforehand, in place into a target allocated beforehand (so
the growth is transient memory only: the load's scratch for compressed chunks, the
staging). Compare source trees with --src OLD --src NEW. Run from the repository
root with the project venv::

    .venv/bin/python benchmarks/sync_behind_async.py --src /tmp/old/src --src src
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

_CHILD = r"""
import json, os, sys, time
import numpy as np
import statestream as ss
from statestream.engine import host_pool
d, kind, budget = sys.argv[1], sys.argv[2], int(sys.argv[3])
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
n = 1 << 28  # 1 GiB of float32
state = {f"w{i}": np.full(n // 16, i, np.float32) for i in range(16)}
big = np.arange(n, dtype=np.float32).reshape(1 << 14, 1 << 14)
other = state if kind == "contiguous" else {"t": big.T}
mem = ss.MemoryOptions(memory_budget_bytes=budget)
ss.save(os.path.join(d, "warm"), {"x": np.ones(8)})
if kind == "load":
    rng = np.random.default_rng(0)
    saved = {f"c{i}": rng.standard_normal(1 << 22, np.float32) for i in range(16)}
    ss.save(os.path.join(d, "c"), saved, compression="zstd")
    target = {k: np.zeros_like(v) for k, v in saved.items()}
before = hwm()
t0 = time.perf_counter()
h = ss.save_async(os.path.join(d, "a"), state, memory=mem)
t1 = time.perf_counter()
if kind == "load":
    ss.load(os.path.join(d, "c"), target, in_place=True, memory=mem)
else:
    ss.save(os.path.join(d, "b"), other, memory=mem)
t2 = time.perf_counter()
h.result()
t3 = time.perf_counter()
print(json.dumps({"growth_mib": (hwm() - before) / 2**20, "async_call_s": t1 - t0,
                  "sync_s": t2 - t1, "all_s": t3 - t0,
                  "pool_peak_lent_mib": host_pool().peak_lent_bytes / 2**20}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--src", action="append", default=[])
    ap.add_argument("--budget-mib", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--kind", action="append", default=[],
                    help="contiguous, transposed, load (default: all three)")
    args = ap.parse_args()
    srcs = args.src or ["src"]
    for kind in args.kind or ["contiguous", "transposed", "load"]:
        for r in range(args.repeats):
            for src in (srcs if r % 2 == 0 else srcs[::-1]):
                d = tempfile.mkdtemp(dir=os.environ.get("BENCH_DIR"))
                try:
                    env = dict(os.environ, PYTHONPATH=os.path.abspath(src))
                    out = subprocess.run([sys.executable, "-c", _CHILD, d, kind,
                                          str(args.budget_mib << 20)], env=env, check=True,
                                         capture_output=True, text=True).stdout
                    res = json.loads(out.strip().splitlines()[-1])
                    print(json.dumps({"src": src, "kind": kind, **{
                        k: round(v, 3) for k, v in res.items()}}))
                finally:
                    shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
