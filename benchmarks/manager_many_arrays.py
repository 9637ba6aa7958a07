#!/usr/bin/env python3
"""A ``CheckpointManager``'s cost per save beyond the save itself, on a state of many
small arrays (where reading a manifest again is what costs).

Each configuration runs in a fresh process and saves ``--steps`` steps of a state of
``--arrays`` float32 arrays of 16 values (64 B each, one changing per step); the time
of each save after the first is recorded, and the figure is their median:

- ``ss.save``: the plain save of the same state (the floor);
- ``manager``: ``CheckpointManager(async_save=False, keep_policy=KeepLatest(3))``;
- ``manager incremental=3``: the same with ``incremental=3`` (hashes, references).

``torch.save`` of the same state (as torch tensors) is timed in the same process as
the peer. Run a tree against another in turns (ABBA), e.g.::

    PYTHONPATH=/tmp/old/src .venv/bin/python benchmarks/manager_many_arrays.py --arrays 100000
    PYTHONPATH=src .venv/bin/python benchmarks/manager_many_arrays.py --arrays 100000
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any


def _state(n: int, step: int) -> dict[str, Any]:
    import numpy as np

    base = np.arange(16, dtype=np.float32)
    state = {f"layer{i // 100}/w{i % 100}": base + i for i in range(n)}
    state["layer0/w0"] = base + 1e6 * step  # one array changes each step
    return {"model": state, "step": step}


def child(config: str, arrays: int, steps: int, directory: str) -> dict[str, Any]:
    import statestream as ss

    times = []
    for step in range(steps):
        state = _state(arrays, step)
        if config == "torch.save":
            import torch

            state = {"model": {k: torch.from_numpy(v) for k, v in state["model"].items()},
                     "step": step}
        t0 = time.perf_counter()
        if config == "ss.save":
            ss.save(os.path.join(directory, f"step_{step}"), state)
        elif config == "torch.save":
            import torch

            torch.save(state, os.path.join(directory, f"step_{step}.pt"))
        else:
            if step == 0:
                mgr = ss.CheckpointManager(
                    directory, async_save=False, keep_policy=ss.KeepLatest(3),
                    incremental=3 if config.endswith("incremental=3") else False)
            mgr.save(step, state)
        times.append(time.perf_counter() - t0)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"config": config, "times": times, "peak_rss_mib": rss}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arrays", type=int, default=100_000)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--configs", default="ss.save,manager,manager incremental=3,torch.save")
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as d:
            print(json.dumps(child(args.child, args.arrays, args.steps, d)))
        return
    rows = []
    for rep in range(args.repeats):
        for config in args.configs.split(","):
            out = subprocess.run([sys.executable, __file__, "--child", config, "--arrays",
                                  str(args.arrays), "--steps", str(args.steps)],
                                 check=True, capture_output=True, text=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            r["repeat"] = rep
            rows.append(r)
            later = r["times"][1:]
            print(f"{config:24s} first {r['times'][0]:.3f} s, later median "
                  f"{statistics.median(later):.3f} s ({min(later):.3f}-{max(later):.3f}), "
                  f"peak RSS {r['peak_rss_mib']:.0f} MiB", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
