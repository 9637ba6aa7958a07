"""Cold loads of the 3 GB Llama-like state, one fresh process per load, systems alternated.

What ``bench_core.py`` measures in one pass per system, this measures as interleaved
pairs, which is what a noisy machine needs to compare two ways of loading the same bytes
(issue 16 goal 1). Every sample: a fresh child process, page cache dropped, the clock
around the load call plus whatever makes every byte resident:

- ``ss``: ``ss.load(path)`` (NumPy, no target; large arrays mapped, every chunk's CRC-32C
  checked, which pulls their pages in),
- ``ss-torch``: ``ss.load(path, target=torch-like)`` (the ``like`` tensors are made first,
  outside the clock, as ``torch.empty``: no page touched),
- ``ss-inplace`` / ``ss-inplace-drop``: ``ss.load(path, target=resident tensors,
  in_place=True)``, the second with ``IOOptions(drop_behind=True)`` (``-t4``: and four
  I/O threads); targets are made and
  zeroed *before* the page cache is dropped (a training job's),
- ``torch-mmap``: ``torch.load(file, mmap=True, weights_only=True)`` plus a read of one
  byte per 4 KiB page of every tensor,
- ``raw``: two threads ``preadv`` the statestream data files in 64 MiB requests into
  pre-faulted buffers (the disk's limit, as bench_core's raw probe); ``raw-drop``: the
  same in 8 MiB requests, letting the page cache drop each one once read
  (``posix_fadvise(DONTNEED)``), so the page cache reuses its pages instead of taking
  fresh ones, which this VM backs slowly.

A/B of two source trees: ``--old-src /tmp/base/src`` and systems suffixed ``@old``
(``--systems raw,ss-inplace-drop,ss-inplace-drop@old``) run the old tree in the same
rounds.

Run::

    .venv/bin/python benchmarks/cold_loads.py --dir /tmp/coldloads --repeats 5 \\
        --systems raw,ss,ss-torch,torch-mmap,ss-inplace,ss-inplace-drop \\
        --out benchmarks/results/loads/cold-loads.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"


def _spec(size: str) -> list[tuple[str, tuple[int, ...]]]:
    sys.path.insert(0, str(HERE))
    import bench_core

    return bench_core.workload_spec("llama", False, 0, size)


def _prepare(d: Path, size: str) -> None:
    import numpy as np
    import torch

    import statestream as ss

    sys.path.insert(0, str(HERE))
    import bench_core

    spec = _spec(size)
    if not (d / "ss" / "COMMITTED").exists():
        state = {k: torch.from_numpy(v) for k, v in bench_core.build_numpy(spec).items()}
        ss.save(d / "ss", state, overwrite=True)
        torch.save(state, d / "state.pt")
        del state
    np.zeros(1)  # (numpy imported for the build)


def _raw(d: Path, drop: bool = False) -> None:
    import numpy as np

    files = sorted((d / "ss" / "data").iterdir())
    chunk = (8 if drop else 64) << 20
    lock = threading.Lock()
    todo = list(files)

    def worker() -> None:
        buf = np.ones(chunk, dtype=np.uint8)
        while True:
            with lock:
                if not todo:
                    return
                f = todo.pop()
            fd = os.open(f, os.O_RDONLY)
            try:
                off = 0
                while (n := os.preadv(fd, [buf], off)) > 0:
                    if drop:
                        os.posix_fadvise(fd, off, n, os.POSIX_FADV_DONTNEED)
                    off += n
            finally:
                os.close(fd)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _child(system: str, d: Path, size: str) -> dict[str, float]:
    import numpy as np
    import torch

    import statestream as ss

    sys.path.insert(0, str(HERE))
    from _common import drop_caches

    spec = _spec(size)
    like = None
    if system in ("ss-inplace", "ss-inplace-drop", "ss-inplace-drop-t4"):
        like = {k: torch.zeros(s) for k, s in spec}  # resident, as a training job's
    elif system == "ss-torch":
        like = {k: torch.empty(s) for k, s in spec}
    err = drop_caches()
    if err:
        raise SystemExit(f"cannot drop the page cache: {err}")
    t0, c0 = time.perf_counter(), os.times()
    if system in ("raw", "raw-drop"):
        _raw(d, drop=system == "raw-drop")
    elif system == "ss":
        out = ss.load(d / "ss")
    elif system == "ss-torch":
        out = ss.load(d / "ss", target=like)
    elif system == "ss-inplace":
        out = ss.load(d / "ss", target=like, in_place=True)
    elif system == "ss-inplace-drop":
        out = ss.load(d / "ss", target=like, in_place=True, io=ss.IOOptions(drop_behind=True))
    elif system == "ss-inplace-drop-t4":  # four I/O threads: a deeper queue of cold reads
        out = ss.load(d / "ss", target=like, in_place=True,
                      io=ss.IOOptions(drop_behind=True, num_threads=4))
    elif system == "torch-mmap":
        out = torch.load(d / "state.pt", mmap=True, weights_only=True)
        for v in out.values():  # one byte per page: the mapping's pages come in
            int(v.reshape(-1).view(torch.uint8)[::4096].sum())
    else:
        raise SystemExit(f"unknown system {system}")
    wall, c1 = time.perf_counter() - t0, os.times()
    if not system.startswith("raw"):
        k0 = spec[0][0]
        assert np.asarray(out[k0]).shape == spec[0][1]
    return {"s": wall, "user": c1.user - c0.user, "sys": c1.system - c0.system}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/tmp/coldloads")
    ap.add_argument("--size", default="3g")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--systems", default="raw,ss,ss-torch,torch-mmap,ss-inplace,ss-inplace-drop")
    ap.add_argument("--out", default=None)
    ap.add_argument("--old-src", default=None,
                    help="source tree for systems suffixed @old (an A/B in one run)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    d = Path(a.dir)
    if a.child:
        print(json.dumps(_child(a.child.split("@")[0], d, a.size)))
        return
    d.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    old_env = {**os.environ, "PYTHONPATH": str(a.old_src)} if a.old_src else None
    subprocess.run([sys.executable, __file__, "--dir", str(d), "--size", a.size, "--child",
                    "prepare"], env=env, check=True)
    systems = [s.strip() for s in a.systems.split(",") if s.strip()]
    nbytes = sum((d / "ss" / "data" / f).stat().st_size for f in os.listdir(d / "ss" / "data"))
    samples: dict[str, list[dict[str, float]]] = {s: [] for s in systems}
    for r in range(a.repeats):
        for s in (systems if r % 2 == 0 else systems[::-1]):  # alternate the order
            if s.endswith("@old") and old_env is None:
                raise SystemExit(f"{s}: give --old-src")
            p = subprocess.run([sys.executable, __file__, "--dir", str(d), "--size", a.size,
                                "--child", s], env=old_env if s.endswith("@old") else env,
                               capture_output=True, text=True, check=True)
            got = json.loads(p.stdout.strip().splitlines()[-1])
            samples[s].append(got)
            print(f"[{r}] {s:16s} {got['s']:.3f} s  {nbytes / got['s'] / 1e9:.2f} GB/s  "
                  f"user {got['user']:.2f} sys {got['sys']:.2f}", flush=True)
    summary = {}
    for s, xs in samples.items():
        secs = [x["s"] for x in xs]
        summary[s] = {"median_s": statistics.median(secs), "min_s": min(secs),
                      "max_s": max(secs), "gbps": nbytes / statistics.median(secs) / 1e9}
    print("\n| system | median s [range] | GB/s | x raw |\n|---|---|---|---|")
    raw = summary.get("raw", {}).get("median_s")
    for s, v in summary.items():
        x = f"{raw / v['median_s']:.2f}" if raw else "n/a"
        print(f"| {s} | {v['median_s']:.3f} [{v['min_s']:.3f}-{v['max_s']:.3f}] | "
              f"{v['gbps']:.2f} | {x} |")
    if a.out:
        Path(a.out).write_text(json.dumps({"args": vars(a), "bytes": nbytes,
                                           "samples": samples, "summary": summary}, indent=1))


if __name__ == "__main__":
    if "--child" in sys.argv and sys.argv[sys.argv.index("--child") + 1] == "prepare":
        _prepare(Path(sys.argv[sys.argv.index("--dir") + 1]),
                 sys.argv[sys.argv.index("--size") + 1])
    else:
        main()
