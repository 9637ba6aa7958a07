"""Helpers shared by the benchmark scripts (run as scripts, so this sits next to them)."""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path


def llama_shapes(hidden: int, inter: int, layers: int,
                 vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """Parameter names and shapes of a Llama-like model (no optimizer state)."""
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}"
        out += [
            (f"{p}.input_layernorm.weight", (hidden,)),
            (f"{p}.self_attn.q_proj.weight", (hidden, hidden)),
            (f"{p}.self_attn.k_proj.weight", (hidden, hidden)),
            (f"{p}.self_attn.v_proj.weight", (hidden, hidden)),
            (f"{p}.self_attn.o_proj.weight", (hidden, hidden)),
            (f"{p}.post_attention_layernorm.weight", (hidden,)),
            (f"{p}.mlp.gate_proj.weight", (inter, hidden)),
            (f"{p}.mlp.up_proj.weight", (inter, hidden)),
            (f"{p}.mlp.down_proj.weight", (hidden, inter)),
        ]
    out += [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]
    return out


def drop_caches() -> str | None:
    """Drop the page cache; None on success, else an error string."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return None
    except OSError as e:  # not root / read-only procfs (containers)
        return f"drop_caches failed: {e!r}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def run_child(script: str | Path, src: Path, task: dict, timeout: float, *,
              stderr_on_failure: bool = False) -> dict:
    """Run ``script --child <task json>`` with ``src`` importable; parse its RESULT line."""
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONWARNINGS"] = "ignore"
    env["PYTHONPATH"] = str(src) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [sys.executable, str(Path(script).resolve()), "--child", json.dumps(task)]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timeout after {timeout:.0f}s", "wall_s": time.perf_counter() - t0}
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("RESULT:"):
            r = json.loads(line[len("RESULT:") :])
            r["wall_s"] = time.perf_counter() - t0
            if stderr_on_failure and not r.get("ok"):
                r["stderr"] = p.stderr[-3000:]
            return r
    return {"ok": False, "error": f"child exited rc={p.returncode} without result", "stderr": p.stderr[-3000:]}
