"""Converting between formats: ss.convert vs the formats' own load + save.

Cases (each in a fresh child process; wall time and peak-RSS growth measured there):

- ``ss->safetensors``, ``safetensors->ss``: ``ss.convert`` each way (it fsyncs what it
  writes); ``safetensors load+save``: ``safetensors.torch.load_file`` + ``save_file`` of the
  same state (what a user does without statestream; ``save_file`` does not fsync, so its
  bytes may still be in the page cache when it returns); ``safetensors load+save+fsync``:
  the same plus ``os.fsync`` of the written file (the durability ``ss.convert`` gives).
- ``safetensors->ss zstd``: ``ss.convert(..., compression="zstd")`` (the output's size is
  reported beside the raw one's).
- ``ss->dcp``, ``dcp->ss``: ``ss.convert`` each way; ``dcp load+save``: ``dcp.load`` into a
  preallocated state dict + ``dcp.save`` of it (DCP's file writer fsyncs by default).
- ``orbax->ss``: ``ss.convert`` of an Orbax checkpoint (``StandardCheckpointer``'s defaults:
  OCDBT, zstd) of the same state as NumPy; ``orbax restore``: orbax's own
  ``StandardCheckpointer().restore`` of it, as NumPy (reading it, nothing written);
  ``ss.load orbax``: ``ss.load`` of it (allocating); ``ss->orbax``: ``ss.convert`` to Orbax.

Usage (from the repo root)::

    .venv/bin/python benchmarks/bench_convert.py --size-mb 256 --repeats 3
    .venv/bin/python benchmarks/bench_convert.py --quick      # 64 MB, 1 repeat

Results (every sample as JSON, medians and [min-max] as markdown, with the exact command)
go to ``benchmarks/results/convert/convert-<time>.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import llama_shapes, med, run_child  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CASES = ["ss->safetensors", "safetensors->ss", "safetensors->ss zstd", "safetensors load+save",
         "safetensors load+save+fsync", "ss->dcp", "dcp->ss", "dcp load+save", "orbax->ss", "orbax restore", "ss.load orbax",
         "ss->orbax"]


def _hwm() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def _shapes(size_mb: int) -> list[tuple[str, tuple[int, ...]]]:
    hidden = 512
    layers = max(1, size_mb * (1 << 20) // (4 * 12 * hidden * hidden))
    return llama_shapes(hidden, 4 * hidden, layers, 4096)


def _state(size_mb: int) -> dict[str, object]:
    import torch

    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(s, generator=g).to(torch.bfloat16 if "norm" in n else torch.float32)
            for n, s in _shapes(size_mb)}


def ml_bf16() -> object:
    import ml_dtypes

    return ml_dtypes.bfloat16


def child(task: dict) -> dict:
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file, save_file

    import statestream as ss

    warnings.simplefilter("ignore")
    d = Path(task["dir"])
    case = task["case"]
    out = d / f"out-{task['i']}"
    if case == "prepare":
        state = _state(task["size_mb"])
        ss.save(d / "src-ss", {"model": state})
        save_file(state, d / "src.safetensors")
        dcp.save({"model": state}, checkpoint_id=str(d / "src-dcp"))
        try:
            import orbax.checkpoint as ocp
        except ImportError:
            pass
        else:
            ck = ocp.StandardCheckpointer()
            ck.save(d / "src-orbax", {"model": {n: t.view(torch.int16).numpy().view(ml_bf16())
                                                if t.dtype == torch.bfloat16 else t.numpy()
                                                for n, t in state.items()}})
            ck.wait_until_finished()
        return {"ok": True, "bytes": sum(t.nbytes for t in state.values())}
    base = _hwm()
    t0 = time.perf_counter()
    if case == "ss->safetensors":
        ss.convert(d / "src-ss", f"{out}.safetensors", items=["model"])
    elif case == "safetensors->ss":
        ss.convert(d / "src.safetensors", out)
    elif case == "safetensors->ss zstd":
        ss.convert(d / "src.safetensors", out, compression="zstd")
    elif case == "safetensors load+save":
        save_file(load_file(d / "src.safetensors"), f"{out}.safetensors")
    elif case == "safetensors load+save+fsync":
        save_file(load_file(d / "src.safetensors"), f"{out}.safetensors")
        fd = os.open(f"{out}.safetensors", os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    elif case == "ss->dcp":
        ss.convert(d / "src-ss", out, to="dcp")
    elif case == "dcp->ss":
        ss.convert(d / "src-dcp", out)
    elif case == "orbax->ss":
        ss.convert(d / "src-orbax", out)
    elif case == "orbax restore":
        import orbax.checkpoint as ocp

        ocp.StandardCheckpointer().restore(d / "src-orbax")
    elif case == "ss.load orbax":
        ss.load(d / "src-orbax")
    elif case == "ss->orbax":
        ss.convert(d / "src-ss", out, to="orbax", items=["model"],
                   memory=ss.MemoryOptions(memory_budget_bytes=task["budget_mb"] << 20)
                   if task.get("budget_mb") else None)
    elif case == "dcp load+save":
        sd = {"model": {n: torch.empty(s, dtype=torch.bfloat16 if "norm" in n else torch.float32)
                        for n, s in _shapes(task["size_mb"])}}
        dcp.load(sd, checkpoint_id=str(d / "src-dcp"))
        dcp.save(sd, checkpoint_id=str(out))
    seconds = time.perf_counter() - t0
    written = sum(p.stat().st_size for p in d.glob(f"out-{task['i']}*/**/*") if p.is_file())
    written += sum(p.stat().st_size for p in d.glob(f"out-{task['i']}*") if p.is_file())
    return {"ok": True, "seconds": seconds, "rss_growth_mb": (_hwm() - base) / 2**20,
            "written_mb": written / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--dir", default="bench-data-convert")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated subset")
    ap.add_argument("--budget-mb", type=int, default=0,
                    help="memory budget of the ss->orbax case (default: the library's)")
    ap.add_argument("--child")
    a = ap.parse_args()
    if a.child:
        try:
            r = child(json.loads(a.child))
        except Exception as e:  # reported, not raised: the parent records the failure
            r = {"ok": False, "error": repr(e)}
        print("RESULT:" + json.dumps(r))
        return
    if a.quick:
        a.size_mb, a.repeats = 64, 1
    d = Path(a.dir).resolve()
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    src = ROOT / "src"
    me = Path(__file__)
    prep = run_child(me, src, {"case": "prepare", "dir": str(d), "size_mb": a.size_mb, "i": 0},
                     a.timeout, stderr_on_failure=True)
    if not prep.get("ok"):
        sys.exit(f"prepare failed: {prep}")
    cases = [c for c in CASES if c in a.cases.split(",")]
    samples: dict[str, list[dict]] = {c: [] for c in cases}
    for r in range(a.repeats):
        for c in cases:
            res = run_child(me, src, {"case": c, "dir": str(d), "size_mb": a.size_mb,
                                      "i": f"{r}-{CASES.index(c)}", "budget_mb": a.budget_mb},
                            a.timeout,
                            stderr_on_failure=True)
            samples[c].append(res)
            for p in d.glob("out-*"):
                shutil.rmtree(p) if p.is_dir() else p.unlink()
            # untimed: what a case left unwritten (save_file does not fsync) must not be
            # written back while the next case is timed
            os.sync()
    gb = prep["bytes"] / 1e9
    cmd = " ".join([Path(sys.executable).name] + sys.argv)
    lines = [f"# convert benchmark ({prep['bytes'] / 2**20:.0f} MiB state, "
             f"{a.repeats} repeat(s))", "", f"command: `{cmd}`", "",
             "| case | median s [min-max] | GB/s | peak RSS growth MiB | written MiB |",
             "|---|---|---|---|---|"]
    for c in cases:
        secs = [x["seconds"] for x in samples[c] if x.get("seconds") is not None]
        s = med(secs)
        m = med([x.get("rss_growth_mb") for x in samples[c]])
        err = next((x.get("error") for x in samples[c] if not x.get("ok")), None)
        w = med([x.get("written_mb") for x in samples[c]])
        lines.append(f"| {c} | {s:.2f} [{min(secs):.2f}-{max(secs):.2f}] | {gb / s:.2f} | {m:.0f} "
                     f"| {w:.0f} |" if s else f"| {c} | failed: {err} | | | |")
    lines += ["", "Page cache warm (sources read hot); os.sync() between cases, untimed. "
              "ss.convert and DCP fsync what they write; safetensors' save_file does not "
              "(the +fsync row adds it). "
              f"Machine: {os.cpu_count()} CPUs, shared with other jobs."]
    text = "\n".join(lines) + "\n"
    print(text)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    res_dir = ROOT / "benchmarks" / "results" / "convert"
    res_dir.mkdir(parents=True, exist_ok=True)
    (res_dir / f"convert-{stamp}.json").write_text(json.dumps(
        {"command": cmd, "bytes": prep["bytes"], "samples": samples}, indent=1))
    (res_dir / f"convert-{stamp}.md").write_text(text)
    shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
