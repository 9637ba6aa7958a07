"""The JAX collective's exchanges: time per operation and what stays in the coordination service.

N real JAX processes (``jax.distributed`` on loopback, CPU) run ``--ops`` rounds of
``all_gather_object`` of a small object, ``any_true`` (or its all-gather fallback, as
``agree`` uses it), ``broadcast_object`` and ``gather_object``; every process times each
kind; the figure is the slowest process's mean per operation. At the end (after one more
all-gather and 2.5 s) process 0 counts the keys statestream left under ``statestream/``
in the coordination service's key-value store (JAX keeps every key until the job ends).

Compare two source trees in the same run, alternated per round::

    git worktree add /tmp/old HEAD~1
    .venv/bin/python benchmarks/bench_jax_collective.py --procs 4,8 --src /tmp/old/src --src src
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import free_port  # noqa: E402


def worker(rank: int, world: int, port: int, ops: int) -> dict[str, object]:
    import jax

    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=world,
                               process_id=rank)
    from jax._src import distributed

    from statestream.distributed import JaxCollective

    coll = JaxCollective(timeout_s=120)
    obj = {"rank": rank, "digest": "x" * 32, "values": [1, 2.5, "step"]}
    any_true = getattr(coll, "any_true", None)
    kinds = {
        "all_gather_object": lambda: coll.all_gather_object(obj),
        "any_true": (lambda: any_true(rank == world - 1)) if any_true is not None else
        (lambda: any(coll.all_gather_object(rank == world - 1))),
        "broadcast_object": lambda: coll.broadcast_object(obj if rank == 0 else None, src=0),
        "gather_object": lambda: coll.gather_object(obj, 0),
    }
    out: dict[str, float] = {}
    coll.barrier("start")
    for name, fn in kinds.items():
        fn()  # warm
        coll.barrier(name)
        t0 = time.perf_counter()
        for _ in range(ops):
            fn()
        out[name] = (time.perf_counter() - t0) / ops
    coll.all_gather_object(None)  # every process is past the timed operations
    time.sleep(2.5)  # keys are deleted by a background thread, once a second
    left = None
    if rank == 0:
        client = distributed.global_state.client
        left = len([k for k, _ in client.key_value_dir_get("statestream/")
                    if not k.startswith("statestream/alive/")])
    coll.barrier("counted")
    jax.distributed.shutdown()
    return {"rank": rank, "per_op_s": out, "keys_left": left}


def run(src: str, world: int, ops: int) -> dict[str, object]:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.path.abspath(src), JAX_PLATFORMS="cpu")
    procs = [subprocess.Popen([sys.executable, __file__, "--worker",
                               json.dumps([r, world, port, ops])],
                              env=env, stdout=subprocess.PIPE, text=True)
             for r in range(world)]
    outs = [p.communicate(timeout=1200)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"a worker failed: {[p.returncode for p in procs]}")
    got = [json.loads(o.strip().splitlines()[-1]) for o in outs]
    kinds = got[0]["per_op_s"]
    return {"per_op_s": {k: max(g["per_op_s"][k] for g in got) for k in kinds},
            "keys_left": got[0]["keys_left"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--procs", default="4,8")
    ap.add_argument("--ops", type=int, default=100, help="operations of each kind per launch")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--src", action="append", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        print(json.dumps(worker(*json.loads(args.worker))))
        return
    srcs = args.src or ["src"]
    runs: dict[str, list[dict[str, object]]] = {}
    for world in [int(x) for x in args.procs.split(",")]:
        for rnd in range(args.rounds):
            for src in (srcs if rnd % 2 == 0 else srcs[::-1]):
                r = run(src, world, args.ops)
                runs.setdefault(f"{world}:{src}", []).append(r)
                print(f"procs {world} src {src} round {rnd}: "
                      + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in r["per_op_s"].items())
                      + f"; keys left {r['keys_left']}", flush=True)
    print("\nslowest process's mean per operation, median over rounds (ms); keys left:")
    for key, rs in runs.items():
        kinds = rs[0]["per_op_s"]
        print(f"  procs {key}: " + ", ".join(
            f"{k} {statistics.median(r['per_op_s'][k] for r in rs) * 1e3:.2f}" for k in kinds)
            + f"; keys left {rs[-1]['keys_left']}")
    if args.out:
        Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv), "runs": runs},
                                             indent=1))


if __name__ == "__main__":
    main()
