"""Do O_DIRECT writes and memory copies overlap on this machine? (issue 16, goal 2)

A ``save_async`` whose memory budget B is below the state's size S races: copy threads
copy B bytes into staging while the writers write the other S - B straight from the
state, and the call returns when both are done. Whether that can cost max(write, copy)
rather than write + copy depends on whether the two compete for the same resource.
This times 256 MiB of O_DIRECT writes (4 threads, 16 MiB each, as the writers issue
them) and a 768 MiB copy into resident memory (2 threads, as the copy threads), alone
and together. Every thread is started before the clock and released at once by a
barrier (``--start-during``: the writers are started while the copy runs instead).
``--overwrite`` writes over the blocks of an existing file instead of a new one.

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


class _Bench:
    def __init__(self, path: str, overwrite: bool) -> None:
        self.path, self.overwrite = path, overwrite
        self.src = np.frombuffer(mmap.mmap(-1, WRITE), np.uint8)  # page-aligned, for O_DIRECT
        self.src[:] = 1
        self.csrc, self.cdst = np.ones(COPY, np.uint8), np.zeros(COPY, np.uint8)  # resident
        if overwrite:
            with open(path, "wb") as f:
                f.write(bytes(WRITE))
                os.fsync(f.fileno())

    def _open(self) -> int:
        if not self.overwrite and os.path.exists(self.path):
            os.unlink(self.path)
        return os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT)

    def run(self, write: bool, copy: bool, start_during: bool = False) -> tuple[float, float]:
        """Seconds until the writes, and until the copy, are done (0 where not run)."""
        fd = self._open() if write else -1
        mv = memoryview(self.src)
        late = write and copy and start_during
        go = threading.Barrier(1 + (4 if write and not late else 0) + (2 if copy else 0))
        ends: dict[str, float] = {}

        def writer(i: int) -> None:
            if not late:
                go.wait()
            for off in range(i * STEP, WRITE, 4 * STEP):
                os.pwrite(fd, mv[off:off + STEP], off)
            ends[f"w{i}"] = time.perf_counter()

        def copier(i: int) -> None:
            half = COPY // 2
            go.wait()
            np.copyto(self.cdst[i * half:(i + 1) * half], self.csrc[i * half:(i + 1) * half])
            ends[f"c{i}"] = time.perf_counter()

        ws = [threading.Thread(target=writer, args=(i,)) for i in range(4)] if write else []
        cs = [threading.Thread(target=copier, args=(i,)) for i in range(2)] if copy else []
        for t in cs + ([] if late else ws):
            t.start()
        time.sleep(0.05)
        t0 = time.perf_counter()
        go.wait()
        for t in ws if late else []:
            t.start()
        for t in ws + cs:
            t.join()
        if fd >= 0:
            os.close(fd)
        w = max((v for k, v in ends.items() if k[0] == "w"), default=t0) - t0
        c = max((v for k, v in ends.items() if k[0] == "c"), default=t0) - t0
        return w, c


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=".", help="where the 256 MiB scratch file goes (a local disk)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--overwrite", action="store_true", help="write over an existing file's blocks")
    ap.add_argument("--start-during", action="store_true",
                    help="start the writer threads while the copy runs")
    a = ap.parse_args()
    path = os.path.join(a.dir, ".write-copy-contention.tmp")
    rows: dict[str, list[float]] = {k: [] for k in ("write", "copy", "together", "write_in", "copy_in")}
    try:
        b = _Bench(path, a.overwrite)
        for _ in range(a.repeats):
            rows["write"].append(b.run(True, False)[0])
            rows["copy"].append(b.run(False, True)[1])
            w, c = b.run(True, True, a.start_during)
            rows["together"].append(max(w, c))
            rows["write_in"].append(w)
            rows["copy_in"].append(c)
    finally:
        if os.path.exists(path):
            os.unlink(path)
    med = {k: statistics.median(v) for k, v in rows.items()}
    for k, label in [("write", "256 MiB O_DIRECT write alone"), ("copy", "768 MiB copy alone"),
                     ("together", "both at once, until both are done"),
                     ("write_in", "  the writes done after"), ("copy_in", "  the copy done after")]:
        print(f"{label:40s} {med[k]:.3f} s ({min(rows[k]):.3f}-{max(rows[k]):.3f})")
    print(f"together / max(alone) = {med['together'] / max(med['write'], med['copy']):.2f} "
          f"(1.0: they overlap fully); together / (write + copy) = "
          f"{med['together'] / (med['write'] + med['copy']):.2f} (1.0: not at all)")


if __name__ == "__main__":
    main()
