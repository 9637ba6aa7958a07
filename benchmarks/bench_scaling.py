#!/usr/bin/env python3
"""How cost grows: save/load time and peak RSS against tensors, size, processes; manifest cost.

Run from the repo root with the project venv::

    PYTHONPATH=src .venv/bin/python benchmarks/bench_scaling.py            # everything
    PYTHONPATH=src .venv/bin/python benchmarks/bench_scaling.py --parts tensors,manifest

Parts (every measurement in a fresh child process; medians and ranges of ``--repeats``):

- ``tensors``: N torch fp32 tensors of 1 KiB each (N = 2k, 20k, 200k): ``ss.save`` and
  ``ss.load`` (hot page cache) time and peak RSS above the process's state.
- ``size``: the state size (``--sizes`` GiB, default 0.1, 1, 2) as 64 MiB tensors, plus one
  single tensor of the largest size saved and loaded through a 256 MiB memory budget.
- ``procs``: ``benchmarks/bench_distributed.py --procs 1,2,4,8`` (gloo, DCP beside), its
  save and hot-load rows (run separately; this script reads its JSON with ``--procs-json``).
- ``manifest``: ``encode_manifest``, ``decode_manifest`` and ``ss.metadata`` for 10k, 100k
  and 1M arrays (one chunk each, Llama-like key paths).

Writes benchmarks/results/scaling/scaling-<date>.{json,md} and one PNG per part.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from _common import med, run_child

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SRC = REPO / "src"
MiB, GiB = 1 << 20, 1 << 30


# ----------------------------------------------------------------------------- child side
def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5\n")


def _torch_state(kind: str, n: int, nbytes: int) -> dict[str, Any]:
    import torch

    if kind == "tensors":  # n tensors of 1 KiB
        return {f"layers.{i // 100}.p{i % 100}": torch.full((256,), float(i)) for i in range(n)}
    if kind == "single":
        t = torch.empty(nbytes // 4, dtype=torch.float32)
        t.fill_(1.0)
        return {"w": t}
    per = 64 * MiB
    out = {}
    for i in range(max(1, nbytes // per)):
        t = torch.empty(min(per, nbytes) // 4, dtype=torch.float32)
        t.fill_(float(i))
        out[f"w{i}"] = t
    return out


def child_save_load(a: dict[str, Any]) -> dict[str, Any]:
    import statestream as ss

    path = a["path"]
    mem = ss.MemoryOptions(memory_budget_bytes=a.get("budget"))
    if a["phase"] == "save":
        state = _torch_state(a["kind"], a["n"], a["nbytes"])
        shutil.rmtree(path, ignore_errors=True)
        rss0 = _status_bytes("VmRSS")
        _reset_peak()
        t0 = time.perf_counter()
        ss.save(path, state, memory=mem)
        dt = time.perf_counter() - t0
        return {"ok": True, "s": dt, "peak_extra_bytes": _status_bytes("VmHWM") - rss0}
    rss0 = _status_bytes("VmRSS")
    _reset_peak()
    t0 = time.perf_counter()
    got = ss.load(path, memory=mem)
    dt = time.perf_counter() - t0
    peak = _status_bytes("VmHWM") - rss0
    del got
    return {"ok": True, "s": dt, "peak_extra_bytes": peak}


def _build_manifest(n: int) -> tuple[Any, int]:
    from statestream.format import ArrayEntry, ChunkEntry, FileEntry, Manifest
    from statestream.tree import Node

    arrays, leaves, keys, off = [], [], [], 0
    for i in range(n):
        nb = 4096
        arrays.append(ArrayEntry("float32", (1024,), (
            ChunkEntry(0, off, nb, (i * 7919) & 0xFFFFFFFF, (0,), (1024,)),)))
        off += nb
        leaves.append(Node("array", array=i, attrs={"kind": "torch"}))
        keys.append(f"model.layers.{i // 16}.p{i % 16}.weight")
    tree = Node("dict", keys=["model"], children=[Node("dict", keys=keys, children=leaves)])
    return Manifest(tree=tree, arrays=arrays, files=[FileEntry("data/r0-0.bin", off)]), off


def child_manifest(a: dict[str, Any]) -> dict[str, Any]:
    import statestream as ss
    from statestream._gc import gc_paused
    from statestream.format import (
        COMMIT_NAME,
        MANIFEST_NAME,
        decode_manifest,
        encode_commit,
        encode_manifest,
    )

    m, size = _build_manifest(a["n"])
    rss0 = _status_bytes("VmRSS")
    _reset_peak()
    # ss.save encodes and ss.load decodes with the cyclic GC paused (statestream._gc):
    # measured the same way. ss.metadata is measured as a caller runs it.
    with gc_paused():
        t0 = time.perf_counter()
        data = encode_manifest(m)
        enc = time.perf_counter() - t0
    enc_peak = _status_bytes("VmHWM") - rss0
    del m
    text = data.decode("utf-8")
    with gc_paused():
        t0 = time.perf_counter()
        decode_manifest(text, "bench")
        dec = time.perf_counter() - t0
    del text
    # a committed checkpoint around it (the data file sparse) for ss.metadata
    path = a["path"]
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(os.path.join(path, "data"))
    with open(os.path.join(path, "data", "r0-0.bin"), "wb") as f:
        f.truncate(size)
    with open(os.path.join(path, MANIFEST_NAME), "wb") as f:
        f.write(data)
    with open(os.path.join(path, COMMIT_NAME), "wb") as f:
        f.write(encode_commit(data))
    rss1 = _status_bytes("VmRSS")
    _reset_peak()
    t0 = time.perf_counter()
    md = ss.metadata(path)
    meta = time.perf_counter() - t0
    assert md.num_arrays == a["n"]
    meta_peak = _status_bytes("VmHWM") - rss1
    shutil.rmtree(path, ignore_errors=True)
    return {"ok": True, "manifest_bytes": len(data), "encode_s": enc, "decode_s": dec,
            "metadata_s": meta, "encode_peak_extra_bytes": enc_peak,
            "metadata_peak_extra_bytes": meta_peak}


def child_main(arg: str) -> None:
    a = json.loads(arg)
    try:
        res = child_manifest(a) if a["part"] == "manifest" else child_save_load(a)
    except BaseException as e:  # reported to the parent, which prints it
        import traceback

        res = {"ok": False, "error": f"{type(e).__name__}: {e}",
               "traceback": traceback.format_exc()[-2000:]}
    print("RESULT:" + json.dumps(res), flush=True)
    os._exit(0)


# ----------------------------------------------------------------------------- parent side
def _stat(rs: list[dict[str, Any]], f: str) -> dict[str, Any]:
    xs = [r[f] for r in rs if r.get("ok") and r.get(f) is not None]
    return {"median": med(xs), "min": min(xs, default=None), "max": max(xs, default=None),
            "n": len(xs)}


def _run(task: dict[str, Any], repeats: int, timeout: float) -> list[dict[str, Any]]:
    out = []
    for _ in range(repeats):
        r = run_child(__file__, SRC, task, timeout, stderr_on_failure=True)
        if not r.get("ok"):
            print("FAILED", task, r.get("error"), r.get("traceback", ""), r.get("stderr", ""),
                  file=sys.stderr, flush=True)
        out.append(r)
    return out


def part_save_load(cases: list[tuple[str, str, int, int, int | None]], base: str,
                   repeats: int, timeout: float) -> list[dict[str, Any]]:
    rows = []
    for label, kind, n, nbytes, budget in cases:
        path = os.path.join(base, f"ckpt-{label}")
        row: dict[str, Any] = {"case": label, "kind": kind, "n": n, "nbytes": nbytes,
                               "budget": budget}
        saves, loads = [], []
        for _ in range(repeats):  # save then load, each a fresh process
            t = {"part": "sl", "kind": kind, "n": n, "nbytes": nbytes, "budget": budget,
                 "path": path}
            saves += _run(dict(t, phase="save"), 1, timeout)
            loads += _run(dict(t, phase="load"), 1, timeout)
        shutil.rmtree(path, ignore_errors=True)
        row["save_s"], row["load_s"] = _stat(saves, "s"), _stat(loads, "s")
        row["save_peak"] = _stat(saves, "peak_extra_bytes")
        row["load_peak"] = _stat(loads, "peak_extra_bytes")
        print(f"{label}: save {row['save_s']['median']} load {row['load_s']['median']}",
              flush=True)
        rows.append(row)
    return rows


def part_manifest(ns: list[int], base: str, repeats: int, timeout: float) -> list[dict[str, Any]]:
    rows = []
    for n in ns:
        rs = _run({"part": "manifest", "n": n, "path": os.path.join(base, f"m{n}")},
                  repeats, timeout)
        row = {"n": n, **{f: _stat(rs, f) for f in (
            "manifest_bytes", "encode_s", "decode_s", "metadata_s",
            "encode_peak_extra_bytes", "metadata_peak_extra_bytes")}}
        print(f"manifest {n}: {[(f, row[f]['median']) for f in ('encode_s', 'decode_s', 'metadata_s')]}",
              flush=True)
        rows.append(row)
    return rows


def procs_rows(path: str) -> list[dict[str, Any]]:
    """Save and hot-load medians per process count from a bench_distributed JSON."""
    d = json.loads(Path(path).read_text())
    return d.get("scaling_rows") or d.get("rows") or []


# ----------------------------------------------------------------------------- output
def _m(st: dict[str, Any] | None, scale: float = 1.0, nd: int = 3) -> str:
    if not st or st.get("median") is None:
        return "—"
    return f"{st['median'] / scale:.{nd}f} ({st['min'] / scale:.{nd}f}–{st['max'] / scale:.{nd}f})"


def _per_unit(rows: list[dict[str, Any]], f: str, unit: str) -> list[str]:
    out = []
    for r in rows:
        st = r[f]
        out.append("—" if st["median"] is None else f"{st['median'] / r[unit] * 1e6:.2f}")
    return out


def render(results: dict[str, Any], out_dir: Path, stamp: str) -> str:
    lines = [f"Command: `{results['command']}` (git {results.get('git', '?')}); shared 2-core "
             "machine; medians (min–max) of the repeats, each measurement a fresh process.", ""]
    charts = {}
    if "tensors" in results:
        rows = results["tensors"]
        lines += ["### Number of tensors (1 KiB torch tensors)", "",
                  "| tensors | save s | load s | save µs/tensor | load µs/tensor | save peak MiB | load peak MiB |",
                  "|---|---|---|---|---|---|---|"]
        sp, lp = _per_unit(rows, "save_s", "n"), _per_unit(rows, "load_s", "n")
        for r, a, b in zip(rows, sp, lp):
            lines.append(f"| {r['n']:,} | {_m(r['save_s'])} | {_m(r['load_s'])} | {a} | {b} | "
                         f"{_m(r['save_peak'], MiB, 0)} | {_m(r['load_peak'], MiB, 0)} |")
        charts["tensors"] = _chart(rows, "n", "tensors", out_dir / f"scaling-tensors-{stamp}.png",
                                   "number of 1 KiB tensors", logx=True)
        lines += ["", f"![tensors](results/scaling/{charts['tensors']})", ""]
    if "size" in results:
        rows = results["size"]
        lines += ["### State size (64 MiB tensors; `single`: one tensor through a 256 MiB budget)", "",
                  "| case | GiB | save s | load s | save GB/s | load GB/s | save peak MiB | load peak MiB |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in rows:
            gb = r["nbytes"] / 1e9
            sv, ld = r["save_s"]["median"], r["load_s"]["median"]
            lines.append(f"| {r['case']} | {r['nbytes'] / GiB:.2f} | {_m(r['save_s'])} | {_m(r['load_s'])} | "
                         f"{gb / sv if sv else 0:.2f} | {gb / ld if ld else 0:.2f} | "
                         f"{_m(r['save_peak'], MiB, 0)} | {_m(r['load_peak'], MiB, 0)} |")
        multi = [r for r in rows if r["kind"] == "multi"]
        charts["size"] = _chart(multi, "nbytes", "size", out_dir / f"scaling-size-{stamp}.png",
                                "state size (bytes, 64 MiB tensors)", logx=True)
        lines += ["", f"![size](results/scaling/{charts['size']})", ""]
    if "manifest" in results:
        rows = results["manifest"]
        lines += ["### Manifest (one chunk per array)", "",
                  "| arrays | manifest MB | encode s | decode s | `metadata` s | µs/array (enc, dec, meta) | encode peak MiB | metadata peak MiB |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in rows:
            per = ", ".join("—" if r[f]["median"] is None else f"{r[f]['median'] / r['n'] * 1e6:.1f}"
                            for f in ("encode_s", "decode_s", "metadata_s"))
            mb = r["manifest_bytes"]["median"] or 0
            lines.append(f"| {r['n']:,} | {mb / 1e6:.1f} | {_m(r['encode_s'])} | {_m(r['decode_s'])} | "
                         f"{_m(r['metadata_s'])} | {per} | {_m(r['encode_peak_extra_bytes'], MiB, 0)} | "
                         f"{_m(r['metadata_peak_extra_bytes'], MiB, 0)} |")
        charts["manifest"] = _manifest_chart(rows, out_dir / f"scaling-manifest-{stamp}.png")
        lines += ["", f"![manifest](results/scaling/{charts['manifest']})", ""]
    if results.get("procs"):
        rows = results["procs"]
        lines += [f"### Processes (gloo, from `{results.get('procs_source')}`; DCP's best thread count)",
                  "", "| procs | operation | statestream s | DCP s | DCP / statestream |",
                  "|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['procs']} | {r['op']} | {r['statestream_s']:.3f} | "
                         f"{r['dcp_best_s']:.3f} | {r['ratio']:.2f}x |")
        charts["procs"] = _procs_chart(rows, out_dir / f"scaling-procs-{stamp}.png")
        lines += ["", f"![procs](results/scaling/{charts['procs']})", ""]
    results["charts"] = charts
    return "\n".join(lines) + "\n"


def _chart(rows: list[dict[str, Any]], xkey: str, name: str, out: Path, xlabel: str,
           logx: bool) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r[xkey] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for f, lab in (("save_s", "save"), ("load_s", "load")):
        ax1.plot(xs, [r[f]["median"] for r in rows], "o-", label=lab)
    ax1.set_xlabel(xlabel)
    ax1.set_ylabel("seconds (median)")
    for f, lab in (("save_peak", "save"), ("load_peak", "load")):
        ax2.plot(xs, [(r[f]["median"] or 0) / MiB for r in rows], "o-", label=lab)
    ax2.set_xlabel(xlabel)
    ax2.set_ylabel("peak RSS above the state (MiB)")
    for ax in (ax1, ax2):
        if logx:
            ax.set_xscale("log")
            ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"statestream scaling: {name}")
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out.name


def _procs_chart(rows: list[dict[str, Any]], out: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = sorted({r["op"] for r in rows})
    fig, axes = plt.subplots(1, len(ops), figsize=(4 * len(ops), 4), squeeze=False)
    for ax, op in zip(axes[0], ops):
        rs = sorted((r for r in rows if r["op"] == op), key=lambda r: r["procs"])
        xs = [r["procs"] for r in rs]
        ax.plot(xs, [r["statestream_s"] for r in rs], "o-", label="statestream")
        ax.plot(xs, [r["dcp_best_s"] for r in rs], "s--", label="DCP (best threads)")
        ax.set_title(op)
        ax.set_xlabel("processes (gloo)")
        ax.set_ylabel("seconds (median)")
        ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out.name


def _manifest_chart(rows: list[dict[str, Any]], out: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [r["n"] for r in rows]
    for f in ("encode_s", "decode_s", "metadata_s"):
        ax.plot(xs, [r[f]["median"] for r in rows], "o-", label=f[:-2])
    ax.plot(xs, [rows[0]["encode_s"]["median"] * x / xs[0] for x in xs], ":", color="grey",
            label="linear from 10k encode")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arrays in the manifest")
    ax.set_ylabel("seconds (median)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out.name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="tensors,size,manifest")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tensors", default="2000,20000,200000")
    ap.add_argument("--sizes", default="0.1,1,2", help="GiB; the largest is also run as one tensor")
    ap.add_argument("--single-budget", type=int, default=256 * MiB)
    ap.add_argument("--manifest", default="10000,100000,1000000")
    ap.add_argument("--procs-json", default=None,
                    help="a bench_distributed.py --procs 1,2,4,8 results JSON to chart")
    ap.add_argument("--dir", default=str(REPO / "bench-data-scaling"))
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--render", default=None, metavar="JSON", help="re-render a results JSON")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        child_main(args.child)
        return
    out_dir = HERE / "results" / "scaling"
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.render:
        p = Path(args.render)
        results = json.loads(p.read_text())
        stamp = p.stem.split("scaling-", 1)[-1]
        md = render(results, out_dir, stamp)
        p.with_suffix(".md").write_text(md)
        print(md)
        return
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    exe = os.path.relpath(sys.executable, os.getcwd()) if sys.executable.startswith(os.getcwd()) else sys.executable
    results: dict[str, Any] = {"command": " ".join(shlex.quote(x) for x in [exe] + sys.argv),
                               "started": _dt.datetime.now().isoformat(timespec="seconds"),
                               "loadavg_start": os.getloadavg()}
    try:
        import subprocess

        results["git"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                                        capture_output=True, text=True).stdout.strip()
    except OSError:
        results["git"] = "?"
    base = os.path.abspath(args.dir)
    os.makedirs(base, exist_ok=True)
    parts = args.parts.split(",")
    if "tensors" in parts:
        cases = [(f"{n}-tensors", "tensors", int(n), int(n) * 1024, None)
                 for n in args.tensors.split(",")]
        results["tensors"] = part_save_load(cases, base, args.repeats, args.timeout)
    if "size" in parts:
        sizes = [float(x) for x in args.sizes.split(",")]
        cases = [(f"{g:g} GiB", "multi", 0, int(g * GiB), None) for g in sizes]
        cases.append((f"single {max(sizes):g} GiB tensor, 256 MiB budget", "single", 1,
                      int(max(sizes) * GiB), args.single_budget))
        results["size"] = part_save_load(cases, base, args.repeats, args.timeout)
    if "manifest" in parts:
        results["manifest"] = part_manifest([int(x) for x in args.manifest.split(",")], base,
                                            args.repeats, args.timeout)
    if args.procs_json:
        results["procs"] = procs_rows(args.procs_json)
        results["procs_source"] = args.procs_json
    shutil.rmtree(base, ignore_errors=True)
    results["loadavg_end"] = os.getloadavg()
    out = out_dir / f"scaling-{stamp}.json"
    md = render(results, out_dir, stamp)
    out.write_text(json.dumps(results, indent=1))
    out.with_suffix(".md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
