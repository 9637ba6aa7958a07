#!/usr/bin/env python3
"""One short CUDA check: the CUDA tests, then device-to-host bandwidth and save blocking.

Meant for a machine with an NVIDIA GPU, run once from the repo root::

    python benchmarks/cuda_check.py [--gib 2] [--out DIR]

It (1) runs ``tests/providers/test_cuda.py`` and (2) measures, for a state of
``--gib`` GiB of fp32 CUDA tensors (64 MiB each):

- device-to-host bandwidth of ``tensor.to("cpu")`` (pageable, what a naive
  save does), of ``copy_(non_blocking=True)`` into freshly pinned memory, and
  into pinned buffers that are reused (what statestream does);
- the blocking time of ``ss.save_async`` (first call, then with warm buffers)
  and of ``ss.save_async(lazy=True)``, and the total time to commit;
- the same for DCP's ``async_save`` (one process, a gloo group on loopback;
  torch's default stager copies the CUDA tensors to the host), in the same run.

Medians of ``--repeats`` runs; results go to stdout and, with ``--out``, to
``cuda_check.json`` there. Prints "SKIP" and exits 0 without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))


def _median_time(fn, repeats: int) -> tuple[float, list[float]]:
    import torch

    ts = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), ts


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def dcp_async_times(state: dict, scratch: Path, repeats: int) -> dict[str, object]:
    """Blocking (the call) and total (the future's result) times of DCP ``async_save``
    of ``state``: the first call, then the median of ``repeats`` more."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}",
                                rank=0, world_size=1)
    blocking, total = [], []
    for i in range(repeats + 1):
        path = scratch / f"dcp-{i}"
        _sync()
        t0 = time.perf_counter()
        fut = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(str(path)))
        blocking.append(time.perf_counter() - t0)
        fut.result()
        total.append(time.perf_counter() - t0)
        shutil.rmtree(path, ignore_errors=True)
    return {"blocking_first_s": blocking[0],
            "blocking_warm_median_s": statistics.median(blocking[1:]),
            "total_warm_median_s": statistics.median(total[1:]),
            "blocking_samples": blocking, "total_samples": total}


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--no-tests", action="store_true")
    args = ap.parse_args()

    import torch

    if not torch.cuda.is_available():
        print("SKIP: no CUDA device")
        return 0
    out: dict[str, object] = {"device": torch.cuda.get_device_name(0),
                              "torch": torch.__version__}
    if not args.no_tests:
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            str(REPO / "tests" / "providers" / "test_cuda.py")],
                           cwd=REPO, capture_output=True, text=True, timeout=300)
        print(r.stdout[-3000:], r.stderr[-2000:])
        out["tests_rc"] = r.returncode
        out["tests_tail"] = r.stdout.strip().splitlines()[-1:] if r.stdout else []

    import statestream as ss

    n = max(1, int(args.gib * 16))
    state = {f"t{i}": torch.randn(16 << 20, device="cuda") for i in range(n)}  # 64 MiB each
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    gb = nbytes / 1e9

    def pageable() -> None:
        for t in state.values():
            t.to("cpu")

    def fresh_pinned() -> None:
        for t in state.values():
            torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)

    reused = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in state.values()]

    def reused_pinned() -> None:
        for dst, t in zip(reused, state.values()):
            dst.copy_(t, non_blocking=True)

    res: dict[str, object] = {"state_bytes": nbytes}
    for name, fn in [("pageable_to_cpu", pageable), ("fresh_pinned", fresh_pinned),
                     ("reused_pinned", reused_pinned)]:
        med, ts = _median_time(fn, args.repeats)
        res[name] = {"median_s": med, "GBps": gb / med, "samples": ts}
        print(f"D2H {name:16s} {med:.4f} s  {gb / med:6.1f} GB/s")
    reused.clear()

    scratch = Path(tempfile.mkdtemp(prefix="ss-cuda-", dir=os.environ.get("TMPDIR")))
    try:
        ss.release_staging()
        for mode in ("async", "lazy"):
            blocking, total = [], []
            for i in range(args.repeats + 1):  # the first call allocates pinned buffers
                path = scratch / f"{mode}-{i}"
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                h = ss.save_async(path, state, lazy=mode == "lazy")
                if mode == "lazy":
                    h.wait_snapshot()
                blocking.append(time.perf_counter() - t0)
                h.result()
                total.append(time.perf_counter() - t0)
                shutil.rmtree(path)
            res[f"ss_{mode}"] = {
                "blocking_first_s": blocking[0],
                "blocking_warm_median_s": statistics.median(blocking[1:]),
                "snapshot_GBps_warm": gb / statistics.median(blocking[1:]),
                "total_warm_median_s": statistics.median(total[1:]),
                "blocking_samples": blocking, "total_samples": total,
            }
            print(f"ss.save_async {mode:5s}: blocking first {blocking[0]:.3f} s, warm "
                  f"{statistics.median(blocking[1:]):.3f} s; total {statistics.median(total[1:]):.3f} s")
        try:
            d = res["dcp_async"] = dcp_async_times(state, scratch, args.repeats)
            print(f"DCP async_save: blocking first {d['blocking_first_s']:.3f} s, warm "
                  f"{d['blocking_warm_median_s']:.3f} s; total {d['total_warm_median_s']:.3f} s")
        except Exception as exc:  # noqa: BLE001 - the rest of the check still counts
            res["dcp_async"] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"DCP async_save failed: {exc}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        ss.release_staging()
    out["results"] = res
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "cuda_check.json").write_text(json.dumps(out, indent=1))
    print(json.dumps(out)[:4000])
    return 0 if out.get("tests_rc", 0) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
