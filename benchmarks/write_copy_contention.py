"""Do O_DIRECT writes and memory copies overlap on this machine? (issue 16, goal 2)

A ``save_async`` whose memory budget B is below the state's size S races: copy threads
copy B bytes into staging while the writers write the other S - B straight from the
state, and the call returns when both are done. Whether that costs max(write, copy)
or write + copy depends on whether the two compete for the same resource. This times
256 MiB of O_DIRECT writes (4 threads, 16 MiB each, as the writers issue them) and a
768 MiB copy into resident memory (2 threads, as the copy threads), alone and together.

    .venv/bin/python benchmarks/write_copy_contention.py [--dir DIR] [--repeats 5]
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import threading
import time

import numpy as np

MiB = 1 << 20
WRITE, COPY, STEP = 256 * MiB, 768 * MiB, 16 * MiB


def _write(src: np.ndarray, path: str) -> float:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT)
    mv = memoryview(src)

    def one(i: int) -> None:
        for off in range(i * STEP, WRITE, 4 * STEP):
            os.pwrite(fd, mv[off:off + STEP], off)

    t = time.perf_counter()
    _threads(one, 4)
    d = time.perf_counter() - t
    os.close(fd)
    return d


def _copy(dst: np.ndarray, src: np.ndarray) -> float:
    half = COPY // 2
    t = time.perf_counter()
    _threads(lambda i: np.copyto(dst[i * half:(i + 1) * half], src[i * half:(i + 1) * half]), 2)
    return time.perf_counter() - t


def _threads(fn, n: int) -> None:
    ts = [threading.Thread(target=fn, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def _together(src: np.ndarray, path: str, dst: np.ndarray, csrc: np.ndarray) -> tuple[float, float]:
    """The write on a thread of its own and the copy at the same time: each one's time."""
    got: dict[str, float] = {}
    th = threading.Thread(target=lambda: got.setdefault("w", _write(src, path)))
    th.start()
    got["c"] = _copy(dst, csrc)
    th.join()
    return got["w"], got["c"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=".", help="where the 256 MiB scratch file goes (a local disk)")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    path = os.path.join(a.dir, ".write-copy-contention.tmp")
    src = np.frombuffer(mmap.mmap(-1, WRITE), np.uint8)  # page-aligned, for O_DIRECT
    src[:] = 1
    csrc, cdst = np.ones(COPY, np.uint8), np.zeros(COPY, np.uint8)  # both resident
    rows: dict[str, list[float]] = {k: [] for k in ("write", "copy", "together", "write_in", "copy_in")}
    try:
        for _ in range(a.repeats):
            rows["write"].append(_write(src, path))
            rows["copy"].append(_copy(cdst, csrc))
            t = time.perf_counter()
            w, c = _together(src, path, cdst, csrc)
            rows["together"].append(time.perf_counter() - t)
            rows["write_in"].append(w)
            rows["copy_in"].append(c)
    finally:
        if os.path.exists(path):
            os.unlink(path)
    med = {k: statistics.median(v) for k, v in rows.items()}
    rng = {k: (min(v), max(v)) for k, v in rows.items()}
    for k, label in [("write", "256 MiB O_DIRECT write alone"), ("copy", "768 MiB copy alone"),
                     ("together", "both at once, until both are done"),
                     ("write_in", "  the write, while copying"), ("copy_in", "  the copy, while writing")]:
        print(f"{label:40s} {med[k]:.3f} s ({rng[k][0]:.3f}-{rng[k][1]:.3f})")
    print(f"together / max(alone) = {med['together'] / max(med['write'], med['copy']):.2f}; "
          f"together / (write + copy) = {med['together'] / (med['write'] + med['copy']):.2f} "
          f"(1.0 there: the two do not overlap at all)")


if __name__ == "__main__":
    main()
