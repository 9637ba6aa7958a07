#!/usr/bin/env python3
"""Local tier benchmark: restore time per tier, and training time blocked per save.

The persistent tier is S3 on a moto server on 127.0.0.1 (its own process). Every
phase runs in fresh processes. Run from the repo root with the project venv::

    .venv/bin/python benchmarks/bench_tiers.py            # 256 MiB state, 3 repeats
    .venv/bin/python benchmarks/bench_tiers.py --quick    # 64 MiB, 2 repeats

Phases (medians over --repeats, every sample in the JSON):

1. blocked: a loop of --saves saves with --compute-s of (sleeping) compute between
   them; the time the save() call blocks the loop, for CheckpointManager on
   - "s3": s3:// straight (sync and async),
   - "local": a local directory, no tier (the reference: a plain local save),
   - "tier": s3:// with local_tier= (sync and async); persistence runs in the background.
   The final wait() (everything durable) is reported apart as "drain".
2. restore, one process: mgr.load() of the latest step with the page cache dropped, from
   the local tier ("local") and from S3 with an empty local tier ("s3").
3. restore, two processes (torch.distributed gloo; one local directory per process
   standing for its node's disk; replicate_to_peers=True; each process holds half the
   state): both nodes intact ("local"), node 1's directory deleted and the persistent
   copy deleted too ("peer": node 1's files come from node 0 over gloo), both local
   directories empty ("s3"). The time is the slowest rank's load.
4. incremental: a LoRA-like state (95% frozen, 5% changing every step) saved through
   the tier to S3, sync, with wait() after each save (time until the step is durable
   in S3), with and without incremental=True; bytes each step wrote (its own files);
   then a resume on a new machine (empty local tier): load, 2 s of "training", the next
   save until durable.

Outputs benchmarks/results/tiers/tiers-<timestamp>[-quick].{json,md}; the markdown is printed.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(HERE))

from _common import drop_caches, free_port, med, run_child  # noqa: E402

MiB = 1 << 20
BUCKET = "bench"
KEY_ID, SECRET = "bench-key", "bench-secret"
os.environ["NO_PROXY"] = os.environ["no_proxy"] = "127.0.0.1,localhost"
for _v in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy"):
    os.environ.pop(_v, None)
os.environ["AWS_EC2_METADATA_DISABLED"] = "true"


def log(*a: Any) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *a, file=sys.stderr, flush=True)


def make_state(mib: int, step: int, part: int = 0, parts: int = 1) -> dict[str, Any]:
    """``mib`` MiB of float32 in 8 arrays (part ``part`` of ``parts`` of them)."""
    n = mib * MiB // 4 // 8
    out: dict[str, Any] = {"step": step}
    for i in range(8):
        if i % parts == part:
            a = np.arange(n, dtype=np.float32)
            a += step * 1000 + i
            out[f"w{i}"] = a
    return {"params": out}


def check_state(got: dict[str, Any], mib: int, step: int, part: int = 0, parts: int = 1) -> bool:
    want = make_state(mib, step, part, parts)["params"]
    g = got["params"]
    return all(np.array_equal(g[k], v) if isinstance(v, np.ndarray) else g[k] == v
               for k, v in want.items())


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ------------------------------------------------------------------------------ children


def child_blocked(t: dict[str, Any]) -> dict[str, Any]:
    import statestream as ss

    kw: dict[str, Any] = {"async_save": t["mode"] == "async"}
    if t["kind"] == "tier":
        kw["local_tier"] = t["local"]
    where = t["local_plain"] if t["kind"] == "local" else t["url"]
    state = make_state(t["mib"], 0)
    blocked = []
    with ss.CheckpointManager(where, keep_policy=ss.KeepLatest(2), **kw) as mgr:
        for step in range(1, t["saves"] + 1):
            state["params"]["step"] = step
            t0 = time.perf_counter()
            mgr.save(step, state)
            blocked.append(time.perf_counter() - t0)
            time.sleep(t["compute_s"])
        t0 = time.perf_counter()
        mgr.wait()
        drain = time.perf_counter() - t0
        persisted = mgr.persisted_steps()
    return {"ok": True, "blocked_s": blocked, "drain_s": drain, "persisted": persisted,
            "peak_rss_mib": peak_rss_mib()}


def lora_state(mib: int, step: int) -> dict[str, Any]:
    """``mib`` MiB: a frozen 95% (19 arrays) and a 5% array that changes every step."""
    n = mib * MiB // 4 // 20
    out: dict[str, Any] = {f"frozen{i}": np.arange(n, dtype=np.float32) + i for i in range(19)}
    out["lora"] = np.full(n, step, dtype=np.float32)
    return {"params": out, "step": step}


def child_incremental(t: dict[str, Any]) -> dict[str, Any]:
    import statestream as ss

    durable, written = [], []
    with ss.CheckpointManager(t["url"], local_tier=t["local"], async_save=False,
                              incremental=t["incremental"], keep_policy=ss.KeepLatest(2),
                              local_keep_policy=ss.KeepLatest(1)) as mgr:
        for step in range(1, t["saves"] + 1):
            state = lora_state(t["mib"], step)
            t0 = time.perf_counter()
            mgr.save(step, state)
            mgr.wait()
            durable.append(time.perf_counter() - t0)
            data = Path(mgr.step_path(step)) / "data"
            written.append(sum(f.stat().st_size for f in data.iterdir()))
        got = ss.load(f"{t['url']}/step_{t['saves']:010d}")
        want = lora_state(t["mib"], t["saves"])
        ok = all(np.array_equal(got["params"][k], v) for k, v in want["params"].items())
    # a resume on a new machine (an empty local tier): load the newest step, train on
    # (the copy into the tier runs meanwhile), save the next step and wait until durable
    shutil.rmtree(t["local"])
    nxt = t["saves"] + 1
    with ss.CheckpointManager(t["url"], local_tier=t["local"], async_save=False,
                              incremental=t["incremental"], keep_policy=ss.KeepLatest(2),
                              local_keep_policy=ss.KeepLatest(1)) as mgr:
        got = mgr.load()
        ok = ok and got["step"] == t["saves"]
        time.sleep(t.get("compute_s") or 2.0)
        state = lora_state(t["mib"], nxt)
        t0 = time.perf_counter()
        mgr.save(nxt, state)
        mgr.wait()
        resumed = time.perf_counter() - t0
        data = Path(mgr.step_path(nxt)) / "data"
        resumed_written = sum(f.stat().st_size for f in data.iterdir())
    return {"ok": ok, "durable_s": durable, "written_bytes": written,
            "resumed_s": resumed, "resumed_written_bytes": resumed_written,
            "peak_rss_mib": peak_rss_mib()}


def child_restore(t: dict[str, Any]) -> dict[str, Any]:
    import statestream as ss

    with ss.CheckpointManager(t["url"], local_tier=t["local"]) as mgr:
        step = mgr.latest_step()
        drop = drop_caches()
        t0 = time.perf_counter()
        got = mgr.load()
        dt = time.perf_counter() - t0
    return {"ok": check_state(got, t["mib"], step), "s": dt, "drop_caches": drop,
            "peak_rss_mib": peak_rss_mib()}


def child_seed(t: dict[str, Any]) -> dict[str, Any]:
    import statestream as ss

    with ss.CheckpointManager(t["url"], local_tier=t["local"], async_save=False) as mgr:
        mgr.save(1, make_state(t["mib"], 1))
        mgr.wait()
        return {"ok": mgr.persisted_steps() == [1]}


def peer_child(t: dict[str, Any]) -> dict[str, Any]:
    """One of two gloo processes: save (with peers) or time a restore."""
    import datetime

    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{t['port']}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300))
    import statestream as ss

    local = os.path.join(t["root"], f"node{rank}")
    with ss.CheckpointManager(t["url"], local_tier=local, replicate_to_peers=True,
                              async_save=False) as mgr:
        if t["op"] == "save":
            mgr.save(1, make_state(t["mib"], 1, rank, world))
            mgr.wait()
            return {"ok": mgr.persisted_steps() == [1]}
        dist.barrier()
        drop = drop_caches() if rank == 0 else None
        dist.barrier()
        t0 = time.perf_counter()
        got = mgr.load()
        dt = time.perf_counter() - t0
    ok = all(check_state(got, t["mib"], 1, r, world) for r in range(world))
    return {"ok": ok, "s": dt, "drop_caches": drop, "peak_rss_mib": peak_rss_mib()}


# ------------------------------------------------------------------------------ parent


class MotoServer:
    def __init__(self) -> None:
        import urllib.request

        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.time() + 60
        while True:
            try:
                urllib.request.urlopen(self.endpoint + "/moto-api/", timeout=2).read()
                break
            except OSError:
                if time.time() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("moto server did not start") from None
                time.sleep(0.2)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def run_pair(task: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
    env = dict(os.environ, WORLD_SIZE="2", GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
               PYTHONPATH=str(REPO / "src"), PYTHONWARNINGS="ignore")
    task = dict(task, port=free_port())
    procs = [subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--peer-child",
                               json.dumps(task)], env=dict(env, RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    out = []
    for p in procs:
        try:
            so, se = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            so, se = p.communicate()
        res = next((json.loads(line[7:]) for line in reversed(so.splitlines())
                    if line.startswith("RESULT:")), None)
        out.append(res or {"ok": False, "error": se[-2000:]})
    return out


def phase_blocked(args: argparse.Namespace, base: dict[str, Any], tmp: str,
                  samples: dict[str, list[Any]]) -> None:
    for rep in range(args.repeats):
        for kind, mode in [("local", "sync"), ("local", "async"), ("s3", "sync"),
                           ("s3", "async"), ("tier", "sync"), ("tier", "async")]:
            d = tempfile.mkdtemp(dir=tmp)
            t = dict(base, phase="blocked", kind=kind, mode=mode, url=f"{base['url']}/b-{rep}-"
                     f"{kind}-{mode}", local=os.path.join(d, "local"),
                     local_plain=os.path.join(d, "plain"))
            r = run_child(__file__, REPO / "src", t, 900, stderr_on_failure=True)
            log("blocked", kind, mode, rep, {k: r.get(k) for k in ("blocked_s", "drain_s", "ok")})
            samples.setdefault(f"blocked/{kind}/{mode}", []).append(r)
            shutil.rmtree(d, ignore_errors=True)


def phase_incremental(args: argparse.Namespace, base: dict[str, Any], tmp: str,
                      samples: dict[str, list[Any]]) -> None:
    for rep in range(args.repeats):
        for inc in (False, True):
            d = tempfile.mkdtemp(dir=tmp)
            kind = "incremental" if inc else "full"
            t = dict(base, phase="incremental", incremental=inc, saves=max(3, args.saves),
                     url=f"{base['url']}/i-{rep}-{kind}", local=os.path.join(d, "local"))
            r = run_child(__file__, REPO / "src", t, 900, stderr_on_failure=True)
            log("incremental", kind, rep, {k: r.get(k) for k in ("durable_s", "ok")})
            samples.setdefault(f"incremental/{kind}", []).append(r)
            shutil.rmtree(d, ignore_errors=True)


def phase_restore(args: argparse.Namespace, base: dict[str, Any], tmp: str,
                  samples: dict[str, list[Any]]) -> None:
    d = tempfile.mkdtemp(dir=tmp)
    url = f"{base['url']}/restore1"
    local = os.path.join(d, "local")
    r = run_child(__file__, REPO / "src", dict(base, phase="seed", url=url, local=local), 900,
                  stderr_on_failure=True)
    assert r.get("ok"), r
    for rep in range(args.repeats):
        for kind in ("local", "s3"):
            lt = local if kind == "local" else os.path.join(d, f"empty-{rep}")
            r = run_child(__file__, REPO / "src", dict(base, phase="restore", url=url, local=lt),
                          900, stderr_on_failure=True)
            log("restore-1p", kind, rep, r.get("s"), r.get("ok"))
            samples.setdefault(f"restore1/{kind}", []).append(r)
    shutil.rmtree(d, ignore_errors=True)


def phase_restore2(args: argparse.Namespace, base: dict[str, Any], tmp: str,
                   samples: dict[str, list[Any]]) -> None:
    for rep in range(args.repeats):
        root = tempfile.mkdtemp(dir=tmp)
        url = f"{base['url']}/restore2-{rep}"
        r = run_pair(dict(base, op="save", url=url, root=root), 900)
        assert all(x.get("ok") for x in r), r
        r = run_pair(dict(base, op="restore", url=url, root=root), 900)
        samples.setdefault("restore2/local", []).append(r)
        log("restore-2p local", rep, [x.get("s") for x in r])
        empty = tempfile.mkdtemp(dir=tmp)
        r = run_pair(dict(base, op="restore", url=url, root=empty), 900)
        samples.setdefault("restore2/s3", []).append(r)
        log("restore-2p s3", rep, [x.get("s") for x in r])
        shutil.rmtree(os.path.join(root, "node1"))
        subprocess.run([sys.executable, "-c", (
            "import boto3,sys;c=boto3.client('s3',endpoint_url=sys.argv[1],region_name="
            "'us-east-1',aws_access_key_id=sys.argv[2],aws_secret_access_key=sys.argv[3]);"
            "[c.delete_object(Bucket='bench',Key=o['Key']) for o in c.list_objects_v2("
            "Bucket='bench',Prefix=sys.argv[4]).get('Contents',[])]"),
            base["endpoint"], KEY_ID, SECRET, url.split("/", 3)[3]], check=True)
        r = run_pair(dict(base, op="restore", url=url, root=root), 900)
        samples.setdefault("restore2/peer", []).append(r)
        log("restore-2p peer", rep, [x.get("s") for x in r])
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(empty, ignore_errors=True)


def summarize(samples: dict[str, list[Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, rs in samples.items():
        if key.startswith("blocked/"):
            per_save = [b for r in rs for b in r.get("blocked_s", [])]
            out[key] = {"ok": all(r.get("ok") for r in rs),
                        "blocked_median_s": med(per_save),
                        "blocked_range_s": [min(per_save), max(per_save)] if per_save else None,
                        "drain_median_s": med([r.get("drain_s") for r in rs]),
                        "peak_rss_mib": max((r.get("peak_rss_mib") or 0) for r in rs)}
        elif key.startswith("incremental/"):
            later = [d for r in rs for d in r.get("durable_s", [])[1:]]
            wrote = [b for r in rs for b in r.get("written_bytes", [])[1:]]
            out[key] = {"ok": all(r.get("ok") for r in rs),
                        "first_median_s": med([r["durable_s"][0] for r in rs
                                               if r.get("durable_s")]),
                        "later_median_s": med(later),
                        "later_range_s": [min(later), max(later)] if later else None,
                        "later_written_mib": med(wrote) / MiB if wrote else None,
                        "resumed_median_s": med([r.get("resumed_s") for r in rs]),
                        "resumed_written_mib": (med([r.get("resumed_written_bytes")
                                                     for r in rs]) or 0) / MiB,
                        "peak_rss_mib": max((r.get("peak_rss_mib") or 0) for r in rs)}
        else:
            times = [max(x.get("s") or 0 for x in r) if isinstance(r, list) else r.get("s")
                     for r in rs]
            oks = [all(x.get("ok") for x in r) if isinstance(r, list) else r.get("ok")
                   for r in rs]
            rss = [max(x.get("peak_rss_mib") or 0 for x in r) if isinstance(r, list)
                   else r.get("peak_rss_mib") for r in rs]
            out[key] = {"ok": all(oks), "median_s": med(times),
                        "range_s": [min(times), max(times)] if times else None,
                        "peak_rss_mib": max(x or 0 for x in rss)}
    return out


def render(doc: dict[str, Any]) -> str:
    s = doc["summary"]
    mib = doc["config"]["mib"]
    lines = [f"# Local tier benchmark ({doc['when']})", "",
             f"Command: `{doc['command']}`", "",
             f"State: {mib} MiB float32 (8 arrays); repeats: {doc['config']['repeats']}; "
             f"{doc['config']['saves']} saves per loop, {doc['config']['compute_s']} s compute "
             "between saves; persistent tier: S3 on a local moto server. Machine: "
             f"{doc['machine']} (shared with other jobs while this ran).", "",
             "## Training time blocked per save (median, range)", "",
             "| target | mode | blocked per save | final wait() | peak RSS MiB | ok |",
             "|---|---|---|---|---|---|"]
    for key in sorted(k for k in s if k.startswith("blocked/")):
        v = s[key]
        _, kind, mode = key.split("/")
        rng = v["blocked_range_s"] or [0, 0]
        lines.append(f"| {kind} | {mode} | {v['blocked_median_s']:.3f} s "
                     f"({rng[0]:.3f}-{rng[1]:.3f}) | {v['drain_median_s']:.2f} s | "
                     f"{v['peak_rss_mib']:.0f} | {v['ok']} |")
    lines += ["", "## Restore of the latest step (median, range; page cache dropped)", "",
              "| processes | from | time | vs S3 | peak RSS MiB | ok |", "|---|---|---|---|---|---|"]
    for procs, prefix, kinds in [(1, "restore1", ("local", "s3")),
                                 (2, "restore2", ("local", "peer", "s3"))]:
        s3 = (s.get(f"{prefix}/s3") or {}).get("median_s")
        for kind in kinds:
            v = s.get(f"{prefix}/{kind}")
            if v is None:
                continue
            ratio = f"{s3 / v['median_s']:.1f}x faster" if s3 and v["median_s"] else "-"
            lines.append(f"| {procs} | {kind} | {v['median_s']:.3f} s ({v['range_s'][0]:.3f}-"
                         f"{v['range_s'][1]:.3f}) | {ratio} | {v['peak_rss_mib']:.0f} | "
                         f"{v['ok']} |")
    if any(k.startswith("incremental/") for k in s):
        lines += ["", "## Incremental steps through the tier to S3 (sync save + wait per step)",
                  "", "LoRA-like state: 95% frozen, 5% changes every step. Durable: until "
                  "the step is committed in S3. Later steps: every step after the first.", "",
                  "| manager | first step durable | later steps durable (range) | "
                  "written per later step | first save after a resume elsewhere | "
                  "peak RSS MiB | ok |", "|---|---|---|---|---|---|---|"]
        for kind in ("full", "incremental"):
            v = s.get(f"incremental/{kind}")
            if v is None or v["later_median_s"] is None:
                continue
            lo, hi = v["later_range_s"]
            lines.append(f"| {kind} | {v['first_median_s']:.2f} s | {v['later_median_s']:.2f} s "
                         f"({lo:.2f}-{hi:.2f}) | {v['later_written_mib']:.1f} MiB | "
                         f"{v['resumed_median_s']:.2f} s, {v['resumed_written_mib']:.1f} MiB | "
                         f"{v['peak_rss_mib']:.0f} | {v['ok']} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--mib", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--compute-s", type=float, default=None)
    ap.add_argument("--phases", default="blocked,restore,restore2,incremental")
    args = ap.parse_args()
    args.mib = args.mib or (64 if args.quick else 256)
    args.repeats = args.repeats or (2 if args.quick else 3)
    args.compute_s = args.compute_s if args.compute_s is not None else (
        2.0 if args.quick else 5.0)
    server = MotoServer()
    tmp = tempfile.mkdtemp(prefix="bench-tiers-", dir=os.environ.get("BENCH_TMP"))
    try:
        import boto3

        boto3.client("s3", endpoint_url=server.endpoint, region_name="us-east-1",
                     aws_access_key_id=KEY_ID, aws_secret_access_key=SECRET
                     ).create_bucket(Bucket=BUCKET)
        os.environ.update({"AWS_ENDPOINT_URL": server.endpoint, "AWS_ALLOW_HTTP": "true",
                           "AWS_REGION": "us-east-1", "AWS_ACCESS_KEY_ID": KEY_ID,
                           "AWS_SECRET_ACCESS_KEY": SECRET})
        base = {"mib": args.mib, "saves": args.saves, "compute_s": args.compute_s,
                "url": f"s3://{BUCKET}/run", "endpoint": server.endpoint}
        samples: dict[str, list[Any]] = {}
        phases = args.phases.split(",")
        if "blocked" in phases:
            phase_blocked(args, base, tmp, samples)
        if "restore" in phases:
            phase_restore(args, base, tmp, samples)
        if "restore2" in phases:
            phase_restore2(args, base, tmp, samples)
        if "incremental" in phases:
            phase_incremental(args, base, tmp, samples)
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    doc = {"when": stamp, "command": " ".join(shlex.quote(a) for a in sys.argv),
           "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
           "config": vars(args), "summary": summarize(samples), "samples": samples}
    out = HERE / "results" / "tiers"
    out.mkdir(parents=True, exist_ok=True)
    name = f"tiers-{stamp}{'-quick' if args.quick else ''}"
    (out / f"{name}.json").write_text(json.dumps(doc, indent=1, default=str))
    md = render(doc)
    (out / f"{name}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        task = json.loads(sys.argv[2])
        fn = {"blocked": child_blocked, "restore": child_restore, "seed": child_seed,
              "incremental": child_incremental}
        try:
            res = fn[task["phase"]](task)
        except BaseException as exc:  # report to the parent, which records it
            res = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        print("RESULT:" + json.dumps(res, default=str), flush=True)
    elif len(sys.argv) > 2 and sys.argv[1] == "--peer-child":
        try:
            res = peer_child(json.loads(sys.argv[2]))
        except BaseException as exc:  # report to the parent, which records it
            res = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        print("RESULT:" + json.dumps(res, default=str), flush=True)
        os._exit(0)
    else:
        sys.exit(main())
