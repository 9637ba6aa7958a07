#!/usr/bin/env python3
"""Peak RSS and time of ss.save / ss.save_async to S3 (moto in its own process).

Each measurement is a fresh process: it saves a small warm-up checkpoint (imports,
client set-up), then saves the state (one 256 MiB array, or 4,096 arrays of 64 KiB)
through a memory budget (32 MiB unless --budget-mib) and reports VmHWM growth, the
wall time to commit and, for save_async, the time the call blocked. Two source trees
can be compared in one run (--src OLD --src NEW, interleaved ABBA); medians and
ranges over --repeats. Run from the repository root with the project venv::

    .venv/bin/python benchmarks/bench_object_memory.py --repeats 3
    .venv/bin/python benchmarks/bench_object_memory.py --src /tmp/base/src --src src

Writes benchmarks/results/object-memory-<timestamp>.{json,md}; the markdown is printed.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MiB = 1 << 20

_CHILD = r'''
import json, sys, time
import numpy as np
import statestream as ss
from statestream.storage import S3Options, S3Storage, set_backend
opts, url, mode, shape, budget = (json.loads(sys.argv[1]), sys.argv[2], sys.argv[3],
                                  sys.argv[4], int(sys.argv[5]))
set_backend("s3", S3Storage(S3Options(**opts)))
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
size = 256 << 20
if shape == "one":
    state = {"w": np.arange(size // 4, dtype=np.int32)}
else:
    n = 4096
    state = {f"t{i}": np.full(size // 4 // n, i, np.int32) for i in range(n)}
ss.save(url + "-warm", {"x": np.ones(1024, np.float32)})
mem = ss.MemoryOptions(memory_budget_bytes=budget)
before = hwm()
t = time.perf_counter()
if mode == "sync":
    ss.save(url, state, memory=mem)
    block = time.perf_counter() - t
else:
    h = ss.save_async(url, state, memory=mem)
    block = time.perf_counter() - t
    h.result()
total = time.perf_counter() - t
growth = hwm() - before
key = "w" if shape == "one" else "t4095"
assert np.array_equal(ss.load(url, items=[key])[key], state[key])
print(json.dumps({"growth_mib": growth / 2**20, "total_s": total, "block_s": block}))
'''


def _server() -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = ("import logging, time\nfrom moto.server import ThreadedMotoServer\n"
            "logging.getLogger('werkzeug').setLevel(logging.ERROR)\n"
            f"s = ThreadedMotoServer(ip_address='127.0.0.1', port={port}, verbose=False)\n"
            "s.start()\ntime.sleep(1e9)\n")
    proc = subprocess.Popen([sys.executable, "-c", code])
    ep = f"http://127.0.0.1:{port}"
    import boto3

    client = boto3.client("s3", endpoint_url=ep, region_name="us-east-1",
                          aws_access_key_id="bench", aws_secret_access_key="bench")
    for _ in range(100):
        try:
            client.create_bucket(Bucket="bench")
            return proc, ep
        except Exception:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("moto did not start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", action="append", default=[],
                    help="a source tree (its src/ directory) to measure; repeat to compare")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget-mib", type=int, default=32)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    srcs = [str(Path(s).resolve()) for s in args.src] or [str(HERE.parent / "src")]
    proc, ep = _server()
    opts = dict(endpoint=ep, region="us-east-1", access_key_id="bench",
                secret_access_key="bench")
    samples: dict[str, list[dict[str, float]]] = {}
    try:
        for r in range(args.repeats):
            order = srcs if r % 2 == 0 else srcs[::-1]
            for shape in ("one", "small"):
                for mode in ("sync", "async"):
                    for src in order:
                        env = {**os.environ, "PYTHONPATH": src}
                        url = f"s3://bench/{shape}-{mode}-{r}-{time.time_ns()}"
                        out = subprocess.run(
                            [sys.executable, "-c", _CHILD, json.dumps(opts), url, mode, shape,
                             str(args.budget_mib * MiB)],
                            capture_output=True, text=True, timeout=900, env=env, check=False)
                        if out.returncode:
                            raise RuntimeError(out.stderr[-3000:])
                        got = json.loads(out.stdout.strip().splitlines()[-1])
                        samples.setdefault(f"{src}|{shape}|{mode}", []).append(got)
    finally:
        proc.kill()
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    lines = [f"# object-store save memory {stamp}", "",
             f"command: `{shlex.join([sys.executable, *sys.argv])}`", "",
             f"256 MiB of int32 to S3 (moto on loopback, own process), budget "
             f"{args.budget_mib} MiB, default IOOptions; medians [min-max] of {args.repeats}", "",
             "| tree | state | call | peak RSS growth MiB | commit s | blocked s |",
             "|---|---|---|---|---|---|"]
    for key, rs in samples.items():
        src, shape, mode = key.split("|")
        cells = []
        for f in ("growth_mib", "total_s", "block_s"):
            v = [x[f] for x in rs]
            cells.append(f"{statistics.median(v):.2f} [{min(v):.2f}-{max(v):.2f}]")
        name = "one 256 MiB array" if shape == "one" else "4,096 x 64 KiB"
        call = "ss.save" if mode == "sync" else "ss.save_async"
        lines.append(f"| {src} | {name} | {call} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    out = Path(args.out) if args.out else HERE / "results" / f"object-memory-{stamp}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps({"command": sys.argv, "samples": samples},
                                                   indent=1))
    print(text)


if __name__ == "__main__":
    main()
