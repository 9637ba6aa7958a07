#!/usr/bin/env python3
"""S3 backend benchmark: statestream save/load vs. a naive boto3 put/get, plus client choice.

Everything talks to a moto S3 server on 127.0.0.1 that runs in its own process (so its
CPU time is not billed to the client being measured; it is recorded separately). Run from
the repo root with the project venv::

    .venv/bin/python benchmarks/bench_s3.py            # full run (~1 GiB state, 3 repeats)
    .venv/bin/python benchmarks/bench_s3.py --quick    # smoke run (~64 MiB, 1 repeat)

Phases (medians over --repeats, every sample in the JSON):

1. sweep: S3Options(part_bytes x max_concurrency) on save, IOOptions(num_threads) on save
   and load, IOOptions(max_request_bytes) on load, over a smaller Llama-like state;
2. main: ss.save / ss.load of a Llama-like fp32 state (params + Adam moments) to
   s3://bench/<prefix> with the default options and with the sweep's best, against the
   naive baseline (boto3 put_object of the concatenated bytes as ONE object in one stream;
   get_object reading it back whole; concatenation is not timed);
3. clients: one object (256 MiB; 64 MiB with --quick) through obstore (open_writer
   multipart, as statestream uses; single-stream get; parallel get_range), boto3
   (put_object/get_object; TransferManager upload_fileobj/download_fileobj) and s3fs
   (only if a separate venv with it is given via --s3fs-python, see docs/storage.md).

Outputs benchmarks/results/s3-<timestamp>[-quick].{json,md}; the markdown is printed.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime as _dt
import gc
import io
import json
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(HERE))

from _common import llama_shapes  # noqa: E402
from bench_core import RssSampler, _fill  # noqa: E402  (same deterministic tensor data)

MiB = 1 << 20
GiB = 1 << 30
BUCKET = "bench"
KEY_ID, SECRET = "bench-key", "bench-secret"
# keep every request on loopback, whatever the environment says about proxies / IMDS
os.environ["NO_PROXY"] = os.environ["no_proxy"] = "127.0.0.1,localhost"
for _v in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy"):
    os.environ.pop(_v, None)
os.environ["AWS_EC2_METADATA_DISABLED"] = "true"


def log(*a: Any) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *a, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------ workload


def llama_spec(hidden: int, inter: int, layers: int, vocab: int,
               optim: bool = True) -> list[tuple[str, tuple[int, ...]]]:
    params = llama_shapes(hidden, inter, layers, vocab)
    if not optim:
        return params
    return (params + [(f"optim.exp_avg.{k}", s) for k, s in params]
            + [(f"optim.exp_avg_sq.{k}", s) for k, s in params])


#: name -> (hidden, MLP, layers, vocab); all are params + Adam exp_avg + exp_avg_sq, fp32
STATES = {
    "64m": (256, 704, 4, 4000),      # 0.06 GiB (= bench_core --quick llama)
    "256m": (512, 1408, 2, 16000),   # 0.26 GiB (sweeps)
    "1g": (768, 2048, 6, 32000),     # 1.02 GiB
    "3g": (1024, 2816, 16, 32000),   # 3.03 GiB (= bench_core llama)
}


def nbytes_of(spec: list[tuple[str, tuple[int, ...]]]) -> int:
    return sum(4 * int(np.prod(s)) for _, s in spec)


def build_torch(spec):
    import torch

    return {k: torch.from_numpy(_fill(int(np.prod(s)), i).reshape(s))
            for i, (k, s) in enumerate(spec)}


def empty_like(spec):
    import torch

    return {k: torch.empty(s, dtype=torch.float32) for k, s in spec}


def verify_state(out: dict, spec) -> str | None:
    if set(out) != {k for k, _ in spec}:
        return "keys differ"
    for k, s in spec:
        if tuple(out[k].shape) != tuple(s):
            return f"shape of {k}"
    for i in sorted({0, len(spec) // 2, len(spec) - 1}):
        k, s = spec[i]
        if not np.array_equal(out[k].numpy().ravel(), _fill(int(np.prod(s)), i)):
            return f"values of {k}"
    return None


# ------------------------------------------------------------------------------ server


class MotoServer:
    """``python -m moto.server`` on 127.0.0.1 in a child process (own CPU accounting)."""

    def __init__(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
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
        self._tck = os.sysconf("SC_CLK_TCK")

    def cpu_s(self) -> float:
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / self._tck  # utime + stime

    def rss_mib(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        return 0.0

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


# ------------------------------------------------------------------------------ timing

SERVER: MotoServer


def timed(fn: Callable[[], Any]) -> tuple[dict, Any]:
    gc.collect()
    s0, c0 = SERVER.cpu_s(), time.process_time()
    with RssSampler() as rs:
        t0 = time.perf_counter()
        out = fn()
        dt = time.perf_counter() - t0
    return {"s": dt, "client_cpu_s": time.process_time() - c0,
            "server_cpu_s": SERVER.cpu_s() - s0,
            "rss_peak_over_baseline_mib": rs.result["rss_peak_over_baseline"] / MiB}, out


def boto_client():
    import boto3

    return boto3.client("s3", endpoint_url=SERVER.endpoint, region_name="us-east-1",
                        aws_access_key_id=KEY_ID, aws_secret_access_key=SECRET)


def s3_storage(part_bytes: int | None = None, max_concurrency: int | None = None):
    from statestream.storage import S3Options, S3Storage

    kw: dict[str, Any] = {}
    if part_bytes:
        kw["part_bytes"] = part_bytes
    if max_concurrency:
        kw["max_concurrency"] = max_concurrency
    return S3Storage(S3Options(endpoint=SERVER.endpoint, region="us-east-1",
                               access_key_id=KEY_ID, secret_access_key=SECRET, **kw))


def obstore_store():
    from obstore.store import S3Store

    return S3Store(BUCKET, endpoint=SERVER.endpoint, region="us-east-1",
                   access_key_id=KEY_ID, secret_access_key=SECRET,
                   client_options={"allow_http": True})


class Stats:
    def __init__(self) -> None:
        self.samples: dict[str, list[dict]] = {}

    def add(self, name: str, rec: dict) -> None:
        self.samples.setdefault(name, []).append(rec)

    def median(self, name: str, field: str = "s") -> float | None:
        v = [r[field] for r in self.samples.get(name, []) if r.get(field) is not None]
        return statistics.median(v) if v else None


# ------------------------------------------------------------------------------ phases


def ss_save_load(stats: Stats, label: str, spec, state, like, *, part_bytes=None,
                 max_concurrency=None, num_threads=None, max_request_bytes=None,
                 do_load=True, rep=0) -> None:
    import statestream as ss
    from statestream.storage import set_backend

    st = s3_storage(part_bytes, max_concurrency)
    set_backend("s3", st)
    io_kw: dict[str, Any] = {}
    if num_threads:
        io_kw["num_threads"] = num_threads
    url = f"s3://{BUCKET}/ss/{label.replace(' ', '_')}-r{rep}"
    try:
        rec, _ = timed(lambda: ss.save(url, state, io=ss.IOOptions(**io_kw) if io_kw else None))
        stats.add(f"{label}|save", rec)
        log(f"  {label} save {rec['s']:.2f}s")
        if do_load:
            lkw = dict(io_kw)
            if max_request_bytes:
                lkw["max_request_bytes"] = max_request_bytes
            # no IOOptions -> the backend's read preferences (few large parallel GETs)
            rec, out = timed(lambda: ss.load(url, target=like,
                                             io=ss.IOOptions(**lkw) if lkw else None))
            rec["verify"] = verify_state(out, spec)
            stats.add(f"{label}|load", rec)
            log(f"  {label} load {rec['s']:.2f}s verify={rec['verify']}")
            del out
    finally:
        st.delete(url)
        set_backend("s3", None)


def naive_put_get(stats: Stats, label: str, blob: bytes, rep: int) -> None:
    c = boto_client()
    key = f"naive/{label}-r{rep}.bin"
    rec, _ = timed(lambda: c.put_object(Bucket=BUCKET, Key=key, Body=blob))
    stats.add(f"{label}|save", rec)
    rec, got = timed(lambda: c.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    rec["verify"] = None if got == blob else "bytes differ"
    stats.add(f"{label}|load", rec)
    log(f"  {label} put {stats.samples[label + '|save'][-1]['s']:.2f}s get {rec['s']:.2f}s")
    del got
    c.delete_object(Bucket=BUCKET, Key=key)


def client_round(stats: Stats, blob: bytes, rep: int, args) -> None:
    import obstore
    from boto3.s3.transfer import TransferConfig

    n = len(blob)
    part, conc = 16 * MiB, 8
    mv = memoryview(blob)

    # obstore: multipart through open_writer, exactly how statestream writes a data object
    store = obstore_store()
    key = f"clients/obstore-r{rep}"

    def ob_put() -> None:
        w = obstore.open_writer(store, key, buffer_size=part, max_concurrency=conc)
        for o in range(0, n, part):
            w.write(mv[o:o + part])
        w.close()

    rec, _ = timed(ob_put)
    stats.add("obstore|put", rec)
    rec, got = timed(lambda: obstore.get(store, key).bytes())
    rec["verify"] = None if bytes(got) == blob else "bytes differ"
    stats.add("obstore|get", rec)
    del got

    def ob_ranged() -> bytearray:  # statestream-style: 32 MiB get_range on 4 threads
        out = bytearray(n)
        ov = memoryview(out)

        def one(o: int) -> None:
            ln = min(32 * MiB, n - o)
            ov[o:o + ln] = memoryview(obstore.get_range(store, key, start=o, length=ln))

        with cf.ThreadPoolExecutor(4) as ex:
            list(ex.map(one, range(0, n, 32 * MiB)))
        return out

    rec, got = timed(ob_ranged)
    rec["verify"] = None if got == blob else "bytes differ"
    stats.add("obstore|get_range x4 threads", rec)
    del got
    obstore.delete(store, key)

    # boto3 TransferManager (multipart, threads)
    c = boto_client()
    cfg = TransferConfig(multipart_threshold=8 * MiB, multipart_chunksize=part,
                         max_concurrency=conc)
    key = f"clients/boto3tm-r{rep}"
    rec, _ = timed(lambda: c.upload_fileobj(io.BytesIO(blob), BUCKET, key, Config=cfg))
    stats.add("boto3 TransferManager|put", rec)

    def tm_get() -> bytes:
        b = io.BytesIO()
        c.download_fileobj(BUCKET, key, b, Config=cfg)
        return b.getvalue()

    rec, got = timed(tm_get)
    rec["verify"] = None if got == blob else "bytes differ"
    stats.add("boto3 TransferManager|get", rec)
    del got
    c.delete_object(Bucket=BUCKET, Key=key)

    # boto3 single stream
    naive_put_get(stats, "boto3 put_object/get_object", blob, rep)
    stats.samples["boto3 put_object/get_object|put"] = stats.samples.pop(
        "boto3 put_object/get_object|save")
    stats.samples["boto3 put_object/get_object|get"] = stats.samples.pop(
        "boto3 put_object/get_object|load")

    # s3fs, in its own interpreter (its aiobotocore pins an older botocore than boto3 needs)
    if args.s3fs_python:
        s0 = SERVER.cpu_s()
        p = subprocess.run([args.s3fs_python, __file__, "--s3fs-child", SERVER.endpoint,
                            str(n), str(rep), str(SERVER.proc.pid)],
                           capture_output=True, text=True, timeout=600)
        if p.returncode != 0:
            stats.add("s3fs|put", {"s": None, "error": p.stderr[-2000:]})
            log("  s3fs failed:", p.stderr[-500:])
        else:
            res = json.loads(p.stdout.strip().splitlines()[-1])
            stats.add("s3fs|put", res["put"])
            stats.add("s3fs|get", res["get"])
            stats.samples.setdefault("s3fs|version", [{"s": None, "v": res["versions"]}])
        del s0
    log(f"  clients r{rep}: " + ", ".join(
        f"{k}={v[-1]['s']:.2f}s" for k, v in stats.samples.items()
        if v and v[-1].get("s") is not None and k.split("|")[0] in CLIENTS))


CLIENTS = ("obstore", "boto3 TransferManager", "boto3 put_object/get_object", "s3fs")


def s3fs_child(endpoint: str, n: int, rep: int, server_pid: int) -> None:
    """Runs under the s3fs venv: time pipe_file / cat_file of n random bytes."""
    import aiobotocore
    import botocore
    import s3fs

    tck = os.sysconf("SC_CLK_TCK")

    def scpu() -> float:
        with open(f"/proc/{server_pid}/stat") as f:
            fl = f.read().rsplit(")", 1)[1].split()
        return (int(fl[11]) + int(fl[12])) / tck

    fs = s3fs.S3FileSystem(key=KEY_ID, secret=SECRET, endpoint_url=endpoint,
                           client_kwargs={"region_name": "us-east-1"}, max_concurrency=8)
    blob = np.random.default_rng(rep).integers(0, 256, n, dtype=np.uint8).tobytes()
    path = f"{BUCKET}/clients/s3fs-r{rep}"
    out: dict[str, Any] = {"versions": {"s3fs": s3fs.__version__, "botocore": botocore.__version__,
                                        "aiobotocore": aiobotocore.__version__}}
    for name, fn in (("put", lambda: fs.pipe_file(path, blob, chunksize=16 * MiB,
                                                   max_concurrency=8)),
                     ("get", lambda: fs.cat_file(path))):
        gc.collect()
        s0, c0, t0 = scpu(), time.process_time(), time.perf_counter()
        got = fn()
        out[name] = {"s": time.perf_counter() - t0, "client_cpu_s": time.process_time() - c0,
                     "server_cpu_s": scpu() - s0}
        if name == "get":
            out[name]["verify"] = None if got == blob else "bytes differ"
    fs.rm(path)
    print(json.dumps(out))


# ------------------------------------------------------------------------------ report


def gbps(nbytes: int, s: float | None) -> str:
    return f"{nbytes / s / 1e9:.3f}" if s else "n/a"


def fmt(x: float | None, p: int = 2) -> str:
    return "n/a" if x is None else f"{x:.{p}f}"


def row(stats: Stats, name: str, nbytes: int) -> str:
    s = stats.median(name)
    bad = [r["verify"] for r in stats.samples.get(name, []) if r.get("verify")]
    return (f"| {fmt(s)} | {gbps(nbytes, s)} | {fmt(stats.median(name, 'client_cpu_s'))} | "
            f"{fmt(stats.median(name, 'server_cpu_s'))} | "
            f"{fmt(stats.median(name, 'rss_peak_over_baseline_mib'), 0)} |"
            + (f" VERIFY FAILED: {bad[0]}" if bad else ""))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="~64 MiB state, 64 MiB object, 1 repeat")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--state", choices=sorted(STATES), default=None,
                    help="main state size (default 1g; 64m with --quick)")
    ap.add_argument("--sweep-state", choices=sorted(STATES), default=None,
                    help="state for the option sweeps (default 256m; 64m with --quick)")
    ap.add_argument("--object-mib", type=int, default=None,
                    help="object size for the client comparison (default 256; 64 with --quick)")
    ap.add_argument("--phases", default="sweep,main,clients")
    ap.add_argument("--tuned", action="append", default=[],
                    metavar="PART_MIB,CONC,THREADS,REQUEST_MIB",
                    help="also run the main state with these settings (row 'statestream "
                         "(tuned ...)'), e.g. 64,8,8,256; repeatable")
    ap.add_argument("--s3fs-python", default=None,
                    help="python of a separate venv that has s3fs (default: /tmp/s3fs-venv if "
                         "present); 'none' to skip")
    ap.add_argument("--out", default=None)
    ap.add_argument("--render", metavar="JSON", help="only re-render the .md of a results JSON")
    ap.add_argument("--s3fs-child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.render:
        doc = json.loads(Path(args.render).read_text())
        st = Stats()
        st.samples = doc["samples"]
        md = render_md(doc, st)
        Path(args.render).with_suffix(".md").write_text(md)
        print(md)
        return 0
    if args.s3fs_child:
        e, n, r, pid = args.s3fs_child
        s3fs_child(e, int(n), int(r), int(pid))
        return 0

    repeats = args.repeats or (1 if args.quick else 3)
    state_name = args.state or ("64m" if args.quick else "1g")
    sweep_name = args.sweep_state or ("64m" if args.quick else "256m")
    obj_bytes = (args.object_mib or (64 if args.quick else 256)) * MiB
    phases = set(args.phases.split(","))
    if args.s3fs_python is None and Path("/tmp/s3fs-venv/bin/python").exists():
        args.s3fs_python = "/tmp/s3fs-venv/bin/python"
    if args.s3fs_python == "none":
        args.s3fs_python = None

    import boto3
    import botocore
    import moto
    import obstore
    import torch

    import statestream as ss
    from statestream.storage import S3Options

    t_start = time.time()
    load_start = os.getloadavg()
    global SERVER
    SERVER = MotoServer()
    log(f"moto server pid {SERVER.proc.pid} at {SERVER.endpoint}")
    stats = Stats()
    best: dict[str, Any] = {}
    try:
        boto_client().create_bucket(Bucket=BUCKET)
        # warm-up (imports, connection pools, thread pools), untimed
        tiny = [("w", (1024,))]
        ss_save_load(Stats(), "warmup", tiny, build_torch(tiny), empty_like(tiny))
        naive_put_get(Stats(), "warmup", b"x" * 1024, 0)

        sweep: dict[str, Any] = {}
        if "sweep" in phases:
            spec = llama_spec(*STATES[sweep_name])
            state, like = build_torch(spec), empty_like(spec)
            log(f"sweep state {sweep_name}: {nbytes_of(spec) / GiB:.3f} GiB")
            parts = [8 * MiB, 16 * MiB, 64 * MiB]
            concs = [4, 8, 16]
            threads = [1, 2, 4, 8]
            reqs = [8 * MiB, 32 * MiB, 128 * MiB]
            for r in range(repeats):
                for pb in parts:
                    for mc in concs:
                        ss_save_load(stats, f"sweep part={pb // MiB}MiB conc={mc}", spec, state,
                                     like, part_bytes=pb, max_concurrency=mc, do_load=False,
                                     rep=r)
                for nt in threads:
                    ss_save_load(stats, f"sweep threads={nt}", spec, state, like,
                                 num_threads=nt, rep=r)
                for rq in reqs:
                    ss_save_load(stats, f"sweep request={rq // MiB}MiB", spec, state, like,
                                 max_request_bytes=rq, do_load=True, rep=r)
            sb = nbytes_of(spec)
            pc = min(((pb, mc) for pb in parts for mc in concs),
                     key=lambda t: stats.median(f"sweep part={t[0] // MiB}MiB conc={t[1]}|save"))
            nts = min(threads, key=lambda t: stats.median(f"sweep threads={t}|save"))
            ntl = min(threads, key=lambda t: stats.median(f"sweep threads={t}|load"))
            rq = min(reqs, key=lambda t: stats.median(f"sweep request={t // MiB}MiB|load"))
            best = {"part_bytes": pc[0], "max_concurrency": pc[1], "save_num_threads": nts,
                    "load_num_threads": ntl, "max_request_bytes": rq}
            sweep = {"state": sweep_name, "nbytes": sb, "best": best}
            log("sweep best:", best)
            del state, like
            gc.collect()

        main_info: dict[str, Any] = {}
        if "main" in phases:
            spec = llama_spec(*STATES[state_name])
            nb = nbytes_of(spec)
            state, like = build_torch(spec), empty_like(spec)
            t0 = time.perf_counter()
            blob = b"".join(t.numpy().tobytes() for t in state.values())
            concat_s = time.perf_counter() - t0
            main_info = {"state": state_name, "tensors": len(spec), "nbytes": nb,
                         "concat_s": concat_s, "tuned": args.tuned, "best": best}
            log(f"main state {state_name}: {len(spec)} tensors, {nb / GiB:.3f} GiB "
                f"(concat for naive {concat_s:.2f}s, untimed)")
            for r in range(repeats):
                ss_save_load(stats, "statestream (defaults)", spec, state, like, rep=r)
                naive_put_get(stats, "naive boto3 put/get", blob, r)
                if best and (best["part_bytes"], best["max_concurrency"]) != (
                        S3Options().part_bytes, S3Options().max_concurrency):
                    ss_save_load(stats, "statestream (sweep best)", spec, state, like,
                                 part_bytes=best["part_bytes"],
                                 max_concurrency=best["max_concurrency"],
                                 num_threads=best["save_num_threads"], rep=r)
                for tuned in args.tuned:
                    pm, mc, nt, rq = (int(x) for x in tuned.split(","))
                    ss_save_load(stats, f"statestream (tuned {tuned})", spec, state, like,
                                 part_bytes=pm * MiB, max_concurrency=mc, num_threads=nt,
                                 max_request_bytes=rq * MiB, rep=r)
            del state, like, blob
            gc.collect()

        if "clients" in phases:
            blob = np.random.default_rng(7).integers(0, 256, obj_bytes, dtype=np.uint8).tobytes()
            log(f"clients: one {obj_bytes // MiB} MiB object")
            for r in range(repeats):
                client_round(stats, blob, r, args)
            del blob
        server_rss = SERVER.rss_mib()
    finally:
        SERVER.stop()

    # ------------------------------------------------------------------ write results
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_json = Path(args.out) if args.out else (
        HERE / "results" / f"s3-{stamp}{'-quick' if args.quick else ''}.json")
    out_json.parent.mkdir(parents=True, exist_ok=True)
    try:
        git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                             capture_output=True, text=True).stdout.strip()
    except OSError:
        git = "?"
    cmd = " ".join(shlex.quote(a) for a in [".venv/bin/python", "benchmarks/bench_s3.py",
                                             *sys.argv[1:]])
    d = S3Options()
    versions = {"statestream": ss.__version__, "obstore": obstore.__version__,
                "moto": moto.__version__, "boto3": boto3.__version__,
                "botocore": botocore.__version__, "torch": torch.__version__,
                "numpy": np.__version__}
    s3fs_v = stats.samples.pop("s3fs|version", [{}])[0].get("v")
    if s3fs_v:
        versions.update({f"{k} (s3fs venv)": v for k, v in s3fs_v.items()})
    doc = {
        "command": cmd, "cwd": str(REPO), "git": git, "started": t_start,
        "wall_s": time.time() - t_start, "quick": args.quick, "repeats": repeats,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "python": platform.python_version(), "loadavg_start": load_start,
                    "loadavg_end": os.getloadavg()},
        "versions": versions, "server": {"kind": "python -m moto.server (separate process)",
                                         "endpoint": "127.0.0.1", "rss_end_mib": server_rss},
        "defaults": {"S3Options.part_bytes": d.part_bytes,
                     "S3Options.max_concurrency": d.max_concurrency,
                     "IOOptions": dataclass_dict(ss.IOOptions())},
        "main": main_info, "sweep": sweep, "object_bytes": obj_bytes,
        "samples": stats.samples,
    }
    out_json.write_text(json.dumps(doc, indent=1))
    md = render_md(doc, stats)
    out_json.with_suffix(".md").write_text(md)
    print(md)
    log(f"wrote {out_json} and {out_json.with_suffix('.md')}")
    return 0


def dataclass_dict(x: Any) -> dict:
    import dataclasses

    return dataclasses.asdict(x)


def _fmt_best(best: dict | None) -> str:
    if not best:
        return ""
    return "(" + ", ".join(f"{k}={v // MiB if 'bytes' in k else v}"
                           f"{' MiB' if 'bytes' in k else ''}" for k, v in best.items()) + ")"


def render_md(doc: dict, stats: Stats) -> str:
    L: list[str] = []
    started = _dt.datetime.fromtimestamp(doc["started"]).isoformat(timespec="seconds")
    L.append(f"# statestream S3 benchmark ({started}{', quick' if doc['quick'] else ''})\n")
    L.append(f"Command: `{doc['command']}` (cwd `{doc['cwd']}`), git `{doc['git']}`\n")
    m = doc["machine"]
    L.append(f"Machine: {m['platform']}, {m['cpus']} CPUs (shared; load average "
             f"{m['loadavg_start'][0]:.1f} at start, {m['loadavg_end'][0]:.1f} at end), "
             f"Python {m['python']}; versions: "
             + ", ".join(f"{k} {v}" for k, v in doc["versions"].items()) + "\n")
    L.append("Server: moto's S3 server (`python -m moto.server -H 127.0.0.1`) in a separate "
             "process on loopback; its CPU time per operation is the `server CPU s` column. "
             "Medians over "
             f"{doc['repeats']} repeat(s); GB/s = bytes / seconds (1 GB = 1e9 B). `client CPU s` "
             "is the benchmark process's CPU time (all threads) during the call; `peak RSS` is "
             "the client's peak RSS over its level right before the call (indicative only: "
             "measured in-process, so memory the allocator kept from earlier runs hides "
             "re-use; 0 means no growth).\n")
    hdr = ("| s | GB/s | client CPU s | server CPU s | peak RSS MiB |\n")
    if doc["main"]:
        mi = doc["main"]
        nb = mi["nbytes"]
        L.append(f"## Main: Llama-like fp32 state `{mi['state']}` ({mi['tensors']} tensors, "
                 f"{nb / GiB:.3f} GiB)\n")
        L.append("| system | op " + hdr + "|---|---|---|---|---|---|---|")
        tuned = [f"statestream (tuned {t})" for t in (mi.get("tuned") or [])]
        for sysname in ("statestream (defaults)", "statestream (sweep best)", *tuned,
                        "naive boto3 put/get"):
            for op in ("save", "load"):
                if f"{sysname}|{op}" in stats.samples:
                    L.append(f"| {sysname} | {op} " + row(stats, f"{sysname}|{op}", nb))
        L.append("")
        L.append(f"Naive baseline: the tensors' bytes concatenated into one `bytes` "
                 f"({mi['concat_s']:.2f} s, not timed), `put_object` as one object in one "
                 "stream, `get_object(...)['Body'].read()` whole.\n")
        ss_s, ss_l = (stats.median("statestream (defaults)|save"),
                      stats.median("statestream (defaults)|load"))
        nv_s = stats.median("naive boto3 put/get|save")
        nv_l = stats.median("naive boto3 put/get|load")
        L.append(f"- Target (statestream >= naive): save {ss_s:.2f} s vs put {nv_s:.2f} s -> "
                 f"**{'met' if ss_s <= nv_s else 'NOT met'}** (speed-up {nv_s / ss_s:.2f}x); "
                 f"load {ss_l:.2f} s vs get {nv_l:.2f} s -> "
                 f"**{'met' if ss_l <= nv_l else 'NOT met'}** (speed-up {nv_l / ss_l:.2f}x)")
        for name, what in (("statestream (sweep best)", "the sweep's best settings "
                            f"{_fmt_best(mi.get('best') or (doc['sweep'] or {}).get('best'))}"),
                           *((f"statestream (tuned {t})", f"--tuned {t} (part_bytes MiB, "
                              "max_concurrency, num_threads, max_request_bytes MiB)")
                             for t in (mi.get("tuned") or []))):
            b, lo = stats.median(f"{name}|save"), stats.median(f"{name}|load")
            if b:
                L.append(f"- With {what}: save {b:.2f} s (speed-up over put {nv_s / b:.2f}x), "
                         f"load {lo:.2f} s (speed-up over get {nv_l / lo:.2f}x)")
        L.append("")
    if doc["sweep"]:
        sw = doc["sweep"]
        nb = sw["nbytes"]
        L.append(f"## Option sweeps (state `{sw['state']}`, {nb / GiB:.3f} GiB)\n")
        L.append("| setting | op " + hdr + "|---|---|---|---|---|---|---|")
        for name in stats.samples:
            if name.startswith("sweep "):
                setting, op = name[6:].rsplit("|", 1)
                L.append(f"| {setting} | {op} " + row(stats, name, nb))
        L.append("")
        d = doc["defaults"]
        L.append(f"Defaults: S3Options(part_bytes={d['S3Options.part_bytes'] // MiB} MiB, "
                 f"max_concurrency={d['S3Options.max_concurrency']}), IOOptions(num_threads="
                 f"{d['IOOptions']['num_threads']}, max_request_bytes="
                 f"{d['IOOptions']['max_request_bytes'] // MiB} MiB). part/conc rows use "
                 "the default threads; threads rows the default S3Options; request rows "
                 "the default threads. Fastest here: "
                 + ", ".join(f"{k}={v // MiB if 'bytes' in k else v}"
                             f"{' MiB' if 'bytes' in k else ''}"
                             for k, v in sw["best"].items()) + "\n")
    clients = [n for n in stats.samples if n.split("|")[0] in CLIENTS]
    if clients:
        nb = doc["object_bytes"]
        L.append(f"## Clients: one {nb // MiB} MiB object (16 MiB parts, 8 in flight where "
                 "the client does multipart)\n")
        L.append("| client | op " + hdr + "|---|---|---|---|---|---|---|")
        for name in stats.samples:
            if name.split("|")[0] in CLIENTS:
                c, op = name.split("|", 1)
                if stats.median(name) is None:
                    L.append(f"| {c} | {op} | failed | | | | |")
                    continue
                L.append(f"| {c} | {op} " + row(stats, name, nb))
        L.append("")
        L.append("- obstore put = `open_writer(buffer_size=16 MiB, max_concurrency=8)` (what "
                 "statestream uses); obstore get = `get(...).bytes()` (one stream); obstore "
                 "get_range x4 threads = 32 MiB `get_range` calls on 4 threads (what "
                 "statestream's load does). boto3 TransferManager = `upload_fileobj` / "
                 "`download_fileobj` with `TransferConfig(multipart_threshold=8 MiB, "
                 "multipart_chunksize=16 MiB, max_concurrency=8)`. s3fs = `pipe_file(chunksize="
                 "16 MiB, max_concurrency=8)` / `cat_file`, run in a separate venv (its "
                 "aiobotocore pins a botocore older than the project's boto3 needs); its peak "
                 "RSS is not measured.\n")
    L.append(f"Total wall time: {doc['wall_s']:.0f} s; moto server RSS at the end "
             f"{doc['server']['rss_end_mib']:.0f} MiB\n")
    return "\n".join(L)


if __name__ == "__main__":
    sys.exit(main())
