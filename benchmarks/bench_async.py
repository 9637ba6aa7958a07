#!/usr/bin/env python3
"""Asynchronous-save benchmark: checkpointing inside a CPU training loop.

A small GPT-like transformer (~100M fp32 params; ``--quick``: ~10M) is trained with AdamW
on random tokens, and the full training state (model + optimizer state dicts) is
checkpointed every ``--every`` steps. Per configuration we measure the mean step time and
its overhead vs. a no-checkpoint baseline, and per save its *blocking* time (how long the
training loop is stalled by the checkpoint) and its *total* time (save call -> durable
commit).

Run from the repo root with the project venv::

    .venv/bin/python benchmarks/bench_async.py            # full run (~100M params, 12 steps, save every 4)
    .venv/bin/python benchmarks/bench_async.py --quick    # smoke run (~10M params, 6 steps, save every 2)

Configurations (each in a fresh child process, this script re-invoked with ``--child``):

- ``baseline``: no checkpointing (also measures a plain memcpy of the state).
- ``ss-sync``: ``ss.save(path, state)``; blocking = total = the call.
- ``ss-async``: ``h = ss.save_async(path, state)``; blocking = the call (+ any wait in
  ``h.result()`` before the next save, which is a stall only if the save is not done yet).
- ``ss-lazy``: ``h = ss.save_async(path, state, lazy=True)`` + ``ss.guard_optimizer(opt, h)``;
  blocking = the call + the time ``optimizer.step()`` waits in the guard (measured with a
  step pre-hook registered after the guard's) + any wait before the next save.
- ``dcp-async``: ``torch.distributed.checkpoint.async_save(state, storage_writer=
  FileSystemWriter(dir))`` in a gloo process group of world size 1; blocking = the call
  (staging) + the wait on the previous future before the next save.
- ``orbax-async``: ``ocp.StandardCheckpointer()`` (an AsyncCheckpointer) saving a pytree of
  JAX arrays with the same shapes as the torch state. The pytree is converted once before
  the loop (as a JAX user's state would already live in JAX), and that same pytree is
  saved at every checkpoint step; blocking = the ``save`` call (+ any wait before the
  next save); total = until the checkpoint directory is finalized.

Total time is taken by a watcher (a thread waiting on the handle / a future callback /
polling for Orbax's finalized directory every 5 ms), so it never stalls the loop.
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
import statistics
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
from _common import free_port, med, run_child

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SRC = REPO / "src"
MiB = 1 << 20
GiB = 1 << 30

CONFIGS = ["baseline", "ss-sync", "ss-async", "ss-lazy", "dcp-async", "orbax-async"]

NOTES = {
    "baseline": "no checkpointing; the child also times a plain memcpy of the state",
    "ss-sync": "ss.save(path, state) (durable on return)",
    "ss-async": "h = ss.save_async(path, state); h.result() before the next save / at the end",
    "ss-lazy": "h = ss.save_async(path, state, lazy=True); ss.guard_optimizer(opt, h); h.result() before the next save / at the end",
    "dcp-async": "f = dcp.async_save(state, storage_writer=FileSystemWriter(dir)) (torch default: THREAD executor, DefaultStager), "
    "gloo process group of world size 1; f.result() before the next save / at the end",
    "orbax-async": "ocp.StandardCheckpointer() (async; OCDBT + zarr, zstd level 1 by default) saving a pytree of JAX arrays "
    "of the same shapes, converted ONCE before the loop and re-saved at every checkpoint step; "
    "wait_until_finished() before the next save / at the end",
}


def model_cfg(quick: bool) -> dict:
    if quick:
        return {"vocab": 8000, "d": 320, "layers": 4, "heads": 5, "seq": 64, "batch": 2}
    return {"vocab": 32000, "d": 768, "layers": 8, "heads": 12, "seq": 64, "batch": 2}


# --------------------------------------------------------------------------------------
# Child: the training loop
# --------------------------------------------------------------------------------------


def build(cfg: dict, seed: int):
    import torch
    import torch.nn as nn

    torch.manual_seed(seed)

    class Block(nn.Module):
        def __init__(self, d, h):
            super().__init__()
            self.ln1 = nn.LayerNorm(d)
            self.attn = nn.MultiheadAttention(d, h, batch_first=True)
            self.ln2 = nn.LayerNorm(d)
            self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

        def forward(self, x, mask):
            y = self.ln1(x)
            x = x + self.attn(y, y, y, attn_mask=mask, need_weights=False)[0]
            return x + self.mlp(self.ln2(x))

    class GPT(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.tok = nn.Embedding(c["vocab"], c["d"])
            self.pos = nn.Embedding(c["seq"], c["d"])
            self.blocks = nn.ModuleList([Block(c["d"], c["heads"]) for _ in range(c["layers"])])
            self.ln_f = nn.LayerNorm(c["d"])
            self.head = nn.Linear(c["d"], c["vocab"], bias=False)
            self.register_buffer("mask", torch.triu(torch.full((c["seq"], c["seq"]), float("-inf")), 1), persistent=False)

        def forward(self, idx):
            x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
            for b in self.blocks:
                x = b(x, self.mask)
            return self.head(self.ln_f(x))

    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"] + 1), generator=g)
    return model, opt, data


def train_step(model, opt, data):
    import torch.nn.functional as F

    logits = model(data[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), data[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss)


def state_of(model, opt, step: int) -> dict:
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}


def state_tensors(model, opt) -> list:
    import torch

    ts = list(model.state_dict().values())
    for st in opt.state.values():
        ts += [v for v in st.values() if isinstance(v, torch.Tensor)]
    return ts


def dir_bytes(p: str) -> int:
    return sum(f.stat().st_size for f in Path(p).rglob("*") if f.is_file()) if os.path.isdir(p) else 0


def measure_memcpy(tensors: list, repeats: int = 3) -> dict:
    """Plain memcpy of the state: into preallocated (pre-faulted) buffers, and into fresh ones."""
    srcs = [t.detach().numpy().reshape(-1).view(np.uint8) for t in tensors]
    pre = [np.ones(s.nbytes, dtype=np.uint8) for s in srcs]
    pre_s, fresh_s = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for d, s in zip(pre, srcs):
            np.copyto(d, s)
        pre_s.append(time.perf_counter() - t0)
    del pre
    gc.collect()
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = []
        for s in srcs:
            b = np.empty(s.nbytes, dtype=np.uint8)
            np.copyto(b, s)
            out.append(b)
        fresh_s.append(time.perf_counter() - t0)
        del out
        gc.collect()
    return {"prealloc_s": pre_s, "fresh_s": fresh_s}


class Saver:
    """One checkpointing configuration. start() returns after the blocking part; the watcher
    records when the save became durable; wait() waits for it (timed as a potential stall)."""

    def __init__(self, config: str, base: str, model, opt, budget: int | None = None):
        self.config, self.base, self.model, self.opt = config, base, model, opt
        self.budget = budget  # statestream's memory budget (None: its default)
        self.pending = None  # (record, waiter, event)

    # -- setup ----------------------------------------------------------------------------
    def setup(self) -> dict:
        info: dict[str, Any] = {}
        c = self.config
        if c.startswith("ss-"):
            import statestream as ss

            self.ss = ss
            info["statestream"] = getattr(ss, "__version__", "?")
            self.mem = ss.MemoryOptions(memory_budget_bytes=self.budget)
            info["budget_bytes"] = self.mem.resolved()
            if c != "ss-sync":  # where the snapshot time goes: one timestamp per copied chunk
                from statestream import _hooks

                self.chunk_ts: list[float] = []
                _hooks.register("async.snapshot_chunk", lambda: self.chunk_ts.append(time.perf_counter()))
        elif c == "dcp-async":
            import torch.distributed as dist
            import torch.distributed.checkpoint as dcp

            self.dcp = dcp
            port = free_port()
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
            info["process_group"] = f"gloo, world_size=1, tcp://127.0.0.1:{port}"
        elif c == "orbax-async":
            import jax
            import orbax.checkpoint as ocp

            self.ocp = ocp
            self.ck = ocp.StandardCheckpointer()
            t0 = time.perf_counter()
            # same shapes/bytes as the torch state, converted ONCE (a JAX user's state lives in JAX)
            sd = state_of(self.model, self.opt, 0)
            tree = {"model": {k: v.detach().numpy() for k, v in sd["model"].items()},
                    "optim": {str(i): {k: v.detach().numpy() for k, v in st.items() if hasattr(v, "numpy")}
                              for i, st in sd["optim"]["state"].items()}}
            self.jtree = jax.tree.map(lambda a: jax.device_put(np.array(a)), tree)
            jax.block_until_ready(self.jtree)
            info["jax_convert_s"] = time.perf_counter() - t0
            info["jax_tree_bytes"] = int(sum(x.nbytes for x in jax.tree.leaves(self.jtree)))
            info["jax_devices"] = str(jax.devices())
        self._warmup()
        return info

    def _warmup(self) -> None:
        """Tiny untimed save so lazy imports / thread pools are not billed."""
        import torch

        p = os.path.join(self.base, "warmup")
        tiny = {"a": torch.ones(64, 64), "b": {"c": torch.zeros(8)}, "step": 0}
        c = self.config
        if c == "ss-sync":
            self.ss.save(p, tiny)
        elif c in ("ss-async", "ss-lazy"):
            self.ss.save_async(p, tiny, lazy=(c == "ss-lazy")).result()
        elif c == "dcp-async":
            self.dcp.async_save(tiny, storage_writer=self.dcp.FileSystemWriter(p)).result()
        elif c == "orbax-async":
            import jax.numpy as jnp

            self.ck.save(p, {"a": jnp.ones((64, 64)), "b": {"c": jnp.zeros(8)}})
            self.ck.wait_until_finished()
        shutil.rmtree(p, ignore_errors=True)

    # -- per save ---------------------------------------------------------------------------
    def start(self, idx: int, step: int) -> dict:
        rec: dict[str, Any] = {"step": step, "stall_before_s": 0.0, "guard_wait_s": 0.0}
        rec["stall_before_s"] = self.wait()  # previous save must be committed first
        path = os.path.join(self.base, f"ckpt-{idx}")
        rec["path"] = path
        c = self.config
        t0 = time.perf_counter()
        if c == "ss-sync":
            self.ss.save(path, state_of(self.model, self.opt, step), memory=self.mem)
            t1 = time.perf_counter()
            rec.update(call_s=t1 - t0, total_s=t1 - t0)
            return rec
        if c in ("ss-async", "ss-lazy"):
            self.chunk_ts.clear()
            h = self.ss.save_async(path, state_of(self.model, self.opt, step), lazy=(c == "ss-lazy"),
                                   memory=self.mem)
            if c == "ss-lazy":
                rh = self.ss.guard_optimizer(self.opt, h)
                self._time_guard(rh, rec)
            t1 = time.perf_counter()
            ev: dict[str, Any] = {}

            def watch():
                try:
                    h.result()
                except BaseException as e:  # recorded, surfaced by wait()
                    ev["error"] = repr(e)
                ev["t"] = time.perf_counter()

            if c == "ss-lazy":
                def watch_snap():
                    try:
                        h.wait_snapshot()
                    except BaseException:
                        pass
                    rec["snapshot_s"] = time.perf_counter() - t0
                threading.Thread(target=watch_snap, daemon=True).start()
            th = threading.Thread(target=watch, daemon=True)
            th.start()
            waiter = lambda: (h.result(), th.join())  # noqa: E731
        elif c == "dcp-async":
            w = self.dcp.FileSystemWriter(path)
            fut = self.dcp.async_save(state_of(self.model, self.opt, step), storage_writer=w)
            t1 = time.perf_counter()
            ev = {}
            done = threading.Event()

            def cb(f):
                ev["t"] = time.perf_counter()
                done.set()

            fut.add_done_callback(cb)
            waiter = lambda: (fut.result(), done.wait())  # noqa: E731
        elif c == "orbax-async":
            self.ck.save(path, self.jtree)
            t1 = time.perf_counter()
            ev = {}
            stop = threading.Event()

            def poll():  # Orbax renames its tmp dir to `path` when the checkpoint is finalized
                while not stop.is_set():
                    if os.path.isdir(path):
                        ev["t"] = time.perf_counter()
                        return
                    stop.wait(0.005)

            th = threading.Thread(target=poll, daemon=True)
            th.start()

            def waiter():
                self.ck.wait_until_finished()
                th.join(10)
                stop.set()
                ev.setdefault("t", time.perf_counter())
        else:
            raise ValueError(c)
        rec["call_s"] = t1 - t0
        rec["_t0"] = t0
        self.pending = (rec, waiter, ev)
        return rec

    def _time_guard(self, rh, rec) -> None:
        """Time the guard's pre-step hook by wrapping it in place (outside any step).

        Not done with an extra pre-hook registered after the guard: the guard's hook
        removes itself during the optimizer's iteration over its pre-hooks, which raises
        "OrderedDict mutated during iteration" whenever another pre-hook follows it.
        """
        hooks = self.opt._optimizer_step_pre_hooks
        inner = hooks[rh.id]

        def timed(opt, args, kwargs):
            t0 = time.perf_counter()
            try:
                return inner(opt, args, kwargs)
            finally:
                rec["guard_wait_s"] += time.perf_counter() - t0
                rec["guarded_steps"] = rec.get("guarded_steps", 0) + 1

        hooks[rh.id] = timed  # same key: not a size/order change

    def wait(self) -> float:
        """Wait for the pending save to commit; return how long this call blocked."""
        if self.pending is None:
            return 0.0
        rec, waiter, ev = self.pending
        self.pending = None
        t0 = time.perf_counter()
        waiter()
        dt = time.perf_counter() - t0
        t_done = ev.get("t", time.perf_counter())
        t0 = rec.pop("_t0")
        rec["total_s"] = t_done - t0
        ts = getattr(self, "chunk_ts", None)
        if ts:  # walk + plan (+ first chunk), then the copies of all chunks
            rec["snap_first_chunk_s"] = ts[0] - t0
            rec["snap_chunks_s"] = ts[-1] - ts[0]
            rec["snap_n_chunks"] = len(ts)
        if ev.get("error"):
            rec["error"] = ev["error"]
        return dt

    def finish(self) -> float:
        return self.wait()

    def close(self) -> None:
        if self.config == "dcp-async":
            import torch.distributed as dist

            dist.destroy_process_group()
        if self.config == "orbax-async":
            self.ck.close()


def child_run(a: dict) -> dict:
    import torch

    cfg = a["cfg"]
    config = a["config"]
    base = os.path.join(a["dir"], config)
    shutil.rmtree(base, ignore_errors=True)
    os.makedirs(base, exist_ok=True)
    model, opt, data = build(cfg, a["seed"])
    n_params = sum(p.numel() for p in model.parameters())
    # warm-up steps (untimed): first step allocates the AdamW state
    for _ in range(a["warmup_steps"]):
        train_step(model, opt, data)
    sd = state_of(model, opt, 0)
    tens = state_tensors(model, opt)
    state_bytes = sum(t.numel() * t.element_size() for t in tens)
    saver = Saver(config, base, model, opt, a.get("budget")) if config != "baseline" else None
    setup = saver.setup() if saver else {}
    del sd
    gc.collect()
    os.sync()
    steps: list[float] = []
    opt_steps: list[float] = []
    saves: list[dict] = []
    t_step = [0.0]

    def opt_pre(o, ar, kw):
        t_step[0] = time.perf_counter()

    def opt_post(o, ar, kw):
        opt_steps.append(time.perf_counter() - t_step[0])

    opt.register_step_pre_hook(opt_pre)  # first pre-hook: includes any guard wait
    opt.register_step_post_hook(opt_post)
    run_t0 = time.perf_counter()
    losses = []
    for i in range(1, a["steps"] + 1):
        t0 = time.perf_counter()
        losses.append(train_step(model, opt, data))
        if saver is not None and (i - 1) % a["every"] == 0:
            saves.append(saver.start(len(saves), i))
        steps.append(time.perf_counter() - t0)
    loop_s = time.perf_counter() - run_t0
    final_wait = saver.finish() if saver else 0.0
    res: dict[str, Any] = {
        "n_params": n_params,
        "state_bytes": state_bytes,
        "state_tensors": len(tens),
        "torch_threads": torch.get_num_threads(),
        "step_s": steps,
        "opt_step_s": opt_steps,
        "loop_s": loop_s,
        "final_wait_s": final_wait,
        "losses": losses,
        "setup": setup,
    }
    for r in saves:
        r["blocking_s"] = r["call_s"] + r["guard_wait_s"] + r["stall_before_s"]
        r["disk_bytes"] = dir_bytes(r["path"])
        r["committed"] = os.path.isdir(r["path"])
    # stall_before_s of save k is charged to save k-1 (it waits for that one's commit)
    for k in range(1, len(saves)):
        saves[k - 1]["stall_after_s"] = saves[k]["stall_before_s"]
    if saves:
        saves[-1]["stall_after_s"] = 0.0  # the end-of-run wait is reported as final_wait_s
    for r in saves:
        r["blocking_s"] = r["call_s"] + r["guard_wait_s"] + r["stall_after_s"]
    res["saves"] = saves
    if saver:
        saver.close()
    if config == "baseline":
        res["memcpy"] = measure_memcpy(tens)
    shutil.rmtree(base, ignore_errors=True)
    return res


def child_main(arg: str) -> None:
    a = json.loads(arg)
    if a.get("pythonpath"):
        sys.path.insert(0, a["pythonpath"])
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    try:
        if a.get("phases"):
            import async_phases

            res = async_phases.child(a)
        else:
            res = {"ok": True, **child_run(a)}
    except BaseException as e:
        res = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    sys.stdout.flush()
    print("RESULT:" + json.dumps(res, default=str), flush=True)
    os._exit(0)  # do not let leftover non-daemon threads (DCP/Orbax executors) hang the child


# --------------------------------------------------------------------------------------
# Parent
# --------------------------------------------------------------------------------------


def mean(xs):
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def loadavg() -> list[float]:
    try:
        return list(os.getloadavg())
    except OSError:
        return []


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def git_rev() -> str:
    try:
        return subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() or "?"
    except Exception:
        return "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="~10M params, 6 steps, checkpoint every 2")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 12; quick 6)")
    ap.add_argument("--every", type=int, default=None, help="checkpoint every N steps (default 4; quick 2)")
    ap.add_argument("--warmup-steps", type=int, default=1)
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma list; default: all")
    ap.add_argument("--repeats", type=int, default=1, help="child runs per configuration")
    ap.add_argument("--no-end-baseline", action="store_true", help="skip the second baseline run at the end")
    ap.add_argument("--dir", default=str(REPO / "bench-data-async"), help="checkpoint scratch dir (deleted at the end)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--out", default=None, help="JSON output path (markdown goes next to it)")
    ap.add_argument("--keep-data", action="store_true")
    ap.add_argument("--render", default=None, metavar="JSON", help="re-summarize a results JSON (rewrites it and its .md)")
    ap.add_argument("--phases", action="store_true",
                    help="time the phases of sync/async/lazy/DCP saves of a ~1.09 GB state, "
                    "each in a fresh process (benchmarks/async_phases.py); --repeats runs each")
    ap.add_argument("--budget", type=int, default=None, help="statestream's memory budget in bytes (default: its own)")
    ap.add_argument("--aligned-state", action="store_true",
                    help="--phases: the state's tensors on page-aligned memory (not torch's allocator)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        child_main(args.child)
        return
    if args.phases:
        import async_phases

        exe = os.path.relpath(sys.executable, os.getcwd()) if sys.executable.startswith(os.getcwd()) else sys.executable
        cmdline = " ".join(shlex.quote(x) for x in [exe] + sys.argv)
        stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        out = Path(args.out) if args.out else HERE / "results" / "async" / f"phases-{stamp}{'-quick' if args.quick else ''}.json"
        res = async_phases.run(args, run_child, Path(__file__), SRC, out.parent, cmdline, log)
        res["git"], res["loadavg_end"] = git_rev(), loadavg()
        print(async_phases.write(res, out))
        return
    if args.render:
        rp = Path(args.render)
        results = json.loads(rp.read_text())
        summarize(results)
        rp.write_text(json.dumps(results, indent=1, default=str))
        md = render_md(results)
        rp.with_suffix(".md").write_text(md)
        print(md)
        return
    steps = args.steps or (6 if args.quick else 12)
    every = args.every or (2 if args.quick else 4)
    cfg = model_cfg(args.quick)
    started = time.time()
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_json = Path(args.out) if args.out else HERE / "results" / f"async-{stamp}{'-quick' if args.quick else ''}.json"
    out_md = out_json.with_suffix(".md")
    out_json.parent.mkdir(parents=True, exist_ok=True)
    base = os.path.abspath(args.dir)
    os.makedirs(base, exist_ok=True)
    exe = os.path.relpath(sys.executable, os.getcwd()) if sys.executable.startswith(os.getcwd()) else sys.executable
    cmdline = " ".join(shlex.quote(x) for x in [exe] + sys.argv)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    results: dict[str, Any] = {
        "command": cmdline,
        "cwd": os.getcwd(),
        "started": _dt.datetime.now().isoformat(timespec="seconds"),
        "git": git_rev(),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "mem_total_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB,
            "python": platform.python_version(),
        },
        "loadavg_start": loadavg(),
        "args": vars(args),
        "model": cfg,
        "steps": steps,
        "every": every,
        "notes": {c: NOTES[c] for c in configs},
        "runs": {},
    }
    try:
        import importlib.metadata as im

        vs = {}
        for p in ("torch", "jax", "jaxlib", "orbax-checkpoint", "numpy", "statestream"):
            try:
                vs[p] = im.version(p)
            except Exception:
                pass
        results["versions"] = vs
    except Exception:
        pass
    order = list(configs)
    if "baseline" in configs and not args.no_end_baseline and len(configs) > 1:
        order.append("baseline")  # again at the end: noise estimate on a shared machine
    for c in order:
        for r in range(args.repeats):
            task = {"config": c, "cfg": cfg, "steps": steps, "every": every, "warmup_steps": args.warmup_steps,
                    "dir": base, "seed": args.seed, "pythonpath": str(SRC), "budget": args.budget}
            la = loadavg()
            res = run_child(__file__, SRC, task, args.timeout, stderr_on_failure=True)
            res["loadavg_before"] = la
            results["runs"].setdefault(c, []).append(res)
            if not res.get("ok"):
                log(f"{c} #{r} FAILED: {res.get('error')}\n{res.get('traceback', '')}{res.get('stderr', '')[-1500:]}")
                continue
            sv = res.get("saves", [])
            log(f"{c} #{r}: {res['n_params'] / 1e6:.1f}M params, state {res['state_bytes'] / MiB:.0f} MiB, "
                f"mean step {mean(res['step_s']):.3f}s (median {med(res['step_s']):.3f}s), load {la[:1]}"
                + (f"; blocking {[round(s['blocking_s'], 3) for s in sv]} total {[round(s.get('total_s') or 0, 3) for s in sv]}" if sv else ""))
    if not args.keep_data:
        shutil.rmtree(base, ignore_errors=True)
    results["loadavg_end"] = loadavg()
    results["elapsed_s"] = time.time() - started
    summarize(results)
    out_json.write_text(json.dumps(results, indent=1, default=str))
    md = render_md(results)
    out_md.write_text(md)
    print(md)
    log(f"wrote {out_json} and {out_md} in {results['elapsed_s']:.0f}s")


def summarize(results: dict) -> None:
    rows: dict[str, Any] = {}
    state_bytes = None
    memcpy = {"prealloc_s": [], "fresh_s": []}
    for c, runs in results["runs"].items():
        ok = [r for r in runs if r.get("ok")]
        if not ok:
            rows[c] = {"error": runs[0].get("error") if runs else "no run"}
            continue
        all_steps = [s for r in ok for s in r["step_s"]]
        saves = [s for r in ok for s in r.get("saves", [])]
        state_bytes = state_bytes or ok[0]["state_bytes"]
        if c == "baseline":
            pass  # the baseline rows are read from `rows` below
            for r in ok:
                for k in memcpy:
                    memcpy[k] += (r.get("memcpy") or {}).get(k, [])
        rows[c] = {
            "n_params": ok[0]["n_params"],
            "state_bytes": ok[0]["state_bytes"],
            "step_s_mean": mean(all_steps),
            "step_s_median": med(all_steps),
            "step_s_samples": all_steps,
            "opt_step_s_samples": [s for r in ok for s in r["opt_step_s"]],
            "n_saves": len(saves),
            "blocking_s_median": med([s["blocking_s"] for s in saves]),
            "blocking_s_samples": [s["blocking_s"] for s in saves],
            "call_s_samples": [s["call_s"] for s in saves],
            "guard_wait_s_samples": [s["guard_wait_s"] for s in saves],
            "stall_after_s_samples": [s.get("stall_after_s") for s in saves],
            "total_s_median": med([s.get("total_s") for s in saves]),
            "total_s_samples": [s.get("total_s") for s in saves],
            "snapshot_s_samples": [s.get("snapshot_s") for s in saves if "snapshot_s" in s],
            "final_wait_s": [r["final_wait_s"] for r in ok],
            "disk_bytes_median": med([s.get("disk_bytes") for s in saves]),
            "all_committed": all(s.get("committed") for s in saves),
            "save_errors": [s["error"] for s in saves if s.get("error")],
            "loadavg_before": [r.get("loadavg_before") for r in ok],
            "saves": saves,
        }
    # Reference: the FASTER of the baseline runs (start/end), so noise from other users' load
    # on one baseline run cannot hide checkpoint overhead (conservative for the configs).
    bruns_ok = [r for r in results["runs"].get("baseline", []) if r.get("ok")]
    bmean = min((mean(r["step_s"]) for r in bruns_ok), default=None)
    bmed = min((med(r["step_s"]) for r in bruns_ok), default=None)
    for row in rows.values():
        if "step_s_mean" in row and bmean:
            row["overhead_vs_baseline"] = row["step_s_mean"] / bmean - 1
            row["overhead_median_vs_baseline"] = row["step_s_median"] / bmed - 1
    mc = {"prealloc_s_median": med(memcpy["prealloc_s"]), "fresh_s_median": med(memcpy["fresh_s"]),
          "prealloc_s_samples": memcpy["prealloc_s"], "fresh_s_samples": memcpy["fresh_s"]}

    def g(c, f):
        return (rows.get(c) or {}).get(f)

    targets = []

    def target(name, value, limit, ok, detail):
        targets.append({"target": name, "value": value, "limit": limit,
                        "met": None if ok is None else bool(ok), "detail": detail})

    fresh, pre = mc["fresh_s_median"], mc["prealloc_s_median"]
    b_async = g("ss-async", "blocking_s_median")
    if b_async is not None and fresh:
        target("ss-async blocking <= ~1 memcpy of the state (fresh-buffer copy; x1.25 tolerance)", b_async, 1.25 * fresh,
               b_async <= 1.25 * fresh,
               f"blocking {b_async:.3f}s = {b_async / fresh:.2f}x fresh-buffer copy ({fresh:.3f}s), "
               f"{b_async / pre:.2f}x preallocated copy ({pre:.3f}s)")
    b_lazy, sync_s = g("ss-lazy", "blocking_s_median"), g("ss-sync", "total_s_median")
    if b_lazy is not None and sync_s:
        target("ss-lazy blocking <= 5% of a sync save", b_lazy, 0.05 * sync_s, b_lazy <= 0.05 * sync_s,
               f"blocking {b_lazy:.4f}s = {100 * b_lazy / sync_s:.1f}% of ss.save ({sync_s:.3f}s)")
    b_dcp = g("dcp-async", "blocking_s_median")
    for c in ("ss-async", "ss-lazy"):
        b = g(c, "blocking_s_median")
        if b is not None and b_dcp:
            target(f"{c} blocking >= 3x lower than DCP async_save's", b, b_dcp / 3, b * 3 <= b_dcp,
                   f"DCP {b_dcp:.3f}s / {c} {b:.4f}s = {b_dcp / b if b else float('inf'):.1f}x")
    ov = g("ss-lazy", "overhead_vs_baseline")
    if ov is not None:
        ovm = g("ss-lazy", "overhead_median_vs_baseline")
        target("ss-lazy training overhead <= 5% (mean step vs the faster baseline run)", ov, 0.05, ov <= 0.05,
               f"mean step {g('ss-lazy', 'step_s_mean'):.3f}s vs baseline {bmean:.3f}s: {100 * ov:+.1f}% "
               f"(median step: {100 * ovm:+.1f}%)")
    # noise estimate: two baseline runs
    bruns = [r for r in results["runs"].get("baseline", []) if r.get("ok")]
    noise = None
    if len(bruns) >= 2:
        ms = [mean(r["step_s"]) for r in bruns]
        noise = max(ms) / min(ms) - 1
    results["summary"] = {"rows": rows, "memcpy": mc, "state_bytes": state_bytes, "baseline_step_s_mean": bmean,
                          "baseline_run_spread": noise, "targets": targets}


def _f(x, nd=3):
    return "n/a" if x is None else f"{x:.{nd}f}"


def _l(xs, nd=3):
    return "[" + ", ".join("n/a" if x is None else f"{x:.{nd}f}" for x in xs) + "]"


def render_md(results: dict) -> str:
    s = results["summary"]
    L = []
    L.append(f"# statestream async-save benchmark ({results['started']})\n")
    L.append(f"Command: `{results['command']}` (cwd `{results['cwd']}`), git `{results['git']}`\n")
    m = results["machine"]
    L.append(f"Machine: {m['platform']}, {m['cpus']} CPUs, {m['mem_total_gib']:.1f} GiB RAM, Python {m['python']}; versions: "
             + ", ".join(f"{k} {v}" for k, v in (results.get("versions") or {}).items()))
    la0, la1 = results.get("loadavg_start") or [], results.get("loadavg_end") or []
    L.append(f"Load average (1/5/15 min) at start {_l(la0, 2)}, at end {_l(la1, 2)}.\n")
    cfg = results["model"]
    sb = s.get("state_bytes")
    np_ = next((r.get("n_params") for r in s["rows"].values() if r.get("n_params")), None)
    L.append(f"- model: GPT-like, vocab {cfg['vocab']}, d_model {cfg['d']}, {cfg['layers']} layers, {cfg['heads']} heads, "
             f"batch {cfg['batch']} x seq {cfg['seq']}, AdamW; {np_ / 1e6 if np_ else 0:.1f}M fp32 params")
    if sb:
        L.append(f"- state (model + AdamW exp_avg/exp_avg_sq/step): {sb} bytes ({sb / MiB:.1f} MiB)")
    L.append(f"- {results['steps']} timed steps after {results['args']['warmup_steps']} warm-up step(s); checkpoint after steps "
             f"1, 1+{results['every']}, ... ; {results['args']['repeats']} child run(s) per configuration")
    mc = s["memcpy"]
    L.append(f"- plain memcpy of the state: preallocated buffers {_f(mc['prealloc_s_median'])} s, fresh buffers "
             f"{_f(mc['fresh_s_median'])} s (medians of {_l(mc['prealloc_s_samples'])} / {_l(mc['fresh_s_samples'])})")
    if s.get("baseline_run_spread") is not None:
        L.append(f"- baseline run at start and end: mean step differs by {100 * s['baseline_run_spread']:.1f}% (noise floor for overhead)")
    L.append("- blocking = save call + guarded optimizer.step wait (lazy) + wait for the commit before the next save; "
             "total = save call -> durable commit\n")
    L.append("## Results (medians; all samples below and in the JSON)\n")
    L.append("Overhead is relative to the faster of the two baseline runs: mean step (median step in brackets).\n")
    L.append("| config | mean step s | median step s | overhead vs baseline | saves | blocking s (median) | total s (median) | blocking / sync save | blocking / memcpy (fresh) |")
    L.append("|---|---|---|---|---|---|---|---|---|")
    sync_s = (s["rows"].get("ss-sync") or {}).get("total_s_median")
    fresh = mc["fresh_s_median"]
    for c, r in s["rows"].items():
        if "error" in r and "step_s_mean" not in r:
            L.append(f"| {c} | ERROR: {r['error']} |||||||| ")
            continue
        ov = r.get("overhead_vs_baseline")
        ovs = "n/a" if ov is None else f"{100 * ov:+.1f}% ({100 * r['overhead_median_vs_baseline']:+.1f}%)"
        b = r.get("blocking_s_median")
        L.append(f"| {c} | {_f(r['step_s_mean'])} | {_f(r['step_s_median'])} | {ovs} | "
                 f"{r['n_saves']} | {_f(b, 4)} | {_f(r['total_s_median'])} | "
                 f"{'n/a' if b is None or not sync_s else f'{100 * b / sync_s:.1f}%'} | "
                 f"{'n/a' if b is None or not fresh else f'{b / fresh:.2f}x'} |"
                 + (f" save errors: {r['save_errors']}" if r.get("save_errors") else "")
                 + ("" if r.get("all_committed", True) else " NOT ALL COMMITTED"))
    L.append("\n## Targets\n")
    for t in s["targets"]:
        L.append(f"- {'MET' if t['met'] else 'NOT MET'}: {t['target']} -- {t['detail']}")
    L.append("\n## Samples\n")
    for c, r in s["rows"].items():
        if "step_s_samples" not in r:
            continue
        L.append(f"- **{c}**: steps {_l(r['step_s_samples'])}; opt.step {_l(r['opt_step_s_samples'])}")
        if r["n_saves"]:
            L.append(f"  - blocking {_l(r['blocking_s_samples'], 4)} = call {_l(r['call_s_samples'], 4)} + guard wait "
                     f"{_l(r['guard_wait_s_samples'], 4)} + wait before next save {_l(r['stall_after_s_samples'], 4)}; "
                     f"total {_l(r['total_s_samples'])}" + (f"; lazy snapshot done after {_l(r['snapshot_s_samples'])}" if r["snapshot_s_samples"] else "")
                     + (f"; snapshot: walk+plan+1st chunk {_l([x.get('snap_first_chunk_s') for x in r['saves']], 4)}, "
                        f"remaining {r['saves'][0].get('snap_n_chunks', 0) - 1} chunk copies {_l([x.get('snap_chunks_s') for x in r['saves']], 4)}"
                        if r['saves'] and 'snap_chunks_s' in r['saves'][0] else "")
                     + f"; end-of-run wait {_l(r['final_wait_s'])}; checkpoint size {r['disk_bytes_median']} bytes")
    L.append("\n## Settings\n")
    for c, n in results["notes"].items():
        L.append(f"- **{c}**: {n}")
    L.append("- Orbax blocking is for a pytree of JAX arrays that already lives in JAX (converted once before the loop, "
             "same shapes as the torch state, re-saved unchanged at each checkpoint step); the torch->JAX conversion is not billed.")
    L.append("- The machine is a shared 2-core VM: background save threads compete with training for the same 2 cores, "
             "and other users' load adds noise; compare the baseline runs for the noise floor.")
    L.append(f"\nTotal wall time: {results['elapsed_s']:.0f} s\n")
    return "\n".join(L)


if __name__ == "__main__":
    main()
