#!/usr/bin/env python3
"""The blocking phase of ``save_async`` on a state of many small torch tensors, against
a synchronous save of the same state (issue 16 goal 2: never longer than a sync save).

Each configuration runs in a fresh process and saves the state ``--saves`` times
(alternating two directories); the figure is the median of the saves after the first
(the staging pool warm), with the range. ``torch.save`` of the same state is the peer.
Run a tree against another in turns (ABBA), e.g.::

    PYTHONPATH=/tmp/old/src .venv/bin/python benchmarks/async_small.py --tensors 20000
    PYTHONPATH=src .venv/bin/python benchmarks/async_small.py --tensors 20000
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any


def child(config: str, tensors: int, numel: int, saves: int, directory: str,
          pause: float = 0.0) -> dict[str, Any]:
    import torch

    import statestream as ss

    torch.manual_seed(0)
    state = {f"p{i}": torch.randn(numel) for i in range(tensors)}
    blocking, total = [], []
    for i in range(saves):
        path = os.path.join(directory, f"c{i % 2}")
        shutil.rmtree(path, ignore_errors=True)
        if os.path.exists(path + ".pt"):
            os.remove(path + ".pt")
        t0 = time.perf_counter()
        if config == "ss.save":
            ss.save(path, state)
        elif config == "torch.save":
            torch.save(state, path + ".pt")
        else:
            h = ss.save_async(path, state, lazy=config == "save_async lazy")
            blocking.append(time.perf_counter() - t0)
            h.result()
        total.append(time.perf_counter() - t0)
        time.sleep(pause)  # training between saves (the staging warms up meanwhile)
    return {"config": config, "blocking": blocking or total, "total": total}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", type=int, default=20_000)
    ap.add_argument("--numel", type=int, default=256, help="float32 values per tensor")
    ap.add_argument("--saves", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--configs", default="ss.save,save_async,save_async lazy,torch.save")
    ap.add_argument("--pause", type=float, default=0.0,
                    help="seconds between saves (0: each save right after the last commits)")
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as d:
            r = child(args.child, args.tensors, args.numel, args.saves, d, args.pause)
        print(json.dumps(r))
        return
    rows = []
    for rep in range(args.repeats):
        for config in args.configs.split(","):
            out = subprocess.run(
                [sys.executable, __file__, "--child", config, "--tensors", str(args.tensors),
                 "--numel", str(args.numel), "--saves", str(args.saves),
                 "--pause", str(args.pause)],
                check=True, capture_output=True, text=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            r["repeat"] = rep
            rows.append(r)
            b, t = r["blocking"][1:], r["total"][1:]
            print(f"{config:16s} blocking {statistics.median(b):.3f} s "
                  f"({min(b):.3f}-{max(b):.3f}), total {statistics.median(t):.3f} s "
                  f"({min(t):.3f}-{max(t):.3f}); first {r['blocking'][0]:.3f} / "
                  f"{r['total'][0]:.3f}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
