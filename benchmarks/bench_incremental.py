#!/usr/bin/env python3
"""Incremental-save benchmark: a LoRA-like fine-tuning state saved every step.

Run from the repo root with the project venv::

    .venv/bin/python benchmarks/bench_incremental.py            # 200 MB state, 6 steps, 3 repeats
    .venv/bin/python benchmarks/bench_incremental.py --quick    # 50 MB state, 4 steps, 2 repeats
    .venv/bin/python benchmarks/bench_incremental.py --size large   # ~720 MB state

The state (deterministic, see ``build_state``) is a Llama-like model in float32 whose
weights are frozen (95% of the bytes) plus LoRA adapters on q/v projections with
their Adam moments (the trained 5%). A "training step" changes every trained array
(outside the timing). Phases, each in a fresh child process, same state and steps:

- ``full``: ``ss.save`` of the whole state every step (what a job does without
  incremental saves).
- ``incremental``: the first step ``ss.save(..., hashes=True)``, then every step
  ``ss.save(step_k, state, base=step_{k-1})``: only changed chunks are written.
- ``safetensors``: ``safetensors.numpy.save_file`` of the whole state every step (a
  peer's full save, for scale).
- ``all-changed``: every array changes every step, and each step is saved twice in the
  same process, alternating which goes first: a plain ``ss.save`` and
  ``ss.save(base=previous)``, which hashes every chunk and finds nothing to skip. The
  cost of hashing is the median of the per-step ratio (paired, so machine noise that
  hits one step hits both saves).

Per step (the first, full, step excluded): save wall time, bytes the new checkpoint
adds on disk (data files, manifest, marker) and peak RSS above the baseline. Medians
over every step of every repeat, with ranges. Saves are synchronous and durable
(fsync), so they include the write to disk.
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
from _common import llama_shapes, med, run_child
from bench_core import RssSampler

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SRC = REPO / "src"

PHASES = ["full", "incremental", "safetensors", "all-changed"]


#: Llama-like shapes (hidden, intermediate, layers, vocab) per --size.
SIZES = {"quick": (256, 688, 4, 8000), "default": (512, 1376, 8, 16000),
         "large": (1024, 2752, 11, 16000)}


def build_state(size: str) -> dict[str, np.ndarray]:
    """Frozen Llama-like weights (95%) and LoRA adapters + Adam moments (5%), flat."""
    hidden, inter, layers, vocab = SIZES[size]
    rng = np.random.default_rng(2026)
    state: dict[str, np.ndarray] = {}
    for name, shape in llama_shapes(hidden, inter, layers, vocab):
        state[f"frozen/{name}"] = rng.standard_normal(shape, dtype=np.float32) * 0.02
    frozen = sum(a.nbytes for a in state.values())
    # trained = 3 x (A and B on q and v per layer) at rank r: 5% of the total
    per_rank = 3 * layers * 2 * 2 * hidden * 4
    r = max(1, round(frozen * 5 / 95 / per_rank))
    for i in range(layers):
        for proj in ("q_proj", "v_proj"):
            for part, shape in (("A", (r, hidden)), ("B", (hidden, r))):
                key = f"layers.{i}.{proj}.lora_{part}"
                state[f"trained/params/{key}"] = rng.standard_normal(shape, dtype=np.float32)
                state[f"trained/exp_avg/{key}"] = np.zeros(shape, np.float32)
                state[f"trained/exp_avg_sq/{key}"] = np.zeros(shape, np.float32)
    return state


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in flat.items():
        *head, last = k.split("/")
        d = out
        for h in head:
            d = d.setdefault(h, {})
        d[last] = v
    return out


def train_step(flat: dict[str, np.ndarray], step: int, everything: bool) -> None:
    """Change the trained arrays (or every array) in place, as an optimizer step does."""
    for k, a in flat.items():
        if everything or k.startswith("trained/"):
            a += np.float32(1e-3 * step)


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(path) for f in fs)


def _save(phase: str, flat: dict[str, np.ndarray], state: Any, path: str,
          prev: str | None) -> None:
    import statestream as ss

    if phase == "safetensors":
        from safetensors.numpy import save_file

        save_file(flat, path)
    elif phase in ("full", "all-changed-plain"):
        ss.save(path, state)
    elif prev is None:
        ss.save(path, state, hashes=True)
    else:
        ss.save(path, state, base=prev)


def _timed(phase: str, flat: dict[str, np.ndarray], state: Any, path: str,
           prev: str | None) -> dict[str, Any]:
    gc.collect()
    os.sync()
    with RssSampler() as s:
        t0 = time.perf_counter()
        _save(phase, flat, state, path, prev)
        dt = time.perf_counter() - t0
    size = _dir_bytes(path) if os.path.isdir(path) else os.path.getsize(path)
    return {"seconds": dt, "bytes": size, **s.result}


def _check_load(path: str, flat: dict[str, np.ndarray]) -> None:
    """The last step loads bit-exact (through its references)."""
    import statestream as ss

    got = _flat(ss.load(path))
    bad = [k for k, v in flat.items() if not np.array_equal(got[k], v)]
    if bad:
        raise AssertionError(f"loaded state differs at {bad[:3]}")


def child(a: dict[str, Any]) -> dict[str, Any]:
    phase, size, root, steps = a["phase"], a["size"], a["dir"], a["steps"]
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    flat = build_state(size)
    state = nest(flat)
    # warm the library (imports, thread pools) on a tiny save
    _save(phase, {"w": np.zeros(16, np.float32)}, {"w": np.zeros(16, np.float32)},
          os.path.join(root, "warm"), None)
    rows = []
    prev = None
    for step in range(steps):
        if step:
            train_step(flat, step, everything=phase == "all-changed")
        path = os.path.join(root, f"step-{step}")
        if phase != "all-changed":
            rows.append({"step": step, **_timed(phase, flat, state, path, prev)})
        else:  # paired: plain and incremental save of the same step, alternating order
            order = ["full", "incremental"] if step % 2 else ["incremental", "full"]
            row: dict[str, Any] = {"step": step}
            for kind in order:
                r = _timed(kind, flat, state, path + ("-plain" if kind == "full" else ""),
                           prev)
                row.update({f"{kind}_{k}": v for k, v in r.items()})
            row["seconds"], row["bytes"] = row["incremental_seconds"], row["incremental_bytes"]
            row["rss_peak_over_baseline"] = row["incremental_rss_peak_over_baseline"]
            rows.append(row)
        prev = path
    if phase != "safetensors":
        _check_load(prev, flat)
    shutil.rmtree(root, ignore_errors=True)
    return {"rows": rows, "state_bytes": sum(v.nbytes for v in flat.values()),
            "trained_bytes": sum(v.nbytes for k, v in flat.items() if k.startswith("trained/"))}


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(_flat(v, f"{prefix}/{k}" if prefix else k))
        return out
    return {prefix: tree}


def child_main(arg: str) -> None:
    try:
        res = {"ok": True, **child(json.loads(arg))}
    except BaseException as e:  # reported to the parent, which records it
        res = {"ok": False, "error": f"{type(e).__name__}: {e}",
               "traceback": traceback.format_exc()[-3000:]}
    print("RESULT:" + json.dumps(res), flush=True)


# ----------------------------------------------------------------------------- parent


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _rng(xs: list[float], fmt: str = ".3f") -> str:
    return f"[{min(xs):{fmt}}-{max(xs):{fmt}}]" if len(xs) > 1 else ""


def _steps(results: dict[str, Any], phase: str) -> list[dict[str, Any]]:
    return [row for r in results["samples"] if r["phase"] == phase and r.get("ok")
            for row in r["rows"] if row["step"] > 0]


def summarize(results: dict[str, Any]) -> str:
    total, trained = results["state_bytes"], results["trained_bytes"]
    lines = [f"# Incremental-save benchmark ({results['started']})", "",
             f"Command: `{results['command']}`", "",
             f"Machine: {results['machine']}. State: {total / 1e6:.1f} MB float32, of which "
             f"{trained / 1e6:.1f} MB ({100 * trained / total:.1f}%) trained. "
             f"{results['steps']} steps per run, {results['repeats']} run(s) per phase, each in a "
             "fresh process; per-step figures exclude the first (full) step; medians "
             "[min-max].", "",
             "| phase | save s / step | bytes written / step | of the state | "
             "speed-up vs full | peak RSS MB |", "|---|---|---|---|---|---|"]
    full = med([r["seconds"] for r in _steps(results, "full")])
    for phase in results["phases"]:
        rows = _steps(results, phase)
        if not rows:
            err = next((r.get("error") for r in results["samples"]
                        if r["phase"] == phase and not r.get("ok")), "no run")
            lines.append(f"| {phase} | failed: {err} | | | | |")
            continue
        secs = [r["seconds"] for r in rows]
        nbytes = [r["bytes"] for r in rows]
        speed = f"{full / med(secs):.2f}x" if full else "n/a"
        rss = med([r["rss_peak_over_baseline"] / 1e6 for r in rows])
        lines.append(f"| {phase} | {med(secs):.3f} {_rng(secs)} | {med(nbytes) / 1e6:.2f} MB | "
                     f"{100 * med(nbytes) / total:.1f}% | {speed} | {rss:.0f} |")
    incr = med([r["seconds"] for r in _steps(results, "incremental")])
    lines += [""]
    if full and incr:
        lines.append(f"- Incremental vs full save per step: {full / incr:.1f}x faster "
                     "(goal >= 5x); bytes per step above.")
    paired = _steps(results, "all-changed")
    if paired:
        ratio = [r["incremental_seconds"] / r["full_seconds"] for r in paired]
        plain = [r["full_seconds"] for r in paired]
        lines.append(
            f"- Hashing cost when everything changed (all-changed row: the incremental save; "
            f"its plain twin took {med(plain):.3f} s {_rng(plain)}): the incremental save "
            f"takes {100 * (med(ratio) - 1):+.1f}% {_rng([100 * (x - 1) for x in ratio], '+.0f')} "
            "vs the plain save of the same step, median of per-step ratios (goal <= +10%).")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=str(REPO / "bench-data-incremental"))
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--size", choices=sorted(SIZES), default=None,
                    help="state size: quick (~50 MB), default (~176 MB), large (~720 MB)")
    ap.add_argument("--phases", default=",".join(PHASES))
    ap.add_argument("--child")
    a = ap.parse_args()
    if a.child:
        child_main(a.child)
        return
    size = a.size or ("quick" if a.quick else "default")
    repeats = a.repeats or (2 if a.quick else 3)
    steps = a.steps or (4 if a.quick else 6)
    phases = a.phases.split(",")
    started = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    results: dict[str, Any] = {
        "started": started, "command": shlex.join([sys.executable, *sys.argv]),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (shared with other jobs), "
                   f"Python {platform.python_version()}",
        "repeats": repeats, "steps": steps, "phases": phases, "samples": []}
    for rep in range(repeats):
        for phase in phases:  # interleaved, so machine noise hits every phase alike
            log(f"repeat {rep + 1}/{repeats}: {phase}")
            r = run_child(__file__, SRC, {"phase": phase, "size": size, "steps": steps,
                                          "dir": os.path.join(a.dir, phase)}, 900,
                          stderr_on_failure=True)
            r["phase"] = phase
            results["samples"].append(r)
            if r.get("ok"):
                results["state_bytes"] = r["state_bytes"]
                results["trained_bytes"] = r["trained_bytes"]
            else:
                log(f"  failed: {r.get('error')}")
    shutil.rmtree(a.dir, ignore_errors=True)
    out = HERE / "results" / "incremental"
    out.mkdir(parents=True, exist_ok=True)
    stem = f"incremental-{started}{'' if size == 'default' else '-' + size}"
    (out / f"{stem}.json").write_text(json.dumps(results, indent=1))
    text = summarize(results)
    (out / f"{stem}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
