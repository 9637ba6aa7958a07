#!/usr/bin/env python3
"""Multi-process benchmark: statestream vs. PyTorch DCP on FSDP2-style DTensors.

Run from the repo root with the project venv::

    .venv/bin/python benchmarks/bench_distributed.py --quick   # ~64 MiB, 1 repeat (~1 min)
    .venv/bin/python benchmarks/bench_distributed.py           # ~1 GiB, 3 repeats

N gloo processes on loopback (torch.multiprocessing.spawn) each hold a Shard(0)
slice of every tensor of a Llama-like fp32 state (a 1-D mesh over all ranks, as
FSDP2 lays parameters out). Measured, on rank 0, from a barrier before the call
to a barrier after it:

- save: ``ss.save(path, state)`` vs ``dcp.save(state, FileSystemWriter(path,
  sync_files=True, thread_count=k))`` for every k in ``--dcp-threads`` (both fsync);
- load (hot page cache, and cold after ``drop_caches``) into DTensors with the
  same sharding; DCP loads in place into preallocated DTensors, statestream
  returns new DTensors with the target's mesh/placements;
- reshard load: checkpoints written by the 4-process run are loaded by the
  2-process run into DTensors with the 2-process sharding.

DCP's reported number is its best configuration per row (the config column
says which). Every load is checked element-for-element once per config.
Outputs benchmarks/results/distributed-<date>[-quick].{json,md}.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime as _dt
import json
import os
import platform
import pstats
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from _common import drop_caches, free_port
from _common import llama_shapes as _llama

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SRC = REPO / "src"
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))
MiB = 1 << 20
GiB = 1 << 30

# ----------------------------------------------------------------------------------------
# Workload: deterministic values, so any rank can build or check any slice of any tensor.
# ----------------------------------------------------------------------------------------

_PERIOD = 4 * MiB  # elements (16 MiB of float32) of seeded random values, repeated
_BLOCK: np.ndarray | None = None


def _block() -> np.ndarray:
    global _BLOCK
    if _BLOCK is None:
        b = np.random.default_rng(12345).random(_PERIOD, dtype=np.float32) - 0.5
        _BLOCK = np.concatenate([b, b])
    return _BLOCK


def fill(tensor_index: int, flat_start: int, n: int) -> np.ndarray:
    """Elements [flat_start, flat_start + n) of the flattened tensor ``tensor_index``."""
    blk = _block()
    out = np.empty(n, dtype=np.float32)
    base = (tensor_index * 1_000_003 + flat_start) % _PERIOD
    pos = 0
    while pos < n:
        k = min(_PERIOD, n - pos)
        out[pos:pos + k] = blk[base:base + k]
        pos += k
    return out


def llama_shapes(quick: bool) -> list[tuple[str, tuple[int, ...]]]:
    """Llama-like parameters (float32): ~1.01 GiB full, ~63 MiB quick."""
    if quick:
        return _llama(512, 1408, 3, 8000)
    return _llama(1024, 2816, 16, 32000)


def nbytes_of(shapes) -> int:
    return sum(4 * int(np.prod(s)) for _, s in shapes)


# ----------------------------------------------------------------------------------------
# Worker (one per rank)
# ----------------------------------------------------------------------------------------


def _read_all(root: Path) -> None:
    """Read every file under ``root`` once (into the page cache)."""
    for dirpath, _, names in os.walk(root):
        for n in names:
            with open(os.path.join(dirpath, n), "rb") as f:
                while f.read(64 << 20):
                    pass


def _du(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            total += os.path.getsize(os.path.join(root, f))
    return total


def worker(rank: int, world: int, port: int, cfg: dict[str, Any]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    import statestream as ss

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    ss.TorchCollective()  # create (and cache) statestream's gloo group outside the timings
    shapes = [(k, tuple(s)) for k, s in cfg["shapes"]]
    total = nbytes_of(shapes)
    base = Path(cfg["dir"])
    keep = Path(cfg["keep_dir"])
    results: list[dict[str, Any]] = []
    profile_op = cfg.get("profile")

    def local_layout(shape):
        lshape, off = compute_local_shape_and_global_offset(shape, mesh, [Shard(0)])
        return tuple(lshape), tuple(off)

    def local_values(i, shape):
        lshape, off = local_layout(shape)
        row = int(np.prod(shape[1:])) if len(shape) > 1 else 1
        return torch.from_numpy(fill(i, off[0] * row, int(np.prod(lshape))).reshape(lshape))

    def make_state(zero: bool) -> dict[str, Any]:
        out = {}
        for i, (k, s) in enumerate(shapes):
            local = torch.zeros(local_layout(s)[0]) if zero else local_values(i, s)
            out[k] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                        shape=torch.Size(s),
                                        stride=torch.empty(s, device="meta").stride())
        return {"model": out}

    def check(loaded: dict[str, Any], what: str) -> None:
        for i, (k, s) in enumerate(shapes):
            t = loaded["model"][k]
            assert isinstance(t, DTensor) and t.placements == (Shard(0),), (what, k, type(t))
            if not torch.equal(t.to_local(), local_values(i, s)):
                raise AssertionError(f"{what}: wrong values in {k} on rank {rank}")

    def timed(op: str, system: str, config: str, fn, cold: bool, repeat: int,
              warm: Path | None = None) -> Any:
        note = None
        if cold:
            if rank == 0:
                note = drop_caches()
            dist.barrier()
        elif warm is not None:
            # "hot" = the checkpoint is in the page cache. A save does not leave it
            # there when it writes with O_DIRECT (statestream), so read it once first,
            # for every system alike.
            if rank == 0:
                _read_all(warm)
            dist.barrier()
        dist.barrier()
        prof = None
        if rank == 0 and profile_op and f"{system}:{op}" in profile_op.split(",") and repeat == 0:
            prof = cProfile.Profile()
            prof.enable()
        t0 = time.perf_counter()
        out = fn()
        dist.barrier()
        dt = time.perf_counter() - t0
        if prof is not None:
            prof.disable()
            path = base.parent / f"profile-{system}-{op.replace(' ', '_')}-{world}p.txt"
            with open(path, "w") as f:
                pstats.Stats(prof, stream=f).sort_stats("cumulative").print_stats(40)
            print(f"[bench] profile written to {path}", file=sys.stderr, flush=True)
        if rank == 0:
            results.append({"procs": world, "op": op, "system": system, "config": config,
                            "repeat": repeat, "seconds": dt, "bytes": total,
                            **({"drop_caches_error": note} if note else {})})
            print(f"[bench] {world}p {op:<22} {system:<11} {config:<14} r{repeat} "
                  f"{dt:7.3f}s {total / dt / 1e9:6.2f} GB/s", file=sys.stderr, flush=True)
        return out

    def rmtree(p: Path) -> None:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(p, ignore_errors=True)
        dist.barrier()

    state = make_state(zero=False)
    threads = cfg["dcp_threads"]
    colds = [False, True] if cfg["cold"] else [False]

    def ss_load(path, like):
        # in_place=True: fill the given DTensors, as dcp.load does (apples to apples)
        return ss.load(str(path), target=like, in_place=True)

    def dcp_save(path, k):
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path), sync_files=True,
                                                             thread_count=k))

    def dcp_load(path, like):
        dcp.load(like, storage_reader=dcp.FileSystemReader(str(path)))
        return like

    for r in range(cfg["repeats"]):
        # ---- save ------------------------------------------------------------------------
        ss_path = base / f"ss-{world}p-r{r}"
        timed("save", "statestream", "default", partial(ss.save, str(ss_path), state), False, r)
        dcp_paths = {}
        for k in threads:
            p = base / f"dcp-{world}p-t{k}-r{r}"
            dcp_paths[k] = p
            timed("save", "DCP", f"thread_count={k}",
                  partial(dcp_save, p, k), False, r)
        if rank == 0 and r == 0:
            results.append({"procs": world, "op": "disk_bytes", "statestream": _du(str(ss_path)),
                            **{f"DCP t{k}": _du(str(p)) for k, p in dcp_paths.items()}})

        # ---- load, same sharding -----------------------------------------------------------
        for cold in colds:
            op = "load (cold)" if cold else "load (hot)"
            like = make_state(zero=True)
            out = timed(op, "statestream", "default", partial(ss_load, ss_path, like), cold, r,
                        warm=ss_path)
            if r == 0:
                check(out, f"statestream {op}")
            del out
            for k in threads:
                like = make_state(zero=True)
                out = timed(op, "DCP", f"ckpt thread_count={k}",
                            partial(dcp_load, dcp_paths[k], like), cold, r, warm=dcp_paths[k])
                if r == 0:
                    check(out, f"DCP {op} t{k}")
                del out, like

        # ---- resharding load: checkpoints written by the 4-process run -------------------
        if cfg.get("reshard_from"):
            src = Path(cfg["reshard_from"])
            nsrc = cfg["reshard_procs"]
            for cold in colds:
                op = f"reshard {nsrc}->{world} " + ("(cold)" if cold else "(hot)")
                like = make_state(zero=True)
                out = timed(op, "statestream", "default", partial(ss_load, src / "ss", like),
                            cold, r, warm=src / "ss")
                if r == 0:
                    check(out, f"statestream {op}")
                del out
                for k in threads:
                    like = make_state(zero=True)
                    out = timed(op, "DCP", f"ckpt thread_count={k}",
                                partial(dcp_load, src / f"dcp-t{k}", like), cold, r,
                                warm=src / f"dcp-t{k}")
                    if r == 0:
                        check(out, f"DCP {op} t{k}")
                    del out, like

        # keep the last repeat's checkpoints for a later resharding run, delete the rest
        last = r == cfg["repeats"] - 1
        dist.barrier()
        if rank == 0:
            if last and cfg.get("keep"):
                keep.mkdir(parents=True, exist_ok=True)
                shutil.rmtree(keep / "ss", ignore_errors=True)
                ss_path.rename(keep / "ss")
                for k, p in dcp_paths.items():
                    shutil.rmtree(keep / f"dcp-t{k}", ignore_errors=True)
                    p.rename(keep / f"dcp-t{k}")
            for p in [ss_path, *dcp_paths.values()]:
                shutil.rmtree(p, ignore_errors=True)
        dist.barrier()

    if rank == 0:
        with open(cfg["result_file"], "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------
# Driver
# ----------------------------------------------------------------------------------------


def run_world(world: int, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp

    cfg = dict(cfg, result_file=str(Path(cfg["dir"]) / f"results-{world}p.json"))
    t0 = time.time()
    mp.spawn(worker, args=(world, free_port(), cfg), nprocs=world, join=True)
    print(f"[bench] {world} processes done in {time.time() - t0:.0f}s", file=sys.stderr)
    with open(cfg["result_file"]) as f:
        return json.load(f)


def summarize(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    keys = []
    for s in samples:
        if "seconds" in s and (s["procs"], s["op"]) not in keys:
            keys.append((s["procs"], s["op"]))
    for procs, op in keys:
        mine = [s for s in samples if s.get("procs") == procs and s.get("op") == op]
        nbytes = mine[0]["bytes"]
        med: dict[tuple[str, str], float] = {}
        for s in mine:
            med.setdefault((s["system"], s["config"]), [])  # type: ignore[arg-type]
        for key in med:
            med[key] = statistics.median(  # type: ignore[assignment]
                s["seconds"] for s in mine if (s["system"], s["config"]) == key)
        ss_s = med[("statestream", "default")]
        dcp = {c: v for (sysn, c), v in med.items() if sysn == "DCP"}
        best_cfg = min(dcp, key=dcp.get)  # type: ignore[arg-type]
        rows.append({
            "procs": procs, "op": op, "bytes": nbytes,
            "statestream_s": ss_s, "dcp_best_s": dcp[best_cfg], "dcp_best_config": best_cfg,
            "dcp_all_s": dcp, "ratio": dcp[best_cfg] / ss_s,
        })
    return rows


def markdown(rows, meta) -> str:
    gb = lambda n, s: n / s / 1e9  # noqa: E731
    lines = [
        f"# statestream vs PyTorch DCP, multi-process ({meta['date']})",
        "",
        f"Command: `{meta['command']}` (cwd `{REPO}`), git `{meta['git']}`",
        "",
        f"Machine: {meta['machine']}; torch {meta['torch']}; gloo on loopback, "
        f"DTensor Shard(0) over a 1-D mesh of all ranks; torch threads per process = "
        f"cores // procs.",
        f"State: {meta['tensors']} fp32 Llama-like parameters, {meta['bytes'] / GiB:.3f} GiB "
        f"({meta['bytes'] / 1e9:.3f} GB) in total, split across the processes. "
        f"Medians of {meta['repeats']} repeat(s), rank 0, barrier to barrier; "
        "GB/s = total state bytes / s. Cold = after `sync; echo 3 > /proc/sys/vm/drop_caches`.",
        "DCP: `FileSystemWriter(sync_files=True, thread_count=k)`, k in "
        f"{meta['dcp_threads']}; its best k per row is shown (loads read the checkpoint "
        "written with that k). ratio = DCP best s / statestream s (> 1: statestream faster).",
        "",
        "| procs | operation | statestream s (GB/s) | DCP best s (GB/s) | DCP config | ratio |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['procs']} | {r['op']} | {r['statestream_s']:.3f} "
            f"({gb(r['bytes'], r['statestream_s']):.2f}) | {r['dcp_best_s']:.3f} "
            f"({gb(r['bytes'], r['dcp_best_s']):.2f}) | {r['dcp_best_config']} | "
            f"**{r['ratio']:.2f}x** |")
    lines += ["", "All DCP configurations (median s):", ""]
    for r in rows:
        allc = ", ".join(f"{c}: {v:.3f}" for c, v in r["dcp_all_s"].items())
        lines.append(f"- {r['procs']}p {r['op']}: {allc}")
    t = meta.get("targets")
    if t:
        lines += ["", "Targets:", ""] + [f"- {x}" for x in t]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="~64 MiB state, 1 repeat")
    ap.add_argument("--repeats", type=int, default=None, help="default 3 (1 with --quick)")
    ap.add_argument("--procs", default="2,4", help="process counts (comma list)")
    ap.add_argument("--dcp-threads", default="1,2,4",
                    help="DCP FileSystemWriter thread_count values")
    ap.add_argument("--no-cold", action="store_true", help="skip cold-cache loads")
    ap.add_argument("--dir", default=str(REPO / "bench-data-dist"), help="scratch directory")
    ap.add_argument("--keep-data", action="store_true")
    ap.add_argument("--profile", default=None,
                    help="cProfile rank 0 in repeat 0 for these system:op pairs, e.g. "
                         "'statestream:save,statestream:load (hot)'; the report goes next to --dir")
    ap.add_argument("--out", default=None, help="JSON output path")
    args = ap.parse_args()

    repeats = args.repeats or (1 if args.quick else 3)
    procs = [int(x) for x in args.procs.split(",")]
    threads = [int(x) for x in args.dcp_threads.split(",")]
    shapes = llama_shapes(args.quick)
    base = Path(args.dir)
    if base.exists():
        shutil.rmtree(base)
    base.mkdir(parents=True)
    keep = base / "keep"
    cfg = {"shapes": shapes, "dir": str(base), "keep_dir": str(keep), "repeats": repeats,
           "dcp_threads": threads, "cold": not args.no_cold, "profile": args.profile}

    samples: list[dict[str, Any]] = []
    order = sorted(procs, reverse=True)  # the largest run writes the resharding source
    src_procs = order[0]
    for i, world in enumerate(order):
        c = dict(cfg, keep=(i == 0 and len(order) > 1))
        if i > 0:
            c.update(reshard_from=str(keep), reshard_procs=src_procs)
        samples += run_world(world, c)
    rows = summarize(samples)
    rank_op = ["save", "load (hot)", "load (cold)", "reshard"]
    rows.sort(key=lambda r: (r["procs"], next(i for i, o in enumerate(rank_op)
                                              if r["op"].startswith(o)), r["op"]))

    import torch

    date = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    try:
        git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                             capture_output=True, text=True).stdout.strip()
    except OSError:
        git = "?"
    cmd = " ".join(shlex.quote(a) for a in [os.path.relpath(sys.executable, REPO), *sys.argv])
    targets = []
    for r in rows:
        if r["op"] == "save":
            targets.append(f"{r['procs']}p save >= 1.3x DCP best: {r['ratio']:.2f}x -> "
                           f"{'MET' if r['ratio'] >= 1.3 else 'NOT MET'}")
        if r["op"].startswith("reshard"):
            targets.append(f"{r['procs']}p {r['op']} >= 2x DCP best: {r['ratio']:.2f}x -> "
                           f"{'MET' if r['ratio'] >= 2 else 'NOT MET'}")
    meta = {
        "date": date, "command": cmd, "git": git, "torch": torch.__version__,
        "machine": f"{platform.platform()}, {os.cpu_count()} CPUs",
        "bytes": nbytes_of(shapes), "tensors": len(shapes), "repeats": repeats,
        "dcp_threads": threads, "procs": procs, "quick": args.quick, "targets": targets,
    }
    md = markdown(rows, meta)
    out_dir = HERE / "results"
    out_dir.mkdir(exist_ok=True)
    stem = f"distributed-{date}" + ("-quick" if args.quick else "")
    jpath = Path(args.out) if args.out else out_dir / f"{stem}.json"
    jpath.write_text(json.dumps({"meta": meta, "rows": rows, "samples": samples}, indent=1))
    jpath.with_suffix(".md").write_text(md)
    print(md)
    print(f"[bench] wrote {jpath} and {jpath.with_suffix('.md')}", file=sys.stderr)
    if not args.keep_data:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
