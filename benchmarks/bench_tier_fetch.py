"""Bytes moved between nodes by a manager's local-tier load into sharded targets.

``python benchmarks/bench_tier_fetch.py [--procs 4] [--nodes 2] [--mib 64] [--src DIR]``

Starts ``--procs`` real processes (torch.distributed gloo, loopback); ranks are
spread over ``--nodes`` simulated nodes, each with its own local-tier directory
(ranks of one node share it). The job saves FSDP-like state (parameters and two
Adam-like moments as ``Shard(0)`` DTensors over all ranks, plus a step) through
``CheckpointManager(local_tier=...)``, then a new job (a resume) loads it into
targets of the same layout. Reported per node: the data bytes of its copy of
the step before and after that load (what came over the collective), the load's
wall time, and a check that the values are exact. ``--src`` picks the
statestream source tree the children import (to compare two versions).
Results go to ``benchmarks/results/tiers/fetch-<time>.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
REPO = HERE.parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _node_bytes(local: str, step: int) -> int:
    data = os.path.join(local, f"step_{step:010d}", "data")
    if not os.path.isdir(data):
        return 0
    return sum(os.path.getsize(os.path.join(data, n)) for n in os.listdir(data))


def _state(mesh: Any, mib: int, step: int) -> dict[str, Any]:
    import torch
    from torch.distributed.tensor import Shard, distribute_tensor

    rows = mib * (1 << 20) // 4 // 3 // 1024
    out: dict[str, Any] = {"step": step}
    for name, scale in (("param", 1.0), ("exp_avg", 0.5), ("exp_avg_sq", 0.25)):
        full = torch.arange(rows * 1024, dtype=torch.float32).reshape(rows, 1024) * scale + step
        out[name] = distribute_tensor(full, mesh, [Shard(0)])
    return out


def child(rank: int, world: int, port: int, root: str, nodes: int, mib: int,
          phase: str) -> dict[str, Any]:
    import datetime

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import statestream as ss

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300))
    mesh = init_device_mesh("cpu", (world,))
    node = rank * nodes // world
    local = os.path.join(root, f"node{node}")
    out: dict[str, Any] = {"rank": rank, "node": node}
    with ss.CheckpointManager(os.path.join(root, "persist"), local_tier=local) as mgr:
        if phase == "save":
            mgr.save(1, _state(mesh, mib, 1))
            mgr.wait()
        else:
            target = _state(mesh, mib, 0)
            out["before"] = _node_bytes(local, 1)
            dist.barrier()
            t0 = time.perf_counter()
            got = mgr.load(target=target)
            out["load_s"] = time.perf_counter() - t0
            out["after"] = _node_bytes(local, 1)
            want = _state(mesh, mib, 1)
            out["exact"] = bool(got["step"] == 1 and all(
                torch.equal(got[k].to_local(), want[k].to_local())
                for k in ("param", "exp_avg", "exp_avg_sq")))
    dist.destroy_process_group()
    return out


def run(src: str, procs: int, nodes: int, mib: int, root: str, phase: str) -> list[dict[str, Any]]:
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": src}
    ps = [subprocess.Popen([sys.executable, str(HERE), "--child", json.dumps(
        [r, procs, port, root, nodes, mib, phase])], env=env, stdout=subprocess.PIPE, text=True)
        for r in range(procs)]
    outs = []
    for p in ps:
        so, _ = p.communicate(timeout=600)
        if p.returncode:
            raise SystemExit(f"a child failed ({p.returncode})")
        outs.append(json.loads(so.strip().splitlines()[-1]))
    return outs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--src", default=str(REPO / "src"))
    ap.add_argument("--child")
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(*json.loads(a.child))))
        return 0
    root = tempfile.mkdtemp(prefix="tierfetch-")
    try:
        run(a.src, a.procs, a.nodes, a.mib, root, "save")
        res = run(a.src, a.procs, a.nodes, a.mib, root, "load")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    leaders = {}
    for r in res:
        leaders.setdefault(r["node"], r)
    lines = [f"# Local-tier load into sharded targets ({time.strftime('%Y%m%d-%H%M%S')})", "",
             f"Command: `benchmarks/bench_tier_fetch.py --procs {a.procs} --nodes {a.nodes} "
             f"--mib {a.mib} --src {a.src}`", "",
             "| node | copy before load | copy after load | moved to it |", "|---|---|---|---|"]
    for n, r in sorted(leaders.items()):
        lines.append(f"| {n} | {r['before'] / 2**20:.1f} MiB | {r['after'] / 2**20:.1f} MiB | "
                     f"{(r['after'] - r['before']) / 2**20:.1f} MiB |")
    lines += ["", f"load wall time (max over ranks): {max(r['load_s'] for r in res):.2f} s; "
              f"exact on every rank: {all(r['exact'] for r in res)}"]
    text = "\n".join(lines) + "\n"
    print(text)
    dest = REPO / "benchmarks" / "results" / "tiers" / f"fetch-{time.strftime('%Y%m%d-%H%M%S')}.md"
    dest.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
