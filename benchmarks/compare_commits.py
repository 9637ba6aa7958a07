"""Compare two statestream source trees with bench_core.py, interleaved in one session.

The machine is shared and noisy, so the two trees are measured in turns
(ABBA order: old, new, new, old, ...), each run a full ``bench_core.py``
invocation on the same script, scratch directory and arguments; only
``--src`` differs. The report gives, for every result row and metric, the
median and range of each tree's per-run figures and the ratio of the
medians (new / old). No thresholds: read the ratio against the ranges.

Example (from the repository root, the baseline checked out with
``git worktree add /tmp/base <commit>``)::

    python benchmarks/compare_commits.py --old /tmp/base/src --new src --runs 3 \\
        -- --quick --systems statestream
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
METRICS = [
    ("save_s_median", "save s"),
    ("cold_load_s_median", "cold load s"),
    ("hot_load_s_median", "hot load s"),
    ("save_peak_rss_over_state_bytes", "save peak RSS B"),
    ("cold_load_peak_rss_over_baseline_bytes", "cold load peak RSS B"),
]


def run_order(runs: int) -> list[str]:
    """ABBA interleaving: old, new, new, old, old, new, ..."""
    out: list[str] = []
    for i in range(runs):
        out += ["old", "new"] if i % 2 == 0 else ["new", "old"]
    return out


def _fmt(x: float) -> str:
    return f"{x:.3g}" if abs(x) < 1e4 else f"{x:.3e}"


def compare(results: dict[str, list[dict]]) -> list[str]:
    """Markdown table rows: metric, old median [min-max], new median [min-max], new/old."""
    lines = ["| row | metric | old median [range] | new median [range] | new/old |",
             "|---|---|---|---|---|"]
    keys = sorted({k for rs in results.values() for r in rs for k in r["summary"]["rows"]})
    for key in keys:
        for field, label in METRICS:
            vals = {side: [r["summary"]["rows"][key][field] for r in rs
                           if key in r["summary"]["rows"]
                           and r["summary"]["rows"][key].get(field) is not None]
                    for side, rs in results.items()}
            if not vals["old"] or not vals["new"]:
                continue
            mo, mn = statistics.median(vals["old"]), statistics.median(vals["new"])
            cells = [f"{_fmt(statistics.median(v))} [{_fmt(min(v))}-{_fmt(max(v))}]"
                     for v in (vals["old"], vals["new"])]
            ratio = f"{mn / mo:.3f}" if mo else "-"
            lines.append(f"| {key} | {label} | {cells[0]} | {cells[1]} | {ratio} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", required=True, help="baseline source tree (its src/ directory)")
    ap.add_argument("--new", required=True, help="source tree to compare (its src/ directory)")
    ap.add_argument("--runs", type=int, default=3, help="bench_core runs per tree")
    ap.add_argument("--out-dir", default=None, help="default: benchmarks/results/compare-STAMP")
    ap.add_argument("bench_args", nargs=argparse.REMAINDER,
                    help="after --: arguments for bench_core.py (e.g. --quick --systems statestream)")
    args = ap.parse_args()
    extra = [a for a in args.bench_args if a != "--"] if args.bench_args[:1] == ["--"] else args.bench_args
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_dir = Path(args.out_dir) if args.out_dir else HERE / "results" / f"compare-{stamp}"
    out_dir.mkdir(parents=True, exist_ok=True)
    srcs = {"old": str(Path(args.old).resolve()), "new": str(Path(args.new).resolve())}
    results: dict[str, list[dict]] = {"old": [], "new": []}
    counts = {"old": 0, "new": 0}
    for side in run_order(args.runs):
        counts[side] += 1
        out = out_dir / f"{side}-{counts[side]}.json"
        cmd = [sys.executable, str(HERE / "bench_core.py"), "--src", srcs[side],
               "--out", str(out), *extra]
        print(f"[{_dt.datetime.now():%H:%M:%S}] {side} run {counts[side]}: "
              f"{shlex.join(cmd)}", file=sys.stderr, flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        results[side].append(json.loads(out.read_text()))
    md = [f"# compare_commits {stamp}", "",
          f"command: `{shlex.join([sys.executable, *sys.argv])}`", "",
          f"old: `{srcs['old']}`", f"new: `{srcs['new']}`",
          f"order: {', '.join(run_order(args.runs))}; {args.runs} runs each; "
          "median and [min-max] over runs of each run's own median", "",
          *compare(results)]
    text = "\n".join(md) + "\n"
    (out_dir / "compare.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
