"""Cold loads of arrays stored in several small chunks (what N processes write), one process.

A checkpoint of ``--arrays`` float32 arrays of ``--kib`` KiB each is saved in chunks of
``--chunk-kib`` (``IOOptions(max_chunk_bytes=...)``: each array in several row blocks, as
an array sharded over several processes is). Each round drops the page cache and loads
it in a fresh process with each source tree (``--src``, alternated per round); the time
is ``ss.load`` alone, medians over rounds. Example (A/B of two trees)::

    git worktree add /tmp/old HEAD~1
    PYTHONPATH=src .venv/bin/python benchmarks/cold_chunks.py --src /tmp/old/src --src src
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from _common import drop_caches

CHILD = r"""
import sys, time, json
import statestream as ss
path, map_files = sys.argv[1], sys.argv[2] == "1"
t0 = time.perf_counter()
out = ss.load(path, io=ss.IOOptions(map_files=map_files))
t = time.perf_counter() - t0
print(json.dumps({"s": t, "n": len(out)}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arrays", type=int, default=5000)
    ap.add_argument("--kib", type=int, default=64)
    ap.add_argument("--chunk-kib", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--map-files", action="store_true", help="IOOptions(map_files=True)")
    ap.add_argument("--src", action="append", default=None)
    ap.add_argument("--dir", default="/tmp/cold-chunks")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    srcs = args.src or ["src"]
    path = os.path.join(args.dir, f"ck-{args.arrays}x{args.kib}k-{args.chunk_kib}k")
    if not os.path.exists(path):
        sys.path.insert(0, os.path.abspath(srcs[-1]))
        import numpy as np

        import statestream as ss

        rng = np.random.default_rng(0)
        rows = args.kib * 1024 // (64 * 4)
        state = {f"a{i:05d}": rng.standard_normal((rows, 64)).astype(np.float32)
                 for i in range(args.arrays)}
        ss.save(path, state, io=ss.IOOptions(max_chunk_bytes=args.chunk_kib * 1024))
        del state
    times: dict[str, list[float]] = {s: [] for s in srcs}
    for r in range(args.rounds):
        for src in (srcs if r % 2 == 0 else srcs[::-1]):
            err = drop_caches()
            if err:
                raise SystemExit(f"cannot drop the page cache: {err}")
            env = dict(os.environ, PYTHONPATH=os.path.abspath(src))
            got = subprocess.run([sys.executable, "-c", CHILD, path,
                                  "1" if args.map_files else "0"],
                                 env=env, capture_output=True, text=True, check=True)
            t = json.loads(got.stdout.strip().splitlines()[-1])["s"]
            times[src].append(t)
            print(f"round {r} {src}: {t:.3f} s", flush=True)
    print(f"\n{args.arrays} arrays of {args.kib} KiB in {args.chunk_kib} KiB chunks, cold "
          f"load (map_files={args.map_files}), median [min-max] of {args.rounds}:")
    for src, ts in times.items():
        print(f"  {src}: {statistics.median(ts):.3f} [{min(ts):.3f}-{max(ts):.3f}]")
    if args.out:
        Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv), "times": times},
                                             indent=1))


if __name__ == "__main__":
    main()
