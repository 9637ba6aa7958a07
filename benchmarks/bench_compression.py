#!/usr/bin/env python3
"""Compression benchmark: statestream zstd vs statestream uncompressed vs Orbax's default
(StandardCheckpointer: OCDBT + zstd through tensorstore), in one run.

Run from the repo root with the project venv::

    .venv/bin/python benchmarks/bench_compression.py            # 376 MB fp32 + 188 MB bf16, 3 repeats
    .venv/bin/python benchmarks/bench_compression.py --quick    # 65 MB + 33 MB, 1 repeat

Two workloads (deterministic, see ``build_state``):

- ``llama-fp32``: a Llama-like model (hidden 512, MLP 1376, 6 layers, vocab 12000) in
  float32 with Adam ``exp_avg`` and ``exp_avg_sq`` (3 x 125 MB). The parameters are
  trained-like weights kept in fp32 but carrying bf16 precision (N(0, 0.02) rounded to
  bfloat16, as after loading a bf16 checkpoint into fp32 master weights; norms near 1);
  the Adam moments have full fp32 mantissas (N(0, 1e-4) and its square), which is the
  hard case: only their sign/exponent bytes compress.
- ``llama-bf16``: the same model with parameters and both moments in bfloat16.

Random fp32 data barely compresses (about 8%), so neither workload is random noise;
both are what a fine-tuning job's checkpoint looks like byte for byte, not in values.

Every measurement runs in a fresh child process (``--child``): save (from NumPy arrays
for statestream, from CPU jax.Arrays for Orbax), then load into fresh memory, cold
(page cache dropped; root) and hot. Throughput is raw state bytes per second; the
checkpoint size is every file under its directory. Medians (and ranges) over repeats.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import platform
import shlex
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
from _common import drop_caches, llama_shapes, med, run_child
from bench_core import RssSampler

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SRC = REPO / "src"

SYSTEMS = ["statestream", "statestream-zstd", "statestream-zstd-noshuffle", "orbax-zstd"]
WORKLOADS = ["llama-fp32", "llama-bf16"]


def shapes(quick: bool) -> list[tuple[str, tuple[int, ...]]]:
    params = llama_shapes(256, 688, 3, 6000) if quick else llama_shapes(512, 1376, 6, 12000)
    out = [(f"params/{k}", s) for k, s in params]
    out += [(f"opt/exp_avg/{k}", s) for k, s in params]
    out += [(f"opt/exp_avg_sq/{k}", s) for k, s in params]
    return out


_BASE: dict[int, np.ndarray] = {}


def _gauss(n: int, i: int) -> np.ndarray:
    """``n`` N(0, 1) float32 values: a window (offset by tensor number ``i``) of a seeded
    block, so building a state costs a copy, not a random number per element."""
    if 0 not in _BASE:
        b = np.random.default_rng(2026).standard_normal(1 << 23, dtype=np.float32)
        _BASE[0] = np.concatenate([b, b])
    blk = _BASE[0]
    period = blk.size // 2
    out = np.empty(n, np.float32)
    pos, off = 0, (i * 7919 + 104729 * (i % 13)) % period
    while pos < n:
        k = min(period, n - pos)
        out[pos:pos + k] = blk[off:off + k]
        pos, off = pos + k, 0
    return out


def _bf16_round(x: np.ndarray) -> np.ndarray:
    """fp32 values carrying bf16 precision (round to nearest even on the top 16 bits)."""
    u = x.view(np.uint32)
    u += 0x7FFF + ((u >> 16) & 1)
    u &= 0xFFFF0000
    return x


def build_state(workload: str, quick: bool) -> dict[str, np.ndarray]:
    import ml_dtypes

    out: dict[str, np.ndarray] = {}
    for i, (k, s) in enumerate(shapes(quick)):
        n = int(np.prod(s))
        g = _gauss(n, i)
        if k.startswith("params/"):
            x = (1.0 + 0.05 * g) if k.endswith("norm.weight") else 0.02 * g
            x = _bf16_round(x.astype(np.float32))
        elif k.startswith("opt/exp_avg/"):
            x = 1e-4 * g
        else:
            x = (1e-4 * g) ** 2
        x = x.reshape(s)
        out[k] = x.astype(ml_dtypes.bfloat16) if workload == "llama-bf16" else x
    return out


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    root: dict[str, Any] = {}
    for k, v in flat.items():
        d = root
        parts = k.split("/")
        for p in parts[:-1]:
            d = d.setdefault(p, {})
        d[parts[-1]] = v
    return root


def _disk_bytes(path: str) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


# ----------------------------------------------------------------------------- systems


def _orbax() -> Any:
    import orbax.checkpoint as ocp

    return ocp.StandardCheckpointer()


def do_save(system: str, state: dict[str, np.ndarray], path: str) -> None:
    if system.startswith("statestream"):
        import statestream as ss

        comp = {"statestream-zstd": ss.Compression("zstd"),
                "statestream-zstd-noshuffle": ss.Compression("zstd", shuffle=False)}.get(system)
        ss.save(path, nest(state), compression=comp)
        return
    ck = _orbax()
    ck.save(path, nest(state))
    ck.wait_until_finished()


def prepare(system: str, state: dict[str, np.ndarray]) -> dict[str, Any]:
    if system.startswith("statestream"):
        return state
    import jax

    out = {k: jax.device_put(state.pop(k)) for k in list(state)}
    jax.block_until_ready(out)
    return out


def do_load(system: str, path: str, spec: list[tuple[str, tuple[int, ...]]], dtype: Any) -> Any:
    if system.startswith("statestream"):
        import statestream as ss

        return ss.load(path)
    import jax

    like = nest({k: jax.ShapeDtypeStruct(s, dtype) for k, s in spec})
    out = _orbax().restore(path, like)
    jax.block_until_ready(out)
    return out


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(_flat(v, f"{prefix}{k}/"))
        return out
    return {prefix[:-1]: tree}


def _check(out: Any, workload: str, quick: bool) -> str | None:
    want = build_state(workload, quick)
    got = _flat(out)
    if set(got) != set(want):
        return f"keys differ ({len(got)} vs {len(want)})"
    for k in list(want)[:: max(1, len(want) // 6)]:
        if np.asarray(got[k]).tobytes() != want[k].tobytes():
            return f"value mismatch at {k}"
    return None


# ----------------------------------------------------------------------------- children


def child(a: dict[str, Any]) -> dict[str, Any]:
    system, workload, quick, path = a["system"], a["workload"], a["quick"], a["path"]
    if a["task"] == "save":
        warm = os.path.join(a["dir"], "warm")
        do_save(system, prepare(system, {"w": np.zeros((64, 64), np.float32)}), warm)
        shutil.rmtree(warm, ignore_errors=True)
        state = prepare(system, build_state(workload, quick))
        shutil.rmtree(path, ignore_errors=True)
        gc.collect()
        os.sync()
        with RssSampler() as s:
            t0 = time.perf_counter()
            do_save(system, state, path)
            dt = time.perf_counter() - t0
        return {"seconds": dt, "disk_bytes": _disk_bytes(path), **s.result}
    import ml_dtypes

    spec = shapes(quick)
    dtype = ml_dtypes.bfloat16 if workload == "llama-bf16" else np.float32
    res: dict[str, Any] = {}
    for mode in ("cold", "hot"):
        gc.collect()
        if mode == "cold":
            err = drop_caches()
            if err:
                res["cold_error"] = err
        with RssSampler() as s:
            t0 = time.perf_counter()
            out = do_load(system, path, spec, dtype)
            dt = time.perf_counter() - t0
        res[mode] = {"seconds": dt, **s.result}
        if mode == "hot":
            res["verify_error"] = _check(out, workload, quick)
        del out
    return res


def child_main(arg: str) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    try:
        res = {"ok": True, **child(json.loads(arg))}
    except BaseException as e:  # reported to the parent, which records it
        res = {"ok": False, "error": f"{type(e).__name__}: {e}",
               "traceback": traceback.format_exc()[-3000:]}
    print("RESULT:" + json.dumps(res), flush=True)


# ----------------------------------------------------------------------------- parent


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _rng(xs: list[float]) -> str:
    return f"[{min(xs):.2f}-{max(xs):.2f}]" if len(xs) > 1 else ""


def summarize(results: dict[str, Any]) -> str:
    lines = [f"# Compression benchmark ({results['started']})", "",
             f"Command: `{results['command']}`", "",
             f"Machine: {results['machine']}. State sizes: " + ", ".join(
                 f"{w} {b / 1e6:.0f} MB" for w, b in results["raw_bytes"].items()) + ". "
             f"{results['repeats']} repeat(s); medians [min-max]; throughput = raw state "
             "bytes / s (GB/s); size = all files of the checkpoint.", ""]
    for w in results["workloads"]:
        raw = results["raw_bytes"][w]
        lines += [f"## {w}", "",
                  "| system | size MB | size / raw | save GB/s | load cold GB/s | "
                  "load hot GB/s | save peak RSS MB | load peak RSS MB |",
                  "|---|---|---|---|---|---|---|---|"]
        for sname in results["systems"]:
            runs = [r for r in results["samples"] if r["workload"] == w and r["system"] == sname]
            ok = [r for r in runs if r["save"].get("ok") and r["load"].get("ok")]
            if not ok:
                err = next((r[p].get("error") for r in runs for p in ("save", "load")
                            if not r[p].get("ok")), "no run")
                lines.append(f"| {sname} | failed: {err} | | | | | | |")
                continue
            size = med([r["save"]["disk_bytes"] for r in ok])
            sv = [raw / r["save"]["seconds"] / 1e9 for r in ok]
            cold = [raw / r["load"]["cold"]["seconds"] / 1e9 for r in ok
                    if "cold_error" not in r["load"]]
            hot = [raw / r["load"]["hot"]["seconds"] / 1e9 for r in ok]
            srss = med([r["save"]["rss_peak_over_baseline"] / 1e6 for r in ok])
            lrss = med([r["load"]["hot"]["rss_peak_over_baseline"] / 1e6 for r in ok])
            verr = {r["load"].get("verify_error") for r in ok} - {None}
            lines.append(
                f"| {sname} | {size / 1e6:.1f} | {size / raw:.3f} | {med(sv):.2f} {_rng(sv)} | "
                + (f"{med(cold):.2f} {_rng(cold)}" if cold else "n/a")
                + f" | {med(hot):.2f} {_rng(hot)} | {srss:.0f} | {lrss:.0f} |"
                + (f" VERIFY FAILED: {verr}" if verr else ""))
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=str(REPO / "bench-data-compression"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        child_main(args.child)
        return
    if args.quick and "--repeats" not in " ".join(sys.argv):
        args.repeats = 1
    systems, workloads = args.systems.split(","), args.workloads.split(",")
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    outdir = HERE / "results" / "compression"
    outdir.mkdir(parents=True, exist_ok=True)
    out_json = outdir / f"compression-{stamp}{'-quick' if args.quick else ''}.json"
    raw_bytes = {w: sum(a.nbytes for a in build_state(w, args.quick).values())
                 for w in workloads}
    results: dict[str, Any] = {
        "started": stamp, "command": shlex.join([Path(sys.executable).name] + sys.argv),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores (shared by several users), "
                   f"Python {platform.python_version()}",
        "repeats": args.repeats, "systems": systems, "workloads": workloads,
        "raw_bytes": raw_bytes, "quick": args.quick, "samples": []}
    os.makedirs(args.dir, exist_ok=True)
    try:
        for rep in range(args.repeats):
            for w in workloads:
                # rotate the order each repeat so that machine noise falls on every system
                order = systems[rep % len(systems):] + systems[:rep % len(systems)]
                for sname in order:
                    path = os.path.join(args.dir, f"{sname}-{w}")
                    task = {"system": sname, "workload": w, "quick": args.quick, "path": path,
                            "dir": args.dir}
                    log(f"repeat {rep + 1}/{args.repeats} {w} {sname}: save")
                    sv = run_child(__file__, SRC, {**task, "task": "save"}, args.timeout,
                                   stderr_on_failure=True)
                    log(f"repeat {rep + 1}/{args.repeats} {w} {sname}: load")
                    ld = (run_child(__file__, SRC, {**task, "task": "load"}, args.timeout,
                                    stderr_on_failure=True) if sv.get("ok")
                          else {"ok": False, "error": "save failed"})
                    results["samples"].append({"repeat": rep, "workload": w, "system": sname,
                                               "save": sv, "load": ld})
                    shutil.rmtree(path, ignore_errors=True)
                    out_json.write_text(json.dumps(results, indent=1))
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    md = summarize(results)
    out_json.write_text(json.dumps(results, indent=1))
    out_json.with_suffix(".md").write_text(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
