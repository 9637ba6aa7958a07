"""Cold load of an incremental checkpoint of the 3 GB Llama-like state, two source trees
alternated (one fresh process per sample, page cache dropped each time).

The base (``s1``, saved with ``hashes=True``) holds the state; ``s2`` changes one tensor
and refers to ``s1`` for everything else, so a load of ``s2`` reads almost all of its
bytes from its base's files. Each sample is ``ss.load(s2)`` (NumPy, no target).

Run (``--old`` a source tree to compare with, e.g. a ``git worktree`` of an older commit)::

    .venv/bin/python benchmarks/incremental_cold_load.py --dir /tmp/inc3g \\
        --old /tmp/base/src --new src --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _child(mode: str, d: Path) -> None:
    sys.path.insert(0, str(HERE))
    import bench_core
    from _common import drop_caches

    import statestream as ss

    spec = bench_core.workload_spec("llama", False, 0, "3g")
    if mode == "prepare":
        if not (d / "s2" / "COMMITTED").exists():
            st = bench_core.build_numpy(spec)
            ss.save(d / "s1", st, hashes=True, overwrite=True)
            k = spec[1][0]
            st[k] = st[k] + 1
            ss.save(d / "s2", st, base=d / "s1", overwrite=True)
        return
    err = drop_caches()
    if err:
        raise SystemExit(f"cannot drop the page cache: {err}")
    c0, t0 = os.times(), time.perf_counter()
    out = ss.load(d / "s2")
    wall, c1 = time.perf_counter() - t0, os.times()
    assert len(out) == len(spec)
    print(f"{wall} {c1.user - c0.user} {c1.system - c0.system}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/tmp/inc3g")
    ap.add_argument("--old", required=True, help="source tree (its src/) to compare with")
    ap.add_argument("--new", default=str(HERE.parent / "src"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    d = Path(a.dir)
    if a.child:
        _child(a.child, d)
        return
    d.mkdir(parents=True, exist_ok=True)

    def run(src: str, mode: str) -> str:
        env = {**os.environ, "PYTHONPATH": str(Path(src).resolve())}
        return subprocess.run([sys.executable, __file__, "--dir", str(d), "--old", a.old,
                               "--child", mode], env=env, check=True, capture_output=True,
                              text=True).stdout.strip()

    run(a.new, "prepare")
    got: dict[str, list[float]] = {"old": [], "new": []}
    for r in range(a.rounds):
        for name in (("old", "new") if r % 2 == 0 else ("new", "old")):
            wall, user, sys_ = (float(x) for x in run(getattr(a, name), "load").split())
            got[name].append(wall)
            print(f"[{r}] {name}: {wall:.3f} s (user {user:.2f}, sys {sys_:.2f})", flush=True)
    for name, xs in got.items():
        print(f"{name}: median {statistics.median(xs):.3f} s [{min(xs):.3f}-{max(xs):.3f}]")


if __name__ == "__main__":
    main()
