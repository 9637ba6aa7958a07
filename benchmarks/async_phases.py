"""The phases of an asynchronous save, each in a fresh process (``bench_async.py --phases``).

A Llama-like state of torch fp32 tensors (default ~1.09 GB: hidden 1024, 16 layers;
``--quick``: ~0.14 GB) is saved by each configuration in its own child process:

- ``sync``: ``ss.save`` (the reference every async phase is compared with);
- ``async``: ``ss.save_async``: blocking time of the first save of the process, its
  total time (call -> durable commit), then two more saves of the same state once the
  first has settled (steady state: staging buffers already mapped);
- ``lazy``: ``ss.save_async(lazy=True)``: the call, and the background phase (call ->
  commit) of the first and of a later save;
- ``dcp``: ``torch.distributed.checkpoint.async_save`` (gloo, world size 1): the same
  first/steady blocking and total times;
- ``memcpy``: one copy of the state into fresh memory, and again into the same memory
  (what "one copy into resident memory" costs here);
- ``fork``: a copy-on-write snapshot (the issue's third idea, measured, not built into
  the library): ``os.fork()`` and a synchronous ``ss.save`` in the child, which sees
  the state as it was at the fork. The blocking phase is the fork alone (a lower bound
  for a library version, which would walk the state first).

``async`` and ``fork`` also time one training-like step right after the blocking phase
returns (every tensor multiplied in place, ``t.mul_(1.0)``) against the same step with
no save in flight: a copy-on-write snapshot moves its copy into that step, as page faults.

Peak RSS is the process's high-water mark (``VmHWM``, reset with ``/proc/self/clear_refs``
after the state is built) minus the state's own resident bytes, so it reads as "extra
memory the save needed"; the state's size is reported beside it. ``fork`` adds the child's: the sum of both
processes' proportional set sizes (``Pss`` of ``/proc/<pid>/smaps_rollup``, which counts a
page the two share once), sampled every 20 ms, minus the state's, so shared pages are not
counted twice.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from _common import llama_shapes, med

MiB = 1 << 20


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5\n")


def _state(quick: bool, aligned: bool = False) -> dict[str, Any]:
    """The state; ``aligned``: each tensor on page-aligned memory (torch's own
    allocator starts large tensors 64 bytes into a page, so O_DIRECT writes from
    them go through the writers' bounce buffer; from these they go as they are)."""
    import numpy as np
    import torch

    from statestream._memory import aligned_bytes

    shapes = llama_shapes(1024, 2816, 2 if quick else 16, 8000 if quick else 32000)
    out = {}
    for i, (name, shape) in enumerate(shapes):
        if aligned:
            n = int(np.prod(shape)) * 4
            t = torch.from_numpy(np.frombuffer(aligned_bytes(n), np.float32).reshape(shape))
        else:
            t = torch.empty(shape, dtype=torch.float32)
        t.fill_(float(i))  # touched: the state is resident before any save
        out[name] = t
    return out


def _pss(pid: int | str) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class _PssPeak:
    """The peak of this process's Pss plus its forked child's, sampled on a thread."""

    def __init__(self) -> None:
        self.child = 0
        self.peak = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            total = _pss("self") + (_pss(self.child) if self.child else 0)
            self.peak = max(self.peak, total)
            self._stop.wait(0.02)

    def close(self) -> int:
        self._stop.set()
        self._t.join()
        return self.peak


def _step(state: dict[str, Any]) -> float:
    """A training-like step: every tensor written in place (same values)."""
    t0 = time.perf_counter()
    for t in state.values():
        t.mul_(1.0)
    return time.perf_counter() - t0


def _fork_save(ss: Any, path: str, state: dict[str, Any], mem: Any,
               pss: _PssPeak) -> dict[str, float]:
    t0 = time.perf_counter()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: save the state as it was at the fork, then leave
        code = 1
        try:
            os.close(r)
            ss.save(path, state, memory=mem)
            os.write(w, b"ok")
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    pss.child = pid
    t1 = time.perf_counter()
    step = _step(state)
    with os.fdopen(r, "rb") as f:
        ok = f.read() == b"ok"
    os.waitpid(pid, 0)
    t2 = time.perf_counter()
    pss.child = 0
    if not ok:
        raise RuntimeError("the forked save failed")
    return {"blocking_s": t1 - t0, "total_s": t2 - t0, "step_after_s": step}


def _nbytes(state: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def child(task: dict[str, Any]) -> dict[str, Any]:
    import statestream as ss

    cfg, base = task["config"], task["dir"]
    os.makedirs(base, exist_ok=True)
    state = _state(task["quick"], task.get("aligned", False))
    res: dict[str, Any] = {"ok": True, "config": cfg, "state_bytes": _nbytes(state)}
    rss0 = _status_bytes("VmRSS")
    _reset_peak()
    mem = ss.MemoryOptions(memory_budget_bytes=task.get("budget"))
    res["budget_bytes"] = mem.resolved()
    paths = [os.path.join(base, f"{cfg}-{i}") for i in range(3)]
    if cfg == "sync":
        t0 = time.perf_counter()
        ss.save(paths[0], state, memory=mem)
        res["save_s"] = time.perf_counter() - t0
    elif cfg in ("async", "lazy"):
        saves = []
        step = task.get("step", False) and cfg == "async"
        if step:
            res["step_s"] = min(_step(state) for _ in range(3))
        for p in paths:
            t0 = time.perf_counter()
            h = ss.save_async(p, state, lazy=cfg == "lazy", memory=mem)
            t1 = time.perf_counter()
            h.wait_snapshot()
            t2 = time.perf_counter()
            after = _step(state) if step else None
            h.result()
            t3 = time.perf_counter()
            h._settled.wait()  # the pool is warmed after the commit (not counted)
            saves.append({"blocking_s": t1 - t0, "snapshot_s": t2 - t0, "total_s": t3 - t0,
                          "step_after_s": after})
        res["saves"] = saves
    elif cfg == "fork":
        import gc

        res["step_s"] = min(_step(state) for _ in range(3))
        pss0 = _pss("self")
        pss = _PssPeak()
        gc.freeze()  # the child's collector must not touch (and so copy) every page
        try:
            res["saves"] = [_fork_save(ss, p, state, mem, pss) for p in paths]
        finally:
            gc.unfreeze()
        res["peak_extra_pss_bytes"] = pss.close() - pss0
    elif cfg == "dcp":
        res["saves"] = _dcp(state, paths)
    elif cfg == "memcpy":
        import torch

        t0 = time.perf_counter()
        dst = {k: torch.empty_like(v) for k, v in state.items()}
        for k, v in state.items():
            dst[k].copy_(v)
        t1 = time.perf_counter()
        for k, v in state.items():
            dst[k].copy_(v)
        res["fresh_s"], res["reused_s"] = t1 - t0, time.perf_counter() - t1
    res["peak_extra_bytes"] = _status_bytes("VmHWM") - rss0
    for p in paths:
        shutil.rmtree(p, ignore_errors=True)
    return res


def _dcp(state: dict[str, Any], paths: list[str]) -> list[dict[str, float]]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from _common import free_port

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    dist.init_process_group("gloo", rank=0, world_size=1)
    saves = []
    try:
        for p in paths:
            t0 = time.perf_counter()
            f = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(p))
            t1 = time.perf_counter()
            f.result()
            saves.append({"blocking_s": t1 - t0, "total_s": time.perf_counter() - t0})
    finally:
        dist.destroy_process_group()
    return saves


CONFIGS = ["sync", "async", "lazy", "dcp", "memcpy", "fork"]


def run(args: Any, run_child: Any, script: Path, src: Path, out_dir: Path, cmdline: str,
        log: Any) -> dict[str, Any]:
    configs = [c for c in args.configs.split(",") if c in CONFIGS] or CONFIGS
    results: dict[str, Any] = {"command": cmdline, "quick": args.quick, "runs": {}}
    base = os.path.abspath(args.dir)
    for r in range(args.repeats):
        for c in configs:  # interleaved, so load on the shared machine hits all alike
            task = {"phases": True, "config": c, "dir": base, "quick": args.quick,
                    "budget": args.budget, "step": "fork" in configs,
                    "aligned": args.aligned_state}
            res = run_child(script, src, task, args.timeout, stderr_on_failure=True)
            results["runs"].setdefault(c, []).append(res)
            log(f"{c} #{r}: {json.dumps({k: v for k, v in res.items() if k != 'stderr'})[:400]}")
            if not res.get("ok"):
                log(res.get("stderr", ""))
    shutil.rmtree(base, ignore_errors=True)
    results["summary"] = summarize(results["runs"])
    return results


def _stat(xs: list[float]) -> dict[str, float | None]:
    xs = [x for x in xs if x is not None]
    return {"median": med(xs), "min": min(xs) if xs else None, "max": max(xs) if xs else None,
            "n": len(xs)}


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    ok = {c: [r for r in rs if r.get("ok")] for c, rs in runs.items()}
    s: dict[str, Any] = {}

    def saves(c: str, i: int | None, f: str) -> dict[str, float | None]:
        vals = []
        for r in ok.get(c, []):
            sv = r["saves"]
            vals += [sv[i][f]] if i is not None else [x[f] for x in sv[1:]]
        return _stat(vals)

    if ok.get("sync"):
        s["sync_save_s"] = _stat([r["save_s"] for r in ok["sync"]])
        s["sync_peak_extra_bytes"] = _stat([r["peak_extra_bytes"] for r in ok["sync"]])
    for c in ("async", "lazy", "dcp", "fork"):
        if ok.get(c):
            s[c] = {"first_blocking_s": saves(c, 0, "blocking_s"),
                    "first_total_s": saves(c, 0, "total_s"),
                    "later_blocking_s": saves(c, None, "blocking_s"),
                    "later_total_s": saves(c, None, "total_s"),
                    "peak_extra_bytes": _stat([r.get("peak_extra_pss_bytes",
                                                     r["peak_extra_bytes"]) for r in ok[c]])}
            if all(r.get("step_s") is not None for r in ok[c]):
                s[c]["step_s"] = _stat([r["step_s"] for r in ok[c]])
                s[c]["first_step_after_s"] = saves(c, 0, "step_after_s")
                s[c]["later_step_after_s"] = saves(c, None, "step_after_s")
    if ok.get("memcpy"):
        s["memcpy_fresh_s"] = _stat([r["fresh_s"] for r in ok["memcpy"]])
        s["memcpy_reused_s"] = _stat([r["reused_s"] for r in ok["memcpy"]])
    first = next((r for rs in ok.values() for r in rs), None)
    if first is not None:
        s["state_bytes"] = first["state_bytes"]
        s["budget_bytes"] = first["budget_bytes"]
    return s


def render_md(results: dict[str, Any]) -> str:
    s = results["summary"]

    def f(st: dict[str, Any] | None, scale: float = 1.0, nd: int = 2) -> str:
        if not st or st.get("median") is None:
            return "—"
        return (f"{st['median'] / scale:.{nd}f} ({st['min'] / scale:.{nd}f}–"
                f"{st['max'] / scale:.{nd}f})")

    gib = float(1 << 30)
    lines = [
        "# save_async phases (each configuration in a fresh process)",
        "",
        f"Command: `{results['command']}`",
        "",
        f"State: {s.get('state_bytes', 0) / gib:.2f} GiB of torch fp32 tensors (Llama-like); "
        f"memory budget {s.get('budget_bytes', 0) / gib:.2f} GiB. Medians (min–max) of "
        f"{max((len(v) for v in results['runs'].values()), default=0)} runs per configuration, "
        "seconds; peak = process high-water mark minus the state's resident bytes (GiB). "
        "Shared 2-core machine.",
        "",
        f"- sync `ss.save`: {f(s.get('sync_save_s'))} s, peak extra "
        f"{f(s.get('sync_peak_extra_bytes'), gib)} GiB",
        f"- memcpy of the state: into fresh memory {f(s.get('memcpy_fresh_s'))} s, "
        f"into the same memory again {f(s.get('memcpy_reused_s'))} s",
        "",
        "| | first save: blocking | first save: total | later saves: blocking | "
        "later saves: total | peak extra (GiB) |",
        "|---|---|---|---|---|---|",
    ]
    names = {"async": "`ss.save_async`", "lazy": "`ss.save_async(lazy=True)`",
             "dcp": "DCP `async_save`", "fork": "fork + `ss.save` in the child"}
    for c, name in names.items():
        if c in s:
            x = s[c]
            lines.append(f"| {name} | {f(x['first_blocking_s'])} | {f(x['first_total_s'])} | "
                         f"{f(x['later_blocking_s'])} | {f(x['later_total_s'])} | "
                         f"{f(x['peak_extra_bytes'], gib)} |")
    stepped = [c for c in names if c in s and "step_s" in s[c]]
    if stepped:
        lines += ["", "A step writing every tensor in place, right after the blocking phase "
                  "returned, against the same step with no save in flight (s):", "",
                  "| | step alone | step after the first save | step after later saves |",
                  "|---|---|---|---|"]
        for c in stepped:
            x = s[c]
            lines.append(f"| {names[c]} | {f(x['step_s'], nd=3)} | "
                         f"{f(x['first_step_after_s'], nd=3)} | "
                         f"{f(x['later_step_after_s'], nd=3)} |")
    sync = (s.get("sync_save_s") or {}).get("median")
    if sync:
        lines += ["", "Ratios to the sync save (medians):", ""]
        for c, name in names.items():
            if c in s:
                x = s[c]
                fb, lb = x["first_blocking_s"]["median"], x["later_blocking_s"]["median"]
                ft, lt = x["first_total_s"]["median"], x["later_total_s"]["median"]
                lines.append(f"- {name}: blocking {fb / sync:.2f}x first, {lb / sync:.2f}x later; "
                             f"total {ft / sync:.2f}x first, {lt / sync:.2f}x later")
    return "\n".join(lines) + "\n"


def write(results: dict[str, Any], out_json: Path) -> str:
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(results, indent=1, default=str))
    md = render_md(results)
    out_json.with_suffix(".md").write_text(md)
    return md


__all__ = ["child", "run", "render_md", "write", "MiB"]
