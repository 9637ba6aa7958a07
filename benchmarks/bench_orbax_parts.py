"""Reading parts of large Orbax storage chunks: peak anonymous RSS growth and time of
``ss.verify`` (2 x 256 MiB arrays) and ``ss.convert`` / ``ss.load`` (one 512 MiB array),
each array one zstd storage chunk (orbax's default), under a 64 MiB memory budget.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_orbax_parts.py verify|convert|load [DIR]

Run each case in a fresh process (3 times for medians); DIR keeps the checkpoints
between runs (default /tmp/bench-orbax-parts).
"""

from __future__ import annotations

import gc
import os
import shutil
import sys
import threading
import time

import numpy as np
import orbax.checkpoint as ocp

import statestream as ss


def _anon_mib() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) // 1024
    raise RuntimeError("no RssAnon")


def _save(path: str, state: dict) -> None:
    if not os.path.exists(path):
        ck = ocp.StandardCheckpointer()
        ck.save(path, state)
        ck.wait_until_finished()


def main(case: str, where: str) -> None:
    os.makedirs(where, exist_ok=True)
    two, big, tiny = (os.path.join(where, n) for n in ("two.orbax", "big.orbax", "tiny.orbax"))
    _save(two, {"a": np.arange(64 << 20, dtype=np.float32),
                "b": np.arange(64 << 20, dtype=np.float32) * 2})
    _save(big, {"w": np.arange(128 << 20, dtype=np.float32)})
    _save(tiny, {"w": np.arange(1 << 10, dtype=np.float32)})
    mem = ss.MemoryOptions(memory_budget_bytes=64 << 20)
    out = os.path.join(where, "out")
    shutil.rmtree(out, ignore_errors=True)
    ss.verify(tiny, memory=mem)  # imports, tensorstore's first use
    ss.load(tiny, memory=mem)
    gc.collect()
    base = peak = _anon_mib()
    stop = False

    def sample() -> None:
        nonlocal peak
        while not stop:
            peak = max(peak, _anon_mib())
            time.sleep(0.002)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    t0 = time.perf_counter()
    if case == "verify":
        assert ss.verify(two, memory=mem).ok
    elif case == "convert":
        ss.convert(big, out, memory=mem)
    else:
        ss.load(big, memory=mem)
    dt = time.perf_counter() - t0
    stop = True
    t.join()
    print(f"{case}: peak RssAnon +{peak - base} MiB in {dt:.1f} s")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "/tmp/bench-orbax-parts")
