#!/usr/bin/env python3
"""Fresh memory for loads: which allocation fills fastest (statestream._memory).

Part 1 (always): read ``--size`` bytes of a file in the page cache into fresh buffers
(16 pieces, 2 threads, ``preadv``), each try in a fresh process, the allocators
interleaved: ``numpy`` (``np.empty``: NumPy advises ``MADV_HUGEPAGE`` on buffers of
4 MiB or more), ``numpy-noadvice`` (the same with NumPy's switch off for the process),
``statestream`` (``fresh_bytes``: NumPy's allocator with the advice off for the call,
page-aligned), ``torch`` (``torch.empty``). ``--churn N`` first allocates, touches and frees
N x 16 MiB in the process (as building a model and a training step do).

Part 2 (``--resume-old-src DIR``): a ``StatestreamTrainer`` resume of GPT-2 124M +
AdamW (benchmarks/bench_hf_trainer.py's child: load + first step), the library in
``DIR/statestream`` (e.g. a worktree of an older commit) against this checkout's, and the
``Trainer``'s own resume, interleaved in fresh processes.

    PYTHONPATH=src .venv/bin/python benchmarks/fresh_memory.py --repeats 5 --churn 150
    git worktree add /tmp/old <commit>
    PYTHONPATH=src .venv/bin/python benchmarks/fresh_memory.py --repeats 5 --resume-old-src /tmp/old/src
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
sys.path.insert(0, str(HERE))
from _common import med, run_child  # noqa: E402

ALLOCATORS = ("numpy", "numpy-noadvice", "statestream", "torch")


def _child(task: dict) -> dict:
    import numpy as np
    import torch

    from statestream._memory import fresh_bytes

    torch.set_num_threads(2)
    for _ in range(task["churn"]):  # one at a time: allocated, touched, freed
        torch.randn(1 << 22).mul_(2)
    if task["churn"]:
        xs = [torch.randn(1 << 22) for _ in range(task["churn"])]
        del xs
    kind, path = task["alloc"], task["file"]
    n = os.path.getsize(path)
    size = n // 16

    def alloc(nb: int) -> np.ndarray:
        if kind == "numpy":
            return np.empty(nb, np.uint8)
        if kind == "torch":
            return torch.empty(nb, dtype=torch.uint8).numpy()
        if kind == "numpy-noadvice":  # NumPy's allocator (heap reuse), advice off
            np._core.multiarray._set_madvise_hugepage(False)
            return np.empty(nb, np.uint8)
        return fresh_bytes(nb)

    fd = os.open(path, os.O_RDONLY)
    t0 = time.perf_counter()
    bufs = [alloc(size) for _ in range(16)]

    def read(i: int) -> None:
        got = 0
        while got < size:
            got += os.preadv(fd, [memoryview(bufs[i])[got:]], i * size + got)

    with ThreadPoolExecutor(2) as ex:
        list(ex.map(read, range(16)))
    return {"ok": True, "s": time.perf_counter() - t0, "bytes": size * 16}


def _run(script: Path | str, src: Path, task: dict, name: str, timeout: float) -> dict:
    r = run_child(script, src, task, timeout, stderr_on_failure=True)
    if not r.get("ok"):
        raise SystemExit(f"{name}: {r}")
    return r


def _part1(a: argparse.Namespace, root: Path) -> dict:
    blob = root / "blob"
    with open(blob, "wb") as f:
        for _ in range(a.size >> 24):
            f.write(os.urandom(1 << 24))
    with open(blob, "rb") as f:  # into the page cache
        while f.read(1 << 24):
            pass
    rows: dict[str, list[float]] = {k: [] for k in ALLOCATORS}
    for _ in range(a.repeats):
        for kind in ALLOCATORS:
            r = _run(__file__, SRC, {"alloc": kind, "file": str(blob), "churn": a.churn}, kind, 600)
            rows[kind].append(r["s"])
            print(f"{kind}: {r['s']:.3f} s", flush=True)
    return rows


def _part2(a: argparse.Namespace, root: Path) -> dict:
    bench = HERE / "bench_hf_trainer.py"
    ck = {}
    for conf in ("hf", "ss-sync"):
        out = root / f"make-{conf}"
        _run(bench, SRC, {"config": conf, "quick": a.quick, "steps": 8, "every": 8,
                          "out": str(out)}, conf, 1800)
        ck[conf] = out / "checkpoint-8"
    runs = (("Trainer's own", "hf", SRC), ("statestream before", "ss-sync", Path(a.resume_old_src)),
            ("statestream now", "ss-sync", SRC))
    rows: dict[str, list[float]] = {name: [] for name, _, _ in runs}
    for _ in range(a.repeats):
        for name, conf, src in runs:
            out = root / "resume"
            shutil.rmtree(out, ignore_errors=True)
            r = _run(bench, src, {"config": conf, "quick": a.quick, "steps": 9, "every": 8,
                                  "out": str(out), "resume": str(ck[conf])}, name, 1800)
            rows[name].append(r["to_first_step_s"])
            print(f"{name}: resume + first step {r['to_first_step_s']:.3f} s", flush=True)
    return rows


def _table(title: str, rows: dict[str, list[float]]) -> str:
    out = [f"| {title} | median s | min-max |", "|---|---|---|"]
    for k, v in rows.items():
        out.append(f"| {k} | {med(v):.3f} | {min(v):.3f}-{max(v):.3f} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=int, default=1 << 30)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--churn", type=int, default=0)
    ap.add_argument("--resume-old-src", default=None)
    ap.add_argument("--quick", action="store_true", help="part 2 on a 3M-parameter model")
    ap.add_argument("--out", default=None, help="JSON results file")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print("RESULT:" + json.dumps(_child(json.loads(a.child))), flush=True)
        return
    root = Path(tempfile.mkdtemp(prefix="fresh-memory-", dir=os.environ.get("BENCH_DIR")))
    try:
        if a.resume_old_src:
            res = {"resume": _part2(a, root)}
            print(_table("resume + first step", res["resume"]))
        else:
            res = {"read": _part1(a, root)}
            print(_table(f"read {a.size / 2**30:.2f} GiB into fresh memory (churn {a.churn})",
                         res["read"]))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"args": vars(a), **res}, indent=1))


if __name__ == "__main__":
    main()
