"""Saves of many small arrays per process: the commit's gather of every rank's records.

Each of N gloo processes saves K tensors of its own (``--per-rank``, 1 KiB each by
default), so every rank's part of the manifest (its files and one record per chunk)
is K records; the commit gathers the parts, rank 0 joins them into the manifest.
Every process times ``ss.save``: the first save of the launch (the plan agreed anew)
apart, then ``--repeats`` saves (the plan kept); the result is each save's slowest rank,
medians over repeats.

``--gather-only`` times the commit's exchange alone, both ways in the same processes,
alternated: every rank's part (``--per-rank`` chunk records) all-gathered and decoded by
every rank (before 2026-12-03), against gathered to rank 0 and decoded there.

To compare two source trees in the same run (``--src A --src B``), the trees are
alternated per round. Example (the parts gathered to rank 0 alone, against the commit
before)::

    git worktree add /tmp/old HEAD~1
    PYTHONPATH=src .venv/bin/python benchmarks/bench_parts.py --procs 4,8 \\
        --per-rank 5000 --rounds 3 --src /tmp/old/src --src src
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import free_port

HERE = Path(__file__).resolve().parent


def worker(rank: int, world: int, port: int, per_rank: int, elems: int, repeats: int,
           root: str) -> dict[str, object]:
    import datetime

    import torch
    import torch.distributed as dist

    import statestream as ss

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300))
    state = {f"r{rank}": {f"t{i}": torch.full((elems,), float(i)) for i in range(per_rank)}}
    coll = ss.TorchCollective(timeout_s=300)
    dist.barrier()
    t0 = time.perf_counter()
    ss.save(os.path.join(root, "warm"), state, collective=coll)  # agrees on the plan
    first = time.perf_counter() - t0
    times = []
    for i in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        ss.save(os.path.join(root, f"ck{i}"), state, collective=coll)
        times.append(time.perf_counter() - t0)
    dist.destroy_process_group()
    return {"rank": rank, "times": times, "first": first}


def gather_worker(rank: int, world: int, port: int, per_rank: int, repeats: int
                  ) -> dict[str, object]:
    import datetime

    import torch
    import torch.distributed as dist

    import statestream as ss
    from statestream.format import ChunkEntry, FileEntry
    from statestream.plan import RankPart

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300))
    coll = ss.TorchCollective(timeout_s=300)
    part = RankPart([FileEntry(f"data/r{rank}-{i}.bin", 1 << 30) for i in range(4)],
                    {rank * per_rank + a: [ChunkEntry(a % 4, a * 4096, 1024, 0x9E3779B9 ^ a,
                                                      (0,), (256,))]
                     for a in range(per_rank)})
    out: dict[str, list[float]] = {"all_gather": [], "gather": []}
    for i in range(repeats):
        for how in (("all_gather", "gather") if i % 2 == 0 else ("gather", "all_gather")):
            dist.barrier()
            t0 = time.perf_counter()
            if how == "all_gather":
                parts = [RankPart.from_wire(w) for w in coll.all_gather_object(part.to_wire())]
            else:
                wires = coll.gather_object(part.to_wire(), 0)
                parts = [RankPart.from_wire(w) for w in wires] if wires is not None else []
            dist.barrier()  # the exchange is over when the slowest rank is done
            out[how].append(time.perf_counter() - t0)
            del parts
    dist.destroy_process_group()
    return {"rank": rank, "times": out}


def run_gather(src: str, world: int, per_rank: int, repeats: int) -> dict[str, list[float]]:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.path.abspath(src))
    procs = [subprocess.Popen(
        [sys.executable, __file__, "--gather-worker",
         json.dumps([r, world, port, per_rank, repeats])],
        env=env, stdout=subprocess.PIPE, text=True) for r in range(world)]
    outs = [p.communicate(timeout=1200)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"a worker failed: {[p.returncode for p in procs]}")
    return json.loads(outs[0].strip().splitlines()[-1])["times"]


def run_world(src: str, world: int, per_rank: int, elems: int, repeats: int) -> list[float]:
    """Per repeat, the slowest rank's save time."""
    port = free_port()
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as root:
        env = dict(os.environ, PYTHONPATH=os.path.abspath(src))
        procs = [subprocess.Popen(
            [sys.executable, __file__, "--worker",
             json.dumps([r, world, port, per_rank, elems, repeats, root])],
            env=env, stdout=subprocess.PIPE, text=True) for r in range(world)]
        outs = [p.communicate(timeout=1200)[0] for p in procs]
        if any(p.returncode for p in procs):
            raise RuntimeError(f"a worker failed: {[p.returncode for p in procs]}")
    got = [json.loads(o.strip().splitlines()[-1]) for o in outs]
    per = [g["times"] for g in got]
    # the first save (the plan agreed anew) leads, then the repeats (the plan kept)
    return [max(g["first"] for g in got)] + [max(p[i] for p in per) for i in range(repeats)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--procs", default="4,8")
    ap.add_argument("--per-rank", type=int, default=5000, help="tensors per process")
    ap.add_argument("--elems", type=int, default=256, help="float32 elements per tensor")
    ap.add_argument("--repeats", type=int, default=3, help="timed saves per launch")
    ap.add_argument("--rounds", type=int, default=3, help="launches per tree and process count")
    ap.add_argument("--src", action="append", default=None, help="source tree(s) to compare")
    ap.add_argument("--out", default=None, help="JSON results")
    ap.add_argument("--gather-only", action="store_true",
                    help="time the parts' exchange alone: all-gather vs gather to rank 0")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--gather-worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        print(json.dumps(worker(*json.loads(args.worker))))
        return
    if args.gather_worker is not None:
        print(json.dumps(gather_worker(*json.loads(args.gather_worker))))
        return
    srcs = args.src or ["src"]
    res: dict[str, object] = {"command": " ".join(sys.argv), "runs": {}}
    if args.gather_only:
        gathered: dict[str, dict[str, list[float]]] = {}
        print(f"{args.per_rank} chunk records per process; the exchange (barrier to barrier), "
              "seconds, median [min-max]:")
        for world in [int(x) for x in args.procs.split(",")]:
            g = gathered[str(world)] = run_gather(srcs[-1], world, args.per_rank, args.repeats)
            a, b = statistics.median(g["all_gather"]), statistics.median(g["gather"])
            print(f"  procs {world}: all-gather + decode on every rank {a:.3f} "
                  f"[{min(g['all_gather']):.3f}-{max(g['all_gather']):.3f}], gather to rank 0 "
                  f"{b:.3f} [{min(g['gather']):.3f}-{max(g['gather']):.3f}]: {b / a:.2f}x",
                  flush=True)
        res["runs"] = gathered
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=1))
        return
    runs: dict[str, dict[str, list[float]]] = {}
    for world in [int(x) for x in args.procs.split(",")]:
        for rnd in range(args.rounds):
            order = srcs if rnd % 2 == 0 else srcs[::-1]
            for src in order:
                first, *t = run_world(src, world, args.per_rank, args.elems, args.repeats)
                runs.setdefault(f"{world}:{src}", {}).setdefault("times", []).extend(t)
                runs[f"{world}:{src}"].setdefault("first", []).append(first)
                print(f"procs {world} src {src} round {rnd}: first {first:.3f}, then "
                      + " ".join(f"{x:.3f}" for x in t), flush=True)
    print(f"\n{args.per_rank} tensors of {args.elems * 4} B per process; slowest rank's "
          "save, seconds, median [min-max]:")
    for key, v in runs.items():
        ts, fs = v["times"], v["first"]
        print(f"  procs {key}: {statistics.median(ts):.3f} [{min(ts):.3f}-{max(ts):.3f}]; "
              f"first save {statistics.median(fs):.3f} [{min(fs):.3f}-{max(fs):.3f}]")
    res["runs"] = runs
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
