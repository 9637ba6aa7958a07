#!/usr/bin/env python3
"""Core save/load benchmark: statestream vs. raw disk bandwidth and peer libraries.

Run from the repo root with the project venv, e.g.::

    .venv/bin/python benchmarks/bench_core.py            # full run (~3 GiB state, 3 repeats)
    .venv/bin/python benchmarks/bench_core.py --quick    # smoke run (~64 MiB, 1 repeat)

Every timed measurement runs in a fresh child process (this same script invoked with
``--child``) so that memory, allocator state and thread pools are isolated, and peak RSS
can be attributed to a single operation. See benchmarks/README.md for the methodology.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from _common import drop_caches, llama_shapes, med, run_child

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SRC = REPO / "src"
MiB = 1 << 20
GiB = 1 << 30

# --------------------------------------------------------------------------------------
# Workloads (deterministic: tensor i is a window into a seeded random block, so a child
# process can regenerate any tensor to verify a load without holding the whole state).
# --------------------------------------------------------------------------------------

_BLOCK_ELEMS = 16 * MiB  # 64 MiB of float32 random values
_BLOCK: np.ndarray | None = None


def _block() -> np.ndarray:
    global _BLOCK
    if _BLOCK is None:
        rng = np.random.default_rng(12345)
        b = rng.random(_BLOCK_ELEMS, dtype=np.float32) - 0.5
        _BLOCK = np.concatenate([b, b])  # doubled so any window of len <= len(b) is contiguous
    return _BLOCK


def _fill(n: int, idx: int) -> np.ndarray:
    blk = _block()
    period = blk.size // 2
    off = (idx * 7919 + 104729 * (idx % 13)) % period
    out = np.empty(n, dtype=np.float32)
    pos = 0
    while pos < n:
        k = min(period, n - pos)
        out[pos : pos + k] = blk[off : off + k]
        pos += k
    # make tensors distinct even when windows overlap
    out[:1] = np.float32(idx)
    return out


def llama_param_shapes(quick: bool, size: str | None = None) -> list[tuple[str, tuple[int, ...]]]:
    """Parameters of the Llama-like state (x3 with the two Adam moments): ~64 MiB quick,
    ~1 GB with ``size="1g"`` (4 layers, vocab 16,000: fits a shared machine), else ~3.2 GB."""
    if size == "1g":
        return llama_shapes(1024, 2816, 4, 16000)
    if quick or size == "quick":
        return llama_shapes(256, 704, 4, 4000)
    return llama_shapes(1024, 2816, 16, 32000)


def workload_spec(workload: str, quick: bool, seed: int, size: str | None = None) -> list[tuple[str, tuple[int, ...]]]:
    """Flat list of (key, shape), all float32."""
    if workload == "llama":
        params = llama_param_shapes(quick, size)
        out = list(params)
        out += [(f"optim.exp_avg.{k}", s) for k, s in params]
        out += [(f"optim.exp_avg_sq.{k}", s) for k, s in params]
        return out
    if workload == "small":
        n = 2000 if quick else 20000
        rng = np.random.default_rng(seed)
        sizes = rng.integers(1024 // 4, 64 * 1024 // 4 + 1, size=n)  # elements: 1..64 KiB fp32
        return [(f"small.{i:05d}", (int(s),)) for i, s in enumerate(sizes)]
    raise ValueError(workload)


def spec_nbytes(spec) -> int:
    return sum(4 * int(np.prod(s)) for _, s in spec)


def build_numpy(spec) -> dict[str, np.ndarray]:
    return {k: _fill(int(np.prod(s)), i).reshape(s) for i, (k, s) in enumerate(spec)}


def nest_llama(flat: dict) -> dict:
    """{"params": {name: t}, "opt": {"exp_avg": {name: t}, "exp_avg_sq": {name: t}}}."""
    params, ea, eas = {}, {}, {}
    for k, v in flat.items():
        if k.startswith("optim.exp_avg_sq."):
            eas[k[len("optim.exp_avg_sq.") :]] = v
        elif k.startswith("optim.exp_avg."):
            ea[k[len("optim.exp_avg.") :]] = v
        else:
            params[k] = v
    return {"params": params, "opt": {"exp_avg": ea, "exp_avg_sq": eas}}


def flatten_any(tree, prefix="") -> dict:
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(flatten_any(v, f"{prefix}{k}/"))
        return out
    return {prefix[:-1]: tree}


# --------------------------------------------------------------------------------------
# Helpers: fsync, page cache, RSS sampling
# --------------------------------------------------------------------------------------


def fsync_path(p: str | Path) -> None:
    fd = os.open(str(p), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(p: str | Path) -> None:
    p = Path(p)
    if p.is_file():
        fsync_path(p)
        fsync_path(p.parent)
        return
    for root, dirs, files in os.walk(p):
        for f in files:
            fsync_path(os.path.join(root, f))
        fsync_path(root)
    fsync_path(p.parent)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def rss_bytes() -> int:
    return _status_kib("VmRSS") * 1024


class RssSampler:
    """Samples VmRSS every `interval` s in a thread; also resets/reads VmHWM (peak RSS)."""

    def __init__(self, interval: float = 0.005):
        self.interval = interval
        self.peak = 0
        self.samples = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self.hwm_reset = False

    def _run(self):
        while not self._stop.is_set():
            r = rss_bytes()
            self.samples += 1
            if r > self.peak:
                self.peak = r
            self._stop.wait(self.interval)

    def __enter__(self):
        try:  # "5" resets the peak RSS (VmHWM) counter of this process (Linux >= 4.0)
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.hwm_reset = True
        except OSError:
            self.hwm_reset = False
        self.baseline = rss_bytes()
        self.peak = self.baseline
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.hwm = _status_kib("VmHWM") * 1024
        peak = max(self.peak, self.hwm if self.hwm_reset else 0)
        self.result = {
            "rss_baseline": self.baseline,
            "rss_peak_sampled": self.peak,
            "rss_hwm": self.hwm if self.hwm_reset else None,
            "rss_peak": peak,
            "rss_peak_over_baseline": peak - self.baseline,
            "rss_samples": self.samples,
        }
        return False


# --------------------------------------------------------------------------------------
# System adapters. Each: kind ("torch"/"numpy"/"jax"), prepare(np_state)->native state,
# save(state, path), make_like(spec)->target for load, load(path, like)->state.
# --------------------------------------------------------------------------------------


class Adapter:
    name = "?"
    kind = "torch"
    nested = False  # statestream nested llama form
    note = ""
    path_is_dir = True

    def prepare(self, np_state: dict):
        import torch

        st = {k: torch.from_numpy(v) for k, v in np_state.items()}
        return nest_llama(st) if self.nested else st

    def make_like(self, spec):
        import torch

        st = {k: torch.empty(s, dtype=torch.float32) for k, s in spec}
        return nest_llama(st) if self.nested else st

    def save(self, state, path: str) -> None:
        raise NotImplementedError

    def load(self, path: str, like):
        raise NotImplementedError

    def to_flat_numpy(self, out) -> dict[str, np.ndarray]:
        flat = flatten_any(out)
        res = {}
        for k, v in flat.items():
            if hasattr(v, "numpy") and not isinstance(v, np.ndarray):
                try:
                    v = v.numpy()
                except Exception:
                    v = np.asarray(v)
            res[k] = np.asarray(v)
        return res


class StatestreamAdapter(Adapter):
    """statestream; load(target=torch-like) -> torch tensors ("torch" load variant)."""

    def __init__(self, nested=False, load_numpy=False):
        self.nested = nested
        self.load_numpy = load_numpy
        self.name = "statestream" + ("-nested" if nested else "") + ("-np" if load_numpy else "")
        self.note = ("nested {params, opt} tree" if nested else "flat dict") + (
            "; load(path) -> numpy" if load_numpy else "; load(path, target=torch-like) -> torch"
        )

    def save(self, state, path):
        import statestream as ss

        ss.save(path, state)

    def load(self, path, like):
        import statestream as ss

        if self.load_numpy:
            return ss.load(path)
        return ss.load(path, target=like)


class StatestreamInPlaceAdapter(StatestreamAdapter):
    """statestream load(target, in_place=True) into resident torch tensors (as DCP does)."""

    resident = True

    def __init__(self):
        super().__init__()
        self.name = "statestream-inplace"
        self.note = "load(path, target=resident torch tensors, in_place=True)"

    def load(self, path, like):
        import statestream as ss

        return ss.load(path, target=like, in_place=True)


class StatestreamDropBehindAdapter(StatestreamInPlaceAdapter):
    """In place, with IOOptions(drop_behind=True): the page cache lets go of what the load
    read in (so the "hot" load after it reads from disk again)."""

    def __init__(self):
        super().__init__()
        self.name = "statestream-inplace-drop"
        self.note = ("load(path, target=resident torch tensors, in_place=True, "
                     "io=IOOptions(drop_behind=True)); its 'hot' load is cold again")

    def load(self, path, like):
        import statestream as ss

        return ss.load(path, target=like, in_place=True, io=ss.IOOptions(drop_behind=True))


class TorchSaveAdapter(Adapter):
    name = "torch.save"
    note = "torch.save to file object + flush + fsync; torch.load(weights_only=True)"
    path_is_dir = False

    def save(self, state, path):
        import torch

        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        fsync_path(os.path.dirname(path))

    def load(self, path, like):
        import torch

        return torch.load(path, weights_only=True)


class TorchMmapAdapter(TorchSaveAdapter):
    name = "torch.load-mmap"
    note = "torch.load(mmap=True, weights_only=True) of a torch.save file; touch() reads every page"

    def load(self, path, like):
        import torch

        return torch.load(path, weights_only=True, mmap=True)


class SafetensorsAdapter(Adapter):
    name = "safetensors"
    note = "safetensors.torch.save_file + fsync; load_file"
    path_is_dir = False

    def save(self, state, path):
        from safetensors.torch import save_file

        save_file(state, path)
        fsync_path(path)
        fsync_path(os.path.dirname(path))

    def load(self, path, like):
        from safetensors.torch import load_file

        return load_file(path)


class NumpySavezAdapter(Adapter):
    name = "numpy.savez"
    kind = "numpy"
    note = "np.savez (uncompressed zip) + fsync; np.load + materialize every array"
    path_is_dir = False

    def prepare(self, np_state):
        return np_state

    def make_like(self, spec):
        return None

    def save(self, state, path):
        with open(path, "wb") as f:
            np.savez(f, **state)
            f.flush()
            os.fsync(f.fileno())
        fsync_path(os.path.dirname(path))

    def load(self, path, like):
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}


class DCPAdapter(Adapter):
    name = "torch DCP"

    def __init__(self, thread_count: int = 1):
        self.thread_count = thread_count
        self.note = (
            f"dcp.save/load(no_dist=True, no process group), FileSystemWriter(sync_files=True, "
            f"thread_count={thread_count}); load into torch.empty targets"
        )

    def save(self, state, path):
        import torch.distributed.checkpoint as dcp

        w = dcp.FileSystemWriter(path, sync_files=True, thread_count=self.thread_count)
        dcp.save(state, storage_writer=w, no_dist=True)

    def load(self, path, like):
        import torch.distributed.checkpoint as dcp

        dcp.load(like, storage_reader=dcp.FileSystemReader(path), no_dist=True)
        return like


class OrbaxAdapter(Adapter):
    kind = "jax"

    def __init__(self, compressed: bool):
        self.compressed = compressed
        if compressed:
            self.name = "orbax-std"
            self.note = (
                "StandardCheckpointer() defaults (OCDBT, zarr2, zstd level 1 -- StandardCheckpointHandler "
                "has no use_compression option); save + wait_until_finished; restore(abstract ShapeDtypeStruct tree)"
            )
        else:
            self.name = "orbax"
            self.note = (
                "AsyncCheckpointer(PyTreeCheckpointHandler(use_compression=False)) = StandardCheckpointer's "
                "layout (OCDBT, zarr2) without zstd; save + wait_until_finished; restore(PyTreeRestore)"
            )
        self._ck = None

    def _ckptr(self):
        import orbax.checkpoint as ocp

        if self._ck is None:
            if self.compressed:
                self._ck = ocp.StandardCheckpointer()
            else:
                self._ck = ocp.AsyncCheckpointer(ocp.PyTreeCheckpointHandler(use_compression=False))
        return self._ck

    def prepare(self, np_state):
        import jax

        # jax.device_put, not jnp.asarray: the latter compiles a convert per distinct shape
        # (~12 ms each), which makes building the 20,000-tensor state take minutes.
        out = {}
        for k in list(np_state.keys()):
            out[k] = jax.device_put(np_state.pop(k))
        jax.block_until_ready(out)
        return out

    def make_like(self, spec):
        import jax
        import jax.numpy as jnp

        return {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in spec}

    def save(self, state, path):
        import orbax.checkpoint as ocp

        ck = self._ckptr()
        if self.compressed:
            ck.save(path, state)
        else:
            ck.save(path, args=ocp.args.PyTreeSave(state))
        ck.wait_until_finished()

    def load(self, path, like):
        import jax
        import orbax.checkpoint as ocp

        ck = self._ckptr()
        if self.compressed:
            out = ck.restore(path, like)
        else:
            rargs = jax.tree.map(lambda a: ocp.ArrayRestoreArgs(dtype=a.dtype), like)
            out = ck.restore(path, args=ocp.args.PyTreeRestore(item=like, restore_args=rargs))
        jax.block_until_ready(out)
        return out


class DCPResidentAdapter(DCPAdapter):
    resident = True

    def __init__(self, thread_count: int = 1):
        super().__init__(thread_count)
        self.name = "torch DCP-resident"
        self.note += " (resident targets, made before the clock starts)"


def make_adapter(name: str, dcp_threads: int) -> Adapter:
    table: dict[str, Callable[[], Adapter]] = {
        "statestream-inplace": StatestreamInPlaceAdapter,
        "statestream-inplace-drop": StatestreamDropBehindAdapter,
        "torch.load-mmap": TorchMmapAdapter,
        "torch DCP-resident": lambda: DCPResidentAdapter(dcp_threads),
        "statestream": lambda: StatestreamAdapter(),
        "statestream-nested": lambda: StatestreamAdapter(nested=True),
        "statestream-np": lambda: StatestreamAdapter(load_numpy=True),
        "torch.save": TorchSaveAdapter,
        "safetensors": SafetensorsAdapter,
        "numpy.savez": NumpySavezAdapter,
        "torch DCP": lambda: DCPAdapter(dcp_threads),
        "orbax": lambda: OrbaxAdapter(compressed=False),
        "orbax-std": lambda: OrbaxAdapter(compressed=True),
    }
    return table[name]()


#: extra load variants of a saved checkpoint (same files, another reader)
EXTRA_LOADS = {
    "statestream": ["statestream-np", "statestream-inplace", "statestream-inplace-drop"],
    "torch.save": ["torch.load-mmap"],
    "torch DCP": ["torch DCP-resident"],
}

ALL_SYSTEMS = [
    "statestream",
    "statestream-nested",
    "torch.save",
    "safetensors",
    "numpy.savez",
    "torch DCP",
    "orbax",
    "orbax-std",
]

# --------------------------------------------------------------------------------------
# Child-process tasks
# --------------------------------------------------------------------------------------


def _ckpt_path(base: str, ad: Adapter) -> str:
    ext = {"torch.save": ".pt", "safetensors": ".safetensors", "numpy.savez": ".npz"}.get(ad.name, "")
    return os.path.join(base, "ckpt" + ext)


def _rm(p: str) -> None:
    if os.path.isdir(p):
        shutil.rmtree(p, ignore_errors=True)
    elif os.path.exists(p):
        os.unlink(p)


def _warmup(ad: Adapter, base: str) -> None:
    """Tiny save+load so lazy imports / thread pools are not billed to the timed call."""
    spec = [("warm.a", (64, 64)), ("warm.b", (128,))]
    if ad.nested:
        spec = [("model.a", (64, 64)), ("optim.exp_avg.model.a", (64, 64)), ("optim.exp_avg_sq.model.a", (64, 64))]
    st = ad.prepare(build_numpy(spec))
    p = os.path.join(base, "warmup" + os.path.splitext(_ckpt_path(base, ad))[1])
    _rm(p)
    ad.save(st, p)
    ad.load(p, ad.make_like(spec))
    _rm(p)


def _verify(ad: Adapter, out, spec, nbytes: int) -> str | None:
    flat = ad.to_flat_numpy(out)
    if ad.nested:
        exp_keys = set(flatten_any(nest_llama({k: 0 for k, _ in spec})).keys())
    else:
        exp_keys = {k for k, _ in spec}
    if set(flat.keys()) != exp_keys:
        return f"key mismatch: got {len(flat)} keys, expected {len(exp_keys)}"
    tot = sum(v.nbytes for v in flat.values())
    if tot != nbytes:
        return f"byte mismatch {tot} != {nbytes}"
    # spot-check values of a few tensors
    keys = [k for k, _ in spec]
    nested_map = {}
    if ad.nested:
        nk = list(flatten_any(nest_llama({k: k for k, _ in spec})).items())
        nested_map = {orig: nkey for nkey, orig in nk}
    for i in sorted({0, len(spec) // 2, len(spec) - 1}):
        k, s = spec[i]
        got = flat[nested_map.get(k, k)]
        exp = _fill(int(np.prod(s)), i).reshape(s)
        if got.shape != tuple(s) or got.dtype != np.float32 or not np.array_equal(got, exp):
            return f"value mismatch at {k}"
    return None


def touch(out) -> float:
    """Read one float per 4 KiB page of every loaded tensor, so that lazily mmapped results
    (e.g. safetensors.load_file) are charged for their I/O. Applied to every system."""
    acc = 0.0
    for v in flatten_any(out).values():
        if isinstance(v, np.ndarray):
            a = v
        elif hasattr(v, "untyped_storage"):  # torch
            a = v.detach().numpy()
        else:  # jax arrays are fully materialized by block_until_ready already
            continue
        if a.size:
            acc += float(a.reshape(-1)[::1024].sum())
    return acc


def child_save(a: dict) -> dict:
    ad = make_adapter(a["system"], a["dcp_threads"])
    base = a["dir"]
    os.makedirs(base, exist_ok=True)
    _warmup(ad, base)
    spec = workload_spec(a["workload"], a["quick"], a["seed"], a.get("size"))
    t0 = time.perf_counter()
    st = ad.prepare(build_numpy(spec))
    build_s = time.perf_counter() - t0
    gc.collect()
    path = _ckpt_path(base, ad)
    _rm(path)
    os.sync()
    with RssSampler() as s:
        t0 = time.perf_counter()
        ad.save(st, path)
        dt = time.perf_counter() - t0
    du = sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file()) if os.path.isdir(path) else os.path.getsize(path)
    return {"seconds": dt, "build_s": build_s, "path": path, "disk_bytes": du, **s.result}


def child_load(a: dict) -> dict:
    ad = make_adapter(a["system"], a["dcp_threads"])
    base = a["dir"]
    _warmup(ad, base)
    spec = workload_spec(a["workload"], a["quick"], a["seed"], a.get("size"))
    nbytes = spec_nbytes(spec)
    path = a["path"]
    res: dict[str, Any] = {}
    for mode in ("cold", "hot"):
        gc.collect()
        if mode == "cold":
            err = drop_caches()
            if err:
                res["cold_error"] = err
                res["cold"] = None
                # still warm the cache for the hot measurement
                ad.load(path, ad.make_like(spec))
                gc.collect()
                continue
        else:
            # make sure the whole checkpoint is resident (cold load read it already)
            pass
        resident = None
        if getattr(ad, "resident", False):  # targets already in memory (a training job's)
            resident = ad.make_like(spec)
            for v in flatten_any(resident).values():
                v.zero_()
        with RssSampler() as s:
            t0 = time.perf_counter()
            # fresh (lazily-faulted) target memory each time, unless resident
            like = resident if resident is not None else ad.make_like(spec)
            out = ad.load(path, like)
            t1 = time.perf_counter()
            touch(out)
            dt = time.perf_counter() - t0
        t2 = time.perf_counter()
        touch(out)  # second pass: pure overhead of the touch loop (everything resident now)
        touch_s = time.perf_counter() - t2
        err = _verify(ad, out, spec, nbytes) if a.get("verify", True) else None
        res[mode] = {"seconds": dt, "load_call_s": t1 - t0, "touch_overhead_s": touch_s, "verify_error": err, **s.result}
        del out, like, resident
        gc.collect()
    return res


def child_raw(a: dict) -> dict:
    """Raw 2-thread pwrite+fsync / preadv bandwidth on the checkpoint filesystem."""
    total = a["nbytes"]
    nthreads = 2
    chunk = 64 * MiB
    per = (total // nthreads + chunk - 1) // chunk * chunk
    base = a["dir"]
    os.makedirs(base, exist_ok=True)
    files = [os.path.join(base, f"raw{i}.bin") for i in range(nthreads)]
    buf = np.frombuffer(np.random.default_rng(1).bytes(chunk), dtype=np.uint8).copy()  # prefaulted
    mv = memoryview(buf)
    out: dict[str, Any] = {"bytes": per * nthreads, "threads": nthreads, "chunk": chunk, "write": [], "cold": [], "hot": []}

    def run_threads(fn):
        errs = []

        def wrap(i):
            try:
                fn(i)
            except BaseException as e:  # pragma: no cover
                errs.append(e)

        ts = [threading.Thread(target=wrap, args=(i,)) for i in range(nthreads)]
        t0 = time.perf_counter()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        dt = time.perf_counter() - t0
        if errs:
            raise errs[0]
        return dt

    def writer(i):
        fd = os.open(files[i], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            off = 0
            while off < per:
                n = os.pwrite(fd, mv, off)
                off += n
            os.fsync(fd)
        finally:
            os.close(fd)

    read_bufs: list[np.ndarray] = []

    def reader(i):
        fd = os.open(files[i], os.O_RDONLY)
        try:
            b = read_bufs[i]
            m = memoryview(b)
            off = 0
            while off < per:
                n = os.preadv(fd, [m[off : off + chunk]], off)
                if n <= 0:
                    raise OSError("short read")
                off += n
        finally:
            os.close(fd)

    for r in range(a["repeats"]):
        for f in files:
            _rm(f)
        os.sync()
        out["write"].append(run_threads(writer))
    # cold reads into preallocated (prefaulted) buffers
    read_bufs = [np.ones(per, dtype=np.uint8) for _ in range(nthreads)]
    for r in range(a["repeats"]):
        err = drop_caches()
        if err:
            out["cold_error"] = err
            break
        out["cold"].append(run_threads(reader))
    read_bufs = []
    gc.collect()
    # hot reads into freshly allocated (np.empty, not prefaulted) memory each repetition;
    # one untimed pass first so the files are fully in the page cache
    read_bufs = [np.empty(per, dtype=np.uint8) for _ in range(nthreads)]
    run_threads(reader)
    for r in range(a["repeats"]):
        read_bufs = []
        gc.collect()
        read_bufs = [np.empty(per, dtype=np.uint8) for _ in range(nthreads)]
        out["hot"].append(run_threads(reader))
    read_bufs = []
    for f in files:
        _rm(f)
    return out


def child_main(arg: str) -> None:
    a = json.loads(arg)
    if a.get("pythonpath"):
        sys.path.insert(0, a["pythonpath"])
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    try:
        fn = {"save": child_save, "load": child_load, "raw": child_raw}[a["task"]]
        res = {"ok": True, **fn(a)}
    except BaseException as e:
        res = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    sys.stdout.flush()
    print("RESULT:" + json.dumps(res), flush=True)


# --------------------------------------------------------------------------------------
# Parent: orchestration, statistics, reporting
# --------------------------------------------------------------------------------------


def gbps(nbytes, secs):
    return nbytes / secs / 1e9 if secs else None


def statestream_available() -> tuple[bool, str]:
    code = "import statestream as ss; assert callable(ss.save) and callable(ss.load); print(getattr(ss, '__version__', '?'))"
    env = dict(os.environ, PYTHONPATH=str(SRC))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    if p.returncode == 0:
        return True, p.stdout.strip()
    return False, (p.stderr.strip().splitlines() or ["?"])[-1]


def git_rev() -> str:
    try:
        return subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() or "?"
    except Exception:
        return "?"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=str(REPO / "bench-data"), help="checkpoint scratch dir (deleted at the end)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="~64 MiB llama + 2,000 small tensors, 1 repeat")
    ap.add_argument("--systems", default=",".join(ALL_SYSTEMS), help="comma list; default: all")
    ap.add_argument("--workloads", default="llama,small")
    ap.add_argument("--small-systems", default=None, help="systems for the small workload (default: same as --systems)")
    ap.add_argument("--dcp-threads", type=int, default=1, help="FileSystemWriter thread_count (DCP default is 1)")
    ap.add_argument("--state-size", default=None, choices=["quick", "1g", "3g"],
                    help="size of the Llama-like state (default: quick with --quick, else 3g)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600, help="per child process timeout (s)")
    ap.add_argument("--out", default=None, help="JSON output path (markdown goes next to it)")
    ap.add_argument("--no-verify", action="store_true")
    ap.add_argument("--keep-data", action="store_true")
    ap.add_argument("--src", default=None,
                    help="statestream source tree to measure (default: this repository's src/); "
                         "benchmarks/compare_commits.py passes another commit's")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        child_main(args.child)
        return
    if args.src is not None:
        global SRC
        SRC = Path(args.src).resolve()
    if args.quick and "--repeats" not in " ".join(sys.argv):
        args.repeats = 1

    started = time.time()
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_json = Path(args.out) if args.out else HERE / "results" / f"core-{stamp}{'-quick' if args.quick else ''}.json"
    out_md = out_json.with_suffix(".md")
    out_json.parent.mkdir(parents=True, exist_ok=True)
    base = os.path.abspath(args.dir)
    os.makedirs(base, exist_ok=True)

    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    skipped: dict[str, str] = {}
    if args.small_systems:
        small_systems = [s.strip() for s in args.small_systems.split(",") if s.strip()]
    else:
        small_systems = [s for s in systems if s != "orbax-std"]
        if "orbax-std" in systems:
            skipped["orbax-std|small"] = (
                "skipped by default to bound runtime (~1 min per save/load of 20k arrays on 2 cores); "
                "the uncompressed 'orbax' row covers the same layout; pass --small-systems to include it"
            )
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    ok, info = statestream_available()
    if not ok:
        msg = f"statestream not importable ({info}); skipped"
        log(msg)
        for s in ("statestream", "statestream-nested", "statestream-np"):
            skipped[s] = msg
        systems = [s for s in systems if not s.startswith("statestream")]
        small_systems = [s for s in small_systems if not s.startswith("statestream")]
    cmdline = " ".join(shlex.quote(x) for x in [os.path.relpath(sys.executable, os.getcwd()) if sys.executable.startswith(os.getcwd()) else sys.executable] + sys.argv)

    results: dict[str, Any] = {
        "command": cmdline,
        "cwd": os.getcwd(),
        "started": _dt.datetime.now().isoformat(timespec="seconds"),
        "git": git_rev(),
        "src": str(SRC),
        "statestream": info if ok else None,
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "mem_total_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB,
            "python": platform.python_version(),
        },
        "args": vars(args),
        "skipped": skipped,
        "workloads": {},
        "raw": None,
        "runs": {},
    }
    try:
        import importlib.metadata as im

        results["versions"] = {p: im.version(p) for p in ("torch", "jax", "jaxlib", "orbax-checkpoint", "safetensors", "numpy", "tensorstore") if _has_dist(im, p)}
    except Exception:
        pass

    specs = {w: workload_spec(w, args.quick, args.seed, args.state_size) for w in workloads}
    for w, sp in specs.items():
        results["workloads"][w] = {"tensors": len(sp), "bytes": spec_nbytes(sp)}
        log(f"workload {w}: {len(sp)} tensors, {spec_nbytes(sp) / GiB:.3f} GiB")

    # 1. raw bandwidths (same total size as workload 1)
    raw_bytes = spec_nbytes(specs.get("llama") or workload_spec("llama", args.quick, args.seed, args.state_size))
    log("raw bandwidth ...")
    raw = run_child(__file__, SRC, {"task": "raw", "dir": base, "nbytes": raw_bytes, "repeats": args.repeats}, args.timeout)
    results["raw"] = raw
    if not raw.get("ok"):
        log(f"raw failed: {raw.get('error')}")
    else:
        log(
            "raw: write+fsync %.2f GB/s, cold %s GB/s, hot %.2f GB/s"
            % (
                gbps(raw["bytes"], med(raw["write"])),
                f"{gbps(raw['bytes'], med(raw['cold'])):.2f}" if raw["cold"] else "n/a",
                gbps(raw["bytes"], med(raw["hot"])),
            )
        )

    # 2. systems x workloads
    common = {"dir": base, "quick": args.quick, "size": args.state_size, "seed": args.seed, "dcp_threads": args.dcp_threads, "pythonpath": str(SRC), "verify": not args.no_verify}
    for w in workloads:
        sys_list = small_systems if w == "small" else systems
        for sname in sys_list:
            key = f"{sname}|{w}"
            run = {"system": sname, "workload": w, "note": make_adapter(sname, args.dcp_threads).note, "save": [], "load": []}
            if sname.startswith("statestream-nested") and w != "llama":
                continue
            results["runs"][key] = run
            for r in range(args.repeats):
                task = dict(common, task="save", system=sname, workload=w)
                sres = run_child(__file__, SRC, task, args.timeout)
                run["save"].append(sres)
                if not sres.get("ok"):
                    log(f"{key} save #{r} FAILED: {sres.get('error')}")
                    run["error"] = sres.get("error")
                    break
                nb = results["workloads"][w]["bytes"]
                log(f"{key} save #{r}: {sres['seconds']:.3f}s {gbps(nb, sres['seconds']):.2f} GB/s  peak RSS +{sres['rss_peak_over_baseline'] / MiB:.0f} MiB")
                loads = [sname] + EXTRA_LOADS.get(sname, [])
                for lname in loads:
                    lres = run_child(__file__, SRC, dict(common, task="load", system=lname, workload=w, path=sres["path"]), args.timeout)
                    lres["variant"] = lname
                    run["load"].append(lres)
                    if not lres.get("ok"):
                        log(f"{key} load[{lname}] #{r} FAILED: {lres.get('error')}")
                        continue
                    c, h = lres.get("cold"), lres.get("hot")
                    log(
                        f"{key} load[{lname}] #{r}: cold {c['seconds'] if c else float('nan'):.3f}s hot {h['seconds']:.3f}s"
                        + (f" VERIFY: {c.get('verify_error') or h.get('verify_error')}" if (c and c.get("verify_error")) or h.get("verify_error") else "")
                    )
                _rm(sres["path"])
    # raw bandwidth again at the end: the machine is shared/noisy and a VM's first touches of
    # guest memory can be slow, so the ratios use the better (faster) of the two raw runs.
    log("raw bandwidth (end) ...")
    results["raw_end"] = run_child(__file__, SRC, {"task": "raw", "dir": base, "nbytes": raw_bytes, "repeats": args.repeats}, args.timeout)
    if not args.keep_data:
        shutil.rmtree(base, ignore_errors=True)
    results["elapsed_s"] = time.time() - started
    summarize(results)
    out_json.write_text(json.dumps(results, indent=1, default=str))
    md = render_md(results)
    out_md.write_text(md)
    print(md)
    log(f"wrote {out_json} and {out_md} in {results['elapsed_s']:.0f}s")


def _has_dist(im, p):
    try:
        im.version(p)
        return True
    except Exception:
        return False


def summarize(results: dict) -> None:
    summ: dict[str, Any] = {}

    def raw_summary(raw):
        b = raw["bytes"]
        return {
            "write_fsync_gbps": gbps(b, med(raw["write"])),
            "cold_read_gbps": gbps(b, med(raw["cold"])) if raw.get("cold") else None,
            "hot_read_gbps": gbps(b, med(raw["hot"])),
            "write_samples_s": raw["write"],
            "cold_samples_s": raw["cold"],
            "hot_samples_s": raw["hot"],
            "cold_error": raw.get("cold_error"),
        }

    runs = [r for r in (results.get("raw"), results.get("raw_end")) if r and r.get("ok")]
    if runs:
        parts = [raw_summary(r) for r in runs]
        summ["raw_runs"] = parts  # [start, end]
        best = {}
        for f in ("write_fsync_gbps", "cold_read_gbps", "hot_read_gbps"):
            vals = [p[f] for p in parts if p[f]]
            best[f] = max(vals) if vals else None
        best["cold_error"] = parts[0]["cold_error"]
        summ["raw"] = best  # used for ratios: the faster of start/end (conservative for statestream)
    rows = {}
    for key, run in results["runs"].items():
        nb = results["workloads"][run["workload"]]["bytes"]
        saves = [s for s in run["save"] if s.get("ok")]
        by_variant: dict[str, list] = {}
        for l in run["load"]:
            if l.get("ok"):
                by_variant.setdefault(l["variant"], []).append(l)
        for variant in by_variant or {run["system"]: []}:
            loads = by_variant.get(variant, [])
            cold = [l["cold"]["seconds"] for l in loads if l.get("cold")]
            hot = [l["hot"]["seconds"] for l in loads if l.get("hot")]
            is_main = variant == run["system"]
            save_s = [s["seconds"] for s in saves] if is_main else []
            rk = f"{variant}|{run['workload']}"
            rows[rk] = {
                "system": variant,
                "workload": run["workload"],
                "bytes": nb,
                "note": run["note"] if is_main else make_adapter(variant, 1).note,
                "save_s_median": med(save_s),
                "save_s_samples": save_s,
                "save_gbps": gbps(nb, med(save_s)) if save_s else None,
                "cold_load_s_median": med(cold),
                "cold_load_s_samples": cold,
                "cold_load_gbps": gbps(nb, med(cold)) if cold else None,
                "hot_load_s_median": med(hot),
                "hot_load_s_samples": hot,
                "hot_load_gbps": gbps(nb, med(hot)) if hot else None,
                "save_peak_rss_over_state_bytes": med([s["rss_peak_over_baseline"] for s in saves]) if is_main and saves else None,
                "cold_load_peak_rss_over_baseline_bytes": med([l["cold"]["rss_peak_over_baseline"] for l in loads if l.get("cold")]),
                "hot_load_peak_rss_over_baseline_bytes": med([l["hot"]["rss_peak_over_baseline"] for l in loads if l.get("hot")]),
                "verify_errors": sorted({str(l[m].get("verify_error")) for l in loads for m in ("cold", "hot") if l.get(m) and l[m].get("verify_error")}),
                "error": run.get("error") if is_main else None,
                "disk_bytes": med([s.get("disk_bytes") for s in saves]) if is_main and saves else None,
            }
    summ["rows"] = rows

    def g(sys_, w, f):
        return (rows.get(f"{sys_}|{w}") or {}).get(f)

    def ratio(a, b):
        return a / b if a and b else None

    rr = summ.get("raw", {})
    ratios = {}
    for w in ("llama", "small"):
        ratios[f"{w}: statestream save / raw write+fsync"] = ratio(g("statestream", w, "save_gbps"), rr.get("write_fsync_gbps"))
        ratios[f"{w}: statestream save / DCP save (speedup)"] = ratio(g("statestream", w, "save_gbps"), g("torch DCP", w, "save_gbps"))
        ratios[f"{w}: statestream save / torch.save (speedup)"] = ratio(g("statestream", w, "save_gbps"), g("torch.save", w, "save_gbps"))
        ratios[f"{w}: statestream cold load / raw cold read"] = ratio(g("statestream", w, "cold_load_gbps"), rr.get("cold_read_gbps"))
        ratios[f"{w}: statestream hot load / raw hot read"] = ratio(g("statestream", w, "hot_load_gbps"), rr.get("hot_read_gbps"))
        ratios[f"{w}: statestream hot load / DCP hot load (speedup)"] = ratio(g("statestream", w, "hot_load_gbps"), g("torch DCP", w, "hot_load_gbps"))
        ratios[f"{w}: statestream cold load / DCP cold load (speedup)"] = ratio(g("statestream", w, "cold_load_gbps"), g("torch DCP", w, "cold_load_gbps"))
        ratios[f"{w}: statestream cold load / torch.load(mmap) + touch cold (speedup)"] = ratio(g("statestream", w, "cold_load_gbps"), g("torch.load-mmap", w, "cold_load_gbps"))
        ratios[f"{w}: statestream load / torch.load cold (speedup)"] = ratio(g("statestream", w, "cold_load_gbps"), g("torch.save", w, "cold_load_gbps"))
        ratios[f"{w}: statestream load / torch.load hot (speedup)"] = ratio(g("statestream", w, "hot_load_gbps"), g("torch.save", w, "hot_load_gbps"))
        ratios[f"{w}: statestream-inplace cold load / raw cold read"] = ratio(g("statestream-inplace", w, "cold_load_gbps"), rr.get("cold_read_gbps"))
        ratios[f"{w}: statestream-inplace-drop cold load / raw cold read"] = ratio(g("statestream-inplace-drop", w, "cold_load_gbps"), rr.get("cold_read_gbps"))
        ratios[f"{w}: statestream-inplace hot load / DCP-resident hot load (speedup)"] = ratio(g("statestream-inplace", w, "hot_load_gbps"), g("torch DCP-resident", w, "hot_load_gbps"))
    ratios["llama: statestream save peak RSS over state / state bytes"] = ratio(g("statestream", "llama", "save_peak_rss_over_state_bytes"), g("statestream", "llama", "bytes"))
    summ["ratios"] = {k: v for k, v in ratios.items() if v is not None}
    summ["ratios_unavailable"] = [k for k, v in ratios.items() if v is None]
    results["summary"] = summ


def _f(x, nd=2):
    return "n/a" if x is None else f"{x:.{nd}f}"


def _mib(x):
    return "n/a" if x is None else f"{x / MiB:.0f} MiB"


def render_md(results: dict) -> str:
    s = results["summary"]
    L = []
    L.append(f"# statestream core benchmark ({results['started']})\n")
    L.append(f"Command: `{results['command']}` (cwd `{results['cwd']}`), git `{results['git']}`, statestream `{results['statestream']}`\n")
    m = results["machine"]
    L.append(f"Machine: {m['platform']}, {m['cpus']} CPUs, {m['mem_total_gib']:.1f} GiB RAM, Python {m['python']}; versions: " + ", ".join(f"{k} {v}" for k, v in (results.get("versions") or {}).items()) + "\n")
    for w, info in results["workloads"].items():
        L.append(f"- workload `{w}`: {info['tensors']} fp32 tensors, {info['bytes'] / GiB:.3f} GiB ({info['bytes'] / 1e9:.3f} GB)")
    L.append(f"- repeats: {results['args']['repeats']} (medians shown; all samples in the JSON). GB/s = state bytes / seconds (1 GB = 1e9 B).\n")
    rr = s.get("raw")
    L.append("## Raw filesystem bandwidth (2 threads, 64 MiB pwrite/preadv)\n")
    if rr:
        L.append("| when | write+fsync GB/s | cold read GB/s | hot read GB/s (fresh np.empty) |\n|---|---|---|---|")
        rows = list(zip(["start of run", "end of run"], s.get("raw_runs", []))) + [("**used for ratios (max)**", rr)]
        for label, x in rows:
            L.append(f"| {label} | {_f(x['write_fsync_gbps'])} | {_f(x['cold_read_gbps']) if x['cold_read_gbps'] else 'unavailable: ' + str(x.get('cold_error'))} | {_f(x['hot_read_gbps'])} |")
        L.append("")
    else:
        L.append(f"raw measurement failed: {(results.get('raw') or {}).get('error')}\n")
    L.append("## Results (medians)\n")
    L.append("| system | workload | save s | save GB/s | cold load s | cold load GB/s | hot load s | hot load GB/s | peak save RSS over state | peak cold-load RSS over baseline | peak hot-load RSS over baseline |")
    L.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for rk, r in s["rows"].items():
        L.append(
            f"| {r['system']} | {r['workload']} | {_f(r['save_s_median'], 3)} | {_f(r['save_gbps'])} | {_f(r['cold_load_s_median'], 3)} | {_f(r['cold_load_gbps'])} | "
            f"{_f(r['hot_load_s_median'], 3)} | {_f(r['hot_load_gbps'])} | {_mib(r['save_peak_rss_over_state_bytes'])} | {_mib(r['cold_load_peak_rss_over_baseline_bytes'])} | {_mib(r['hot_load_peak_rss_over_baseline_bytes'])} |"
            + (f" ERROR: {r['error']}" if r.get("error") else "")
            + (f" VERIFY FAILED: {'; '.join(r['verify_errors'])}" if r.get("verify_errors") else "")
        )
    L.append("")
    L.append("## Ratios\n")
    for k, v in s["ratios"].items():
        L.append(f"- {k}: **{v:.2f}**")
    if s["ratios_unavailable"]:
        L.append(f"- unavailable (missing inputs): {', '.join(s['ratios_unavailable'])}")
    L.append("\n## Settings per system\n")
    seen = set()
    for r in s["rows"].values():
        if r["system"] not in seen:
            seen.add(r["system"])
            L.append(f"- **{r['system']}**: {r['note']}")
    if results["skipped"]:
        L.append("\n## Skipped\n")
        for k, v in results["skipped"].items():
            L.append(f"- {k}: {v}")
    L.append(f"\nTotal wall time: {results['elapsed_s']:.0f} s\n")
    return "\n".join(L)


if __name__ == "__main__":
    main()
